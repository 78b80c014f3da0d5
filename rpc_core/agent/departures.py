"""The calls still pending to a member that left the group gracefully: failed only once its
connection has delivered every answer it sent.

A leaver answers what it accepted before it asks to leave (``api._leave``), but that answer
travels on the caller's connection to the leaver, while the news of the leave comes from
rank 0 on another connection (or, on rank 0, from the leaver's own connection to it): the
news may overtake the answer. So when a member hears of a graceful leave, the calls it still
has pending on its connection to the leaver are not failed at once. They wait for their
answers on that connection, which the leaver closes only once it has written every answer
it will ever send (``Agent.close``). Its end (the leaver's close, a crash, a reset) fails
those still pending with the leave's reason; so does ``GRACE`` passing first (a leaver that
froze while it left closes nothing). Calls to it made after the news fail at once, as any
call to a departed member does; a member removed without a leave (it crashed, was found
silent) has its calls failed at once too: nothing more will come from it.

``Departures`` is a part of ``connections.Connections`` (which holds, ends and gives up on the
connections it lists), made with the agent's ``PendingCalls``.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

from ..errors import WorkerLeftError
from .completion import PendingCalls
from .outbound import Outbound

# How long the calls pending on a departed member's connection may wait for their answers
# after its leave was heard (s). The leaver answers what it accepted before it asks to leave,
# and what arrives after that within its shutdown timeout (5 s without one): then it closes.
GRACE = 10.0


class _Departure(NamedTuple):
    """A connection to a member that left gracefully, read until it ends."""

    link: Outbound  # who reads its answers
    name: str  # the leaver's
    reason: str  # why calls to it fail: "worker X (rank r) left the group"


class Departures:
    """The connections to departed members whose answers are still awaited."""

    def __init__(self, pending: PendingCalls) -> None:
        self._pending = pending
        self._lock = threading.Lock()
        self._held: dict[Any, _Departure] = {}  # connection -> its departure

    def hold(self, conn: Any, link: Outbound, name: str, reason: str) -> bool:
        """``name`` left gracefully: keep the calls pending on ``conn`` (read by ``link``)
        until it ends or ``give_up``. False if none are pending (nothing to wait for)."""
        if not any(rec.link is link for rec in list(self._pending.pending.values())):
            return False
        with self._lock:
            self._held[conn] = _Departure(link, name, reason)
        return True

    def ended(self, conn: Any) -> bool:
        """``conn`` ended: fail what still waits on it. False if it is not held."""
        with self._lock:
            departure = self._held.pop(conn, None)
        if departure is None:
            return False
        self._fail(departure)
        return True

    def give_up(self, conn: Any) -> None:
        """``GRACE`` passed since the leave was heard: fail what still waits, and close ``conn``."""
        if self.ended(conn):
            conn.close()  # its reader then ends, as for any connection we close

    def _fail(self, departure: _Departure) -> None:
        name, reason = departure.name, departure.reason
        self._pending.fail_on(departure.link, lambda: WorkerLeftError(reason, worker=name))
