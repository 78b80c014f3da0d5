"""Benchmark of ``python -m ps_train.prepare criteo``: lines/s and peak memory on generated files.

    python -m benchmarks.prepare_bench                    # 2M lines, plain and .gz
    python -m benchmarks.prepare_bench --lines 8000000 --repeat 3

Generates a file in the released Criteo format (label, 13 integers, 26 hex hashes, missing
rates close to the Kaggle file's) and its gzipped copy, then converts each with the command in
a child process. The table gives, per input, lines/s of the conversion (the manifest's
``seconds``) and of the whole command (imports included), CPU time per line (the figure the load
changes least), "cores busy" (CPU time over wall time: what it got of the machine), peak RSS,
and the load average before and after. Targets: >= 500,000 lines/s, peak RSS <= 2 GB.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import shutil
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from benchmarks._format import fmt
from benchmarks._results import add_result_option, run_recorded

# Missing-value rates per feature, roughly those of Kaggle's train.txt.
INT_MISSING = [0.45, 0.0, 0.22, 0.22, 0.03, 0.22, 0.04, 0.0, 0.04, 0.45, 0.04, 0.77, 0.22]
CAT_MISSING = [
    0.0,
    0.0,
    0.03,
    0.03,
    0.0,
    0.12,
    0.0,
    0.0,
    0.0,
    0.03,
    0.0,
    0.03,
    0.0,
    0.0,
    0.0,
    0.03,
    0.0,
    0.0,
    0.44,
    0.44,
    0.03,
    0.76,
    0.0,
    0.03,
    0.44,
    0.44,
]
_HEX = np.frombuffer(b"0123456789abcdef", np.uint8)
CHUNK = 250_000


def _chunk(rng: np.random.Generator, n: int) -> pa.Table:
    cols = [pa.array(rng.binomial(1, 0.25, n)).cast(pa.string())]
    for j, p in enumerate(INT_MISSING):
        v = np.floor(np.exp(rng.normal(1.5 + 0.3 * j, 1.6, n))).astype(np.int64)  # counts over decades
        if j == 1:
            v -= rng.binomial(1, 0.1, n) * 3  # I2 has small negatives
        cols.append(pa.array(v, mask=rng.random(n) < p).cast(pa.string()))
    for p in CAT_MISSING:
        v = rng.integers(0, 2**32, n, dtype=np.uint64)
        digits = _HEX[(v[:, None] >> np.arange(28, -1, -4, dtype=np.uint64)) & 15]  # [n, 8]
        cols.append(pa.array(digits.view("S8")[:, 0], mask=rng.random(n) < p).cast(pa.string()))
    return pa.table(cols, names=[f"f{j}" for j in range(40)])


def generate(path: str, lines: int, seed: int) -> None:
    """``lines`` seeded lines in the Criteo format at ``path`` (written beside, then renamed)."""
    rng = np.random.default_rng(seed)
    opts = pacsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
    tmp = path + ".tmp"
    with pa.OSFile(tmp, "wb") as sink:
        for start in range(0, lines, CHUNK):
            pacsv.write_csv(_chunk(rng, min(CHUNK, lines - start)), sink, opts)
    os.replace(tmp, path)


def gzip_file(src: str, dst: str) -> None:
    tmp = dst + ".tmp"
    with open(src, "rb") as f, gzip.open(tmp, "wb", compresslevel=6) as g:
        shutil.copyfileobj(f, g, 16 << 20)
    os.replace(tmp, dst)


def machine() -> dict[str, object]:
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_gib": round(mem, 1),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "pyarrow": pa.__version__,
        "os": platform.platform(),
    }


def run_prepare(src: str, dst: str, workers: int | None) -> dict[str, float]:
    cmd = [sys.executable, "-m", "ps_train.prepare", "criteo", src, dst, "--quiet", "--force"]
    if workers is not None:
        cmd += ["--workers", str(workers)]
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - t0
    err = child.stderr.read() if child.stderr else ""
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({child.returncode}):\n{err}")
    with open(os.path.join(dst, "manifest.json")) as f:
        manifest = json.load(f)
    lines = manifest["lines"]
    return {
        "lines": lines,
        "wall_s": wall,
        "convert_s": manifest["seconds"],
        "lines_per_s": lines / manifest["seconds"],
        "command_lines_per_s": lines / wall,
        "cpu_us_per_line": manifest["cpu_seconds"] / lines * 1e6,
        "command_cpu_us_per_line": (usage.ru_utime + usage.ru_stime) / lines * 1e6,
        "peak_rss_mb": usage.ru_maxrss / 1024,
        "load_before": load0,
        "load_after": os.getloadavg()[0],
        "input_mb": os.path.getsize(src) / 2**20,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lines", type=int, default=2_000_000, help="lines per generated file (~480 MB for 2M)")
    ap.add_argument("--seed", type=int, default=0, help="generator seed")
    ap.add_argument(
        "--work", default="/tmp/ps_train_prepare_bench", help="where inputs and outputs go (inputs are reused)"
    )
    ap.add_argument("--workers", type=int, default=None, help="prepare's workers (default: its own)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per input; the table shows the fastest")
    ap.add_argument("--only", choices=["plain", "gz"], help="one input only")
    ap.add_argument("--json", help="also write every run's figures as JSON")
    add_result_option(ap, "prepare_bench")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    plain = os.path.join(args.work, f"criteo_{args.lines}_{args.seed}.tsv")
    inputs = {"plain": plain, "gz": plain + ".gz"}
    if not os.path.exists(plain):
        t = time.perf_counter()
        generate(plain, args.lines, args.seed)
        print(f"generated {plain} ({os.path.getsize(plain) / 2**20:.0f} MiB) in {time.perf_counter() - t:.0f} s")
    if args.only != "plain" and not os.path.exists(inputs["gz"]):
        t = time.perf_counter()
        gzip_file(plain, inputs["gz"])
        print(
            f"compressed {inputs['gz']} ({os.path.getsize(inputs['gz']) / 2**20:.0f} MiB) "
            f"in {time.perf_counter() - t:.0f} s"
        )
    info = machine()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(
        f"machine: {info['cpu']}, {info['cores']} cores, {info['ram_gib']} GiB; python {info['python']}, "
        f"numpy {info['numpy']}, pyarrow {info['pyarrow']}; commit {commit or '?'}"
    )
    results: dict[str, list[dict[str, float]]] = {}
    for kind, src in inputs.items():
        if args.only and kind != args.only:
            continue
        dst = os.path.join(args.work, f"prepared_{kind}")
        results[kind] = [run_prepare(src, dst, args.workers) for _ in range(args.repeat)]
        shutil.rmtree(dst, ignore_errors=True)
    head = [
        "input",
        "lines",
        "MiB",
        "lines/s",
        "command lines/s",
        "CPU us/line",
        "cores busy",
        "peak RSS MB",
        "load before/after",
    ]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for kind, runs in results.items():
        r = max(runs, key=lambda x: x["lines_per_s"])
        print(
            f"| {kind} | {r['lines']:,} | {fmt(r['input_mb'])} | {fmt(r['lines_per_s'])} | "
            f"{fmt(r['command_lines_per_s'])} | {fmt(r['cpu_us_per_line'])} | "
            f"{r['cpu_us_per_line'] * r['lines_per_s'] / 1e6:.2f} | {fmt(r['peak_rss_mb'])} | "
            f"{r['load_before']:.1f} / {r['load_after']:.1f} |"
        )
    ok = all(max(r["lines_per_s"] for r in runs) >= 500_000 for runs in results.values())
    rss_ok = all(max(r["peak_rss_mb"] for r in runs) <= 2048 for runs in results.values())
    print(
        f"target conversion >= 500,000 lines/s: {'PASS' if ok else 'FAIL'}; "
        f"peak RSS <= 2 GB: {'PASS' if rss_ok else 'FAIL'}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "machine": info,
                    "commit": commit,
                    "lines": args.lines,
                    "seed": args.seed,
                    "workers": args.workers,
                    "runs": results,
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(run_recorded("prepare_bench", main))
