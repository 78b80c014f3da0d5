"""Workloads: what ps_train trains, as plug-ins.

A ``Workload`` names everything that differs between, say, an image classifier and a
click-through-rate model: the model's dense stages (what the servers host and trainers call
in forward order), the trainer class (its data, its step's loss, its evaluation and
metrics), a check of the data files before any process starts, and, for a model with
embedding tables, the servers' table service (``ps_train.table_service.TablePart``). The
launcher, the roles and the modes never import a workload: they ask this registry for the
run's (``workload_for(cfg.model)``), keyed by ``model.name``. A workload's functions take the
config groups they read (the model's, the data's, a ``TableSettings``), never the whole config.

Each workload registers itself when its module is imported (``register_workload``); the
built-in ones are ``ps_train.workloads.vision.workload`` and ``ps_train.workloads.ctr.workload``,
imported by ``ps_train.app``. A workload of your own is one module that registers itself and is named in
``PS_TRAIN_PLUGINS`` (comma-separated modules), which ``python -m ps_train`` imports before it
composes the config: docs/extending.md walks through one.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ps_train.config import DataConfig, ModelConfig, register_model_schema

if TYPE_CHECKING:
    from torch import nn

    from ps_train.table_service import TablePart, TableSettings

__all__ = [
    "DatasetNotFoundError",
    "StagePlan",
    "Workload",
    "UnknownWorkloadError",
    "register_workload",
    "workload_for",
    "registered_workloads",
    "import_plugins",
    "PLUGINS_ENV",
]

PLUGINS_ENV = "PS_TRAIN_PLUGINS"


class DatasetNotFoundError(FileNotFoundError):
    """A workload's data files are missing (or corrupt); the message says how to get them."""


class UnknownWorkloadError(LookupError):
    """No registered workload trains the configured model."""


@dataclass(frozen=True)
class StagePlan:
    """A model's dense stages, in forward order, and how to place them on the servers."""

    stages: list[nn.Module]  # [stage 0, stage 1, ...]: stage k's output feeds stage k + 1
    # Consecutive stages on one server merge into one shard (one call) unless the trainer
    # computes something between them (DLRM's interaction between its two MLPs).
    merge: bool = True
    # At most this many servers host stages (None: every server); the others hold only tables.
    max_servers: int | None = None


@dataclass(frozen=True)
class Workload:
    """What one kind of model needs from ps_train; see the module docstring."""

    name: str
    # The ``model.name`` values (Hydra's model group choices) this workload trains.
    models: tuple[str, ...]
    # The seeded dense stages every process builds identically from the model's and the data's
    # configs and the run's ``seed``: ``stages(model, data, seed)``.
    stages: Callable[[ModelConfig, DataConfig, int], StagePlan]
    # The trainer class: a ``ps_train.roles.trainer.Trainer`` with the workload's ``load``,
    # ``step_loss`` and ``evaluate`` (imported lazily: it pulls in the roles).
    trainer: Callable[[], type[Any]]
    # Raises OSError/ValueError when the data cannot be trained on; returns the number of
    # training samples when only the files know it (None: the config knows).
    check_data: Callable[[DataConfig], int | None]
    # Server ``rank``'s part of the model's embedding tables (None: the model has none):
    # ``table_service(model, data, settings, rank, run_dir)``; the run folder is where it may
    # keep files (a disk tier's store).
    table_service: Callable[[ModelConfig, DataConfig, TableSettings, int, str], TablePart | None] = (
        lambda model, data, settings, rank, run_dir: None
    )
    # Model config schemas (``model.name`` -> dataclass) this workload adds to Hydra's model group.
    model_schemas: tuple[tuple[str, type[ModelConfig]], ...] = ()
    # The module that registered it: role processes import it (the launcher has imported it).
    module: str = ""
    # Heavy modules its roles use (its trainer, its table service), which the launcher's
    # fork server imports once so that forked roles start without importing them.
    preload: tuple[str, ...] = ()
    # Heavy modules only some data configs use (a dataset's loader): preloaded for those runs only.
    preload_for: Callable[[DataConfig], tuple[str, ...]] = lambda data: ()
    # Work every trainer would repeat, done once by the launcher's fork server before it forks
    # the roles (each finds the result in its copy): e.g. drawing a computed data set, which
    # its trainer's ``load`` then takes instead of drawing it again. It must leave the result
    # what each trainer would have computed itself (spawned roles do compute it themselves).
    prepare: Callable[[DataConfig], None] = lambda data: None
    # The modules that define the functions its roles call on each other by RPC (``rpc_sync``
    # / ``rpc_async`` / ``remote`` of a function, not an RRef's methods) and the record classes
    # those calls carry, each marked ``@ps_train.backend.called_by_name``. Under
    # ``cluster.serializer=safe`` every role imports them before ``init_rpc``
    # (``ps_train.rpc_allowlist``): a peer may name only what they marked.
    rpc_modules: tuple[str, ...] = ()


_REGISTRY: dict[str, Workload] = {}


def register_workload(workload: Workload) -> Workload:
    """Add ``workload`` (and its model schemas) to the registry; registering the same name
    again replaces it (a reloaded module). Two workloads may not claim one model name."""
    for model in workload.models:
        for other in _REGISTRY.values():
            if other.name != workload.name and model in other.models:
                raise ValueError(
                    f"workload {workload.name!r} claims model.name={model!r}, which workload "
                    f"{other.name!r} ({other.module}) already trains; give the model another name"
                )
    for name, schema in workload.model_schemas:
        register_model_schema(name, schema)
    _REGISTRY[workload.name] = workload
    return workload


def registered_workloads() -> list[Workload]:
    return list(_REGISTRY.values())


def workload_for(model: ModelConfig) -> Workload:
    """The registered workload that trains ``model`` (a run's ``cfg.model``)."""
    for w in _REGISTRY.values():
        if model.name in w.models:
            return w
    known = sorted(m for w in _REGISTRY.values() for m in w.models)
    raise UnknownWorkloadError(
        f"model.name={model.name!r}: no registered workload trains it (known: {known}); a workload of "
        f"your own must be imported first: name its module in {PLUGINS_ENV} (docs/extending.md)"
    )


def import_plugins(modules: Iterable[str] | None = None) -> list[str]:
    """Import workload modules so that they register: ``modules``, or those named in
    ``PS_TRAIN_PLUGINS``. Returns the modules imported."""
    if modules is None:
        modules = [m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(",") if m.strip()]
    done = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ImportError(f"{PLUGINS_ENV}: cannot import workload module {name!r}: {e}") from e
        done.append(name)
    return done
