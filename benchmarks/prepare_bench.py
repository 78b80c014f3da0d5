"""Benchmark of ``python -m ps_train.prepare criteo`` as a user times it: lines/s of the whole
command on generated files, next to the machine's own floors measured in the same run.

    python -m benchmarks.prepare_bench                    # 1M lines, plain and .gz
    python -m benchmarks.prepare_bench --lines 8000000 --repeat 3

Generates a file in the released Criteo format (label, 13 integers, 26 hex hashes, missing
rates close to the Kaggle file's) and its gzipped copy (level 6, as the gzip command), then
converts each with ``python -m ps_train.prepare criteo SRC DST --quiet`` in a child process.
The table gives, per input: lines/s of the whole command (interpreter start and imports
included; the target: >= 500,000 on 2 cores, plain and .gz) and of that the time outside the
conversion ("start s"); the floor, lines/s of ``cat SRC`` (reading, from the page cache once
warm) or ``gzip -dc SRC.gz`` (the system's decompression, one core) to /dev/null, timed in the
same run on the same files; lines/s of the conversion alone (the manifest's ``seconds``); CPU
time per line (all threads; the figure the load changes least); "cores busy" (CPU time over
wall time: what it got of the machine); peak RSS (``ru_maxrss``; the target: <= 1 GB, not
growing with --lines); and the load average before and after. A last line gives
``python -m ps_train.prepare --help``'s time (the target: <= 0.5 s).
"""

from __future__ import annotations

import argparse
import gzip
import importlib.metadata
import json
import os
import platform
import resource
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


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


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
        "isal": _version("isal"),
        "os": platform.platform(),
    }


def timed(cmd: list[str], stdout: int | None = subprocess.DEVNULL) -> tuple[float, resource.struct_rusage, str]:
    """``(wall seconds, rusage, stderr)`` of one child process; raises if it fails."""
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - t0
    err = child.stderr.read() if child.stderr else ""
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({code}):\n{err}")
    return wall, usage, err


def floors(files: dict[str, str], lines: int, repeat: int) -> dict[str, float]:
    """Lines/s of the machine's own tools on the same files (the fastest of ``repeat`` runs),
    and the seconds ``python -m ps_train.prepare --help`` takes."""
    out: dict[str, float] = {}
    for kind, src in files.items():
        cmd = ["gzip", "-dc", src] if kind == "gz" else ["cat", src]
        out[f"{cmd[0]}_lines_per_s"] = lines / min(timed(cmd)[0] for _ in range(repeat))
    out["help_s"] = min(timed([sys.executable, "-m", "ps_train.prepare", "--help"])[0] for _ in range(3))
    return out


def run_prepare(src: str, dst: str, workers: int | None, gunzip: str) -> dict[str, float]:
    cmd = [sys.executable, "-m", "ps_train.prepare", "criteo", src, dst, "--quiet", "--force", "--gunzip", gunzip]
    if workers is not None:
        cmd += ["--workers", str(workers)]
    load0 = os.getloadavg()[0]
    wall, usage, _ = timed(cmd)
    with open(os.path.join(dst, "manifest.json")) as f:
        manifest = json.load(f)
    lines = manifest["lines"]
    return {
        "lines": lines,
        "wall_s": wall,
        "convert_s": manifest["seconds"],
        "start_s": wall - manifest["seconds"],  # interpreter, imports, arguments (and exit)
        "lines_per_s": lines / manifest["seconds"],
        "command_lines_per_s": lines / wall,
        "cpu_us_per_line": manifest["cpu_seconds"] / lines * 1e6,
        "command_cpu_us_per_line": (usage.ru_utime + usage.ru_stime) / lines * 1e6,
        "peak_rss_mb": usage.ru_maxrss / 1024,
        "load_before": load0,
        "load_after": os.getloadavg()[0],
        "input_mb": os.path.getsize(src) / 2**20,
    }


