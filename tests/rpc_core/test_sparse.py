"""Sparse tensors over RPC and sparse gradients in distributed autograd.

Sparse COO and compressed (CSR, CSC, BSR, BSC) tensors travel as arguments and results of
``rpc_sync``, ``rpc_async`` and ``remote``/``to_here`` with their layout, indices, values
and coalesced state; a peer's malformed sparse tensor is refused, not built. An embedding
with ``sparse=True`` on a callee leaves a sparse gradient in the context there, and a sparse
gradient for a tensor the caller sent travels back sparse. ``DistributedOptimizer`` steps
SGD, Adagrad and SparseAdam on those gradients exactly as the same optimizer does in one
process (the oracle). A sparse tensor that requires grad, as an argument or a result, keeps
its autograd edge both ways: its gradients are those of one-process autograd (the oracle).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import rpc_core as rpc
import rpc_core.autograd as dist_autograd
from rpc_core.optim import DistributedOptimizer
from rpc_core.protocol import serialization as ser
from tests._world import run_world

W1 = "worker1"


def _send_receive(obj: Any) -> Any:
    s = ser.serialize(obj)
    return ser.deserialize(ser.encode_head(s.metas, None), s.body, ser.loopback(s.buffers))[0]


def _uncoalesced() -> torch.Tensor:
    # Index (1, 2) twice, out of order: not coalesced.
    return torch.sparse_coo_tensor(torch.tensor([[1, 0, 1], [2, 0, 2]]), torch.tensor([3.0, 4.0, 5.0]), (2, 3))


def _samples() -> dict[str, torch.Tensor]:
    dense = torch.tensor([[0.0, 1.0, 0.0, 0.0], [2.0, 0.0, 0.0, 3.0], [0.0, 0.0, 4.0, 0.0], [5.0, 0.0, 0.0, 6.0]])
    return {
        "coo": _uncoalesced(),
        "coo_coalesced": _uncoalesced().coalesce(),
        "csr": dense.to_sparse_csr(),
        "csc": dense.to_sparse_csc(),
        "bsr": dense.to_sparse_bsr((2, 2)),
        "bsc": dense.to_sparse_bsc((2, 2)),
    }


def _assert_same_sparse(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.layout == want.layout and got.shape == want.shape and got.dtype == want.dtype
    if want.layout == torch.sparse_coo:
        assert got.is_coalesced() == want.is_coalesced()
        assert torch.equal(got._indices(), want._indices()) and torch.equal(got._values(), want._values())
    else:
        assert torch.equal(got.values(), want.values())
    assert torch.equal(got.to_dense(), want.to_dense())


@pytest.mark.parametrize("kind", sorted(_samples()))
def test_sparse_tensors_keep_layout_indices_values_and_coalesced_state(kind: str) -> None:
    t = _samples()[kind]
    _assert_same_sparse(_send_receive(t), t)


def test_a_sparse_tensor_with_indices_out_of_range_is_refused_not_built() -> None:
    bad = torch.sparse_coo_tensor(torch.tensor([[5], [0]]), torch.tensor([1.0]), (2, 3), check_invariants=False)
    with pytest.raises(RuntimeError, match="index 5"):
        _send_receive(bad)


def _echo(x: Any) -> Any:
    return x


def _double(t: torch.Tensor) -> torch.Tensor:
    return t * 2


def _rpc_world(ctx: Any) -> list[str]:
    if ctx.rank != 0:
        return []
    checked = []
    for kind, t in _samples().items():
        _assert_same_sparse(rpc.rpc_sync(W1, _echo, args=(t,)), t)
        _assert_same_sparse(rpc.rpc_async(W1, _echo, args=({"t": t},)).wait()["t"], t)
        _assert_same_sparse(rpc.remote(W1, _echo, args=(t,)).to_here(), t)
        checked.append(kind)
    doubled = rpc.rpc_sync(W1, _double, args=(_uncoalesced(),))
    assert torch.equal(doubled.to_dense(), _uncoalesced().to_dense() * 2)
    return checked


def test_sparse_tensors_travel_as_arguments_and_results_of_every_call_kind() -> None:
    assert run_world(_rpc_world, 2, timeout=90)[0] == sorted(_samples(), key=list(_samples()).index)


# -- sparse gradients ------------------------------------------------------------------------
NUM, DIM = 20, 3
# Two steps of bags: (ids, offsets); ids repeat within and across bags.
BATCHES: list[tuple[list[int], list[int]]] = [([1, 2, 4, 2, 7], [0, 2]), ([7, 0, 1, 1, 19, 4], [0, 3, 4])]
OPTIMIZERS: list[tuple[str, type, dict[str, Any]]] = [
    ("sgd", torch.optim.SGD, dict(lr=0.1)),
    ("adagrad", torch.optim.Adagrad, dict(lr=0.1)),
    ("sparse_adam", torch.optim.SparseAdam, dict(lr=0.05)),
]


class Bags(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.bags = nn.EmbeddingBag(NUM, DIM, mode="sum", sparse=True)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.bags(ids, offsets)  # [num bags, DIM]


def _loss(pooled: torch.Tensor) -> torch.Tensor:
    return (pooled * torch.arange(1.0, DIM + 1)).pow(2).sum()


def _local_run(opt_cls: type, kwargs: dict[str, Any]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The oracle: the same steps with plain autograd in one process; the first step's
    (sparse) gradient and the final table."""
    m = Bags()
    opt = opt_cls(m.parameters(), **kwargs)
    grads = []
    for ids, offsets in BATCHES:
        opt.zero_grad(set_to_none=True)
        _loss(m(torch.tensor(ids), torch.tensor(offsets))).backward()
        grad = m.bags.weight.grad
        assert grad is not None
        grads.append(grad.clone())
        opt.step()
    return grads, m.bags.weight.detach().clone()


