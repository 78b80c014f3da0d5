"""Turn Python objects into (head, body, buffers) and back, tensors out of band.

``serialize`` pickles an object; every tensor inside it is replaced by a reference into a
table of tensor metas (dtype, shape, strides, storage offset, requires_grad) and its storage
bytes become a separate buffer (a zero-copy memoryview of tensor memory). ``deserialize``
first rebuilds the tensors from the buffers (which the transport received straight into
fresh storage), lets a hook transform them (distributed autograd attaches its recv node
there), then unpickles the body with the references resolved.

Tensors that share a storage in one message share it again on the receiver, so views stay
views; a small view of a large storage only ships the bytes it spans.

Functions travel by reference (module + qualified name), never as code. Higher layers
register reducers for their own types (``register_reducer``), e.g. RRef forks.
"""

from __future__ import annotations

import ctypes
import io
import pickle
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import torch

from ..errors import ProtocolError

_tls = threading.local()
SAFE_MAGIC = b"\xa7S"  # how the safe serializer's messages start (safe_encoding.MAGIC)
_REDUCERS: dict[type, Callable[[Any], Any]] = {}


# A tensor's meta in the frame head is a plain tuple (a NamedTuple pickles through its class
# and costs a Python call per tensor to rebuild):
#   (buffer index, dtype code, size, stride, offset in elements from the buffer's start, flags)
# The dtype code indexes _DTYPES; a dtype not listed there travels as the dtype itself.
TensorMeta = tuple[int, Any, tuple[int, ...], tuple[int, ...], int, int]
_REQUIRES_GRAD, _IS_PARAM = 1, 2
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_DTYPE_CODES = {dt: i for i, dt in enumerate(_DTYPES)}


def register_reducer(cls: type, reducer: Callable[[Any], Any]) -> None:
    """Make ``cls`` travel as ``reducer(obj) -> (callable, args)`` inside RPC messages (under
    serializer="safe" too: ``callable`` must then be in the receiver's allowlist)."""
    _REDUCERS[cls] = reducer


def reducer_for(cls: type) -> Callable[[Any], Any] | None:
    return _REDUCERS.get(cls)


class Codec(Protocol):
    """A serializer other than pickle (``safe_codec``): what ``serialize``, ``encode_head``,
    ``decode_head`` and ``unpickle_body`` use instead of pickle once installed."""

    name: str

    def serialize(self, obj: Any) -> Serialized: ...

    def encode_head(self, metas: Sequence[TensorMeta], extras: dict[str, Any] | None) -> bytes: ...

    def decode_head(self, head: bytes) -> tuple[Sequence[TensorMeta], dict[str, Any] | None]: ...

    def loads(self, body: Any, tensors: Sequence[torch.Tensor]) -> Any: ...


# The process's serializer: None is pickle. One per process, as there is one agent
# (init_rpc installs the one its options name).
_codec: Codec | None = None


def use_codec(codec: Codec | None) -> None:
    global _codec
    _codec = codec


def codec_name() -> str:
    """ "pickle", or the installed codec's name ("safe")."""
    return "pickle" if _codec is None else _codec.name


def storage_view(storage: torch.UntypedStorage, start: int = 0, end: int | None = None) -> memoryview:
    """A writable byte memoryview over a storage's memory, without copying."""
    end = storage.nbytes() if end is None else end
    n = end - start
    if n <= 0:
        return memoryview(b"")
    arr = (ctypes.c_char * n).from_address(storage.data_ptr() + start)
    return memoryview(arr).cast("B")


def _tensor_from_table(index: int) -> torch.Tensor:
    t: torch.Tensor = _tls.tensors[index]
    return t


# Compressed sparse layouts by the code they travel under.
_COMPRESSED = {torch.sparse_csr: 0, torch.sparse_csc: 1, torch.sparse_bsr: 2, torch.sparse_bsc: 3}
_COMPRESSED_LAYOUTS = list(_COMPRESSED)


