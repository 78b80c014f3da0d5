"""A delaying TCP relay: netem's delay and jitter, in user space (this kernel has no netem).

A relay runs in one host's network namespace (its threads ``setns`` there), where an
iptables REDIRECT sends it every TCP connection the host opens into the emulated subnet. It
reads the real destination (``SO_ORIGINAL_DST``), connects there itself (its sockets carry
``MARK``, which the REDIRECT rule skips), and forwards each direction's bytes after
``delay`` +- ``jitter`` seconds. Release times never decrease, so the stream keeps its order
(jitter spaces chunks, it never reorders them). At most ``_MAX_QUEUED`` bytes wait per
direction: past that the relay stops reading, so a slow or cut link pushes back on the
sender as a real one does.

Every loop ends when its sockets close or ``close()`` is called; waits are bounded.
"""

from __future__ import annotations

import collections
import random
import socket
import struct
import threading
import time

MARK = 0x5A17  # SO_MARK of the relay's own connections
_SO_ORIGINAL_DST = 80
_SO_MARK = 36
_CHUNK = 256 << 10
_MAX_QUEUED = 4 << 20
_POLL = 0.2  # how often blocked loops look at the stop flag (s)
_CONNECT_TIMEOUT = 10.0


class Relay:
    def __init__(self, netns_path: str, port: int, delay: float, jitter: float) -> None:
        self.delay, self.jitter = delay, jitter
        self.connections = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self._rng = random.Random(port)
        ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._serve,
            args=(netns_path, port, ready),
            daemon=True,
            name=f"relay-{netns_path.rsplit('/', 1)[-1]}",
        )
        self._thread.start()
        if not ready.wait(_CONNECT_TIMEOUT) or self._error is not None:
            self.close()
            raise RuntimeError(f"the relay in {netns_path} did not start: {self._error}")

    def _track(self, s: socket.socket) -> socket.socket:
        with self._lock:
            if self._stop.is_set():
                s.close()
                raise OSError("relay closed")
            self._socks.add(s)
        return s

    def _serve(self, netns_path: str, port: int, ready: threading.Event) -> None:
        from tests.netns import setns  # this thread, and the threads it starts, live in the host's namespace

        try:
            setns(netns_path)
            listener = self._track(socket.socket())
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("0.0.0.0", port))
            listener.listen(128)
            listener.settimeout(_POLL)
        except BaseException as e:  # noqa: BLE001 - reported by the constructor
            self._error = e
            ready.set()
            return
        ready.set()
        while not self._stop.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        try:
            self._track(client)
            raw = client.getsockopt(socket.SOL_IP, _SO_ORIGINAL_DST, 16)
            (port,) = struct.unpack_from("!H", raw, 2)
            dst = (socket.inet_ntoa(raw[4:8]), port)
            upstream = self._track(socket.socket())
            upstream.setsockopt(socket.SOL_SOCKET, _SO_MARK, MARK)
            upstream.settimeout(_CONNECT_TIMEOUT)
            upstream.connect(dst)
            upstream.settimeout(None)
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            client.close()
            return
        self.connections += 1
        for src, dst_sock in ((client, upstream), (upstream, client)):
            _Pipe(self, src, dst_sock).start()

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            socks, self._socks = list(self._socks), set()
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self._thread.join(_POLL * 5)


class _Pipe:
    """One direction of a relayed connection: a reader queues chunks, a writer sends each at its time."""

    def __init__(self, relay: Relay, src: socket.socket, dst: socket.socket) -> None:
        self._relay, self._src, self._dst = relay, src, dst
        self._cv = threading.Condition()
        self._queue: collections.deque[tuple[float, bytes]] = collections.deque()  # (release time, b"" = EOF)
        self._queued = 0
        self._done = False

    def start(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._write, daemon=True).start()

    def _read(self) -> None:
        relay, last = self._relay, 0.0
        while True:
            try:
                data = self._src.recv(_CHUNK)
            except OSError:
                data = b""
            with self._cv:
                while self._queued > _MAX_QUEUED and not (self._done or relay._stop.is_set()):
                    self._cv.wait(_POLL)
                if self._done or relay._stop.is_set():
                    return
                spread = relay._rng.uniform(-relay.jitter, relay.jitter) if relay.jitter else 0.0
                last = max(last, time.monotonic() + relay.delay + spread)
                self._queue.append((last, data))
                self._queued += len(data)
                self._cv.notify_all()
            if not data:
                return

    def _write(self) -> None:
        relay = self._relay
        while True:
            with self._cv:
                while not self._done and not relay._stop.is_set():
                    now = time.monotonic()
                    if self._queue and self._queue[0][0] <= now:
                        break
                    # The emulated latency itself: wait until the head chunk is due (or news).
                    self._cv.wait(min(_POLL, self._queue[0][0] - now) if self._queue else _POLL)
                if self._done or relay._stop.is_set():
                    return
                _, data = self._queue.popleft()
                self._queued -= len(data)
                self._cv.notify_all()
            try:
                if data:
                    self._dst.sendall(data)
                else:
                    self._dst.shutdown(socket.SHUT_WR)  # the source's end, passed on in order
                    return
            except OSError:
                with self._cv:
                    self._done = True
                    self._cv.notify_all()
                for s in (self._src, self._dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                return
