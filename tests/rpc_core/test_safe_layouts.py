"""The safe serializer's compact layouts: int runs ("k") and frame heads ("H").

Both exist for speed; these tests pin that they round-trip exactly what the generic
encoding would (types included), fall back where they cannot hold a value, and that bytes
crafted against them are refused as protocol errors before anything is allocated.
"""

from __future__ import annotations

import struct

import pytest
import torch

from rpc_core.errors import ProtocolError
from rpc_core.protocol.safe_decoding import decode, decode_head
from rpc_core.protocol.safe_encoding import MAX_INT_RUN, MAX_META_DIMS, encode, encode_head


@pytest.mark.parametrize(
    "value",
    [
        (0, 0),
        (281474976710656, -1),
        tuple(range(MAX_INT_RUN)),
        tuple(range(MAX_INT_RUN + 1)),  # longer than a run: item by item
        (1 << 63, 1),  # beyond 64 bits: item by item
        (-(1 << 63), (1 << 63) - 1),
        (True, 1),  # a bool stays a bool
        (1, None),
        (),
        ((1, 2), [3, (4,)], {"k": (5, 6)}),
    ],
)
def test_tuples_round_trip_with_their_item_types(value: tuple[object, ...]) -> None:
    got = decode(encode(value)[0], ())
    assert got == value
    assert [type(x) for x in got] == [type(x) for x in value]


def test_a_tuple_of_ints_travels_as_one_run() -> None:
    raw = encode((7, 8))[0]
    assert raw == b"\xa7Sk" + struct.pack("<I2q", 2, 7, 8)


_METAS = [
    (0, 0, (32, 10), (10, 1), 0, 1),
    (1, 4, (), (), 3, 0),  # a scalar
    (2, 9, tuple(range(1, 9)), tuple(range(8, 0, -1)), 5, 2),
]


@pytest.mark.parametrize("extras", [None, {}, {"ag": (281474976710668, 12), "rel": [1, 2]}])
def test_frame_heads_round_trip(extras: dict[str, object] | None) -> None:
    raw = encode_head(_METAS, extras)
    assert raw[2:3] == b"H"
    metas, got = decode_head(raw)
    assert list(metas) == _METAS and got == (extras or None)
    assert encode_head([], extras)[2:3] == b"H"


def test_a_meta_the_head_layout_cannot_hold_takes_the_generic_encoding() -> None:
    metas = [(0, torch.float8_e4m3fn, (2,), (1,), 0, 0), (1, 0, (3,), (1,), 0, 0)]
    raw = encode_head(metas, {"ag": (1, -1)})
    assert raw[2:3] != b"H"
    assert decode_head(raw) == (metas, {"ag": (1, -1)})


def test_a_head_holding_a_tensor_is_refused_at_the_sender() -> None:
    with pytest.raises(TypeError, match="extras hold a tensor"):
        encode_head(_METAS, {"x": torch.zeros(1)})


def _head(n: int, metas: bytes, extras: bytes = b"N") -> bytes:
    return b"\xa7SH" + struct.pack("<I", n) + metas + extras


def test_crafted_runs_and_heads_are_protocol_errors() -> None:
    runs = [
        b"\xa7Sk" + struct.pack("<I", 0),  # an empty run
        b"\xa7Sk" + struct.pack("<I", MAX_INT_RUN + 1) + b"\0" * 8 * (MAX_INT_RUN + 1),  # too long
        b"\xa7Sk" + struct.pack("<Iq", 2, 1),  # fewer ints than announced
    ]
    for raw in runs:
        with pytest.raises(ProtocolError):
            decode(raw, ())
    meta = struct.pack("<IBB2qqB", 0, 0, 1, 4, 1, 0, 0)
    assert decode_head(_head(1, meta)) == ([(0, 0, (4,), (1,), 0, 0)], None)
    heads = [
        _head(1, meta[:-3]),  # a meta cut short
        _head(1, meta[:5]),  # cut inside its prefix
        _head(1, struct.pack("<IBB", 0, 0, MAX_META_DIMS + 1) + b"\0" * 2000),  # too many dims
        _head(10**6, meta),  # more metas than bytes
        _head(1, meta, b"NN"),  # stray bytes
        _head(1, meta, b"[\x00\x00\x00\x00"),  # extras not a dict
        _head(1, meta, b""),  # no extras
        b"\xa7S(" + struct.pack("<I", 2) + b"NN",  # generic, metas not a list
    ]
    for raw in heads:
        with pytest.raises(ProtocolError):
            decode_head(raw)
