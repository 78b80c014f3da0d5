"""Reading the safe serializer's encoding (the format: ``safe_encoding``).

The bytes come from a peer, which may be hostile even with the right secret: every length
is checked against the bytes left before it is used, nesting is bounded, and the only
objects called are what ``allowlist.resolve`` returns for a name (a class to build a
record of, an rpc_core rebuilding function) and the constructors of containers, numbers
and tensors. A name outside the allowlist raises ``NotAllowedError`` naming it.
"""

from __future__ import annotations

import collections
import dataclasses
import struct
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import NotAllowedError, ProtocolError, RemoteFunctionError
from . import allowlist, serialization
from .safe_encoding import (
    HEAD_TAG,
    MAGIC,
    MAX_BIG_INT,
    MAX_DEPTH,
    MAX_INT_RUN,
    MAX_META_DIMS,
    META_PREFIX,
    is_plain,
    meta_struct,
)

_Q = struct.Struct("<q")
_D = struct.Struct("<d")
_DD = struct.Struct("<dd")
_U32 = struct.Struct("<I")
_TORCH_ENUMS = (torch.layout, torch.memory_format)
_INT_TAG = ord("i")
_STR_TAG = ord("s")
_NAME_TAG = ord("r")
_INT_RUNS = [struct.Struct(f"<{n}q") for n in range(MAX_INT_RUN + 1)]
_TOO_DEEP = f"a safe message nests values more than {MAX_DEPTH} deep"


class _Decoder:
    __slots__ = ("buf", "pos", "tensors", "depth")

    def __init__(self, buf: bytes, tensors: Sequence[torch.Tensor]) -> None:
        self.buf = buf
        self.pos = 0
        self.tensors = tensors
        self.depth = 0

    def value(self) -> Any:
        buf, pos = self.buf, self.pos
        if pos >= len(buf):
            raise ProtocolError("a safe message ends in the middle of a value")
        tag = buf[pos]
        if tag == _INT_TAG and pos + 9 <= len(buf):  # the most frequent value, without a call
            self.pos = pos + 9
            n: int = _Q.unpack_from(buf, pos + 1)[0]
            return n
        self.pos = pos + 1
        return _DECODE[tag](self)

    def string_at(self, pos: int) -> str:
        """The string whose length starts at ``pos`` (its tag read already)."""
        buf = self.buf
        if pos + 4 > len(buf):
            raise ProtocolError("a safe message ends in the middle of a length")
        start = pos + 4
        end = start + _U32.unpack_from(buf, pos)[0]
        if end > len(buf):
            raise ProtocolError(f"a safe message announces {end - start} bytes where {len(buf) - start} are left")
        self.pos = end
        return buf[start:end].decode("utf-8", "surrogatepass")

    def take(self, n: int) -> bytes:
        pos, end = self.pos, self.pos + n
        if end > len(self.buf):
            raise ProtocolError(f"a safe message announces {n} bytes where {len(self.buf) - pos} are left")
        self.pos = end
        return self.buf[pos:end]

    # unpack_from at the position, no slice: these run for every int and length.
    def u32(self) -> int:
        pos = self.pos
        if pos + 4 > len(self.buf):
            raise ProtocolError("a safe message ends in the middle of a length")
        self.pos = pos + 4
        n: int = _U32.unpack_from(self.buf, pos)[0]
        return n

    def q(self) -> int:
        pos = self.pos
        if pos + 8 > len(self.buf):
            raise ProtocolError("a safe message ends in the middle of an int")
        self.pos = pos + 8
        n: int = _Q.unpack_from(self.buf, pos)[0]
        return n

    def count(self) -> int:
        """An item count: each item takes at least a byte, so more than are left is a lie."""
        buf, pos = self.buf, self.pos + 4
        if pos > len(buf):
            raise ProtocolError("a safe message ends in the middle of a length")
        n: int = _U32.unpack_from(buf, pos - 4)[0]
        if n > len(buf) - pos:
            raise ProtocolError(f"a safe message announces {n} items where {len(buf) - pos} bytes are left")
        self.pos = pos
        return n

    def expect(self, tag: bytes) -> None:
        got = self.take(1)
        if got != tag:
            raise ProtocolError(f"a safe message has tag {got!r} where {tag!r} belongs")

    def text(self) -> str:
        pos = self.pos
        if pos >= len(self.buf) or self.buf[pos] != _STR_TAG:
            self.expect(b"s")  # raises, naming what is there instead
        return self.string_at(pos + 1)

    def string(self) -> str:
        return self.string_at(self.pos)

    def items(self) -> list[Any]:
        n = self.count()
        depth = self.depth = self.depth + 1
        if depth > MAX_DEPTH:
            raise ProtocolError(_TOO_DEEP)
        # value() inlined: this loop runs for every item of every container.
        buf, end, table, out = self.buf, len(self.buf), _DECODE, []
        for _ in range(n):
            pos = self.pos
            if pos >= end:
                raise ProtocolError("a safe message ends in the middle of a value")
            tag = buf[pos]
            if tag == _INT_TAG and pos + 9 <= end:
                self.pos = pos + 9
                out.append(_Q.unpack_from(buf, pos + 1)[0])
            else:
                self.pos = pos + 1
                out.append(table[tag](self))
        self.depth = depth - 1
        return out

    def tuple_of(self, n: int | None = None) -> tuple[Any, ...]:
        self.expect(b"(")
        out = tuple(self.items())
        if n is not None and len(out) != n:
            raise ProtocolError(f"a safe message has {len(out)} fields where {n} belong")
        return out

    def pairs(self) -> list[tuple[Any, Any]]:
        n = self.count()
        if not n:
            return []
        depth = self.depth = self.depth + 1
        if depth > MAX_DEPTH:
            raise ProtocolError(_TOO_DEEP)
        value = self.value
        out = [(value(), value()) for _ in range(n)]
        self.depth = depth - 1
        return out

    def name(self) -> tuple[str, str]:
        pos = self.pos
        if pos >= len(self.buf) or self.buf[pos] != _NAME_TAG:
            self.expect(b"r")  # raises, naming what is there instead
        self.pos = pos + 1
        return self.text(), self.text()

    def ref(self) -> Any:
        return allowlist.resolve(*self.name())

    def cls(self, what: str) -> type:
        obj = self.ref()
        if not isinstance(obj, type):
            raise NotAllowedError(f"a safe message builds {what} of {obj!r}, which is not a class")
        return obj


