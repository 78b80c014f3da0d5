"""The ``model`` group: one schema per architecture, each knowing its own stage count.

The stage counts here are the facts validation and sharding need before any model is built;
``ps_train.workloads.vision.models`` builds exactly that many stages (its tests check that the two agree).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from ps_train.config.base import Problems
from ps_train.config.optim import TABLE_OPTIMIZER_NAMES
from ps_train.config.tables import TableConfig

__all__ = [
    "ModelConfig",
    "MLPConfig",
    "CNNConfig",
    "ResNetConfig",
    "DLRMConfig",
    "MODEL_SCHEMAS",
    "MODEL_NAMES",
    "TABLE_SHARDINGS",
    "POOLINGS",
    "INTERACTIONS",
    "TABLE_DTYPES",
    "LAZY_TABLE_OPTIMIZERS",
    "parse_size",
]

TABLE_SHARDINGS = ("range", "mod")
POOLINGS = ("sum", "mean")  # how a table's bag of rows becomes one vector (nn.EmbeddingBag's modes)
# model.interaction: dot (DLRM's pairwise dot products) | dcn (DCN-v2's low-rank cross layers)
INTERACTIONS = ("dot", "dcn")
DCN_DEFAULTS = {"dcn_layers": 3, "dcn_rank": 16}


@dataclass
class ModelConfig:
    """Base schema of the ``model`` group; ``name`` selects the architecture."""

    name: str = MISSING  # the architecture: choose it with model=<name> (not model.name=)

    def num_stages(self) -> int:
        """Number of stages ``ps_train.workloads.vision.models.build_stages`` makes, without building anything."""
        raise ValueError(
            f"model.name: unknown model {self.name!r} ({type(self).__name__}); "
            "choose model=mlp, model=cnn or model=resnet18"
        )

    def has_batch_norm(self) -> bool:
        """Whether a forward updates BatchNorm running statistics (servers order such forwards)."""
        return False

    def needs_ctr_data(self) -> bool:
        """Whether the model trains on click-through-rate data (dense features + table ids)."""
        return False

    def uses_every_server(self) -> bool:
        """Whether every server hosts part of the model whatever its stage count (row-sharded
        tables), so ``cluster.num_servers`` is not limited by ``num_stages()``."""
        return False

    def matches_schema(self) -> bool:
        """``name`` is a known model and this object is that model's schema."""
        return self.name in MODEL_SCHEMAS and isinstance(self, MODEL_SCHEMAS[self.name])

    def problems(self) -> Problems:
        """This group's own problems (see ``Config.problems`` for those across groups)."""
        p = Problems()
        if self.name not in MODEL_SCHEMAS:
            p.append(f"model.name: unknown model {self.name!r}; choose one of {list(MODEL_SCHEMAS)} (e.g. model=cnn)")
        elif not self.matches_schema():
            p.append(
                f"model.name: {self.name!r} does not match the selected model group "
                f"({type(self).__name__}); select the model with model={self.name}, not model.name="
            )
        return p

    def input_problems(self, shape: tuple[int, ...], data_name: str) -> Problems:
        """Problems feeding this model samples of ``shape`` (no batch dim) from ``data_name``."""
        return Problems()


@dataclass
class MLPConfig(ModelConfig):
    name: str = "mlp"
    # One stage per hidden layer (Linear+ReLU+Dropout) plus a final Linear stage.
    hidden_sizes: list[int] = field(default_factory=lambda: [128, 64])
    dropout: float = 0.0  # dropout probability after each hidden layer (masks seeded per step)

    def num_stages(self) -> int:
        return len(self.hidden_sizes) + 1

    def problems(self) -> Problems:
        p = super().problems()
        p.need(all(h > 0 for h in self.hidden_sizes), f"model.hidden_sizes: {self.hidden_sizes} must all be > 0")
        p.need(0.0 <= self.dropout < 1.0, f"model.dropout: {self.dropout} must be in [0, 1)")
        return p


