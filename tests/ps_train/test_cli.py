"""``python -m ps_train`` as a Hydra app: bad configs fail before any role starts, naming the
field; ``--help`` and ``--cfg job`` work as Hydra users expect."""

import pytest
import yaml

from tests.ps_train._app import cli


def assert_nothing_started(tmp_path, r):
    assert not list(tmp_path.rglob("logs")), "a role was started"
    assert "starting" not in r.stdout + r.stderr


@pytest.mark.timeout(60)
def test_invalid_value_exits_nonzero_naming_the_field_before_any_process_starts(tmp_path):
    r = cli("cluster.num_trainers=0", cwd=tmp_path)
    assert r.returncode == 2
    assert "cluster.num_trainers: 0 must be >= 1" in r.stderr
    assert_nothing_started(tmp_path, r)


@pytest.mark.timeout(60)
def test_misspelt_key_exits_nonzero_with_hydras_message_naming_it(tmp_path):
    r = cli("optim.learning_rate=0.1", cwd=tmp_path)
    assert r.returncode != 0
    assert "Could not override 'optim.learning_rate'" in r.stderr
    assert "Key 'learning_rate' not in 'OptimConfig'" in r.stderr
    assert_nothing_started(tmp_path, r)


@pytest.mark.timeout(60)
def test_wrong_type_exits_nonzero_with_hydras_message_naming_the_field(tmp_path):
    r = cli("cluster.num_servers=two", cwd=tmp_path)
    assert r.returncode != 0
    assert "Value 'two' of type 'str' could not be converted to Integer" in r.stderr
    assert "full_key: cluster.num_servers" in r.stderr
    assert_nothing_started(tmp_path, r)


@pytest.mark.timeout(60)
def test_help_lists_config_groups_and_examples(tmp_path):
    r = cli("--help", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ps_train: parameter-server, model-parallel training")
    for line in ("mode: async, hybrid, ssp, sync", "cluster: env, local", "optim: adam, adamw, sgd"):
        assert line in r.stdout
    assert "python -m ps_train -m optim.lr=0.01,0.1 mode=sync,async" in r.stdout
    assert not (tmp_path / "runs").exists()


@pytest.mark.timeout(60)
def test_cfg_job_prints_the_composed_config_without_running(tmp_path):
    r = cli("--cfg", "job", "model=cnn", "mode=ssp", "cluster.num_servers=3", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    cfg = yaml.safe_load(r.stdout)
    assert cfg["model"]["name"] == "cnn" and cfg["model"]["channels"] == [32, 64]
    assert cfg["mode"] == {"name": "ssp", "staleness": 2, "aggregate": "mean", "staleness_rule": "scale"}
    assert cfg["cluster"]["num_servers"] == 3 and cfg["cluster"]["launcher"] == "local"
    assert not (tmp_path / "runs").exists()
