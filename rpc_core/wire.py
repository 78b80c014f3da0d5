"""The rpc_core wire protocol, all of it.

A connection starts with a mutual challenge-response handshake, then carries frames.

Handshake (fixed sizes, so nothing from an unauthenticated peer is ever parsed further):

    acceptor  -> connector   HELLO     MAGIC(4) VERSION(u16) nonce_a(32)                 = 38 bytes
    connector -> acceptor    PROOF     MAGIC(4) mac_c(32) nonce_c(32)                    = 68 bytes
                             mac_c = HMAC-SHA256(secret, b"connector" + nonce_a + nonce_c)
    acceptor  -> connector   VERDICT   ok(u8) mac_a(32)                                  = 33 bytes
                             mac_a = HMAC-SHA256(secret, b"acceptor" + nonce_c + nonce_a)

The acceptor checks mac_c before it reads anything else; the connector checks mac_a, so a
peer that does not know the secret can neither talk to a worker nor impersonate one.

Frame (little endian):

    kind(u8) flags(u8) nbuf(u16) head_len(u32) body_len(u64) msg_id(u64)    = FRAME_HEADER, 24 bytes
    nbuf x buffer_len(u64)
    head   head_len bytes   pickle of (tensor metas, extras) or empty
    body   body_len bytes   pickle of the message object; tensors inside it are references
                            into the tensor metas
    buffers                 raw bytes of tensor storages, back to back (out of band: they
                            never pass through pickle and land straight in tensor memory)

Kinds: REQUEST carries (func, args, kwargs); the callee answers with RESPONSE (the return
value) or EXCEPTION (an ``ExceptionInfo``) under the same msg_id. Everything else — RRef
creation/fork/delete, distributed backward, context cleanup, shutdown barriers — is a
REQUEST of an rpc_core function, so the protocol has no other message kinds.

Flags: CONTROL marks rpc_core's own bookkeeping calls (shutdown barriers), which graceful
shutdown does not count as user work in flight.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import struct
from typing import NamedTuple

MAGIC = b"RPCc"
VERSION = 1
NONCE_LEN = 32
MAC_LEN = 32

HELLO = struct.Struct("<4sH32s")
PROOF = struct.Struct("<4s32s32s")
VERDICT = struct.Struct("<B32s")

FRAME_HEADER = struct.Struct("<BBHIQQ")
BUFFER_LEN = struct.Struct("<Q")

# Message kinds.
REQUEST = 1
RESPONSE = 2
EXCEPTION = 3
KINDS = (REQUEST, RESPONSE, EXCEPTION)

# Flags.
CONTROL = 0x1

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


class ExceptionInfo(NamedTuple):
    """What travels for a remote exception: enough to rebuild its type on the caller."""

    type_module: str
    type_qualname: str
    message: str  # includes the remote traceback
    worker: str


def new_nonce() -> bytes:
    return os.urandom(NONCE_LEN)


def connector_mac(secret: bytes, nonce_a: bytes, nonce_c: bytes) -> bytes:
    return hmac.new(secret, b"connector" + nonce_a + nonce_c, hashlib.sha256).digest()


def acceptor_mac(secret: bytes, nonce_c: bytes, nonce_a: bytes) -> bytes:
    return hmac.new(secret, b"acceptor" + nonce_c + nonce_a, hashlib.sha256).digest()


def macs_equal(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)


def pack_header(kind: int, flags: int, head_len: int, body_len: int, msg_id: int, buffer_lens: list[int]) -> bytes:
    out = FRAME_HEADER.pack(kind, flags, len(buffer_lens), head_len, body_len, msg_id)
    if buffer_lens:
        out += struct.pack(f"<{len(buffer_lens)}Q", *buffer_lens)
    return out


def check_header(h: FrameHeader) -> None:
    """Raise ValueError describing the first field out of bounds."""
    if h.kind not in KINDS:
        raise ValueError(f"unknown frame kind {h.kind}")
    if h.head_len > MAX_HEAD_BYTES:
        raise ValueError(f"head length {h.head_len} exceeds {MAX_HEAD_BYTES}")
    if h.body_len > MAX_BODY_BYTES:
        raise ValueError(f"body length {h.body_len} exceeds {MAX_BODY_BYTES}")


def check_buffer_lens(lens: tuple[int, ...], h: FrameHeader) -> None:
    total = h.head_len + h.body_len
    for n in lens:
        if n > MAX_BUFFER_BYTES:
            raise ValueError(f"buffer length {n} exceeds {MAX_BUFFER_BYTES}")
        total += n
    if total > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {total} bytes exceeds {MAX_FRAME_BYTES}")
