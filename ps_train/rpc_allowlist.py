"""What ps_train's messages name under ``cluster.serializer=safe``.

Every function a role calls on another by RPC, and every class whose objects or records
travel, is marked ``@backend.called_by_name`` where it is defined, or here when its module
stays below ``backend`` (the modes); a receiver resolves a name only among the marked objects
its process has imported. ``register`` imports every module that holds some (ps_train's own,
and those the run's workload lists in ``Workload.rpc_modules``), so each role knows all of
them whichever roles it runs. tests/ps_train/test_safe_calls.py checks that every function
ps_train's source passes to ``rpc_sync`` / ``rpc_async`` / ``remote`` is among them.
"""

from __future__ import annotations

import importlib

from ps_train import backend
from ps_train.config import ModelConfig
from ps_train.modes import ANSWER_RECORDS
from ps_train.modes.base import UpdateRequest
from ps_train.workload import workload_for

MODULES = (
    "ps_train.checkpoint.files",
    "ps_train.elastic.membership",
    "ps_train.faults",
    "ps_train.observe.traces",
    "ps_train.roles.server",
    "ps_train.roles.step",
    "ps_train.roles.trainer",
)


def register(model: ModelConfig) -> None:
    """Import the modules whose RPC functions and classes mark themselves (before init_rpc):
    ps_train's, and those of the workload that trains ``model`` (the run's ``cfg.model``)."""
    for module in MODULES:
        importlib.import_module(module)
    workload = workload_for(model)
    for module in workload.rpc_modules:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ImportError(
                f"workload {workload.name!r} ({workload.module}): cannot import {module!r}, named in its "
                f"Workload.rpc_modules: {e}; list only importable modules there"
            ) from e
    backend.called_by_name(UpdateRequest)  # a trainer's update call carries one
    for record in ANSWER_RECORDS:  # e.g. ssp: ps0's answer to an update that rode on the backward
        backend.called_by_name(record)
