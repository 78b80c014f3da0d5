"""Every ``RPC_CORE_*`` environment variable rpc_core reads, parsed here and nowhere else.

Each knob is read when it is needed, never at import time, so a variable set after
``import rpc_core`` (by a launcher, a test, a notebook) still counts. Where a value is
used on the per-message path it is read once when the object that uses it is made, and
the knob's doc says when that is.

One rule for booleans: ``1/true/yes/on`` is true, ``0/false/no/off`` false (any case,
surrounding blanks ignored); unset or empty means the default; anything else raises
ValueError naming the variable and the accepted values. Numbers that are not numbers, or
out of range, raise ValueError the same way.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NamedTuple

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class Knob(NamedTuple):
    """One variable: its name, its default (as it would be written in the environment) and
    what it does, in one line (the table in docs/rpc_core.md says the same)."""

    name: str
    default: str
    doc: str


SPIN_US = Knob(
    "RPC_CORE_SPIN_US",
    "2000",
    "µs a reader polls its socket before sleeping in recv, only while the machine has a core to spare; "
    "0 never polls (read when a connection is made)",
)
UDS = Knob("RPC_CORE_UDS", "1", "0 keeps same-host workers on TCP loopback instead of Unix sockets")
CMA = Knob("RPC_CORE_CMA", "1", "0 turns off cross-memory attach for large same-host tensors (read per connection)")
MALLOC_TUNE = Knob("RPC_CORE_MALLOC_TUNE", "1", "0 leaves glibc's malloc thresholds as they are (read by init_rpc)")
HANDSHAKE_TIMEOUT = Knob(
    "RPC_CORE_HANDSHAKE_TIMEOUT",
    "10",
    "seconds a connection's whole handshake may take, either side (read when a worker starts "
    "and by each rendezvous step)",
)
# 30 s: well above the longest a live peer goes quiet that we know of (TCP's retransmission
# backoff after a few packets lost in a row: 0.2 + 0.4 + ... + 6.4 = 12.6 s for six), and half
# the default RPC timeout, so a call without a timeout, or a long one, learns that its callee
# froze or became unreachable in at most 30 s plus a tick (see heartbeats).
HEARTBEAT_TIMEOUT = Knob(
    "RPC_CORE_HEARTBEAT_TIMEOUT",
    "30",
    "seconds a peer with calls pending may send nothing (heartbeats unanswered) before they "
    "fail; 0 turns heartbeats off (read when a worker starts)",
)
WAIT_ALL_EARLY = Knob(
    "RPC_CORE_WAIT_ALL_EARLY",
    "1",
    "0 keeps torch's torch.futures.wait_all/collect_all for rpc_core futures too: a failed call is "
    "raised once every future is done, not at once (read by each call)",
)
RENDEZVOUS_LOG_INTERVAL = Knob(
    "RPC_CORE_RENDEZVOUS_LOG_INTERVAL",
    "10",
    "seconds between the lines init_rpc logs while it waits in the rendezvous, naming "
    "whom it waits for; 0: none (read by init_rpc)",
)
AUTH_SECRET = Knob(
    "RPC_CORE_AUTH_SECRET", "", "shared secret when RpcBackendOptions(auth_secret=...) is not given (read by init_rpc)"
)

KNOBS: dict[str, Knob] = {
    k.name: k
    for k in (
        SPIN_US,
        UDS,
        CMA,
        MALLOC_TUNE,
        HANDSHAKE_TIMEOUT,
        HEARTBEAT_TIMEOUT,
        RENDEZVOUS_LOG_INTERVAL,
        WAIT_ALL_EARLY,
        AUTH_SECRET,
    )
}


def _raw(knob: Knob) -> str:
    """The variable's text, or its default when unset or blank."""
    raw = os.environ.get(knob.name, "").strip()
    return raw if raw else knob.default


def flag(knob: Knob) -> bool:
    raw = _raw(knob)
    low = raw.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(
        f"{knob.name}={raw!r}: expected one of {'/'.join(_TRUE)} (on) or {'/'.join(_FALSE)} (off); "
        f"default {knob.default}"
    )


def number(knob: Knob, ok: Callable[[float], bool], expected: str) -> float:
    raw = _raw(knob)
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not ok(value):  # NaN fails every range test
        raise ValueError(f"{knob.name}={raw!r}: expected {expected}, e.g. {knob.name}={knob.default}")
    return value


def spin_seconds() -> float:
    """How long a reader may poll its socket before it sleeps (``RPC_CORE_SPIN_US``), in s."""
    return number(SPIN_US, lambda v: v >= 0, "a number of microseconds >= 0") * 1e-6


def uds() -> bool:
    """Whether same-host workers talk over Unix sockets (``RPC_CORE_UDS``)."""
    return flag(UDS)


def cma() -> bool:
    """Whether this process offers and accepts cross-memory attach (``RPC_CORE_CMA``)."""
    return flag(CMA)


def malloc_tune() -> bool:
    """Whether ``memory.tune`` may set glibc's malloc thresholds (``RPC_CORE_MALLOC_TUNE``)."""
    return flag(MALLOC_TUNE)


def handshake_timeout() -> float:
    """The longest a whole connection handshake may take, in s (``RPC_CORE_HANDSHAKE_TIMEOUT``)."""
    return number(HANDSHAKE_TIMEOUT, lambda v: 0 < v < float("inf"), "a positive number of seconds")


def heartbeat_timeout() -> float:
    """How long a peer we wait on may stay silent before its calls fail, in s; 0: never
    (``RPC_CORE_HEARTBEAT_TIMEOUT``)."""
    return number(HEARTBEAT_TIMEOUT, lambda v: 0 <= v < float("inf"), "a number of seconds >= 0 (0: off)")


def rendezvous_log_interval() -> float:
    """Seconds between a rendezvous's "still waiting" log lines; 0: none
    (``RPC_CORE_RENDEZVOUS_LOG_INTERVAL``)."""
    return number(RENDEZVOUS_LOG_INTERVAL, lambda v: 0 <= v < float("inf"), "a number of seconds >= 0 (0: none)")


def wait_all_early() -> bool:
    """Whether ``torch.futures.wait_all``/``collect_all`` return at the first failed rpc_core
    future (``RPC_CORE_WAIT_ALL_EARLY``; see ``agent.early_exit``)."""
    return flag(WAIT_ALL_EARLY)


def auth_secret() -> str:
    """The shared secret from the environment (``RPC_CORE_AUTH_SECRET``); empty: none."""
    return os.environ.get(AUTH_SECRET.name, "")


def check() -> None:
    """Parse every knob once, raising the first ValueError: ``rendezvous`` (the first step
    of ``init_rpc``) calls this, so a bad value fails ``init_rpc`` on the caller's thread
    instead of later in a handshake thread, where it would only drop a connection."""
    spin_seconds()
    uds()
    cma()
    malloc_tune()
    handshake_timeout()
    heartbeat_timeout()
    rendezvous_log_interval()
    wait_all_early()
