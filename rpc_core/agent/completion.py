"""Calls this worker made: their records while unanswered, and how each ends (answered,
failed, timed out).

``PendingCalls`` is a part of ``agent.Agent``: the agent files each call it sends in its
table (``pending``, shared with the timer) and counts it (``n_sent``); answers come to
``on_answer`` straight from the connection that read them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ..errors import RpcError, RpcTimeoutError
from ..protocol import wire
from ..protocol.serialization import decode_head, deserialize
from .early_exit import torch_collect_all
from .futures import RpcFuture, rebuild_exception
from .middleware import Middleware, incoming_hook
from .outbound import Outbound
from .pool import ElasticPool
from .roster import Roster

# torch.futures.Future.set_result is a Python wrapper around this: one frame less per answer.
_set_result = torch._C.Future.set_result


class Pending(NamedTuple):
    """An unanswered call, under its msg_id in ``PendingCalls.pending``. Made once per call, with
    ``new_pending(Pending, (fields...))``: NamedTuple's own constructor is a Python-level
    function (a quarter µs per call), tuple.__new__ is not."""

    future: RpcFuture
    dst: int  # destination rank
    call_extras: dict[str, Any]  # what response middleware gets along with the answer's extras
    timeout: float  # s; 0: none
    flags: int  # wire flags of the request (CONTROL calls are not user work)
    link: Outbound | None  # who reads the connection's answers (None for calls to self)
    unattended: bool  # nobody waits on the future yet: the background reader reads its answer


new_pending = tuple.__new__


class PendingCalls:
    """The pending-call table and the ways a call ends. Uses the roster to name peers in
    errors, the pool to run the callbacks of completed futures, and the middleware (the
    agent's list, shared) on every answer's extras and tensors."""

    def __init__(self, roster: Roster, pool: ElasticPool, middleware: list[Middleware]) -> None:
        self._roster = roster
        self._pool = pool
        self._middleware = middleware
        self.pending: dict[int, Pending] = {}  # msg_id -> the unanswered call
        # For graceful shutdown's quiescence check (user calls only, not CONTROL): calls sent
        # (the agent counts them), and calls done (answered, failed or timed out).
        self.n_sent = 0
        self.n_done = 0

    def on_answer(
        self, src: int, h: wire.FrameHeader, head: bytes, body: bytes, storages: list[torch.UntypedStorage]
    ) -> None:
        """An answer (RESPONSE or EXCEPTION) from ``src``: it completes its call."""
        rec = self.pending.pop(h.msg_id, None)
        if rec is None:  # timed out or failed already: the late answer is dropped, but not its news
            try:
                extras = decode_head(head)[1]
            except Exception:  # noqa: BLE001 - a late answer that cannot be decoded has no news
                return
            self._response_extras(extras, {})
            return
        fut = rec.future
        call_extras = rec.call_extras
        fut._answered = True  # its completion may still be on its way through the pool
        counted = not rec.flags & wire.CONTROL
        if rec.link is not None:
            rec.link.answered(rec.unattended)
        try:
            if h.kind == wire.RESPONSE:
                value, extras = deserialize(head, body, storages, incoming_hook(self._middleware, src, True))
                self._response_extras(extras, call_extras)
                self._complete(fut, value, inline=False, counted=counted)
            else:
                info, extras = deserialize(head, body, storages)
                self._response_extras(extras, call_extras)
                self._complete(fut, error=rebuild_exception(info), inline=False, counted=counted)
        except BaseException as e:  # noqa: BLE001 - a response we cannot decode fails its call, not the reader
            self._complete(
                fut,
                error=RpcError(f"could not decode the response from {self._roster.describe(src)}: {e!r}"),
                inline=False,
                counted=counted,
            )

    def _response_extras(self, extras: dict[str, Any] | None, call_extras: dict[str, Any]) -> None:
        if extras:
            for m in self._middleware:
                m.on_response(extras, call_extras)

    def expire(self, msg_id: int) -> None:
        """Fail call ``msg_id`` as timed out (the timer calls this at its deadline)."""
        # A method of its own, so no local outlives the call: the timer thread then sleeps
        # without pinning the call's record (and the RRef a proxy call keeps alive in it).
        rec = self.pending.get(msg_id)
        if rec is not None:
            self.fail(
                msg_id,
                RpcTimeoutError(
                    f"{self.timeout_message(rec.timeout, rec.dst)}; raise the timeout per call "
                    "(timeout=...) or in RpcBackendOptions(rpc_timeout=...), 0 means none",
                    worker=self._roster.name_of(rec.dst),
                ),
            )

    def timeout_message(self, timeout: float, dst: int) -> str:
        return (
            f"RPC ran for more than set timeout ({int(timeout * 1000)} ms) and will now be marked "
            f"with an error (call to {self._roster.describe(dst)})"
        )

    def _complete(
        self,
        fut: RpcFuture,
        value: Any = None,
        error: BaseException | None = None,
        inline: bool = True,
        counted: bool = False,
    ) -> None:
        if fut._has_callbacks and not inline:
            self._pool.submit(self._settle, fut, value, error, counted)
        else:
            self._settle(fut, value, error, counted)

    def _settle(self, fut: RpcFuture, value: Any, error: BaseException | None, counted: bool) -> None:
        try:
            if error is not None:
                fut.set_exception(error)
            else:
                _set_result(fut, value)
        except RuntimeError:
            pass  # already completed (e.g. timed out first)
        if counted:
            # Only now, after its callbacks ran: calls they made are counted as sent
            # before this one counts as done, so shutdown cannot see a false quiet moment.
            self.n_done += 1

    def fail(self, msg_id: int, error: BaseException, inline: bool = True, unsent: bool = False) -> None:
        """Fail the pending call ``msg_id`` with ``error``. ``unsent``: its connection was reset,
        which may have dropped the request before it arrived, so graceful shutdown's count of
        requests sent and received takes it as never sent (and never done)."""
        rec = self.pending.pop(msg_id, None)
        if rec is not None:
            rec.future._answered = True
            user_call = not rec.flags & wire.CONTROL
            self._complete(rec.future, error=error, inline=inline, counted=user_call and not unsent)
            if rec.link is not None:
                rec.link.answered(rec.unattended)
            if unsent and user_call:
                self.n_sent -= 1

    def fail_to(self, dst: int, error: Callable[[], BaseException], keep: Outbound | None = None) -> None:
        """Fail every call pending to rank ``dst`` with a fresh ``error()``, off this thread
        where they have callbacks; but those on the connection ``keep`` reads."""
        for msg_id, rec in list(self.pending.items()):
            if rec.dst == dst and (keep is None or rec.link is not keep):
                self.fail(msg_id, error(), inline=False)

    def fail_on(self, link: Outbound, error: Callable[[], BaseException]) -> None:
        """Fail every call pending on the connection ``link`` reads with a fresh ``error()``."""
        for msg_id, rec in list(self.pending.items()):
            if rec.link is link:
                self.fail(msg_id, error(), inline=False)

    def fail_all(self, error: Callable[[], BaseException]) -> None:
        """Fail every pending call (the agent is closing)."""
        for msg_id in list(self.pending):
            self.fail(msg_id, error())

    def in_flight(self) -> int:
        """User calls (not CONTROL) made by this worker and not answered yet."""
        return sum(1 for rec in list(self.pending.values()) if not rec.flags & wire.CONTROL)

    def wait_idle(self, deadline: float | None) -> None:
        """Wait until no user call made by this worker is pending (or the deadline passes)."""
        while True:
            futs: list[torch.futures.Future[Any]] = [
                rec.future for rec in list(self.pending.values()) if not rec.flags & wire.CONTROL
            ]
            if not futs:
                return
            done = threading.Event()
            torch_collect_all(futs).add_done_callback(_setter(done))
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0 or not done.wait(remaining):
                return


def _setter(event: threading.Event) -> Callable[[object], None]:
    """A done-callback that sets ``event`` (bound to it now, not to a later loop's)."""
    return lambda _: event.set()
