"""Who a worker is (``WorkerInfo``, its name rules) and what a rendezvous gives it (``World``).

Below the rendezvous that fills them, so every layer can name workers; ``rendezvous``
re-exports them (their historical home).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import RpcValueError
from ..protocol import allowlist
from ..protocol.serialization import register_reducer
from ..transport import Connection, Listener

MAX_NAME_LEN = 128
_NAME_RE = re.compile(r"^[A-Za-z0-9_:\-]+$")


class WorkerInfo:
    """A worker's name and id (its rank). Equal and hashable by both."""

    __slots__ = ("_name", "_id")

    def __init__(self, name: str, id: int) -> None:
        validate_name(name)
        self._name = name
        self._id = int(id)

    @property
    def name(self) -> str:
        return self._name

    @property
    def id(self) -> int:
        return self._id

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WorkerInfo) and other._id == self._id and other._name == self._name

    def __hash__(self) -> int:
        return hash((self._id, self._name))

    def __repr__(self) -> str:
        return f"WorkerInfo(id={self._id}, name={self._name})"

    def __reduce__(self) -> tuple[type[WorkerInfo], tuple[str, int]]:
        return WorkerInfo, (self._name, self._id)


# Under serializer="safe" a WorkerInfo travels as its name and id (pickle's form).
register_reducer(WorkerInfo, WorkerInfo.__reduce__)
allowlist.internal(WorkerInfo)


def validate_name(name: str) -> None:
    """Raise ``RpcValueError`` (a RuntimeError, as torch raises, and a ValueError) for a bad name."""
    if not isinstance(name, str):
        raise TypeError(f"worker name must be a str, got {type(name).__name__}")
    if not name:
        raise RpcValueError("Worker name must be non-empty")
    if len(name) >= MAX_NAME_LEN:
        raise RpcValueError(f"Worker name must be shorter than {MAX_NAME_LEN} chars, got {len(name)}: {name[:40]!r}...")
    if not _NAME_RE.match(name):
        raise RpcValueError(
            f"Worker name must match ^[A-Za-z0-9_:-]+$ (letters, digits, '_', ':' and '-'), got {name!r}"
        )


@dataclass
class World:
    """Result of a rendezvous: who is who, and the listeners and connections it leaves us with."""

    me: WorkerInfo
    workers: list[WorkerInfo]  # by rank
    addresses: dict[int, tuple[str, int]]
    # This worker's listeners (transport.listen): TCP's, at the address it advertises, first.
    listeners: list[Listener]
    # rank 0: {rank: incoming connection}; others: {0: outgoing connection to rank 0}
    connections: dict[int, Connection]
    # A dynamic group (``world_size=None``): members join and leave while it runs.
    dynamic: bool = False
    # Dynamic groups: which join brought each member in (rank 0, the founder: 0), so a rank
    # reused after a leave is told apart from the member that held it before.
    generations: dict[int, int] = field(default_factory=dict)
