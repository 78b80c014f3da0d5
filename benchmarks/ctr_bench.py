"""DLRM benchmark: ps_train's row-sharded tables on rpc_core vs backend=torch vs one process
(plain torch, and TorchRec's DLRM when torchrec is installed).

Usage (from the repo root)::

    python benchmarks/ctr_bench.py --quick          # everything once, few steps (~4-6 min)
    python benchmarks/ctr_bench.py --rounds 2 --json benchmarks/results/ctr.json
    python benchmarks/ctr_bench.py --tables         # the tables alone (benchmarks/_table_step.py)
    python benchmarks/ctr_bench.py --tables --tables-bag 20

Options:
    --quick               fewer steps (small 150, large 40 instead of 600 and 200)
    --only small|large|multihot
                          run one configuration
    --rounds N            run everything N times, reversing the order in every other round
                          (single, torchrec, torch, rpc_core, ... then ..., rpc_core, torch,
                          torchrec, single);
                          the table shows the median per cell
    --json PATH           also write every figure, per round, with the machine and settings
    --timeout SECONDS     hard limit per run (default 900, quick 600)
    --run-root DIR        where run folders go (default: a temporary folder, deleted at the
                          end unless a run failed or --keep-runs)
    --update-in-backward null|true|false
                          ``cluster.update_in_backward`` of the rpc_core runs (default null:
                          ps_train's default, on in sync mode); compare ``true`` with
                          ``false`` in two invocations (each has its own single-process
                          baseline)
    --tables              instead of the runs: the tables' lookup + backward + update alone,
                          side by side in one invocation (one-process nn.EmbeddingBag, FBGEMM's
                          CPU TBE with fused row-wise Adagrad when fbgemm_gpu imports, ps_train
                          before and after fused storage, 1+1 and 2+2), against this run's
                          memcpy floor (``_table_step.py`` says what each measures)
    --tables-bag N        ids per bag for --tables (default 1: one-hot)
    --table-steps N       timed steps per --tables variant (default 30, quick 12)

Configurations (``model=dlrm``, ``data=synthetic_ctr``, ``mode=sync``, ``seed=0``):

- small: the defaults of ``model=dlrm`` (8 tables x 1,000 rows, dim 16, batch 256, Adagrad
  tables, SGD MLPs), as 1 server + 1 trainer and 2 + 2. Fits anywhere.
- large: ``preset=dlrm_large`` (26 tables x 384,616 rows, dim 64: 2.56 GB of rows, batch
  512), 2 servers + 2 trainers. The single process holds all 2.56 GB of rows plus as much
  Adagrad state (~5.5 GB resident; fine on a 24 GiB machine).
- multihot: 8 tables x 100,000 rows, dim 32, bags of 20 ids (``data.bag_sizes=[20]``), batch
  256, 2 servers + 2 trainers: the servers pool their rows of each bag (``ps_train.workloads.ctr.tables.plan``).

Every run: ``train.eval_every=0``, ``checkpoint.every=0``, ``checkpoint.final=false`` (the
large run's final checkpoint writes 5 GB inside trainer0's timed loop), no TensorBoard, one
status line at the end (``train.log_every`` = steps).

What is measured:

- samples/s. ps_train: all trainers' samples (``metrics.json``) over the training loop of the
  trainer that started it last (``trainer_wall_time_s``; clock started before the first
  batch, after process start, ``init_rpc``, building tables and loading data; stopped after
  the last update). In sync mode every step needs every trainer, so that loop spans all the
  training, while an earlier trainer's loop also holds its wait for the others' start-up
  (seconds on a loaded machine): ``metrics.json``'s ``samples_per_s`` divides by the longest
  loop, and is kept in --json as ``metrics_samples_per_s``.
  Single process: ``ps_train.workloads.ctr.model.DLRM`` (``nn.EmbeddingBag(sparse=True)`` tables with the
  same initial rows and MLPs), the same optimizers (``optim`` on the MLPs,
  ``model.table_optim`` on the tables), trainer0's batches of a one-trainer run, one
  intra-op thread (what each ps_train process gets), timed the same way. It has no servers
  or trainers, so a 2+2 row compares the 2 trainers' total with the one process. Sync mode
  with one trainer computes the same thing as the single process: the 1+1 row prints the
  largest per-step loss difference (float32 rounding of summed row gradients, ~1e-6).
  TorchRec: ``torchrec.models.dlrm.DLRM`` with the same shapes, its tables fused with
  ``model.table_optim`` (FBGEMM's CPU kernels), the same batches as KeyedJaggedTensors, one
  thread (``benchmarks/_torchrec_dlrm.py``); "skipped", with the reason, without torchrec.
- bytes per step: ``server_bytes_per_step`` of ``metrics.json`` (each server's bytes sent
  plus received per trainer step, from rpc_core's connection counters, start-up included),
  against the ideal of ``_ctr_traffic.py`` (formula in its docstring) computed from the
  exact batches every trainer took (the data loader replayed; its distinct rows per step
  must equal the run's ``rows_pulled_per_step``, else the table says so). backend=torch
  records no bytes (TensorPipe exposes no byte counters): n/a.
- peak RSS per role (``peak_rss_bytes`` of ``metrics.json``) for the large configuration.

Targets (PASS/FAIL under the tables): bytes per step within 1.25x of the ideal on every
server (rpc_core; multihot: within 1.1x of the pooled ideal); large: rpc_core >= 2x
backend=torch samples/s, every trainer's peak RSS < 1.5 GB; small 1 + 1: rpc_core >= 0.8x
single-process samples/s.

The cores may be shared: compare ratios from one invocation. A failed run shows "error" and
its reason under the table; the others go on; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for _p in (REPO, HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from _ctr_report import render  # noqa: E402 (the benchmarks folder is on the path just above)
from _ctr_traffic import replay_ideal_bytes  # noqa: E402

COMMON = [
    "mode=sync",
    "seed=0",
    "train.eval_every=0",
    "checkpoint.every=0",
    "checkpoint.final=false",
    "logging.tensorboard=false",
    "logging.progress=false",
    "logging.level=WARNING",
]
# name -> (overrides, (servers, trainers) clusters, steps {full, quick})
CONFIGS: dict[str, tuple[list[str], list[tuple[int, int]], dict[str, int]]] = {
    "small": (["model=dlrm", "data=synthetic_ctr"], [(1, 1), (2, 2)], {"full": 600, "quick": 150}),
    # Servers build their 1.28 GB of rows before init_rpc; the trainers' rendezvous waits for
    # them within cluster.init_timeout (300 s by default).
    "large": (["preset=dlrm_large"], [(2, 2)], {"full": 200, "quick": 40}),
    "multihot": (
        [
            "model=dlrm",
            "data=synthetic_ctr",
            "data.bag_sizes=[20]",
            "data.table_rows=100000",
            "data.num_samples=120000",
            "model.embedding_dim=32",
        ],
        [(2, 2)],
        {"full": 200, "quick": 40},
    ),
}
BACKENDS = ("torch", "rpc_core")


def overrides_for(
    name: str, servers: int, trainers: int, backend: str, steps: int, in_backward: str = "null"
) -> list[str]:
    base, _, _ = CONFIGS[name]
    # torch has no update in the backward: its runs always send the update call.
    extra = [f"cluster.update_in_backward={in_backward}"] if in_backward != "null" and backend == "rpc_core" else []
    return [
        *extra,
        *base,
        *COMMON,
        f"cluster.num_servers={servers}",
        f"cluster.num_trainers={trainers}",
        f"backend={backend}",
        f"train.steps={steps}",
        f"train.log_every={steps}",
    ]


def compose(overrides: list[str]) -> Any:
    """The validated ``Config`` that ``python -m ps_train <overrides>`` runs."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import ps_train
    from ps_train.config import from_dictconfig

    conf = os.path.join(os.path.dirname(os.path.abspath(ps_train.__file__)), "conf")
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        return from_dictconfig(hydra_compose("config", overrides=overrides))


