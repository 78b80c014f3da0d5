"""The CTR data a run's ``data`` config names: ``(train, test, best_auc)``."""
from __future__ import annotations

import os

from ps_train.config import CriteoConfig, CtrDataConfig, SyntheticCtrConfig
from ps_train.config.prepared import MANIFEST_NAME
from ps_train.ctr.criteo import load_criteo
from ps_train.ctr.mapped import load_prepared
from ps_train.ctr.split import CtrDataset
from ps_train.ctr.synthetic import synthetic_ctr
from ps_train.ctr.synthetic_bags import BagShape

__all__ = ["load_ctr_data"]


def load_ctr_data(cfg: CtrDataConfig) -> tuple[CtrDataset, CtrDataset, float | None]:
    """Train and test splits for ``data=synthetic_ctr`` or ``data=criteo``, and the best AUC
    a model can reach on the test split (synthetic data only; None for Criteo). Criteo
    splits are in memory when read from ``data.root``, memory-mapped from ``data.prepared``."""
    if isinstance(cfg, SyntheticCtrConfig):
        return synthetic_ctr(cfg.num_samples, cfg.num_dense, cfg.sizes(), cfg.zipf_alpha, cfg.data_seed,
                             cfg.test_fraction, positive_rate=cfg.positive_rate, signal_std=cfg.signal_std,
                             interaction=cfg.interaction,
                             bag_shape=BagShape(tuple(cfg.bag_size_list()), cfg.bag_size_dist, cfg.id_weights))
    if isinstance(cfg, CriteoConfig) and cfg.prepared:
        mapped = load_prepared(os.path.expanduser(cfg.prepared), cfg.sizes(), cfg.test_fraction,
                               skip_malformed=cfg.skip_malformed, manifest=cfg.prepared_manifest())
        return mapped[0], mapped[1], None
    if isinstance(cfg, CriteoConfig):
        root = os.path.expanduser(cfg.root)
        if not os.path.exists(root):
            raise FileNotFoundError(f"data=criteo: data.root={cfg.root!r} does not exist; point data.root at the "
                                    "folder holding the Criteo day_* or train.txt files")
        if os.path.isfile(os.path.join(root, MANIFEST_NAME)):
            raise ValueError(f"data=criteo: data.root={cfg.root!r} is a prepared folder (it has {MANIFEST_NAME}); "
                             f"train from it with data.prepared={cfg.root}")
        train, test, _ = load_criteo(root, cfg.sizes(), cfg.test_fraction, skip_malformed=cfg.skip_malformed)
        return train, test, None
    raise ValueError(f"data.name: {cfg.name!r} is not click-through-rate data; use data=synthetic_ctr or "
                     "data=criteo with model=dlrm")
