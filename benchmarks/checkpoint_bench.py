"""Checkpoints of embedding tables while training: what the steps lose while a full
checkpoint is written, how long each takes to become complete, and the disk's own bandwidth
measured in the same run (its floor).

    python -m benchmarks.checkpoint_bench                     # preset=dlrm_large, 200 steps, every 100
    python -m benchmarks.checkpoint_bench --shape medium      # 26 x 100,000 rows (1.3 GB with Adagrad)
    python -m benchmarks.checkpoint_bench --kinds none,fork,thread,differential --rounds 2

Sync runs of one job (2 servers + 2 trainers, Adagrad tables) one after another: ``none`` (no
checkpoints), ``fork`` (a forked child writes each full checkpoint, the default writer),
``thread`` (a thread of each server writes it), ``differential`` (the first full, then changed
rows). Step ends come from trainer0's TensorBoard events; a checkpoint is being written from
its manifest's ``created_unix`` until the manifest's mtime (its time to complete). Per run: the
steps that ended inside those windows against the same steps of ``none`` (``x none``), the
whole run's wall (loop plus the wait for the last checkpoint) against ``none``'s, samples/s,
``final_checkpoint_wait_s``, and per checkpoint its bytes, time to complete and fork time. The
disk: ``--disk-gb`` written with ``O_DIRECT`` and through the page cache, each then fsync'd.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._results import add_result_option, run_recorded

SHAPES = {
    "large": ["preset=dlrm_large"],
    "medium": ["preset=dlrm_large", "data.table_rows=100000"],
    "small": ["preset=dlrm_large", "data.table_rows=30000"],
}
KINDS = {
    "none": ["checkpoint.every=0"],
    "fork": ["checkpoint.writer=fork"],
    "thread": ["checkpoint.writer=thread"],
    "differential": ["checkpoint.differential=true", "checkpoint.full_every=1000"],
}
_FORKED = re.compile(r"\[(ps\d+)\].*a forked writer \(fork (\d+) ms\) wrote .* into (\S+) in ([\d.]+) s \((.+)\)")


def run(shape: str, kind: str, steps: int, every: int, run_dir: Path, timeout: float) -> float:
    """One run; its wall time as a user times the command."""
    overrides = [
        *SHAPES[shape],
        "mode=sync",
        "model.table_optim=adagrad",
        f"train.steps={steps}",
        "train.log_every=1",
        "logging.progress=false",
        "cluster.role_timeout=600",  # a shared machine under load starts processes slowly
        "checkpoint.final=false",
        "checkpoint.keep=0",
        f"checkpoint.every={every}",
        *KINDS[kind],
        f"hydra.run.dir={run_dir}",
    ]
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "ps_train", *overrides], check=True, timeout=timeout, stdout=subprocess.DEVNULL
    )
    wall = time.perf_counter() - t0
    print(f"  {kind}: {wall:.0f} s", file=sys.stderr)
    return wall


def disk_bandwidth(folder: Path, nbytes: int, direct: bool) -> float:
    """GB/s writing ``nbytes`` of random bytes into a new file in ``folder`` and fsyncing it,
    in 8 MiB writes (``direct``: with O_DIRECT, as the forked writer does)."""
    buf = mmap.mmap(-1, 8 << 20)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(len(buf)))
    path = folder / f".disk_bench_{os.getpid()}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (getattr(os, "O_DIRECT", 0) if direct else 0)
    fd = os.open(path, flags, 0o644)
    try:
        t0 = time.perf_counter()
        for _ in range(max(1, nbytes // len(buf))):
            os.write(fd, buf)
        os.fsync(fd)
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink()
        buf.close()
    return max(1, nbytes // (8 << 20)) * (8 << 20) / seconds / 1e9


def fork_probe(gb: float, threads: int = 32) -> dict[str, float]:
    """What the forked writer costs a server of ``gb`` GB with ``threads`` idle threads, in this
    process: the fork itself, and a write to one float of every 4 KB page of a quarter of the
    memory while a child holds it (each a copy-on-write fault) against the same writes with no
    child (no copy)."""
    import threading

    import torch

    rows = torch.ones(int(gb * 1e9) // 256, 64)  # [R, 64] float32, every page touched
    stop = threading.Event()
    pool = [threading.Thread(target=stop.wait, daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    page_rows = torch.arange(0, rows.shape[0] // 4, 16)  # 16 rows of 256 B: one per 4 KB page

    def touch() -> float:
        t0 = time.perf_counter()
        rows.index_add_(0, page_rows, torch.ones(len(page_rows), 64))
        return time.perf_counter() - t0

    plain = touch()
    held, release = os.pipe()
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os.close(release)
        os.read(held, 1)  # holds the image until the parent is done writing (as the writer does)
        os._exit(0)
    fork_s = time.perf_counter() - t0
    cow = touch()
    os.close(release)
    os.waitpid(pid, 0)
    os.close(held)
    stop.set()
    pages = len(page_rows)
    return {
        "gb": gb,
        "threads": threads,
        "fork_ms": fork_s * 1e3,
        "pages": pages,
        "plain_us_per_page": plain / pages * 1e6,
        "cow_us_per_page": cow / pages * 1e6,
    }


def step_ends(run_dir: Path) -> list[float]:
    """Wall time at the end of every step of trainer0 (step 1 first)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run_dir / "tb" / "trainer0"), size_guidance={"scalars": 0})
    ea.Reload()
    events = sorted(ea.Scalars("train/loss"), key=lambda e: e.step)
    return [e.wall_time for e in events]


