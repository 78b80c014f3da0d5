"""A parameter server's TensorBoard metrics: counted per update, written on a timer.

The server bumps ``UpdateCounters`` on every update (a lock and a few additions); a
``ServerMetrics`` thread reads them every ``logging.server_every`` seconds and writes rates
into ``tb/ps<r>/``, so the cost per message stays constant and TensorBoard sees one point
per interval whatever the update rate. The x axis is the server's version (updates applied):
in sync mode that is the trainers' step.

Tags (all under ``server/``): ``updates_per_s``, ``update_time_ms`` (mean time of one
optimizer step here), ``contributions_per_round`` (sync: trainer gradients per applied
update), ``staleness_mean`` and the ``staleness`` histogram (async/ssp: updates applied by
others between a gradient's read and its update), ``rows_read_per_s``,
``rows_updated_per_s``, ``rows_live`` (tables: rows updated at least once since the role
started), ``dynamic_rows_live``, ``dynamic_rows_created``, ``dynamic_rows_evicted``,
``dynamic_rows_admitted`` (dynamic tables: rows held now, and cumulative counts),
``bytes_in_per_s``, ``bytes_out_per_s``, ``requests_in_flight`` (rpc_core's connection
counters: the requests received and not answered when sampled) and ``peak_rss_mb``.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import NamedTuple, Protocol

from ps_train.metrics import MetricsWriter, mark_session_start, peak_rss_bytes

__all__ = ["UpdateCounters", "CounterSnapshot", "ByteCounts", "MonitoredServer", "ServerMetrics"]


class CounterSnapshot(NamedTuple):
    contributions: int  # trainer gradients handed in (one per trainer per update request)
    updates: int  # optimizer steps applied
    update_seconds: float  # time spent in them


class ByteCounts(NamedTuple):
    received: int
    sent: int
    requests_in_flight: int = 0  # requests received and not yet answered, at this moment


class UpdateCounters:
    """What a server counts per update; thread-safe (requests arrive on many threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._contributions = 0
        self._updates = 0
        self._update_seconds = 0.0
        self._staleness: Counter[int] = Counter()  # since the last take_staleness()

    def contributed(self) -> None:
        with self._lock:
            self._contributions += 1

    def applied(self, seconds: float) -> None:
        with self._lock:
            self._updates += 1
            self._update_seconds += seconds

    def stale(self, staleness: int) -> None:
        with self._lock:
            self._staleness[staleness] += 1

    def snapshot(self) -> CounterSnapshot:
        with self._lock:
            return CounterSnapshot(self._contributions, self._updates, self._update_seconds)

    def take_staleness(self) -> Counter[int]:
        """The staleness of the updates applied since the last call: value -> count."""
        with self._lock:
            out, self._staleness = self._staleness, Counter()
        return out


class MonitoredServer(Protocol):
    """What the sampler reads of a server (``ps_train.roles.server.ParameterServer``)."""

    @property
    def version(self) -> int: ...

    @property
    def counters(self) -> UpdateCounters: ...

    def table_counts(self) -> Mapping[str, float]:
        """Tables only (else empty): cumulative ``rows_read``, ``rows_updated``, ``rows_live``."""


class ServerMetrics:
    """Samples ``server``'s counters every ``every_s`` seconds into ``writer``.

    ``byte_counts``: bytes received and sent so far by this process (None: not known, e.g.
    on backend=torch); it returns None when RPC is not running, then bytes are left out.
    ``staleness``: whether the mode's updates can be stale (async/ssp), else sync's
    contributions per round are written.
    """

    def __init__(
        self,
        server: MonitoredServer,
        writer: MetricsWriter,
        every_s: float,
        staleness: bool,
        byte_counts: Callable[[], ByteCounts | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.server, self.writer, self.every_s, self.staleness = server, writer, every_s, staleness
        self.byte_counts, self.clock = byte_counts, clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t = clock()
        self._prev = server.counters.snapshot()
        self._prev_tables = server.table_counts()
        self._prev_bytes = self._bytes() or ByteCounts(0, 0)  # none yet before init_rpc
        # A resumed server starts at its checkpoint's version: earlier points after it are superseded.
        mark_session_start(writer, server.version + 1)

    def _bytes(self) -> ByteCounts | None:
        return None if self.byte_counts is None else self.byte_counts()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="server-metrics", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def close(self) -> None:
        """Stop the timer, write a last sample, close the writer."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()
        self.writer.close()

    def sample(self) -> dict[str, float]:
        """Write one point of every tag (rates over the time since the last sample); returns it."""
        now = self.clock()
        dt = now - self._t
        if dt <= 0:
            return {}
        step = self.server.version
        snap = self.server.counters.snapshot()
        tables = self.server.table_counts()
        moved = self._bytes()
        updates = snap.updates - self._prev.updates
        out: dict[str, float] = {"server/updates_per_s": updates / dt}
        if updates:
            out["server/update_time_ms"] = (snap.update_seconds - self._prev.update_seconds) / updates * 1e3
            if not self.staleness:
                out["server/contributions_per_round"] = (snap.contributions - self._prev.contributions) / updates
        stale = self.server.counters.take_staleness()
        if self.staleness and stale:
            values = sorted(stale.elements())
            out["server/staleness_mean"] = sum(values) / len(values)
            self.writer.add_histogram("server/staleness", values, step)
        if tables:
            out["server/rows_read_per_s"] = (tables["rows_read"] - self._prev_tables.get("rows_read", 0)) / dt
            out["server/rows_updated_per_s"] = (tables["rows_updated"] - self._prev_tables.get("rows_updated", 0)) / dt
            out["server/rows_live"] = float(tables["rows_live"])
            for key in ("live", "created", "evicted", "admitted"):  # dynamic tables: cumulative counts
                if f"dynamic_rows_{key}" in tables:
                    out[f"server/dynamic_rows_{key}"] = float(tables[f"dynamic_rows_{key}"])
            if "tier_hit_rate" in tables:  # lazy and tiered tables (ps_train.workloads.ctr.tables.tiered_storage)
                out["server/tier_rows_in_ram"] = float(tables["tier_rows_in_ram"])
                for key in ("hits", "misses"):
                    out[f"server/tier_{key}_per_s"] = (
                        tables[f"tier_{key}"] - self._prev_tables.get(f"tier_{key}", 0)
                    ) / dt
                for key in ("rows_evicted", "rows_read_back", "bytes_written", "bytes_read"):
                    if f"tier_{key}" in tables:
                        prev = self._prev_tables.get(f"tier_{key}", 0)
                        out[f"server/tier_{key}_per_s"] = (tables[f"tier_{key}"] - prev) / dt
        if moved is not None:
            # Counts are over open connections: one that closed takes its bytes along.
            out["server/bytes_in_per_s"] = max(0, moved.received - self._prev_bytes.received) / dt
            out["server/bytes_out_per_s"] = max(0, moved.sent - self._prev_bytes.sent) / dt
            # The queue when sampled: requests being served or waiting (sync: updates waiting
            # for their round; ssp: clocks holding a trainer back), the sampler's own not counted.
            out["server/requests_in_flight"] = float(moved.requests_in_flight)
        out["server/peak_rss_mb"] = peak_rss_bytes() / 2**20
        self.writer.add_scalars(out, step)
        self._t, self._prev_tables = now, tables
        if updates:  # gradients that came while no update applied count toward the next round
            self._prev = snap
        if moved is not None:
            self._prev_bytes = moved
        return out


def rpc_byte_counts() -> ByteCounts | None:
    """This process's bytes over RPC so far (backend=rpc_core, while RPC runs), else None."""
    from ps_train import backend

    if backend.name() != "rpc_core":
        return None
    from rpc_core import connection_stats
    from rpc_core.errors import RpcNotInitializedError

    try:
        c = connection_stats()
    except RpcNotInitializedError:  # not yet, or no longer
        return None
    return ByteCounts(c.bytes_received, c.bytes_sent, c.requests_in_flight)
