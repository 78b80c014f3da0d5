"""Fault injection for tests: make a chosen role die, freeze or wait at a chosen step.

``PS_TRAIN_FAULT`` in the launcher's environment (every role inherits it) holds one or more
comma-separated faults ``<role>@<step>[:<action>][#<attempt>]``:

- ``<role>@<step>``: that role SIGKILLs itself -- a trainer right after finishing step
  ``<step>``, a server right after applying its ``<step>``-th update; ``<role>@+<n>``: after
  its ``<n>``-th step or update in this process (a trainer that joined a running job starts at
  a later step); not in a process that replaces a dead one (``PS_TRAIN_REPLACED`` set by the
  launcher that started it), which would otherwise die at the same point of its own steps
  again and again;
- ``:freeze`` instead SIGSTOPs it: the process stays alive but does nothing, not even its
  heartbeat, as a hung machine or a stopped VM would (``:kill`` is the default);
- ``:stall`` (a trainer) stops training after the step and waits for the rest of the process's
  life, alive and beating (not a failure the launcher sees): a trainer that lags far behind
  the others (async/ssp) until the run fails for another reason and is restarted;
- at a point inside a step instead of after it (each SIGKILLs the role there):
  ``:partial`` (a trainer) sends its step-``<step>`` update to ps0 only, waits until ps0
  applied it, and dies before the other servers get it: a step that reached some servers and
  not others; ``:checkpoint`` (trainer0) dies while writing the step's checkpoint, once the
  servers wrote their files and before the manifest that completes it; ``:eval`` (trainer0)
  dies in the middle of the step's evaluation, after its first batch; ``:restore`` (a server)
  dies in the middle of a restarted run's recovery: it loaded the step-``<step>`` checkpoint
  and met the other roles, which are starting from it, and it has applied no update yet;
- ``:hold_waiting=<name>``, ``:hold_steps=<name>*<n>``, ``:hold_leave=<name>`` (a trainer):
  after the step it waits, its heartbeats going on, until ps0 sees the event: trainer
  ``<name>`` waiting for an epoch that takes it (a joiner that asked for its first one), ps0
  having applied ``<n>`` of trainer ``<name>``'s updates, or the worker ``<name>`` gone from
  the group (asked every 20 ms; the first needs an elastic run). Then it trains on. So an
  elastic test's job lasts exactly until what the test waits for has happened (a joiner came,
  trained, froze) instead of for a fixed, long number of steps. A hold gives up after
  ``HOLD_TIMEOUT`` s with a warning, and the test's own checks then fail;
- ``#<attempt>`` limits the fault to one attempt of a restarted run (0 = the first; see
  ``cluster.max_restarts``); without it the fault fires in every attempt, so a run that
  restarts from a checkpoint before that step meets it again.

E.g. ``ps1@5#0`` kills ps1 once, ``ps1@5:freeze#0,trainer1@7#1`` freezes ps1 in the first
attempt and kills trainer1 in the second, ``trainer0@1:hold_waiting=trainer2,trainer0@40:hold_steps=trainer2*1``
keeps trainer0 at step 1 until a joiner named trainer2 waits for its first epoch, and at step
40 until ps0 applied one of its updates. So tests can check how the launcher reports a
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
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from ps_train import backend

__all__ = [
    "FAULT_ENV",
    "ATTEMPT_ENV",
    "REPLACED_ENV",
    "Fault",
    "current_attempt",
    "parse_faults",
    "maybe_inject_fault",
    "fault_at",
    "die",
    "HOLD_TIMEOUT",
]

log = logging.getLogger("ps_train")

FAULT_ENV = "PS_TRAIN_FAULT"
ATTEMPT_ENV = "PS_TRAIN_ATTEMPT"
REPLACED_ENV = "PS_TRAIN_REPLACED"  # "1" in a trainer started in place of a dead one
_ACTIONS = {
    "kill": signal.SIGKILL,
    "freeze": signal.SIGSTOP,
    "partial": signal.SIGKILL,
    "checkpoint": signal.SIGKILL,
    "eval": signal.SIGKILL,
    "restore": signal.SIGKILL,
}
_HOLDS = ("hold_waiting", "hold_steps", "hold_leave")  # wait instead of dying (``_hold``)
HOLD_TIMEOUT = 120.0  # s a hold waits at most: longer than a joiner's start on a loaded machine
_HOLD_POLL = 0.02  # s between looks at ps0 (``_ps0_view``)
# Where in a step each action fires: "step" after it (maybe_inject_fault), the others where the
# role asks (fault_at): "partial" in the trainer's update, "checkpoint" and "eval" in trainer0's.
_POINTS = {
    "kill": "step",
    "freeze": "step",
    "partial": "partial",
    "checkpoint": "checkpoint",
    "eval": "eval",
    "restore": "restore",
    **{hold: "step" for hold in _HOLDS},
    "stall": "step",
}
_SPEC = re.compile(
    r"(?P<role>[A-Za-z0-9_]+)@(?P<rel>\+?)(?P<step>\d+)"
    r"(?::(?P<action>[a-z_]+)(?:=(?P<peer>[A-Za-z0-9_]+)(?:\*(?P<count>\d+))?)?)?"
    r"(?:#(?P<attempt>\d+))?"
)
_FORMAT = (
    "<role>@[+]<step>[:kill|:freeze|:stall|:partial|:checkpoint|:eval|:restore"
    "|:hold_waiting=<name>|:hold_steps=<name>*<n>|:hold_leave=<name>][#<attempt>]"
)


class Fault(NamedTuple):
    role: str
    step: int
    action: (
        str  # kill | freeze | stall | partial | checkpoint | eval | restore | hold_waiting | hold_steps | hold_leave
    )
    attempt: int | None  # None: every attempt
    relative: bool = False  # ``step`` counts this process's steps (1 = its first), not the run's
    peer: str | None = None  # a hold's worker: the one it waits for
    updates: int = 0  # ``:hold_steps``: how many of the peer's updates ps0 must have applied


_first_step: dict[str, int] = {}  # role -> the first step this process reported for it


def parse_faults(spec: str) -> list[Fault]:
    """``"ps1@5:freeze#0,trainer1@7"`` -> faults; a malformed entry raises ``ValueError``."""
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        m = _SPEC.fullmatch(part)
        action = (m.group("action") or "kill") if m else ""
        peer, count = (m.group("peer"), m.group("count")) if m else (None, None)
        # A hold names its peer (and :hold_steps a count); nothing else takes either.
        shape_ok = (peer is not None) == (action in _HOLDS) and (count is not None) == (action == "hold_steps")
        if m is None or action not in _POINTS or not shape_ok:
            raise ValueError(
                f"{FAULT_ENV}={spec!r}: {part!r} is not {_FORMAT} (e.g. ps1@5, trainer0@3:freeze#0, "
                "trainer2@+2:freeze, trainer1@5:partial, trainer1@3:stall or trainer0@40:hold_steps=trainer2*1)"
            )
        attempt = m.group("attempt")
        faults.append(
            Fault(
                m.group("role"),
                int(m.group("step")),
                action,
                None if attempt is None else int(attempt),
                relative=bool(m.group("rel")),
                peer=peer,
                updates=0 if count is None else int(count),
            )
        )
    return faults


def current_attempt() -> int:
    """Which attempt of a restarted run this process belongs to (0 = the first)."""
    raw = os.environ.get(ATTEMPT_ENV) or os.environ.get("TORCHELASTIC_RESTART_COUNT") or "0"
    return int(raw) if raw.isdigit() else 0


def _armed(role: str, step: int, point: str) -> Fault | None:
    """The fault ``PS_TRAIN_FAULT`` sets for ``role`` at ``step``'s ``point`` in this attempt, if any."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    attempt = current_attempt()
    # This process's n-th step of the role; only steps count (``restore`` comes before any).
    first = _first_step.setdefault(role, step) if point == "step" else _first_step.get(role, step)
    nth = step - first + 1
    for fault in parse_faults(spec):
        if fault.relative and os.environ.get(REPLACED_ENV):
            continue
        if (
            fault.role == role
            and (nth if fault.relative else step) == fault.step
            and fault.attempt in (None, attempt)
            and _POINTS[fault.action] == point
        ):
            return fault
    return None