def checkpoints(run_dir: Path) -> list[dict[str, Any]]:
    """Each checkpoint: step, when asked for and when complete, bytes, and its forked writers."""
    writers: dict[str, list[dict[str, Any]]] = {}
    for log in sorted((run_dir / "logs").glob("ps*.log")):
        for m in _FORKED.finditer(log.read_text()):
            entry = {"server": m[1], "fork_ms": int(m[2]), "write_s": float(m[4]), "io": m[5]}
            writers.setdefault(Path(m[3]).name, []).append(entry)
    out = []
    for ckpt in sorted((run_dir / "checkpoints").glob("step_*")):
        manifest = json.loads((ckpt / "manifest.json").read_text())
        start, end = manifest["created_unix"], (ckpt / "manifest.json").stat().st_mtime
        out.append(
            {
                "step": manifest["step"],
                "start": start,
                "end": end,
                "complete_s": end - start,
                "bytes": sum(f.stat().st_size for f in ckpt.iterdir()),
                "differential": bool(manifest.get("bases")),
                "writers": writers.get(ckpt.name, []),
            }
        )
    return out


def during(ends: list[float], windows: list[dict[str, Any]], warmup: int) -> list[int]:
    """The steps (1-based) after ``warmup`` that ended inside a window."""
    return [i + 1 for i in range(max(warmup, 1), len(ends)) if any(w["start"] <= ends[i] <= w["end"] for w in windows)]


def steps_time(ends: list[float], steps: list[int]) -> float:
    """The time steps ``steps`` (1-based, each after the first) took."""
    return sum(ends[s - 1] - ends[s - 2] for s in steps)


def analyse(rec: dict[str, Any], none: dict[str, Any], warmup: int) -> None:
    """Add to run record ``rec`` its steps inside checkpoint windows against the same steps
    of ``none`` (``x_none``) and against as many steps just before the first window in the
    same run (``x_before``: less sensitive to a load that drifts between runs)."""
    steps = during(rec["ends"], rec["checkpoints"], warmup)
    rec["steps_while_writing"] = steps
    rec["x_none"] = steps_time(none["ends"], steps) / steps_time(rec["ends"], steps) if steps else None
    before = list(range(max(warmup + 2, steps[0] - len(steps)), steps[0])) if steps else []
    rec["x_before"] = None
    if steps and before:  # seconds a step before the checkpoint over seconds a step during it
        ends = rec["ends"]
        rec["x_before"] = (steps_time(ends, before) / len(before)) / (steps_time(ends, steps) / len(steps))
    rec["run_x_none"] = rec["run_s"] / none["run_s"]


