"""The launcher's fork server (``ps_train.launch.fork_server``): each role is a fresh copy of
the fork server, whatever the roles before it did; a role's exit code (or the signal that
killed it) reaches the launcher; a role whose launcher is gone exits."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
from functools import partial
from typing import Any

import pytest

from ps_train.launch.fork_server import ForkServer, ForkServerError

# What a role may change: the next role must still see these values.
SETTINGS: dict[str, Any] = {"lr": 0.1}


def _role(fd: int, action: str) -> None:
    """Write what this process sees to ``fd``, then change it (as a role could, by mistake)."""
    os.write(fd, f"{SETTINGS['lr']} {os.environ.get('FORK_TEST_VAR', '-')}\n".encode())
    SETTINGS["lr"] = 99.0
    os.environ["FORK_TEST_VAR"] = "changed"
    if action == "exit3":
        sys.exit(3)
    if action == "raise":
        raise RuntimeError("the role's own error")
    if action == "abort":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(0)


@pytest.fixture
def served():
    """A pipe the roles report on (created first: roles inherit what the launcher had when it
    started the fork server), and the fork server; its read end and the server."""
    r, w = os.pipe()
    fork_server = ForkServer(["json"], partial(_role, w))
    yield r, fork_server
    fork_server.close()
    os.close(r)
    os.close(w)


def _read_line(fd: int) -> str:
    out = b""
    while not out.endswith(b"\n"):
        out += os.read(fd, 100)
    return out.decode().strip()


@pytest.mark.timeout(30)
def test_a_role_that_changes_a_global_does_not_affect_the_next_role(served):
    r, server = served
    for name in ("trainer0", "trainer1"):
        p = server.start("ok", name)
        assert _read_line(r) == "0.1 -", name  # as the launcher had it, not as trainer0 left it
        p.join(20)
        assert p.exitcode == 0
    assert SETTINGS["lr"] == 0.1  # and the launcher's own copy is untouched


@pytest.mark.timeout(60)
def test_many_roles_at_once_each_a_fresh_copy_with_its_own_name_and_exit_code(served):
    # Enough at once that several forkers share them out (fork_server._TREE_FROM): each role
    # still gets its own name, a fresh copy, and its exit code or signal reaches the launcher.
    r, server = served
    actions = ["exit3" if i % 5 == 1 else "abort" if i % 7 == 2 else "ok" for i in range(24)]
    procs = server.start_all([(a, f"role{i}") for i, a in enumerate(actions)])
    assert [p.name for p in procs] == [f"role{i}" for i in range(24)]
    assert len({p.pid for p in procs}) == 24
    out = b""
    while out.count(b"\n") < 24:  # the roles write at once: one read may hold several lines
        out += os.read(r, 4096)
    assert out.decode().split("\n")[:-1] == ["0.1 -"] * 24
    for p, action in zip(procs, actions, strict=True):
        p.join(30)
        assert p.exitcode == {"exit3": 3, "abort": -signal.SIGKILL, "ok": 0}[action], p.name
    again = server.start("ok", "after")  # the helper still forks, as itself
    assert _read_line(r) == "0.1 -"
    again.join(20)
    assert again.exitcode == 0


def _prepare() -> None:
    SETTINGS["prepared"] = os.getpid()  # in the fork server, before any role


@pytest.mark.timeout(30)
def test_what_the_fork_server_prepared_is_in_every_role_and_not_in_the_launcher():
    r, w = os.pipe()
    server = ForkServer([], partial(_role_prepared, w), _prepare)
    try:
        seen = []
        for name in ("trainer0", "trainer1"):
            p = server.start("ok", name)
            seen.append(_read_line(r))
            p.join(20)
            assert p.exitcode == 0
        assert seen[0] == seen[1] == str(server.pid)  # prepared once, by the fork server, before both
        assert "prepared" not in SETTINGS
    finally:
        server.close()
        os.close(r)
        os.close(w)


def _role_prepared(fd: int, action: str) -> None:
    os.write(fd, f"{SETTINGS.get('prepared', '-')}\n".encode())
    os._exit(0)


@pytest.mark.timeout(30)
def test_exit_codes_and_signals_reach_the_launcher(served):
    _, server = served
    procs = {action: server.start(action, f"role-{action}") for action in ("exit3", "raise", "abort", "ok")}
    for p in procs.values():
        p.join(20)
        assert not p.is_alive()
    assert procs["exit3"].exitcode == 3
    assert procs["raise"].exitcode == 1
    assert procs["abort"].exitcode == -signal.SIGKILL
    assert procs["ok"].exitcode == 0
    assert procs["abort"].name == "role-abort"


@pytest.mark.timeout(30)
def test_a_module_that_cannot_be_preloaded_is_named():
    fork_server = ForkServer(["no_such_module_for_the_fork_server"], partial(_role, 1))
    try:
        with pytest.raises(ForkServerError, match="no_such_module_for_the_fork_server"):
            fork_server.start("ok", "ps0")
    finally:
        fork_server.close()


LAUNCHER = textwrap.dedent(
    """
    import os, sys, time
    from ps_train.launch.fork_server import ForkServer

    def role(_):
        time.sleep(600)  # until its launcher is gone

    server = ForkServer([], role)
    p = server.start(None, "trainer0")
    print(p.pid, flush=True)
    os.kill(os.getpid(), 9)  # the launcher dies without stopping anyone
    """
)


@pytest.mark.timeout(60)
def test_a_role_exits_when_its_launcher_dies():
    out = subprocess.run([sys.executable, "-c", LAUNCHER], capture_output=True, text=True, timeout=50)
    pid = int(out.stdout.split()[0])
    # The role's watcher exits it as soon as the launcher's end of its pipe closes: wait for
    # its exit (a pidfd is readable once the process has ended).
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # gone already
    try:
        assert select.select([pidfd], [], [], 40)[0], f"role {pid} still runs after its launcher died"
    finally:
        os.close(pidfd)


@pytest.mark.timeout(150)
def test_python_m_ps_train_forks_its_roles_from_the_fork_server(tmp_path):
    # numpy's OpenBLAS starts a thread pool when torch imports numpy; a launcher with threads
    # falls back to multiprocessing's forkserver, so ``python -m ps_train`` must keep that pool
    # from starting. The fork server's preload is then a phase of its own in metrics.json.
    from tests.ps_train._app import QUICK, read_json

    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    run_dir = tmp_path / "run"
    args = ["data=synthetic", "train.steps=3", "checkpoint.every=0", "cluster.num_servers=1"]
    args += ["cluster.num_trainers=1", *QUICK, f"hydra.run.dir={run_dir}"]
    done = subprocess.run(
        [sys.executable, "-m", "ps_train", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=140
    )
    assert done.returncode == 0, done.stderr
    assert "forkserver" not in done.stdout + done.stderr
    phases = {p["name"]: p for p in read_json(run_dir / "metrics.json")["phases"]["phases"]}
    assert phases["preload"]["wall_s"] > 0 and phases["preload"]["cpu_s"] > 0, phases
