"""The click-through-rate workload: DLRM-style models (model=dlrm) with embedding tables
split by rows across the servers, on data=synthetic_ctr or data=criteo (docs/ctr.md).

- ``data/``: Criteo reading and preparing, memory-mapped arrays, the synthetic generator,
  per-trainer batches, multi-hot bags and KeyedJaggedTensor batches;
- ``tables/``: row ownership and init, the servers' table storage and its optimizers,
  dynamic (raw-id) tables, the trainer's bag plan and hot-row cache, checkpoint snapshots,
  and the servers' table service;
- ``model`` (the single-process DLRM, the interaction, the dense stages), ``metrics`` (AUC,
  log loss), ``trainer`` (``CtrTrainer``) and ``ideal_traffic`` (the bytes per step the
  scheme must move, which ``benchmarks/ctr_bench.py`` compares with the measured ones).

Its registration with ``ps_train.workload`` is the module ``workload`` (``CTR``), not this
package: ``python -m ps_train.prepare`` imports ``data/`` modules and starts without the
config, Hydra or torch that the registration brings in.
"""
