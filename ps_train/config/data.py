"""The ``data`` group: one schema per kind of dataset, each knowing its sample shape and
number of classes without loading anything (what validation and model building need)."""
from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from ps_train.config.base import Problems

__all__ = [
    "DataConfig", "DigitsConfig", "VisionDataConfig", "SyntheticConfig", "DATA_SCHEMAS", "DATA_NAMES",
    "VISION_SHAPES",
]

# Sample shape [C, H, W] of each dataset torchvision reads; ps_train.data checks the files
# it loads against it.
VISION_SHAPES: dict[str, tuple[int, ...]] = {
    "mnist": (1, 28, 28), "fashion_mnist": (1, 28, 28), "cifar10": (3, 32, 32),
}


@dataclass
class DataConfig:
    """Base schema of the ``data`` group; ``name`` selects the dataset."""

    name: str = MISSING

    def sample_shape(self) -> tuple[int, ...]:
        """Shape of one sample (no batch dim)."""
        raise ValueError(f"data.name: unknown dataset {self.name!r}; use digits, mnist, fashion_mnist, cifar10 or "
                         "synthetic")

    def class_count(self) -> int:
        """Number of classes (the model's output width)."""
        return 10

    def matches_schema(self) -> bool:
        """``name`` is a known dataset and this object is that dataset's schema."""
        return self.name in DATA_SCHEMAS and isinstance(self, DATA_SCHEMAS[self.name])

    def problems(self) -> Problems:
        """This group's own problems (see ``Config.problems`` for those across groups)."""
        p = Problems()
        if self.name not in DATA_SCHEMAS:
            p.append(f"data.name: unknown dataset {self.name!r}; choose one of {list(DATA_NAMES)} (e.g. data=mnist)")
        elif not self.matches_schema():
            p.append(f"data.name: {self.name!r} does not match the selected data group "
                     f"({type(self).__name__}); select the dataset with data={self.name}, not data.name=")
        return p


@dataclass
class DigitsConfig(DataConfig):
    name: str = "digits"
    test_fraction: float = 0.2
    # Fixes the train/test split (not the training order, which follows the top-level seed),
    # so test accuracy is comparable across runs with different seeds.
    split_seed: int = 0

    def sample_shape(self) -> tuple[int, ...]:
        return (1, 8, 8)  # scikit-learn's 8x8 grey images

    def problems(self) -> Problems:
        p = super().problems()
        p.need(0.0 < self.test_fraction < 1.0, f"data.test_fraction: {self.test_fraction} must be in (0, 1)")
        return p


@dataclass
class VisionDataConfig(DataConfig):
    """mnist / fashion_mnist / cifar10, read by torchvision from ``root``."""

    root: str = "data"
    download: bool = False

    def sample_shape(self) -> tuple[int, ...]:
        if self.name in VISION_SHAPES:
            return VISION_SHAPES[self.name]
        return super().sample_shape()


@dataclass
class SyntheticConfig(DataConfig):
    name: str = "synthetic"
    shape: list[int] = field(default_factory=lambda: [1, 28, 28])  # per sample: C,H,W or D
    num_classes: int = 10
    train_size: int = 4096
    test_size: int = 1024
    noise: float = 1.0  # std of the noise around each class prototype
    data_seed: int = 0

    def sample_shape(self) -> tuple[int, ...]:
        return tuple(self.shape)

    def class_count(self) -> int:
        return self.num_classes

    def problems(self) -> Problems:
        p = super().problems()
        p.need(len(self.shape) in (1, 3) and all(s > 0 for s in self.shape),
               f"data.shape: {self.shape} must be [C, H, W] or [D] with positive sizes")
        p.need(self.num_classes >= 2, f"data.num_classes: {self.num_classes} must be >= 2")
        p.need(self.train_size > 0 and self.test_size > 0,
               f"data.train_size/test_size: {self.train_size}/{self.test_size} must be > 0")
        p.need(self.noise >= 0, f"data.noise: {self.noise} must be >= 0")
        return p


DATA_SCHEMAS: dict[str, type[DataConfig]] = {
    "digits": DigitsConfig, "mnist": VisionDataConfig, "fashion_mnist": VisionDataConfig,
    "cifar10": VisionDataConfig, "synthetic": SyntheticConfig,
}
DATA_NAMES = tuple(DATA_SCHEMAS)
