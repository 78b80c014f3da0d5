"""What ps_train's messages name under ``cluster.serializer=safe``.

Every function a role calls on another by RPC, and every class whose objects or records
travel, is marked ``@backend.called_by_name`` where it is defined, or here when its module
stays below ``backend`` (the modes); a receiver resolves a name only among the marked objects
its process has imported. ``register`` imports every module that holds some, so each role
knows all of them whichever roles it runs.
"""

from __future__ import annotations

import importlib

from ps_train import backend
from ps_train.modes.base import UpdateRequest

MODULES = (
    "ps_train.checkpoint.files",
    "ps_train.roles.server",
    "ps_train.roles.step",
    "ps_train.roles.trainer",
)


def register() -> None:
    """Import the modules whose RPC functions and classes mark themselves (before init_rpc)."""
    for module in MODULES:
        importlib.import_module(module)
    backend.called_by_name(UpdateRequest)  # a trainer's update call carries one