def _param_rrefs(module_rref: rpc.RRef) -> list[rpc.RRef]:
    return [rpc.RRef(p) for p in module_rref.local_value().parameters()]


def _gradient_here(context_id: int, module_rref: rpc.RRef) -> torch.Tensor:
    grads = dist_autograd.get_gradients(context_id)
    return grads[module_rref.local_value().bags.weight]


def _table(module_rref: rpc.RRef) -> torch.Tensor:
    return module_rref.local_value().bags.weight.detach().clone()


def _lookup(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, table, sparse=True)  # [len(ids), DIM]


def _grad_world(ctx: Any) -> dict[str, Any]:
    if ctx.rank != 0:
        return {}
    out: dict[str, Any] = {}
    for name, opt_cls, kwargs in OPTIMIZERS:
        module = rpc.remote(W1, Bags)
        opt = DistributedOptimizer(opt_cls, rpc.rpc_sync(W1, _param_rrefs, args=(module,)), **kwargs)
        grads = []
        for ids, offsets in BATCHES:
            with dist_autograd.context() as cid:
                pooled = module.rpc_sync().forward(torch.tensor(ids), torch.tensor(offsets))
                dist_autograd.backward(cid, [_loss(pooled)])
                grads.append(rpc.rpc_sync(W1, _gradient_here, args=(cid, module)))
                opt.step(cid)
        out[name] = ([_described(g) for g in grads], rpc.rpc_sync(W1, _table, args=(module,)).tolist())
    # A sparse gradient that crosses the wire: the caller's table is used by the callee.
    table = Bags().bags.weight.detach().clone().requires_grad_()
    looked_up = torch.tensor([3, 5, 3, 0])
    with dist_autograd.context() as cid:
        rows = rpc.rpc_sync(W1, _lookup, args=(looked_up, table))
        dist_autograd.backward(cid, [_loss(rows)])
        out["caller_table_grad"] = _described(dist_autograd.get_gradients(cid)[table])
    return out


def _described(grad: torch.Tensor) -> tuple[str, list[int], list[list[float]]]:
    """(layout, rows present, dense value as lists) of a gradient: what the pipe to the test
    carries (tensors would go through torch's shared-memory pickling, which needs the
    sending process alive)."""
    if grad.layout != torch.sparse_coo:
        return str(grad.layout), [], grad.tolist()
    c = grad.coalesce()
    return str(grad.layout), sorted(set(c.indices()[0].tolist())), c.to_dense().tolist()


