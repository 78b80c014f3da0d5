"""Seeded synthetic click-through-rate data with a known best AUC (``data=synthetic_ctr``).

A sample has ``num_dense`` standard-normal features, one id per table and a click label:

- **Ids** follow a bounded power law per table: the row of popularity rank ``k`` (0-based) has
  probability roughly proportional to ``(k + 1) ** -alpha_t`` (``alpha_t = 0``: uniform), with
  one ``zipf_alpha`` for every table or one per table.
  Ranks are drawn by inverting the CDF of the continuous density ``x ** -alpha`` on
  ``[1, rows + 1)`` and flooring -- O(1) per draw and nothing of size ``rows`` is ever built,
  so tables can have tens of millions of rows. The continuous law slightly under-weights the
  very top ranks compared with the discrete Zipf law; that is irrelevant for a benchmark.
  Ranks are then mapped to rows by ``row = (a * rank + b) mod rows``, a bijection because
  ``gcd(a, rows) = 1``. ``a`` is the first integer from ``round(rows * theta)`` on that is
  coprime to ``rows``, with theta = 0.618... or 0.382... (golden-ratio strides spread any run of consecutive ranks
  most evenly over ``[0, rows)``), ``b`` and the choice of theta are seeded: the hot rows are
  scattered over the table rather than being rows 0..k, so neither range nor modulo
  sharding piles the head onto one server.
- **Labels** come from a hidden logistic model, ``label ~ Bernoulli(sigmoid(logit))`` with
  ``logit = bias + dense @ w + sum_t c_t * (e_t(ids[:, t]) - m_t)``, where ``e_t(row)`` is a
  standard normal computed by hashing ``(seed, table, row)`` -- a per-row effect with no
  per-row storage, so a table of 40 M rows costs the generator nothing more than one of 40.
  ``w``, ``c_t``, ``m_t`` and ``bias`` are fixed on a calibration draw of
  65,536 samples from their own seeded stream: the dense part gets 30% of the logit's
  variance and the tables share the rest equally, the total standard deviation is
  ``signal_std`` and ``bias`` makes the expected click rate ``positive_rate``. The defaults
  (rate 0.25, ``signal_std`` 1.4) give a best AUC near 0.8.
- **Interactions** (optional, ``interaction`` > 0): the logit also gets a term that no sum of
  per-feature effects can express, ``sum over table pairs t < u of <v_t(ids[:, t]),
  v_u(ids[:, u])>``, with ``v_t(row)`` a hashed standard-normal vector of ``INTERACTION_DIM``
  values per row -- a hidden factorisation machine, the kind of signal DLRM's dot
  interaction is for. It takes the share ``interaction`` of the logit's variance; the
  dense and per-table parts share the rest as above. 0 (the default) leaves labels additive.
- **Bags** (optional, ``bag_shape``): multi-hot samples hold a bag of ids per table, the
  first being the one-hot data's id (``ps_train.workloads.ctr.data.synthetic_bags``); a table's effect is
  then the weighted mean of its bag's row effects, and so are the interaction vectors.
- **best AUC**: the AUC of the true probabilities on the test split -- what a perfect model
  scores on that sample. A logistic regression on the dense features plus one learned bias
  per (table, row) is exactly the hidden model's class, so the gap to it measures how well
  training estimated the rows (the rare tail rows cannot be learned from few sightings).

Reproducibility: everything derives from ``seed`` through ``numpy.random.SeedSequence``
streams; samples are generated in chunks of 65,536 with one stream per chunk, so sample ``i``
depends only on the seed, the generator's settings and ``i`` -- never on ``num_samples``,
the number of trainers or servers, or anything else. The hidden model does not depend on
``num_samples`` either, so a larger dataset from the same seed is the same task.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from ps_train.workloads.ctr.data.bags import BagColumns
from ps_train.workloads.ctr.data.split import CtrSplit
from ps_train.workloads.ctr.data.synthetic_bags import BagShape, NumpyBags, concat_columns, draw_bags
from ps_train.workloads.ctr.metrics import auc

__all__ = ["SyntheticCtr", "synthetic_ctr", "zipf_ranks", "MAX_TABLE_ROWS", "INTERACTION_DIM"]

_MASK64 = (1 << 64) - 1
_CHUNK = 65536  # samples per seeded stream; fixed so data never depends on num_samples
_CALIBRATION_SAMPLES = 65536
_DENSE_SHARE = 0.3  # of the logit variance, when there are dense features and tables
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0  # 0.618...: its multiples mod 1 are the most even spread
# a * rank must stay below 2**63 in int64: both < 2**31.
MAX_TABLE_ROWS = 2**31

# Streams of SeedSequence([seed, stream, ...]); interactions have their own, so turning them
# on leaves every other parameter of the hidden model as it was.
_S_MODEL, _S_CALIBRATION, _S_DATA, _S_PAIRS, _S_BAGS, _S_BAGS_CALIBRATION = 0, 1, 2, 3, 4, 5
INTERACTION_DIM = 4  # values per row of the hidden interaction vectors


def _rng(seed: int, *stream: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed & _MASK64, *stream])))


def zipf_ranks(u: np.ndarray, rows: int, alpha: float) -> np.ndarray:
    """Popularity ranks (int64, in ``[0, rows)``, same shape as ``u``) for uniforms ``u`` in [0, 1).

    Inverse CDF of the density proportional to ``x ** -alpha`` on ``[1, rows + 1)``, floored
    and shifted to 0-based: rank 0 is the most frequent. Computed in log space with
    ``log1p``/``expm1`` so ``alpha`` near 1 stays accurate.
    """
    if alpha < 0:
        raise ValueError(f"zipf_alpha={alpha}: must be >= 0 (0 = uniform)")
    if alpha == 0.0 or rows == 1:
        return np.minimum((u * rows).astype(np.int64), rows - 1)
    log_top = math.log(rows + 1.0)
    if abs(1.0 - alpha) < 1e-9:
        log_x = u * log_top  # alpha = 1: x = (rows + 1) ** u
    else:
        e = 1.0 - alpha  # x ** e = 1 + u * ((rows + 1) ** e - 1)
        log_x = np.log1p(u * math.expm1(e * log_top)) / e
    return np.clip(np.floor(np.exp(log_x)).astype(np.int64) - 1, 0, rows - 1)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    # SplitMix64's finaliser: a bijection on uint64 with full avalanche (uint64 ops wrap).
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _row_effects(rows: np.ndarray, key: int) -> np.ndarray:
    """A standard normal (float64) per row, a pure function of ``(key, row)``: Box-Muller on
    two hashed 53-bit uniforms."""
    h1 = _splitmix64(rows.astype(np.uint64) ^ np.uint64(key))
    h2 = _splitmix64(h1)
    u1 = ((h1 >> np.uint64(11)).astype(np.float64) + 0.5) / 2.0**53  # (0, 1): log is finite
    u2 = (h2 >> np.uint64(11)).astype(np.float64) / 2.0**53
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * math.pi * u2)


def _coprime_stride(rows: int, theta: float) -> int:
    if rows == 1:
        return 1
    a = min(max(1, int(round(rows * theta))), rows - 1)
    while math.gcd(a, rows) != 1:  # a = 1 is always coprime, so this ends (in a few steps)
        a = a % (rows - 1) + 1
    return a


class SyntheticCtr:
    """The generator and its hidden labelling model for one setting (see the module docstring).

    ``table_sizes``: rows per table, each in ``[1, MAX_TABLE_ROWS]``. Building it costs a
    calibration draw of 65,536 samples, independent of the table sizes. ``zipf_alpha``: the
    skew of every table, or one per table. ``bag_shape``: multi-hot bags (None: one id per
    table).
    """

    def __init__(
        self,
        num_dense: int,
        table_sizes: Sequence[int],
        zipf_alpha: float | Sequence[float],
        seed: int,
        *,
        positive_rate: float = 0.25,
        signal_std: float = 1.4,
        interaction: float = 0.0,
        bag_shape: BagShape | None = None,
    ) -> None:
        self.table_sizes = [int(s) for s in table_sizes]
        if bag_shape is not None and len(bag_shape.sizes) != len(self.table_sizes):
            raise ValueError(f"bag sizes {list(bag_shape.sizes)}: need one per table ({len(self.table_sizes)})")
        self.bag_shape = bag_shape if bag_shape is not None and bag_shape.multi_hot else None
        self.zipf_alphas = _per_table(zipf_alpha, len(self.table_sizes))
        self.num_dense, self.seed = int(num_dense), int(seed)
        if self.num_dense < 0:
            raise ValueError(f"num_dense={num_dense}: must be >= 0")
        if self.num_dense == 0 and not self.table_sizes:
            raise ValueError("synthetic_ctr: need at least one dense feature or one table")
        bad = [s for s in self.table_sizes if not 1 <= s <= MAX_TABLE_ROWS]
        if bad:
            raise ValueError(f"table_sizes: {bad[0]} rows; each table needs 1..{MAX_TABLE_ROWS} rows")
        bad_alpha = [a for a in self.zipf_alphas if a < 0 or not math.isfinite(a)]
        if bad_alpha:
            raise ValueError(f"zipf_alpha={bad_alpha[0]}: must be a finite number >= 0 (0 = uniform ids)")
        if not 0.0 < positive_rate < 1.0:
            raise ValueError(f"positive_rate={positive_rate}: must be strictly between 0 and 1")
        if not signal_std > 0.0:
            raise ValueError(f"signal_std={signal_std}: must be > 0")
        if not 0.0 <= interaction < 1.0:
            raise ValueError(f"interaction={interaction}: must be in [0, 1) (its share of the logit's variance)")
        if interaction > 0 and len(self.table_sizes) < 2:
            raise ValueError(f"interaction={interaction}: pairwise interactions need at least 2 tables")
        self.interaction = float(interaction)
        additive = math.sqrt(1.0 - self.interaction)  # the additive parts' share of the logit's std

        rng = _rng(seed, _S_MODEL)
        n_tables = len(self.table_sizes)
        dense_share = 1.0 if n_tables == 0 else 0.0 if self.num_dense == 0 else _DENSE_SHARE
        w = rng.standard_normal(self.num_dense)
        norm = float(np.linalg.norm(w))
        # Dense features are i.i.d. N(0, 1), so Var(dense @ w) = |w|^2.
        self.dense_weight = w * (math.sqrt(dense_share) * signal_std * additive / norm) if norm > 0 else w
        self._stride = [_coprime_stride(n, _GOLDEN if rng.random() < 0.5 else 1.0 - _GOLDEN) for n in self.table_sizes]
        self._offset = [int(rng.integers(n)) for n in self.table_sizes]
        self._keys = [int(k) for k in rng.integers(0, 2**63, size=n_tables, dtype=np.int64)]

        # Standardise each table's effect over its id distribution (a few hot rows can
        # dominate it), so the variance split and the click rate hold for any alpha and size.
        dense_c, ids_c = self._features(_rng(seed, _S_CALIBRATION), _CALIBRATION_SAMPLES)
        bags_c = self._bags(ids_c, _rng(seed, _S_BAGS_CALIBRATION))
        effects = self._raw_effects(ids_c, bags_c)
        self._mean = effects.mean(axis=0) if n_tables else np.zeros(0)
        std = effects.std(axis=0) if n_tables else np.zeros(0)
        scale = math.sqrt((1.0 - dense_share) / n_tables) * signal_std * additive if n_tables else 0.0
        # A table whose calibration draws all hit one row (e.g. 1 row) carries no signal.
        self._coef = np.where(std > 1e-9, scale / np.maximum(std, 1e-9), 0.0)
        self._pair_keys = np.zeros((n_tables, 0), dtype=np.int64)
        self._pair_mean, self._pair_coef = 0.0, 0.0
        if self.interaction > 0:
            self._pair_keys = _rng(seed, _S_PAIRS).integers(0, 2**63, size=(n_tables, INTERACTION_DIM), dtype=np.int64)
            pairs = self._raw_pairs(ids_c, bags_c)
            self._pair_mean, pair_std = float(pairs.mean()), float(pairs.std())
            if pair_std > 1e-9:
                self._pair_coef = math.sqrt(self.interaction) * signal_std / pair_std
        self.bias = 0.0
        self.bias = _solve_bias(self.logits(dense_c, ids_c, bags_c), positive_rate)

    # ---------------------------------------------------------------- features and teacher

    def _features(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``dense`` float32 [n, num_dense] and ``ids`` int64 [n, num_tables] from ``rng``."""
        dense = rng.standard_normal((n, self.num_dense), dtype=np.float32)
        u = rng.random((len(self.table_sizes), n))
        ids = np.empty((n, len(self.table_sizes)), dtype=np.int64)
        for t, rows in enumerate(self.table_sizes):
            ranks = zipf_ranks(u[t], rows, self.zipf_alphas[t])
            ids[:, t] = (ranks * self._stride[t] + self._offset[t]) % rows
        return dense, ids

    def _table_ids(self, t: int, u: np.ndarray) -> np.ndarray:
        """Table ``t``'s ids (int64) for uniforms ``u`` in [0, 1), any shape."""
        rows = self.table_sizes[t]
        return (zipf_ranks(u, rows, self.zipf_alphas[t]) * self._stride[t] + self._offset[t]) % rows

    def _bags(self, first: np.ndarray, rng: np.random.Generator) -> NumpyBags | None:
        """Multi-hot bags whose first ids are ``first`` [n, T], the rest from ``rng``; None if one-hot."""
        return None if self.bag_shape is None else draw_bags(first, self.bag_shape, rng, self._table_ids)

    def _raw_effects(self, ids: np.ndarray, bags: NumpyBags | None = None) -> np.ndarray:
        out = np.empty(ids.shape, dtype=np.float64)
        for t in range(ids.shape[1]):
            if bags is None:
                out[:, t] = _row_effects(ids[:, t], self._keys[t])
            else:
                out[:, t] = bags.pool(t, _row_effects(bags.ids[t], self._keys[t]))
        return out

    def _pair_vectors(self, ids: np.ndarray, t: int, bags: NumpyBags | None) -> np.ndarray:
        """Table ``t``'s hidden interaction vectors, float64 [N, K] (a bag's: its ids' weighted mean)."""
        if bags is None:
            return np.stack([_row_effects(ids[:, t], int(k)) for k in self._pair_keys[t]], axis=1)
        per_id = np.stack([_row_effects(bags.ids[t], int(k)) for k in self._pair_keys[t]], axis=2)  # [N, L, K]
        return bags.pool(t, per_id)

    def _raw_pairs(self, ids: np.ndarray, bags: NumpyBags | None = None) -> np.ndarray:
        """``sum_{t < u} <v_t(ids[:, t]), v_u(ids[:, u])>``, float64 [N]."""
        v = np.stack([self._pair_vectors(ids, t, bags) for t in range(ids.shape[1])], axis=1)  # [N, T, K]
        total = v.sum(axis=1)  # [N, K]
        # |sum_t v_t|^2 = sum_t |v_t|^2 + 2 sum_{t<u} <v_t, v_u>
        return 0.5 * ((total * total).sum(axis=1) - (v * v).sum(axis=(1, 2)))

    def logits(
        self,
        dense: np.ndarray | torch.Tensor,
        ids: np.ndarray | torch.Tensor,
        bags: NumpyBags | BagColumns | None = None,
    ) -> np.ndarray:
        """The hidden model's logits, float64 [N], for ``dense [N, num_dense]``, ``ids [N, num_tables]``
        and, for multi-hot data, the samples' ``bags``."""
        dense = np.asarray(dense, dtype=np.float64)
        ids = np.asarray(ids, dtype=np.int64)
        if isinstance(bags, BagColumns):
            bags = NumpyBags.from_columns(bags)
        if (bags is None) != (self.bag_shape is None):
            raise ValueError("logits: pass the samples' bags exactly when the data is multi-hot")
        z = self.bias + dense @ self.dense_weight
        if ids.shape[1]:
            z = z + (self._raw_effects(ids, bags) - self._mean) @ self._coef
        if self._pair_coef:
            z = z + (self._raw_pairs(ids, bags) - self._pair_mean) * self._pair_coef
        return z

    def probabilities(
        self,
        dense: np.ndarray | torch.Tensor,
        ids: np.ndarray | torch.Tensor,
        bags: NumpyBags | BagColumns | None = None,
    ) -> np.ndarray:
        """True click probabilities, float64 [N]: ``sigmoid(logits(dense, ids, bags))``."""
        return 1.0 / (1.0 + np.exp(-self.logits(dense, ids, bags)))

    def hot_rows(self, table: int, k: int) -> np.ndarray:
        """The ``k`` most frequent rows of ``table``, most frequent first (int64 [k])."""
        rows = self.table_sizes[table]
        ranks = np.arange(min(k, rows), dtype=np.int64)
        return (ranks * self._stride[table] + self._offset[table]) % rows

    # ---------------------------------------------------------------- samples

    def generate(self, num_samples: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(dense float32 [N, num_dense], ids int64 [N, num_tables], labels float32 [N],
        probs float64 [N])`` for samples ``0 .. num_samples - 1`` (multi-hot data: ``ids`` are
        the bags' first ids; ``generate_with_bags`` gives the bags)."""
        dense, ids, labels, probs, _ = self.generate_with_bags(num_samples)
        return dense, ids, labels, probs

    def generate_with_bags(
        self, num_samples: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, BagColumns | None]:
        """``generate``'s arrays and, for multi-hot data, every sample's bags (else None)."""
        if num_samples < 0:
            raise ValueError(f"num_samples={num_samples}: must be >= 0")
        dense = np.empty((num_samples, self.num_dense), dtype=np.float32)
        ids = np.empty((num_samples, len(self.table_sizes)), dtype=np.int64)
        labels = np.empty(num_samples, dtype=np.float32)
        probs = np.empty(num_samples, dtype=np.float64)
        chunks: list[BagColumns] = []
        for chunk, start in enumerate(range(0, num_samples, _CHUNK)):
            rng = _rng(self.seed, _S_DATA, chunk)
            # Always draw a full chunk, so sample i does not depend on num_samples.
            d, i = self._features(rng, _CHUNK)
            bags = self._bags(i, _rng(self.seed, _S_BAGS, chunk))
            p = self.probabilities(d, i, bags)
            y = rng.random(_CHUNK) < p
            end = min(start + _CHUNK, num_samples)
            m = end - start
            dense[start:end], ids[start:end], probs[start:end], labels[start:end] = d[:m], i[:m], p[:m], y[:m]
            if bags is not None:
                chunks.append(bags.take(m).to_columns())
        return dense, ids, labels, probs, concat_columns(chunks, len(self.table_sizes)) if chunks else None


def _per_table(alpha: float | Sequence[float], num_tables: int) -> list[float]:
    """``zipf_alpha`` as one skew per table: a number for every table, or a list of one per table."""
    if isinstance(alpha, int | float):
        return [float(alpha)] * num_tables
    alphas = [float(a) for a in alpha]
    if len(alphas) != num_tables:
        raise ValueError(f"zipf_alpha {alphas}: give one skew for every table or one per table ({num_tables})")
    return alphas


def _solve_bias(logits: np.ndarray, rate: float) -> float:
    """``b`` with ``mean(sigmoid(logits + b)) == rate`` (bisection; the mean is increasing in b)."""
    lo, hi = -40.0, 40.0
    for _ in range(80):
        mid = (lo + hi) / 2.0
        if np.mean(1.0 / (1.0 + np.exp(-(logits + mid)))) < rate:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2.0


def synthetic_ctr(
    num_samples: int,
    num_dense: int,
    table_sizes: Sequence[int],
    zipf_alpha: float | Sequence[float],
    seed: int,
    test_fraction: float,
    *,
    positive_rate: float = 0.25,
    signal_std: float = 1.4,
    interaction: float = 0.0,
    bag_shape: BagShape | None = None,
) -> tuple[CtrSplit, CtrSplit, float]:
    """``(train, test, best_auc)``: ``num_samples`` synthetic samples, the last
    ``round(num_samples * test_fraction)`` of them as test.

    ``best_auc`` is the AUC of the true click probabilities on ``test``: print it next to a
    model's test AUC. Memory: the splits only (see ``CtrSplit``), plus a 65,536-sample
    working chunk; nothing grows with the table sizes. Same arguments -> identical data.
    ``bag_shape``: multi-hot bags (the splits' ``bags``); None or bags of one: one-hot.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction={test_fraction}: must be strictly between 0 and 1")
    n_test = int(round(num_samples * test_fraction))
    if n_test < 2 or n_test == num_samples:
        raise ValueError(
            f"num_samples={num_samples} with test_fraction={test_fraction} leaves "
            f"{n_test} test and {num_samples - n_test} train samples; need at least 2 "
            "test samples and 1 train sample"
        )
    gen = SyntheticCtr(
        num_dense,
        table_sizes,
        zipf_alpha,
        seed,
        positive_rate=positive_rate,
        signal_std=signal_std,
        interaction=interaction,
        bag_shape=bag_shape,
    )
    dense, ids, labels, probs, bags = gen.generate_with_bags(num_samples)
    n_train = num_samples - n_test
    split = [
        CtrSplit(
            torch.from_numpy(dense[s]),
            torch.from_numpy(ids[s]),
            torch.from_numpy(labels[s]),
            list(gen.table_sizes),
            bags.subset(s) if bags is not None else None,
        )
        for s in (slice(0, n_train), slice(n_train, num_samples))
    ]
    return split[0], split[1], auc(probs[n_train:], labels[n_train:])
