"""Click-through-rate metrics: ROC AUC and log loss on a held-out split.

Both take whole-split arrays (torch tensors, NumPy arrays or sequences) of shape ``[N]``;
evaluation concatenates the per-batch outputs first. AUC is exact (no histogram
binning), so a run's AUC can be compared with the synthetic data's ``best_auc`` to the
third decimal.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["auc", "log_loss", "ctr_metrics", "format_ctr_metrics"]

ArrayLike = torch.Tensor | np.ndarray | Sequence[float]


def _vector(x: ArrayLike, what: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float64).numpy()
    a = np.asarray(x, dtype=np.float64)
    if a.ndim == 2 and a.shape[1] == 1:  # a model's [N, 1] output
        a = a[:, 0]
    if a.ndim != 1:
        raise ValueError(f"{what}: need a 1-D array [N] (or [N, 1]), got shape {a.shape}")
    return a


def _check(scores: ArrayLike, labels: ArrayLike, fn: str, score_name: str) -> tuple[np.ndarray, np.ndarray]:
    s, y = _vector(scores, f"{fn}: {score_name}"), _vector(labels, f"{fn}: labels")
    if s.shape != y.shape:
        raise ValueError(f"{fn}: {score_name} ({s.shape[0]}) and labels ({y.shape[0]}) differ in length")
    if s.size == 0:
        raise ValueError(f"{fn}: empty input; it is undefined for zero samples (is the test split empty?)")
    if not np.isfinite(s).all():
        raise ValueError(f"{fn}: {score_name} contain NaN or inf (a diverged model?)")
    if not ((y == 0) | (y == 1)).all():
        raise ValueError(f"{fn}: labels must all be 0 or 1")
    return s, y


def auc(scores: ArrayLike, labels: ArrayLike) -> float:
    """Exact ROC AUC of ``scores [N]`` (any monotone score: logits or probabilities) against
    ``labels [N]`` in {0, 1}.

    Mann-Whitney form: AUC = (sum of the positives' ranks - P(P+1)/2) / (P * N_neg), with tied
    scores given their average rank, so a tie between a positive and a negative counts 1/2
    (the same value as ``sklearn.metrics.roc_auc_score``). One sort: O(N log N).

    Raises ``ValueError`` on empty input or if all labels are one class (AUC compares
    positives with negatives, so it is undefined then).
    """
    s, y = _check(scores, labels, "auc", "scores")
    n_pos = int(y.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError(
            f"auc: all {y.size} labels are {int(y[0])}; AUC is undefined without both "
            "positives and negatives (evaluate on a larger split)"
        )
    order = np.argsort(s, kind="stable")
    sorted_s = s[order]
    # Groups of equal scores: [start, end) in sorted order; each member gets the average of
    # the 1-based ranks start+1 .. end.
    boundaries = np.flatnonzero(np.diff(sorted_s)) + 1
    starts = np.concatenate(([0], boundaries))
    ends = np.concatenate((boundaries, [s.size]))
    avg_rank = (starts + ends + 1) / 2.0
    ranks = np.repeat(avg_rank, ends - starts)
    pos_rank_sum = float(ranks[y[order] == 1].sum())
    return (pos_rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


def log_loss(preds: ArrayLike, labels: ArrayLike, *, from_logits: bool = False, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy (natural log) of ``preds [N]`` against ``labels [N]`` in {0, 1}.

    ``preds`` are probabilities by default; they are clamped to ``[eps, 1 - eps]`` so a
    confidently wrong sample costs at most ``-log(eps)`` (16.1 for the default, which is about
    the resolution of a float32 sigmoid near 1) instead of infinity. With ``from_logits=True``
    ``preds`` are logits and the loss is computed stably as ``softplus(-z)`` / ``softplus(z)``
    without clamping.

    Single-class labels are allowed (unlike AUC, log loss is defined for them); empty input
    raises ``ValueError``, as do probabilities outside [0, 1] (likely logits).
    """
    p, y = _check(preds, labels, "log_loss", "logits" if from_logits else "probabilities")
    if from_logits:
        # -log sigmoid(z) = softplus(-z); -log(1 - sigmoid(z)) = softplus(z).
        z = np.where(y == 1, -p, p)
        return float(np.mean(np.logaddexp(0.0, z)))
    if p.min() < 0.0 or p.max() > 1.0:
        raise ValueError(
            f"log_loss: probabilities must be in [0, 1], got [{p.min():.4g}, {p.max():.4g}]; "
            "pass from_logits=True for raw model outputs"
        )
    if not 0.0 < eps < 0.5:
        raise ValueError(f"log_loss: eps={eps} must be in (0, 0.5)")
    p = np.clip(p, eps, 1.0 - eps)
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log1p(-p)))


def ctr_metrics(probs: ArrayLike, labels: ArrayLike, best_auc: float | None = None) -> dict[str, float]:
    """AUC and log loss of probabilities ``probs [N]`` on a held-out split, plus references.

    Keys: ``auc``, ``log_loss``, ``base_log_loss`` (log loss of always predicting the split's
    positive rate: a model must beat it to have learned anything), ``positive_rate``, and with
    ``best_auc`` (the synthetic data's ceiling) ``best_auc`` and ``auc_gap = best_auc - auc``.
    """
    y = _vector(labels, "ctr_metrics: labels")
    out = {"auc": auc(probs, y), "log_loss": log_loss(probs, y)}
    rate = float(y.mean())
    out["base_log_loss"] = -(rate * math.log(rate) + (1 - rate) * math.log1p(-rate))
    out["positive_rate"] = rate
    if best_auc is not None:
        out["best_auc"] = float(best_auc)
        out["auc_gap"] = float(best_auc) - out["auc"]
    return out


def format_ctr_metrics(m: dict[str, float]) -> str:
    """One log line, e.g. ``AUC 0.7812 (best achievable 0.8034) log loss 0.4721 (base 0.5623)``."""
    text = f"AUC {m['auc']:.4f}"
    if "best_auc" in m:
        text += f" (best achievable {m['best_auc']:.4f})"
    text += f" log loss {m['log_loss']:.4f}"
    if "base_log_loss" in m:
        text += f" (base {m['base_log_loss']:.4f})"
    return text
