"""Helpers for the end-to-end ps_train tests: configs composed the way ``python -m ps_train``
composes them, runs with a hard time limit, and readers for what a run leaves behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import ps_train
import ps_train.config  # noqa: F401  (registers the schemas)
from ps_train.app import run
from ps_train.checkpoint.files import latest_checkpoint, load_checkpoint, read_manifest
from ps_train.checkpoint.protocol import load_resume_state
from ps_train.checkpoint.rows_file import load_rows
from ps_train.config import Config, from_dictconfig
from ps_train.faults import FAULT_ENV

CONF = Path(ps_train.__file__).resolve().parent / "conf"  # shipped inside the package
RUN_TIMEOUT = 60.0  # seconds for one small run; the launcher raises RoleFailed after it
CLI_TIMEOUT = 90.0

# Small and quiet: every step logged (so TensorBoard has each tag), no periodic evaluation,
# no progress lines.
QUICK = ["train.eval_every=0", "train.log_every=1", "logging.progress=false"]

# The uninterrupted sync run (conftest's ``sync_baseline``) other runs are compared with.
BASELINE_STEPS = 8
BASELINE = (
    "mode=sync",
    "model=mlp",
    "data=digits",
    "cluster.num_servers=2",
    "cluster.num_trainers=2",
    f"train.steps={BASELINE_STEPS}",
    "checkpoint.every=4",
    "checkpoint.keep=0",
)


def make_cfg(*overrides: str) -> Config:
    """The validated Config that ``python -m ps_train <overrides>`` would run."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        dcfg = compose("config", overrides=[*QUICK, *overrides])
    return from_dictconfig(dcfg)


def run_app(run_dir: Path, *overrides: str, timeout: float = RUN_TIMEOUT) -> dict[str, Any]:
    metrics = run(make_cfg(*overrides), str(run_dir), overrides=list(overrides), timeout=timeout)
    assert metrics is not None  # a local run returns trainer0's metrics (None is for env-launched roles)
    return metrics


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def final_weights(run_dir: Path) -> dict[tuple[str, int, str], torch.Tensor]:
    """Every tensor of the run's latest checkpoint: ``(server, shard index, state key)``."""
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None, f"{run_dir} has no complete checkpoint"
    return checkpoint_weights(ckpt)


def checkpoint_weights(ckpt: Path) -> dict[tuple[str, int, str], torch.Tensor]:
    """Every tensor of checkpoint ``ckpt``, keyed like ``final_weights``."""
    _, states = load_checkpoint(ckpt)
    return {
        (server, int(shard), key): t
        for server, state in states.items()
        for shard, sd in state["shards"].items()
        for key, t in sd.items()
    }


def saved_tables(run_dir: Path, ckpt: Path | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """Every server's table columns (``weight`` and the optimizer's per-row state) in
    checkpoint ``ckpt`` (default: the run's latest), restored from its chain of rows files
    as a resuming server would."""
    ckpt = ckpt or latest_checkpoint(run_dir)
    assert ckpt is not None, f"{run_dir} has no complete checkpoint"
    servers = [f.name for f in read_manifest(ckpt).shards]
    out = {}
    for server in servers:
        state = load_resume_state(str(ckpt), server)["servers"][server]
        out[server] = load_rows(state["tables"]["rows_files"])
    return out


def assert_same_weights(a: dict[Any, torch.Tensor], b: dict[Any, torch.Tensor], exact: bool = True) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), f"{k} differs: max |diff| {(a[k] - b[k]).abs().max().item()}"
        else:
            torch.testing.assert_close(a[k], b[k], msg=_prefixed(k))


def scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """All scalar events under one TensorBoard run folder: tag -> [(step, value)]."""
    ea = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def hparams_plugin(tb_dir: Path) -> dict[str, bytes]:
    ea = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    return ea.PluginTagToContent("hparams")


def cli(
    *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = CLI_TIMEOUT
) -> subprocess.CompletedProcess:
    """``python -m ps_train <args>`` in ``cwd`` (so default run folders land there)."""
    return finish_cli(start_cli(*args, cwd=cwd, env=env), timeout)


def start_cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """``cli`` started, not waited for: several commands, each an interpreter importing torch
    on one core, run side by side (``finish_cli`` waits for each)."""
    full_env = dict(os.environ, **(env or {}))
    full_env.pop(FAULT_ENV, None)
    return subprocess.Popen(
        [sys.executable, "-m", "ps_train", *args],
        cwd=cwd,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish_cli(proc: subprocess.Popen[str], timeout: float = CLI_TIMEOUT) -> subprocess.CompletedProcess:
    """What ``start_cli``'s command printed and returned, once it exited (killed after ``timeout`` s)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def finish_clis(
    procs: dict[str, subprocess.Popen[str]], timeout: float = CLI_TIMEOUT
) -> dict[str, subprocess.CompletedProcess]:
    """``finish_cli`` for each of ``procs``, all of them killed if one fails or times out."""
    try:
        return {name: finish_cli(p, timeout) for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def rendezvous_port(run_dir: Path, role: str = "ps0") -> int:
    """The port a role's log says it joined at (``... rendezvous at tcp://host:port``)."""
    for line in (Path(run_dir) / "logs" / f"{role}.log").read_text().splitlines():
        if "rendezvous at tcp://" in line:
            return int(line.split("rendezvous at tcp://", 1)[1].split(",")[0].rsplit(":", 1)[1])
    raise AssertionError(f"{role}.log in {run_dir} names no rendezvous address")


def _prefixed(key: str) -> Callable[[str], str]:
    """assert_close's message, named by the state-dict key that differs."""
    return lambda message: f"{key}: {message}"