def maybe_inject_fault(role: str, step: int, ps0: Any = None) -> None:
    """Kill, stop or stall this process if ``PS_TRAIN_FAULT`` names ``role`` at ``step`` in
    this attempt (``:kill``, ``:freeze`` or ``:stall``, after the step), or wait there
    (``:hold_*``); else do nothing. ``ps0``: a trainer's RRef to ps0's server (what a hold asks)."""
    fault = _armed(role, step, "step")
    if fault is None:
        return
    if fault.action in _HOLDS:
        _hold(fault, role, step, ps0)
        return
    if fault.action == "stall":
        log.warning(
            "%s=%s: test fault injection, stalling %s (pid %d) after step %d until the run stops",
            FAULT_ENV,
            os.environ.get(FAULT_ENV),
            role,
            os.getpid(),
            step,
        )
        threading.Event().wait()  # for ever: the launcher stops the process with the others
    die(role, step, "killing" if fault.action == "kill" else "freezing", _ACTIONS[fault.action])


@backend.called_by_name  # the answer of ``_ps0_view``
class Ps0View(NamedTuple):
    """What a hold waits for, as ps0 sees it."""

    members: frozenset[str]  # the workers in its group
    waiting: frozenset[str]  # elastic: the trainers waiting for an epoch that takes them
    updates: dict[str, int]  # updates it applied per trainer name


