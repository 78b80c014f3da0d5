"""ps_train: parameter-server, model-parallel training for PyTorch on rpc_core.

Run ``python -m ps_train`` (the Hydra configs ship inside the package, in ``ps_train/conf/``).
The modules that do not touch RPC -- ``config``, ``models``, ``stage_sharding``, ``data``,
``metrics``, ``checkpoint.files`` -- are plain PyTorch and can be used and tested in a
single process; ``app.run(cfg, run_dir)`` is the entry point without Hydra. Which package
holds what, and where a new mode, table optimizer or part of a role goes: docs/design.md
("ps_train: layout, and where a change goes").

What a seed reproduces
----------------------
``mode=sync`` is bit-reproducible: with the same config (seed, model, data, cluster shape,
batch size, optimizer) on the same torch build, two runs give identical per-step losses and
identical final weights; so does a run resumed from a checkpoint, and ``backend=torch``
gives the same numbers as rpc_core. Each step equals plain single-process torch that adds
the trainers' mean-loss gradients in trainer-rank order and divides the sum by the number of
trainers (``mode.aggregate=mean``; ``sum`` stops there) (tests/ps_train/test_reproducibility.py).
For ``model=dlrm`` the reference is ``nn.EmbeddingBag(sparse=True)`` tables, which sum a row's
per-sample gradients in another order than the trainer's deduplicated lookup: table values
agree within float32 rounding (1e-6, tests/ps_train/test_dlrm.py), on either backend, and
runs repeat bit for bit.
What makes it so: seeded init and shard placement, seeded per-epoch data partitions,
gradients added in rank order on every server, dropout masks seeded per (seed, shard,
trainer, step), and BatchNorm statistics updated in trainer order. Changing
``cluster.num_trainers`` or ``train.batch_size`` changes the computation itself.

``mode=async`` and ``mode=ssp`` reproduce the initial weights, every trainer's data order and
the shard placement, and ssp always keeps trainers within ``mode.staleness`` steps of the
slowest. They cannot reproduce losses or weights: which parameter version a forward reads,
and the order in which the trainers' gradients are applied, depend on process timing (that
is the point of these modes), so losses, final weights, staleness values and dropout masks
(drawn in arrival order) differ from run to run -- even with ``mode.staleness=0``, whose
steps are in lockstep but whose updates within a step are applied as they arrive. A resumed
async/ssp run restarts every trainer after its own last step that the checkpoint's servers
hold (``ps_train.checkpoint.positions``): no sample is skipped, a step in flight at the
checkpoint is trained again; it continues training correctly but not along the same path.

``mode=hybrid`` (model=dlrm) is ``mode=sync`` bit for bit with one trainer; with more, its
dense rounds are sync's but the table rows are updated in arrival order, as async's.
"""
