"""A small torch.distributed.rpc program, written against torch's API names only.

test_port.py runs this file unchanged on torch.distributed.rpc, and again with its imports
changed to rpc_core, and expects the same output. Launch one process per rank with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (as torchrun would)."""

import json
import os

import torch
import torch.distributed.rpc as rpc
from torch.distributed.rpc import RRef, TensorPipeRpcBackendOptions


class ParameterServer:
    def __init__(self, size):
        self.weight = torch.zeros(size)
        self.updates = 0

    def get_weight(self):
        return self.weight

    def apply(self, grad, lr):
        self.weight -= lr * grad
        self.updates += 1
        return self.updates

    @staticmethod
    def describe():
        return "ParameterServer"


def square(x):
    return x * x


def sum_of(rrefs):
    return sum(r.to_here() for r in rrefs)


@rpc.functions.async_execution
def add_then_double(to, x):
    return rpc.rpc_async(to, torch.add, args=(x, 1)).then(lambda fut: fut.wait() * 2)


def train_step(ps_rref, x):
    weight = ps_rref.rpc_sync().get_weight()
    return ps_rref.rpc_sync().apply(weight + x, 0.5)


def main():
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    options = TensorPipeRpcBackendOptions(num_worker_threads=8, rpc_timeout=60)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    if rank == 0:
        out = {}
        out["sync"] = rpc.rpc_sync("worker1", square, args=(torch.arange(3.0),)).tolist()
        out["async"] = rpc.rpc_async(1, torch.add, args=(torch.ones(2), 2)).wait().tolist()
        futs = [rpc.rpc_async(rpc.get_worker_info("worker2"), square, args=(torch.tensor(float(i)),)) for i in range(4)]
        out["wait_all"] = [t.item() for t in torch.futures.wait_all(futs)]
        out["async_execution"] = rpc.rpc_sync("worker1", add_then_double, args=("worker2", torch.ones(2))).tolist()
        ps = rpc.remote("worker1", ParameterServer, args=(3,))
        out["steps"] = [rpc.rpc_sync("worker2", train_step, args=(ps, torch.ones(3))) for _ in range(3)]
        out["weight"] = ps.rpc_sync().get_weight().tolist()
        out["describe"] = ps.rpc_async().describe().wait()
        out["remote_proxy"] = ps.remote().get_weight().to_here().tolist()
        out["owner"] = [ps.owner_name(), ps.owner().id, ps.is_owner()]
        mine = RRef(torch.full((2,), 5.0))
        theirs = rpc.remote("worker2", torch.add, args=(torch.ones(2), 0))
        out["rrefs"] = rpc.rpc_sync("worker1", sum_of, args=([mine, theirs],)).tolist()
        out["me"] = [rpc.get_worker_info().name, rpc.get_worker_info().id]
        print("RESULT " + json.dumps(out, sort_keys=True), flush=True)
    rpc.shutdown()


if __name__ == "__main__":
    main()
