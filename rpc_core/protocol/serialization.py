"""Turn Python objects into (head, body, buffers) and back, tensors out of band.

``serialize`` pickles an object; every tensor inside it is replaced by a reference into a
table of tensor metas (dtype, shape, strides, storage offset, requires_grad) and its storage
bytes become a separate buffer (a zero-copy memoryview of tensor memory). ``deserialize``
first rebuilds the tensors from the buffers (which the transport received straight into
fresh storage), lets a hook transform them (distributed autograd attaches its recv node
there), then unpickles the body with the references resolved.

Tensors that share a storage in one message share it again on the receiver, so views stay
views; a small view of a large storage only ships the bytes it spans.

A sparse tensor is an entry of the table too, right after its dense parts (indices and
values), which travel like any other tensor; its meta says how to rebuild it from them.
Being an entry of its own, it keeps ``requires_grad`` as a dense tensor does, and
distributed autograd attaches its recv node to it like to any other (a gradient pass
through it carries the whole gradient of the sparse tensor, not only its values').

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
# A sparse tensor's meta: (-1, dtype code of its values, size, (), layout code, flags), its
# parts being the 2 (COO: indices, values) or 3 (compressed: compressed indices, plain
# indices, values) entries right before it (_SPARSE_LAYOUTS: the layout codes).
TensorMeta = tuple[int, Any, tuple[int, ...], tuple[int, ...], int, int]
_REQUIRES_GRAD, _IS_PARAM, _COALESCED = 1, 2, 4
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


# Sparse layouts by the code their meta names them with.
_SPARSE_LAYOUTS = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)
_SPARSE_CODES = {layout: i for i, layout in enumerate(_SPARSE_LAYOUTS)}


def compressed_parts(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(compressed indices, plain indices, values) of a CSR/CSC/BSR/BSC tensor."""
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return t.crow_indices(), t.col_indices(), t.values()
    return t.ccol_indices(), t.row_indices(), t.values()


def add_sparse(table: list[torch.Tensor], t: torch.Tensor) -> int:
    """Append sparse ``t`` to a message's tensor ``table``, its dense parts first; its index.
    The parts are detached: the gradient of a sparse tensor is the sparse tensor's, which
    travels with the tensor itself (an entry of its own), not through its parts."""
    code = _SPARSE_CODES.get(t.layout)
    if code is None:
        raise TypeError(
            f"rpc_core cannot send tensors with layout {t.layout}; send .to_dense(), "
            "or a COO/CSR/CSC/BSR/BSC sparse tensor"
        )
    if not t.is_cpu:
        raise TypeError(
            f"rpc_core sends CPU tensors only, got a tensor on {t.device}; move it with "
            ".cpu() before sending (torch RPC needs a device map for this)"
        )
    parts = (t._indices(), t._values()) if code == 0 else compressed_parts(t)
    table.extend(p.detach() for p in parts)
    table.append(t)
    return len(table) - 1


def _sparse_meta(t: torch.Tensor) -> TensorMeta:
    flags = _REQUIRES_GRAD if t.requires_grad else 0
    if isinstance(t, _Parameter):
        flags |= _IS_PARAM
    code = _SPARSE_CODES[t.layout]
    if code == 0 and t.is_coalesced():
        flags |= _COALESCED
    return (-1, _DTYPE_CODES.get(t.dtype, t.dtype), tuple(t.size()), (), code, flags)


