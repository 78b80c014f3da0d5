"""``RpcBackendOptions(serializer="safe")``: nothing from the wire is unpickled.

In-process: every supported type round-trips through the safe codec (oracle: the value
sent), and what is outside the allowlist or malformed is refused naming it. Across real
worker processes: rpc_core's own traffic (RRefs, distributed autograd and the optimizer,
RemoteModule, the profiler, barriers) works under "safe" with results equal to plain
torch; and a peer that holds the secret but sends crafted frames (a raw pickle, a call of
an unlisted function, a class with a ``__reduce__``) is refused, nothing runs (the file
the payload would create does not exist), and the worker keeps serving.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import typing
from pathlib import Path

import pytest
import torch

import rpc_core
import rpc_core.autograd as dist_autograd
from rpc_core import transport
from rpc_core.errors import NotAllowedError, ProtocolError, RemoteFunctionError
from rpc_core.optim import DistributedOptimizer
from rpc_core.protocol import safe_codec, serialization, wire
from rpc_core.protocol.safe_decoding import decode
from rpc_core.protocol.safe_encoding import dumps_plain, encode
from tests._world import run_world

IO_TIMEOUT = 20.0


@rpc_core.safe.allow
@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    step: int
    tags: list[str]


@rpc_core.safe.allow
class Point(typing.NamedTuple):
    x: float
    y: float


@rpc_core.safe.allow
class Plain:
    def __init__(self, w: torch.Tensor, name: str) -> None:
        self.w, self.name = w, name

    def scaled(self, k: float) -> torch.Tensor:
        return self.w * k


@rpc_core.safe.allow
class CustomError(ValueError):
    pass


class Unlisted:
    pass


class Exploit:
    """Builds ``_touch(path)`` when unpickled: the proof that a payload ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[typing.Any, tuple[str]]:
        return _touch, (self.path,)


def _touch(path: str) -> str:  # deliberately not allowed
    Path(path).touch()
    return path


@rpc_core.safe.allow
def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a + b


@rpc_core.safe.allow
def forward(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w)


@rpc_core.safe.allow
def echo(v: typing.Any) -> typing.Any:
    return v


@rpc_core.safe.allow
def raise_custom(message: str) -> None:
    raise CustomError(message)


@rpc_core.safe.allow
def raise_unlisted() -> None:
    raise _UnlistedError("secret detail")


class _UnlistedError(RuntimeError):
    pass


@rpc_core.safe.allow
def sum_of(rref: rpc_core.RRef[torch.Tensor]) -> torch.Tensor:
    return rref.to_here().sum()


@rpc_core.safe.allow
def param_rrefs(module: rpc_core.RRef[torch.nn.Module]) -> list[rpc_core.RRef[torch.nn.Parameter]]:
    return [rpc_core.RRef(p) for p in module.local_value().parameters()]


rpc_core.safe.allow(torch.nn.Linear)
rpc_core.safe.allow(torch.optim.SGD)


@rpc_core.safe.allow
def exists(path: str) -> bool:
    return os.path.exists(path)


@pytest.fixture
def safe() -> typing.Iterator[None]:
    safe_codec.use("safe")
    try:
        yield
    finally:
        safe_codec.use("pickle")


def _round_trip(obj: typing.Any, extras: dict[str, typing.Any] | None = None) -> typing.Any:
    ser = serialization.serialize(obj)
    head = serialization.encode_head(ser.metas, extras)
    assert ser.body[:2] == b"\xa7S" and b"\x80\x05" not in head[:2]
    value, got_extras = serialization.deserialize(head, ser.body, serialization.loopback(ser.buffers))
    assert got_extras == extras
    return value


def _same(a: typing.Any, b: typing.Any) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.layout == b.layout and a.dtype == b.dtype and a.requires_grad == b.requires_grad
        assert torch.equal(a.to_dense(), b.to_dense())
    elif isinstance(a, (list, tuple)) and not hasattr(a, "_fields"):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, Batch):
        _same((a.x, a.step, a.tags), (b.x, b.step, b.tags))
    elif isinstance(a, Plain):
        _same((a.w, a.name), (b.w, b.name))
    elif isinstance(a, BaseException):
        assert a.args == b.args
    else:
        assert a == b


