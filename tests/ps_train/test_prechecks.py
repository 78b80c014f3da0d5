"""What the launcher checks of the data before any role starts: a mistake there is one
traceback-free error (exit 2), before a single process is started."""

from pathlib import Path

import numpy as np
import pytest

from ps_train.config import ConfigError, CriteoConfig, DigitsConfig, SyntheticConfig, SyntheticCtrConfig
from ps_train.launch.prechecks import DataCheckError, check_data
from ps_train.workloads.ctr.data.criteo import CHECKED_LINES, check_criteo_files
from ps_train.workloads.ctr.data.loading import load_ctr_data
from ps_train.workloads.vision.data import load_data
from tests.ps_train._app import finish_clis, make_cfg, start_cli
from tests.ps_train.test_cli import assert_nothing_started


def criteo_day(path: Path, n: int, bad_line: int | None = None, seed: int = 0) -> Path:
    """``n`` lines in Criteo's format; line ``bad_line`` (1-based) has a non-hex C7."""
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(n):
        ints = [str(int(v)) for v in rng.integers(0, 100, 13)]
        cats = [f"{int(v):08x}" for v in rng.integers(0, 2**32, 26)]
        if i + 1 == bad_line:
            cats[6] = "68fd1eXY"
        lines.append("\t".join([str(int(rng.integers(2))), *ints, *cats]) + "\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(lines))
    return path


@pytest.mark.parametrize("data", [DigitsConfig(), DigitsConfig(test_fraction=0.33), SyntheticConfig(train_size=777)])
def test_the_config_knows_the_training_samples_load_data_gives(data):
    train, _ = load_data(data)
    assert data.train_samples() == len(train)


@pytest.mark.parametrize("n, fraction", [(1001, 0.1), (1000, 0.25), (37, 0.5)])
def test_the_config_knows_the_training_samples_of_synthetic_ctr(n, fraction):
    data = SyntheticCtrConfig(num_samples=n, test_fraction=fraction, num_tables=2, table_rows=10)
    assert data.train_samples() == len(load_ctr_data(data).train)
    assert CriteoConfig().train_samples() is None  # only the files know


def test_too_many_trainers_for_the_batch_size_is_a_config_error_naming_the_fix():
    with pytest.raises(
        ConfigError,
        match=r"train\.batch_size=32: 64 trainers get only 22 of 1437 training samples "
        r"each, not a full batch; lower train\.batch_size or cluster\.num_trainers",
    ):
        make_cfg("cluster.num_trainers=64", "cluster.num_servers=3", "mode=async")
    make_cfg("cluster.num_trainers=44", "cluster.num_servers=3", "mode=async")  # 1437 // 44 = 32: one full batch


@pytest.fixture(scope="module")
def commands(tmp_path_factory):
    """The two commands of the tests below, started at once (each an interpreter importing
    torch on one core), each in a fresh folder: name -> (folder, completed process)."""
    folders = {name: tmp_path_factory.mktemp(name) for name in ("too_many_trainers", "malformed_line")}
    root = folders["malformed_line"] / "criteo"
    criteo_day(root / "day_0", 50)
    criteo_day(root / "day_1", 50, bad_line=10)
    procs = {
        "too_many_trainers": start_cli(
            "cluster.num_trainers=64", "cluster.num_servers=3", "mode=async", cwd=folders["too_many_trainers"]
        ),
        "malformed_line": start_cli(
            "model=dlrm",
            "data=criteo",
            f"data.root={root}",
            "data.table_rows=50",
            "train.steps=4",
            "train.batch_size=8",
            "cluster.num_trainers=2",
            "cluster.num_servers=2",
            cwd=folders["malformed_line"],
        ),
    }
    return {name: (folders[name], r) for name, r in finish_clis(procs).items()}


@pytest.mark.timeout(120)
def test_too_many_trainers_fails_before_any_role_starts_with_one_line(commands):
    tmp_path, r = commands["too_many_trainers"]
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.strip() == (
        "error: invalid ps_train config:\n  - train.batch_size=32: 64 trainers get only 22 "
        "of 1437 training samples each, not a full batch; lower train.batch_size or "
        "cluster.num_trainers"
    )
    assert_nothing_started(tmp_path, r)


def test_check_criteo_files_parses_the_first_lines_of_every_file(tmp_path):
    criteo_day(tmp_path / "day_0", 30)
    criteo_day(tmp_path / "day_1", CHECKED_LINES + 10, bad_line=CHECKED_LINES + 5)
    assert check_criteo_files(str(tmp_path), 100) == [str(tmp_path / "day_0"), str(tmp_path / "day_1")]
    criteo_day(tmp_path / "day_1", 40, bad_line=12)
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'day_1'}, line 12: categorical feature C7 .* '68fd1eXY'"):
        check_criteo_files(str(tmp_path), 100)
    check_criteo_files(str(tmp_path), 100, skip_malformed=True)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.root={root}/missing"], r"data\.root='.*/missing' does not exist"),
        (["data.root={root}/empty"], r"no Criteo files in .*/empty; expected day_0"),
        (["data.root={root}/bad"], r"^.*/bad/day_0, line 3: categorical feature C7 \(field 21\) is '68fd1eXY'"),
        (["data.prepared={root}/missing"], r"missing"),
        (
            ["data.root={root}/good", "cluster.num_trainers=4"],
            None,
        ),  # 40 lines: only the files know, and the trainers read them all
    ],
)
def test_check_data_names_what_the_trainers_would_fail_on(tmp_path, overrides, message):
    criteo_day(tmp_path / "bad" / "day_0", 20, bad_line=3)
    criteo_day(tmp_path / "good" / "day_0", 40)
    (tmp_path / "empty").mkdir()
    cfg = make_cfg("model=dlrm", "data=criteo", "data.table_rows=50", *(o.format(root=tmp_path) for o in overrides))
    if message is None:
        check_data(cfg.model, cfg.data, cfg.cluster.num_trainers, cfg.train.batch_size)
        return
    with pytest.raises(DataCheckError, match=message):
        check_data(cfg.model, cfg.data, cfg.cluster.num_trainers, cfg.train.batch_size)


def test_check_data_names_missing_vision_files(tmp_path):
    with pytest.raises(Exception, match=r"data=mnist: dataset files not found in .*data\.download=true"):
        cfg = make_cfg("data=mnist", f"data.root={tmp_path}", "model=mlp")
        check_data(cfg.model, cfg.data, cfg.cluster.num_trainers, cfg.train.batch_size)


@pytest.mark.timeout(120)
def test_a_malformed_line_among_the_first_fails_before_any_role_starts_with_one_line(commands):
    tmp_path, r = commands["malformed_line"]
    root = tmp_path / "criteo"
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    errors = [x for x in r.stderr.splitlines() if x.startswith("error: ")]
    assert errors == [x for x in r.stderr.splitlines() if x.strip()]  # nothing else on stderr
    [line] = errors
    assert line.startswith(f"error: {root / 'day_1'}, line 10: categorical feature C7 (field 21) is '68fd1eXY'")
    assert "data.skip_malformed=true" in line
    assert_nothing_started(tmp_path, r)
