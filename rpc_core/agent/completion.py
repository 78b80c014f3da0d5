"""Calls this worker made: their records while unanswered, and how each ends (answered,
failed, timed out).

``Calls`` is a part of ``agent.Agent`` (a mixin: its methods run for every answer, and
share the agent's table and counters without a hop through another object).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ..errors import RpcError, RpcTimeoutError
from ..protocol import wire
from ..protocol.serialization import decode_head, deserialize
from .futures import RpcFuture, rebuild_exception
from .middleware import Middleware
from .outbound import Outbound
from .pool import ElasticPool

# torch.futures.Future.set_result is a Python wrapper around this: one frame less per answer.
_set_result = torch._C.Future.set_result


class Pending(NamedTuple):
    """An unanswered call, under its msg_id in ``Calls._pending``. Made once per call, with
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


class Calls:
    """The pending-call table and the ways a call ends. Uses the agent's ``describe`` and
    the request side's ``_admit``, ``_run_request`` and ``_incoming_hook`` (``dispatch``)."""

    middleware: list[Middleware]
    pool: ElasticPool
    n_sent: int
    n_done: int
    n_received: int

    if TYPE_CHECKING:  # the agent's and the request side's (dispatch: its _Head is Any here, a peer layer's type)
        def describe(self, rank: int) -> str: ...
        def name_of(self, rank: int) -> str | None: ...
        def _admit(self, src: int, head: bytes) -> Any: ...
        def _run_request(self, conn: Any, src: int, h: wire.FrameHeader, req: Any, body: bytes,
                         storages: list[torch.UntypedStorage]) -> None: ...
        def _incoming_hook(self, src: int, is_response: bool) -> Callable[..., list[torch.Tensor]] | None: ...

    def _init_calls(self) -> None:
        self._pending: dict[int, Pending] = {}  # msg_id -> the unanswered call

    def _on_frame(self, conn: Any, src: int, h: wire.FrameHeader, head: bytes, body: bytes,
                  storages: list[torch.UntypedStorage]) -> None:
        """A frame that arrived outside a connection's request-serving loop (answers on our
        outgoing connections, calls to self): an answer completes its call here; a request
        is admitted here, in arrival order, and run by the pool (see dispatch)."""
        if h.kind == wire.REQUEST:
            if not h.flags & wire.CONTROL:
                self.n_received += 1
            self.pool.submit(self._run_request, conn, src, h, self._admit(src, head), body, storages)
            return
        rec = self._pending.pop(h.msg_id, None)
        if rec is None:  # timed out or failed already: the late answer is dropped, but not its news
            try:
                extras = decode_head(head)[1]
            except Exception:
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
                value, extras = deserialize(head, body, storages, self._incoming_hook(src, True))
                self._response_extras(extras, call_extras)
                self._complete(fut, value, inline=False, counted=counted)
            else:
                info, extras = deserialize(head, body, storages)
                self._response_extras(extras, call_extras)
                self._complete(fut, error=rebuild_exception(info), inline=False, counted=counted)
        except BaseException as e:  # a response we cannot decode fails its call, not the reader
            self._complete(fut, error=RpcError(f"could not decode the response from {self.describe(src)}: {e!r}"),
                           inline=False, counted=counted)

    def _response_extras(self, extras: dict[str, Any] | None, call_extras: dict[str, Any]) -> None:
        if extras:
            for m in self.middleware:
                m.on_response(extras, call_extras)

    def _expire(self, msg_id: int) -> None:
        # A method of its own, so no local outlives the call: the timer thread then sleeps
        # without pinning the call's record (and the RRef a proxy call keeps alive in it).
        rec = self._pending.get(msg_id)
        if rec is not None:
            self._fail(msg_id, RpcTimeoutError(
                f"{self._timeout_message(rec.timeout, rec.dst)}; raise the timeout per call "
                "(timeout=...) or in RpcBackendOptions(rpc_timeout=...), 0 means none", worker=self.name_of(rec.dst)))

    def _timeout_message(self, timeout: float, dst: int) -> str:
        return (f"RPC ran for more than set timeout ({int(timeout * 1000)} ms) and will now be marked "
                f"with an error (call to {self.describe(dst)})")

    def _complete(self, fut: RpcFuture, value: Any = None, error: BaseException | None = None, inline: bool = True,
                  counted: bool = False) -> None:
        if fut._has_callbacks and not inline:
            self.pool.submit(self._settle, fut, value, error, counted)
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

    def _fail(self, msg_id: int, error: BaseException, inline: bool = True, unsent: bool = False) -> None:
        """Fail the pending call ``msg_id`` with ``error``. ``unsent``: its connection was reset,
        which may have dropped the request before it arrived, so graceful shutdown's count of
        requests sent and received takes it as never sent (and never done)."""
        rec = self._pending.pop(msg_id, None)
        if rec is not None:
            rec.future._answered = True
            user_call = not rec.flags & wire.CONTROL
            self._complete(rec.future, error=error, inline=inline, counted=user_call and not unsent)
            if rec.link is not None:
                rec.link.answered(rec.unattended)
            if unsent and user_call:
                self.n_sent -= 1

    def in_flight(self) -> int:
        """User calls (not CONTROL) made by this worker and not answered yet."""
        return sum(1 for rec in list(self._pending.values()) if not rec.flags & wire.CONTROL)

    def wait_idle(self, deadline: float | None) -> None:
        """Wait until no user call made by this worker is pending (or the deadline passes)."""
        while True:
            futs: list[torch.futures.Future[Any]] = [
                rec.future for rec in list(self._pending.values()) if not rec.flags & wire.CONTROL]
            if not futs:
                return
            done = threading.Event()
            torch.futures.collect_all(futs).add_done_callback(_setter(done))
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0 or not done.wait(remaining):
                return


def _setter(event: threading.Event) -> Callable[[object], None]:
    """A done-callback that sets ``event`` (bound to it now, not to a later loop's)."""
    return lambda _: event.set()