TARGET_LINES_PER_S = 500_000  # the whole command, plain and .gz, on 2 cores
TARGET_RSS_MB = 1024
TARGET_HELP_S = 0.5


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lines", type=int, default=1_000_000, help="lines per generated file (~250 MB for 1M)")
    ap.add_argument("--seed", type=int, default=0, help="generator seed")
    ap.add_argument(
        "--work", default="/tmp/ps_train_prepare_bench", help="where inputs and outputs go (inputs are reused)"
    )
    ap.add_argument("--workers", type=int, default=None, help="prepare's workers (default: its own)")
    ap.add_argument("--gunzip", choices=["auto", "isal", "zlib"], default="auto", help="prepare's inflater of .gz")
    ap.add_argument("--repeat", type=int, default=1, help="runs per input; the table shows the fastest")
    ap.add_argument("--only", choices=["plain", "gz"], help="one input only")
    ap.add_argument("--json", help="also write every run's figures as JSON")
    add_result_option(ap, "prepare_bench")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    plain = os.path.join(args.work, f"criteo_{args.lines}_{args.seed}.tsv")
    inputs = {"plain": plain, "gz": plain + ".gz"}
    if args.only:
        inputs = {args.only: inputs[args.only]}
    if not os.path.exists(plain):
        t = time.perf_counter()
        generate(plain, args.lines, args.seed)
        print(f"generated {plain} ({os.path.getsize(plain) / 2**20:.0f} MiB) in {time.perf_counter() - t:.0f} s")
    if "gz" in inputs and not os.path.exists(inputs["gz"]):
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
        f"numpy {info['numpy']}, pyarrow {info['pyarrow']}, isal {info['isal']}; commit {commit or '?'}"
    )
    floor = floors(inputs, args.lines, max(args.repeat, 2))  # the first cat also warms the page cache
    results: dict[str, list[dict[str, float]]] = {}
    for kind, src in inputs.items():
        dst = os.path.join(args.work, f"prepared_{kind}")
        results[kind] = [run_prepare(src, dst, args.workers, args.gunzip) for _ in range(args.repeat)]
        shutil.rmtree(dst, ignore_errors=True)
    head = [
        "input",
        "lines",
        "MiB",
        "command lines/s",
        "start s",
        "floor lines/s",
        "conversion lines/s",
        "CPU us/line",
        "cores busy",
        "peak RSS MB",
        "load before/after",
    ]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for kind, runs in results.items():
        r = max(runs, key=lambda x: x["command_lines_per_s"])
        tool = "gzip -dc" if kind == "gz" else "cat"
        print(
            f"| {kind} | {r['lines']:,} | {fmt(r['input_mb'])} | {fmt(r['command_lines_per_s'])} | "
            f"{r['start_s']:.2f} | {fmt(floor[tool.split()[0] + '_lines_per_s'])} ({tool}) | {fmt(r['lines_per_s'])} | "
            f"{fmt(r['cpu_us_per_line'])} | {r['cpu_us_per_line'] * r['lines_per_s'] / 1e6:.2f} | "
            f"{fmt(r['peak_rss_mb'])} | {r['load_before']:.1f} / {r['load_after']:.1f} |"
        )
    ok = all(max(r["command_lines_per_s"] for r in runs) >= TARGET_LINES_PER_S for runs in results.values())
    rss_ok = all(max(r["peak_rss_mb"] for r in runs) <= TARGET_RSS_MB for runs in results.values())
    help_ok = floor["help_s"] <= TARGET_HELP_S
    print(
        f"python -m ps_train.prepare --help: {floor['help_s']:.2f} s; "
        f"targets: command >= {TARGET_LINES_PER_S:,} lines/s: {'PASS' if ok else 'FAIL'}; "
        f"peak RSS <= {TARGET_RSS_MB} MB: {'PASS' if rss_ok else 'FAIL'}; "
        f"--help <= {TARGET_HELP_S} s: {'PASS' if help_ok else 'FAIL'}"
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
                    "gunzip": args.gunzip,
                    "floors": floor,
                    "runs": results,
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(run_recorded("prepare_bench", main))
