"""The CTR data a run's ``data`` config names (``load_ctr_data``), and what the launcher
checks of it before any role starts (``check_ctr_data``)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import NamedTuple

import torch

from ps_train.config import CriteoConfig, CtrDataConfig, SyntheticCtrConfig
from ps_train.workloads.ctr.data.bags import BagColumns
from ps_train.workloads.ctr.data.criteo import check_criteo_files, load_criteo
from ps_train.workloads.ctr.data.mapped import load_prepared, skipped_note
from ps_train.workloads.ctr.data.prepared import MANIFEST_NAME, CriteoManifest, read_manifest
from ps_train.workloads.ctr.data.split import CtrDataset, CtrSplit, held_out_count
from ps_train.workloads.ctr.data.synthetic import synthetic_ctr
from ps_train.workloads.ctr.data.synthetic_bags import BagShape

__all__ = ["CtrData", "load_ctr_data", "check_ctr_data", "RAW_CRITEO_ROWS"]

# Criteo's hashing into a table of this many rows, 1 + v % (rows - 1), is 1 + v for every
# 32-bit value v: a dynamic table's raw id.
RAW_CRITEO_ROWS = 2**32 + 1


class CtrData(NamedTuple):
    train: CtrDataset
    test: CtrDataset
    best_auc: float | None  # the best AUC a model can reach on ``test``: synthetic data only
    skipped: str | None = None  # data.skip_malformed=true: one line on the malformed lines skipped, if any


def load_ctr_data(cfg: CtrDataConfig, raw_ids: Sequence[int] = ()) -> CtrData:
    """Train and test splits for ``data=synthetic_ctr`` or ``data=criteo``. Criteo splits are
    in memory when read from ``data.root``, memory-mapped from ``data.prepared``.

    ``raw_ids``: tables (dynamic ones) whose ids are not folded into a fixed range: synthetic
    data's ids are so already (``num_embeddings`` distinct ids, nothing of that size is
    built); Criteo's are the categorical's 32-bit value plus 1 (0 for empty) instead of
    ``1 + v % (rows - 1)``: the value before the modulo, so two values never share an id."""
    if raw_ids and isinstance(cfg, CriteoConfig):
        sizes = cfg.sizes()
        cfg = dataclasses.replace(
            cfg, table_sizes=[RAW_CRITEO_ROWS if t in raw_ids else n for t, n in enumerate(sizes)]
        )
    if isinstance(cfg, SyntheticCtrConfig):
        drawn = [cfg.drawn_ids or n for n in cfg.sizes()]
        train, test, best = synthetic_ctr(
            cfg.num_samples,
            cfg.num_dense,
            drawn,
            cfg.zipf_alpha_list(),
            cfg.data_seed,
            cfg.test_fraction,
            positive_rate=cfg.positive_rate,
            signal_std=cfg.signal_std,
            interaction=cfg.interaction,
            bag_shape=BagShape(tuple(cfg.bag_size_list()), cfg.bag_size_dist, cfg.id_weights),
        )
        if cfg.drawn_ids:  # fixed tables hash the ids into their rows; dynamic ones keep them
            train, test = hash_ids(train, cfg.sizes(), raw_ids), hash_ids(test, cfg.sizes(), raw_ids)
        return CtrData(train, test, best)
    if isinstance(cfg, CriteoConfig) and cfg.prepared:
        folder = os.path.expanduser(cfg.prepared)
        manifest = _prepared_manifest(cfg)
        mapped = load_prepared(
            folder, cfg.sizes(), cfg.test_fraction, skip_malformed=cfg.skip_malformed, manifest=manifest
        )
        return CtrData(mapped[0], mapped[1], None, skipped_note(manifest, folder, cfg.skip_malformed))
    if isinstance(cfg, CriteoConfig):
        train, test, stats = load_criteo(
            _criteo_root(cfg), cfg.sizes(), cfg.test_fraction, skip_malformed=cfg.skip_malformed
        )
        return CtrData(train, test, None, stats.skipped_note())
    raise ValueError(
        f"data.name: {cfg.name!r} is not click-through-rate data; use data=synthetic_ctr or data=criteo with model=dlrm"
    )


def hash_ids(split: CtrSplit, rows: Sequence[int], keep: Sequence[int] = ()) -> CtrSplit:
    """``split`` with table t's ids folded into ``rows[t]`` rows (id mod rows), except the
    tables ``keep``, whose ids stay as drawn."""
    T = split.num_tables
    mods = torch.tensor([1 << 62 if t in keep else int(n) for t, n in enumerate(rows)], dtype=torch.int64)
    ids = torch.remainder(split.ids, mods)  # [N, T]
    bags = split.bags
    if bags is not None:
        lengths = bags.offsets[1:] - bags.offsets[:-1]  # [N * T], sample-major
        table = torch.repeat_interleave(torch.arange(len(lengths)) % T, lengths)  # [M]
        values = torch.remainder(bags.values.to(torch.int64), mods[table]).to(bags.values.dtype)
        bags = BagColumns(values, bags.offsets, bags.weights, T)
    sizes = [split.table_sizes[t] if t in keep else int(n) for t, n in enumerate(rows)]
    return CtrSplit(split.dense, ids, split.labels, sizes, bags)


def check_ctr_data(cfg: CtrDataConfig) -> int | None:
    """What ``load_ctr_data(cfg)`` would fail on first, checked cheaply, in the launcher: the
    Criteo files exist and their first lines parse (``check_criteo_files``), or a prepared
    folder is whole and usable. Returns the training samples when known without reading the
    data (a prepared folder's manifest), else None. Raises the error a trainer would."""
    if not isinstance(cfg, CriteoConfig):
        return None  # generated data: the config says it all
    if cfg.prepared:
        manifest = _prepared_manifest(cfg)
        skipped_note(manifest, os.path.expanduser(cfg.prepared), cfg.skip_malformed)  # raises if it may not skip
        return manifest.rows - held_out_count(manifest.rows, cfg.test_fraction)
    check_criteo_files(_criteo_root(cfg), cfg.sizes(), skip_malformed=cfg.skip_malformed)
    return None


def _prepared_manifest(cfg: CriteoConfig) -> CriteoManifest:
    """The manifest of ``data.prepared``, checked: the folder exists, is in this version of
    the format with every array whole, and no source file still present changed since.
    Read where the data is (a trainer, the launcher's precheck), not in the config's
    ``problems()``: other roles of a job validate the same config on machines that may not
    hold the data."""
    if not cfg.prepared:
        raise ValueError("data.prepared: not set")
    return read_manifest(os.path.expanduser(cfg.prepared))


def _criteo_root(cfg: CriteoConfig) -> str:
    root = os.path.expanduser(cfg.root)
    if not os.path.exists(root):
        raise FileNotFoundError(
            f"data=criteo: data.root={cfg.root!r} does not exist; point data.root at the "
            "folder holding the Criteo day_* or train.txt files"
        )
    if os.path.isfile(os.path.join(root, MANIFEST_NAME)):
        raise ValueError(
            f"data=criteo: data.root={cfg.root!r} is a prepared folder (it has {MANIFEST_NAME}); "
            f"train from it with data.prepared={cfg.root}"
        )
    return root
