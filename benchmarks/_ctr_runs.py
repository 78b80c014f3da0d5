"""How ctr_bench runs each way: the overrides of each configuration, a ps_train run in its
own launcher (``run_ps_train``), and the one-process loop (plain torch or TorchRec) in a
child process (``run_single``, ``single_worker``). Every runner returns a dict with
``status`` ("ok", "error" with the reason, or "skipped") and ``samples_per_s``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout the workers run in


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
        from benchmarks._torchrec_dlrm import torchrec_missing

        missing = torchrec_missing()
        if missing:
            return {"status": "skipped", "skipped": missing, "samples_per_s": None}
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        cmd = [sys.executable, "-m", "benchmarks.ctr_bench", f"--{kind}-worker", name, str(steps), out.name]
        try:
            proc = subprocess.run(cmd, cwd=REPO, timeout=timeout, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
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
    t0, cpu0 = time.perf_counter(), time.process_time()
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
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    with open(out_path, "w") as f:
        json.dump(
            {
                "samples_per_s": samples / wall,
                "wall_time_s": wall,
                "cpu_time_s": cpu,  # the loop's process CPU (benchmarks.ctr_breakdown)
                "losses": losses,
                "peak_rss_bytes": rss,
            },
            f,
        )


# ---------------------------------------------------------------------------- the report
