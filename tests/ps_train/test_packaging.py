"""A plain (non-editable) install works: build a wheel of this checkout, install it into a
fresh virtual environment and run ``python -m ps_train --cfg job`` from a directory that is
not the source tree, so the Hydra configs must come from inside the installed package.

Everything here works offline: the wheel is built with ``--no-build-isolation`` (setuptools
from this environment, which the ``test`` extra requires) and installed with ``--no-deps
--no-index``; torch, hydra, pip and the other dependencies come from this environment: the
running interpreter's site directories, added to the new environment by a ``.pth`` file. That
works whether the tests run on a system Python or inside a virtual environment (whose
packages ``--system-site-packages`` would not give: it gives the base interpreter's).
"""

import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.ps_train._app import finish_cli

REPO = Path(__file__).resolve().parents[2]
STEP_TIMEOUT = 60  # seconds for one subprocess; each takes a few seconds on 2 busy cores


def _run(cmd, cwd, env):
    return _finish(_start(cmd, cwd, env))


def _start(cmd, cwd, env):
    """``cmd`` started, not waited for (``_finish`` waits): commands that each import torch on
    one core run side by side."""
    cmd = [str(c) for c in cmd]
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc):
    done = finish_cli(proc, STEP_TIMEOUT)
    assert done.returncode == 0, f"{proc.args} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done


@pytest.mark.timeout(150)
def test_wheel_installs_into_a_fresh_venv_and_runs_from_another_directory(tmp_path):
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    # PYTHONPATH (e.g. pointing at this checkout) would shadow the installed copy.
    for var in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PS_TRAIN_FAULT"):
        env.pop(var, None)

    # Build from a copy of what the wheel is made of: pip builds in the source tree and would
    # leave build/ and *.egg-info behind in the checkout.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for pkg in ("rpc_core", "ps_train"):
        shutil.copytree(REPO / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path / "dist"
    building = _start(  # while the venv below is made
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            dist,
            src,
        ],
        cwd=tmp_path,
        env=env,
    )

    # A venv without pip of its own (no ensurepip needed) that sees this environment's
    # packages; `python -m pip` inside it is this environment's pip, installing into the venv.
    # The packages are wherever the running interpreter finds them: its site directories (a
    # virtual environment's own when the tests run in one; --system-site-packages would give
    # the base interpreter's instead, which may lack torch). A .pth file in the venv adds them
    # with site.addsitedir, which also runs their own .pth files, as this interpreter did.
    # They come after the venv's site-packages on sys.path, and the source checkout's
    # editable install (if any) is a meta-path finder placed after the normal path search, so
    # the venv's copy wins. -s keeps a user site (~/.local) out; cwd is outside the checkout.
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp_path, env=env)
    py = venv / "bin" / "python"
    site_dirs = [d for d in site.getsitepackages() if os.path.isdir(d)]
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        site_dirs.append(site.getusersitepackages())
    venv_site = Path(
        _run(
            [py, "-s", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=tmp_path, env=env
        ).stdout.strip()
    )
    assert venv_site.resolve().is_relative_to(venv.resolve()), venv_site
    # a .pth line that starts with "import" is run; one line, so its statements are joined by ";"
    (venv_site / "_test_environment.pth").write_text(
        "import site; " + "; ".join(f"site.addsitedir({d!r})" for d in site_dirs) + "\n"
    )
    try:
        _finish(building)
    finally:
        if building.poll() is None:
            building.kill()
            building.wait()
    wheels = list(dist.glob("*.whl"))
    assert len(wheels) == 1, wheels
    _run(
        [py, "-s", "-m", "pip", "install", "--no-deps", "--force-reinstall", "--no-index", "-q", wheels[0]],
        cwd=tmp_path,
        env=env,
    )

    work = tmp_path / "elsewhere"
    work.mkdir()
    imports = _start(
        [py, "-s", "-c", "import ps_train, rpc_core; print(ps_train.__file__); print(rpc_core.__file__)"],
        cwd=work,
        env=env,
    )
    composes = _start(
        [py, "-s", "-m", "ps_train", "--cfg", "job", "model=cnn", "cluster.num_servers=3"], cwd=work, env=env
    )
    # The plan reads the calibration shipped as package data (ps_train/scaling/calibration.json).
    plans = _start([py, "-s", "-m", "ps_train.plan", "model=cnn", "cluster.num_trainers=8"], cwd=work, env=env)
    try:
        r, job, plan = _finish(imports), _finish(composes), _finish(plans)
    finally:
        for proc in (imports, composes, plans):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for f in r.stdout.split():
        assert Path(f).resolve().is_relative_to(venv.resolve()), f"imported {f}, not the venv's copy"
    conf = (
        venv
        / "lib"
        / f"python{sys.version_info.major}.{sys.version_info.minor}"
        / "site-packages"
        / "ps_train"
        / "conf"
    )
    assert (conf / "config.yaml").is_file() and (conf / "model" / "mlp.yaml").is_file()

    cfg = yaml.safe_load(job.stdout)
    assert cfg["model"]["name"] == "cnn" and cfg["data"]["name"] == "digits"
    assert cfg["cluster"]["num_servers"] == 3 and cfg["cluster"]["launcher"] == "local"
    assert cfg["mode"]["name"] == "sync" and cfg["optim"]["name"] == "sgd"
    assert not (work / "runs").exists()
    assert "predicted samples/s:" in plan.stdout and "stated error:" in plan.stdout
