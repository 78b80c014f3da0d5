"""Serialization (rpc_core/protocol/serialization.py): tensors keep dtype, shape, strides, views and
storage sharing, and their bytes travel out of band, received straight into tensor memory.

Every round trip here goes through a real connection (a socket pair), as a message would."""

import pickle
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rpc_core.protocol import serialization as ser
from rpc_core.protocol import wire
from rpc_core.transport import stream

IO_TIMEOUT = 30.0


def _send_receive(obj):
    """Serialize ``obj``, send it over a socket pair, receive and deserialize it.
    Returns (object, Serialized, received storages)."""
    import socket

    a, b = socket.socketpair()
    b.settimeout(IO_TIMEOUT)
    src, dst = stream.Connection(a), stream.Connection(b)
    s = ser.serialize(obj)
    head = ser.encode_head(s.metas, None)
    with ThreadPoolExecutor(1) as ex:
        sent = ex.submit(src.send, wire.REQUEST, 0, 1, head, s.body, s.buffers)
        _, got_head, body, storages = dst.recv()
        sent.result(IO_TIMEOUT)
    src.close()
    dst.close()
    out, extras = ser.deserialize(got_head, body, storages)
    assert extras is None
    return out, s, storages


def roundtrip(obj):
    return _send_receive(obj)[0]


def _same_tensor(a, b):
    assert type(a) is type(b)
    assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
    assert a.requires_grad == b.requires_grad
    assert torch.equal(a.detach(), b.detach())


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.complex128,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
        # not in the head's dtype table: these travel as the dtype object itself
        torch.uint16,
        torch.uint32,
        torch.float8_e4m3fn,
    ],
)
def test_dtype_shape_and_values_are_preserved(dtype):
    t = (torch.arange(24) % 5).reshape(2, 3, 4).to(dtype)
    out = roundtrip(t)
    assert out.dtype == dtype and out.shape == t.shape and out.stride() == t.stride()
    assert torch.equal(out.view(torch.uint8), t.view(torch.uint8))  # byte for byte (not every dtype has ==)


def test_a_dtype_code_outside_the_table_is_a_clear_error_not_a_crash():
    s = ser.serialize(torch.ones(3))
    ((buffer, code, size, stride, offset, flags),) = s.metas
    bad = ser.encode_head([(buffer, 999, size, stride, offset, flags)], None)
    with pytest.raises(ValueError, match="dtype code 999"):
        ser.deserialize(bad, s.body, ser.loopback(s.buffers))


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.tensor(3.5),
        lambda: torch.empty(0),
        lambda: torch.empty(2, 0, 3),
        lambda: torch.ones(1, 1, 1, 1),
        lambda: torch.arange(10.0)[7],
        lambda: torch.zeros(1 << 16)[40000],
    ],
    ids=["0-dim", "empty", "empty-2d", "unit-dims", "0-dim-view-at-offset", "0-dim-view-of-large-storage"],
)
def test_scalar_and_empty_shapes_are_preserved(make):
    t = make()
    _same_tensor(roundtrip(t), t)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(12.0).reshape(3, 4).t(),
        lambda: torch.arange(40.0).reshape(5, 8)[1:4:2, ::3],
        lambda: torch.arange(24.0).reshape(2, 3, 4).permute(2, 0, 1),
        lambda: torch.arange(3.0).expand(4, 3),  # stride 0
        lambda: torch.arange(6.0).reshape(2, 3).as_strided((2, 2), (1, 2), 1),  # overlapping
    ],
    ids=["transposed", "sliced-steps", "permuted", "expanded", "overlapping"],
)
def test_non_contiguous_tensors_keep_their_strides(make):
    t = make()
    out = roundtrip(t)
    _same_tensor(out, t)
    assert out.is_contiguous() == t.is_contiguous()


def test_views_of_one_storage_still_share_storage_after_the_trip():
    base = torch.arange(20.0)
    a, b, c = base[2:10], base[5:15].view(2, 5), base.view(4, 5).t()
    out = roundtrip({"a": a, "b": b, "c": c, "base": base})
    for k, t in {"a": a, "b": b, "c": c, "base": base}.items():
        _same_tensor(out[k], t)
        assert out[k].storage_offset() == t.storage_offset()
    storage = out["base"].untyped_storage().data_ptr()
    assert all(out[k].untyped_storage().data_ptr() == storage for k in "abc")
    out["base"][5] = -1.0  # a write through one view shows through the others
    assert out["a"][3] == -1.0 and out["b"][0, 0] == -1.0 and out["c"][0, 1] == -1.0


def test_same_tensor_twice_arrives_as_one_tensor_memory():
    t = torch.ones(3)
    x, y = roundtrip((t, t))
    assert x.data_ptr() == y.data_ptr()


def test_small_view_of_large_storage_ships_only_the_bytes_it_spans():
    big = torch.zeros(1 << 20)
    view = big[1000:1010]
    view.copy_(torch.arange(10.0))
    out, s, storages = _send_receive(view)
    _same_tensor(out, view)
    assert sum(st.nbytes() for st in storages) < 1024


def test_views_with_different_dtypes_on_one_storage_are_rebuilt_at_their_own_bytes():
    raw = torch.zeros(4096, dtype=torch.uint8)
    raw[:64] = torch.arange(64, dtype=torch.uint8)
    bytes_view = raw[1:3]  # starts at an odd byte
    floats = raw[4:12].view(torch.float32)  # two float32s at bytes 4..11
    longs = raw[16:32].view(torch.int64)
    out = roundtrip([bytes_view, floats, longs])
    for got, want in zip(out, [bytes_view, floats, longs], strict=True):
        _same_tensor(got, want)


