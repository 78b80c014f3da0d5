"""What the user sees when a run fails: its first cause once, without a traceback, and what
the other roles did because of it (the tracebacks are in logs/<role>.log)."""

import re

import pytest

from ps_train.launch.failures import MAX_ERROR_BYTES, FailedRole, RoleError, failure_report, first_cause
from rpc_core.errors import RpcError, WorkerUnavailableError
from tests.ps_train._app import finish_clis, start_cli
from tests.ps_train.test_prechecks import criteo_day

HINT = "no checkpoint was written yet; the run has to start over"


def failed(role, rank, error=None, peer=None, how="exit code 1"):
    return FailedRole(role, rank, how, None if error is None else RoleError(role, error, peer))


def test_the_first_cause_is_the_role_that_blames_no_other():
    # The launcher saw ps1 fail first; its error is about trainer15, whose own error blames nobody.
    too_few = "ValueError: train.batch_size=32: each of the 64 trainers gets only 22 of 1437 training samples"
    seen = [
        failed("ps1", 1, "RpcError: graceful shutdown of 'ps1' failed: worker 'trainer15' left", "trainer15"),
        failed("ps2", 2, "WorkerUnavailableError: worker 'trainer15' closed the connection", "trainer15"),
        failed("trainer15", 18, too_few),
        failed("trainer3", 6, too_few),
        failed("trainer4", 7, "KeyError: 'x'"),
    ]
    assert first_cause(seen).role == "trainer15"
    report = failure_report(
        seen, ["ps0", "ps1", "ps2", "trainer0", "trainer3", "trainer4", "trainer15"], "/runs/r", HINT, None
    )
    assert str(report).split("\n  ") == [
        f"trainer15 (rank 18, exit code 1; log: /runs/r/logs/trainer15.log) failed: {too_few}",
        "trainer3 failed the same way",
        "trainer4 also failed: KeyError: 'x'",
        "ps0, ps1, ps2 and trainer0 stopped because trainer15 failed",
        HINT,
    ]
    assert (report.role, report.reason, report.checkpoint) == ("trainer15", too_few, None)


def test_a_long_list_of_roles_is_counted_not_named():
    seen = [failed(f"trainer{k}", 3 + k, "ValueError: too few samples") for k in range(64)]
    everyone = ["ps0", "ps1", "ps2"] + [f"trainer{k}" for k in range(64)]
    assert str(failure_report(seen, everyone, "/r", HINT, None)).split("\n  ")[1:] == [
        "trainer1, trainer2, trainer3, trainer4, trainer5 and 58 others failed the same way",
        "ps0, ps1 and ps2 stopped because trainer0 failed",
        HINT,
    ]


def test_a_killed_role_is_the_cause_its_peers_report():
    seen = [
        failed("trainer0", 2, "WorkerUnavailableError: worker 'ps1' closed the connection", "ps1"),
        failed("ps1", 1, how="killed by signal SIGKILL"),
    ]
    assert first_cause(seen).role == "ps1"
    report = failure_report(seen, ["ps0", "ps1", "trainer0", "trainer1"], "/r", "the latest ...", "/r/ckpt")
    assert str(report).split("\n  ") == [
        "ps1 (rank 1, killed by signal SIGKILL; log: /r/logs/ps1.log) failed",
        "ps0, trainer0 and trainer1 stopped because ps1 failed",
        "the latest ...",
    ]
    assert (report.role, report.reason, report.checkpoint) == ("ps1", "killed by signal SIGKILL", "/r/ckpt")


def test_when_every_failed_role_blames_another_the_cause_is_the_end_of_the_chain():
    seen = [failed("trainer0", 2, "E: ps1", "ps1"), failed("ps1", 1, "E: trainer1", "trainer1")]
    assert first_cause(seen).role == "ps1"  # trainer1 still runs: ps1 is the last one known to have failed
    cycle = [failed("ps0", 0, "E: ps1", "ps1"), failed("ps1", 1, "E: ps0", "ps0")]
    assert first_cause(cycle).role == "ps0"


