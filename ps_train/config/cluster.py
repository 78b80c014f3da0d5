"""The ``cluster`` group: how many roles, where they meet, how shards are placed."""

from __future__ import annotations

from dataclasses import dataclass

from ps_train.config.base import Problems

__all__ = ["ClusterConfig", "PLACEMENTS", "LAUNCHERS"]

PLACEMENTS = ("round_robin", "balanced")
LAUNCHERS = ("local", "env")
SERIALIZERS = ("pickle", "safe")  # rpc_core.RpcBackendOptions(serializer=...)


@dataclass
class ClusterConfig:
    num_servers: int = 2  # parameter servers: ranks 0..num_servers-1, named ps0, ps1, ...
    num_trainers: int = 2  # trainers: the ranks after the servers, named trainer0, trainer1, ...
    placement: str = "balanced"  # round_robin | balanced (by parameter bytes)
    master_addr: str = "127.0.0.1"  # rank 0's address, where the ranks meet (the rendezvous)
    master_port: int = 0  # 0: the launcher picks a free port
    launcher: str = "local"  # local: spawn all roles here; env: one rank from RANK/WORLD_SIZE/...
    rpc_timeout: float = 60.0  # seconds; 0 = no timeout
    # Seconds the ranks wait for each other to start (the rendezvous): process start-up on a busy
    # or large cluster may take far longer than one call should.
    init_timeout: float = 300.0
    num_worker_threads: int = 8  # threads each process serves RPCs with (RpcBackendOptions)
    # Local launcher: restart the whole run from its latest complete checkpoint when a role dies or
    # stops answering, at most this often (0: a failed role stops the run). Under launcher=env
    # torchrun's --max-restarts restarts the processes instead (see docs/training_failures.md).
    max_restarts: int = 0
    # Local launcher: seconds without a heartbeat after which a role counts as frozen (0: off).
    role_timeout: float = 30.0
    # async/ssp, local launcher, rpc_core: a trainer that dies or freezes is replaced instead of
    # stopping the run, and trainers may join the running job (docs/training_failures.md, ps_train.elastic.membership).
    elastic: bool = False
    # rpc_core only: each server takes a trainer's update when its part of the distributed
    # backward is done (rpc_core.autograd hooks), so a step sends each server a forward and a
    # gradient call; false: a separate update call after the backward (as backend=torch).
    # null (auto): on where it trains faster (docs/benchmarks.md): sync mode, whose servers
    # apply the round after answering, unless model.cache_rows > 0; off for async, ssp, hybrid.
    update_in_backward: bool | None = None
    # rpc_core only: how messages are encoded. pickle (as torch); safe: rpc_core's own
    # encoding, nothing unpickled, calls limited to ps_train's RPC functions and classes
    # (ps_train.rpc_allowlist), so a peer that holds the run's secret still runs nothing else.
    serializer: str = "pickle"

    def problems(self) -> Problems:
        p = Problems()
        p.need(self.num_servers >= 1, f"cluster.num_servers: {self.num_servers} must be >= 1")
        p.need(self.num_trainers >= 1, f"cluster.num_trainers: {self.num_trainers} must be >= 1")
        p.need(
            self.placement in PLACEMENTS,
            f"cluster.placement: unknown {self.placement!r}; choose one of {list(PLACEMENTS)}",
        )
        p.need(
            self.launcher in LAUNCHERS, f"cluster.launcher: unknown {self.launcher!r}; choose one of {list(LAUNCHERS)}"
        )
        p.need(
            0 <= self.master_port <= 65535,
            f"cluster.master_port: {self.master_port} must be in 0..65535 (0 = pick a free port)",
        )
        # Empty under launcher=env: rank 0's host comes from the launcher (ps_train.launch.environment).
        p.need(
            bool(self.master_addr) or self.launcher == "env", "cluster.master_addr: must not be empty (e.g. 127.0.0.1)"
        )
        p.need(
            self.serializer in SERIALIZERS,
            f"cluster.serializer: unknown {self.serializer!r}; choose one of {list(SERIALIZERS)}",
        )
        p.need(self.rpc_timeout >= 0, f"cluster.rpc_timeout: {self.rpc_timeout} must be >= 0 (0 = no timeout)")
        p.need(self.init_timeout > 0, f"cluster.init_timeout: {self.init_timeout} must be > 0 seconds")
        p.need(self.num_worker_threads >= 1, f"cluster.num_worker_threads: {self.num_worker_threads} must be >= 1")
        p.need(self.max_restarts >= 0, f"cluster.max_restarts: {self.max_restarts} must be >= 0 (0 = no restarts)")
        p.need(
            self.launcher != "env" or self.max_restarts == 0,
            f"cluster.max_restarts: {self.max_restarts} with cluster.launcher=env, where no ps_train launcher "
            "watches the ranks; let torchrun restart them (torchrun --max-restarts=N ...), each restarted "
            "attempt resumes from the run folder's latest checkpoint by itself",
        )
        p.need(
            self.role_timeout >= 0,
            f"cluster.role_timeout: {self.role_timeout} must be >= 0 seconds (0 = do not detect frozen roles)",
        )
        p.need(
            not self.elastic or self.launcher == "local",
            "cluster.elastic=true needs cluster.launcher=local: the local launcher replaces dead trainers; "
            "under cluster=env let torchrun restart the job (torchrun --max-restarts=N), or run the servers "
            "and first trainers with cluster=local and add trainers with join=<run dir>",
        )
        return p
