"""The root ``Config``: the top-level fields, every group, and the rules that span groups."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any

from ps_train.config.base import ConfigError, Problems, format_problems
from ps_train.config.cluster import ClusterConfig
from ps_train.config.data import CtrDataConfig, DataConfig, DigitsConfig
from ps_train.config.model import DLRMConfig, MLPConfig, ModelConfig
from ps_train.config.optim import OptimConfig
from ps_train.config.run import CheckpointConfig, LoggingConfig, ModeConfig, ProfileConfig, TrainConfig
from ps_train.modes import elastic_problems, run_problems

__all__ = ["Config", "BACKENDS", "ELASTIC_FILE", "RESUME_AUTO", "validate", "config_to_dict", "batch_problems"]

BACKENDS = ("rpc_core", "torch")
# A running elastic job's rendezvous (address, port, auth secret) in its run folder, for join=.
ELASTIC_FILE = "elastic.json"
RESUME_AUTO = "auto"  # resume=auto: this run folder's latest complete checkpoint, if it has one


@dataclass
class Config:
    # the runs' folder: runs/<experiment>/<date>_<time>/ (ps_train/conf/config.yaml: ${data.name}_${model.name})
    experiment: str = "default"
    seed: int = 0  # fixes initialisation, data order, dropout masks and shard placement
    backend: str = "rpc_core"  # rpc_core | torch (torch.distributed.rpc, for comparison)
    resume: str | None = None  # a run dir (latest checkpoint), a checkpoint dir, or auto (this run's own)
    join: str | None = None  # the run dir of a running cluster.elastic=true job: add a trainer to it
    model: ModelConfig = field(default_factory=MLPConfig)
    data: DataConfig = field(default_factory=DigitsConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    mode: ModeConfig = field(default_factory=ModeConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    def problems(self) -> Problems:
        """Every problem of the config: the top-level fields', each group's, and those of
        combinations no single group can judge (servers vs stages, model vs data shape)."""
        p = Problems()
        p.need(
            bool(re.fullmatch(r"[A-Za-z0-9_.,=+-]+", self.experiment or "")),
            f"experiment: {self.experiment!r} must be a non-empty name of letters, digits and _.,=+- "
            "(it becomes a folder under runs/)",
        )
        p.need(self.backend in BACKENDS, f"backend: unknown backend {self.backend!r}; choose one of {list(BACKENDS)}")
        if self.resume is not None and self.resume != RESUME_AUTO:
            p.need(
                os.path.exists(self.resume),
                f"resume: {self.resume!r} does not exist; pass a run dir (runs/<experiment>/<date>_<time>) "
                "or one of its checkpoint dirs (or resume=auto: this run folder's own latest checkpoint)",
            )
        p += self.model.problems()
        p += self.data.problems()
        p += self.cluster.problems()
        p += self._elastic_problems()
        if self.model.matches_schema() and self.data.matches_schema():
            p += self._model_vs_data_and_cluster()
        for group in (self.optim, self.mode, self.train, self.checkpoint, self.logging, self.profile):
            p += group.problems()
        p.need(
            not self.profile.enabled or self.backend == "rpc_core",
            "profile.enabled=true needs backend=rpc_core (its profiler records the servers' side of each RPC)",
        )
        p.need(
            self.cluster.serializer == "pickle" or self.backend == "rpc_core",
            f"cluster.serializer={self.cluster.serializer} needs backend=rpc_core (torch.distributed.rpc always "
            "pickles); use cluster.serializer=pickle with backend=torch",
        )
        return p

    def _elastic_problems(self) -> Problems:
        p = Problems()
        if self.join is not None:
            p.need(
                os.path.isfile(os.path.join(self.join, ELASTIC_FILE)),
                f"join: {self.join!r} is not the run folder of a running cluster.elastic=true job (it has no "
                f"{ELASTIC_FILE}); pass the run dir the job printed (runs/<experiment>/<date>_<time>)",
            )
            p.need(self.resume is None, "join: a joining trainer takes the job's state from its servers; drop resume=")
        if not self.cluster.elastic:
            return p
        p += elastic_problems(self)  # a mode that needs every trainer it started
        p.need(
            self.backend == "rpc_core",
            "cluster.elastic=true needs backend=rpc_core: torch.distributed.rpc reports no dead or frozen "
            "peers to the servers and reads a dynamic group's members once, at join",
        )
        return p

    def _model_vs_data_and_cluster(self) -> Problems:
        p = Problems()
        m, d, c = self.model, self.data, self.cluster
        if m.needs_ctr_data() != d.is_ctr():
            p.append(
                f"data: model {m.name!r} and data {d.name!r} do not go together; model=dlrm trains on CTR "
                "data (data=synthetic_ctr or data=criteo), the other models on images (e.g. data=digits)"
            )
            return p
        shape = d.sample_shape()
        stages = m.num_stages()
        p.need(
            c.num_servers <= stages or m.uses_every_server(),
            f"cluster.num_servers: {c.num_servers} servers but model {m.name!r} has only {stages} stages "
            f"(each server needs at least one); use cluster.num_servers<={stages} or a deeper model",
        )
        p += m.input_problems(shape, d.name)
        if isinstance(m, DLRMConfig) and isinstance(d, CtrDataConfig):
            p += m.table_problems(len(d.sizes()), d.has_id_weights())
            p.need(
                m.cache_rows == 0 or not c.update_in_backward,
                "model.cache_rows: a trainer pushes its cached rows' gradients before its update request, "
                "and cluster.update_in_backward=true sends the update with the backward; set one of them off",
            )
        p += batch_problems(d.train_samples(), c.num_trainers, self.train.batch_size)
        p += run_problems(self)  # the mode's own, with the other groups
        return p


def batch_problems(samples: int | None, trainers: int, batch_size: int) -> Problems:
    """Each trainer's share of ``samples`` training samples must hold a full batch: the data
    iterators take full batches only (every trainer the same number of steps). ``samples``:
    None when only the data files know (the launcher checks it once it has read them)."""
    p = Problems()
    if samples is not None and trainers >= 1 and batch_size >= 1:
        p.need(
            samples // trainers >= batch_size,
            f"train.batch_size={batch_size}: {trainers} trainers get only {samples // trainers} of {samples} "
            "training samples each, not a full batch; lower train.batch_size or cluster.num_trainers",
        )
    return p


def apply_table_declarations(cfg: Config) -> Problems:
    """A non-empty ``model.tables`` declares the tables: copy their sizes, poolings and feature
    names to ``data.table_sizes`` / ``data.num_tables``, ``model.pooling`` and
    ``model.feature_names``, where the rest of ps_train reads them. Those keys may only repeat
    what the tables say (a saved config does); anything else is a problem naming what to drop."""
    p = Problems()
    m, d = cfg.model, cfg.data
    if not isinstance(m, DLRMConfig) or not m.tables:
        return p
    if not isinstance(d, CtrDataConfig):
        return p  # the model-vs-data check says what to change
    sizes = [t.num_embeddings for t in m.tables]
    pooling = [t.pooling for t in m.tables]
    features = [t.feature() for t in m.tables]
    data_default = type(d)()
    drop = "model.tables declares the tables; drop"
    p.need(not d.table_sizes or list(d.table_sizes) == sizes, f"data.table_sizes: {drop} data.table_sizes")
    p.need(d.num_tables in (data_default.num_tables, len(sizes)), f"data.num_tables: {drop} data.num_tables")
    p.need(
        d.table_rows == data_default.table_rows,
        f"data.table_rows: {drop} data.table_rows (give each table's num_embeddings)",
    )
    p.need(
        not m.pooling or list(m.pooling) == pooling,
        f"model.pooling: {drop} model.pooling (give each table's pooling)",
    )
    p.need(
        not m.feature_names or list(m.feature_names) == features,
        f"model.feature_names: {drop} model.feature_names (give each table's feature_names)",
    )
    if not p:
        d.table_sizes, d.num_tables = sizes, len(sizes)
        m.pooling, m.feature_names = pooling, features
    return p


def dynamic_table_problems(cfg: Config) -> Problems:
    """What dynamic tables need of the rest of the config."""
    p = Problems()
    m, d = cfg.model, cfg.data
    if not isinstance(m, DLRMConfig) or not isinstance(d, CtrDataConfig) or not m.dynamic_tables():
        return p
    p.need(
        not cfg.checkpoint.differential,
        "checkpoint.differential: differential checkpoints do not hold dynamic tables (their rows move "
        "between slots); set checkpoint.differential=false, or make every model.tables entry kind: fixed",
    )
    bags = d.max_bag_sizes()
    for t in m.dynamic_tables():
        table = m.tables[t]
        if table.max_rows is None or t >= len(bags):
            continue
        # Rows are evicted between steps only, so that a step's lookups never race with them:
        # a server keeps free the slots one step's new ids may need.
        need = cfg.cluster.num_trainers * cfg.train.batch_size * bags[t]
        p.need(
            table.max_rows > need,
            f"model.tables[{t}].max_rows: {table.max_rows} slots per server cannot hold one step's new ids "
            f"besides older rows (up to cluster.num_trainers x train.batch_size x ids per bag = {need}); "
            f"raise it above {need}",
        )
    return p


def validate(cfg: Config) -> Config:
    """Check every rule; raise ``ConfigError`` listing every problem, else return cfg."""
    problems = apply_table_declarations(cfg)
    problems += cfg.problems()
    problems += dynamic_table_problems(cfg)
    if problems:
        raise ConfigError(format_problems(problems))
    return cfg


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """Plain nested dict of a Config (JSON/YAML-safe), e.g. for metrics.json or hparams."""
    return dataclasses.asdict(cfg)