def compressed_parts(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(compressed indices, plain indices, values) of a CSR/CSC/BSR/BSC tensor."""
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return t.crow_indices(), t.col_indices(), t.values()
    return t.ccol_indices(), t.row_indices(), t.values()


# Sparse tensors are rebuilt with their invariants checked (indices in range, compressed
# indices sorted): the bytes come from a peer, and torch reads out of bounds on a sparse
# tensor that breaks them.
def sparse_coo(
    indices: torch.Tensor, values: torch.Tensor, size: tuple[int, ...], coalesced: bool, leaf_grad: bool
) -> torch.Tensor:
    t = torch.sparse_coo_tensor(indices, values, size, check_invariants=True, is_coalesced=coalesced)
    return t.requires_grad_() if leaf_grad and not t.requires_grad else t


def sparse_compressed(
    compressed: torch.Tensor,
    plain: torch.Tensor,
    values: torch.Tensor,
    size: tuple[int, ...],
    layout: int,
    leaf_grad: bool,
) -> torch.Tensor:
    if not isinstance(layout, int) or not 0 <= layout < len(_COMPRESSED_LAYOUTS):
        raise ValueError(f"unknown compressed sparse layout code {layout!r}")
    t = torch.sparse_compressed_tensor(
        compressed, plain, values, size, layout=_COMPRESSED_LAYOUTS[layout], check_invariants=True
    )
    return t.requires_grad_() if leaf_grad and not t.requires_grad else t


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._tensors = tensors

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if obj.is_nested:
                raise TypeError("rpc_core cannot send nested tensors; send the list of its parts (t.unbind())")
            if obj.layout is not torch.strided:
                # Sparse tensors travel as their dense parts, which are tensors themselves
                # (their buffers out of band like any other).
                if obj.layout == torch.sparse_coo:
                    return sparse_coo, (
                        obj._indices(),
                        obj._values(),
                        tuple(obj.size()),
                        obj.is_coalesced(),
                        obj.requires_grad and obj.is_leaf,
                    )
                if obj.layout in _COMPRESSED:
                    return sparse_compressed, (
                        *compressed_parts(obj),
                        tuple(obj.size()),
                        _COMPRESSED[obj.layout],
                        obj.requires_grad and obj.is_leaf,
                    )
                raise TypeError(
                    f"rpc_core cannot send tensors with layout {obj.layout}; send .to_dense(), "
                    "or a COO/CSR/CSC/BSR/BSC sparse tensor"
                )
            if not obj.is_cpu:
                raise TypeError(
                    f"rpc_core sends CPU tensors only, got a tensor on {obj.device}; move it with "
                    ".cpu() before sending (torch RPC needs a device map for this)"
                )
            self._tensors.append(obj)
            return _tensor_from_table, (len(self._tensors) - 1,)
        reducer = _REDUCERS.get(type(obj))
        if reducer is not None:
            return reducer(obj)
        return NotImplemented


_Parameter = torch.nn.Parameter
# What _pack_tensors learns of a tensor: (tensor, storage, storage's data_ptr, element size,
# offset in elements, size, stride, first byte, end byte of its span, empty).
_TensorInfo = tuple[torch.Tensor, torch.UntypedStorage, int, int, int, tuple[int, ...], tuple[int, ...], int, int, bool]


def _pack_tensors(tensors: Sequence[torch.Tensor]) -> tuple[list[TensorMeta], list[memoryview], list[Any]]:
    """Group tensors by storage; each storage ships once, or only the bytes its views span."""
    if len(tensors) == 1:
        packed = _pack_whole(tensors[0])
        if packed is not None:
            return packed
    # One pass over the tensors: every accessor below is a call into torch. Plain loops, no
    # generators: this runs for every tensor of every message.
    infos: list[_TensorInfo] = []
    by_storage: dict[int, list[int]] = {}  # data_ptr -> indices into infos
    for t in tensors:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        esize = t.element_size()
        offset: int = t.storage_offset()  # type: ignore[assignment]  # torch's stubs: a SymInt only when tracing
        size, stride = tuple(t.size()), tuple(t.stride())
        empty = t.numel() == 0
        last = offset
        if not empty:
            last += 1
            for n, st in zip(size, stride, strict=True):
                last += (n - 1) * st
        members = by_storage.get(ptr)
        if members is None:
            by_storage[ptr] = [len(infos)]
        else:
            members.append(len(infos))
        infos.append((t, storage, ptr, esize, offset, size, stride, offset * esize, last * esize, empty))
    buffers: list[memoryview] = []
    keepalive: list[Any] = []
    groups: dict[int, tuple[int, int]] = {}  # data_ptr -> (buffer index, start byte)
    for ptr, members in by_storage.items():
        info = infos[members[0]]
        storage, lo, hi = info[1], info[7], info[8]
        for i in members[1:]:
            lo, hi = min(lo, infos[i][7]), max(hi, infos[i][8])
        nbytes = storage.nbytes()
        if ptr == 0 or hi <= lo:
            lo = hi = 0
        elif (hi - lo) * 2 > nbytes:
            lo, hi = 0, nbytes  # mostly covered: ship it whole
        else:
            # Views of several dtypes may share the storage: start the span on a multiple of
            # every element size (all divide 16) so each view's offset stays a whole element.
            lo -= lo % 16
        groups[ptr] = (len(buffers), lo)
        buffers.append(storage_view(storage, lo, hi))
        keepalive.append(storage)
    metas: list[TensorMeta] = []
    for t, _, ptr, esize, offset, size, stride, _, _, empty in infos:
        index, lo = groups[ptr]
        metas.append(_meta(t, index, size, stride, 0 if empty else (offset * esize - lo) // esize))
    return metas, buffers, keepalive


def _meta(t: torch.Tensor, index: int, size: tuple[int, ...], stride: tuple[int, ...], offset: int) -> TensorMeta:
    # Parameter's isinstance goes through a Python-level metaclass hook: test the class first.
    cls = t.__class__
    is_param = cls is _Parameter or (cls is not torch.Tensor and isinstance(t, _Parameter))
    dtype = t.dtype
    return (
        index,
        _DTYPE_CODES.get(dtype, dtype),
        size,
        stride,
        offset,
        (_REQUIRES_GRAD if t.requires_grad else 0) | (_IS_PARAM if is_param else 0),
    )


def _pack_whole(t: torch.Tensor) -> tuple[list[TensorMeta], list[memoryview], list[Any]] | None:
    """The common message, one contiguous tensor that is its whole storage (a fresh result,
    a parameter), packed with a few accessors; None for anything else (the general path)."""
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    if t.storage_offset() or t.nbytes != nbytes or not nbytes or not t.is_contiguous():
        return None
    return [_meta(t, 0, tuple(t.size()), tuple(t.stride()), 0)], [storage_view(storage, 0, nbytes)], [storage]


class Serialized(NamedTuple):
    metas: list[TensorMeta]
    body: bytes
    buffers: list[memoryview]
    tensors: list[torch.Tensor]  # the tensors found, in table order (autograd records sends on them)
    keepalive: list[Any]  # storages that must outlive the send


_new_tuple = tuple.__new__


class _PicklerSlot:
    """A per-thread pickler, reused across messages (building one costs more than a
    small message's whole pickling)."""

    def __init__(self) -> None:
        self.file = io.BytesIO()
        self.tensors: list[torch.Tensor] = []
        self.pickler = _Pickler(self.file, self.tensors)
        self.busy = False


def serialize(obj: Any) -> Serialized:
    if _codec is not None:
        return _codec.serialize(obj)
    slot = getattr(_tls, "slot", None)
    if slot is None or slot.busy:  # first use on this thread, or a reducer re-entered us
        slot = _PicklerSlot()
        if getattr(_tls, "slot", None) is None:
            _tls.slot = slot
    slot.busy = True
    f, tensors = slot.file, slot.tensors
    try:
        slot.pickler.dump(obj)
        body = f.getvalue()
    finally:
        slot.pickler.clear_memo()
        f.seek(0)
        f.truncate()
        tensors = list(tensors)
        slot.tensors.clear()
        slot.busy = False
    return packed(body, tensors)


def packed(body: bytes, tensors: list[torch.Tensor]) -> Serialized:
    """A message of ``body`` and the tensors its references index, their buffers packed."""
    if not tensors:
        return _new_tuple(Serialized, ([], body, [], tensors, []))  # tuple.__new__: no Python-level constructor
    metas, buffers, keepalive = _pack_tensors(tensors)
    return _new_tuple(Serialized, (metas, body, buffers, tensors, keepalive))


def encode_head(metas: Sequence[TensorMeta], extras: dict[str, Any] | None) -> bytes:
    """The frame head: tensor metas and message extras (autograd ids, profiling, ...)."""
    if not metas and not extras:
        return b""
    if _codec is not None:
        return _codec.encode_head(metas, extras)
    return pickle.dumps((metas, extras or None), pickle.HIGHEST_PROTOCOL)


def decode_head(head: bytes) -> tuple[Sequence[TensorMeta], dict[str, Any] | None]:
    if not head:
        return (), None
    if _codec is not None:
        return _codec.decode_head(head)
    decoded: tuple[Sequence[TensorMeta], dict[str, Any] | None] = pickle.loads(head)
    return decoded


# One empty tensor per dtype: ``template.new()`` makes the next empty tensor of that dtype
# without parsing torch.empty's arguments (per received tensor).
_TEMPLATES: dict[torch.dtype, torch.Tensor] = {}


def rebuild_tensors(metas: Sequence[TensorMeta], storages: Sequence[torch.UntypedStorage]) -> list[torch.Tensor]:
    out = []
    for buffer, dtype, size, stride, offset, flags in metas:
        if type(dtype) is int:
            if not 0 <= dtype < len(_DTYPES):
                raise ValueError(
                    f"tensor meta names dtype code {dtype}, which no rpc_core version sends "
                    f"(codes are 0..{len(_DTYPES) - 1}); the peer is broken or not rpc_core"
                )
            dtype = _DTYPES[dtype]
        template = _TEMPLATES.get(dtype)
        if template is None:
            template = _TEMPLATES[dtype] = torch.empty(0, dtype=dtype)
        t = template.new().set_(storages[buffer], offset, size, stride)
        if flags & _IS_PARAM:
            t = _Parameter(t, requires_grad=bool(flags & _REQUIRES_GRAD))
        elif flags & _REQUIRES_GRAD:
            t.requires_grad_(True)
        out.append(t)
    return out


def defer_until(fut: torch.futures.Future[Any]) -> None:
    """Called while unpickling: the message's user function must wait for ``fut``
    (e.g. an RRef fork's confirmation) before it runs."""
    waits = getattr(_tls, "waits", None)
    if waits is not None:
        waits.append(fut)


def note_for_reply(key: str, item: Any) -> bool:
    """Called while unpickling a request: ``item`` goes back to the request's sender in the
    response's extras, in a list under ``key``. False when no request is being unpickled:
    the caller must then tell the sender some other way."""
    notes = getattr(_tls, "notes", None)
    if notes is None:
        return False
    notes.setdefault(key, []).append(item)
    return True


def unpickle_body(
    body: Any,
    tensors: Sequence[torch.Tensor],
    waits: list[torch.futures.Future[Any]] | None = None,
    notes: dict[str, list[Any]] | None = None,
) -> Any:
    prev = getattr(_tls, "tensors", None), getattr(_tls, "waits", None), getattr(_tls, "notes", None)
    _tls.tensors, _tls.waits, _tls.notes = tensors, waits, notes
    try:
        if _codec is not None:
            return _codec.loads(body, tensors)
        if body[:2] == SAFE_MAGIC:
            raise ProtocolError(
                "a message is in the safe serializer's format (the sender uses serializer='safe') but this "
                "worker uses 'pickle': give every worker of the group the same RpcBackendOptions(serializer=...)"
            )
        return pickle.loads(body)
    finally:
        _tls.tensors, _tls.waits, _tls.notes = prev


def deserialize(
    head: bytes,
    body: Any,
    storages: Sequence[torch.UntypedStorage],
    tensor_hook: Callable[[list[torch.Tensor], Sequence[TensorMeta], dict[str, Any]], list[torch.Tensor]] | None = None,
    waits: list[torch.futures.Future[Any]] | None = None,
    notes: dict[str, list[Any]] | None = None,
) -> tuple[Any, dict[str, Any] | None]:
    """Inverse of ``serialize``; returns (object, extras). Futures the body's objects ask to
    wait for (``defer_until``) are appended to ``waits``; what they want to tell the sender
    (``note_for_reply``) goes into ``notes``."""
    metas, extras = decode_head(head)
    return deserialize_decoded(metas, extras, body, storages, tensor_hook, waits, notes), extras


def deserialize_decoded(
    metas: Sequence[TensorMeta],
    extras: dict[str, Any] | None,
    body: Any,
    storages: Sequence[torch.UntypedStorage],
    tensor_hook: Callable[[list[torch.Tensor], Sequence[TensorMeta], dict[str, Any]], list[torch.Tensor]] | None = None,
    waits: list[torch.futures.Future[Any]] | None = None,
    notes: dict[str, list[Any]] | None = None,
) -> Any:
    """``deserialize`` for a head that was decoded already (``decode_head``)."""
    tensors = rebuild_tensors(metas, storages) if metas else []
    if tensor_hook is not None and tensors:
        tensors = tensor_hook(tensors, metas, extras or {})
    return unpickle_body(body, tensors, waits, notes)


def loopback(buffers: Sequence[memoryview]) -> list[torch.UntypedStorage]:
    """Storages for a message delivered to this same process (a call to self still copies,
    as torch does, so the callee never aliases the caller's tensors)."""
    out = []
    for mv in buffers:
        st = torch.UntypedStorage(len(mv))
        if len(mv):
            storage_view(st)[:] = mv
        out.append(st)
    return out
