"""``cluster=env`` fed the exact variables each launcher of docs/deploy.md gives its processes:
torchrun on several nodes, SLURM's srun, a Kubeflow PyTorchJob. In-process: the config is
composed as ``python -m ps_train cluster=env`` composes it, and nothing is launched."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import ps_train
from ps_train.app import env_init_method
from ps_train.config import ConfigError, from_dictconfig
from ps_train.launch.environment import env_rank, first_slurm_host
from ps_train.launch.failures import role_name
from ps_train.launch.ports import free_port

CONF = Path(ps_train.__file__).resolve().parent / "conf"
S, T = 2, 6  # 8 ranks: ps0, ps1, trainer0..trainer5
LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_RESTART_COUNT",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_JOB_NODELIST",
    "SLURM_STEP_NODELIST",
    "PET_NODE_RANK",
)


def torchrun_env(nodes: int, per_node: int, store_port: int = 29400, host0: str = "node0") -> list[dict[str, str]]:
    """What torchrun (c10d rendezvous) sets in each worker: MASTER_ADDR/PORT are the store of
    the agent that got group rank 0."""
    world = nodes * per_node
    return [
        {
            "RANK": str(n * per_node + i),
            "LOCAL_RANK": str(i),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(per_node),
            "GROUP_RANK": str(n),
            "GROUP_WORLD_SIZE": str(nodes),
            "ROLE_RANK": str(n * per_node + i),
            "ROLE_WORLD_SIZE": str(world),
            "ROLE_NAME": "default",
            "MASTER_ADDR": host0,
            "MASTER_PORT": str(store_port),
            "TORCHELASTIC_RUN_ID": "job1",
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "3",
            "TORCHELASTIC_ERROR_FILE": f"/tmp/torchelastic_x/{n}_{i}/error.json",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            "OMP_NUM_THREADS": "1",
            "HOSTNAME": f"node{n}",
        }
        for n in range(nodes)
        for i in range(per_node)
    ]


def srun_env(per_node: int, nodelist: str, hosts: list[str]) -> list[dict[str, str]]:
    """What srun (block distribution) sets in each task of ``srun --ntasks-per-node=...``."""
    world = len(hosts) * per_node
    return [
        {
            "SLURM_PROCID": str(n * per_node + i),
            "SLURM_NTASKS": str(world),
            "SLURM_NPROCS": str(world),
            "SLURM_LOCALID": str(i),
            "SLURM_NODEID": str(n),
            "SLURM_NNODES": str(len(hosts)),
            "SLURM_JOB_NODELIST": nodelist,
            "SLURM_STEP_NODELIST": nodelist,
            "SLURM_NODELIST": nodelist,
            "SLURM_JOB_ID": "81234",
            "SLURM_STEP_ID": "0",
            "SLURM_TASKS_PER_NODE": f"{per_node}(x{len(hosts)})",
            "SLURM_CPUS_ON_NODE": "8",
            "SLURMD_NODENAME": host,
        }
        for n, host in enumerate(hosts)
        for i in range(per_node)
    ]


def pytorchjob_env(job: str, workers: int, port: int = 23456) -> list[dict[str, str]]:
    """What the training operator sets in a PyTorchJob's pods (one Master, ``workers`` Workers,
    nprocPerNode 1): every pod, the master's too, gets the master's service name."""
    world = workers + 1
    pods = [f"{job}-master-0"] + [f"{job}-worker-{i}" for i in range(workers)]
    return [
        {
            "MASTER_ADDR": f"{job}-master-0",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world),
            "RANK": str(r),
            "PET_MASTER_ADDR": f"{job}-master-0",
            "PET_MASTER_PORT": str(port),
            "PET_NNODES": str(world),
            "PET_NPROC_PER_NODE": "1",
            "PET_NODE_RANK": str(r),
            "PYTHONUNBUFFERED": "0",
            "HOSTNAME": pod,
        }
        for r, pod in enumerate(pods)
    ]


def derive(monkeypatch, env: dict[str, str], *overrides: str):
    """Compose ``cluster=env`` under ``env`` alone (no launcher variable of the test's own
    environment leaks in) and derive this rank's place."""
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        raw = compose(
            "config", overrides=["cluster=env", f"cluster.num_servers={S}", f"cluster.num_trainers={T}", *overrides]
        )
    cfg = from_dictconfig(raw)
    return cfg, env_rank(cfg.cluster, os.environ)


def check_job(monkeypatch, envs: list[dict[str, str]], host0: str, port: int, launcher: str):
    places = [derive(monkeypatch, env)[1] for env in envs]
    assert sorted(p.rank for p in places) == list(range(S + T))  # each rank exactly once
    assert {p.world_size for p in places} == {S + T}
    assert {(p.master_addr, p.master_port) for p in places} == {(host0, port)}  # all dial the same rank 0
    assert {p.launcher for p in places} == {launcher}
    roles = {role_name(p.rank, S) for p in places}
    assert roles == {"ps0", "ps1"} | {f"trainer{i}" for i in range(T)}
    return places