def _median(values: list[float | None]) -> float | None:
    known = sorted(v for v in values if v is not None)
    return known[len(known) // 2] if known else None


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="large")
    ap.add_argument("--kinds", default="none,fork,thread", help=f"comma-separated, from {list(KINDS)}")
    ap.add_argument("--rounds", type=int, default=1, help="the kinds one after another, this many times")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--disk-gb", type=float, default=1.0, help="bytes written to measure the disk")
    ap.add_argument("--fork-gb", type=float, default=2.6, help="memory of the fork probe (0: none)")
    ap.add_argument("--timeout", type=float, default=1500)
    ap.add_argument("--run-root", default=None)
    ap.add_argument(
        "--keep-runs", action="store_true", help="keep each run's folder (a large preset's checkpoints are ~5 GB each)"
    )
    ap.add_argument("--json", default=None)
    add_result_option(ap, "checkpoint_bench")
    args = ap.parse_args(argv)
    kinds = args.kinds.split(",")
    if "none" not in kinds or any(k not in KINDS for k in kinds):
        ap.error(f"--kinds: {args.kinds!r} must include none and name only {list(KINDS)}")
    root = Path(args.run_root or tempfile.mkdtemp(prefix="checkpoint_bench."))
    root.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    nbytes = int(args.disk_gb * 1e9)
    disk = {
        "direct": disk_bandwidth(root, nbytes, direct=True),
        "page_cache": disk_bandwidth(root, nbytes, direct=False),
    }
    probe = fork_probe(args.fork_gb) if args.fork_gb else None
    rounds: list[dict[str, dict[str, Any]]] = []
    for r in range(args.rounds):
        runs: dict[str, dict[str, Any]] = {}
        for kind in kinds:
            run_dir = root / f"{kind}.{r}"
            command_s = run(args.shape, kind, args.steps, args.every, run_dir, args.timeout)
            metrics = json.loads((run_dir / "metrics.json").read_text())
            runs[kind] = {
                "ends": step_ends(run_dir),
                "checkpoints": checkpoints(run_dir) if kind != "none" else [],
                "command_s": command_s,
                "samples_per_s": metrics["samples_per_s"],
                "final_checkpoint_wait_s": metrics.get("final_checkpoint_wait_s", 0.0),
                "run_s": metrics["wall_time_s"] + metrics.get("final_checkpoint_wait_s", 0.0),
            }
            if not args.keep_runs:
                # Everything the report needs is read: free the disk before the next run
                # (rounds x kinds x ~5 GB would otherwise fill it).
                shutil.rmtree(run_dir, ignore_errors=True)
        for rec in runs.values():
            analyse(rec, runs["none"], args.warmup)
        rounds.append(runs)
    load_after = os.getloadavg()
    print(
        f"shape {args.shape}, {args.steps} steps, a checkpoint every {args.every}, {args.rounds} round(s); "
        f"load {load[0]:.1f} -> {load_after[0]:.1f}; the disk: {disk['direct']:.2f} GB/s with O_DIRECT, "
        f"{disk['page_cache']:.2f} GB/s through the page cache (each {args.disk_gb:g} GB, then fsync)"
    )
    print()
    columns = ["run", "samples/s", "steps in windows", "x none (same steps)", "x before (same run)", "run s"]
    print("| " + " | ".join([*columns, "x none", "final wait s"]) + " |")
    print("|---|---|---|---|---|---|---|---|")
    for kind in kinds:
        recs = [rnd[kind] for rnd in rounds]
        cells = [
            _fmt(_median([r["samples_per_s"] for r in recs]), ",.0f"),
            str(len(recs[0]["steps_while_writing"])),
            _fmt(_median([r["x_none"] for r in recs])) if kind != "none" else "-",
            _fmt(_median([r["x_before"] for r in recs])) if kind != "none" else "-",
            _fmt(_median([r["run_s"] for r in recs]), ".1f"),
            _fmt(_median([r["run_x_none"] for r in recs])),
            _fmt(_median([r["final_checkpoint_wait_s"] for r in recs]), ".1f"),
        ]
        print(f"| {kind} | " + " | ".join(cells) + " |")
    print()
    print("| run | round | step | GB | complete s | disk floor s | fork ms | child write s | I/O |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r, rnd in enumerate(rounds):
        for kind in kinds:
            for c in rnd[kind]["checkpoints"]:
                w = c["writers"]
                fork_ms = max((x["fork_ms"] for x in w), default=None)
                write_s = max((x["write_s"] for x in w), default=None)
                io = w[0]["io"] if w else "thread (O_DIRECT where the file system takes it)"
                cells = [kind, str(r), str(c["step"]), f"{c['bytes'] / 1e9:.2f}", f"{c['complete_s']:.1f}"]
                cells += [f"{c['bytes'] / 1e9 / disk['direct']:.1f}", _fmt(fork_ms, ".0f"), _fmt(write_s, ".1f"), io]
                print("| " + " | ".join(cells) + " |")
    if probe is not None:
        print()
        print(
            f"fork probe: a {probe['gb']:g} GB process with {probe['threads']} threads forks in "
            f"{probe['fork_ms']:.0f} ms; "
            f"a first write to each of {probe['pages']:,} pages then takes {probe['cow_us_per_page']:.2f} us a page "
            f"(copy-on-write) against {probe['plain_us_per_page']:.2f} us with no child"
        )
    print()
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        out = {"shape": args.shape, "steps": args.steps, "every": args.every, "disk_gb_per_s": disk, "fork": probe}
        Path(args.json).write_text(json.dumps({**out, "load": [load, load_after], "rounds": rounds}, indent=2))
    if not args.run_root:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_recorded("checkpoint_bench", main))
