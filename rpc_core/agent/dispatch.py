"""Running the requests that arrive: admit them in arrival order, run them, answer them.

A connection's reader runs each request inline, on the thread that read it (no hand-over
to another thread); if the request blocks or runs long, another pool thread takes over the
reading (``ElasticPool.run_inline``). Whichever thread runs it, ``_admit`` has already
shown the request to the middleware on the reading thread, before the next message was
read: that is ``Middleware.admit``'s contract.

``Dispatch`` is a part of ``agent.Agent``. It answers requests on the connection they came
on; a frame that is not a request goes to ``on_answer`` (``PendingCalls.on_answer``), and a
connection whose reading fails to ``lost`` (the agent's connections), both callables it was
made with.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from .. import functions, transport
from ..errors import RpcError, failed_worker, not_a_future
from ..protocol import wire
from ..protocol.serialization import decode_head, deserialize_decoded, encode_head, serialize
from ..transport import Connection
from .early_exit import torch_collect_all
from .middleware import Middleware, incoming_hook
from .pool import ElasticPool, init_torch_thread
from .roster import Roster
from .worlds import WorkerInfo

log = logging.getLogger("rpc_core")
# An exception a called function raised, logged on the worker that ran it (as torch prints
# it on the callee) with its traceback, at WARNING: the caller gets the exception too, so
# ``logging.getLogger("rpc_core.user_errors").setLevel(logging.ERROR)`` quiets these alone.
user_errors = logging.getLogger("rpc_core.user_errors")


def log_call_error(me: WorkerInfo, func: Any, error: BaseException, caller: str | None = None) -> None:
    """Log ``error``, raised by ``func`` in a call this worker ran (``caller``: who made it)."""
    if user_errors.isEnabledFor(logging.WARNING):
        name = f"{getattr(func, '__module__', None) or '?'}.{getattr(func, '__qualname__', repr(func))}"
        user_errors.warning(
            "On %s: %s%s raised %r", me, name, f" (called by {caller})" if caller else "", error, exc_info=error
        )


# The request-extras key under which a request's reply notes (serialization.note_for_reply)
# wait for its response.
_REPLY_NOTES = wire.LOCAL_REPLY_NOTES

# The connection whose reading loop this thread serves (its answers may wait in the queue
# while the next request's bytes are buffered: see _send_answer).
_loop = threading.local()


class _Head(NamedTuple):
    """A request's decoded frame head, as ``_admit`` left it for ``_run_request``."""

    metas: Sequence[Any]
    extras: dict[str, Any]
    error: BaseException | None  # the head could not be decoded (the request fails with it)


