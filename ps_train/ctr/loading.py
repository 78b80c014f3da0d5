"""The CTR data a run's ``data`` config names (``load_ctr_data``), and what the launcher
checks of it before any role starts (``check_ctr_data``)."""

from __future__ import annotations

import os
from typing import NamedTuple

from ps_train.config import CriteoConfig, CtrDataConfig, SyntheticCtrConfig
from ps_train.config.prepared import MANIFEST_NAME
from ps_train.ctr.criteo import check_criteo_files, load_criteo
from ps_train.ctr.mapped import load_prepared, skipped_note
from ps_train.ctr.split import CtrDataset, held_out_count
from ps_train.ctr.synthetic import synthetic_ctr
from ps_train.ctr.synthetic_bags import BagShape

__all__ = ["CtrData", "load_ctr_data", "check_ctr_data"]


class CtrData(NamedTuple):
    train: CtrDataset
    test: CtrDataset
    best_auc: float | None  # the best AUC a model can reach on ``test``: synthetic data only
    skipped: str | None = None  # data.skip_malformed=true: one line on the malformed lines skipped, if any


def load_ctr_data(cfg: CtrDataConfig) -> CtrData:
    """Train and test splits for ``data=synthetic_ctr`` or ``data=criteo``. Criteo splits are
    in memory when read from ``data.root``, memory-mapped from ``data.prepared``."""
    if isinstance(cfg, SyntheticCtrConfig):
        return CtrData(
            *synthetic_ctr(
                cfg.num_samples,
                cfg.num_dense,
                cfg.sizes(),
                cfg.zipf_alpha,
                cfg.data_seed,
                cfg.test_fraction,
                positive_rate=cfg.positive_rate,
                signal_std=cfg.signal_std,
                interaction=cfg.interaction,
                bag_shape=BagShape(tuple(cfg.bag_size_list()), cfg.bag_size_dist, cfg.id_weights),
            )
        )
    if isinstance(cfg, CriteoConfig) and cfg.prepared:
        folder = os.path.expanduser(cfg.prepared)
        manifest = cfg.prepared_manifest()
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


def check_ctr_data(cfg: CtrDataConfig) -> int | None:
    """What ``load_ctr_data(cfg)`` would fail on first, checked cheaply, in the launcher: the
    Criteo files exist and their first lines parse (``check_criteo_files``), or a prepared
    folder is whole and usable. Returns the training samples when known without reading the
    data (a prepared folder's manifest), else None. Raises the error a trainer would."""
    if not isinstance(cfg, CriteoConfig):
        return None  # generated data: the config says it all
    if cfg.prepared:
        manifest = cfg.prepared_manifest()
        skipped_note(manifest, os.path.expanduser(cfg.prepared), cfg.skip_malformed)  # raises if it may not skip
        return manifest.rows - held_out_count(manifest.rows, cfg.test_fraction)
    check_criteo_files(_criteo_root(cfg), cfg.sizes(), skip_malformed=cfg.skip_malformed)
    return None


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
