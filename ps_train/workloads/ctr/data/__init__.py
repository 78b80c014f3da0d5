"""Click-through-rate data for the DLRM-style sparse-embedding workload.

- ``split``: ``CtrSplit`` (dense features, one id per table, 0/1 labels) and ``time_split``;
- ``synthetic``: ``synthetic_ctr``, seeded Zipf ids and labels from a hidden model with a
  known best AUC (the offline default);
- ``criteo``: ``read_criteo`` / ``load_criteo`` for the Criteo TSV logs in a local folder;
- ``gunzip``, ``line_blocks``, ``criteo_columns``, ``criteo_prepare``, ``progress``: ``python -m
  ps_train.prepare criteo``, the files converted once into ``.npy`` arrays; ``prepared``: the
  prepared folder's format (its manifest and checks); ``mapped``: ``MappedCtrSplit`` over them;
- ``batches``: ``CtrBatchIterator`` (per-trainer, resumable) and ``iter_ctr_eval_batches``.

Metrics (AUC, log loss) are in ``ps_train.workloads.ctr.metrics``.

The rest of the package is the DLRM-style model on top of this data (model=dlrm, docs/ctr.md):
``model`` (the single-process reference and the interaction), ``rows`` (which server owns
which row), ``shards`` and ``table_server`` (a server's rows and their optimizer, the server's
``TablePart``), ``dynamic`` (a dynamic table's slots, admission and eviction),
``optimizers`` (the table optimizers), ``trainer`` (``CtrTrainer``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ps_train.workloads.ctr.data.batches import CtrBatch, CtrBatchIterator, iter_ctr_eval_batches
    from ps_train.workloads.ctr.data.criteo import (
        CriteoFormatError,
        CriteoStats,
        find_criteo_files,
        load_criteo,
        read_criteo,
    )
    from ps_train.workloads.ctr.data.split import CtrSplit, time_split
    from ps_train.workloads.ctr.data.synthetic import SyntheticCtr, synthetic_ctr

# name -> the module that defines it. The names are imported on first use, not with the
# package: ``python -m ps_train.prepare`` imports modules of this package and must start
# without torch, which most of these modules import.
_EXPORTS = {
    "CtrSplit": "split",
    "time_split": "split",
    "SyntheticCtr": "synthetic",
    "synthetic_ctr": "synthetic",
    "CriteoFormatError": "criteo",
    "CriteoStats": "criteo",
    "read_criteo": "criteo",
    "load_criteo": "criteo",
    "find_criteo_files": "criteo",
    "CtrBatch": "batches",
    "CtrBatchIterator": "batches",
    "iter_ctr_eval_batches": "batches",
}

__all__ = [
    "CtrSplit",
    "time_split",
    "SyntheticCtr",
    "synthetic_ctr",
    "CriteoFormatError",
    "CriteoStats",
    "read_criteo",
    "load_criteo",
    "find_criteo_files",
    "CtrBatch",
    "CtrBatchIterator",
    "iter_ctr_eval_batches",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
