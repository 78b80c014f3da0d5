"""Fault injection for tests: make a chosen role die or freeze at a chosen step.

``PS_TRAIN_FAULT`` in the launcher's environment (every role inherits it) holds one or more
comma-separated faults ``<role>@<step>[:<action>][#<attempt>]``:

- ``<role>@<step>``: that role SIGKILLs itself -- a trainer right after finishing step
  ``<step>``, a server right after applying its ``<step>``-th update; ``<role>@+<n>``: after
  its ``<n>``-th step or update in this process (a trainer that joined a running job or
  replaces a dead one starts at a later step);
- ``:freeze`` instead SIGSTOPs it: the process stays alive but does nothing, not even its
  heartbeat, as a hung machine or a stopped VM would (``:kill`` is the default);
- ``#<attempt>`` limits the fault to one attempt of a restarted run (0 = the first; see
  ``cluster.max_restarts``); without it the fault fires in every attempt, so a run that
  restarts from a checkpoint before that step meets it again.

E.g. ``ps1@5#0`` kills ps1 once, ``ps1@5:freeze#0,trainer1@7#1`` freezes ps1 in the first
attempt and kills trainer1 in the second. So tests can check how the launcher reports a
failed role, restarts the run, and that resuming from the last checkpoint works. Never set
it in real runs.

The attempt a process belongs to is ``PS_TRAIN_ATTEMPT`` (set by the local launcher) or
torchrun's ``TORCHELASTIC_RESTART_COUNT``. This module lives apart from the launcher so
that the server and trainer, which call the hook, do not import the launcher that starts them.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from typing import NamedTuple

__all__ = ["FAULT_ENV", "ATTEMPT_ENV", "Fault", "current_attempt", "parse_faults", "maybe_inject_fault"]

log = logging.getLogger("ps_train")

FAULT_ENV = "PS_TRAIN_FAULT"
ATTEMPT_ENV = "PS_TRAIN_ATTEMPT"
_ACTIONS = {"kill": signal.SIGKILL, "freeze": signal.SIGSTOP}
_SPEC = re.compile(
    r"(?P<role>[A-Za-z0-9_]+)@(?P<rel>\+?)(?P<step>\d+)(?::(?P<action>[a-z]+))?"
    r"(?:#(?P<attempt>\d+))?"
)


class Fault(NamedTuple):
    role: str
    step: int
    action: str  # kill | freeze
    attempt: int | None  # None: every attempt
    relative: bool = False  # ``step`` counts this process's steps (1 = its first), not the run's


_first_step: dict[str, int] = {}  # role -> the first step this process reported for it


def parse_faults(spec: str) -> list[Fault]:
    """``"ps1@5:freeze#0,trainer1@7"`` -> faults; a malformed entry raises ``ValueError``."""
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        m = _SPEC.fullmatch(part)
        action = (m.group("action") or "kill") if m else ""
        if m is None or action not in _ACTIONS:
            raise ValueError(
                f"{FAULT_ENV}={spec!r}: {part!r} is not <role>@[+]<step>[:kill|:freeze][#<attempt>] "
                "(e.g. ps1@5, trainer0@3:freeze#0 or trainer2@+2:freeze)"
            )
        attempt = m.group("attempt")
        faults.append(
            Fault(
                m.group("role"),
                int(m.group("step")),
                action,
                None if attempt is None else int(attempt),
                relative=bool(m.group("rel")),
            )
        )
    return faults


def current_attempt() -> int:
    """Which attempt of a restarted run this process belongs to (0 = the first)."""
    raw = os.environ.get(ATTEMPT_ENV) or os.environ.get("TORCHELASTIC_RESTART_COUNT") or "0"
    return int(raw) if raw.isdigit() else 0


def maybe_inject_fault(role: str, step: int) -> None:
    """Kill or stop this process if ``PS_TRAIN_FAULT`` names ``role`` at ``step`` in this
    attempt; else do nothing."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    attempt = current_attempt()
    nth = step - _first_step.setdefault(role, step) + 1  # this process's n-th step of the role
    for fault in parse_faults(spec):
        if fault.role == role and (nth if fault.relative else step) == fault.step and fault.attempt in (None, attempt):
            verb = "killing" if fault.action == "kill" else "freezing"
            log.warning(
                "%s=%s: test fault injection, %s %s (pid %d) at step %d at unix time %.3f",
                FAULT_ENV,
                spec,
                verb,
                role,
                os.getpid(),
                step,
                time.time(),
            )
            # Neither signal runs a handler: flush the log first so the test can read the line.
            for h in logging.getLogger().handlers:
                h.flush()
            os.kill(os.getpid(), _ACTIONS[fault.action])
            return