def test_torchrun_on_two_nodes(monkeypatch):
    envs = torchrun_env(nodes=2, per_node=4)
    places = check_job(monkeypatch, envs, "node0", 29400, "torchrun")
    for env, p in zip(envs, places, strict=True):
        assert (p.local_rank, p.node_rank) == (int(env["LOCAL_RANK"]), int(env["GROUP_RANK"]))
    rank0 = next(env for env, p in zip(envs, places, strict=True) if p.rank == 0)
    assert rank0["HOSTNAME"] == "node0"  # rank 0 (ps0) runs where MASTER_ADDR points


@pytest.mark.timeout(60)
def test_torchrun_ranks_meet_next_to_its_store(monkeypatch):
    """Under torchrun rank 0 picks rpc_core's port and hands it out through torchrun's store
    (here a real TCPStore on loopback standing in for the agent's)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    store_port = free_port()
    store = TCPStore("127.0.0.1", store_port, is_master=True, timeout=timedelta(seconds=30))
    envs = torchrun_env(nodes=2, per_node=4, store_port=store_port, host0="127.0.0.1")
    methods = set()
    for env in envs:  # rank 0 first: the others read what it set
        cfg, place = derive(monkeypatch, env, "cluster.init_timeout=30")
        methods.add(env_init_method(cfg, place))
    assert len(methods) == 1
    (method,) = methods
    assert method.startswith("tcp://127.0.0.1:") and method != f"tcp://127.0.0.1:{store_port}"
    del store


@pytest.mark.parametrize(
    "nodelist,hosts",
    [
        ("cn[017-019,042]", ["cn017", "cn018", "cn019", "cn042"]),
        ("gpu-a07,gpu-b[1-3]", ["gpu-a07", "gpu-b1", "gpu-b2", "gpu-b3"]),
    ],
)
def test_srun_without_master_addr_finds_rank0_on_the_first_node(monkeypatch, nodelist, hosts):
    envs = srun_env(per_node=2, nodelist=nodelist, hosts=hosts)
    places = check_job(monkeypatch, envs, hosts[0], 29500, "srun")
    rank0 = next(env for env, p in zip(envs, places, strict=True) if p.rank == 0)
    assert rank0["SLURMD_NODENAME"] == hosts[0]  # the derived address is rank 0's own node
    for env, p in zip(envs, places, strict=True):
        assert (p.local_rank, p.node_rank) == (int(env["SLURM_LOCALID"]), int(env["SLURM_NODEID"]))


def test_srun_with_the_batch_scripts_master_addr_and_port(monkeypatch):
    """docs/deploy.md's batch script exports MASTER_ADDR and MASTER_PORT before srun."""
    envs = [
        dict(env, MASTER_ADDR="cn017.cluster", MASTER_PORT="20417")
        for env in srun_env(per_node=2, nodelist="cn[017-020]", hosts=["cn017", "cn018", "cn019", "cn020"])
    ]
    check_job(monkeypatch, envs, "cn017.cluster", 20417, "srun")


def test_pytorchjob_master_and_workers(monkeypatch):
    envs = pytorchjob_env("ps-train", workers=S + T - 1)
    places = check_job(monkeypatch, envs, "ps-train-master-0", 23456, "RANK/WORLD_SIZE")
    rank0 = next(env for env, p in zip(envs, places, strict=True) if p.rank == 0)
    assert rank0["HOSTNAME"] == "ps-train-master-0"  # ps0 is the master pod, behind its service name
    assert {env_init_method(*derive(monkeypatch, env)) for env in envs} == {"tcp://ps-train-master-0:23456"}


@pytest.mark.parametrize(
    "env,message",
    [
        ({}, "needs RANK and WORLD_SIZE"),
        ({"RANK": "one", "WORLD_SIZE": "8"}, "RANK='one' is not a whole number"),
        ({"RANK": "8", "WORLD_SIZE": "8"}, "rank 8 of a world of 8"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}, "no MASTER_ADDR and no SLURM_JOB_NODELIST"),
    ],
)
def test_launcher_variables_that_name_no_place_fail_clearly(monkeypatch, env, message):
    with pytest.raises(ConfigError, match=message):
        derive(monkeypatch, env)


@pytest.mark.parametrize(
    "nodelist,first",
    [
        ("node1", "node1"),
        ("node[07-09,12],gpu1", "node07"),
        ("a[3,5]-ib[0-1]", "a3-ib0"),
        ("x,y", "x"),
    ],
)
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_an_unreadable_node_list_says_how_to_name_rank0():
    with pytest.raises(ConfigError, match="export MASTER_ADDR"):
        first_slurm_host("node[01")
