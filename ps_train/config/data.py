"""The ``data`` group: one schema per kind of dataset, each knowing its sample shape and
number of classes without loading anything (what validation and model building need)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from omegaconf import MISSING

from ps_train.config.base import Problems

__all__ = [
    "DataConfig",
    "DigitsConfig",
    "VisionDataConfig",
    "SyntheticConfig",
    "CtrDataConfig",
    "SyntheticCtrConfig",
    "CriteoConfig",
    "DATA_SCHEMAS",
    "DATA_NAMES",
    "VISION_SHAPES",
    "VISION_TRAIN_SIZES",
    "CRITEO_TABLES",
    "CRITEO_DENSE",
    "BAG_SIZE_DISTS",
]

CRITEO_TABLES, CRITEO_DENSE = 26, 13  # Criteo's categorical and integer features
BAG_SIZE_DISTS = ("fixed", "uniform")  # synthetic_ctr's bag lengths (ps_train.workloads.ctr.data.synthetic_bags)

# Sample shape [C, H, W] of each dataset torchvision reads; ps_train.data checks the files
# it loads against it.
VISION_SHAPES: dict[str, tuple[int, ...]] = {
    "mnist": (1, 28, 28),
    "fashion_mnist": (1, 28, 28),
    "cifar10": (3, 32, 32),
}
VISION_TRAIN_SIZES: dict[str, int] = {"mnist": 60000, "fashion_mnist": 60000, "cifar10": 50000}
DIGITS_SAMPLES = 1797  # scikit-learn's load_digits


@dataclass
class DataConfig:
    """Base schema of the ``data`` group; ``name`` selects the dataset."""

    name: str = MISSING  # the dataset: choose it with data=<name> (not data.name=)

    def sample_shape(self) -> tuple[int, ...]:
        """Shape of one sample (no batch dim)."""
        raise ValueError(
            f"data.name: unknown dataset {self.name!r}; use digits, mnist, fashion_mnist, cifar10 or synthetic"
        )

    def class_count(self) -> int:
        """Number of classes (the model's output width)."""
        return 10

    def train_samples(self) -> int | None:
        """Samples in the training split, if the config alone says (None: only the files know)."""
        return None

    def is_ctr(self) -> bool:
        """Click-through-rate data (dense features, one id per table, 0/1 labels)."""
        return False

    def matches_schema(self) -> bool:
        """``name`` is a known dataset and this object is that dataset's schema."""
        return self.name in DATA_SCHEMAS and isinstance(self, DATA_SCHEMAS[self.name])

    def problems(self) -> Problems:
        """This group's own problems (see ``Config.problems`` for those across groups)."""
        p = Problems()
        if self.name not in DATA_SCHEMAS:
            p.append(f"data.name: unknown dataset {self.name!r}; choose one of {list(DATA_NAMES)} (e.g. data=mnist)")
        elif not self.matches_schema():
            p.append(
                f"data.name: {self.name!r} does not match the selected data group "
                f"({type(self).__name__}); select the dataset with data={self.name}, not data.name="
            )
        return p


@dataclass
class DigitsConfig(DataConfig):
    name: str = "digits"
    test_fraction: float = 0.2  # share of the 1,797 images held out for the test accuracy
    # Fixes the train/test split (not the training order, which follows the top-level seed),
    # so test accuracy is comparable across runs with different seeds.
    split_seed: int = 0

    def sample_shape(self) -> tuple[int, ...]:
        return (1, 8, 8)  # scikit-learn's 8x8 grey images

    def train_samples(self) -> int:
        # scikit-learn's train_test_split: the test split takes ceil(n * fraction) of the n samples.
        return DIGITS_SAMPLES - math.ceil(self.test_fraction * DIGITS_SAMPLES)

    def problems(self) -> Problems:
        p = super().problems()
        p.need(0.0 < self.test_fraction < 1.0, f"data.test_fraction: {self.test_fraction} must be in (0, 1)")
        return p


@dataclass
class VisionDataConfig(DataConfig):
    """mnist / fashion_mnist / cifar10, read by torchvision from ``root``."""

    root: str = "data"  # folder torchvision reads the dataset's files from
    download: bool = False  # true: torchvision downloads the files into root if they are missing

    def sample_shape(self) -> tuple[int, ...]:
        if self.name in VISION_SHAPES:
            return VISION_SHAPES[self.name]
        return super().sample_shape()

    def train_samples(self) -> int | None:
        return VISION_TRAIN_SIZES.get(self.name)


@dataclass
class SyntheticConfig(DataConfig):
    name: str = "synthetic"
    shape: list[int] = field(default_factory=lambda: [1, 28, 28])  # per sample: C,H,W or D
    num_classes: int = 10  # classes, one prototype each (the model's output width)
    train_size: int = 4096  # training samples, over all trainers
    test_size: int = 1024  # held-out samples
    noise: float = 1.0  # std of the noise around each class prototype
    data_seed: int = 0  # fixes the samples (not the training order, which follows seed)

    def sample_shape(self) -> tuple[int, ...]:
        return tuple(self.shape)

    def class_count(self) -> int:
        return self.num_classes

    def train_samples(self) -> int:
        return self.train_size

    def problems(self) -> Problems:
        p = super().problems()
        p.need(
            len(self.shape) in (1, 3) and all(s > 0 for s in self.shape),
            f"data.shape: {self.shape} must be [C, H, W] or [D] with positive sizes",
        )
        p.need(self.num_classes >= 2, f"data.num_classes: {self.num_classes} must be >= 2")
        p.need(
            self.train_size > 0 and self.test_size > 0,
            f"data.train_size/test_size: {self.train_size}/{self.test_size} must be > 0",
        )
        p.need(self.noise >= 0, f"data.noise: {self.noise} must be >= 0")
        return p


@dataclass
class CtrDataConfig(DataConfig):
    """Click-through-rate data for model=dlrm. The tables: ``table_sizes`` (rows per table)
    if given, else ``num_tables`` tables of ``table_rows`` rows each."""

    num_tables: int = 8  # embedding tables, one per categorical feature
    table_rows: int = 1000  # rows of every table, unless table_sizes lists them
    table_sizes: list[int] = field(default_factory=list)  # rows of each table, one by one; []: table_rows each
    test_fraction: float = 0.1  # the last samples (in time order) are the held-out split

    def is_ctr(self) -> bool:
        return True

    def sizes(self) -> list[int]:
        """Rows of each embedding table."""
        return list(self.table_sizes) if self.table_sizes else [self.table_rows] * self.num_tables

    def dense_count(self) -> int:
        raise NotImplementedError

    def has_id_weights(self) -> bool:
        """Whether samples carry a weight per id (multi-hot synthetic data only)."""
        return False

    def max_bag_sizes(self) -> list[int]:
        """The most ids a sample's bag holds, per table (1: one-hot)."""
        return [1] * len(self.sizes())

    def sample_shape(self) -> tuple[int, ...]:
        return (self.dense_count(),)

    def class_count(self) -> int:
        return 2

    def problems(self) -> Problems:
        p = super().problems()
        p.need(self.num_tables >= 1, f"data.num_tables: {self.num_tables} must be >= 1")
        p.need(self.table_rows >= 2, f"data.table_rows: {self.table_rows} must be >= 2")
        p.need(all(s >= 2 for s in self.table_sizes), f"data.table_sizes: {self.table_sizes} must all be >= 2")
        p.need(0.0 < self.test_fraction < 1.0, f"data.test_fraction: {self.test_fraction} must be in (0, 1)")
        return p


@dataclass
class SyntheticCtrConfig(CtrDataConfig):
    """Seeded CTR data with a known best AUC (``ps_train.workloads.ctr.data.synthetic``); offline."""

    name: str = "synthetic_ctr"
    num_samples: int = 500000  # train + test
    num_dense: int = 13  # dense (float) features per sample, the bottom MLP's input
    zipf_alpha: float = 1.05  # id popularity ~ rank ** -alpha; 0 = uniform
    zipf_alphas: list[float] = field(default_factory=list)  # one skew per table; []: zipf_alpha for every table
    positive_rate: float = 0.25  # share of samples labelled 1 (clicks)
    signal_std: float = 1.4  # std of the hidden model's logit: higher = easier (best AUC up)
    interaction: float = 0.0  # share of the logit's variance from pairwise table interactions
    data_seed: int = 0  # fixes the samples and the hidden model (not the training order)
    # Multi-hot bags: ids per bag, [] (one id per table), one size for every table, or one per table.
    bag_sizes: list[int] = field(default_factory=list)
    bag_size_dist: str = "fixed"  # fixed: exactly bag_sizes[t] ids | uniform: 1..bag_sizes[t]
    id_weights: bool = False  # a weight in (0, 1] per id (pooled as nn.EmbeddingBag's per_sample_weights)
    # Ids drawn per table, then hashed (id mod rows) into a fixed table's rows, as click logs'
    # ids into a fixed table; 0: as many as the table's rows (no two ids share a row).
    drawn_ids: int = 0

    def dense_count(self) -> int:
        return self.num_dense

    def has_id_weights(self) -> bool:
        return self.id_weights

    def max_bag_sizes(self) -> list[int]:
        return self.bag_size_list()

    def bag_size_list(self) -> list[int]:
        """Ids per bag of every table (the most, for ``uniform``): one per table."""
        n = len(self.sizes())
        return (
            [1] * n
            if not self.bag_sizes
            else [self.bag_sizes[0]] * n
            if len(self.bag_sizes) == 1
            else list(self.bag_sizes)
        )

    def zipf_alpha_list(self) -> list[float]:
        """Every table's id skew: ``zipf_alphas``, or ``zipf_alpha`` for every table."""
        return list(self.zipf_alphas) if self.zipf_alphas else [self.zipf_alpha] * len(self.sizes())

    def train_samples(self) -> int:
        # What ps_train.workloads.ctr.data.split.time_split keeps: the last round(n * test_fraction)
        # samples are the test split.
        return self.num_samples - int(round(self.num_samples * self.test_fraction))

    def problems(self) -> Problems:
        p = super().problems()
        p.need(self.num_samples >= 4, f"data.num_samples: {self.num_samples} must be >= 4")
        p.need(self.num_dense >= 1, f"data.num_dense: {self.num_dense} must be >= 1 (model=dlrm's bottom MLP)")
        p.need(self.zipf_alpha >= 0, f"data.zipf_alpha: {self.zipf_alpha} must be >= 0")
        p.need(
            len(self.zipf_alphas) in (0, len(self.sizes())),
            f"data.zipf_alphas: {self.zipf_alphas} lists {len(self.zipf_alphas)} skews for {len(self.sizes())} "
            "tables; give one per table, or [] (data.zipf_alpha for every table)",
        )
        p.need(
            all(a >= 0 and math.isfinite(a) for a in self.zipf_alphas),
            f"data.zipf_alphas: {self.zipf_alphas} must all be finite and >= 0 (0: uniform ids)",
        )
        p.need(
            self.drawn_ids == 0 or self.drawn_ids >= 2,
            f"data.drawn_ids: {self.drawn_ids} must be >= 2 (or 0: ids as the tables' rows)",
        )
        p.need(0.0 < self.positive_rate < 1.0, f"data.positive_rate: {self.positive_rate} must be in (0, 1)")
        p.need(self.signal_std > 0, f"data.signal_std: {self.signal_std} must be > 0")
        p.need(0.0 <= self.interaction < 1.0, f"data.interaction: {self.interaction} must be in [0, 1)")
        p.need(
            self.interaction == 0 or len(self.sizes()) >= 2,
            "data.interaction: pairwise interactions need at least 2 tables",
        )
        p.need(
            len(self.bag_sizes) in (0, 1, len(self.sizes())),
            f"data.bag_sizes: {self.bag_sizes} lists {len(self.bag_sizes)} sizes for {len(self.sizes())} tables; "
            "give [] (one id per table), one size for every table, or one per table",
        )
        p.need(all(b >= 1 for b in self.bag_sizes), f"data.bag_sizes: {self.bag_sizes} must all be >= 1")
        p.need(
            self.bag_size_dist in BAG_SIZE_DISTS,
            f"data.bag_size_dist: unknown {self.bag_size_dist!r}; choose one of {list(BAG_SIZE_DISTS)}",
        )
        return p


@dataclass
class CriteoConfig(CtrDataConfig):
    """Criteo TSV day files (``day_0`` .. or ``train.txt``, plain or .gz) from ``root``, or,
    when ``prepared`` is set, the folder ``python -m ps_train.prepare criteo`` made of them
    (memory-mapped; ``root`` is then not read)."""

    name: str = "criteo"
    root: str = "data/criteo"  # folder of the TSV day files (day_0 ..) or train.txt, plain or .gz
    prepared: str | None = None  # a prepared folder (its format: ps_train.workloads.ctr.data.prepared)
    num_tables: int = CRITEO_TABLES
    table_rows: int = 100000  # ids are hashed into this many rows per table
    skip_malformed: bool = False  # true: count and skip malformed lines with a warning

    def dense_count(self) -> int:
        return CRITEO_DENSE

    def problems(self) -> Problems:
        p = super().problems()
        p.need(
            len(self.sizes()) == CRITEO_TABLES,
            f"data.num_tables/table_sizes: Criteo has {CRITEO_TABLES} categorical features, got "
            f"{len(self.sizes())} tables; leave data.num_tables={CRITEO_TABLES} or give {CRITEO_TABLES} table_sizes",
        )
        p.need(
            self.prepared is None or self.prepared.strip() != "",
            "data.prepared: empty; give the folder python -m ps_train.prepare criteo wrote, or leave it null "
            "to read the TSV files in data.root",
        )
        return p


DATA_SCHEMAS: dict[str, type[DataConfig]] = {
    "digits": DigitsConfig,
    "mnist": VisionDataConfig,
    "fashion_mnist": VisionDataConfig,
    "cifar10": VisionDataConfig,
    "synthetic": SyntheticConfig,
    "synthetic_ctr": SyntheticCtrConfig,
    "criteo": CriteoConfig,
}
DATA_NAMES = tuple(DATA_SCHEMAS)
