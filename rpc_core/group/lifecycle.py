"""A worker's life cycle around the agent: init/shutdown hooks, barriers, quiescence.

Layers above the agent plug into ``init_rpc`` and ``shutdown`` through the hook lists here,
so the facade that runs them (``api``) need not know them. Graceful shutdown and
``_barrier``/``_all_gather`` run through a coordinator on rank 0, which also notices dead
workers (their connection to rank 0 drops), so a barrier with a dead peer fails fast and
names the peer instead of hanging.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ..agent.agent import Agent, current_agent
from ..errors import RpcTimeoutError, WorkerUnavailableError
from ..functions import async_execution
from ..options import DEFAULT_SHUTDOWN_TIMEOUT, UNSET_RPC_TIMEOUT
from ..protocol import allowlist, wire

# Called with each new Agent, before it starts (distributed autograd installs its middleware here).
init_hooks: list[Callable[[Agent], None]] = []
# Called as a worker tears down, before its agent closes.
shutdown_hooks: list[Callable[[], None]] = []
# Called once every worker has entered graceful shutdown, before the in-flight work drains
# (e.g. distributed autograd sends its deferred context releases).
pre_shutdown_hooks: list[Callable[[], None]] = []


@dataclass
class _Round:
    """One round on the coordinator: who arrived with what, and the future they all wait on."""

    payloads: dict[int, Any] = field(default_factory=dict)
    future: torch.futures.Future[Any] = field(default_factory=torch.futures.Future)


class _Coordinator:
    """Runs on rank 0: rounds of 'everyone arrives, everyone gets everyone's payload'."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rounds: dict[Any, _Round] = {}
        self.agent: Agent | None = None

    def start(self, agent: Agent) -> None:
        self.agent = agent
        self.rounds = {}
        agent.connections.on_peer_lost.append(self.peer_lost)
        # A member that froze or became unreachable must not hold a round open forever: while
        # one is open, the agent watches every peer (heartbeats) and reports a silent one.
        agent.heartbeats.on_peer_unreachable.append(self.peer_lost)
        agent.heartbeats.liveness_wanted.append(lambda: bool(self.rounds))

    def peer_lost(self, rank: int, reason: str) -> None:
        with self.lock:
            rounds, self.rounds = self.rounds, {}
        worker = self.agent.roster.name_of(rank) if self.agent is not None else None
        for r in rounds.values():
            if not r.future.done():
                r.future.set_exception(WorkerUnavailableError(reason, worker=worker))

    def arrive(self, key: Any, rank: int, payload: Any, expected: int) -> torch.futures.Future[Any]:
        agent = self.agent
        assert agent is not None
        if agent.roster.dead:
            f: torch.futures.Future[Any] = torch.futures.Future()
            rank, reason = next(iter(agent.roster.dead.items()))
            f.set_exception(WorkerUnavailableError(reason, worker=agent.roster.name_of(rank)))
            return f
        with self.lock:
            r = self.rounds.get(key)
            if r is None:
                r = self.rounds[key] = _Round()
            r.payloads[rank] = payload
            complete = len(r.payloads) == expected
            if complete:
                del self.rounds[key]
        if complete:
            r.future.set_result(dict(r.payloads))
        return r.future


_coordinator = _Coordinator()


def start_coordinator(agent: Agent) -> None:
    """On rank 0, at init: serve the rounds of barriers and shutdown."""
    _coordinator.start(agent)


@async_execution
def _coord_arrive(key: Any, rank: int, payload: Any, expected: int) -> torch.futures.Future[Any]:
    return _coordinator.arrive(key, rank, payload, expected)


_round_ids: dict[str, int] = {}


