"""A fork server forked from the launcher itself: roles start without importing anything.

``multiprocessing``'s forkserver is a fresh interpreter: it imports torch and everything a
role needs again, after the launcher already did (seconds of CPU, before the first role can
start). ``ForkServer`` instead forks a helper from the launcher while the launcher is still
single-threaded (so no lock can be held by a thread that does not exist in the copy); the
helper imports what the launcher has not (``preload``), runs ``prepare`` (work every role
would repeat, e.g. drawing a computed data set) and then forks one child per
``start`` request (many at once: several forkers, copies of the helper, fork their shares
side by side; ``_fork_all``). Every child is a copy of the helper: torch is imported, the workload is
registered, and the objects the launcher created before the helper (pipes, the heartbeat
array, the run's config) are there without pickling.

The launcher only sends each role's small request (a picklable value for ``run``). The
helper, the only process that can reap the roles, reports each one's pid with a sentinel
(the read end of a pipe whose write end only the role holds: it becomes readable when the
role exits, however it exits) and, once reaped, its exit code. ``ForkedProcess`` is the
launcher's handle with the part of ``multiprocessing.Process``'s interface it uses.

A role exits by itself if the launcher dies (it watches a pipe only the launcher writes to);
the helper exits when the launcher closes it or dies.
"""

from __future__ import annotations

import gc
import importlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["ForkServer", "ForkedProcess", "ForkServerError"]

_MAX_MESSAGE = 1 << 20  # bytes: a request (a role's environment) or a report, as one datagram
# Requests that arrive together are forked by this many forkers at once (copies of the helper,
# each forking its share and exiting), from this many requests on. A fork copies the page
# tables of the whole helper (~300 MB of anonymous memory with torch: ~10 ms of system time);
# one forker forks 67 roles in 0.7 CPU-s, seconds of wall on a loaded machine, while each
# forker gets its own share of the cores.
_FORKERS = 4
_TREE_FROM = 16
_PR_SET_CHILD_SUBREAPER = 36  # prctl: orphaned descendants come to the helper, which reaps them


class ForkServerError(RuntimeError):
    """The fork server is gone or broke its protocol."""


@dataclass(frozen=True)
class _Ready:
    at: float  # wall clock: the helper has imported everything in ``preload`` and run ``prepare``
    cpu_s: float  # the CPU time that took


@dataclass(frozen=True)
class _Started:
    pid: int
    seq: int  # the request's number: forkers of a batch answer in any order


@dataclass(frozen=True)
class _Exited:
    pid: int
    exitcode: int  # negative: killed by that signal (as ``multiprocessing.Process.exitcode``)


@dataclass(frozen=True)
class _Failed:
    error: str  # why the helper could not fork or preload


