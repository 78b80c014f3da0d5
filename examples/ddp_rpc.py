"""RPC and DistributedDataParallel in one program: PyTorch's ``distributed/rpc/ddp_rpc`` example,
on rpc_core and on CPU.

Run from the repository root::

    python examples/ddp_rpc.py            # 4 local processes, 127.0.0.1, free ports
    python examples/ddp_rpc.py --steps 50

Four processes: ``master`` (rank 2) and ``ps`` (rank 3) and two trainers (ranks 0, 1). The
master builds a ``RemoteModule`` holding an ``nn.EmbeddingBag`` on ``ps`` and hands it to
both trainers over RPC. The trainers also form their own gloo process group
(``torch.distributed.init_process_group``, on a second port) and wrap a local ``nn.Linear``
in ``DistributedDataParallel``. Each step: the remote embedding lookup, the DDP layer,
``rpc_core.autograd.backward`` (DDP averages the linear layer's gradients between the
trainers meanwhile), and one ``DistributedOptimizer.step`` over the embedding's parameters
(on ``ps``) and the local DDP parameters (as local RRefs).

The program differs from a torch.distributed.rpc program only in the import lines marked
``torch:``; tests/rpc_core/test_ddp_rpc.py runs it both ways and checks each against one
process of plain torch. Against torch's example: CPU instead of CUDA, ports as arguments,
seeded batches, and a ``dist.barrier()`` after each step so that both trainers' updates of
the shared embedding are applied before either reads it again (the result is then
deterministic, up to the order of two additions).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import secrets
import socket
import sys
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # this checkout's rpc_core

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import rpc_core as rpc  # noqa: E402  torch: import torch.distributed.rpc as rpc
import rpc_core.autograd as dist_autograd  # noqa: E402  torch: import torch.distributed.autograd as dist_autograd
from rpc_core import RRef, TensorPipeRpcBackendOptions  # noqa: E402  torch: from torch.distributed.rpc import ...
from rpc_core.nn import RemoteModule  # noqa: E402  torch: from torch.distributed.nn import RemoteModule
from rpc_core.optim import DistributedOptimizer  # noqa: E402  torch: from torch.distributed.optim import ...

NUM_EMBEDDINGS = 100
EMBEDDING_DIM = 16
NUM_CLASSES = 8
LR = 0.05


class HybridModel(torch.nn.Module):
    """A sparse part (the remote EmbeddingBag on ``ps``) and a dense part (an nn.Linear
    replicated on the trainers by DDP)."""

    def __init__(self, remote_emb_module: RemoteModule) -> None:
        super().__init__()
        self.remote_emb_module = remote_emb_module
        self.fc = DDP(torch.nn.Linear(EMBEDDING_DIM, NUM_CLASSES))

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        emb_lookup = self.remote_emb_module.forward(indices, offsets)  # (bags, EMBEDDING_DIM)
        return self.fc(emb_lookup)  # (bags, NUM_CLASSES)


def batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Trainer ``rank``'s batches: (indices (n,), bag offsets (bags,), targets (bags,)), seeded."""
    g = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(steps):
        num_indices = int(torch.randint(20, 50, (), generator=g))
        indices = torch.randint(0, NUM_EMBEDDINGS, (num_indices,), generator=g)
        offsets, start = [], 0
        while start < num_indices:
            offsets.append(start)
            start += int(torch.randint(1, 10, (), generator=g))
        target = torch.randint(0, NUM_CLASSES, (len(offsets),), generator=g)
        out.append((indices, torch.tensor(offsets), target))
    return out


def _state(module: torch.nn.Module) -> dict[str, list]:
    return {k: v.tolist() for k, v in module.state_dict().items()}


def _run_trainer(remote_emb_module: RemoteModule, rank: int, steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = HybridModel(remote_emb_module)
    initial_fc = _state(model.fc.module)
    # The embedding's parameters as RRefs on ps, and the local DDP parameters as local RRefs
    # (model.parameters() would ask the RemoteModule for its parameters, which it refuses).
    model_parameter_rrefs = model.remote_emb_module.remote_parameters()
    for param in model.fc.parameters():
        model_parameter_rrefs.append(RRef(param))
    opt = DistributedOptimizer(torch.optim.SGD, model_parameter_rrefs, lr=LR)
    criterion = torch.nn.CrossEntropyLoss()
    losses = []
    for indices, offsets, target in batches(rank, steps):
        with dist_autograd.context() as context_id:
            output = model(indices, offsets)
            loss = criterion(output, target)
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        dist.barrier()  # both trainers stepped: the next forward sees both embedding updates
        losses.append(loss.item())
    print(f"trainer{rank}: {steps} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    return {"losses": losses, "initial_fc": initial_fc, "fc": _state(model.fc.module)}


def run_worker(rank: int, world_size: int, rpc_port: int, pg_port: int, steps: int = 10) -> dict[str, Any] | None:
    """One process: rank 2 is the master, 3 the parameter server, 0 and 1 the trainers.
    The master returns what the run did (for tests): the embedding before and after
    training, and each trainer's losses and linear layer."""
    # Different ports for the RPC group and the trainers' process group.
    rpc_backend_options = TensorPipeRpcBackendOptions()
    rpc_backend_options.init_method = f"tcp://127.0.0.1:{rpc_port}"
    result = None
    if rank == 2:
        rpc.init_rpc("master", rank=rank, world_size=world_size, rpc_backend_options=rpc_backend_options)
        remote_emb_module = RemoteModule(
            "ps", torch.nn.EmbeddingBag, args=(NUM_EMBEDDINGS, EMBEDDING_DIM), kwargs={"mode": "sum"}
        )
        initial_emb = _state(remote_emb_module.get_module_rref().to_here())
        futs = [rpc.rpc_async(f"trainer{r}", _run_trainer, args=(remote_emb_module, r, steps)) for r in (0, 1)]
        trainers = [fut.wait() for fut in futs]
        result = {
            "initial_emb": initial_emb,
            "emb": _state(remote_emb_module.get_module_rref().to_here()),
            "trainers": trainers,
        }
    elif rank <= 1:
        dist.init_process_group(backend="gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{pg_port}")
        rpc.init_rpc(f"trainer{rank}", rank=rank, world_size=world_size, rpc_backend_options=rpc_backend_options)
    else:
        rpc.init_rpc("ps", rank=rank, world_size=world_size, rpc_backend_options=rpc_backend_options)
    rpc.shutdown()  # blocks until every worker is done
    if rank <= 1:
        dist.destroy_process_group()
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _process(rank: int, rpc_port: int, pg_port: int, steps: int) -> None:
    torch.set_num_threads(1)
    run_worker(rank, 4, rpc_port, pg_port, steps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10, help="training steps per trainer")
    ap.add_argument("--timeout", type=float, default=300.0, help="kill the processes after this many seconds")
    args = ap.parse_args()
    os.environ.setdefault("RPC_CORE_AUTH_SECRET", secrets.token_hex(16))  # the same for every process
    ports = (_free_port(), _free_port())
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_process, args=(rank, *ports, args.steps)) for rank in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(args.timeout)
    failed = [rank for rank, p in enumerate(procs) if p.is_alive() or p.exitcode != 0]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if failed:
        print(f"failed ranks: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