@dataclass
class CNNConfig(ModelConfig):
    name: str = "cnn"
    # One stage per conv block (conv3x3 + ReLU + 2x2 max-pool), then an fc stage and a
    # classifier stage. Each block halves H and W, so inputs need H, W >= 2**len(channels).
    channels: list[int] = field(default_factory=lambda: [32, 64])
    fc_size: int = 128  # width of the fully connected stage after the conv blocks
    dropout: float = 0.0  # dropout probability before the classifier stage

    def num_stages(self) -> int:
        return len(self.channels) + 2

    def problems(self) -> Problems:
        p = super().problems()
        p.need(0.0 <= self.dropout < 1.0, f"model.dropout: {self.dropout} must be in [0, 1)")
        p.need(
            len(self.channels) > 0 and all(c > 0 for c in self.channels),
            f"model.channels: {self.channels} must be a non-empty list of positive ints",
        )
        p.need(self.fc_size > 0, f"model.fc_size: {self.fc_size} must be > 0")
        return p

    def input_problems(self, shape: tuple[int, ...], data_name: str) -> Problems:
        p = Problems()
        p.need(
            len(shape) == 3 and min(shape[1:]) >= 2 ** len(self.channels),
            f"model.channels: {len(self.channels)} conv blocks halve H and W each, but data {data_name!r} "
            f"has sample shape {list(shape)}; need [C, H, W] with H, W >= {2 ** len(self.channels)}",
        )
        return p


@dataclass
class ResNetConfig(ModelConfig):
    name: str = "resnet18"
    # True: 3x3 stride-1 stem and no max-pool (the usual CIFAR adaptation), which keeps
    # spatial resolution for 8x8..32x32 inputs. False: torchvision's ImageNet stem.
    small_input: bool = True

    def num_stages(self) -> int:
        return 6  # stem, layer1, layer2, layer3, layer4, head

    def has_batch_norm(self) -> bool:
        return True

    def input_problems(self, shape: tuple[int, ...], data_name: str) -> Problems:
        p = Problems()
        p.need(
            len(shape) == 3, f"model: resnet18 needs image data [C, H, W]; data {data_name!r} has shape {list(shape)}"
        )
        return p