def _int_run(d: _Decoder) -> tuple[int, ...]:
    n = d.u32()
    if not 0 < n <= MAX_INT_RUN:
        raise ProtocolError(f"a safe message holds a run of {n} ints (1 to {MAX_INT_RUN})")
    pos = d.pos
    end = pos + 8 * n
    if end > len(d.buf):
        raise ProtocolError(f"a safe message announces {n} ints where {len(d.buf) - pos} bytes are left")
    d.pos = end
    out: tuple[int, ...] = _INT_RUNS[n].unpack_from(d.buf, pos)
    return out


def _tensor(d: _Decoder) -> torch.Tensor:
    i = d.u32()
    if i >= len(d.tensors):
        raise ProtocolError(f"a safe message names tensor {i} of a table of {len(d.tensors)}")
    return d.tensors[i]


def _big_int(d: _Decoder) -> int:
    n = d.u32()
    if n > MAX_BIG_INT:
        raise ProtocolError(f"a safe message holds an int of {n} bytes (at most {MAX_BIG_INT})")
    return int.from_bytes(d.take(n), "little", signed=True)


def _dtype(d: _Decoder) -> torch.dtype:
    name = d.string()
    dtype = getattr(torch, name, None) if not name.startswith("_") else None
    if not isinstance(dtype, torch.dtype):
        raise ProtocolError(f"a safe message names dtype {name!r}, which torch does not have")
    return dtype