def test_every_supported_type_round_trips(safe: None) -> None:
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    values = [
        None,
        True,
        False,
        0,
        -(2**63),
        2**63,
        -(2**200),
        3.25,
        float("inf"),
        1 - 2j,
        "",
        "héllo \udcff",
        b"\x00raw",
        bytearray(b"ba"),
        (1, (2, ())),
        [1, [2.0, "x"]],
        {"a": 1, 2: [3]},
        collections.OrderedDict(b=1, a=2),
        {1, 2},
        frozenset({"f"}),
        slice(1, None, 2),
        Ellipsis,
        range(2, 9, 3),
        torch.float16,
        torch.bfloat16,
        torch.int8,
        torch.device("cpu"),
        torch.Size([2, 3]),
        torch.sparse_coo,
        torch.channels_last,
        torch.randn(3, 4),
        base[1:3, ::2],
        torch.zeros(0),
        torch.tensor(True),
        torch.randn(2, requires_grad=True),
        torch.nn.Parameter(torch.ones(3)),
        torch.sparse_coo_tensor(torch.tensor([[0, 2], [1, 0]]), torch.tensor([1.0, 2.0]), (3, 3)),
        torch.eye(3).to_sparse_csr(),
        Batch(torch.ones(2), 7, ["a"]),
        Point(1.0, 2.0),
        Plain(torch.ones(1), "p"),
        ValueError("bad", 3),
        CustomError("mine"),
        rpc_core.WorkerInfo("worker3", 3),
        add,
        Batch,
        torch.Tensor,
    ]
    for v in values:
        _same(v, _round_trip(v))
    # Views of one storage stay views of one storage; extras ride in the head.
    a, b = _round_trip((base[0], base[1:]), {"ag": (5, -1), "rel": [1, 2]})
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert torch.equal(torch.cat([a, b.flatten()]), base.flatten())


def test_a_name_outside_the_allowlist_is_refused_naming_it(safe: None) -> None:
    for obj, name in ((_touch, "_touch"), ((Unlisted,), "Unlisted"), (os.system, "system")):
        ser = serialization.serialize(obj)
        with pytest.raises(NotAllowedError, match=rf"{name} is not allowed here.*rpc_core\.safe\.allow"):
            serialization.deserialize(b"", ser.body, [])
    # A module on the list lends only what it defines: not what it imported.
    rpc_core.safe.allow_module(__name__)
    assert decode(encode(_touch)[0], ()) is _touch
    raw = bytearray(encode(_touch)[0])
    forged = bytes(raw).replace(b"\x06\x00\x00\x00_touch", b"\x09\x00\x00\x00os.system")
    with pytest.raises(NotAllowedError, match=r"os\.system is not allowed"):
        decode(forged, ())


def test_what_the_safe_serializer_cannot_send_is_refused_at_the_sender(safe: None) -> None:
    with pytest.raises(NotAllowedError, match="cannot send a .*Exploit.*__reduce__"):
        serialization.serialize(Exploit("/nonexistent"))
    with pytest.raises(NotAllowedError, match="no importable name"):
        serialization.serialize(lambda: 0)


def test_malformed_bytes_are_protocol_errors(safe: None) -> None:
    good = encode(([1, 2], {"k": "v"}))[0]
    cases = [
        good[:-3],  # truncated
        good + b"N",  # stray bytes
        b"\xa7S" + b"\xee",  # unknown tag
        b"\xa7S[" + (10**6).to_bytes(4, "little"),  # more items than bytes
        b"\xa7S" + b"[\x01\x00\x00\x00" * 200 + b"N",  # too deep
        b"\xa7St\x05\x00\x00\x00",  # tensor index outside the table
        b"\xa7SD\x04\x00\x00\x00save",  # not a dtype
    ]
    for raw in cases:
        with pytest.raises(ProtocolError):
            decode(raw, ())


