"""Typed configuration for ps_train.

The dataclasses below are the schemas Hydra validates the YAML in ``ps_train/conf/`` and
every command-line override against, so a misspelt key (``optim.learning_rate=...``) or a wrong
type (``cluster.num_servers=two``) fails inside Hydra, before any process starts.
``from_dictconfig`` converts the composed config once into a ``Config`` object and
``validate`` rejects combinations a schema cannot express (0 trainers, more servers than
model stages, negative staleness, ...), naming the offending field and how to fix it.

Model and data groups have one schema per choice (``MLPConfig``, ``CNNConfig``, ...),
all subclasses of ``ModelConfig`` / ``DataConfig``: a field that belongs to another model
(``model.channels`` while ``model=mlp``) is a Hydra error, not a silently ignored key.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

__all__ = [
    "ModelConfig", "MLPConfig", "CNNConfig", "ResNetConfig",
    "DataConfig", "DigitsConfig", "VisionDataConfig", "SyntheticConfig",
    "ClusterConfig", "OptimConfig", "ModeConfig", "TrainConfig", "CheckpointConfig",
    "LoggingConfig", "Config", "ConfigError",
    "MODEL_NAMES", "DATA_NAMES", "MODE_NAMES", "PLACEMENTS", "LAUNCHERS", "BACKENDS",
    "OPTIMIZERS", "register_configs", "from_dictconfig", "validate", "optimizer_spec",
    "config_to_dict",
]


class ConfigError(ValueError):
    """An invalid configuration; the message lists every problem as ``field: what, fix``."""


# ----------------------------------------------------------------------------- model


@dataclass
class ModelConfig:
    """Base schema of the ``model`` group; ``name`` selects the architecture."""

    name: str = MISSING


@dataclass
class MLPConfig(ModelConfig):
    name: str = "mlp"
    # One stage per hidden layer (Linear+ReLU+Dropout) plus a final Linear stage.
    hidden_sizes: list[int] = field(default_factory=lambda: [128, 64])
    dropout: float = 0.0


@dataclass
class CNNConfig(ModelConfig):
    name: str = "cnn"
    # One stage per conv block (conv3x3 + ReLU + 2x2 max-pool), then an fc stage and a
    # classifier stage. Each block halves H and W, so inputs need H, W >= 2**len(channels).
    channels: list[int] = field(default_factory=lambda: [32, 64])
    fc_size: int = 128
    dropout: float = 0.0


@dataclass
class ResNetConfig(ModelConfig):
    name: str = "resnet18"
    # True: 3x3 stride-1 stem and no max-pool (the usual CIFAR adaptation), which keeps
    # spatial resolution for 8x8..32x32 inputs. False: torchvision's ImageNet stem.
    small_input: bool = True


# ------------------------------------------------------------------------------ data


@dataclass
class DataConfig:
    """Base schema of the ``data`` group; ``name`` selects the dataset."""

    name: str = MISSING


@dataclass
class DigitsConfig(DataConfig):
    name: str = "digits"
    test_fraction: float = 0.2
    # Fixes the train/test split (not the training order, which follows the top-level seed),
    # so test accuracy is comparable across runs with different seeds.
    split_seed: int = 0


@dataclass
class VisionDataConfig(DataConfig):
    """mnist / fashion_mnist / cifar10, read by torchvision from ``root``."""

    root: str = "data"
    download: bool = False


@dataclass
class SyntheticConfig(DataConfig):
    name: str = "synthetic"
    shape: list[int] = field(default_factory=lambda: [1, 28, 28])  # per sample: C,H,W or D
    num_classes: int = 10
    train_size: int = 4096
    test_size: int = 1024
    noise: float = 1.0  # std of the noise around each class prototype
    data_seed: int = 0


# ----------------------------------------------------------------------- the others


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


@dataclass
class OptimConfig:
    name: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9  # optimizers without momentum (adam, ...) need 0 here
    weight_decay: float = 0.0
    nesterov: bool = False
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])


@dataclass
class ModeConfig:
    name: str = "sync"  # sync | async | ssp
    staleness: int = 0  # ssp only: max steps a trainer may run ahead of the slowest


@dataclass
class TrainConfig:
    # Exactly one of steps / epochs; both count per trainer (an epoch = one pass over the
    # trainer's own partition).
    steps: int | None = 300
    epochs: int | None = None
    batch_size: int = 32  # per trainer
    eval_every: int = 100  # steps; 0 = evaluate only at the end
    eval_batch_size: int = 512
    log_every: int = 20


@dataclass
class CheckpointConfig:
    every: int = 100  # steps; 0 = only at the end
    keep: int = 2  # newest complete checkpoints to keep; 0 = keep all


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    progress: bool = True  # periodic one-line status (step, loss, samples/s)
    level: str = "INFO"


@dataclass
class Config:
    # ps_train/conf/config.yaml sets this to ${data.name}_${model.name}; runs go to runs/<experiment>/.
    experiment: str = "default"
    seed: int = 0
    backend: str = "rpc_core"  # rpc_core | torch (torch.distributed.rpc, for comparison)
    resume: str | None = None  # a run dir (latest checkpoint) or a checkpoint dir
    model: ModelConfig = field(default_factory=MLPConfig)
    data: DataConfig = field(default_factory=DigitsConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    mode: ModeConfig = field(default_factory=ModeConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


MODEL_SCHEMAS: dict[str, type[ModelConfig]] = {
    "mlp": MLPConfig, "cnn": CNNConfig, "resnet18": ResNetConfig,
}
DATA_SCHEMAS: dict[str, type[DataConfig]] = {
    "digits": DigitsConfig, "mnist": VisionDataConfig, "fashion_mnist": VisionDataConfig,
    "cifar10": VisionDataConfig, "synthetic": SyntheticConfig,
}
MODEL_NAMES = tuple(MODEL_SCHEMAS)
DATA_NAMES = tuple(DATA_SCHEMAS)
MODE_NAMES = ("sync", "async", "ssp")
PLACEMENTS = ("round_robin", "balanced")
LAUNCHERS = ("local", "env")
BACKENDS = ("rpc_core", "torch")
# name -> (optimizer class, OptimConfig fields it takes)
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], tuple[str, ...]]] = {
    "sgd": (torch.optim.SGD, ("momentum", "weight_decay", "nesterov")),
    "adam": (torch.optim.Adam, ("betas", "weight_decay")),
    "adamw": (torch.optim.AdamW, ("betas", "weight_decay")),
    "rmsprop": (torch.optim.RMSprop, ("momentum", "weight_decay")),
    "adagrad": (torch.optim.Adagrad, ("weight_decay",)),
}


def register_configs() -> None:
    """Register the schemas in Hydra's ConfigStore (idempotent; done on import).

    ``config_schema`` is the root; model and data files extend ``<group>/<name>_schema``,
    the subclass for their choice.
    """
    cs = ConfigStore.instance()
    # The root schema types model/data as the base classes, so any subclass chosen by the
    # group (mlp, cnn, ...) can be merged in; a concrete default would reject the others.
    cs.store(name="config_schema", node=Config(model=ModelConfig(), data=DataConfig()))
    for name, schema in MODEL_SCHEMAS.items():
        cs.store(group="model", name=f"{name}_schema", node=schema)
    cs.store(group="data", name="digits_schema", node=DigitsConfig)
    cs.store(group="data", name="vision_schema", node=VisionDataConfig)
    cs.store(group="data", name="synthetic_schema", node=SyntheticConfig)
    # cluster/optim/mode/logging have one schema each, already typed by the root schema.


register_configs()


def from_dictconfig(cfg: DictConfig | dict[str, Any], check: bool = True) -> Config:
    """Convert a composed (or saved, plain) config into a validated ``Config``.

    A plain config, e.g. a run's saved ``.hydra/config.yaml`` loaded for resume, is first
    merged onto the schemas its ``model.name`` / ``data.name`` select, so it gets the same
    type checks as a freshly composed one.
    """
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.create(cfg)
    if OmegaConf.get_type(cfg) is not Config:
        model_name = OmegaConf.select(cfg, "model.name", default="mlp")
        data_name = OmegaConf.select(cfg, "data.name", default="digits")
        problems = []
        if model_name not in MODEL_SCHEMAS:
            problems.append(f"model.name: unknown model {model_name!r}; choose one of {list(MODEL_NAMES)}")
        if data_name not in DATA_SCHEMAS:
            problems.append(f"data.name: unknown dataset {data_name!r}; choose one of {list(DATA_NAMES)}")
        if problems:
            raise ConfigError(_format(problems))
        schema = OmegaConf.structured(
            Config(model=MODEL_SCHEMAS[model_name](), data=DATA_SCHEMAS[data_name](name=data_name))
        )
        try:
            cfg = OmegaConf.merge(schema, cfg)
        except OmegaConfBaseException as e:  # unknown key or wrong type in the saved file
            raise ConfigError(f"invalid ps_train config: {e}") from e
    extra = _unknown_keys(cfg)
    if extra:
        # Hydra's `+key=value` force-adds keys even to a schema; to_object would drop them.
        raise ConfigError(_format(extra))
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, Config):
        raise ConfigError(f"expected a ps_train Config, got {type(obj).__name__}")
    return validate(obj) if check else obj


def _unknown_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """Keys of a structured config that its dataclass does not declare, as problems."""
    problems = []
    schema = OmegaConf.get_type(node)
    known = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else None
    for key in node.keys():
        path = f"{prefix}{key}"
        if known is not None and key not in known:
            problems.append(f"{path}: not a field of {schema.__name__} (fields: {', '.join(sorted(known))}); "
                            "check the spelling, and do not add keys with +")
            continue
        if OmegaConf.is_missing(node, key):
            continue
        child = node[key]
        if isinstance(child, DictConfig):
            problems += _unknown_keys(child, f"{path}.")
    return problems


def _format(problems: list[str]) -> str:
    return "invalid ps_train config:\n  - " + "\n  - ".join(problems)


def validate(cfg: Config) -> Config:
    """Check cross-field rules; raise ``ConfigError`` listing every problem, else return cfg."""
    # Imported here: models/data import this module for their config types.
    from ps_train.data import data_shape
    from ps_train.models import num_stages

    p: list[str] = []

    def need(ok: bool, msg: str) -> None:
        if not ok:
            p.append(msg)

    need(bool(re.fullmatch(r"[A-Za-z0-9_.,=+-]+", cfg.experiment or "")),
         f"experiment: {cfg.experiment!r} must be a non-empty name of letters, digits and _.,=+- "
         "(it becomes a folder under runs/)")
    need(cfg.backend in BACKENDS, f"backend: unknown backend {cfg.backend!r}; choose one of {list(BACKENDS)}")
    if cfg.resume is not None:
        need(os.path.exists(cfg.resume),
             f"resume: {cfg.resume!r} does not exist; pass a run dir (runs/<experiment>/<date>_<time>) "
             "or one of its checkpoint dirs")

    m = cfg.model
    model_ok = m.name in MODEL_SCHEMAS and isinstance(m, MODEL_SCHEMAS[m.name])
    if m.name not in MODEL_SCHEMAS:
        p.append(f"model.name: unknown model {m.name!r}; choose one of {list(MODEL_NAMES)} (e.g. model=cnn)")
    elif not model_ok:
        p.append(f"model.name: {m.name!r} does not match the selected model group "
                 f"({type(m).__name__}); select the model with model={m.name}, not model.name=")
    if isinstance(m, MLPConfig):
        need(all(h > 0 for h in m.hidden_sizes), f"model.hidden_sizes: {m.hidden_sizes} must all be > 0")
    if isinstance(m, (MLPConfig, CNNConfig)):
        need(0.0 <= m.dropout < 1.0, f"model.dropout: {m.dropout} must be in [0, 1)")
    if isinstance(m, CNNConfig):
        need(len(m.channels) > 0 and all(c > 0 for c in m.channels),
             f"model.channels: {m.channels} must be a non-empty list of positive ints")
        need(m.fc_size > 0, f"model.fc_size: {m.fc_size} must be > 0")

    d = cfg.data
    data_ok = d.name in DATA_SCHEMAS and isinstance(d, DATA_SCHEMAS[d.name])
    if d.name not in DATA_SCHEMAS:
        p.append(f"data.name: unknown dataset {d.name!r}; choose one of {list(DATA_NAMES)} (e.g. data=mnist)")
    elif not data_ok:
        p.append(f"data.name: {d.name!r} does not match the selected data group "
                 f"({type(d).__name__}); select the dataset with data={d.name}, not data.name=")
    if isinstance(d, DigitsConfig):
        need(0.0 < d.test_fraction < 1.0, f"data.test_fraction: {d.test_fraction} must be in (0, 1)")
    if isinstance(d, SyntheticConfig):
        need(len(d.shape) in (1, 3) and all(s > 0 for s in d.shape),
             f"data.shape: {d.shape} must be [C, H, W] or [D] with positive sizes")
        need(d.num_classes >= 2, f"data.num_classes: {d.num_classes} must be >= 2")
        need(d.train_size > 0 and d.test_size > 0,
             f"data.train_size/test_size: {d.train_size}/{d.test_size} must be > 0")
        need(d.noise >= 0, f"data.noise: {d.noise} must be >= 0")

    c = cfg.cluster
    need(c.num_servers >= 1, f"cluster.num_servers: {c.num_servers} must be >= 1")
    need(c.num_trainers >= 1, f"cluster.num_trainers: {c.num_trainers} must be >= 1")
    need(c.placement in PLACEMENTS, f"cluster.placement: unknown {c.placement!r}; choose one of {list(PLACEMENTS)}")
    need(c.launcher in LAUNCHERS, f"cluster.launcher: unknown {c.launcher!r}; choose one of {list(LAUNCHERS)}")
    need(0 <= c.master_port <= 65535, f"cluster.master_port: {c.master_port} must be in 0..65535 (0 = pick a free port)")
    need(bool(c.master_addr), "cluster.master_addr: must not be empty (e.g. 127.0.0.1)")
    need(c.rpc_timeout >= 0, f"cluster.rpc_timeout: {c.rpc_timeout} must be >= 0 (0 = no timeout)")
    need(c.num_worker_threads >= 1, f"cluster.num_worker_threads: {c.num_worker_threads} must be >= 1")
    if model_ok and data_ok:
        shape = data_shape(d)
        stages = num_stages(m)
        need(c.num_servers <= stages,
             f"cluster.num_servers: {c.num_servers} servers but model {m.name!r} has only {stages} stages "
             f"(each server needs at least one); use cluster.num_servers<={stages} or a deeper model")
        if isinstance(m, CNNConfig):
            need(len(shape) == 3 and min(shape[1:]) >= 2 ** len(m.channels),
                 f"model.channels: {len(m.channels)} conv blocks halve H and W each, but data {d.name!r} "
                 f"has sample shape {list(shape)}; need [C, H, W] with H, W >= {2 ** len(m.channels)}")
        if isinstance(m, ResNetConfig):
            need(len(shape) == 3, f"model: resnet18 needs image data [C, H, W]; data {d.name!r} has shape {list(shape)}")
            if cfg.backend == "torch" and cfg.mode.name == "sync":
                # Sync mode runs BatchNorm shards' forwards in trainer order: up to (trainers - 1)
                # requests per shard wait in server threads, and torch's RPC pool has a fixed size.
                per_server = 1 if c.placement == "balanced" else -(-stages // max(c.num_servers, 1))
                least = (c.num_trainers - 1) * per_server + 2
                need(c.num_worker_threads >= least,
                     f"cluster.num_worker_threads: {c.num_worker_threads} is too few for resnet18 in sync mode on "
                     f"backend=torch with {c.num_trainers} trainers (forwards wait for their turn in server "
                     f"threads); use cluster.num_worker_threads>={least}")

    o = cfg.optim
    if o.name not in OPTIMIZERS:
        p.append(f"optim.name: unknown optimizer {o.name!r}; choose one of {list(OPTIMIZERS)}")
    else:
        takes = OPTIMIZERS[o.name][1]
        need("momentum" in takes or o.momentum == 0,
             f"optim.momentum: {o.name} has no momentum; remove the override or use optim=sgd")
        need("nesterov" in takes or not o.nesterov, "optim.nesterov: only sgd supports nesterov")
    need(o.lr > 0, f"optim.lr: {o.lr} must be > 0")
    need(o.momentum >= 0, f"optim.momentum: {o.momentum} must be >= 0")
    need(not o.nesterov or o.momentum > 0, "optim.nesterov: needs optim.momentum > 0")
    need(o.weight_decay >= 0, f"optim.weight_decay: {o.weight_decay} must be >= 0")
    need(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), f"optim.betas: {o.betas} must be two values in [0, 1)")

    md = cfg.mode
    need(md.name in MODE_NAMES, f"mode.name: unknown mode {md.name!r}; choose one of {list(MODE_NAMES)} (e.g. mode=ssp)")
    if md.name == "ssp":
        need(md.staleness >= 0, f"mode.staleness: {md.staleness} must be >= 0 in ssp mode")
    else:
        need(md.staleness == 0, f"mode.staleness: only used by mode=ssp (got {md.staleness} with mode={md.name})")

    t = cfg.train
    need((t.steps is None) != (t.epochs is None),
         f"train.steps/train.epochs: set exactly one (got steps={t.steps}, epochs={t.epochs}); "
         "e.g. train.steps=null train.epochs=3")
    need(t.steps is None or t.steps > 0, f"train.steps: {t.steps} must be > 0")
    need(t.epochs is None or t.epochs > 0, f"train.epochs: {t.epochs} must be > 0")
    need(t.batch_size > 0, f"train.batch_size: {t.batch_size} must be > 0")
    need(t.eval_batch_size > 0, f"train.eval_batch_size: {t.eval_batch_size} must be > 0")
    need(t.eval_every >= 0, f"train.eval_every: {t.eval_every} must be >= 0 (0 = only at the end)")
    need(t.log_every >= 1, f"train.log_every: {t.log_every} must be >= 1")
    need(cfg.checkpoint.every >= 0, f"checkpoint.every: {cfg.checkpoint.every} must be >= 0 (0 = only at the end)")
    need(cfg.checkpoint.keep >= 0, f"checkpoint.keep: {cfg.checkpoint.keep} must be >= 0 (0 = keep all)")
    need(isinstance(logging.getLevelName(cfg.logging.level.upper()), int),
         f"logging.level: unknown level {cfg.logging.level!r}; use DEBUG, INFO, WARNING or ERROR")
    if p:
        raise ConfigError(_format(p))
    return cfg


def optimizer_spec(cfg: OptimConfig) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The optimizer class and its kwargs, e.g. for ``DistributedOptimizer(cls, rrefs, **kw)``."""
    if cfg.name not in OPTIMIZERS:
        raise ConfigError(f"optim.name: unknown optimizer {cfg.name!r}; choose one of {list(OPTIMIZERS)}")
    cls, takes = OPTIMIZERS[cfg.name]
    kwargs: dict[str, Any] = {"lr": cfg.lr}
    for name in takes:
        value = getattr(cfg, name)
        kwargs[name] = tuple(value) if name == "betas" else value
    return cls, kwargs


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """Plain nested dict of a Config (JSON/YAML-safe), e.g. for metrics.json or hparams."""
    return dataclasses.asdict(cfg)
