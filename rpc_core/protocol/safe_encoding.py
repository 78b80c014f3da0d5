"""The safe serializer (``RpcBackendOptions(serializer="safe")``): messages without pickle.

A message body (and frame head) is one value in a compact self-describing encoding of
rpc_core's own, a tag byte then the value's bytes (little endian)::

    N T F                 None, True, False
    i q / I u32 bytes     int in 64 bits / a larger one (two's complement, at most 4 KB)
    f d / c dd            float / complex
    s u32 utf8 / b u32 / B u32    str / bytes / bytearray
    ( [ { } S Z  u32 n    tuple, list, dict (n key-value pairs), OrderedDict, set, frozenset
    t u32                 a tensor: index into the frame's tensor table (serialization: its
                          bytes travel out of band, as under pickle; a sparse tensor is an
                          entry of the table too, after its parts)
    D s / L s / v s / z   torch dtype / layout or memory format (by name) / device / Size
    / . R                 slice(start, stop, step) / Ellipsis / range(start, stop, step)
    r s s                 a function or class: module, qualified name (resolved by ``allowlist``)
    n r (                 a NamedTuple: its class, its fields
    d r u32 (s v)*        a dataclass: its class, its fields by name
    O r {                 a plain object of a class without a reduction of its own: its __dict__
    e r ( s               an exception: its class, args, str(e)
    x r (                 an object rpc_core reduces (``serialization.register_reducer``: RRefs,
                          WorkerInfo, RemoteModule): the rebuilding function and its arguments

Decoding calls only what ``allowlist.resolve`` returns for a name (and builds containers,
numbers, tensors); a name outside the allowlist raises ``NotAllowedError`` naming it. Every
length is checked against the bytes left before anything is allocated, and nesting is bounded.
"""

from __future__ import annotations

import collections
import dataclasses
import struct
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ..errors import NotAllowedError
from . import allowlist, serialization

MAGIC = serialization.SAFE_MAGIC  # starts every safe body and head (a pickle starts with 0x80)
MAX_DEPTH = 100
MAX_BIG_INT = 4096

_Q = struct.Struct("<q")
_D = struct.Struct("<d")
_DD = struct.Struct("<dd")
_U32 = struct.Struct("<I")
_TAG_U32 = struct.Struct("<BI")
_TAG_Q = struct.Struct("<Bq")
_MAX_U32 = (1 << 32) - 1

_TORCH_ENUMS = (torch.layout, torch.memory_format)


class _Encoder:
    __slots__ = ("out", "tensors", "sparse", "depth")

    def __init__(self) -> None:
        self.out = bytearray(MAGIC)
        self.tensors: list[torch.Tensor] = []
        self.sparse: list[int] = []  # indices of the table's sparse entries
        self.depth = 0

    def value(self, obj: Any) -> None:
        fn = _ENCODE.get(type(obj))
        if fn is not None:
            fn(self, obj)
        else:
            self.other(obj)

    def count(self, tag: bytes, n: int) -> None:
        if n > _MAX_U32:
            raise ValueError(f"a container of {n} items is too large for one message")
        self.out += _TAG_U32.pack(tag[0], n)

    def items(self, tag: bytes, seq: Any) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise ValueError(f"the value is nested more than {MAX_DEPTH} deep; the safe serializer refuses it")
        self.count(tag, len(seq))
        for item in seq:
            self.value(item)
        self.depth -= 1

    def mapping(self, tag: bytes, d: Any) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise ValueError(f"the value is nested more than {MAX_DEPTH} deep; the safe serializer refuses it")
        self.count(tag, len(d))
        for k, v in d.items():
            self.value(k)
            self.value(v)
        self.depth -= 1

    def text(self, tag: bytes, s: str) -> None:
        raw = s.encode("utf-8", "surrogatepass")
        self.count(tag, len(raw))
        self.out += raw

    def name(self, obj: Any) -> None:
        module, qualname = allowlist.name_of(obj)
        self.out += b"r"
        self.text(b"s", module)
        self.text(b"s", qualname)

    def tensor(self, t: torch.Tensor) -> None:
        if t.is_nested:
            raise TypeError("rpc_core cannot send nested tensors; send the list of its parts (t.unbind())")
        if t.layout is not torch.strided:  # an entry of its own, after its parts (serialization.add_sparse)
            self.sparse.append(serialization.add_sparse(self.tensors, t))
            self.out += b"t" + _U32.pack(self.sparse[-1])
            return
        if not t.is_cpu:
            raise TypeError(
                f"rpc_core sends CPU tensors only, got a tensor on {t.device}; move it with "
                ".cpu() before sending (torch RPC needs a device map for this)"
            )
        self.out += b"t" + _U32.pack(len(self.tensors))
        self.tensors.append(t)

    def other(self, obj: Any) -> None:
        """Everything the exact-type table does not cover."""
        cls = type(obj)
        if isinstance(obj, torch.Tensor):
            self.tensor(obj)
            return
        reducer = serialization.reducer_for(cls)
        if reducer is not None:
            fn, args = reducer(obj)
            self.out += b"x"
            self.name(fn)
            self.items(b"(", tuple(args))
            return
        if isinstance(obj, (type, *allowlist.FUNCTION_TYPES)):
            self.name(obj)
            return
        if isinstance(obj, tuple) and hasattr(cls, "_fields"):
            self.out += b"n"
            self.name(cls)
            self.items(b"(", obj)
            return
        if isinstance(obj, BaseException):
            self.out += b"e"
            self.name(cls)
            self.items(b"(", obj.args)
            self.text(b"s", str(obj))
            return
        if isinstance(obj, collections.OrderedDict):
            self.mapping(b"}", obj)
            return
        if isinstance(obj, _TORCH_ENUMS):
            self.text(b"L", str(obj).rsplit(".", 1)[-1])
            return
        if dataclasses.is_dataclass(obj):
            names = _field_names(cls)
            self.out += b"d"
            self.name(cls)
            self.count(b"(", len(names))
            self.depth += 1
            for n in names:
                self.text(b"s", n)
                self.value(getattr(obj, n))
            self.depth -= 1
            return
        if is_plain(cls) and isinstance(getattr(obj, "__dict__", None), dict):
            self.out += b"O"
            self.name(cls)
            self.mapping(b"{", obj.__dict__)
            return
        raise NotAllowedError(
            f"the safe serializer cannot send a {cls.__module__}.{cls.__qualname__}: it sends tensors, numbers, "
            "strings, bytes, None, containers, RRefs, WorkerInfo, exceptions, allowed functions and classes, and "
            "dataclasses, NamedTuples or plain objects of allowed classes (a class with a __reduce__, "
            "__getstate__ or __setstate__ of its own is refused: send its fields instead)"
        )


