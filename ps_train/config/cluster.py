"""The ``cluster`` group: how many roles, where they meet, how shards are placed."""
from __future__ import annotations

from dataclasses import dataclass

from ps_train.config.base import Problems

__all__ = ["ClusterConfig", "PLACEMENTS", "LAUNCHERS"]

PLACEMENTS = ("round_robin", "balanced")
LAUNCHERS = ("local", "env")


@dataclass
class ClusterConfig:
    num_servers: int = 2
    num_trainers: int = 2
    placement: str = "balanced"  # round_robin | balanced (by parameter bytes)
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: the launcher picks a free port
    launcher: str = "local"  # local: spawn all roles here; env: one rank from RANK/WORLD_SIZE/...
    rpc_timeout: float = 60.0  # seconds; 0 = no timeout
    num_worker_threads: int = 8

    def problems(self) -> Problems:
        p = Problems()
        p.need(self.num_servers >= 1, f"cluster.num_servers: {self.num_servers} must be >= 1")
        p.need(self.num_trainers >= 1, f"cluster.num_trainers: {self.num_trainers} must be >= 1")
        p.need(self.placement in PLACEMENTS,
               f"cluster.placement: unknown {self.placement!r}; choose one of {list(PLACEMENTS)}")
        p.need(self.launcher in LAUNCHERS,
               f"cluster.launcher: unknown {self.launcher!r}; choose one of {list(LAUNCHERS)}")
        p.need(0 <= self.master_port <= 65535,
               f"cluster.master_port: {self.master_port} must be in 0..65535 (0 = pick a free port)")
        p.need(bool(self.master_addr), "cluster.master_addr: must not be empty (e.g. 127.0.0.1)")
        p.need(self.rpc_timeout >= 0, f"cluster.rpc_timeout: {self.rpc_timeout} must be >= 0 (0 = no timeout)")
        p.need(self.num_worker_threads >= 1, f"cluster.num_worker_threads: {self.num_worker_threads} must be >= 1")
        return p
