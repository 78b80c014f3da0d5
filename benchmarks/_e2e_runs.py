"""How e2e_bench runs each way: the ps_train config every way trains (``make_config``), a
ps_train run in this process's launcher (``run_ps_train``) and the plain-torch loop in a
spawned child (``single_main``, ``run_single``). Every runner returns a dict with ``status``
("ok" or "error", with the reason) and ``samples_per_s``; none raises."""

from __future__ import annotations

import glob
import json
import multiprocessing as mp
import os
import queue as queue_mod
import sys
import tempfile
import time
import traceback
from typing import Any

MODELS = ("mlp", "cnn")
CLUSTERS = ((1, 1), (2, 2))  # (num_servers, num_trainers)
# What ps_train runs: (backend, cluster.update_in_backward). torch has no update in the backward.
VARIANTS = {"torch": ("torch", False), "rpc_core": ("rpc_core", False), "rpc_core_bw": ("rpc_core", True)}
BACKENDS = tuple(VARIANTS)
IMPLS = ("single",) + BACKENDS
LABELS = {
    "single": "single-process",
    "torch": "torch",
    "rpc_core": "rpc_core",
    "rpc_core_bw": "rpc_core, update in backward",
}
BATCH_SIZE = 32
STEPS = {"full": {"mlp": 2000, "cnn": 400}, "quick": {"mlp": 600, "cnn": 100}}

# (model, servers, trainers, ratio, threshold, strictly greater, label)
# Each is checked for both rpc_core variants (the update call and the update in the backward).
TARGETS = [
    ("mlp", 1, 1, "/torch", 3.0, False, "MLP 1+1 >= 3x the torch backend"),
    ("mlp", 1, 1, "/single", 0.6, False, "MLP 1+1 >= 0.6x single-process"),
    ("mlp", 2, 2, "/torch", 2.0, False, "MLP 2+2 >= 2x the torch backend"),
    ("cnn", 1, 1, "/single", 0.9, False, "CNN 1+1 >= 0.9x single-process"),
]


def make_config(
    model: str,
    servers: int,
    trainers: int,
    backend: str,
    steps: int,
    batch_size: int = BATCH_SIZE,
    mode: str = "sync",
    update_in_backward: bool = False,
    serializer: str = "pickle",
):
    """The validated ps_train ``Config`` every implementation trains (see module docstring)."""
    from ps_train.config import (
        CheckpointConfig,
        ClusterConfig,
        CNNConfig,
        Config,
        LoggingConfig,
        MLPConfig,
        ModeConfig,
        SyntheticConfig,
        TrainConfig,
        validate,
    )

    cfg = Config(
        experiment=f"e2e_{model}_{servers}x{trainers}",
        backend=backend,
        model=MLPConfig() if model == "mlp" else CNNConfig(),
        data=SyntheticConfig(shape=[1, 28, 28], num_classes=10),
        cluster=ClusterConfig(
            num_servers=servers,
            num_trainers=trainers,
            launcher="local",
            update_in_backward=update_in_backward,
            serializer=serializer,
        ),
        mode=ModeConfig(name=mode, staleness=2 if mode == "ssp" else 0),
        train=TrainConfig(steps=steps, epochs=None, batch_size=batch_size, eval_every=0, log_every=steps),
        checkpoint=CheckpointConfig(every=0),
        logging=LoggingConfig(tensorboard=False, progress=False, level="WARNING"),
    )
    return validate(cfg)


def _failure_reason(exc: BaseException, run_dir: str) -> str:
    """One line for the error note: the exception, plus the last line of any role's traceback."""
    first = (str(exc).strip().splitlines() or [""])[0]
    reason = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    details = []
    for path in sorted(glob.glob(os.path.join(run_dir, "logs", "*.log"))):
        try:
            with open(path, errors="replace") as f:
                lines = [ln.rstrip() for ln in f if ln.strip()]
        except OSError:
            continue
        if not any(ln.startswith("Traceback") for ln in lines):
            continue
        last = next((ln for ln in reversed(lines) if not ln.startswith(" ")), "")
        details.append(f"{os.path.basename(path)[:-4]}: {last.strip()}")
    if details:
        reason += " | " + "; ".join(details)
    return reason