@dataclass
class DLRMConfig(ModelConfig):
    """A DLRM-style CTR model: bottom MLP on the dense features, one embedding table per
    categorical feature (sizes from the ``data`` group), an interaction (``dot``, or
    DCN-v2's cross layers), top MLP, BCE.

    The bottom MLP and the top stage (the cross layers, if any, and the top MLP) are two
    stages placed on servers like any model's; every
    table is split by rows across all servers (``table_sharding``) and updated sparsely by
    ``table_optim``."""

    name: str = "dlrm"
    embedding_dim: int = 16  # width of every table row (and of the bottom MLP's output)
    bottom_mlp: list[int] = field(default_factory=lambda: [64, 32])  # hidden sizes; its output is embedding_dim
    top_mlp: list[int] = field(default_factory=lambda: [64, 32])  # hidden sizes; its output is 1 logit
    # dot (pairwise dot products) | dcn (DCN-v2 low-rank cross layers before the top MLP, docs/ctr.md)
    interaction: str = "dot"
    dcn_layers: int = DCN_DEFAULTS["dcn_layers"]  # interaction=dcn: cross layers
    dcn_rank: int = DCN_DEFAULTS["dcn_rank"]  # interaction=dcn: rank r of each layer's U [N, r] V [r, N]
    table_sharding: str = "range"  # range (contiguous rows per server) | mod (id % num_servers)
    table_optim: str = "adagrad"  # sgd | adagrad | sparse_adam | rowwise_adagrad: touched rows only (ctr.optimizers)
    table_lr: float | None = None  # null: optim.lr
    pooling: list[str] = field(default_factory=list)  # per table sum | mean; []: sum; one value: every table
    feature_names: list[str] = field(default_factory=list)  # each table's feature (KeyedJagged keys); []: f0, f1, ...
    cache_rows: int = 0  # hot rows each trainer caches (ps_train.workloads.ctr.tables.cache); 0: no cache
    cache_staleness: int = 1  # steps a cached row serves before it is pulled again
    # The tables one by one (TorchRec's EmbeddingBagConfig fields, ps_train.config.tables); []:
    # fixed tables from data.num_tables/table_sizes, model.pooling and model.feature_names.
    tables: list[TableConfig] = field(default_factory=list)
    # Where rows live (docs/tables.md). Lazy: a row exists once a batch touches it, its value
    # depending only on (seed, table, row); false (with no budget and float32): every row in RAM from the start.
    lazy_rows: bool = False
    # Per server, e.g. 2GB, 512MiB or bytes: hot rows in RAM, the rest on disk under the run
    # folder (implies lazy rows); null: no disk tier.
    table_memory_budget: str | None = None
    table_dtype: str = (
        "float32"  # float32 | float16 | bfloat16: rows in RAM and on disk (optimizer state stays float32)
    )

    def num_stages(self) -> int:
        return 2  # bottom MLP, top MLP

    def tiered(self) -> bool:
        """Whether the tables use the lazy (optionally tiered, half-precision) storage."""
        return self.lazy_rows or self.table_memory_budget is not None or self.table_dtype != "float32"

    def memory_budget_bytes(self) -> int | None:
        """``table_memory_budget`` in bytes (None: no disk tier)."""
        return None if self.table_memory_budget is None else parse_size(self.table_memory_budget)

    def dynamic_tables(self) -> list[int]:
        """Indices of the tables declared ``kind: dynamic`` (ascending)."""
        return [t for t, table in enumerate(self.tables) if table.dynamic]

    def declared_problems(self) -> Problems:
        """Problems of ``model.tables`` on their own (names, widths, dynamic settings)."""
        p = Problems()
        for t, table in enumerate(self.tables):
            p += table.problems(f"model.tables[{t}]", self.embedding_dim)
        names = [t.name for t in self.tables]
        p.need(len(set(names)) == len(names), f"model.tables: table names {names} repeat; give each table its own name")
        features = [t.feature() for t in self.tables]
        p.need(
            len(set(features)) == len(features),
            f"model.tables: features {features} repeat; each table looks up a feature of its own",
        )
        p.need(
            not self.dynamic_tables() or self.cache_rows == 0,
            "model.cache_rows: the trainers' row cache names rows by their place in a server's storage, which "
            "dynamic tables decide on the server; set model.cache_rows=0 or make every table kind: fixed",
        )
        return p

    def pooling_list(self, num_tables: int) -> list[str]:
        """Every table's pooling (``model.pooling`` spread over ``num_tables`` tables)."""
        if not self.pooling:
            return ["sum"] * num_tables
        return [self.pooling[0]] * num_tables if len(self.pooling) == 1 else list(self.pooling)

    def feature_list(self, num_tables: int) -> list[str]:
        """Every table's feature name (``model.feature_names``, or ``f0``, ``f1``, ...)."""
        return list(self.feature_names) if self.feature_names else [f"f{t}" for t in range(num_tables)]

    def table_problems(self, num_tables: int, id_weights: bool) -> Problems:
        """Problems of these settings with the data's ``num_tables`` tables."""
        p = Problems()
        p.need(
            not self.feature_names
            or (len(self.feature_names) == num_tables and len(set(self.feature_names)) == num_tables),
            f"model.feature_names: {self.feature_names} must name each of the {num_tables} tables' feature once "
            "(or [] for f0, f1, ...)",
        )
        p.need(
            len(self.pooling) in (0, 1, num_tables),
            f"model.pooling: {self.pooling} lists {len(self.pooling)} values for {num_tables} tables; give [] "
            "(sum everywhere), one for every table, or one per table",
        )
        p.need(
            not id_weights or "mean" not in self.pooling,
            "model.pooling: mean pooling takes no per-id weights (as nn.EmbeddingBag); use sum pooling or "
            "data.id_weights=false",
        )
        return p

    def needs_ctr_data(self) -> bool:
        return True

    def uses_every_server(self) -> bool:
        return True

    def problems(self) -> Problems:
        p = super().problems()
        p += self.declared_problems()
        p.need(self.embedding_dim >= 1, f"model.embedding_dim: {self.embedding_dim} must be >= 1")
        p.need(all(h > 0 for h in self.bottom_mlp), f"model.bottom_mlp: {self.bottom_mlp} must all be > 0")
        p.need(all(h > 0 for h in self.top_mlp), f"model.top_mlp: {self.top_mlp} must all be > 0")
        p += self.interaction_problems()
        p.need(
            self.table_sharding in TABLE_SHARDINGS,
            f"model.table_sharding: unknown {self.table_sharding!r}; choose one of {list(TABLE_SHARDINGS)}",
        )
        p.need(
            self.table_optim in TABLE_OPTIMIZER_NAMES,
            f"model.table_optim: unknown {self.table_optim!r}; choose one of {list(TABLE_OPTIMIZER_NAMES)} "
            "(optimizers that update only the rows a batch touched)",
        )
        p.need(
            all(x in POOLINGS for x in self.pooling),
            f"model.pooling: {self.pooling}: each must be one of {list(POOLINGS)}",
        )
        p.need(
            self.table_lr is None or self.table_lr > 0,
            f"model.table_lr: {self.table_lr} must be > 0 (or null for optim.lr)",
        )
        p.need(self.cache_rows >= 0, f"model.cache_rows: {self.cache_rows} must be >= 0 (0: no row cache)")
        p.need(
            self.cache_staleness >= 1,
            f"model.cache_staleness: {self.cache_staleness} must be >= 1 (steps a cached row serves)",
        )
        p.need(
            self.table_dtype in TABLE_DTYPES,
            f"model.table_dtype: unknown {self.table_dtype!r}; choose one of {list(TABLE_DTYPES)}",
        )
        if self.table_memory_budget is not None:
            try:
                p.need(
                    parse_size(self.table_memory_budget) > 0,
                    f"model.table_memory_budget: {self.table_memory_budget!r} must be > 0 (or null: no disk tier)",
                )
            except ValueError as e:
                p.need(False, f"model.table_memory_budget: {e}")
        p.need(
            not self.tiered() or self.table_optim in LAZY_TABLE_OPTIMIZERS,
            f"model.table_optim={self.table_optim}: lazy, tiered or half-precision rows "
            f"(model.lazy_rows, model.table_memory_budget, model.table_dtype) take one of "
            f"{list(LAZY_TABLE_OPTIMIZERS)}",
        )
        p.need(
            not self.tiered() or self.cache_rows == 0,
            "model.cache_rows: the trainers' row cache keeps a score per row of every table, which lazy and "
            "tiered tables do not pay for; set model.cache_rows=0 with them",
        )
        return p

    def interaction_problems(self) -> Problems:
        """Problems of ``interaction`` and the cross layers' settings."""
        p = Problems()
        if self.interaction not in INTERACTIONS:
            p.append(f"model.interaction: unknown {self.interaction!r}; choose one of {list(INTERACTIONS)}")
        elif self.interaction == "dcn":
            p.need(self.dcn_layers >= 1, f"model.dcn_layers: {self.dcn_layers} must be >= 1 (cross layers)")
            p.need(self.dcn_rank >= 1, f"model.dcn_rank: {self.dcn_rank} must be >= 1 (each cross layer's rank)")
        else:
            for key, default in DCN_DEFAULTS.items():
                p.need(
                    getattr(self, key) == default,
                    f"model.{key}: only model.interaction=dcn takes it; drop it or set model.interaction=dcn",
                )
        return p

    def input_problems(self, shape: tuple[int, ...], data_name: str) -> Problems:
        p = Problems()
        p.need(
            len(shape) == 1 and shape[0] >= 1,
            f"model=dlrm needs at least one dense feature; data {data_name!r} has {list(shape)}",
        )
        return p


