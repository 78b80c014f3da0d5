"""The safe serializer (``RpcBackendOptions(serializer="safe")``): messages without pickle.

A message body (and frame head) is one value in a compact self-describing encoding of
rpc_core's own, a tag byte then the value's bytes (little endian)::

    N T F                 None, True, False
    i q / I u32 bytes     int in 64 bits / a larger one (two's complement, at most 4 KB)
    f d / c dd            float / complex
    s u32 utf8 / b u32 / B u32    str / bytes / bytearray
    ( [ { } S Z  u32 n    tuple, list, dict (n key-value pairs), OrderedDict, set, frozenset
    k u32 n q*n           a tuple of 1..32 ints that each fit 64 bits, in one run
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

A frame head is "H u32 n", n tensor metas of a fixed layout, then the extras (``encode_head``).

Decoding calls only what ``allowlist.resolve`` returns for a name (and builds containers,
numbers, tensors); a name outside the allowlist raises ``NotAllowedError`` naming it. Every
length is checked against the bytes left before anything is allocated, and nesting is bounded.
"""

from __future__ import annotations

import collections
import dataclasses
import struct
import types
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, NoReturn

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
_MIN_Q, _END_Q = -(1 << 63), 1 << 63

# A tuple of at most MAX_INT_RUN int64s (tensor sizes, ids, autograd message ids) travels as
# one run, "k u32 n q*n", packed and unpacked by one struct call instead of one per item.
MAX_INT_RUN = 32
INT_RUN_TAG = ord("k")
_INT_RUNS = [struct.Struct(f"<BI{n}q") for n in range(MAX_INT_RUN + 1)]
_ONLY_INT = {int}
# A frame head under the safe serializer: "H u32 n" then n tensor metas, each one struct
# (buffer u32, dtype code u8, ndim u8, size q*ndim, stride q*ndim, offset q, flags u8), then
# the extras as one value. Metas this layout cannot hold (a dtype sent as itself) take the
# generic encoding of (metas, extras), which decode_head also reads.
HEAD_TAG = ord("H")
MAX_META_DIMS = 64  # torch's own limit on a tensor's dimensions
META_PREFIX = struct.Struct("<IBB")
_META_STRUCTS: dict[int, struct.Struct] = {}


def meta_struct(ndim: int) -> struct.Struct:
    """The layout of one tensor meta of ``ndim`` dimensions in a safe frame head."""
    s = _META_STRUCTS.get(ndim)
    if s is None:
        s = _META_STRUCTS[ndim] = struct.Struct(f"<IBB{2 * ndim}qqB")
    return s


_TORCH_ENUMS = (torch.layout, torch.memory_format)
_TOO_DEEP = f"the value is nested more than {MAX_DEPTH} deep; the safe serializer refuses it"
# The "r s s" bytes of each function or class sent so far (the same few travel in every
# message); bounded, since a process may send many distinct classes over its life.
_NAMES: dict[Any, bytes] = {}
_MAX_NAMES = 4096


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

    # items and mapping run for every container: the per-item dispatch is inlined, and an
    # int (the most frequent item) is packed without a call.
    def items(self, tag: bytes, seq: Any) -> None:
        depth = self.depth = self.depth + 1
        if depth > MAX_DEPTH:
            raise ValueError(_TOO_DEEP)
        self.count(tag, len(seq))
        out = self.out
        get = _ENCODE.get
        for item in seq:
            cls = type(item)
            if cls is int and _MIN_Q <= item < _END_Q:
                out += _TAG_Q.pack(105, item)  # b"i"
                continue
            fn = get(cls)
            if fn is not None:
                fn(self, item)
            else:
                self.other(item)
        self.depth = depth - 1

    def mapping(self, tag: bytes, d: Any) -> None:
        depth = self.depth = self.depth + 1
        if depth > MAX_DEPTH:
            raise ValueError(_TOO_DEEP)
        self.count(tag, len(d))
        get = _ENCODE.get
        for k, v in d.items():
            fn = get(type(k))
            if fn is not None:
                fn(self, k)
            else:
                self.other(k)
            fn = get(type(v))
            if fn is not None:
                fn(self, v)
            else:
                self.other(v)
        self.depth = depth - 1

    def text(self, tag: bytes, s: str) -> None:
        raw = s.encode("utf-8", "surrogatepass")
        self.count(tag, len(raw))
        self.out += raw

    def name(self, obj: Any) -> None:
        try:
            raw = _NAMES.get(obj)
        except TypeError:  # unhashable: name_of refuses it below
            raw = None
        if raw is None:
            module, qualname = allowlist.name_of(obj)
            m, q = module.encode("utf-8", "surrogatepass"), qualname.encode("utf-8", "surrogatepass")
            raw = b"r" + _TAG_U32.pack(115, len(m)) + m + _TAG_U32.pack(115, len(q)) + q  # r s.. s..
            if len(_NAMES) < _MAX_NAMES:
                _NAMES[obj] = raw
        self.out += raw

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
        # A registered reducer wins (looked up every time: one may be registered later).
        reducer = serialization.reducer_for(cls)
        if reducer is not None and not isinstance(obj, torch.Tensor):
            fn, args = reducer(obj)
            self.out += b"x"
            self.name(fn)
            self.items(b"(", tuple(args))
            return
        # How a class travels depends on the class only: decided once per class.
        handler = _BY_CLASS.get(cls)
        if handler is None:
            handler = _handler_for(cls)
            if len(_BY_CLASS) < _MAX_NAMES:
                _BY_CLASS[cls] = handler
        handler(self, obj)


