"""The DLRM benchmark's ideal bytes per step (ps_train/workloads/ctr/ideal_traffic.py): the formula on a
case computed by hand, and the replay of a run's batches against an independent count."""

from __future__ import annotations

import math

import pytest
import torch

from ps_train.config import CtrDataConfig, DLRMConfig
from ps_train.workloads.ctr.data.batches import CtrBatchIterator
from ps_train.workloads.ctr.data.loading import load_ctr_data
from ps_train.workloads.ctr.ideal_traffic import replay_ideal_bytes, step_ideal_bytes
from tests.ps_train._app import make_cfg


def test_formula_on_a_hand_computed_step() -> None:
    # d=2, B=3, 1 dense feature, 2 tables; this server returns 2 rows of table 0 and 1 of table 1.
    rows = 3 * (8 + 2 * 4 + 2 * 4)  # per row: its int64 id out, 2 floats back, 2 gradient floats in = 72
    bottom = 3 * (1 * 4 + 2 * 4 + 2 * 4)  # dense [3, 1] in, x [3, 2] out, dx [3, 2] in = 60
    z = 2 + 3  # x and the 3 pairwise dots of (x, e0, e1)
    top = 3 * (z * 4 + 4 + 4 + z * 4)  # z [3, 5] in, logit [3, 1] out, dlogit in, dz [3, 5] out = 144
    assert (
        step_ideal_bytes([2, 1], dim=2, batch=3, num_dense=1, num_tables=2, hosts_bottom=True, hosts_top=True)
        == rows + bottom + top
        == 276
    )
    assert step_ideal_bytes([2, 1], 2, 3, 1, 2, hosts_bottom=False, hosts_top=False) == 72
    assert step_ideal_bytes([0, 0], 2, 3, 1, 2, hosts_bottom=False, hosts_top=True) == 144
    with pytest.raises(ValueError, match="lists 1 tables, expected num_tables=2"):
        step_ideal_bytes([1], 2, 3, 1, 2, hosts_bottom=False, hosts_top=False)


def test_replay_counts_each_servers_distinct_rows_of_every_batch() -> None:
    steps = 3
    cfg = make_cfg(
        "model=dlrm",
        "data=synthetic_ctr",
        "data.num_samples=400",
        "data.table_sizes=[10,7]",
        "data.num_dense=3",
        "model.embedding_dim=4",
        "model.bottom_mlp=[8]",
        "model.top_mlp=[8]",
        "model.table_sharding=range",
        "train.batch_size=8",
        "cluster.num_servers=2",
        "cluster.num_trainers=2",
    )
    assert isinstance(cfg.data, CtrDataConfig) and isinstance(cfg.model, DLRMConfig)
    got = replay_ideal_bytes(cfg.model, cfg.data, cfg.cluster, cfg.train.batch_size, cfg.seed, steps)

    # Independently: distinct ids per table and owner (range sharding: the first ceil(n / 2)
    # rows on ps0), from the batches each trainer takes; bottom MLP on ps0, top MLP on ps1.
    train = load_ctr_data(cfg.data).train
    sizes, d, B = cfg.data.sizes(), 4, 8
    rows = [0, 0]
    for k in range(2):
        batches = CtrBatchIterator(train, k, 2, B, cfg.seed)
        for _ in range(steps):
            ids = next(batches)[1]
            assert isinstance(ids, torch.Tensor)  # one-hot data
            for t, n in enumerate(sizes):
                for i in set(ids[:, t].tolist()):
                    rows[i // math.ceil(n / 2)] += 1
    z = d + 3  # x and the pairwise dots of (x, e0, e1)
    want = {
        "ps0": (rows[0] * (8 + 8 * d) + 2 * steps * B * 4 * (3 + 2 * d)) / (2 * steps),
        "ps1": (rows[1] * (8 + 8 * d) + 2 * steps * B * 4 * (2 * z + 2)) / (2 * steps),
    }
    assert got.ideal_per_step == pytest.approx(want, rel=1e-12)
    assert got.rows_per_step == sum(rows) / (2 * steps)
    assert got.trainer_steps == 2 * steps


@pytest.mark.timeout(120)
def test_replay_works_in_a_fresh_process_that_imported_no_workload() -> None:
    # A tool (ctr_bench) calls it without ``python -m ps_train``'s set-up: nothing has
    # registered the CTR workload yet, and the stage plan comes from the registry.
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import os, ps_train\n"
        "from hydra import compose, initialize_config_dir\n"
        "from ps_train.config import from_dictconfig\n"
        "from ps_train.workloads.ctr.ideal_traffic import replay_ideal_bytes\n"
        "conf = os.path.join(os.path.dirname(ps_train.__file__), 'conf')\n"
        "with initialize_config_dir(config_dir=conf, version_base='1.3'):\n"
        "    o = ['model=dlrm', 'data=synthetic_ctr', 'data.num_samples=2000', 'cluster.num_servers=2']\n"
        "    c = from_dictconfig(compose('config', overrides=o))\n"
        "r = replay_ideal_bytes(c.model, c.data, c.cluster, c.train.batch_size, c.seed, 2)\n"
        "print(sorted(r.ideal_per_step), r.trainer_steps)\n"
    )
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=100)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("]")[0].startswith("['ps0', 'ps1'")