def run_ps_train(
    model: str,
    servers: int,
    trainers: int,
    backend: str,
    steps: int,
    run_root: str,
    timeout: float,
    log,
    mode: str = "sync",
    update_in_backward: bool = False,
    serializer: str = "pickle",
) -> dict:
    """One ``ps_train.app.run``; returns ``{"status", "samples_per_s", ...}``, never raises."""
    res: dict[str, Any] = {"status": "ok", "samples_per_s": None, "error": None, "run_dir": None}
    t0 = time.monotonic()
    run_dir = tempfile.mkdtemp(prefix=f"{model}_{servers}x{trainers}_{backend}_", dir=run_root)
    res["run_dir"] = run_dir
    try:
        from ps_train import app

        cfg = make_config(
            model, servers, trainers, backend, steps, mode=mode, update_in_backward=update_in_backward,
            serializer=serializer,
        )  # fmt: skip
        # The roles inherit our stdout and print their "done" line there: send it to stderr
        # with the other progress messages, so stdout carries only the table.
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(2, 1)
        try:
            returned = app.run(cfg, run_dir, timeout=timeout)
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        path = os.path.join(run_dir, "metrics.json")
        if os.path.exists(path):
            with open(path) as f:
                metrics = json.load(f)
        else:
            raise RuntimeError(f"the run finished but wrote no {path} (returned {returned!r:.200})")
        res.update(
            samples_per_s=float(metrics["samples_per_s"]),
            wall_time_s=metrics.get("wall_time_s"),
            samples=metrics.get("samples"),
            steps=metrics.get("steps"),
            backend=metrics.get("backend"),
            losses=metrics.get("losses", {}).get("trainer0"),
            # rpc_core: requests each server served per trainer step (see "Messages")
            requests_per_step=[n / (steps * trainers) for n in metrics["server_requests"]]
            if "server_requests" in metrics
            else None,
        )
        if metrics.get("backend") not in (None, backend):
            raise RuntimeError(f"asked for backend={backend} but metrics.json says {metrics.get('backend')}")
        expected = steps * BATCH_SIZE * trainers
        if metrics.get("samples") != expected:
            raise RuntimeError(
                f"metrics.json counts {metrics.get('samples')} samples, expected "
                f"{steps} steps x {BATCH_SIZE} x {trainers} trainers = {expected}"
            )
    except Exception as e:  # noqa: BLE001 - a failing configuration must not stop the others
        res.update(status="error", error=_failure_reason(e, run_dir), samples_per_s=None)
        log(f"    error: {res['error']}")
    res["elapsed_s"] = time.monotonic() - t0
    return res


def single_main(model: str, steps: int, threads: int, out) -> None:
    """Child process: train the reference model with plain torch; put the result on ``out``."""
    try:
        import torch
        import torch.nn.functional as F

        torch.set_num_threads(threads)
        from ps_train.config import optimizer_spec
        from ps_train.workloads.vision.data import BatchIterator, load_data
        from ps_train.workloads.vision.models import build_stages, reference_model

        cfg = make_config(model, 1, 1, "rpc_core", steps)
        train_set, _ = load_data(cfg.data)
        net = reference_model(build_stages(cfg.model, cfg.data.sample_shape(), cfg.data.class_count(), seed=cfg.seed))
        net.train()
        cls, kwargs = optimizer_spec(cfg.optim)
        opt = cls(net.parameters(), **kwargs)
        batches = BatchIterator(train_set, 0, 1, cfg.train.batch_size, cfg.seed)
        losses = []
        samples = 0
        t_start = time.perf_counter()
        for _ in range(steps):
            x, y = next(batches)
            opt.zero_grad(set_to_none=True)
            logits = net(x)
            loss = F.cross_entropy(logits, y)
            loss.backward()
            opt.step()
            (logits.detach().argmax(1) == y).float().mean().item()  # as ps_train's trainer does
            losses.append(loss.item())
            samples += len(y)
        wall = time.perf_counter() - t_start
        out.put(
            (
                "ok",
                {
                    "samples_per_s": samples / wall,
                    "wall_time_s": wall,
                    "samples": samples,
                    "steps": steps,
                    "losses": losses,
                    "threads": torch.get_num_threads(),
                },
            )
        )
    except BaseException:  # noqa: BLE001 - reported by the parent
        out.put(("error", traceback.format_exc()))


def run_single(model: str, steps: int, threads: int, timeout: float, log) -> dict:
    res: dict[str, Any] = {"status": "ok", "samples_per_s": None, "error": None}
    t0 = time.monotonic()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=single_main, args=(model, steps, threads, q), name=f"e2e-single-{model}", daemon=True)
    p.start()
    msg = None
    deadline = t0 + timeout
    while msg is None:
        try:
            msg = q.get(timeout=0.2)
        except queue_mod.Empty:
            if not p.is_alive():
                try:
                    msg = q.get(timeout=1.0)
                except queue_mod.Empty:
                    msg = ("error", f"the single-process run died (exit code {p.exitcode}) without a result")
            elif time.monotonic() > deadline:
                msg = ("error", f"timeout after {timeout:.0f} s; process killed")
    if p.is_alive():
        p.join(5)
    if p.is_alive():
        p.kill()
        p.join(5)
    q.close()
    kind, payload = msg
    if kind == "ok":
        res.update(payload)
    else:
        lines = [ln for ln in str(payload).strip().splitlines() if ln.strip()]
        res.update(status="error", error=lines[-1].strip() if lines else "unknown error")
        log(f"    error: {payload}")
    res["elapsed_s"] = time.monotonic() - t0
    return res
