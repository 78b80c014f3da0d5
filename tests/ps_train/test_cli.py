"""``python -m ps_train`` as a Hydra app: bad configs fail before any role starts, naming the
field; ``--help`` and ``--cfg job`` work as Hydra users expect.

Each case is one command, an interpreter that imports torch on one core: ``commands`` starts
them all at once, each in a folder of its own, and each test checks its own."""

import pytest
import yaml

from tests.ps_train._app import finish_clis, start_cli

COMMANDS = {
    "invalid_value": ("cluster.num_trainers=0",),
    "misspelt_key": ("optim.learning_rate=0.1",),
    "wrong_type": ("cluster.num_servers=two",),
    "help": ("--help",),
    "cfg_job": ("--cfg", "job", "model=cnn", "mode=ssp", "cluster.num_servers=3"),
}
TIMEOUT = 150  # s: the five interpreters share the cores


@pytest.fixture(scope="module")
def commands(tmp_path_factory):
    """Each of ``COMMANDS``, run in a fresh folder: name -> (folder, completed process)."""
    folders = {name: tmp_path_factory.mktemp(name) for name in COMMANDS}
    procs = {name: start_cli(*args, cwd=folders[name]) for name, args in COMMANDS.items()}
    return {name: (folders[name], r) for name, r in finish_clis(procs, timeout=TIMEOUT - 30).items()}


def assert_nothing_started(tmp_path, r):
    assert not list(tmp_path.rglob("logs")), "a role was started"
    assert "starting" not in r.stdout + r.stderr


@pytest.mark.timeout(TIMEOUT)
def test_invalid_value_exits_nonzero_naming_the_field_before_any_process_starts(commands):
    folder, r = commands["invalid_value"]
    assert r.returncode == 2
    assert "cluster.num_trainers: 0 must be >= 1" in r.stderr
    assert_nothing_started(folder, r)


@pytest.mark.timeout(TIMEOUT)
def test_misspelt_key_exits_nonzero_with_hydras_message_naming_it(commands):
    folder, r = commands["misspelt_key"]
    assert r.returncode != 0
    assert "Could not override 'optim.learning_rate'" in r.stderr
    assert "Key 'learning_rate' not in 'OptimConfig'" in r.stderr
    assert_nothing_started(folder, r)


@pytest.mark.timeout(TIMEOUT)
def test_wrong_type_exits_nonzero_with_hydras_message_naming_the_field(commands):
    folder, r = commands["wrong_type"]
    assert r.returncode != 0
    assert "Value 'two' of type 'str' could not be converted to Integer" in r.stderr
    assert "full_key: cluster.num_servers" in r.stderr
    assert_nothing_started(folder, r)


@pytest.mark.timeout(TIMEOUT)
def test_help_lists_config_groups_and_examples(commands):
    folder, r = commands["help"]
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ps_train: parameter-server, model-parallel training")
    for line in ("mode: async, hybrid, ssp, sync", "cluster: env, local", "optim: adagrad, adam, adamw, sgd"):
        assert line in r.stdout
    assert "python -m ps_train -m optim.lr=0.01,0.1 mode=sync,async" in r.stdout
    assert not (folder / "runs").exists()


@pytest.mark.timeout(TIMEOUT)
def test_cfg_job_prints_the_composed_config_without_running(commands):
    folder, r = commands["cfg_job"]
    assert r.returncode == 0, r.stderr
    cfg = yaml.safe_load(r.stdout)
    assert cfg["model"]["name"] == "cnn" and cfg["model"]["channels"] == [32, 64]
    assert cfg["mode"] == {"name": "ssp", "staleness": 2, "aggregate": "mean", "staleness_rule": "scale"}
    assert cfg["cluster"]["num_servers"] == 3 and cfg["cluster"]["launcher"] == "local"
    assert not (folder / "runs").exists()
