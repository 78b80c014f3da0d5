"""Sparse features as TorchRec users hold them: a keyed jagged tensor.

TorchRec's ``KeyedJaggedTensor`` (KJT) carries a batch's sparse features as one jagged
tensor keyed by feature name: ``keys`` [F], ``values`` [N], ``lengths`` [F * B] (key-major:
feature 0's B bags, then feature 1's, ...) or the equivalent ``offsets`` [F * B + 1], and
optional per-id ``weights`` [N]. ``KeyedJagged`` is ps_train's small type with the same
fields; ``keyed_jagged`` also takes TorchRec's own object when torchrec is installed (an
optional extra: README), reading its fields as they are.

A model names its tables' features (``model.feature_names``, one per table, as TorchRec's
``EmbeddingBagConfig.feature_names``); ``KeyedJagged.to_bags`` puts a batch's features in
that order, whatever the order of its keys, as the ``Bags`` the rest of ps_train uses (the
same table-major layout, so for keys already in order the tensors are the KJT's own).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ps_train.workloads.ctr.data.bags import Bags, as_bags, jagged_positions

__all__ = ["KeyedJagged", "keyed_jagged", "is_keyed_jagged", "to_bags", "torchrec_kjt_type"]


@dataclass(frozen=True, eq=False)  # == on tensors is elementwise, not a bool
class KeyedJagged:
    """A batch's sparse features: ``keys`` (feature names), ``values`` int64 [N],
    ``lengths`` int64 [F * B] (key-major), ``weights`` float32 [N] or None. Build it from
    lengths or from offsets (``from_offsets``)."""

    keys: tuple[str, ...]
    values: Tensor
    lengths: Tensor
    weights: Tensor | None = None

    def __post_init__(self) -> None:
        F = len(self.keys)
        if F == 0 or len(set(self.keys)) != F:
            raise ValueError(f"KeyedJagged.keys: need distinct feature names, got {list(self.keys)}")
        if self.values.dim() != 1 or self.values.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"KeyedJagged.values: need int64 [N], got {self.values.dtype} {tuple(self.values.shape)}")
        if self.lengths.dim() != 1 or len(self.lengths) % F or bool((self.lengths < 0).any()):
            raise ValueError(
                f"KeyedJagged.lengths: need [{F} keys x batch] nonnegative lengths, got {tuple(self.lengths.shape)}"
            )
        if int(self.lengths.sum()) != len(self.values):
            raise ValueError(
                f"KeyedJagged: lengths add up to {int(self.lengths.sum())} ids, values hold {len(self.values)}"
            )
        if self.weights is not None and self.weights.shape != self.values.shape:
            raise ValueError(f"KeyedJagged.weights: need [{len(self.values)}], got {tuple(self.weights.shape)}")

    @staticmethod
    def from_offsets(
        keys: Sequence[str], values: Tensor, offsets: Tensor, weights: Tensor | None = None
    ) -> KeyedJagged:
        """From ``offsets`` int64 [F * B + 1] (nondecreasing, from 0 to N) instead of lengths."""
        if offsets.dim() != 1 or len(offsets) < 1 or int(offsets[0]) != 0 or bool((offsets[1:] < offsets[:-1]).any()):
            raise ValueError("KeyedJagged offsets: need a nondecreasing int64 [F * B + 1] starting at 0")
        return KeyedJagged(tuple(keys), values, torch.diff(offsets), weights)

    @property
    def batch_size(self) -> int:
        return len(self.lengths) // len(self.keys)

    def offsets(self) -> Tensor:
        """int64 [F * B + 1]: where each bag starts in ``values``."""
        out = torch.zeros(len(self.lengths) + 1, dtype=torch.int64)
        torch.cumsum(self.lengths.to(torch.int64), 0, out=out[1:])
        return out

    def to_bags(self, feature_names: Sequence[str]) -> Bags:
        """The features in ``feature_names``' order (one per table) as ``Bags``."""
        missing = [f for f in feature_names if f not in self.keys]
        extra = [k for k in self.keys if k not in feature_names]
        if missing or extra:
            raise ValueError(
                f"a KeyedJagged batch with keys {list(self.keys)} for tables of features {list(feature_names)}: "
                f"missing {missing}, not a table's {extra}; name every table's feature once (model.feature_names)"
            )
        B = self.batch_size
        values, weights = self.values.to(torch.int64), self.weights
        if weights is not None:
            weights = weights.to(torch.float32)
        offsets = self.offsets()
        src = [self.keys.index(f) for f in feature_names]
        if src != list(range(len(src))):  # reorder the key blocks with one gather
            bags = (torch.tensor(src).unsqueeze(1) * B + torch.arange(B).unsqueeze(0)).reshape(-1)  # [T * B]
            lengths = self.lengths.to(torch.int64)[bags]
            where = jagged_positions(offsets[bags], lengths)
            values = values[where]
            weights = weights[where] if weights is not None else None
            offsets = torch.zeros(len(bags) + 1, dtype=torch.int64)
            torch.cumsum(lengths, 0, out=offsets[1:])
        return Bags(values, offsets, weights, len(feature_names))

    @staticmethod
    def from_bags(bags: Bags, feature_names: Sequence[str]) -> KeyedJagged:
        """``bags`` keyed by ``feature_names`` (one per table)."""
        if len(feature_names) != bags.num_tables:
            raise ValueError(f"{len(feature_names)} feature names for {bags.num_tables} tables")
        return KeyedJagged(tuple(feature_names), bags.values, bags.lengths(), bags.weights)


def torchrec_kjt_type() -> type | None:
    """TorchRec's ``KeyedJaggedTensor`` class if torchrec imports, else None."""
    try:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    except ImportError:
        return None
    return KeyedJaggedTensor  # type: ignore[no-any-return,unused-ignore]


def is_keyed_jagged(x: Any) -> bool:
    """Whether ``x`` is a ``KeyedJagged`` or TorchRec's ``KeyedJaggedTensor``."""
    if isinstance(x, KeyedJagged):
        return True
    kjt = torchrec_kjt_type() if type(x).__name__ == "KeyedJaggedTensor" else None
    return kjt is not None and isinstance(x, kjt)


def keyed_jagged(x: Any) -> KeyedJagged:
    """``x`` (a ``KeyedJagged`` or TorchRec's ``KeyedJaggedTensor``) as a ``KeyedJagged``:
    TorchRec's fields are read as they are (``keys()``, ``values()``, ``lengths()``,
    ``weights_or_none()``)."""
    if isinstance(x, KeyedJagged):
        return x
    if not is_keyed_jagged(x):
        raise TypeError(f"need a KeyedJagged or torchrec's KeyedJaggedTensor, got {type(x).__name__}")
    if getattr(x, "variable_stride_per_key", lambda: False)():
        raise ValueError("a KeyedJaggedTensor with a batch size per key is not supported: give every key B bags")
    return KeyedJagged(tuple(x.keys()), x.values(), x.lengths(), x.weights_or_none())


def to_bags(ids: Any, feature_names: Sequence[str]) -> Bags:
    """A batch's sparse features as ``Bags`` in table order: one-hot ids [B, T], ``Bags``,
    or a ``KeyedJagged`` / TorchRec ``KeyedJaggedTensor`` keyed by ``feature_names``."""
    if isinstance(ids, Tensor | Bags):
        return as_bags(ids)
    return keyed_jagged(ids).to_bags(feature_names)