TABLE_DTYPES = ("float32", "float16", "bfloat16")
# The table optimizers whose per-row state can move between RAM and disk with its row.
LAZY_TABLE_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20}
_SIZE_UNITS.update({"GIB": 2**30, "TIB": 2**40, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12})


def parse_size(text: str | int) -> int:
    """Bytes of a size like ``2GB``, ``1.5GiB``, ``512MB`` or ``1073741824`` (decimal units
    are powers of 10, ``KiB``/``MiB``/``GiB`` of 2)."""
    raw = str(text).strip().replace("_", "")
    num = raw.rstrip("BbKkMmGgTtIi ")
    unit = raw[len(num) :].strip().upper()
    if unit not in _SIZE_UNITS:
        raise ValueError(f"{text!r} is not a size: write bytes or a number with KB, MB, GB, TB, KiB, MiB or GiB")
    try:
        value = float(num)
    except ValueError:
        raise ValueError(
            f"{text!r} is not a size: write bytes or a number with KB, MB, GB, TB, KiB, MiB or GiB"
        ) from None
    return int(value * _SIZE_UNITS[unit])


MODEL_SCHEMAS: dict[str, type[ModelConfig]] = {
    "mlp": MLPConfig,
    "cnn": CNNConfig,
    "resnet18": ResNetConfig,
    "dlrm": DLRMConfig,
}
MODEL_NAMES = tuple(MODEL_SCHEMAS)
