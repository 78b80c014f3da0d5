"""rpc_core.nn.RemoteModule: torch.distributed.nn.RemoteModule's behaviour on rpc_core.

Oracle: a training step through a RemoteModule (forward over RPC, distributed backward,
``DistributedOptimizer`` over ``remote_parameters()``) leaves the remote module equal to the
same step on a local copy of it. Bodies and module classes are module-level: worker
processes import them, and RPC ships them by reference.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
from torch import nn

from rpc_core.nn import remote_module as rm_mod
from tests._world import run_world


class TwoLayer(nn.Module):
    """Linear -> Dropout -> ReLU -> Linear, with one direct parameter (``scale``)."""

    def __init__(self, d_in: int, d_out: int, p: float = 0.0) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d_out))
        self.body = nn.Sequential(nn.Linear(d_in, 8), nn.Dropout(p), nn.ReLU(), nn.Linear(8, d_out))

    def forward(self, x: torch.Tensor, shift: float = 0.0) -> torch.Tensor:
        return self.body(x) * self.scale + shift


def not_a_module() -> int:
    return 3


def _forward_of_received(remote: Any, x: torch.Tensor) -> torch.Tensor:
    """On another worker: use a RemoteModule that arrived inside an RPC."""
    assert isinstance(remote, rm_mod.RemoteModule)
    return remote(x)


def _state(module_rref: Any) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module_rref.to_here().state_dict().items()}


def _step_body(ctx: Any) -> dict[str, Any]:
    import rpc_core.autograd as dist_autograd
    from rpc_core.nn import RemoteModule
    from rpc_core.optim import DistributedOptimizer

    if ctx.rank != 0:
        return {}
    torch.manual_seed(0)
    by_name = RemoteModule("worker1/cpu", TwoLayer, args=(4, 3))
    by_rank = RemoteModule("rank:2", nn.Linear, kwargs={"in_features": 3, "out_features": 2})
    local_a, local_b = by_name.get_module_rref().to_here(), by_rank.get_module_rref().to_here()
    params = by_name.remote_parameters() + by_rank.remote_parameters()
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.1, momentum=0.9)
    local_opt = torch.optim.SGD(list(local_a.parameters()) + list(local_b.parameters()), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)
        with dist_autograd.context() as cid:
            hidden = by_name(x, shift=0.5)  # __call__ -> forward, kwargs travel
            out = by_rank.forward_async(hidden).wait()
            loss = nn.functional.mse_loss(out, y)
            dist_autograd.backward(cid, [loss])
            opt.step(cid)
        local_opt.zero_grad()
        nn.functional.mse_loss(local_b(local_a(x, shift=0.5)), y).backward()
        local_opt.step()
    got = {
        **{f"a.{k}": v for k, v in _state(by_name.get_module_rref()).items()},
        **{f"b.{k}": v for k, v in _state(by_rank.get_module_rref()).items()},
    }
    want = {
        **{f"a.{k}": v for k, v in local_a.state_dict().items()},
        **{f"b.{k}": v for k, v in local_b.state_dict().items()},
    }
    direct = len(by_name.remote_parameters(recurse=False))
    return {
        "diffs": {k: float((got[k] - want[k]).abs().max()) for k in want},
        "loss": float(loss),
        "n_params": len(params),
        "direct": direct,
        "owners": sorted({p.owner_name() for p in params}),
    }


@pytest.mark.timeout(180)
def test_a_step_through_remote_modules_equals_the_local_step() -> None:
    out = run_world(_step_body, 3, timeout=150)[0]
    assert out["n_params"] == 5 + 2 and out["direct"] == 1
    assert out["owners"] == ["worker1", "worker2"]
    for name, diff in out["diffs"].items():
        assert diff <= 1e-6, f"{name}: remote step differs from the local step by {diff}"


def _modes_and_rpc_body(ctx: Any) -> dict[str, Any]:
    from rpc_core import rpc_sync
    from rpc_core.nn import RemoteModule

    if ctx.rank != 0:
        return {}
    torch.manual_seed(0)
    m = RemoteModule("worker1", TwoLayer, args=(4, 3), kwargs={"p": 0.5})
    local = m.get_module_rref().to_here()
    x = torch.randn(6, 4)
    returned = m.eval()
    eval_remote, eval_local = m(x), local.eval()(x)
    remote_flag_after_eval = m.get_module_rref().to_here().training
    m.train()
    remote_flag_after_train = m.get_module_rref().to_here().training
    # A RemoteModule inside an RPC: worker2 gets a handle to the same module on worker1.
    m.eval()
    via_worker2 = rpc_sync("worker2", _forward_of_received, args=(m, x))
    return {
        "same_handle": returned is m,
        "training": m.training,
        "eval_equal": torch.equal(eval_remote, eval_local),
        "flags": (remote_flag_after_eval, remote_flag_after_train),
        "via_worker2": torch.equal(via_worker2, eval_local),
        "repr": repr(m),
    }


@pytest.mark.timeout(180)
def test_train_eval_switch_the_remote_module_and_rpc_carries_the_handle() -> None:
    out = run_world(_modes_and_rpc_body, 3, timeout=150)[0]
    assert out["same_handle"] and out["training"] is False
    assert out["eval_equal"], "eval(): dropout off on the owner, output equals the local module's"
    assert out["flags"] == (False, True)
    assert out["via_worker2"], "a RemoteModule sent to worker2 runs the same remote module"
    assert out["repr"].startswith("RemoteModule(on='worker1', device='cpu'")


def _errors_body(ctx: Any) -> dict[str, Any]:
    from rpc_core import RpcError
    from rpc_core.nn import RemoteModule

    if ctx.rank != 0:
        return {}
    m = RemoteModule("worker1/cpu", nn.Linear, args=(2, 2))
    out: dict[str, Any] = {}
    for name in rm_mod._UNSUPPORTED + ("parameters",):
        try:
            getattr(m, name)()
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    for spec in ("worker1/cpu/0", "rank:x/cpu", "a:b:c/cpu", "/cpu", "worker1/nodevice", "cpu", "worker1/cuda:0"):
        try:
            RemoteModule(spec, nn.Linear, args=(2, 2))
            out["spec " + spec] = "no error"
        except ValueError as e:
            out["spec " + spec] = str(e)
    try:
        RemoteModule("nobody/cpu", nn.Linear, args=(2, 2))
    except RpcError as e:
        out["unknown worker"] = str(e)
    bad = RemoteModule("worker1/cpu", not_a_module)  # type: ignore[arg-type]  # not a module, on purpose
    try:
        bad(torch.ones(1))
    except ValueError as e:
        out["not a module"] = str(e)
    try:
        pickle.dumps(m)
    except RuntimeError as e:
        out["pickle"] = str(e)
    try:
        RemoteModule("worker1/cpu", nn.Linear, args=(2, 2), _module_interface_cls=object)
    except NotImplementedError as e:
        out["script"] = str(e)
    return out


@pytest.mark.timeout(120)
def test_unsupported_methods_and_bad_arguments_raise_like_torch() -> None:
    out = run_world(_errors_body, 2, timeout=100)[0]
    for name in rm_mod._UNSUPPORTED:
        assert out[name] == f"Method ``{name}`` not supported for RemoteModule"
    assert "Please use ``remote_parameters`` instead" in out["parameters"]
    for spec in ("worker1/cpu/0", "rank:x/cpu", "a:b:c/cpu", "/cpu", "worker1/nodevice"):
        assert out["spec " + spec].startswith(f"Could not parse remote_device: {spec}."), out["spec " + spec]
    assert "names a device but no worker" in out["spec cpu"] and "'<workername>/cpu'" in out["spec cpu"]
    assert "CPU tensors only" in out["spec worker1/cuda:0"] and "'worker1/cpu'" in out["spec worker1/cuda:0"]
    assert "'nobody'" in out["unknown worker"]
    assert "returns an instance of <class nn.Module>" in out["not a module"]
    assert out["pickle"].startswith("Cannot pickle RemoteModule in python pickler")
    assert "TorchScript" in out["script"]


def test_the_unsupported_methods_are_torchs() -> None:
    """The same nn.Module methods raise as on torch's RemoteModule (read from its code)."""
    from torch.distributed.nn.api.remote_module import _RemoteModule

    torch_unsupported = {
        name
        for name, f in vars(_RemoteModule).items()
        if "_raise_not_supported" in getattr(getattr(f, "__code__", None), "co_names", ())
    }
    assert torch_unsupported == set(rm_mod._UNSUPPORTED)


def test_remote_device_strings_parse_like_torchs() -> None:
    from torch.distributed.remote_device import _remote_device

    for spec in ("worker1/cpu", "worker1", "rank:3/cpu", "rank:3", "trainer_0/cpu"):
        theirs = _remote_device(spec)
        on = theirs.worker_name() if theirs.worker_name() is not None else theirs.rank()
        assert rm_mod.parse_remote_device(spec) == (on, str(theirs.device())), spec
    for spec in ("a/b/c", "rank:x/cpu", "/cpu"):
        with pytest.raises(ValueError):
            _remote_device(spec)
        with pytest.raises(ValueError, match="Could not parse remote_device"):
            rm_mod.parse_remote_device(spec)
