"""From Hydra to a ``Config``: the schemas in Hydra's ConfigStore, and the one conversion of
a composed (or saved) config into a validated ``Config``."""

from __future__ import annotations

import dataclasses
from typing import Any, cast

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ps_train.config.base import ConfigError, format_problems
from ps_train.config.data import (
    DATA_NAMES,
    DATA_SCHEMAS,
    CriteoConfig,
    DataConfig,
    DigitsConfig,
    SyntheticConfig,
    SyntheticCtrConfig,
    VisionDataConfig,
)
from ps_train.config.model import MODEL_SCHEMAS, ModelConfig
from ps_train.config.root import Config, validate

__all__ = ["register_configs", "register_model_schema", "from_dictconfig"]


def register_configs() -> None:
    """Register the schemas in Hydra's ConfigStore (idempotent; done on import of ps_train.config).

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
    cs.store(group="data", name="synthetic_ctr_schema", node=SyntheticCtrConfig)
    cs.store(group="data", name="criteo_schema", node=CriteoConfig)
    # cluster/optim/mode/logging have one schema each, already typed by the root schema.


def register_model_schema(name: str, schema: type[ModelConfig]) -> None:
    """Add a workload's model schema: ``model=<name>`` then selects it on the command line (no
    YAML file needed), and saved configs naming it load. Idempotent."""
    if not (isinstance(schema, type) and issubclass(schema, ModelConfig)):
        raise TypeError(f"model schema {name!r}: {schema!r} is not a ModelConfig dataclass")
    if MODEL_SCHEMAS.get(name, schema) is not schema:
        raise ValueError(f"model.name={name!r} is already the schema {MODEL_SCHEMAS[name].__name__}")
    MODEL_SCHEMAS[name] = schema
    cs = ConfigStore.instance()
    cs.store(group="model", name=f"{name}_schema", node=schema)
    cs.store(group="model", name=name, node=schema)


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
            problems.append(f"model.name: unknown model {model_name!r}; choose one of {list(MODEL_SCHEMAS)}")
        if data_name not in DATA_SCHEMAS:
            problems.append(f"data.name: unknown dataset {data_name!r}; choose one of {list(DATA_NAMES)}")
        if problems:
            raise ConfigError(format_problems(problems))
        schema = OmegaConf.structured(
            Config(model=MODEL_SCHEMAS[model_name](), data=DATA_SCHEMAS[data_name](name=data_name))
        )
        try:
            cfg = cast(DictConfig, OmegaConf.merge(schema, cfg))  # a dict merged onto a structured dict
        except OmegaConfBaseException as e:  # unknown key or wrong type in the saved file
            raise ConfigError(f"invalid ps_train config: {e}") from e
    extra = _unknown_keys(cfg)
    if extra:
        # Hydra's `+key=value` force-adds keys even to a schema; to_object would drop them.
        raise ConfigError(format_problems(extra))
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
        path = prefix + str(key)
        if known is not None and schema is not None and key not in known:
            problems.append(
                f"{path}: not a field of {schema.__name__} (fields: {', '.join(sorted(known))}); "
                "check the spelling, and do not add keys with +"
            )
            continue
        if OmegaConf.is_missing(node, key):
            continue
        child = node[key]
        if isinstance(child, DictConfig):
            problems += _unknown_keys(child, f"{path}.")
    return problems
