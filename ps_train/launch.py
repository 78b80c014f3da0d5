"""Starting the roles: every process of a run, locally or as one rank of a larger job.

Ranks 0..S-1 are the parameter servers ``ps0..``, ranks S..S+T-1 the trainers
``trainer0..``. ``launch_local`` starts all of them on this machine with a fresh auth
secret and a free port, watches them, and stops the run as soon as one fails, naming it.
``run_rank`` is what each process runs (and, with ``cluster.launcher=env``, what a
torchrun/SLURM-started process runs directly).
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import secrets
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from ps_train import backend
from ps_train.config import Config, config_to_dict, from_dictconfig

log = logging.getLogger("ps_train")


class RoleFailed(RuntimeError):
    """A server or trainer process failed; the message names it."""


def role_name(rank: int, num_servers: int) -> str:
    return f"ps{rank}" if rank < num_servers else f"trainer{rank - num_servers}"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _setup_logging(run_dir: str, name: str, level: str) -> None:
    logs = Path(run_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(logs / f"{name}.log")
    handler.setFormatter(logging.Formatter(f"%(asctime)s [{name}] %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def run_rank(cfg: Config, rank: int, master_addr: str, master_port: int, secret: Optional[str], run_dir: str,
             resume_state: Optional[Dict[str, Any]] = None) -> Optional[Dict[str, Any]]:
    """Run one role until the whole job is done; returns the metrics on trainer0."""
    S, T = cfg.cluster.num_servers, cfg.cluster.num_trainers
    name = role_name(rank, S)
    torch.set_num_threads(1)  # many small processes on few cores: intra-op threads only fight
    _setup_logging(run_dir, name, cfg.logging.level)
    backend.select(cfg.backend)
    rpc = backend.rpc()
    from ps_train import server as server_mod
    from ps_train import trainer as trainer_mod

    if rank < S:
        ps = server_mod.create(cfg, rank)  # before init_rpc: trainers may ask for it at once
        if resume_state is not None:
            from ps_train.checkpoint_io import load_server_state

            load_server_state(ps, resume_state)
    opts = backend.make_options(f"tcp://{master_addr}:{master_port}", cfg.cluster.rpc_timeout,
                                cfg.cluster.num_worker_threads, secret)
    log.info("starting %s (rank %d of %d) on %s backend", name, rank, S + T, cfg.backend)
    rpc.init_rpc(name, rank=rank, world_size=S + T, rpc_backend_options=opts)
    result = None
    try:
        if rank >= S:
            start, data_state = 0, None
            if resume_state is not None:
                start = resume_state["step"]
                data_state = resume_state["trainer_positions"].get(name)
            t = trainer_mod.Trainer(cfg, rank - S, run_dir, start_step=start, data_state=data_state)
            from ps_train.checkpoint_io import checkpoint_hook

            result = t.run(on_step=checkpoint_hook(cfg, run_dir))
    finally:
        rpc.shutdown()
    log.info("%s finished", name)
    return result


def _child(cfg_dict: Dict[str, Any], rank: int, port: int, secret: str, run_dir: str,
           resume_state: Optional[Dict[str, Any]], results: Any) -> None:
    try:
        cfg = from_dictconfig(cfg_dict)
        out = run_rank(cfg, rank, cfg.cluster.master_addr, port, secret, run_dir, resume_state)
        if out is not None:
            results.put(out)
    except BaseException:
        name = role_name(rank, cfg_dict["cluster"]["num_servers"])
        msg = traceback.format_exc()
        logging.getLogger("ps_train").error("%s failed:\n%s", name, msg)
        sys.stderr.write(f"[{name}] failed:\n{msg}")
        sys.stderr.flush()
        os._exit(1)


def launch_local(cfg: Config, run_dir: str, resume_state: Optional[Dict[str, Any]] = None,
                 timeout: Optional[float] = None) -> Dict[str, Any]:
    """Start every role as a process on this machine; return trainer0's metrics."""
    S, T = cfg.cluster.num_servers, cfg.cluster.num_trainers
    port = cfg.cluster.master_port or free_port(cfg.cluster.master_addr)
    secret = secrets.token_hex(16)  # per run: only this run's processes can talk to each other
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    cfg_dict = config_to_dict(cfg)
    procs = {}
    for rank in range(S + T):
        p = ctx.Process(target=_child, args=(cfg_dict, rank, port, secret, run_dir, resume_state, results),
                        name=role_name(rank, S), daemon=False)
        p.start()
        procs[rank] = p
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        _watch(procs, S, run_dir, deadline)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.terminate()
        for p in procs.values():
            p.join(5)
            if p.is_alive():
                p.kill()
    return results.get(timeout=10)


def _watch(procs: Dict[int, Any], S: int, run_dir: str, deadline: Optional[float]) -> None:
    """Wait for all roles; on the first failure stop and name the role."""
    alive = dict(procs)
    while alive:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = multiprocessing.connection.wait([p.sentinel for p in alive.values()], timeout=remaining)
        if not ready:
            raise RoleFailed(f"the run did not finish within its time limit; roles still running: "
                             f"{[role_name(r, S) for r in alive]}")
        for rank, p in list(alive.items()):
            if p.sentinel in ready:
                p.join()
                del alive[rank]
                if p.exitcode != 0:
                    from ps_train.checkpoint import latest_checkpoint

                    last = latest_checkpoint(run_dir)
                    hint = (f"; the latest complete checkpoint is {last} (resume with resume={run_dir})"
                            if last else "; no checkpoint was written yet")
                    how = f"killed by signal {-p.exitcode}" if p.exitcode < 0 else f"exit code {p.exitcode}"
                    raise RoleFailed(f"{role_name(rank, S)} (rank {rank}) failed ({how}); stopped the run. "
                                     f"Its log: {run_dir}/logs/{role_name(rank, S)}.log{hint}")