def _enc_int(e: _Encoder, v: int) -> None:
    if -(1 << 63) <= v < (1 << 63):
        e.out += _TAG_Q.pack(105, v)  # b"i"
    else:
        raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
        if len(raw) > MAX_BIG_INT:
            raise ValueError(f"an int of {len(raw)} bytes is too large for the safe serializer (max {MAX_BIG_INT})")
        e.count(b"I", len(raw))
        e.out += raw


def _enc_bytes(tag: bytes) -> Callable[[_Encoder, Any], None]:
    def enc(e: _Encoder, v: Any) -> None:
        e.count(tag, len(v))
        e.out += v

    return enc


def _enc_size(e: _Encoder, v: torch.Size) -> None:
    e.count(b"z", len(v))
    for n in v:
        e.out += _Q.pack(n)


def _enc_slice(e: _Encoder, v: slice) -> None:
    e.out += b"/"
    e.items(b"(", (v.start, v.stop, v.step))


def _enc_range(e: _Encoder, v: range) -> None:
    e.out += b"R" + _Q.pack(v.start) + _Q.pack(v.stop) + _Q.pack(v.step)


_ENCODE: dict[type, Callable[[_Encoder, Any], None]] = {
    type(None): lambda e, v: e.out.extend(b"N"),
    bool: lambda e, v: e.out.extend(b"T" if v else b"F"),
    int: _enc_int,
    float: lambda e, v: e.out.extend(b"f" + _D.pack(v)),
    complex: lambda e, v: e.out.extend(b"c" + _DD.pack(v.real, v.imag)),
    str: lambda e, v: e.text(b"s", v),
    bytes: _enc_bytes(b"b"),
    bytearray: _enc_bytes(b"B"),
    tuple: lambda e, v: e.items(b"(", v),
    list: lambda e, v: e.items(b"[", v),
    dict: lambda e, v: e.mapping(b"{", v),
    set: lambda e, v: e.items(b"S", v),
    frozenset: lambda e, v: e.items(b"Z", v),
    torch.Tensor: lambda e, v: e.tensor(v),
    torch.nn.Parameter: lambda e, v: e.tensor(v),
    torch.dtype: lambda e, v: e.text(b"D", str(v).rsplit(".", 1)[-1]),
    torch.device: lambda e, v: e.text(b"v", str(v)),
    torch.Size: _enc_size,
    slice: _enc_slice,
    type(Ellipsis): lambda e, v: e.out.extend(b"."),
    range: _enc_range,
}

_FIELDS: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


def is_plain(cls: type) -> bool:
    """A class whose instances pickle as their __dict__ (no reduction or state hooks of its own)."""
    c: Any = cls  # compared with object's own slots, which the stubs type apart
    base: Any = object
    return bool(
        c.__reduce_ex__ is base.__reduce_ex__
        and c.__reduce__ is base.__reduce__
        and getattr(c, "__getstate__", None) is getattr(base, "__getstate__", None)
        and not hasattr(c, "__setstate__")
        and c.__new__ is base.__new__
    )


class Encoded(NamedTuple):
    body: bytes
    tensors: list[torch.Tensor]  # the tensor table its references index
    sparse: list[int]  # the indices of the table's sparse entries (serialization.add_sparse)


def encode(obj: Any) -> Encoded:
    """``obj`` as safe bytes, and the tensors its table references (in table order)."""
    e = _Encoder()
    e.value(obj)
    return Encoded(bytes(e.out), e.tensors, e.sparse)


def dumps_plain(obj: Any) -> bytes:
    """Bytes of a value without tensors (the rendezvous' and the identity frame's)."""
    raw, tensors, _ = encode(obj)
    if tensors:
        raise ValueError("dumps_plain takes values without tensors")
    return raw
