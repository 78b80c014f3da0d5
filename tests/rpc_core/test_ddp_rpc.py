"""A program that mixes RPC with a process group runs on rpc_core as on torch.

``examples/ddp_rpc.py`` is PyTorch's ``distributed/rpc/ddp_rpc`` example on rpc_core: a
RemoteModule (an EmbeddingBag on the parameter server) and a DistributedDataParallel layer
on two trainers that form their own gloo group, trained with distributed autograd and one
DistributedOptimizer over both. Its only rpc_core-specific lines are its imports: the test
swaps them for torch's to get the torch program, runs both, and checks each against the
same training in one process of plain torch (the DDP layer's gradient is the trainers'
mean, the embedding gets both trainers' gradients).
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import secrets
import sys
from typing import Any

import pytest
import torch

from tests._world import free_port, run_world

PROGRAM = pathlib.Path(__file__).resolve().parents[2] / "examples" / "ddp_rpc.py"
STEPS = 4
TORCH_IMPORTS = {
    "import rpc_core as rpc": "import torch.distributed.rpc as rpc",
    "import rpc_core.autograd as dist_autograd": "import torch.distributed.autograd as dist_autograd",
    "from rpc_core import RRef, TensorPipeRpcBackendOptions": (
        "from torch.distributed.rpc import RRef, TensorPipeRpcBackendOptions"
    ),
    "from rpc_core.nn import RemoteModule": "from torch.distributed.nn import RemoteModule",
    "from rpc_core.optim import DistributedOptimizer": "from torch.distributed.optim import DistributedOptimizer",
}


def torch_source() -> str:
    """The example with its rpc_core imports swapped for torch's; nothing else changes."""
    src = PROGRAM.read_text()
    for ours, theirs in TORCH_IMPORTS.items():
        assert src.count(ours + "  #") == 1, f"{PROGRAM.name} should import {ours!r} once"
        src = src.replace(ours + "  #", theirs + "  #")
    left = [line for line in src.splitlines() if line.startswith(("import rpc_core", "from rpc_core"))]
    assert not left, f"imports not swapped: {left}"
    return src


def load_program() -> Any:
    spec = importlib.util.spec_from_file_location("ddp_rpc_example", PROGRAM)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(ctx: Any, module_dir: str, module_name: str, pg_port: int) -> Any:
    sys.path.insert(0, module_dir)
    program = importlib.import_module(module_name)
    rpc_port = int(ctx.init_method.rsplit(":", 1)[1])
    return program.run_worker(ctx.rank, ctx.world_size, rpc_port, pg_port, STEPS)


def run_program(module_dir: str, module_name: str) -> dict[str, Any]:
    port = free_port()
    env = {"RPC_CORE_AUTH_SECRET": secrets.token_hex(16)}
    results = run_world(
        _run, 4, args=(module_dir, module_name, free_port()), init=False, env=env, port=port, timeout=240
    )
    return results[2]


def oracle(program: Any, initial_emb: dict[str, list], initial_fc: dict[str, list]) -> dict[str, Any]:
    """The same training in one process: per step, both trainers' losses on the same weights;
    the embedding steps with the sum of their gradients, the linear layer with their mean."""
    emb = torch.nn.EmbeddingBag(program.NUM_EMBEDDINGS, program.EMBEDDING_DIM, mode="sum")
    fc = torch.nn.Linear(program.EMBEDDING_DIM, program.NUM_CLASSES)
    emb.load_state_dict({k: torch.tensor(v) for k, v in initial_emb.items()})
    fc.load_state_dict({k: torch.tensor(v) for k, v in initial_fc.items()})
    data = [program.batches(r, STEPS) for r in (0, 1)]
    losses: list[list[float]] = [[], []]
    for step in range(STEPS):
        emb_grads, fc_grads = [], []
        for r in (0, 1):
            indices, offsets, target = data[r][step]
            loss = torch.nn.functional.cross_entropy(fc(emb(indices, offsets)), target)
            losses[r].append(loss.item())
            emb_grads.append(torch.autograd.grad(loss, list(emb.parameters()), retain_graph=True))
            fc_grads.append(torch.autograd.grad(loss, list(fc.parameters())))
        with torch.no_grad():
            for i, p in enumerate(emb.parameters()):
                p.sub_(program.LR * (emb_grads[0][i] + emb_grads[1][i]))
            for i, p in enumerate(fc.parameters()):
                p.sub_(program.LR * (fc_grads[0][i] + fc_grads[1][i]) / 2)
    return {"emb": emb.state_dict(), "fc": fc.state_dict(), "losses": losses}