def test_each_side_refuses_the_others_format_clearly(safe: None) -> None:
    import pickle

    with pytest.raises(ProtocolError, match="it is a pickle.*serializer='pickle'"):
        serialization.deserialize(b"", pickle.dumps(Exploit("/nonexistent")), [])
    body = serialization.serialize(1).body
    safe_codec.use("pickle")
    with pytest.raises(ProtocolError, match="sender uses serializer='safe'"):
        serialization.deserialize(b"", body, [])


# -- across processes -----------------------------------------------------------------------------
def _body_internal_traffic(ctx: typing.Any) -> typing.Any:
    if ctx.rank != 0:
        return None
    torch.manual_seed(0)
    x, w = torch.randn(4, 3), torch.randn(3, 2)
    out: dict[str, typing.Any] = {}
    out["add"] = torch.equal(rpc_core.rpc_sync(1, add, args=(x, x)), x + x)
    sent = (Batch(x, 3, ["t"]), Point(1.5, 2.5), collections.OrderedDict(a=x[0]), torch.eye(3).to_sparse())
    back = rpc_core.rpc_sync(1, echo, args=(sent,))
    sparse_back = torch.equal(back[3].to_dense(), sent[3].to_dense())
    out["records"] = torch.equal(back[0].x, x) and back[0].tags == ["t"] and back[1] == sent[1] and sparse_back
    # RRefs: remote, to_here, proxies, an RRef passed to its owner and to a third party.
    rref = rpc_core.remote(1, Plain, args=(w, "w"))
    out["proxy"] = torch.equal(rref.rpc_sync().scaled(2.0), w * 2)
    t = rpc_core.remote(1, add, args=(x, x))
    out["to_here"] = torch.equal(t.to_here(), x + x)
    out["fork"] = torch.equal(rpc_core.rpc_sync(2, sum_of, args=(t,)), (x + x).sum())
    # Errors: an allowed type comes back as itself; another as a generic error with its name.
    with pytest.raises(CustomError, match="boom"):
        rpc_core.rpc_sync(1, raise_custom, args=("boom",))
    with pytest.raises(RemoteFunctionError, match="_UnlistedError: secret detail") as info:
        rpc_core.rpc_sync(1, raise_unlisted)
    out["traceback"] = "Remote traceback" in str(info.value)
    with pytest.raises(NotAllowedError, match="_touch is not allowed"):
        rpc_core.rpc_sync(1, _touch, args=(f"/tmp/never-{os.getpid()}",))
    # Distributed autograd and the optimizer: gradients equal plain torch's.
    w_rref = rpc_core.remote(1, torch.nn.Parameter, args=(w.clone(),))
    w_param = w_rref.to_here()
    with dist_autograd.context() as cid:
        y = rpc_core.rpc_sync(1, forward, args=(w_param, x))
        dist_autograd.backward(cid, [y.sum()])
        grads = dist_autograd.get_gradients(cid)
    w_local = w.clone().requires_grad_()
    torch.tanh(x @ w_local).sum().backward()
    out["gradient"] = w_local.grad is not None and torch.allclose(grads[w_param], w_local.grad)
    module = rpc_core.remote(1, torch.nn.Linear, args=(3, 2))
    before = [p.to_here() for p in rpc_core.rpc_sync(1, param_rrefs, args=(module,))]
    opt = DistributedOptimizer(torch.optim.SGD, rpc_core.rpc_sync(1, param_rrefs, args=(module,)), lr=0.1)
    with dist_autograd.context() as cid:
        loss = module.rpc_sync().forward(x).sum()
        dist_autograd.backward(cid, [loss])
        opt.step(cid)
    after = [p.to_here() for p in rpc_core.rpc_sync(1, param_rrefs, args=(module,))]
    local = torch.nn.Linear(3, 2)
    with torch.no_grad():
        local.weight.copy_(before[0]), local.bias.copy_(before[1])
    local_opt = torch.optim.SGD(local.parameters(), lr=0.1)
    local(x).sum().backward()
    local_opt.step()
    out["optim"] = all(torch.allclose(a, b) for a, b in zip(after, local.parameters(), strict=True))
    with rpc_core.profiler.profile() as prof:
        rpc_core.rpc_sync(1, add, args=(x, x))
    assert prof is not None
    out["profiled"] = any("add" in e.name for e in prof.function_events)
    return out  # then every rank's graceful shutdown: rpc_core's barriers, under "safe" too