def _torch_enum(d: _Decoder) -> Any:
    name = d.string()
    obj = getattr(torch, name, None) if not name.startswith("_") else None
    if not isinstance(obj, _TORCH_ENUMS):
        raise ProtocolError(f"a safe message names torch layout or memory format {name!r}, which torch does not have")
    return obj


def _size(d: _Decoder) -> torch.Size:
    n = d.count()
    return torch.Size([d.q() for _ in range(n)])


def _slice(d: _Decoder) -> slice:
    start, stop, step = d.tuple_of(3)
    return slice(start, stop, step)


def _range(d: _Decoder) -> range:
    return range(d.q(), d.q(), d.q())


def _named_tuple(d: _Decoder) -> tuple[Any, ...]:
    cls = d.cls("a NamedTuple")
    fields = getattr(cls, "_fields", None)
    if not issubclass(cls, tuple) or not isinstance(fields, tuple):
        raise NotAllowedError(f"a safe message sends {cls.__qualname__} as a NamedTuple, which it is not")
    items = d.tuple_of(len(fields))
    out: tuple[Any, ...] = tuple.__new__(cls, items)
    return out


def _dataclass(d: _Decoder) -> Any:
    cls = d.cls("a dataclass")
    if not dataclasses.is_dataclass(cls) or cls.__new__ is not object.__new__:
        raise NotAllowedError(f"a safe message sends {cls.__qualname__} as a dataclass, which it is not")
    names = {f.name for f in dataclasses.fields(cls)}
    d.expect(b"(")
    n = d.count()
    obj = object.__new__(cls)
    d.depth += 1
    for _ in range(n):
        field = d.text()
        if field not in names:
            raise ProtocolError(f"a safe message sets field {field!r}, which dataclass {cls.__qualname__} lacks")
        object.__setattr__(obj, field, d.value())  # also for frozen dataclasses, as pickle does
    d.depth -= 1
    return obj


def _plain_object(d: _Decoder) -> Any:
    cls = d.cls("an object")
    if not is_plain(cls):
        raise NotAllowedError(f"a safe message sends an object of {cls.__qualname__}, which has a reduction of its own")
    d.expect(b"{")
    state = dict(d.pairs())
    if not all(type(k) is str for k in state):
        raise ProtocolError(f"a safe message gives an object of {cls.__qualname__} attributes that are not strings")
    obj: Any = object.__new__(cls)
    obj.__dict__.update(state)
    return obj


def _exception(d: _Decoder) -> BaseException:
    module, qualname = d.name()
    args = d.tuple_of()
    message = d.text()
    cls = allowlist.exception_type(module, qualname)
    if cls is not None:
        try:
            return cls(*args)
        except Exception:  # noqa: BLE001 - its constructor takes other arguments: the generic error below
            pass
    return RemoteFunctionError(f"{module}.{qualname}: {message}")


def _reduced(d: _Decoder) -> Any:
    fn = d.ref()
    args = d.tuple_of()
    return fn(*args)


def _bad(d: _Decoder) -> Any:
    raise ProtocolError(f"a safe message has unknown tag {d.buf[d.pos - 1]:#x} at byte {d.pos - 1}")


def _ordered(d: _Decoder) -> Any:
    return collections.OrderedDict(d.pairs())


_TABLE: dict[bytes, Callable[[_Decoder], Any]] = {
    b"N": lambda d: None,
    b"T": lambda d: True,
    b"F": lambda d: False,
    b"i": _Decoder.q,
    b"I": _big_int,
    b"f": lambda d: _D.unpack(d.take(8))[0],
    b"c": lambda d: complex(*_DD.unpack(d.take(16))),
    b"s": _Decoder.string,
    b"b": lambda d: d.take(d.u32()),
    b"B": lambda d: bytearray(d.take(d.u32())),
    b"(": lambda d: tuple(d.items()),
    b"k": _int_run,
    b"[": _Decoder.items,
    b"{": lambda d: dict(d.pairs()),
    b"}": _ordered,
    b"S": lambda d: set(d.items()),
    b"Z": lambda d: frozenset(d.items()),
    b"t": _tensor,
    b"D": _dtype,
    b"L": _torch_enum,
    b"v": lambda d: torch.device(d.string()),
    b"z": _size,
    b"/": _slice,
    b".": lambda d: Ellipsis,
    b"R": _range,
    b"r": lambda d: allowlist.resolve(d.text(), d.text()),
    b"n": _named_tuple,
    b"d": _dataclass,
    b"O": _plain_object,
    b"e": _exception,
    b"x": _reduced,
}
_DECODE: list[Callable[[_Decoder], Any]] = [_bad] * 256
for _tag, _fn in _TABLE.items():
    _DECODE[_tag[0]] = _fn