# --------------------------------------------------------------------------------- runs


def _failure(exc: BaseException, run_dir: str) -> str:
    """One line: the exception, plus the last line of any role log that holds a traceback."""
    reason = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
    logs = os.path.join(run_dir, "logs")
    for name in sorted(os.listdir(logs)) if os.path.isdir(logs) else []:
        with open(os.path.join(logs, name), errors="replace") as f:
            lines = [ln.rstrip() for ln in f if ln.strip()]
        if any(ln.startswith("Traceback") for ln in lines):
            last = next((ln for ln in reversed(lines) if not ln.startswith(" ")), "")
            reason += f" | {name[:-4]}: {last.strip()}"
    return reason


def run_ps_train(overrides: list[str], run_dir: str, timeout: float) -> dict[str, Any]:
    """One ``ps_train.app.run``; its metrics.json figures, or ``status="error"``. Never raises.

    A run that fails after trainer0 wrote metrics.json (backend=torch's shutdown has reset
    its connections now and then) keeps its figures, with the failure as a warning."""
    res: dict[str, Any] = {"status": "ok", "run_dir": run_dir}
    try:
        from ps_train import app

        cfg = compose(overrides)
        # The roles print their "done" line on our stdout: keep stdout for the table.
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(2, 1)
        try:
            app.run(cfg, run_dir, overrides=overrides, timeout=timeout)
        except Exception as e:  # noqa: BLE001 - judged below by whether the figures exist
            res["warning"] = _failure(e, run_dir)
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        path = os.path.join(run_dir, "metrics.json")
        if not os.path.exists(path):
            raise RuntimeError(res.pop("warning", f"the run wrote no {path}"))
        with open(path) as f:
            m = json.load(f)
        expected = cfg.train.steps * cfg.train.batch_size * cfg.cluster.num_trainers
        if m.get("samples") != expected or m.get("backend") != cfg.backend:
            raise RuntimeError(
                f"metrics.json: {m.get('samples')} samples on backend {m.get('backend')}, expected "
                f"{expected} on {cfg.backend}"
            )
        # Sync mode: every step needs every trainer, so the trainer whose loop started last
        # times all the training without waiting for another's start-up; the others' loops
        # may include that wait (metrics.json's samples_per_s uses the longest loop).
        loop = min(m["trainer_wall_time_s"].values())
        res.update(
            samples_per_s=m["samples"] / loop,
            loop_time_s=loop,
            metrics_samples_per_s=m["samples_per_s"],
            wall_time_s=m["wall_time_s"],
            losses=m["losses"]["trainer0"],
            peak_rss_bytes=m["peak_rss_bytes"],
            rows_pulled_per_step=m["rows_pulled_per_step"],
            server_bytes_per_step=m.get("server_bytes_per_step"),
        )
    except Exception as e:  # noqa: BLE001 - one failing run must not stop the others
        res.update(
            status="error", error=str(e) if isinstance(e, RuntimeError) else _failure(e, run_dir), samples_per_s=None
        )
    return res


