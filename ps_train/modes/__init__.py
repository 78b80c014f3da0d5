"""The update modes, by name: ``mode=sync|async|ssp|hybrid``.

A mode is one object holding both sides of the update protocol and its config checks
(``ps_train.modes.base.Mode``): ``sync`` (``SyncMode``), ``async`` (``AsyncMode``, in
``asynchronous.py``: ``async`` is a Python keyword), ``ssp`` (``SspMode``) and ``hybrid``
(``HybridMode``: dense parameters in sync, embedding rows async). A new mode is
one module here, one line in ``MODES`` and ``ps_train/conf/mode/<name>.yaml``; nothing else
of ps_train names a mode. ``aggregation`` holds the update arithmetic they share.

Below the config: ``ps_train.config`` checks a run's mode through ``option_problems``,
``elastic_problems`` and ``run_problems``, so nothing here imports the rest of ps_train.
"""

from __future__ import annotations

from collections.abc import Mapping

from ps_train.modes.aggregation import AGGREGATES, STALENESS_RULES
from ps_train.modes.asynchronous import AsyncMode
from ps_train.modes.base import Mode, ModeOptions, RunConfig
from ps_train.modes.hybrid import HybridMode
from ps_train.modes.ssp import ClockedUpdate, SspMode
from ps_train.modes.sync import SyncMode

# The records a mode's answers carry over RPC (the safe serializer must be told of them).
ANSWER_RECORDS: tuple[type, ...] = (ClockedUpdate,)

__all__ = [
    "ANSWER_RECORDS",
    "MODES",
    "MODE_NAMES",
    "AGGREGATES",
    "STALENESS_RULES",
    "Mode",
    "make_mode",
    "option_problems",
    "elastic_problems",
    "run_problems",
]

MODES: dict[str, type[Mode]] = {mode.name: mode for mode in (SyncMode, AsyncMode, SspMode, HybridMode)}
MODE_NAMES = tuple(MODES)


def make_mode(run: RunConfig) -> Mode:
    """The mode object of a run (each process builds its own)."""
    if run.mode.name not in MODES:
        raise ValueError(f"mode.name: unknown mode {run.mode.name!r}; choose one of {list(MODE_NAMES)}")
    return MODES[run.mode.name](run)


def _users(option: str) -> str:
    return " and ".join(f"mode={name}" for name, mode in MODES.items() if option in mode.options)


def option_problems(options: ModeOptions, defaults: Mapping[str, object]) -> list[str]:
    """The ``mode`` group's problems: an unknown mode or rule, a bad value, and an option
    set for a mode that does not read it (it would silently do nothing). ``defaults``: every
    option but ``name``, and the value a mode that does not read it needs."""
    problems = []
    mode = MODES.get(options.name)
    if mode is None:
        problems.append(f"mode.name: unknown mode {options.name!r}; choose one of {list(MODE_NAMES)} (e.g. mode=ssp)")
    if options.aggregate not in AGGREGATES:
        problems.append(f"mode.aggregate: unknown rule {options.aggregate!r}; choose one of {list(AGGREGATES)}")
    if options.staleness_rule not in STALENESS_RULES:
        problems.append(
            f"mode.staleness_rule: unknown rule {options.staleness_rule!r}; choose one of {list(STALENESS_RULES)}"
        )
    if mode is None:
        return problems
    problems += mode.option_problems(options)
    for option, default in defaults.items():
        value = getattr(options, option)
        if option not in mode.options and value != default:
            problems.append(
                f"mode.{option}: only used by {_users(option)} (got {value} with mode={mode.name}"
                f"{mode.unused_reasons.get(option, '')})"
            )
    return problems


def elastic_problems(run: RunConfig) -> list[str]:
    """``cluster.elastic=true`` with a mode that needs every trainer it started."""
    mode = MODES.get(run.mode.name)
    if not run.cluster.elastic or mode is None or mode.not_elastic is None:
        return []
    able = " or ".join(f"mode={name}" for name, m in MODES.items() if m.not_elastic is None)
    return [f"cluster.elastic=true needs {able} (got mode={mode.name}): {mode.not_elastic}"]


def run_problems(run: RunConfig) -> list[str]:
    """The mode's problems with the other groups, once model, data and cluster fit each other."""
    mode = MODES.get(run.mode.name)
    return mode.run_problems(run) if mode is not None else []
