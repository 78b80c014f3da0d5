"""The wire protocol's layout and bounds (rpc_core/protocol/wire.py), checked without sockets."""

import struct

import pytest

from rpc_core.protocol import wire


def test_handshake_messages_have_the_documented_fixed_sizes():
    # Fixed sizes are what lets an acceptor read an unauthenticated peer without parsing.
    assert wire.HELLO.size == 38
    assert wire.PROOF.size == 68
    assert wire.VERDICT.size == 33
    assert wire.FRAME_HEADER.size == 24


def test_frame_header_round_trips_with_buffer_lengths():
    raw = wire.pack_header(wire.RESPONSE, wire.CONTROL, 7, 1 << 31, 2**64 - 1, [0, 5, 1 << 30])
    assert len(raw) == wire.FRAME_HEADER.size + 3 * wire.BUFFER_LEN.size
    h = wire.FrameHeader(*wire.FRAME_HEADER.unpack(raw[: wire.FRAME_HEADER.size]))
    assert h == wire.FrameHeader(wire.RESPONSE, wire.CONTROL, 3, 7, 1 << 31, 2**64 - 1)
    lens = struct.unpack("<3Q", raw[wire.FRAME_HEADER.size :])
    assert lens == (0, 5, 1 << 30)
    wire.check_header(h)
    wire.check_buffer_lens(lens, h)


def test_frame_header_is_little_endian():
    raw = wire.pack_header(wire.REQUEST, 0, 1, 2, 3, [])
    assert raw == bytes([1, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0])


@pytest.mark.parametrize(
    "fields, message",
    [
        ((0, 0, 0, 0, 0, 1), "unknown frame kind 0"),
        ((99, 0, 0, 0, 0, 1), "unknown frame kind 99"),
        ((wire.REQUEST, 0, 0, wire.MAX_HEAD_BYTES + 1, 0, 1), "head length"),
        ((wire.REQUEST, 0, 0, 0, wire.MAX_BODY_BYTES + 1, 1), "body length"),
        ((wire.REQUEST, 0, 0, 0, 2**64 - 1, 1), "body length"),
    ],
)
def test_header_out_of_bounds_is_rejected_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        wire.check_header(wire.FrameHeader(*fields))


def test_buffer_lengths_out_of_bounds_are_rejected():
    h = wire.FrameHeader(wire.REQUEST, 0, 2, 0, 0, 1)
    with pytest.raises(ValueError, match="buffer length"):
        wire.check_buffer_lens((1, wire.MAX_BUFFER_BYTES + 1), h)
    half = wire.MAX_FRAME_BYTES // 2 + 1
    with pytest.raises(ValueError, match="frame of"):
        wire.check_buffer_lens((half, half), h)


def test_macs_bind_the_secret_both_nonces_and_the_role():
    a, c = wire.new_nonce(), wire.new_nonce()
    assert len(a) == wire.NONCE_LEN and a != c
    mac = wire.connector_mac(b"s", a, c)
    assert len(mac) == wire.MAC_LEN
    assert wire.macs_equal(mac, wire.connector_mac(b"s", a, c))
    assert not wire.macs_equal(mac, wire.connector_mac(b"t", a, c))  # other secret
    assert not wire.macs_equal(mac, wire.connector_mac(b"s", c, a))  # nonces swapped
    # An acceptor cannot answer by reflecting the connector's proof (roles are tagged).
    assert not wire.macs_equal(wire.acceptor_mac(b"s", c, a), wire.connector_mac(b"s", a, c))


def test_cross_memory_attach_step_and_remote_table_layout():
    assert wire.OFFER.size == 28 and wire.RESULT.size == 1
    raw = wire.pack_remote_table(9, [0, 0x7F00_0000_1000])
    assert raw == struct.pack("<3Q", 9, 0, 0x7F00_0000_1000)
    assert wire.unpack_remote_table(raw, 2) == (9, (0, 0x7F00_0000_1000))
    wire.check_remote_table((0, 0x1000), (5, 1 << 20))
    with pytest.raises(ValueError, match="wraps"):
        wire.check_remote_table((2**64 - 4096,), (8192,))
    wire.check_header(wire.FrameHeader(wire.RELEASE, 0, 0, 0, 0, 3))
    with pytest.raises(ValueError, match="RELEASE frame carries nothing"):
        wire.check_header(wire.FrameHeader(wire.RELEASE, wire.REMOTE, 0, 0, 0, 3))
