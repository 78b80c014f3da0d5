"""Chaos: a job trained while its servers and trainers are killed at random, against the same
job uninterrupted.

    python -m benchmarks.chaos_bench [--minutes 3] [--mtbf 45] [--mode async|ssp|sync]
                                     [--model mlp|dlrm] [--trainers 3] [--seed 0]

Calibrates the steps per trainer that take about ``--minutes``, runs that job fault-free, then
again while ``ps_train/chaos.py``'s killer SIGKILLs a random role every Exp(``--mtbf``) seconds
(a server with probability ``--server-share``). async/ssp jobs are elastic; every mode restarts
from its latest checkpoint (``cluster.max_restarts``). The table gives, for both jobs: failures,
restarts, replacements, the time lost per failure, the final accuracy (AUC with ``--model
dlrm``), and what was lost (checkpoints that do not load, updates missing or applied twice).
Exit 1 if a check fails: the chaos job exits 0; sync: the final weights equal the reference's;
async/ssp: accuracy within 1 point (AUC 0.01); every complete checkpoint loads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._results import add_result_option, run_recorded
from ps_train.chaos import SERVERS, checkpoint_problems, job_config, lost_updates, metric, run_job, run_with_killer


def same_final_weights(a: Path, b: Path) -> bool:
    import torch

    from ps_train.checkpoint.files import latest_checkpoint, load_checkpoint

    ca, cb = latest_checkpoint(a), latest_checkpoint(b)
    if ca is None or cb is None:
        return False
    _, sa = load_checkpoint(ca)
    _, sb = load_checkpoint(cb)
    flat = [
        {(srv, shard, k): t for srv, st in s.items() for shard, sd in st["shards"].items() for k, t in sd.items()}
        for s in (sa, sb)
    ]
    return flat[0].keys() == flat[1].keys() and all(torch.equal(flat[0][k], flat[1][k]) for k in flat[0])


def chaos_report(
    args: argparse.Namespace, steps: int, ref_dir: Path, ref: Any, chaos_dir: Path, chaos: Any, kills: list[Any]
) -> tuple[list[tuple[str, str, str]], list[str], dict[str, Any]]:
    """The summary rows, the problems found, and the same as JSON."""
    m, rm = chaos.metrics, ref.metrics
    problems = [] if chaos.returncode == 0 else [f"the chaos job exited {chaos.returncode}: {chaos.tail}"]
    acc, ref_acc = metric(m, "test_accuracy"), metric(rm, "test_accuracy")
    auc, ref_auc = metric(m, "test_auc"), metric(rm, "test_auc")
    bad, interrupted = checkpoint_problems(chaos_dir, steps)
    problems += bad
    lost: dict[str, Any]
    if args.mode == "sync":
        same = same_final_weights(chaos_dir, ref_dir)
        lost = {"final weights equal the reference's": same}
        if not same:
            problems.append("the final weights differ from the uninterrupted run's")
    else:
        lost = {"updates (missing, twice) per server, last attempt": lost_updates(m, args.trainers, steps)}
        if args.model == "dlrm" and not abs(auc - ref_auc) <= 0.01:
            problems.append(f"test AUC {auc:.4f} is not within 0.01 of the fault-free {ref_auc:.4f}")
        if args.model != "dlrm" and not abs(acc - ref_acc) <= 0.01:
            problems.append(f"test accuracy {acc:.4f} is not within 1 point of the fault-free {ref_acc:.4f}")
    servers = sum(k.role.startswith("ps") for k in kills)
    restarts, replacements = m.get("restarts", []), m.get("replacements", [])
    lost_s = (chaos.wall_s - ref.wall_s) / len(kills) if kills else 0.0
    rows = [
        ("steps per trainer", f"{steps}", ""),
        ("wall time (s)", f"{ref.wall_s:.1f}", f"{chaos.wall_s:.1f}"),
        ("test accuracy", f"{ref_acc:.4f}", f"{acc:.4f}"),
    ]
    if args.model == "dlrm":
        rows.append(("test AUC", f"{ref_auc:.4f}", f"{auc:.4f}"))
    rows += [
        ("failures injected (servers / trainers)", "0 / 0", f"{servers} / {len(kills) - servers}"),
        # Not 0 in the fault-free run if the machine is so busy that a role starts or beats too late.
        ("run restarts (from a checkpoint)", f"{len(rm.get('restarts', []))}", f"{len(restarts)}"),
        ("trainer replacements", f"{len(rm.get('replacements', []))}", f"{len(replacements)}"),
        ("time lost per failure (s)", "", f"{lost_s:.1f}"),
        (
            "complete / interrupted checkpoints",
            "",
            f"{len(list((chaos_dir / 'checkpoints').glob('step_*'))) - len(interrupted)} / {len(interrupted)}",
        ),
    ]
    for name, value in lost.items():
        rows.append((name, "", json.dumps(value)))
    summary = {
        "steps": steps,
        "mode": args.mode,
        "model": args.model,
        "mtbf_s": args.mtbf,
        "seed": args.seed,
        "reference": {"wall_s": ref.wall_s, "test_accuracy": ref_acc, "test_auc": ref_auc},
        "chaos": {"wall_s": chaos.wall_s, "test_accuracy": acc, "test_auc": auc, "returncode": chaos.returncode},
        "kills": [vars(k) for k in kills],
        "restarts": restarts,
        "replacements": replacements,
        "time_lost_per_failure_s": lost_s,
        "interrupted_checkpoints": interrupted,
        "lost": lost,
        "problems": problems,
    }
    return rows, problems, summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=3.0, help="about how long the fault-free job trains")
    ap.add_argument("--mtbf", type=float, default=45.0, help="mean seconds between failures (exponential gaps)")
    ap.add_argument("--server-share", type=float, default=0.3, help="probability that a failure hits a server")
    ap.add_argument("--mode", choices=["async", "ssp", "sync"], default="async")
    ap.add_argument("--model", choices=["mlp", "dlrm"], default="mlp")
    ap.add_argument("--trainers", type=int, default=3)
    ap.add_argument("--max-restarts", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0, help="seeds the failure times and victims")
    ap.add_argument("--out", type=Path, default=Path("runs/chaos"), help="run folders go here")
    ap.add_argument("--json", type=Path, help="also write the summary here")
    add_result_option(ap, "chaos_bench")
    args = ap.parse_args(argv)
    out = (args.out / time.strftime("%Y-%m-%d_%H-%M-%S")).resolve()
    limit = max(600.0, 4 * 60 * args.minutes)  # start-up alone takes minutes on a crowded machine
    config = job_config(args.mode, args.model, args.trainers, args.max_restarts)
    print(f"load average at the start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)

    cal_steps = 100 if args.model == "dlrm" else 200
    cal = run_job(out / "calibrate", [*config, f"train.steps={cal_steps}"], limit)
    if cal.returncode != 0:
        print(f"calibration run failed ({cal.returncode}):\n{cal.tail}")
        return 1
    step_s = cal.metrics["wall_time_s"] / cal_steps
    steps = max(100, int(60 * args.minutes / step_s) // 100 * 100)
    common = [*config, f"train.steps={steps}", f"checkpoint.every={max(1, steps // 10)}"]
    print(f"{steps} steps per trainer (~{step_s * 1e3:.1f} ms a step) in {out}", flush=True)

    print("fault-free run ...", flush=True)
    ref = run_job(out / "reference", common, limit)
    if ref.returncode != 0:
        print(f"the fault-free run failed ({ref.returncode}):\n{ref.tail}")
        return 1
    print(f"chaos run (a failure every {args.mtbf:g} s on average) ...", flush=True)
    chaos_dir = out / "chaos"
    killer = {
        "servers": SERVERS,
        "trainers": args.trainers,
        "mtbf": args.mtbf,
        "seed": args.seed,
        "server_share": args.server_share,
    }
    chaos, kills = run_with_killer(chaos_dir, common, 2 * limit, killer)

    rows, problems, summary = chaos_report(args, steps, out / "reference", ref, chaos_dir, chaos, kills)
    summary["load_average_end"] = os.getloadavg()
    print(f"\n| {'':50} | {'fault-free':>10} | {'chaos':>14} |\n|{'-' * 52}|{'-' * 12}|{'-' * 16}|")
    for name, a, b in rows:
        print(f"| {name:50} | {a:>10} | {b:>14} |")
    for r in chaos.metrics.get("restarts", []):
        print(f"restart: {r['role']} ({r['reason']}), resumed after step {r['from_step']}")
    for r in chaos.metrics.get("replacements", []):
        print(f"replacement: {r['role']} ({r['reason']}), attempt {r['attempt']}")
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    print("\n" + ("OK: nothing lost" if not problems else "FAILED:\n  - " + "\n  - ".join(problems)))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(run_recorded("chaos_bench", main))
