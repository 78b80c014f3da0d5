"""Click-through-rate data for the DLRM-style sparse-embedding workload.

- ``split``: ``CtrSplit`` (dense features, one id per table, 0/1 labels) and ``time_split``;
- ``synthetic``: ``synthetic_ctr``, seeded Zipf ids and labels from a hidden model with a
  known best AUC (the offline default);
- ``criteo``: ``read_criteo`` / ``load_criteo`` for the Criteo TSV logs in a local folder;
- ``line_blocks``, ``criteo_columns``, ``criteo_prepare``, ``progress``: ``python -m
  ps_train.prepare criteo``, the files converted once into ``.npy`` arrays; ``mapped``:
  ``MappedCtrSplit`` over them;
- ``batches``: ``CtrBatchIterator`` (per-trainer, resumable) and ``iter_ctr_eval_batches``.

Metrics (AUC, log loss) are in ``ps_train.workloads.ctr.metrics``.

The rest of the package is the DLRM-style model on top of this data (model=dlrm, docs/ctr.md):
``model`` (the single-process reference and the interaction), ``rows`` (which server owns
which row), ``shards`` and ``table_server`` (a server's rows and their optimizer, the server's
``TablePart``), ``dynamic`` (a dynamic table's slots, admission and eviction),
``optimizers`` (the table optimizers), ``trainer`` (``CtrTrainer``).
"""

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