class Dispatch:
    """Serving requests. Uses the roster to name peers in errors, the pool to run requests,
    and the agent's middleware and request-failed hooks (lists it shares with the agent)."""

    def __init__(
        self,
        roster: Roster,
        pool: ElasticPool,
        middleware: list[Middleware],
        request_failed_hooks: list[Callable[[dict[str, Any], BaseException], None]],
        on_answer: Callable[[int, wire.FrameHeader, bytes, bytes, list[torch.UntypedStorage]], None],
        lost: Callable[[Connection, int, BaseException], None],
    ) -> None:
        self.me = roster.me
        self._roster = roster
        self.pool = pool
        self.middleware = middleware
        self.request_failed_hooks = request_failed_hooks
        self._on_answer = on_answer
        self._lost = lost
        # For graceful shutdown's quiescence check (user requests only, not CONTROL).
        self.n_received = 0
        self.n_answered = 0
        self.closing = False  # the agent is shutting down: a failed answer is no news

    def read_loop(self, conn: Connection, peer: int) -> None:
        """Read ``conn`` (from ``peer``) and serve its requests until it closes."""
        init_torch_thread()  # readers rebuild tensors and run recv nodes
        resume = None
        _loop.conn = conn
        try:
            while True:
                h, head, body, storages = conn.recv()
                if h.kind != wire.REQUEST:
                    self._on_answer(peer, h, head, body, storages)
                    continue
                # The request runs here, on the thread that read it: no hand-over to another
                # thread. If it blocks or runs long, another thread reads on (see pool).
                if not h.flags & wire.CONTROL:
                    self.n_received += 1
                req = self._admit(peer, head)
                if resume is None:

                    def resume() -> None:
                        self.read_loop(conn, peer)

                    def waiting() -> bool:
                        return conn.poll(0)

                if not self.pool.run_inline(
                    resume,
                    self._run_request,
                    conn,
                    peer,
                    h,
                    req,
                    body,
                    storages,
                    waiting=waiting,
                    stalled=conn.flush_queued,
                ):
                    return  # the loop goes on in another thread
        except Exception as e:  # noqa: BLE001 - never leave a dead reader behind an open socket
            self._lost(conn, peer, e)
        finally:
            _loop.conn = None

    def on_request(
        self, conn: Any, src: int, h: wire.FrameHeader, head: bytes, body: bytes, storages: list[torch.UntypedStorage]
    ) -> None:
        """A request that arrived outside a connection's reading loop (a call to self, a
        request on an outgoing connection): admitted here, in arrival order, and run by the pool."""
        if not h.flags & wire.CONTROL:
            self.n_received += 1
        self.pool.submit(self._run_request, conn, src, h, self._admit(src, head), body, storages)

    def _admit(self, src: int, head: bytes) -> _Head:
        """Decode a request's head and let the middleware see it, in arrival order: the
        thread that read the request runs this before it reads the next message."""
        try:
            metas, extras = decode_head(head)
        except Exception as e:  # noqa: BLE001 - the request fails with it (see _run_request)
            return _Head((), {}, e)
        extras = extras or {}
        for m in self.middleware:
            m.admit(src, extras)
        return _Head(metas, extras, None)

    def _run_request(
        self, conn: Any, src: int, h: wire.FrameHeader, req: _Head, body: bytes, storages: list[torch.UntypedStorage]
    ) -> None:
        extras = req.extras
        notes: dict[str, list[Any]] = {}  # from the arguments to the caller, in the response's extras
        try:
            try:
                if req.error is not None:
                    raise req.error
                waits: list[torch.futures.Future[Any]] = []
                func, args, kwargs = deserialize_decoded(
                    req.metas, extras, body, storages, incoming_hook(self.middleware, src, False), waits, notes
                )
            except BaseException as e:
                if isinstance(e, (AttributeError, ModuleNotFoundError, ImportError)):
                    e = RpcError(
                        f"{self.me.name} could not load the function or arguments of a call from "
                        f"{self._roster.describe(src)}: {e}. The RPC pickler does not serialize function code: define "
                        "the function in a module that both caller and callee can import."
                    )
                if self.request_failed_hooks:
                    for hook in self.request_failed_hooks:
                        hook(extras, e)
                raise e from None
            finally:
                if notes:  # the response, or the error response, carries them
                    extras[_REPLY_NOTES] = notes
            if waits:  # RRef forks in the arguments must be confirmed by their owners first
                torch_collect_all(waits).add_done_callback(
                    lambda _: self.pool.submit(self._execute, conn, src, h, func, args, kwargs, extras)
                )
                return
            self._execute(conn, src, h, func, args, kwargs, extras)
        except BaseException as e:  # noqa: BLE001 - whatever the call raised goes back to its caller
            self._respond_error(conn, h, e, extras)

    def _execute(
        self,
        conn: Any,
        src: int,
        h: wire.FrameHeader,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        extras: dict[str, Any],
    ) -> None:
        tokens = [m.enter_call(src, extras) for m in self.middleware] if self.middleware else ()
        fut = None
        after: list[Callable[[], Any]]  # functions.after_response's, run once the answer is written
        outer = functions.serving()
        try:
            try:
                result = func(*args, **kwargs)
            except Exception as e:
                if not h.flags & wire.CONTROL:  # not rpc_core's bookkeeping: a function the user called
                    log_call_error(self.me, func, e, self._roster.describe(src))
                raise
            finally:
                after = functions.served(outer)
            if getattr(func, "_wrapped_async_rpc_function", None) is not None:
                fut = result
                if not isinstance(fut, torch._C.Future):
                    raise not_a_future(fut)
                if fut.done():  # finished already (a value that was ready): answer without a callback
                    self._respond_future(conn, src, h, fut, extras)
                else:
                    later, after = after, []

                    def answer(f: torch._C.Future[Any]) -> None:
                        self._respond_future(conn, src, h, f, extras)
                        if later:
                            # On the thread that completed the future: if it is serving a
                            # request, the work waits for that one's answer as well.
                            self._after_answer(conn, later, defer=True)

                    fut.add_done_callback(answer)
            else:
                self._respond(conn, src, h, result, extras)
        except BaseException as e:  # noqa: BLE001 - whatever the call raised goes back to its caller
            self._respond_error(conn, h, e, extras)
        finally:
            # strict=False: the profiler may append its middleware while this call ran (never removes one)
            for m, tok in zip(self.middleware, tokens, strict=False):
                m.exit_call(tok, extras, fut)
        if after:
            self._after_answer(conn, after)

    def _after_answer(self, conn: Any, work: list[Callable[[], Any]], defer: bool = False) -> None:
        """Run what the request left for after its answer (``functions.after_response``),
        once the answer is on its way: an answer deferred behind the next request's bytes
        (see ``_send_answer``) is written first. ``defer``: if this thread is serving another
        request, after that one's answer."""
        try:
            conn.flush_queued()
        except OSError:
            pass  # the connection broke: its reader reports that; the work is still this worker's
        if defer:
            for fn in work:
                functions.after_response(fn)
        else:
            functions.run_after(work)

    def _respond_future(
        self, conn: Any, src: int, h: wire.FrameHeader, f: torch._C.Future[Any], extras: dict[str, Any]
    ) -> None:
        try:
            value = f.value()
        except BaseException as e:  # noqa: BLE001 - whatever the call raised goes back to its caller
            self._respond_error(conn, h, e, extras)
            return
        self._respond(conn, src, h, value, extras)

    def _respond(self, conn: Any, src: int, h: wire.FrameHeader, value: Any, extras: dict[str, Any]) -> None:
        try:
            ser = serialize(value)
            resp: dict[str, Any] = extras.pop(_REPLY_NOTES, None) or {}
            for m in self.middleware:
                m.outgoing(src, ser.tensors, resp, extras)
                m.response_extras(extras, resp)
            head = encode_head(ser.metas, resp)
        except BaseException as e:  # noqa: BLE001 - the caller gets it as an RpcError
            self._respond_error(conn, h, RpcError(f"{self.me.name} could not serialize the result: {e!r}"), extras)
            return
        self._send_answer(conn, h, extras, wire.RESPONSE, head, ser.body, ser.buffers)

    def _respond_error(self, conn: Any, h: wire.FrameHeader, e: BaseException, extras: dict[str, Any]) -> None:
        info = wire.ExceptionInfo(
            type(e).__module__,
            type(e).__qualname__,
            f"{e}\n\nRemote traceback (on {self.me.name}):\n{''.join(traceback.format_exception(e))}",
            self.me.name,
            failed_worker(e),
        )
        ser = serialize(info)
        resp: dict[str, Any] = extras.pop(_REPLY_NOTES, None) or {}
        for m in self.middleware:
            m.response_extras(extras, resp)
        self._send_answer(conn, h, extras, wire.EXCEPTION, encode_head(ser.metas, resp), ser.body, [])

    def _send_answer(
        self,
        conn: Any,
        h: wire.FrameHeader,
        extras: dict[str, Any],
        kind: int,
        head: bytes,
        body: bytes,
        buffers: list[Any],
    ) -> None:
        for m in self.middleware:
            m.finish(extras)
        # On the connection's reading loop, with the next request's bytes buffered, the answer
        # waits for the loop's next read of the socket (or the watchdog, if that request runs
        # long): a burst of requests is answered in a few writes. The callee's CPU per no-op
        # call fell from 16 to 11 µs.
        defer = transport.DEFER_ANSWER if getattr(_loop, "conn", None) is conn else 0
        try:
            conn.send(kind, h.flags & wire.CONTROL, h.msg_id, head, body, buffers, defer)
        except OSError as e:
            if not self.closing:
                log.warning("rpc_core %s: could not send a response: %s", self.me.name, e)
        finally:
            if not h.flags & wire.CONTROL:
                # Once written (or queued: see lifecycle.answer_requests), so a worker that waits
                # for its answers before it leaves does not close a socket one is being written to.
                self.n_answered += 1