def _other_tensor(e: _Encoder, obj: Any) -> None:
    e.tensor(obj)


def _other_name(e: _Encoder, obj: Any) -> None:
    e.name(obj)


def _other_named_tuple(e: _Encoder, obj: Any) -> None:
    e.out += b"n"
    e.name(type(obj))
    e.items(b"(", obj)


def _other_exception(e: _Encoder, obj: Any) -> None:
    e.out += b"e"
    e.name(type(obj))
    e.items(b"(", obj.args)
    e.text(b"s", str(obj))


def _other_ordered(e: _Encoder, obj: Any) -> None:
    e.mapping(b"}", obj)


def _other_enum(e: _Encoder, obj: Any) -> None:
    e.text(b"L", str(obj).rsplit(".", 1)[-1])


def _other_dataclass(e: _Encoder, obj: Any) -> None:
    cls = type(obj)
    names = _field_names(cls)
    e.out += b"d"
    e.name(cls)
    e.count(b"(", len(names))
    e.depth += 1
    for n in names:
        e.text(b"s", n)
        e.value(getattr(obj, n))
    e.depth -= 1


def _other_plain(e: _Encoder, obj: Any) -> None:
    state = getattr(obj, "__dict__", None)
    if not isinstance(state, dict):
        _refuse(e, obj)
    e.out += b"O"
    e.name(type(obj))
    e.mapping(b"{", state)


def _refuse(e: _Encoder, obj: Any) -> NoReturn:
    cls = type(obj)
    raise NotAllowedError(
        f"the safe serializer cannot send a {cls.__module__}.{cls.__qualname__}: it sends tensors, numbers, "
        "strings, bytes, None, containers, RRefs, WorkerInfo, exceptions, allowed functions and classes, and "
        "dataclasses, NamedTuples or plain objects of allowed classes (a class with a __reduce__, "
        "__getstate__ or __setstate__ of its own is refused: send its fields instead)"
    )


def _handler_for(cls: type) -> Callable[[_Encoder, Any], None]:
    """How an object of ``cls`` (not in the exact-type table, no reducer) travels; the
    checks in the order a class could pass several of them."""
    if issubclass(cls, torch.Tensor):
        return _other_tensor
    if issubclass(cls, (type, *allowlist.FUNCTION_TYPES)):
        return _other_name
    if issubclass(cls, tuple) and hasattr(cls, "_fields"):
        return _other_named_tuple
    if issubclass(cls, BaseException):
        return _other_exception
    if issubclass(cls, collections.OrderedDict):
        return _other_ordered
    if issubclass(cls, _TORCH_ENUMS):
        return _other_enum
    if dataclasses.is_dataclass(cls):
        return _other_dataclass
    if is_plain(cls):
        return _other_plain
    return _refuse


_BY_CLASS: dict[type, Callable[[_Encoder, Any], None]] = {}


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


def _enc_tuple(e: _Encoder, v: tuple[Any, ...]) -> None:
    n = len(v)
    if 0 < n <= MAX_INT_RUN and {*map(type, v)} == _ONLY_INT:
        try:
            e.out += _INT_RUNS[n].pack(INT_RUN_TAG, n, *v)
            return
        except struct.error:  # an int beyond 64 bits: item by item
            pass
    e.items(b"(", v)


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
    tuple: _enc_tuple,
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
    # Functions and plain classes go by name (a reducer registered for them would not apply,
    # as for the containers above; other() decides for metaclasses and builtins' kinds).
    types.FunctionType: lambda e, v: e.name(v),
    type: lambda e, v: e.name(v),
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


def encode_head(metas: Sequence[Any], extras: dict[str, Any] | None) -> bytes:
    """A frame head's bytes: its tensor metas (``serialization.TensorMeta``) in their own
    layout (HEAD_TAG), then the extras; ``safe_decoding.decode_head`` reads them."""
    e = _Encoder()
    out = e.out
    out += _TAG_U32.pack(HEAD_TAG, len(metas))
    try:
        for buffer, dtype, size, stride, offset, flags in metas:
            ndim = len(size)
            if type(dtype) is not int or len(stride) != ndim or ndim > MAX_META_DIMS:
                raise ValueError("not a meta of the head layout")
            out += meta_struct(ndim).pack(buffer, dtype, ndim, *size, *stride, offset, flags)
    except (ValueError, TypeError, struct.error):  # a dtype by itself, a field out of range
        e = _Encoder()
        e.value((metas, extras or None))
    else:
        e.value(extras or None)
    if e.tensors:
        raise TypeError("a frame head's extras hold a tensor; send tensors in the message itself")
    return bytes(e.out)


def dumps_plain(obj: Any) -> bytes:
    """Bytes of a value without tensors (the rendezvous' and the identity frame's)."""
    raw, tensors, _ = encode(obj)
    if tensors:
        raise ValueError("dumps_plain takes values without tensors")
    return raw