@backend.called_by_name
def _ps0_view(server: Any) -> Ps0View:
    """Run on ps0 (``server``: the RRef to its ParameterServer, owned there)."""
    ps = server.local_value()
    agent = backend.rpc()._get_current_rpc_agent()
    waiting: frozenset[str] = frozenset()
    if ps.membership is not None:
        with ps.membership.cond:
            waiting = frozenset(f"trainer{t}" for t, _ in ps.membership.waiting)
    return Ps0View(frozenset(w.name for w in agent.get_worker_infos()), waiting, dict(ps.stats()["updates_by_trainer"]))


def _hold(fault: Fault, role: str, step: int, ps0: Any) -> None:
    """Wait until ps0 sees ``fault``'s event or ``HOLD_TIMEOUT`` passed."""
    peer = fault.peer or ""
    what = {
        "hold_waiting": f"{peer} waits for an epoch",
        "hold_steps": f"ps0 applied {fault.updates} update(s) of {peer}",
        "hold_leave": f"{peer} left the group",
    }[fault.action]
    if ps0 is None:
        raise ValueError(f"{FAULT_ENV}: {role} cannot hold until {what}: only a trainer knows ps0")
    log.warning(
        "%s=%s: test fault injection, holding %s at step %d until %s",
        FAULT_ENV,
        os.environ.get(FAULT_ENV),
        role,
        step,
        what,
    )
    happened: Callable[[Ps0View], bool] = {
        "hold_waiting": lambda v: peer in v.waiting,
        "hold_steps": lambda v: v.updates.get(peer, 0) >= fault.updates,
        "hold_leave": lambda v: peer not in v.members,
    }[fault.action]
    rpc = backend.rpc()
    deadline = time.monotonic() + HOLD_TIMEOUT
    while not happened(rpc.rpc_sync(ps0.owner(), _ps0_view, args=(ps0,))):
        if time.monotonic() >= deadline:
            log.warning("%s: gave up holding %s after %g s: not seen that %s", FAULT_ENV, role, HOLD_TIMEOUT, what)
            return
        time.sleep(_HOLD_POLL)  # ps0 sends no event for these: ask again
    log.warning("%s: %s; %s trains on", FAULT_ENV, what, role)


def fault_at(role: str, step: int, point: str) -> bool:
    """Whether ``PS_TRAIN_FAULT`` asks ``role`` to die at ``point`` (``partial``, ``checkpoint``,
    ``eval``, ``restore``) of step ``step`` in this attempt; the role then does what the point needs and
    calls ``die``."""
    return _armed(role, step, point) is not None


def die(role: str, step: int, verb: str = "killing", sig: signal.Signals = signal.SIGKILL) -> None:
    """Log the test fault, then ``sig`` this process."""
    log.warning(
        "%s=%s: test fault injection, %s %s (pid %d) at step %d at unix time %.3f",
        FAULT_ENV,
        os.environ.get(FAULT_ENV),
        verb,
        role,
        os.getpid(),
        step,
        time.time(),
    )
    # Neither signal runs a handler: flush the log first so the test can read the line.
    for h in logging.getLogger().handlers:
        h.flush()
    os.kill(os.getpid(), sig)
