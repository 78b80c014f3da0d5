"""Datasets, per-trainer partitions and a resumable batch iterator.

Every dataset is held in memory as tensors (``TensorSplit``): images stay in their stored
dtype (uint8 for MNIST/CIFAR, 4x smaller than float) and are normalised per batch. A
trainer sees a disjoint slice of a per-epoch seeded permutation (``partition``), so all
trainers together cover the training set once per epoch, and ``BatchIterator`` records its
position as ``(epoch, offset)`` so a resumed run continues with exactly the next batch.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset, default_collate

from ps_train.config import DataConfig, DigitsConfig, SyntheticConfig, VisionDataConfig
from ps_train.partition import PartitionCursor, partition, steps_per_epoch

__all__ = [
    "TensorSplit",
    "DatasetNotFoundError",
    "load_data",
    "prepare_data",
    "check_vision_files",
    "BatchIterator",
    "iter_eval_batches",
]

# name -> (torchvision class name, per-channel mean, std) of the 0..1 pixels; the sample
# shapes are the config's (VisionDataConfig.sample_shape).
_VISION: dict[str, tuple[str, tuple[float, ...], tuple[float, ...]]] = {
    "mnist": ("MNIST", (0.1307,), (0.3081,)),
    "fashion_mnist": ("FashionMNIST", (0.2860,), (0.3530,)),
    "cifar10": ("CIFAR10", (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
}


class DatasetNotFoundError(FileNotFoundError):
    """Dataset files are missing (or corrupt) under ``data.root``; the message says how to get them."""


class TensorSplit(Dataset[tuple[Tensor, Tensor]]):
    """One split (train or test) as in-memory tensors.

    ``images``: ``[N, *in_shape]`` of any dtype; ``labels``: int64 ``[N]``. Indexing with an
    int, slice or index tensor returns ``(x, y)`` with x float32 ``(images / scale - mean) / std``
    (mean/std per channel for ``[C, H, W]`` samples).
    """

    def __init__(
        self,
        images: Tensor,
        labels: Tensor,
        n_classes: int,
        scale: float = 1.0,
        mean: Sequence[float] = (0.0,),
        std: Sequence[float] = (1.0,),
    ) -> None:
        if images.shape[0] != labels.shape[0]:
            raise ValueError(f"images ({images.shape[0]}) and labels ({labels.shape[0]}) differ in length")
        self.images = images
        self.labels = labels.long()
        self.num_classes = int(n_classes)
        self.scale = float(scale)
        # Shape [C, 1, 1] broadcasts over [B, C, H, W]; a scalar for other sample shapes.
        view = (-1, 1, 1) if images.dim() == 4 else (-1,)
        self._mean = (
            torch.tensor(mean, dtype=torch.float32).view(view) if len(mean) > 1 else torch.tensor(float(mean[0]))
        )
        self._std = torch.tensor(std, dtype=torch.float32).view(view) if len(std) > 1 else torch.tensor(float(std[0]))

    @property
    def in_shape(self) -> tuple[int, ...]:
        return tuple(self.images.shape[1:])

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, index: int | slice | Tensor) -> tuple[Tensor, Tensor]:
        x = self.images[index].to(torch.float32)
        if self.scale != 1.0:
            x = x / self.scale
        return (x - self._mean) / self._std, self.labels[index]


# Splits drawn before the roles were forked (``prepare_data``), by ``repr`` of their config:
# every trainer of a run finds the same tensors in its copy instead of drawing them again.
_PREPARED: dict[str, tuple[TensorSplit, TensorSplit]] = {}


def prepare_data(cfg: DataConfig) -> None:
    """Draw ``cfg``'s splits now, for ``load_data`` to return later in this process and in
    the processes forked from it (the launcher's fork server calls it once, before forking
    the trainers): data that is computed (``data=synthetic``, ``data=digits``), not read
    from files. The tensors are the ones ``load_data`` would draw: same seed, same values."""
    if isinstance(cfg, (SyntheticConfig, DigitsConfig)):
        _PREPARED[repr(cfg)] = load_data(cfg)


def load_data(cfg: DataConfig) -> tuple[TensorSplit, TensorSplit]:
    """Load ``(train, test)`` for ``cfg`` (the splits ``prepare_data`` drew, if it did: no
    one writes into a split's tensors, so the processes forked after it share their pages)."""
    prepared = _PREPARED.get(repr(cfg))
    if prepared is not None:
        return prepared
    if isinstance(cfg, DigitsConfig):
        return _digits(cfg)
    if isinstance(cfg, SyntheticConfig):
        return _synthetic(cfg)
    if isinstance(cfg, VisionDataConfig) and cfg.name in _VISION:
        return _vision(cfg)
    raise ValueError(
        f"data.name: unknown dataset {cfg.name!r} for {type(cfg).__name__}; "
        "use data=digits, data=mnist, data=fashion_mnist, data=cifar10 or data=synthetic"
    )


def _digits(cfg: DigitsConfig) -> tuple[TensorSplit, TensorSplit]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()  # ships inside scikit-learn: data [1797, 64] in 0..16, target [1797]
    x = torch.tensor(bunch.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.int64)
    # Stratified so both splits keep the class balance; fixed by split_seed alone.
    train_idx, test_idx = train_test_split(
        torch.arange(len(y)).numpy(), test_size=cfg.test_fraction, random_state=cfg.split_seed, stratify=y.numpy()
    )
    train_idx, test_idx = torch.from_numpy(train_idx), torch.from_numpy(test_idx)
    # Standardise with train statistics only (no test leakage).
    mean, std = x[train_idx].mean().item(), x[train_idx].std().item()
    return (
        TensorSplit(x[train_idx], y[train_idx], 10, mean=(mean,), std=(std,)),
        TensorSplit(x[test_idx], y[test_idx], 10, mean=(mean,), std=(std,)),
    )


def _synthetic(cfg: SyntheticConfig) -> tuple[TensorSplit, TensorSplit]:
    # Class prototypes plus Gaussian noise: learnable, and sized freely for benchmarks.
    g = torch.Generator().manual_seed(cfg.data_seed)
    shape = cfg.sample_shape()
    prototypes = torch.randn((cfg.num_classes, *shape), generator=g)

    def draw(n: int) -> TensorSplit:
        y = torch.randint(cfg.num_classes, (n,), generator=g)
        x = prototypes[y] + cfg.noise * torch.randn((n, *shape), generator=g)
        return TensorSplit(x, y, cfg.num_classes)

    train = draw(cfg.train_size)
    return train, draw(cfg.test_size)


def _expected_files(cls: Any, root: str) -> tuple[str, list[str]]:
    """Where torchvision looks for ``cls``'s files under ``root``, and their names."""
    if hasattr(cls, "base_folder"):  # CIFAR: python pickle batches + meta
        names = [n for n, _ in cls.train_list + cls.test_list] + [cls.meta["filename"]]
        return os.path.join(root, cls.base_folder), names
    # MNIST family: unpacked idx files in <root>/<ClassName>/raw/
    names = [os.path.splitext(os.path.basename(url))[0] for url, _ in cls.resources]
    return os.path.join(root, cls.__name__, "raw"), names


def check_vision_files(cfg: VisionDataConfig) -> str:
    """The folder torchvision reads ``cfg``'s files from; raises ``DatasetNotFoundError`` if
    any is missing and ``data.download`` is off (a stat per file: the launcher checks this
    before any role starts)."""
    import torchvision.datasets as tvd

    if cfg.name not in _VISION:
        raise ValueError(f"data.name: {cfg.name!r} is not a torchvision dataset")
    cls_name = _VISION[cfg.name][0]
    folder, names = _expected_files(getattr(tvd, cls_name), os.path.abspath(os.path.expanduser(cfg.root)))
    missing = [n for n in names if not os.path.isfile(os.path.join(folder, n))]
    if missing and not cfg.download:
        raise DatasetNotFoundError(
            f"data={cfg.name}: dataset files not found in {folder} (data.root={cfg.root!r}); missing: "
            f"{', '.join(missing)}. Download them with data.download=true (needs internet), or copy the "
            f"{cls_name} files torchvision uses there, or point data.root at a folder that has them."
        )
    return folder


def _vision(cfg: VisionDataConfig) -> tuple[TensorSplit, TensorSplit]:
    import torchvision.datasets as tvd

    cls_name, mean, std = _VISION[cfg.name]
    shape = cfg.sample_shape()
    cls = getattr(tvd, cls_name)
    root = os.path.abspath(os.path.expanduser(cfg.root))
    folder = check_vision_files(cfg)
    splits = []
    for train in (True, False):
        try:
            ds = cls(root, train=train, download=cfg.download)
        except RuntimeError as e:  # torchvision: not found / md5 mismatch / download failure
            raise DatasetNotFoundError(
                f"data={cfg.name}: torchvision could not load the files in {folder}: {e}. If they are "
                "corrupt or incomplete, delete them and re-download with data.download=true."
            ) from e
        images = torch.as_tensor(ds.data)
        # MNIST stores [N, H, W]; CIFAR stores HWC numpy [N, H, W, C]; both become [N, C, H, W].
        images = images.unsqueeze(1) if images.dim() == 3 else images.permute(0, 3, 1, 2).contiguous()
        if tuple(images.shape[1:]) != shape:
            raise DatasetNotFoundError(
                f"data={cfg.name}: files in {folder} hold samples of shape {tuple(images.shape[1:])}, expected {shape}"
            )
        splits.append(TensorSplit(images, torch.as_tensor(ds.targets), 10, scale=255.0, mean=mean, std=std))
    return splits[0], splits[1]


class BatchIterator(PartitionCursor, Iterator[tuple[Tensor, Tensor]]):
    """Endless batches of trainer ``rank``'s partition, epoch after epoch (``PartitionCursor``)."""

    def __init__(self, dataset: Dataset[Any], rank: int, world: int, batch_size: int, seed: int) -> None:
        self.dataset, self.rank, self.world, self.seed = dataset, rank, world, seed
        self.batch_size = batch_size
        self.n_items = len(dataset)  # type: ignore[arg-type]
        self.steps_per_epoch = steps_per_epoch(self.n_items, world, batch_size)
        if batch_size < 1 or self.steps_per_epoch == 0:
            raise ValueError(
                f"train.batch_size={batch_size}: each of the {world} trainers gets only "
                f"{self.n_items // world} of {self.n_items} training samples, not a full batch; "
                "lower train.batch_size or cluster.num_trainers"
            )
        partition(self.n_items, rank, world, seed, 0)  # validates rank/world early
        self.rewind()

    def __next__(self) -> tuple[Tensor, Tensor]:
        idx = self.next_indices()
        if isinstance(self.dataset, TensorSplit):
            return self.dataset[idx]
        return default_collate([self.dataset[int(i)] for i in idx])


def iter_eval_batches(dataset: TensorSplit, batch_size: int) -> Iterator[tuple[Tensor, Tensor]]:
    """All samples in order, in batches (the last may be short): for evaluation."""
    for start in range(0, len(dataset), batch_size):
        yield dataset[start : start + batch_size]
