"""docs/extending.md, done as it says: its toy workload module saved on PYTHONPATH, named in
PS_TRAIN_PLUGINS, and its command run; the workload trains (the test MSE falls well below
that of the untrained model) without a line of ps_train changed."""

import json
import os
import re
import shlex
from pathlib import Path

import pytest

from tests.ps_train._app import finish_cli, start_cli

DOC = Path(__file__).resolve().parents[2] / "docs" / "extending.md"
TIMEOUT = 240


def _blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_toy_workload_is_under_100_lines():
    (module,) = _blocks("python")
    assert len(module.strip().splitlines()) < 100


@pytest.mark.timeout(TIMEOUT)
def test_the_toy_workload_trains_as_the_guide_says(tmp_path):
    (module,) = _blocks("python")
    (tmp_path / "toy_workload.py").write_text(module)
    (command,) = _blocks("bash")
    words = shlex.split(command.replace("\\\n", " "))
    env_words = [w for w in words if re.fullmatch(r"[A-Z_]+=.*", w)]
    args = words[len(env_words) + 3 :]  # after: ENV=... python -m ps_train
    assert words[len(env_words) : len(env_words) + 3] == ["python", "-m", "ps_train"]
    env = dict(w.split("=", 1) for w in env_words)
    assert env == {"PS_TRAIN_PLUGINS": "toy_workload"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    # The command as written, in a folder of its own, plus what keeps the test short and its output where we look.
    extra = ["train.eval_every=0", "checkpoint.every=0", f"hydra.run.dir={tmp_path / 'run'}"]
    r = finish_cli(start_cli(*args, *extra, cwd=tmp_path, env=env), timeout=TIMEOUT - 20)
    assert r.returncode == 0, r.stdout + r.stderr
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["steps"] == 200
    # The untrained two-stage MLP's MSE on this target is of order 0.1-1; a trained one far less.
    assert metrics["test_mse"] < 0.02, metrics
    assert "test mse" in r.stdout + r.stderr