def check_against_oracle(out: dict[str, Any]) -> None:
    program = load_program()
    trainers = out["trainers"]
    assert trainers[0]["initial_fc"] == trainers[1]["initial_fc"]  # DDP broadcast rank 0's
    want = oracle(program, out["initial_emb"], trainers[0]["initial_fc"])
    for r in (0, 1):
        assert torch.allclose(torch.tensor(trainers[r]["losses"]), torch.tensor(want["losses"][r]), atol=1e-5)
        for k, v in want["fc"].items():
            assert torch.allclose(torch.tensor(trainers[r]["fc"][k]), v, atol=1e-5), f"trainer{r} fc.{k}"
    for k, v in want["emb"].items():
        got = torch.tensor(out["emb"][k])
        assert torch.allclose(got, v, atol=1e-5), f"emb.{k} differs by {float((got - v).abs().max())}"
    assert not torch.equal(torch.tensor(out["emb"]["weight"]), torch.tensor(out["initial_emb"]["weight"]))


@pytest.mark.timeout(300)
def test_ddp_rpc_example_on_rpc_core_equals_one_process_of_torch() -> None:
    check_against_oracle(run_program(str(PROGRAM.parent), PROGRAM.stem))


@pytest.mark.timeout(300)
def test_the_same_program_on_torch_rpc_equals_it_too(tmp_path: pathlib.Path) -> None:
    """The oracle run: the example with torch's imports, on torch.distributed.rpc."""
    if not torch.distributed.rpc.is_available():
        pytest.skip("this torch build has no torch.distributed.rpc")
    (tmp_path / "ddp_rpc_on_torch.py").write_text(torch_source())
    check_against_oracle(run_program(str(tmp_path), "ddp_rpc_on_torch"))


def _root_pass_body(ctx: Any) -> dict[str, Any]:
    import rpc_core
    import rpc_core.autograd as dist_autograd

    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    w.grad = torch.full((2,), 7.0)  # the owner's own .grad: left as it was
    w.register_hook(lambda g: g * 2)  # a gradient hook runs once per pass, as in torch
    accumulated: list[torch.Tensor] = []
    w.register_post_accumulate_grad_hook(lambda p: accumulated.append(p.grad.clone()))
    with dist_autograd.context() as cid:
        remote_part = rpc_core.rpc_sync("worker1", torch.mul, args=(w, 3.0))  # r = 3w, (2,)
        loss = (remote_part * w).sum()
        dist_autograd.backward(cid, [loss])
        grad = dist_autograd.get_gradients(cid)[w]
    return {"grad": grad.tolist(), "dot_grad": w.grad.tolist(), "accumulated": [a.tolist() for a in accumulated]}


@pytest.mark.timeout(120)
def test_the_root_pass_runs_accumulators_but_leaves_grad_alone() -> None:
    """The caller's leaves go through their accumulators (DDP's hooks run there), which the
    gradient hook sees once and .grad only for the moment; the context holds the result."""
    out = run_world(_root_pass_body, 2, timeout=100)[0]
    # loss = sum(r * w) with r = 3w from worker1. The root pass gives d/dw = r = [3, 6],
    # doubled by the hook: [6, 12]; d/dr = w goes to worker1 and comes back as 3w = [3, 6]
    # in a second pass, doubled too: [12, 24] in all.
    assert out["grad"] == [12.0, 24.0]
    assert out["dot_grad"] == [7.0, 7.0]
    assert out["accumulated"] == [[6.0, 12.0]], "post-accumulate hooks run in the root pass only"
