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
    """Runs on rank 0: rounds of 'everyone arrives, then everyone gets the round's answer'.
    The answer is what the round's callers use (``_answer``): everyone's payload for
    ``all_gather``; the verdict for a quiescence round; nothing for a barrier or the
    shutdown round. Rank 0 sends it to every member, and every member decodes it: an answer
    of every member's payload costs rank 0 members x members to encode."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rounds: dict[Any, _Round] = {}
        self.agent: Agent | None = None
        # The last quiescence round's counts, by its members: (round number, counts).
        self.quiesced: dict[Any, tuple[int, tuple[tuple[int, _CallCounts], ...]]] = {}

    def start(self, agent: Agent) -> None:
        self.agent = agent
        self.rounds = {}
        self.quiesced = {}
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
            try:
                answer = self._answer(key, r.payloads)
            except BaseException as e:  # noqa: BLE001 - e.g. a malformed payload: every member hears it
                r.future.set_exception(e)
            else:
                r.future.set_result(answer)
        return r.future

    def _answer(self, key: Any, payloads: dict[int, Any]) -> Any:
        tag, n, members = key
        if tag == "quiesce":
            return self._quiescence(n, members, payloads)
        if tag in _NO_ANSWER:
            return None
        return dict(payloads)

    def _quiescence(self, n: int, members: Any, payloads: dict[int, Any]) -> _Verdict:
        """Termination detection over every member's call counts (see ``wait_quiescent``):
        work is over when no member has a call pending (sent == done) or a request
        unanswered (received == answered), every request sent has arrived (a timed-out call
        may still be on its way), and the counts did not move since the previous round.
        Requests from connections that are not members' calls (raw clients) count as
        received only, so "arrived" is received >= sent rather than equality."""
        counts = tuple(sorted(payloads.items()))
        got: list[_CallCounts] = list(payloads.values())
        idle = all(c.sent == c.done and c.received == c.answered for c in got) and sum(c.received for c in got) >= sum(
            c.sent for c in got
        )
        with self.lock:
            previous = self.quiesced.get(members)
            self.quiesced[members] = (n, counts)
        unchanged = previous is not None and previous[0] == n - 1 and previous[1] == counts
        return _Verdict(idle and unchanged, idle)


# Rounds whose callers only wait for everyone to arrive: the answer is None.
_NO_ANSWER = frozenset({"barrier", "shutdown"})

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
) -> Any:
    """Arrive at the next round ``tag`` and return its answer once every member has arrived
    (``_Coordinator._answer``): every member's payload by rank for ``all_gather``. ``whole``:
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
        return fut.wait()
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


class _Verdict(NamedTuple):
    """A quiescence round's answer: whether the work is over, and whether every member was
    idle (if not, work is still running somewhere)."""

    over: bool
    idle: bool


def wait_quiescent(agent: Agent, timeout: float, whole: float | None = None) -> None:
    """Termination detection: every worker reports (sent, done, received, answered) call
    counts, in rounds, until the coordinator finds every worker idle with counts that did
    not move between two rounds (``_Coordinator._quiescence``). ``whole``: the shutdown's
    own timeout, of which ``timeout`` is what is left (the error names the one the user gave)."""
    deadline = time.monotonic() + timeout if timeout > 0 else None
    while True:
        agent.pending.wait_idle(deadline)
        calls, requests = agent.pending, agent.dispatch
        mine = _CallCounts(calls.n_sent, calls.n_done, requests.n_received, requests.n_answered)
        left = timeout if deadline is None else max(deadline - time.monotonic(), 1e-3)
        verdict: _Verdict = gather_round("quiesce", mine, left, whole=whole)
        if verdict.over:
            return
        if not verdict.idle:
            time.sleep(0.005)  # work is still running somewhere; let it progress before re-polling
        if deadline is not None and time.monotonic() > deadline:
            said = timeout if whole is None else whole
            raise RpcTimeoutError(f"shutdown timed out after {said:g} s: workers still have calls in flight")


# Barrier arrivals at rank 0: called by name under serializer='safe'.
allowlist.internal(_coord_arrive, _CallCounts, _Verdict)