def run_single(name: str, steps: int, timeout: float, kind: str = "single") -> dict[str, Any]:
    """A single-process loop (``kind``: ``single``, plain torch, or ``torchrec``) in a child
    process (its memory is returned when it exits); ``status="skipped"`` without torchrec."""
    if kind == "torchrec":
        from _torchrec_dlrm import torchrec_missing

        missing = torchrec_missing()
        if missing:
            return {"status": "skipped", "skipped": missing, "samples_per_s": None}
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        cmd = [sys.executable, os.path.abspath(__file__), f"--{kind}-worker", name, str(steps), out.name]
        try:
            proc = subprocess.run(cmd, timeout=timeout, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
        except subprocess.TimeoutExpired:
            return {"status": "error", "error": f"timeout after {timeout:.0f} s; killed", "samples_per_s": None}
        if proc.returncode != 0:
            lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
            return {
                "status": "error",
                "samples_per_s": None,
                "error": f"exit code {proc.returncode}: {lines[-1] if lines else 'no output'}",
            }
        return {"status": "ok", **json.load(out)}


def single_worker(name: str, steps: int, out_path: str) -> None:
    """Child process: train ``ps_train.workloads.ctr.model.DLRM`` in plain torch; write the figures to ``out_path``."""
    import resource
    import warnings

    import torch
    import torch.nn.functional as F

    from ps_train.config import optimizer_spec
    from ps_train.workloads.ctr.data.batches import CtrBatchIterator
    from ps_train.workloads.ctr.data.loading import load_ctr_data
    from ps_train.workloads.ctr.model import DLRM
    from ps_train.workloads.ctr.tables.optimizers import (
        TORCH_TABLE_OPTIMIZERS,
        make_table_optimizer,
        table_optimizer_spec,
    )

    torch.set_num_threads(1)  # as in every ps_train process
    # Adagrad on sparse gradients warns that it does not re-check their indices (see table_server).
    warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")
    cfg = compose(overrides_for(name, 1, 1, "rpc_core", steps))
    data, m = cfg.data, cfg.model
    train = load_ctr_data(data).train
    model = DLRM(
        data.dense_count(),
        data.sizes(),
        m.embedding_dim,
        m.bottom_mlp,
        m.top_mlp,
        cfg.seed,
        m.pooling_list(len(data.sizes())),
    )
    cls, kwargs = optimizer_spec(cfg.optim)
    dense_opt = cls([*model.bottom.parameters(), *model.top.parameters()], **kwargs)
    # torch's own sparse optimizer as the reference; row-wise Adagrad (not in torch) as ps_train runs it
    table_opt: Any = (
        make_table_optimizer(m.table_optim, model.table_weights(), cfg.optim, m.table_lr)
        if m.table_optim not in TORCH_TABLE_OPTIMIZERS
        else None
    )
    if table_opt is None:
        tcls, tkwargs = table_optimizer_spec(m.table_optim, cfg.optim, m.table_lr)
        table_opt = tcls(model.table_weights(), **tkwargs)
    batches = CtrBatchIterator(train, 0, 1, cfg.train.batch_size, cfg.seed)
    losses: list[float] = []
    samples = 0
    t0 = time.perf_counter()
    for _ in range(steps):
        dense, ids, labels = next(batches)  # [B, num_dense], [B, T] or Bags, [B]
        dense_opt.zero_grad(set_to_none=True)
        for w in model.table_weights():
            w.grad = None
        logit = model(dense, ids)  # [B]
        loss = F.binary_cross_entropy_with_logits(logit, labels)
        loss.backward()
        dense_opt.step()
        if isinstance(table_opt, torch.optim.Optimizer):
            table_opt.step()
        else:
            table_opt.step([w.grad for w in model.table_weights()])
        ((logit.detach() > 0) == (labels > 0.5)).float().mean().item()  # as ps_train's trainer does
        losses.append(loss.item())
        samples += len(labels)
    wall = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    with open(out_path, "w") as f:
        json.dump({"samples_per_s": samples / wall, "wall_time_s": wall, "losses": losses, "peak_rss_bytes": rss}, f)


# ---------------------------------------------------------------------------- the report


def run_tables(args: argparse.Namespace) -> int:
    """``--tables``: every ``_table_step`` variant in a child process, one after another,
    then the table of figures against the memcpy floor measured here."""
    import statistics

    from _floor import _memcpy_gbs
    from _table_step import VARIANTS, fbgemm_missing, render_tables

    steps = args.table_steps or (12 if args.quick else 30)
    timeout = args.timeout or 1800.0
    info = {
        **machine(),
        "loadavg_start": os.getloadavg()[0],
        "steps": steps,
        "bag": args.tables_bag,
        "command": " ".join(["python", os.path.relpath(__file__, REPO), *sys.argv[1:]]),
        "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    memcpy = [statistics.median(_memcpy_gbs())]
    results: dict[str, dict[str, Any]] = {}
    for v in VARIANTS:
        if v == "fbgemm" and fbgemm_missing():
            results[v] = {"skipped": fbgemm_missing()}
            continue
        print(f"[tables] {v}, {steps} steps", file=sys.stderr, flush=True)
        with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--table-worker",
                v,
                str(steps),
                str(args.tables_bag),
                out.name,
            ]
            try:
                proc = subprocess.run(cmd, timeout=timeout, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
            except subprocess.TimeoutExpired:
                results[v] = {"error": f"timeout after {timeout:.0f} s"}
                continue
            if proc.returncode != 0:
                last = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
                results[v] = {"error": f"exit code {proc.returncode}: {last[-1] if last else 'no output'}"}
                continue
            results[v] = json.load(out)
        memcpy.append(statistics.median(_memcpy_gbs()))  # the floor between variants: the load drifts
    info["loadavg_end"] = os.getloadavg()[0]
    text, doc = render_tables(results, statistics.median(memcpy), args.tables_bag)
    print(
        f"{info['cpu']}, {info['cores']} cores, load average {info['loadavg_start']:.1f} -> "
        f"{info['loadavg_end']:.1f}; memcpy GB/s over the run: {', '.join(f'{m:.2f}' for m in memcpy)}"
    )
    print(text)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({**doc, "info": info, "memcpy_samples": memcpy}, f, indent=2)
    return 1 if any("error" in r for r in results.values()) else 0


def machine() -> dict[str, Any]:
    import torch

    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=5
            ).stdout.strip()
            or None
        )
        if (
            commit
            and subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
        ):
            commit += " (with uncommitted changes)"
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "commit": commit,
        "memory_gib": _mem_gib(),
    }