def gather_round(
    tag: str, payload: Any, timeout: float, worker_names: list[str] | None = None, whole: float | None = None
) -> dict[int, Any]:
    """Arrive at the next round ``tag`` and return every member's payload by rank. ``whole``:
    the caller's own timeout when ``timeout`` is what is left of it (the error names the one
    the user gave, not the remainder)."""
    agent = current_agent()
    n = _round_ids.get(tag, 0)
    _round_ids[tag] = n + 1
    members = len(agent.roster.workers) if worker_names is None else len(worker_names)
    key = (tag, n, tuple(sorted(worker_names)) if worker_names else None)
    fut = agent.send_request(
        0,
        _coord_arrive,
        (key, agent.me.id, payload, members),
        {},
        timeout=timeout if timeout > 0 else 0,
        flags=wire.CONTROL,
    )
    try:
        payloads: dict[int, Any] = fut.wait()
        return payloads
    except RpcTimeoutError:
        said = timeout if whole is None else whole
        # torch's words after ours ("timed out in _all_gather after 0.10 seconds" on its
        # leader, "RPC ran for more than" on the others), which programs match.
        raise RpcTimeoutError(
            f"{tag} on {agent.me.name!r} timed out after {said:g} s waiting for the other workers "
            f"(timed out in _{tag} after {said:.2f} seconds: the RPC ran for more than its timeout)"
        ) from None


def reset_rounds() -> None:
    """Forget the round numbers (after shutdown: a new group starts counting afresh)."""
    _round_ids.clear()


def all_gather(obj: Any, worker_names: list[str] | None = None, timeout: float = UNSET_RPC_TIMEOUT) -> dict[str, Any]:
    agent = current_agent()
    t = agent.default_timeout if timeout < 0 else timeout
    got = gather_round("all_gather", obj, t, worker_names)
    return {agent.roster.workers[r].name: v for r, v in got.items()}


def barrier(worker_names: list[str]) -> None:
    gather_round("barrier", None, 0, list(worker_names))


def wait_all_workers(timeout: float = DEFAULT_SHUTDOWN_TIMEOUT, whole: float | None = None) -> None:
    gather_round("shutdown", None, timeout, whole=whole)


def answer_requests(agent: Agent, deadline: float | None, arriving: bool = False) -> None:
    """Wait (until ``deadline``; None: no limit) until this worker has answered as many
    requests as it had accepted when this began (``arriving``: as it has accepted, those
    arriving meanwhile included), then write every answer still queued: a worker that
    leaves the group or closes first delivers what it owes. Requests that keep arriving
    never hold up the first kind."""
    dispatch = agent.dispatch
    accepted = dispatch.n_received
    while dispatch.n_answered < (dispatch.n_received if arriving else accepted) and (
        deadline is None or time.monotonic() < deadline
    ):
        time.sleep(0.005)  # the requests are running on other threads; let them finish
    agent.connections.flush_queued()


class _CallCounts(NamedTuple):
    """One worker's call counters, as a quiescence round compares them."""

    sent: int
    done: int
    received: int
    answered: int


def wait_quiescent(agent: Agent, timeout: float, whole: float | None = None) -> None:
    """Termination detection: every worker reports (sent, done, received, answered) call
    counts; work is over when no worker has a call pending (sent == done) or a request
    unanswered (received == answered), every request sent has arrived (a timed-out call may
    still be on its way), and the counts did not move between two rounds. Requests from
    connections that are not workers' calls (raw clients) count as received only, so
    "arrived" is received >= sent rather than equality. ``whole``: the shutdown's own timeout,
    of which ``timeout`` is what is left (the error names the one the user gave)."""
    deadline = time.monotonic() + timeout if timeout > 0 else None
    previous = None
    while True:
        agent.pending.wait_idle(deadline)
        calls, requests = agent.pending, agent.dispatch
        mine = _CallCounts(calls.n_sent, calls.n_done, requests.n_received, requests.n_answered)
        left = timeout if deadline is None else max(deadline - time.monotonic(), 1e-3)
        got: dict[int, _CallCounts] = gather_round("quiesce", mine, left, whole=whole)
        counts = tuple(sorted(got.items()))
        idle = all(c.sent == c.done and c.received == c.answered for c in got.values()) and sum(
            c.received for c in got.values()
        ) >= sum(c.sent for c in got.values())
        if idle and counts == previous:
            return
        previous = counts
        if not idle:
            time.sleep(0.005)  # work is still running somewhere; let it progress before re-polling
        if deadline is not None and time.monotonic() > deadline:
            said = timeout if whole is None else whole
            raise RpcTimeoutError(f"shutdown timed out after {said:g} s: workers still have calls in flight")


# Barrier arrivals at rank 0: called by name under serializer='safe'.
allowlist.internal(_coord_arrive, _CallCounts)
