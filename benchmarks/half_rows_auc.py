"""Half-precision table rows against float32: test AUC on data=synthetic_ctr at equal steps.

Runs ``python -m ps_train model=dlrm data=synthetic_ctr`` (2 servers, 2 trainers, sync) with
``model.table_dtype`` float32, float16 and bfloat16 for each of ``--seeds`` seeds, and prints
per dtype the mean test AUC over the seeds, its spread (max - min) and the mean difference
from float32 (what ``model.table_dtype`` promises: within 0.001). Run:
``python -m benchmarks.half_rows_auc`` (9 runs of ``--steps`` steps; ~1 min each on 2 idle cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def test_auc(run_dir: Path, dtype: str, seed: int, steps: int, extra: list[str]) -> float:
    cmd = [
        sys.executable,
        "-m",
        "ps_train",
        "model=dlrm",
        "data=synthetic_ctr",
        f"seed={seed}",
        f"train.steps={steps}",
        "train.eval_every=0",
        "logging=quiet",
        f"model.table_dtype={dtype}",
        "model.lazy_rows=true",  # float32 too: the same storage, only the dtype differs
        f"hydra.run.dir={run_dir}",
        *extra,
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return float(json.loads((run_dir / "metrics.json").read_text())["test_auc"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=880, help="per trainer (880: one pass over the data)")
    p.add_argument("--dtypes", nargs="+", default=["float32", "float16", "bfloat16"])
    p.add_argument("overrides", nargs="*", help="more ps_train overrides, e.g. model.table_optim=rowwise_adagrad")
    args = p.parse_args()
    aucs: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as d:
        for seed in args.seeds:
            for dtype in args.dtypes:
                auc = test_auc(Path(d) / f"{dtype}_{seed}", dtype, seed, args.steps, args.overrides)
                aucs.setdefault(dtype, []).append(auc)
                print(f"seed {seed} {dtype}: test AUC {auc:.5f}", flush=True)
    base = aucs.get("float32")
    print("| table_dtype | mean test AUC | spread over seeds | mean - float32 |")
    print("|---|---|---|---|")
    for dtype, values in aucs.items():
        diff = statistics.mean(v - b for v, b in zip(values, base, strict=True)) if base else float("nan")
        print(f"| {dtype} | {statistics.mean(values):.5f} | {max(values) - min(values):.5f} | {diff:+.5f} |")


if __name__ == "__main__":
    main()