def test_parameters_stay_parameters_and_requires_grad_is_kept():
    p = torch.nn.Parameter(torch.randn(3, 2))
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    leaf = torch.randn(4, requires_grad=True)
    plain = torch.randn(4)
    out = roundtrip([p, frozen, leaf, plain])
    assert isinstance(out[0], torch.nn.Parameter) and out[0].requires_grad
    assert isinstance(out[1], torch.nn.Parameter) and not out[1].requires_grad
    assert type(out[2]) is torch.Tensor and out[2].requires_grad and out[2].is_leaf
    assert not out[3].requires_grad
    for got, want in zip(out, [p, frozen, leaf, plain], strict=True):
        assert torch.equal(got.detach(), want.detach())


def test_module_state_round_trips():
    m = torch.nn.Linear(3, 2)
    out = roundtrip(m.state_dict())
    assert out.keys() == m.state_dict().keys()
    for k, v in m.state_dict().items():
        _same_tensor(out[k], v)


def test_sparse_coo_tensors_round_trip():
    i = torch.tensor([[0, 1, 1], [2, 0, 2]])
    v = torch.tensor([3.0, 4.0, 5.0])
    s = torch.sparse_coo_tensor(i, v, (2, 3))
    out = roundtrip(s)
    assert out.layout == torch.sparse_coo and out.shape == s.shape
    assert torch.equal(out.to_dense(), s.to_dense())


def test_unsupported_layouts_and_devices_fail_at_the_sender_with_what_to_do():
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    with pytest.raises(TypeError, match=r"nested tensors.*unbind"):
        ser.serialize(nested)
    with pytest.raises(TypeError, match=r"CPU tensors only.*\.cpu\(\)"):
        ser.serialize(torch.empty(2, device="meta"))


def test_tensor_bytes_travel_out_of_band_never_inside_the_pickle():
    t = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    needle = t[:64].numpy().tobytes()
    s = ser.serialize({"x": [t, t[100:200]], "n": 3})
    assert needle not in s.body
    assert len(s.body) < 1024
    assert len(s.buffers) == 1 and bytes(s.buffers[0]) == t.numpy().tobytes()
    # The buffer is a view of the tensor's own memory, not a copy.
    assert s.buffers[0].obj is not None
    assert torch.frombuffer(s.buffers[0], dtype=torch.uint8).data_ptr() == t.data_ptr()


def test_received_tensors_live_in_the_storage_the_transport_filled():
    t = torch.randn(1 << 16)
    out, _, storages = _send_receive(t)
    assert out.untyped_storage().data_ptr() == storages[0].data_ptr()
    assert out.data_ptr() != t.data_ptr()


def test_large_received_tensors_are_ordinary_resizable_tensors():
    t = torch.randn(1 << 20)  # 4 MB: the transport's large-buffer path
    out = roundtrip(t)
    assert torch.equal(out, t)
    out.resize_(3 << 20)  # e.g. a buffer reused with resize_(), as with any local tensor
    assert torch.equal(out[: 1 << 20], t)


def test_a_call_to_self_copies_tensors_instead_of_aliasing_them():
    t = torch.zeros(3)
    s = ser.serialize(t)
    out, _ = ser.deserialize(ser.encode_head(s.metas, None), s.body, ser.loopback(s.buffers))
    out += 1
    assert t.sum() == 0


def test_nested_containers_and_plain_objects_round_trip():
    obj = {"a": (1, 2.5, "s", None, b"raw"), "t": [torch.ones(2), {"deep": torch.zeros(1, dtype=torch.int16)}]}
    out = roundtrip(obj)
    assert out["a"] == obj["a"]
    assert torch.equal(out["t"][0], obj["t"][0])
    assert torch.equal(out["t"][1]["deep"], obj["t"][1]["deep"])


def _module_level_function(x):
    return x


def test_functions_travel_by_reference_never_as_code():
    s = ser.serialize((_module_level_function, (1,), {}))
    assert b"_module_level_function" in s.body and __name__.encode() in s.body
    assert _module_level_function.__code__.co_code not in s.body
    out = roundtrip((_module_level_function, torch.add))
    assert out == (_module_level_function, torch.add)


def test_lambdas_and_local_functions_cannot_be_sent():
    def local(x):
        return x

    for fn in (lambda x: x, local):
        with pytest.raises((pickle.PicklingError, AttributeError)):
            ser.serialize((fn, (), {}))


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(16),
        lambda: torch.randn(3, 5, dtype=torch.float64),
        lambda: torch.nn.Parameter(torch.randn(4, 2)),
        lambda: torch.randn(6, requires_grad=True),
        lambda: torch.arange(10, dtype=torch.int16).reshape(2, 5),
        lambda: torch.zeros(0),  # no bytes: the general path
        lambda: torch.randn(4, 4).t(),  # not contiguous: the general path
        lambda: torch.randn(10)[2:5],  # part of a storage: the general path
    ],
)
def test_one_tensor_packs_exactly_as_the_general_grouping_would(make):
    t = make()
    metas, buffers, _ = ser._pack_tensors([t])
    # The same tensor twice takes the general path (grouping by storage) and packs it once.
    g_metas, g_buffers, _ = ser._pack_tensors([t, t])
    assert metas == g_metas[:1] and g_metas[0] == g_metas[1]
    assert [bytes(b) for b in buffers] == [bytes(b) for b in g_buffers]