class ForkServer:
    """The launcher's side. Create it before the launcher starts any thread; ``run(request)``
    runs in each forked child and must end the process (``os._exit``): a child that returns
    from it exits 0, one that raises exits 1."""

    def __init__(
        self, preload: Iterable[str], run: Callable[[Any], None], prepare: Callable[[], None] | None = None
    ) -> None:
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        alive_r, alive_w = os.pipe()  # only the launcher holds alive_w: EOF on alive_r when it dies
        self._exits: dict[int, int] = {}
        self._lock = threading.Lock()  # start() and the exit codes may be asked from two threads
        self._seq = 0  # requests sent so far: a request's number matches the helper's answer to it
        pid = os.fork()
        if pid == 0:  # the helper: never returns
            self._sock.close()
            os.close(alive_w)
            _helper(theirs, alive_r, list(preload), run, prepare)
        theirs.close()
        os.close(alive_r)
        self.pid, self._alive_w = pid, alive_w
        self._closed = False
        # When the helper was ready and the CPU time its preload took (known from the first start on).
        self.preloaded_at: float | None = None
        self.preload_cpu_s: float | None = None

    def start(self, request: Any, name: str) -> ForkedProcess:
        """Fork a child that runs ``run(request)``; returns once it exists."""
        return self.start_all([(request, name)])[0]

    def start_all(self, requests: list[tuple[Any, str]]) -> list[ForkedProcess]:
        """``start`` for each ``(request, name)``, in order, without a round trip each: all
        requests go out first, then the helper's answers are read (one per child)."""
        with self._lock:
            names = {}
            for request, name in requests:
                try:
                    self._sock.send(pickle.dumps((self._seq, request)))
                except OSError as e:
                    why = self._why_gone()
                    raise ForkServerError(f"the fork server (pid {self.pid}) is gone: {why or e}") from e
                names[self._seq] = name
                self._seq += 1
            started: dict[int, ForkedProcess] = {}
            while len(started) < len(names):
                message, fds = self._receive()
                if isinstance(message, _Started) and message.seq in names:
                    started[message.seq] = ForkedProcess(message.pid, fds[0], names[message.seq], self)
                    continue
                if isinstance(message, _Failed):
                    waiting = [n for seq, n in names.items() if seq not in started]
                    raise ForkServerError(f"the fork server could not start {', '.join(waiting)}: {message.error}")
                for fd in fds:
                    os.close(fd)
            return [started[seq] for seq in names]

    def _why_gone(self) -> str | None:
        """The error the helper reported before it exited, if it did."""
        try:
            while True:
                message, fds = self._receive(block=False)
                for fd in fds:
                    os.close(fd)
                if message is None:
                    return None
                if isinstance(message, _Failed):
                    return message.error
        except ForkServerError:
            return None

    def _receive(self, block: bool = True) -> tuple[Any, list[int]]:
        """One report from the helper (exit codes are noted on the way); ``(None, [])`` when
        ``block`` is false and there is none."""
        flags = 0 if block else socket.MSG_DONTWAIT
        try:
            data, fds, _, _ = socket.recv_fds(self._sock, _MAX_MESSAGE, 4, flags)
        except BlockingIOError:
            return None, []
        if not data:
            raise ForkServerError(f"the fork server (pid {self.pid}) exited")
        message = pickle.loads(data)
        if isinstance(message, _Exited):
            self._exits[message.pid] = message.exitcode
        elif isinstance(message, _Ready):
            self.preloaded_at, self.preload_cpu_s = message.at, message.cpu_s
        return message, fds

    def exitcode(self, pid: int, block: bool) -> int | None:
        """``pid``'s exit code once the helper reaped it (``block``: wait for the report)."""
        with self._lock:
            while pid not in self._exits:
                message, fds = self._receive(block)
                for fd in fds:
                    os.close(fd)
                if message is None:
                    return None
            return self._exits[pid]

    def close(self) -> None:
        """Stop the helper (after the roles: it reports their exits) and reap it."""
        if self._closed:
            return
        self._closed = True
        self._sock.close()  # the helper reads EOF and exits
        os.close(self._alive_w)
        os.waitpid(self.pid, 0)


class ForkedProcess:
    """A role forked by the fork server: ``multiprocessing.Process``'s ``pid``, ``name``,
    ``sentinel``, ``exitcode``, ``is_alive``, ``kill`` and ``join``."""

    def __init__(self, pid: int, sentinel: int, name: str, server: ForkServer) -> None:
        self.pid, self.sentinel, self.name, self._server = pid, sentinel, name, server
        self._code: int | None = None

    def _exited(self, timeout: float | None) -> bool:
        return bool(multiprocessing.connection.wait([self.sentinel], timeout))

    @property
    def exitcode(self) -> int | None:
        """None while it runs; its exit code (negative: the signal that killed it) after."""
        if self._code is None and self._exited(0):
            self._code = self._server.exitcode(self.pid, block=True)  # reported right after the exit
        return self._code

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        if self._exited(timeout):
            self.exitcode  # noqa: B018 - fetches the code while the helper is there to tell it

    def kill(self) -> None:
        if self.exitcode is None:  # not reaped: the pid is still this role's
            os.kill(self.pid, signal.SIGKILL)


def _send(sock: socket.socket, message: Any, fds: list[int] | None = None) -> None:
    socket.send_fds(sock, [pickle.dumps(message)], fds or [])


def _helper(
    sock: socket.socket,
    alive_r: int,
    preload: list[str],
    run: Callable[[Any], None],
    prepare: Callable[[], None] | None,
) -> None:
    """The helper's life: preload and prepare, then fork a child per request, report exits;
    never returns."""
    code = 0
    try:
        # The launcher's Ctrl-C reaches the whole process group: the launcher stops the roles.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for module in preload:
            importlib.import_module(module)
        if prepare is not None:
            prepare()
        # Every object so far goes to gc's permanent generation: a child's collections then
        # never walk (and so never copy-on-write) the pages torch's modules live in, which
        # cost each role a third of a CPU-second and a copy of most of the heap.
        gc.collect()
        gc.freeze()
        _send(sock, _Ready(time.time(), time.process_time()))
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler: SIGCHLD now writes to wake_w
        forkers = _FORKERS if _become_subreaper() else 1
        children: set[int] = set()
        while True:
            ready, _, _ = select.select([sock.fileno(), wake_r], [], [])
            if wake_r in ready:
                os.read(wake_r, 4096)
                _reap(sock, children)
            if sock.fileno() in ready:
                requests = _requests(sock)
                if requests is None:  # the launcher closed us or died
                    break
                children.update(_fork_all(sock, alive_r, (wake_r, wake_w), requests, run, forkers))
    except BaseException as e:  # noqa: BLE001 - the launcher learns why, then the helper exits
        code = 1
        _report_failure(sock, e)
    os._exit(code)