def decode(raw: bytes | memoryview, tensors: Sequence[torch.Tensor]) -> Any:
    """The value ``raw`` encodes; its tensor references index ``tensors``."""
    buf = bytes(raw)
    if buf[:2] != MAGIC:
        hint = " (it is a pickle: the sender uses serializer='pickle')" if buf[:1] == b"\x80" else ""
        raise ProtocolError(
            f"a message is not in the safe serializer's format{hint}; under serializer='safe' nothing is "
            "unpickled: give every worker of the group the same RpcBackendOptions(serializer=...)"
        )
    d = _Decoder(buf, tensors)
    d.pos = 2
    obj = d.value()
    if d.pos != len(buf):
        raise ProtocolError(f"{len(buf) - d.pos} stray bytes after a safe message's value")
    return obj


def decode_head(raw: bytes | memoryview) -> tuple[Sequence[serialization.TensorMeta], dict[str, Any] | None]:
    """(tensor metas, extras) of ``safe_encoding.encode_head``'s bytes, in its head layout or
    (metas it cannot hold) the generic encoding of the pair."""
    buf = bytes(raw)
    if len(buf) < 3 or buf[:2] != MAGIC or buf[2] != HEAD_TAG:
        return _generic_head(decode(buf, ()))
    d = _Decoder(buf, ())
    d.pos = 3
    n = d.count()
    pos, end = d.pos, len(buf)
    metas: list[Any] = []
    for _ in range(n):
        if pos + META_PREFIX.size > end:
            raise ProtocolError("a safe frame head ends in the middle of a tensor meta")
        ndim = buf[pos + 5]
        if ndim > MAX_META_DIMS:
            raise ProtocolError(f"a safe frame head gives a tensor {ndim} dimensions (at most {MAX_META_DIMS})")
        layout = meta_struct(ndim)
        if pos + layout.size > end:
            raise ProtocolError("a safe frame head ends in the middle of a tensor meta")
        v = layout.unpack_from(buf, pos)
        pos += layout.size
        metas.append((v[0], v[1], v[3 : 3 + ndim], v[3 + ndim : 3 + 2 * ndim], v[-2], v[-1]))
    d.pos = pos
    extras = d.value()
    if d.pos != end:
        raise ProtocolError(f"{end - d.pos} stray bytes after a safe frame head")
    if extras is not None and not isinstance(extras, dict):
        raise ProtocolError("a frame head's extras are not a dict")
    return metas, extras


def _generic_head(decoded: Any) -> tuple[Sequence[serialization.TensorMeta], dict[str, Any] | None]:
    if not (isinstance(decoded, tuple) and len(decoded) == 2 and isinstance(decoded[0], (list, tuple))):
        raise ProtocolError("a frame head is not (tensor metas, extras)")
    metas, extras = decoded
    if extras is not None and not isinstance(extras, dict):
        raise ProtocolError("a frame head's extras are not a dict")
    for m in metas:
        if not (isinstance(m, tuple) and len(m) == 6 and isinstance(m[1], (int, torch.dtype))):
            raise ProtocolError(f"a frame head's tensor meta {m!r} is malformed")
    return metas, extras


def loads_plain(raw: bytes) -> Any:
    """The value of ``safe_encoding.dumps_plain``'s bytes (no tensors)."""
    return decode(raw, ())