# Sparse tensors are rebuilt with their invariants checked (indices in range, compressed
# indices sorted): the bytes come from a peer, and torch reads out of bounds on a sparse
# tensor that breaks them.
def _rebuild_sparse(built: list[torch.Tensor], dtype: Any, size: Any, code: Any, flags: int) -> torch.Tensor:
    """The sparse tensor of a meta, from its parts: the last entries of ``built``."""
    if type(code) is not int or not 0 <= code < len(_SPARSE_LAYOUTS):
        raise ValueError(f"a sparse tensor's meta names layout code {code!r}, which no rpc_core version sends")
    n = 2 if code == 0 else 3
    parts = built[-n:]
    if len(parts) != n or any(p.layout is not torch.strided or p.requires_grad for p in parts):
        raise ValueError(
            f"a sparse {_SPARSE_LAYOUTS[code]} tensor's meta comes without the {n} dense parts it is built "
            "from right before it; the peer is broken or not rpc_core"
        )
    if not isinstance(size, tuple) or not all(type(d) is int for d in size):
        raise ValueError(f"a sparse tensor's meta gives size {size!r}, not a tuple of ints")
    if parts[-1].dtype != (_DTYPES[dtype] if type(dtype) is int and 0 <= dtype < len(_DTYPES) else dtype):
        raise ValueError(f"a sparse tensor's meta names dtype {dtype!r}, its values are {parts[-1].dtype}")
    t: torch.Tensor
    if code == 0:
        t = torch.sparse_coo_tensor(
            parts[0], parts[1], size, check_invariants=True, is_coalesced=bool(flags & _COALESCED)
        )
    else:
        t = torch.sparse_compressed_tensor(
            parts[0], parts[1], parts[2], size, layout=_SPARSE_LAYOUTS[code], check_invariants=True
        )
    if flags & _IS_PARAM:
        return _Parameter(t, requires_grad=bool(flags & _REQUIRES_GRAD))
    return t.requires_grad_() if flags & _REQUIRES_GRAD else t


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._tensors = tensors
        self.sparse: list[int] = []  # indices of the table's sparse entries

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if obj.is_nested:
                raise TypeError("rpc_core cannot send nested tensors; send the list of its parts (t.unbind())")
            if obj.layout is not torch.strided:  # an entry of its own, after its parts (add_sparse)
                self.sparse.append(add_sparse(self._tensors, obj))
                return _tensor_from_table, (self.sparse[-1],)
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
    f, tensors, pickler = slot.file, slot.tensors, slot.pickler
    try:
        pickler.dump(obj)
        body = f.getvalue()
    finally:
        pickler.clear_memo()
        f.seek(0)
        f.truncate()
        tensors = list(tensors)
        slot.tensors.clear()
        sparse, pickler.sparse = pickler.sparse, []
        slot.busy = False
    return packed(body, tensors, sparse)


def packed(body: bytes, tensors: list[torch.Tensor], sparse: Sequence[int] = ()) -> Serialized:
    """A message of ``body`` and the tensors its references index, their buffers packed.
    ``sparse``: the indices of the table's sparse entries (``add_sparse``)."""
    if not tensors:
        return _new_tuple(Serialized, ([], body, [], tensors, []))  # tuple.__new__: no Python-level constructor
    if sparse:
        metas, buffers, keepalive = _pack_with_sparse(tensors, sparse)
    else:
        metas, buffers, keepalive = _pack_tensors(tensors)
    return _new_tuple(Serialized, (metas, body, buffers, tensors, keepalive))


def _pack_with_sparse(
    tensors: Sequence[torch.Tensor], sparse: Sequence[int]
) -> tuple[list[TensorMeta], list[memoryview], list[Any]]:
    """``_pack_tensors`` for a table with sparse entries: the dense ones packed, the sparse
    ones described by their metas, in table order."""
    at = set(sparse)
    dense_metas, buffers, keepalive = _pack_tensors([t for i, t in enumerate(tensors) if i not in at])
    dense = iter(dense_metas)
    metas = [_sparse_meta(t) if i in at else next(dense) for i, t in enumerate(tensors)]
    return metas, buffers, keepalive


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
    out: list[torch.Tensor] = []
    for buffer, dtype, size, stride, offset, flags in metas:
        if buffer < 0:  # a sparse tensor, from the entries before it (its meta's buffer is -1)
            out.append(_rebuild_sparse(out, dtype, size, offset, flags))
            continue
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