def _report_failure(sock: socket.socket, error: BaseException) -> None:
    """Tell the launcher why this process (the helper or a forker) is giving up; a launcher
    already gone cannot be told."""
    try:
        _send(sock, _Failed(f"{type(error).__name__}: {error}"))
    except OSError:
        pass


def _become_subreaper() -> bool:
    """Make the helper the reaper of its descendants (Linux): a role forked by a forker that
    has exited becomes the helper's child, which reaps it and reports its exit code."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def _requests(sock: socket.socket) -> list[tuple[int, Any]] | None:
    """Every request waiting on ``sock`` (at least one: it is readable), as ``(seq, request)``;
    None when the launcher closed it."""
    found: list[tuple[int, Any]] = []
    flags = 0
    while True:
        try:
            data = sock.recv(_MAX_MESSAGE, flags)
        except BlockingIOError:
            return found
        if not data:
            return found or None  # the ones before EOF are still forked; EOF is seen next time
        found.append(pickle.loads(data))
        flags = socket.MSG_DONTWAIT


def _fork_all(
    sock: socket.socket,
    alive_r: int,
    wake: tuple[int, ...],
    requests: list[tuple[int, Any]],
    run: Callable[[Any], None],
    forkers: int,
) -> list[int]:
    """Fork a child per request; the pids. Many requests at once are shared out among
    ``forkers`` forkers (``_FORKERS``): each is a fresh copy of the helper that forks its
    share, sends the launcher each child's pid and sentinel, tells the helper the pids
    (a pipe) and exits; its children become the helper's (a subreaper)."""
    if forkers < 2 or len(requests) < _TREE_FROM:
        return [_fork_child(sock, alive_r, wake, seq, request, run) for seq, request in requests]
    pids: list[int] = []
    started = []
    for share in (requests[k::forkers] for k in range(forkers)):
        pids_r, pids_w = os.pipe()
        forker = os.fork()
        if forker == 0:  # a forker: never returns
            os.close(pids_r)
            code = 0
            try:
                for seq, request in share:  # pids_w too is closed in each child: EOF when the forker exits
                    os.write(pids_w, b"%d\n" % _fork_child(sock, alive_r, (*wake, pids_w), seq, request, run))
            except BaseException as e:  # noqa: BLE001 - the launcher learns why
                code = 1
                _report_failure(sock, e)
            os._exit(code)
        os.close(pids_w)
        started.append((forker, pids_r))
    for forker, pids_r in started:
        with os.fdopen(pids_r, "rb") as f:  # EOF when the forker exits
            pids.extend(int(line) for line in f)
        os.waitpid(forker, 0)
    return pids


def _reap(sock: socket.socket, children: set[int]) -> None:
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            children.discard(pid)
            _send(sock, _Exited(pid, os.waitstatus_to_exitcode(status)))


def _fork_child(
    sock: socket.socket, alive_r: int, wake: tuple[int, ...], seq: int, request: Any, run: Callable[[Any], None]
) -> int:
    """Fork the child for ``request`` (number ``seq``); this process (the helper or a forker)
    sends the launcher its pid and sentinel. ``wake``: the descriptors the child closes."""
    sentinel_r, sentinel_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(sentinel_r)  # sentinel_w stays open until this process ends
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd in wake:
            os.close(fd)
        sock.close()
        _child_main(alive_r, request, run)
    os.close(sentinel_w)
    _send(sock, _Started(pid, seq), [sentinel_r])
    os.close(sentinel_r)
    return pid


def _child_main(alive_r: int, request: Any, run: Callable[[Any], None]) -> None:
    code = 0
    try:
        sys.stdin.close()
        sys.stdin = open(os.devnull)  # noqa: SIM115 - the process's stdin for its whole life
        _exit_with_launcher(alive_r)
        run(request)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - ``run`` reports its own errors; this is the last resort
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _exit_with_launcher(alive_r: int) -> None:
    """A role must not outlive its launcher (e.g. killed by a test timeout)."""

    def watch() -> None:
        os.read(alive_r, 1)  # returns (EOF) only when the launcher's end is closed: it is gone
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-launcher", daemon=True).start()
