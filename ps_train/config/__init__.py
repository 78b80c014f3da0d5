"""Typed configuration for ps_train.

The dataclasses here are the schemas Hydra validates the YAML in ``ps_train/conf/`` and
every command-line override against, so a misspelt key (``optim.learning_rate=...``) or a wrong
type (``cluster.num_servers=two``) fails inside Hydra, before any process starts.
``from_dictconfig`` converts the composed config once into a ``Config`` object and
``validate`` rejects combinations a schema cannot express (0 trainers, more servers than
model stages, negative staleness, ...), naming the offending field and how to fix it.

One module per config group, each schema checking itself (``problems()``): ``model``,
``data``, ``cluster``, ``optim``, and ``run`` (mode, train, checkpoint, logging); ``root``
holds ``Config`` and the rules that span groups, ``loading`` the Hydra side (a prepared
Criteo folder, ``data.prepared``, is checked where the data is read:
``ps_train.workloads.ctr.data.prepared``). Model and data groups have one schema per
choice (``MLPConfig``, ``CNNConfig``, ...), all subclasses of ``ModelConfig`` /
``DataConfig``: a field that belongs to another model (``model.channels`` while
``model=mlp``) is a Hydra error, not a silently ignored key. Those schemas also answer
what validation and sharding need to know before anything is built or loaded:
``ModelConfig.num_stages()``, ``DataConfig.sample_shape()``, ``DataConfig.class_count()``.
Nothing here imports the rest of ps_train but the update modes (``ps_train.modes``), which
check their own options and import nothing else.
"""

from ps_train.config.base import ConfigError
from ps_train.config.cluster import LAUNCHERS, PLACEMENTS, ClusterConfig
from ps_train.config.data import (
    BAG_SIZE_DISTS,
    DATA_NAMES,
    DATA_SCHEMAS,
    VISION_SHAPES,
    CriteoConfig,
    CtrDataConfig,
    DataConfig,
    DigitsConfig,
    SyntheticConfig,
    SyntheticCtrConfig,
    VisionDataConfig,
)
from ps_train.config.loading import from_dictconfig, register_configs, register_model_schema
from ps_train.config.model import (
    INTERACTIONS,
    MODEL_NAMES,
    MODEL_SCHEMAS,
    POOLINGS,
    CNNConfig,
    DLRMConfig,
    MLPConfig,
    ModelConfig,
    ResNetConfig,
)
from ps_train.config.optim import OPTIMIZERS, TABLE_OPTIMIZER_NAMES, OptimConfig, optimizer_spec
from ps_train.config.root import BACKENDS, ELASTIC_FILE, RESUME_AUTO, Config, batch_problems, config_to_dict, validate
from ps_train.config.run import (
    AGGREGATES,
    MODE_NAMES,
    STALENESS_RULES,
    CheckpointConfig,
    LoggingConfig,
    ModeConfig,
    ProfileConfig,
    TrainConfig,
)
from ps_train.config.tables import EVICTIONS, TABLE_KINDS, TableConfig

__all__ = [
    "TableConfig",
    "TABLE_KINDS",
    "EVICTIONS",
    "ModelConfig",
    "MLPConfig",
    "CNNConfig",
    "ResNetConfig",
    "DLRMConfig",
    "DataConfig",
    "DigitsConfig",
    "VisionDataConfig",
    "SyntheticConfig",
    "CtrDataConfig",
    "SyntheticCtrConfig",
    "CriteoConfig",
    "ClusterConfig",
    "OptimConfig",
    "ModeConfig",
    "TrainConfig",
    "CheckpointConfig",
    "LoggingConfig",
    "ProfileConfig",
    "Config",
    "ConfigError",
    "MODEL_NAMES",
    "register_model_schema",
    "MODEL_SCHEMAS",
    "DATA_NAMES",
    "DATA_SCHEMAS",
    "VISION_SHAPES",
    "MODE_NAMES",
    "AGGREGATES",
    "STALENESS_RULES",
    "PLACEMENTS",
    "LAUNCHERS",
    "BACKENDS",
    "OPTIMIZERS",
    "TABLE_OPTIMIZER_NAMES",
    "BAG_SIZE_DISTS",
    "POOLINGS",
    "INTERACTIONS",
    "register_configs",
    "from_dictconfig",
    "validate",
    "optimizer_spec",
    "config_to_dict",
    "RESUME_AUTO",
    "ELASTIC_FILE",
    "batch_problems",
]

register_configs()