def test_a_role_error_names_the_peer_rpc_core_blames_and_stays_small():
    gone = WorkerUnavailableError("worker 'ps1' (rank 1) closed the connection", worker="ps1")
    try:
        try:
            raise gone
        except WorkerUnavailableError as e:
            raise RpcError("graceful shutdown of 'ps0' failed") from e
    except RpcError as e:
        shutdown = e
    assert RoleError.of("ps0", shutdown) == RoleError("ps0", "RpcError: graceful shutdown of 'ps0' failed", "ps1")
    assert RoleError.of("ps1", gone).peer is None  # about itself: it blames nobody
    long = RoleError.of("trainer0", ValueError("x" * 10_000))
    assert len(long.error) == MAX_ERROR_BYTES and long.error.endswith("...") and long.peer is None
    wide = RoleError.of("trainer0", ValueError("\u00e9" * 10_000))  # 2 bytes each in UTF-8
    assert len(wide.error.encode()) <= MAX_ERROR_BYTES and wide.error.endswith("\u00e9...")


def criteo_run(tmp_path, *extra):
    """A two-trainer DLRM run on Criteo files whose line 1200 of day_1 is malformed: past the
    lines the launcher checks, so the trainers find it. Started, not waited for."""
    root = tmp_path / "criteo"
    criteo_day(root / "day_0", 1100)
    criteo_day(root / "day_1", 1300, bad_line=1200, seed=1)
    return start_cli(
        "model=dlrm",
        "data=criteo",
        f"data.root={root}",
        "data.table_rows=50",
        "train.steps=3",
        "train.batch_size=8",
        "cluster.num_trainers=2",
        "cluster.num_servers=2",
        "hydra.run.dir=run",
        *extra,
        cwd=tmp_path,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both runs of the tests below at once (each starts an interpreter and 4 roles, most of
    it importing torch on one core), each in a fresh folder: name -> (folder, the bad file,
    completed process)."""
    folders = {name: tmp_path_factory.mktemp(name) for name in ("fails", "skips")}
    procs = {"fails": criteo_run(folders["fails"]), "skips": criteo_run(folders["skips"], "data.skip_malformed=true")}
    # The runs take seconds; starting 4 roles each on a busy machine, up to a minute or two.
    done = finish_clis(procs, timeout=200)
    return {name: (folders[name], folders[name] / "criteo" / "day_1", r) for name, r in done.items()}


@pytest.mark.timeout(300)
def test_a_malformed_line_the_trainers_find_is_one_error_and_a_summary_without_tracebacks(runs):
    tmp_path, bad, r = runs["fails"]
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stdout + r.stderr
    where = f"{bad}, line 1200: categorical feature C7 (field 21) is '68fd1eXY', not a hex string"
    assert (r.stdout + r.stderr).count(where) == 1, r.stdout + r.stderr
    lines = r.stderr.strip().split("\n")
    m = re.fullmatch(
        r"error: (trainer[01]) \(rank [23], exit code 1; log: \S+/run/logs/(trainer[01])\.log\) "
        r"failed: CriteoFormatError: (.*)",
        lines[0],
    )
    assert m and m.group(1) == m.group(2) and m.group(3).startswith(where), lines[0]
    cause, other = m.group(1), {"trainer0": "trainer1", "trainer1": "trainer0"}[m.group(1)]
    # The other trainer read the same file: it failed the same way, or the launcher stopped it first.
    assert lines[1:] in (
        [f"  {other} failed the same way", f"  ps0 and ps1 stopped because {cause} failed", f"  {HINT}"],
        [f"  ps0, ps1 and {other} stopped because {cause} failed", f"  {HINT}"],
    ), lines
    log = (tmp_path / "run" / "logs" / f"{cause}.log").read_text()
    assert "Traceback (most recent call last)" in log and where in log


@pytest.mark.timeout(300)
def test_skipped_malformed_lines_are_counted_on_the_console_once(runs):
    _, bad, r = runs["skips"]
    assert r.returncode == 0, r.stderr[-3000:]
    [line] = [x for x in r.stdout.splitlines() if "malformed of" in x]
    assert line == (
        f"[trainer0] data=criteo: skipped 1 malformed of 2400 lines (day_1: 1); first: {bad}, line 1200: "
        "categorical feature C7 (field 21) is '68fd1eXY', not a hex string"
    )
    assert "malformed of" not in r.stderr