@pytest.fixture(scope="module")
def grad_world() -> dict[str, Any]:
    return run_world(_grad_world, 2, timeout=120)[0]


@pytest.mark.parametrize("name", [o[0] for o in OPTIMIZERS])
def test_distributed_optimizer_steps_sparse_gradients_like_the_local_optimizer(
    grad_world: dict[str, Any], name: str
) -> None:
    _, opt_cls, kwargs = next(o for o in OPTIMIZERS if o[0] == name)
    want_grads, want_table = _local_run(opt_cls, kwargs)
    got_grads, got_table = grad_world[name]
    for (layout, rows, got), want, (ids, _) in zip(got_grads, want_grads, BATCHES, strict=True):
        assert layout == str(torch.sparse_coo) and rows == sorted(set(ids))  # only the rows the bags touched
        torch.testing.assert_close(torch.tensor(got), want.coalesce().to_dense(), rtol=0, atol=0)
    torch.testing.assert_close(torch.tensor(got_table), want_table, rtol=0, atol=0)


def test_a_sparse_gradient_for_a_tensor_the_caller_sent_comes_back_sparse(grad_world: dict[str, Any]) -> None:
    table = Bags().bags.weight.detach().clone().requires_grad_()
    _loss(F.embedding(torch.tensor([3, 5, 3, 0]), table, sparse=True)).backward()
    layout, rows, got = grad_world["caller_table_grad"]
    assert layout == str(torch.sparse_coo) and rows == [0, 3, 5]
    assert table.grad is not None
    torch.testing.assert_close(torch.tensor(got), table.grad.coalesce().to_dense(), rtol=0, atol=0)


# -- sparse tensors that require grad, through distributed autograd ------------------------------
# A sparse tensor that requires grad keeps its autograd edge across the wire both ways: sent
# as an argument (a leaf here) or returned (a result there), its gradient comes back whole,
# sparse or dense as the receiver's graph made it. The oracle: the same functions run in one
# process with plain autograd.
W2 = "worker2"


def _sparse_leaf(coalesce: bool) -> torch.Tensor:
    # Index (1, 2) twice, out of order: not coalesced unless asked.
    t = torch.sparse_coo_tensor(torch.tensor([[1, 0, 1, 2], [2, 0, 2, 1]]), torch.tensor([3.0, 4.0, 5.0, -1.5]), (3, 3))
    return (t.coalesce() if coalesce else t).requires_grad_()


def _leaves() -> dict[str, torch.Tensor]:
    torch.manual_seed(5)
    return {
        "s1": _sparse_leaf(False),
        "s2": _sparse_leaf(True),
        "d": torch.randn(3, 3, requires_grad=True),
        "w": torch.randn(3, 2, requires_grad=True),
    }


@rpc.safe.allow
def _sparse_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.add(a, b * 2)  # a sparse result that requires grad goes back