def _mem_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(ln.split()[1]) for ln in f if ln.startswith("MemTotal"))
        return round(kib / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="DLRM: ps_train on rpc_core vs backend=torch vs one process",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("Configurations")[0] if __doc__ else None,
    )
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=tuple(CONFIGS), default=None)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", default=None, metavar="PATH")
    ap.add_argument("--timeout", type=float, default=None)
    ap.add_argument("--run-root", default=None, metavar="DIR")
    ap.add_argument("--keep-runs", action="store_true")
    ap.add_argument("--update-in-backward", choices=("null", "true", "false"), default="null")
    ap.add_argument("--tables", action="store_true")
    ap.add_argument("--tables-bag", type=int, default=1)
    ap.add_argument("--table-steps", type=int, default=None)
    ap.add_argument("--single-worker", nargs=3, metavar=("CONFIG", "STEPS", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--torchrec-worker", nargs=3, metavar=("CONFIG", "STEPS", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--table-worker", nargs=4, metavar=("VARIANT", "STEPS", "BAG", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.table_worker:
        from _table_step import worker

        variant, steps_, bag, out = args.table_worker
        worker(variant, int(steps_), int(bag), out)
        return 0
    if args.tables:
        return run_tables(args)
    if args.single_worker:
        name, steps, out = args.single_worker
        single_worker(name, int(steps), out)
        return 0
    if args.torchrec_worker:
        from _torchrec_dlrm import worker as torchrec_worker

        name, steps, out = args.torchrec_worker
        torchrec_worker(compose(overrides_for(name, 1, 1, "rpc_core", int(steps))), int(steps), out)
        return 0
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    os.environ.pop("PS_TRAIN_FAULT", None)  # test-only fault injection: never in a benchmark
    names = [args.only] if args.only else list(CONFIGS)
    steps = {n: CONFIGS[n][2]["quick" if args.quick else "full"] for n in names}
    timeout = args.timeout or (600.0 if args.quick else 900.0)
    run_root = tempfile.mkdtemp(prefix="ctr_bench_", dir=args.run_root)
    info = {
        **machine(),
        "loadavg_start": os.getloadavg()[0],
        "rounds": args.rounds,
        "update_in_backward": args.update_in_backward,
        "quick": args.quick,
        "steps": steps,
        "command": " ".join(["python", os.path.relpath(__file__, REPO), *(argv or sys.argv[1:])]),
        "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    log(f"{info['cpu']}, {info['cores']} cores, kernel {info['kernel']}, torch {info['torch']}; runs in {run_root}")

    # The ideal bytes depend only on the batches: replayed once per configuration and cluster.
    ideal = {}
    for n in names:
        for s, t in CONFIGS[n][1]:
            ideal[(n, s, t)] = replay_ideal_bytes(compose(overrides_for(n, s, t, "rpc_core", steps[n])), steps[n])
    raw: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    jobs: list[tuple[Any, ...]] = []
    for n in names:
        jobs += [(n, "single"), (n, "torchrec")]
        jobs += [(n, s, t, b) for s, t in CONFIGS[n][1] for b in BACKENDS]
    failed, kept = False, []
    for rnd in range(args.rounds):
        for job in jobs if rnd % 2 == 0 else jobs[::-1]:  # slow drift in load favours no side
            n = job[0]
            log(f"[round {rnd + 1}/{args.rounds}] {' '.join(map(str, job))}, {steps[n]} steps")
            if job[1] in ("single", "torchrec"):
                res = run_single(n, steps[n], timeout, job[1])
            else:
                _, s, t, b = job
                run_dir = tempfile.mkdtemp(prefix=f"{n}_{s}x{t}_{b}_", dir=run_root)
                res = run_ps_train(
                    overrides_for(n, s, t, b, steps[n], in_backward=args.update_in_backward), run_dir, timeout
                )
                if res["status"] != "ok" or args.keep_runs:
                    kept.append(run_dir)
                else:
                    shutil.rmtree(run_dir, ignore_errors=True)
            failed |= res["status"] == "error"
            log(
                f"    {res['samples_per_s']:,.0f} samples/s"
                if res["samples_per_s"]
                else f"    {res.get('error') or res.get('skipped')}"
            )
            raw.setdefault(job, []).append(res)
    if not kept:
        shutil.rmtree(run_root, ignore_errors=True)
    else:
        log(f"kept run folders: {', '.join(kept)}")
    info["loadavg_end"] = os.getloadavg()[0]
    text, doc = render(names, CONFIGS, BACKENDS, raw, ideal, info)
    print(text)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(
                {
                    **doc,
                    "info": info,
                    "runs": {
                        " ".join(map(str, k)): [{x: y for x, y in r.items() if x != "losses"} for r in v]
                        for k, v in raw.items()
                    },
                },
                f,
                indent=2,
            )
        log(f"wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