@pytest.mark.timeout(120)
def test_rpc_cores_own_traffic_works_under_the_safe_serializer() -> None:
    results = run_world(_body_internal_traffic, 3, options={"serializer": "safe"}, timeout=100)
    assert results[0] == {k: True for k in results[0]}, results[0]
    assert set(results[0]) >= {"add", "records", "proxy", "to_here", "fork", "optim", "profiled"}


def _frame(msg_id: int, body: bytes) -> bytes:
    return wire.pack_header(wire.REQUEST, 0, 0, len(body), msg_id, []) + body


def _body_attack(ctx: typing.Any, tmp: str) -> typing.Any:
    if ctx.rank != 0:
        rpc_core._barrier(["worker0", "worker1"])
        return None
    import pickle

    host, port = rpc_core.api.current_agent().roster.addresses[1]
    paths = [os.path.join(tmp, f"ran-{i}") for i in range(4)]
    # The encoder checks no allowlist (the receiver does), so it builds most payloads itself.
    disguised = object.__new__(Plain)
    disguised.__dict__["path"] = paths[2]
    serialization.register_reducer(Unlisted, lambda _: (_touch, (paths[3],)))  # in this process only
    payloads = {
        # a raw pickle whose __reduce__ would create the file
        "pickle": pickle.dumps((echo, (Exploit(paths[0]),), {})),
        # a well-formed call of an unlisted function
        "unlisted call": encode((_touch, (paths[1],), {}))[0],
        # an object of a class with a __reduce__, sent as a plain object of its class
        "reduce class": encode((echo, (disguised,), {}))[0].replace(
            b"\x05\x00\x00\x00Plain", b"\x07\x00\x00\x00Exploit"
        ),
        # an rpc_core-style reduction naming an unlisted function as its rebuilder
        "reduced": encode((echo, (Unlisted(),), {}))[0],
    }
    answers = {}
    conn: typing.Any = transport.TCP.dial((host, port), ctx.secret.encode(), timeout=IO_TIMEOUT)
    conn.set_recv_timeout(IO_TIMEOUT)
    with conn.sock:
        conn.sock.sendall(wire.pack_header(wire.REQUEST, wire.CONTROL, 0, len(dumps_plain(0)), 0, []) + dumps_plain(0))
        for msg_id, (what, body) in enumerate(payloads.items(), start=100):
            conn.sock.sendall(_frame(msg_id, body))
            h, _, got, _ = conn.recv()
            assert (h.kind, h.msg_id) == (wire.EXCEPTION, msg_id), what
            answers[what] = decode(got, ()).message.split("\n")[0]
    ran = [rpc_core.rpc_sync(1, exists, args=(p,)) for p in paths]
    serving = torch.equal(rpc_core.rpc_sync(1, add, args=(torch.ones(2), torch.ones(2))), torch.full((2,), 2.0))
    rpc_core._barrier(["worker0", "worker1"])
    return answers, ran, serving


@pytest.mark.timeout(120)
def test_a_peer_with_the_secret_sending_crafted_payloads_runs_nothing(tmp_path: Path) -> None:
    results = run_world(_body_attack, 2, args=(str(tmp_path),), options={"serializer": "safe"}, timeout=100)
    answers, ran, serving = results[0]
    assert ran == [False] * 4 and serving
    assert not list(tmp_path.iterdir())
    assert "it is a pickle" in answers["pickle"], answers
    assert "_touch is not allowed here" in answers["unlisted call"], answers
    assert "Exploit is not allowed here" in answers["reduce class"], answers
    assert "_touch is not allowed here" in answers["reduced"], answers