@rpc.safe.allow
def _sparse_mm(s: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.sparse.mm(s, w)  # dense result; s's gradient is sparse


@rpc.safe.allow
def _sparse_plus_dense(s: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return d * d + s  # dense result; s's gradient is dense


@rpc.safe.allow
def _sparse_nested(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # Through a third worker: the tensors hop twice each way.
    return rpc.rpc_sync(W2, _sparse_add, args=(a, b)) * 3


def _nested_locally(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _sparse_add(a, b) * 3


CASES = ("sparse_result", "sparse_grad_of_dense_result", "dense_grad_of_sparse_arg", "nested", "sent_twice")


def _case_loss(case: str, leaves: dict[str, torch.Tensor], call: Any) -> torch.Tensor:
    """The loss of ``case``; ``call(worker, fn, args)`` runs ``fn`` there (or here: the oracle)."""
    s1, s2, d, w = leaves["s1"], leaves["s2"], leaves["d"], leaves["w"]
    if case == "sparse_result":
        return torch.sparse.sum(call(W1, _sparse_add, (s1, s2)) * 1.5)
    if case == "sparse_grad_of_dense_result":
        coef = torch.tensor([[1.0, -2.0], [0.5, 3.0], [2.0, 1.0]])
        return (call(W1, _sparse_mm, (s1, w)) * coef).sum()
    if case == "dense_grad_of_sparse_arg":
        return (call(W1, _sparse_plus_dense, (s2, d)) ** 2).sum()
    if case == "nested":
        return torch.sparse.sum(call(W1, _sparse_nested, (s1, s2)))
    # s1 sent twice in one context: its gradients add up, as in one process.
    return torch.sparse.sum(call(W1, _sparse_add, (s1, s2))) + call(W1, _sparse_mm, (s1, w)).sum()


def _remote_call(worker: str, fn: Any, args: tuple[Any, ...]) -> Any:
    return rpc.remote(worker, fn, args=args).to_here() if fn is _sparse_mm else rpc.rpc_sync(worker, fn, args=args)


def _local_call(worker: str, fn: Any, args: tuple[Any, ...]) -> Any:
    return _nested_locally(*args) if fn is _sparse_nested else fn(*args)


def _local_grads() -> dict[str, dict[str, Any]]:
    """The oracle: each case's gradients for the leaves it reaches, with plain autograd."""
    out = {}
    for case in CASES:
        leaves = _leaves()  # fresh leaves per case: nothing accumulates across them
        loss = _case_loss(case, leaves, _local_call)
        names = list(leaves)
        grads = torch.autograd.grad([loss], [leaves[n] for n in names], allow_unused=True)
        out[case] = {n: _described(g) for n, g in zip(names, grads, strict=True) if g is not None}
    return out


def _sparse_autograd_world(ctx: Any) -> dict[str, dict[str, Any]]:
    if ctx.rank != 0:
        return {}
    out = {}
    for case in CASES:
        leaves = _leaves()
        with dist_autograd.context() as cid:
            loss = _case_loss(case, leaves, _remote_call)
            assert loss.requires_grad, f"{case}: the loss lost its autograd graph across the wire"
            dist_autograd.backward(cid, [loss])
            grads = dist_autograd.get_gradients(cid)
            out[case] = {n: _described(grads[t]) for n, t in leaves.items() if t in grads}
    return out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("serializer", ["pickle", "safe"])
def test_sparse_tensors_that_require_grad_get_the_gradients_of_one_process_autograd(serializer: str) -> None:
    got = run_world(_sparse_autograd_world, 3, options={"serializer": serializer}, timeout=120)[0]
    want = _local_grads()
    assert sorted(got) == sorted(want) == sorted(CASES)
    for case, grads in want.items():
        assert sorted(got[case]) == sorted(grads), case
        for name, (layout, _, dense) in grads.items():
            got_layout, _, got_dense = got[case][name]
            assert got_layout == layout, (case, name)
            torch.testing.assert_close(torch.tensor(got_dense), torch.tensor(dense), rtol=1e-6, atol=1e-6)


def test_a_sparse_result_that_requires_grad_arrives_requiring_grad_its_parts_do_not() -> None:
    s = _sparse_leaf(False)
    result = torch.add(s, s)  # not a leaf
    sent = ser.serialize({"r": result})
    assert any(t is result for t in sent.tensors)  # an entry of its own: distributed autograd sees it
    assert [t.requires_grad for t in sent.tensors].count(True) == 1
    got = _send_receive({"r": result})["r"]
    assert got.requires_grad and got.is_leaf and got.layout == torch.sparse_coo
    assert not got._values().requires_grad
    assert torch.equal(got.detach().to_dense(), result.detach().to_dense())


def test_a_sparse_meta_without_its_parts_before_it_is_refused() -> None:
    s = ser.serialize(_uncoalesced())
    metas = s.metas[-1:]  # the sparse entry alone, its parts dropped
    with pytest.raises(ValueError, match="without the 2 dense parts"):
        ser.rebuild_tensors(metas, ser.loopback(s.buffers))
