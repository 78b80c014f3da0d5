"""The rpc_core wire protocol, all of it.

A connection is a stream socket: TCP, or between workers on one host a Linux abstract
Unix socket named ``\\0rpc_core.<the worker's TCP port>`` (same bytes either way). It
starts with a mutual challenge-response handshake, then carries frames.

Handshake (fixed sizes, so nothing from an unauthenticated peer is ever parsed further):

    acceptor  -> connector   HELLO     MAGIC(4) VERSION(u16) nonce_a(32)                 = 38 bytes
    connector -> acceptor    PROOF     MAGIC(4) mac_c(32) nonce_c(32)                    = 68 bytes
                             mac_c = HMAC-SHA256(secret, b"connector" + nonce_a + nonce_c)
    acceptor  -> connector   VERDICT   ok(u8) mac_a(32)                                  = 33 bytes
                             mac_a = HMAC-SHA256(secret, b"acceptor" + nonce_c + nonce_a)

The acceptor checks mac_c before it reads anything else; the connector checks mac_a, so a
peer that does not know the secret can neither talk to a worker nor impersonate one.

Then, authenticated, both sides find out whether they may read each other's memory
(cross-memory attach, Linux ``process_vm_readv``; see ``cma``). Each side sends, then reads:

    both -> peer             OFFER     pid(u32) probe_addr(u64) probe(16)                = 28 bytes
                             probe = 16 random bytes the sender keeps at probe_addr in
                             process pid; pid 0 = not offered (RPC_CORE_CMA=0, not Linux)
    both -> peer             RESULT    ok(u8)                                            =  1 byte
                             ok = 1 iff we read the peer's probe bytes from its memory

The direction A -> B uses cross-memory attach only if B's RESULT said 1 (B proved it can
read A: same host, same pid namespace, ptrace allowed). Otherwise, silently, in the stream.

Frame (little endian):

    kind(u8) flags(u8) nbuf(u16) head_len(u32) body_len(u64) msg_id(u64)    = FRAME_HEADER, 24 bytes
    nbuf x buffer_len(u64)
    [REMOTE table]          only if flags has REMOTE: token(u64) nbuf x addr(u64)
    head   head_len bytes   (tensor metas, extras) or empty (metas: serialization.TensorMeta)
    body   body_len bytes   the message object; tensors inside it are references into the
                            tensor metas. Head and body are pickles, or under
                            RpcBackendOptions(serializer="safe") rpc_core's own encoding
                            (safe_encoding; starts with 0xA7 'S'). Rendezvous messages and
                            the identity frame are always in the latter.
    buffers                 raw bytes of tensor storages, back to back (out of band: they
                            never pass through pickle and land straight in tensor memory);
                            a buffer whose REMOTE addr is not 0 is absent from the stream:
                            the receiver copies its buffer_len bytes from address addr of
                            the sender's process, then answers RELEASE(token)

Kinds: REQUEST carries (func, args, kwargs); the callee answers with RESPONSE (the return
value) or EXCEPTION (an ``ExceptionInfo``) under the same msg_id. Everything else — RRef
creation/fork/delete, distributed backward, context cleanup, shutdown barriers — is a
REQUEST of an rpc_core function, so the protocol has no other message kinds. The one
other kind belongs to the transport: RELEASE (msg_id = a REMOTE frame's token, nothing else) tells
the sender that the receiver has copied that frame's remote buffers, so the sender may
reuse their memory. The sender's send() returns only then (like a socket write returning
once the bytes are the kernel's). Connections consume RELEASE; the agent never sees it.

Extras: the head's second part is a dict of protocol extras, the side channel that lets
distributed autograd, RRef bookkeeping and the profiler ride on ordinary calls. Every key
is a named constant below (``EXTRA_*``: sent in frame heads). Middleware also keeps state
of its own in the *request's* extras dict on the callee or in a call's extras on the caller;
those keys (``LOCAL_*``) are never sent, and are listed here so no sent key collides with them.

Flags: CONTROL marks rpc_core's own bookkeeping calls (shutdown barriers), which graceful
shutdown does not count as user work in flight. REMOTE marks a frame carrying buffers by
address; only sent in a direction whose RESULT was 1, anything else is malformed. Remote
buffers obey the same length bounds as streamed ones.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Sequence
from typing import NamedTuple

MAGIC = b"RPCc"
# 2: cross-memory attach step, REMOTE flag, RELEASE kind; 3: tensor metas as plain tuples;
# 4: rendezvous messages and identity frames in the safe encoding (no pickle); 5: sparse
# tensors as entries of the tensor table (serialization.add_sparse), not rebuilt by the body,
# and the safe encoding's int runs and frame head layout (safe_encoding: "k", "H")
VERSION = 5
NONCE_LEN = 32
MAC_LEN = 32

HELLO = struct.Struct("<4sH32s")
PROOF = struct.Struct("<4s32s32s")
VERDICT = struct.Struct("<B32s")
OFFER = struct.Struct("<IQ16s")
RESULT = struct.Struct("<B")

FRAME_HEADER = struct.Struct("<BBHIQQ")
BUFFER_LEN = struct.Struct("<Q")
TOKEN = struct.Struct("<Q")

# Message kinds.
REQUEST = 1
RESPONSE = 2
EXCEPTION = 3
RELEASE = 4
KINDS = (REQUEST, RESPONSE, EXCEPTION, RELEASE)

# Flags.
CONTROL = 0x1
REMOTE = 0x2

# Message extras keys (see "Extras" above). Sent in frame heads:
EXTRA_AUTOGRAD = "ag"  # request/response: (context id, autograd message id, or -1 if no tensor needs grad)
EXTRA_RELEASED_CONTEXTS = "rel"  # request: ids of autograd contexts the sender released (deferred cleanup)
EXTRA_RREF_DELETES = "rdel"  # request: [(rref id, fork id)] user RRefs deleted on the sender, for this owner
EXTRA_RREF_ACCEPTED = "racc"  # response: [fork id] forks of the caller's RRefs accepted while unpickling
EXTRA_RREF_CREATE = "rref_create"  # request: id of the RRef a remote() call creates (stores unpickling errors)
EXTRA_PROFILE = "prof"  # request: the caller's profiler options; response: the callee's events
# Local only, never sent:
LOCAL_REPLY_NOTES = "_reply"  # callee's request extras: notes for the response (serialization.note_for_reply)
LOCAL_AUTOGRAD_CONTEXT = "_ag_ctx"  # callee's request extras: the autograd context the request was admitted into
LOCAL_RELEASED_CONTEXTS = "_ag_released"  # callee's request extras: contexts its arrival released, freed once answered
LOCAL_PROFILE_SERVED = "prof.served"  # callee's request extras: the profile of this request
LOCAL_KEEPALIVE = "keepalive"  # caller's call extras: an object held until the answer (an RRef named by id)
LOCAL_HEARTBEAT = "heartbeat"  # caller's call extras: the call is a heartbeat (see heartbeats), not a wait on the peer

# Bounds checked before any allocation; larger means a broken or hostile peer.
MAX_HEAD_BYTES = 64 << 20
MAX_BODY_BYTES = 4 << 30
MAX_BUFFER_BYTES = 64 << 30
MAX_FRAME_BYTES = 64 << 30


class FrameHeader(NamedTuple):
    kind: int
    flags: int
    nbuf: int
    head_len: int
    body_len: int
    msg_id: int


_new_tuple = tuple.__new__


def unpack_header(raw: bytes) -> FrameHeader:
    # tuple.__new__ straight from the unpacked fields: the NamedTuple constructor is a
    # Python-level function, and this runs for every frame.
    return _new_tuple(FrameHeader, FRAME_HEADER.unpack(raw))


class ExceptionInfo(NamedTuple):
    """What travels for a remote exception: enough to rebuild its type on the caller."""

    type_module: str
    type_qualname: str
    message: str  # includes the remote traceback
    worker: str  # where it was raised
    peer: str | None = None  # the worker it is about, if its causes named one (errors.failed_worker)


def new_nonce() -> bytes:
    return os.urandom(NONCE_LEN)


def connector_mac(secret: bytes, nonce_a: bytes, nonce_c: bytes) -> bytes:
    return hmac.new(secret, b"connector" + nonce_a + nonce_c, hashlib.sha256).digest()


def acceptor_mac(secret: bytes, nonce_c: bytes, nonce_a: bytes) -> bytes:
    return hmac.new(secret, b"acceptor" + nonce_c + nonce_a, hashlib.sha256).digest()


def macs_equal(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)


# The frame header followed by n buffer lengths, and n buffer lengths alone, by n: built once
# per count up to _CACHED_COUNTS (a format string made and looked up per frame costs a µs
# of a small call).
_HEADERS: dict[int, struct.Struct] = {0: FRAME_HEADER}
_LENS: dict[int, struct.Struct] = {}
_CACHED_COUNTS = 64


def _header_with_lens(n: int) -> struct.Struct:
    st = struct.Struct(f"<BBHIQQ{n}Q")
    if n <= _CACHED_COUNTS:
        _HEADERS[n] = st
    return st


def buffer_lens_struct(n: int) -> struct.Struct:
    """The struct of ``n`` buffer lengths (a frame's table after its header)."""
    st = _LENS.get(n)
    if st is None:
        st = struct.Struct(f"<{n}Q")
        if n <= _CACHED_COUNTS:
            _LENS[n] = st
    return st


def pack_header(kind: int, flags: int, head_len: int, body_len: int, msg_id: int, buffer_lens: Sequence[int]) -> bytes:
    n = len(buffer_lens)
    st = _HEADERS.get(n) or _header_with_lens(n)
    return st.pack(kind, flags, n, head_len, body_len, msg_id, *buffer_lens)


def unpack_buffer_lens(raw: bytes, nbuf: int) -> tuple[int, ...]:
    return buffer_lens_struct(nbuf).unpack(raw)


def pack_remote_table(token: int, addrs: Sequence[int]) -> bytes:
    return struct.pack(f"<{1 + len(addrs)}Q", token, *addrs)


def unpack_remote_table(raw: bytes, nbuf: int) -> tuple[int, tuple[int, ...]]:
    token, *addrs = struct.unpack(f"<{1 + nbuf}Q", raw)
    return token, tuple(addrs)


def check_header(h: FrameHeader) -> None:
    """Raise ValueError describing the first field out of bounds."""
    if h.kind not in KINDS:
        raise ValueError(f"unknown frame kind {h.kind}")
    if h.kind == RELEASE and (h.flags or h.nbuf or h.head_len or h.body_len):
        raise ValueError("a RELEASE frame carries nothing but its token")
    if h.head_len > MAX_HEAD_BYTES:
        raise ValueError(f"head length {h.head_len} exceeds {MAX_HEAD_BYTES}")
    if h.body_len > MAX_BODY_BYTES:
        raise ValueError(f"body length {h.body_len} exceeds {MAX_BODY_BYTES}")


def check_remote_table(addrs: tuple[int, ...], lens: tuple[int, ...]) -> None:
    """Raise ValueError for a descriptor no process could own (the copy checks the rest)."""
    for a, n in zip(addrs, lens, strict=True):
        if a and a + n >= 1 << 64:
            raise ValueError(f"remote buffer at {a:#x} + {n} bytes wraps the address space")


def check_buffer_lens(lens: tuple[int, ...], h: FrameHeader) -> None:
    total = h.head_len + h.body_len
    for n in lens:
        if n > MAX_BUFFER_BYTES:
            raise ValueError(f"buffer length {n} exceeds {MAX_BUFFER_BYTES}")
        total += n
    if total > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {total} bytes exceeds {MAX_FRAME_BYTES}")
