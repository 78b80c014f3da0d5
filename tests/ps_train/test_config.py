import dataclasses
import re
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf

import ps_train
from ps_train.config import (
    OPTIMIZERS,
    CNNConfig,
    Config,
    ConfigError,
    CriteoConfig,
    DigitsConfig,
    DLRMConfig,
    MLPConfig,
    ResNetConfig,
    SyntheticConfig,
    SyntheticCtrConfig,
    VisionDataConfig,
    config_to_dict,
    from_dictconfig,
    optimizer_spec,
    validate,
)
from ps_train.workloads.vision.data import BatchIterator, load_data
from ps_train.workloads.vision.models import build_stages, reference_model

CONF = Path(ps_train.__file__).resolve().parent / "conf"  # shipped inside the package
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir())
OPTIONS = [(g, f.stem) for g in GROUPS for f in sorted((CONF / g).glob("*.yaml"))]


def compose_cfg(*overrides, hydra=False):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=hydra)


def test_every_group_has_its_options():
    assert {"model", "data", "cluster", "optim", "mode", "logging"} <= set(GROUPS)
    names = {g: {o for gg, o in OPTIONS if gg == g} for g in GROUPS}
    assert names["model"] == {"mlp", "cnn", "resnet18", "dlrm"}
    assert names["data"] == {"digits", "mnist", "fashion_mnist", "cifar10", "synthetic", "synthetic_ctr", "criteo"}
    assert {"local", "env"} <= names["cluster"] and {"sgd", "adam"} <= names["optim"]
    assert names["mode"] == {"sync", "async", "ssp", "hybrid"}


# Options that only go with partner options (the DLRM model trains on CTR data only; the
# hybrid mode splits a model's dense parameters from its tables).
PARTNERS = {
    ("model", "dlrm"): ("data=synthetic_ctr",),
    ("data", "synthetic_ctr"): ("model=dlrm",),
    ("data", "criteo"): ("model=dlrm",),
    ("mode", "hybrid"): ("model=dlrm", "data=synthetic_ctr"),
}


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_group_option_composes_and_validates(group, option, monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    partner = list(PARTNERS.get((group, option), ()))
    cfg = from_dictconfig(compose_cfg(f"{group}={option}", *partner))
    if group == "preset":  # a preset sets fields of several groups, and names its runs' folder
        assert cfg.experiment == option
        return
    section = getattr(cfg, group)
    if group in ("model", "data", "optim", "mode"):
        assert section.name == option
    schema = {
        "mlp": MLPConfig,
        "cnn": CNNConfig,
        "resnet18": ResNetConfig,
        "digits": DigitsConfig,
        "synthetic": SyntheticConfig,
        "mnist": VisionDataConfig,
        "fashion_mnist": VisionDataConfig,
        "cifar10": VisionDataConfig,
        "dlrm": DLRMConfig,
        "synthetic_ctr": SyntheticCtrConfig,
        "criteo": CriteoConfig,
    }
    if option in schema:
        assert type(section) is schema[option]


def test_default_experiment():
    cfg = from_dictconfig(compose_cfg())
    assert isinstance(cfg, Config) and cfg.experiment == "digits_mlp"
    assert (cfg.model.name, cfg.data.name, cfg.mode.name, cfg.backend) == ("mlp", "digits", "sync", "rpc_core")
    assert (cfg.cluster.num_servers, cfg.cluster.num_trainers) == (2, 2)
    assert (cfg.cluster.master_addr, cfg.cluster.master_port, cfg.cluster.launcher) == ("127.0.0.1", 0, "local")
    assert cfg.resume is None and cfg.train.steps == 300 and cfg.logging.tensorboard
    # The YAML defaults and the dataclass defaults agree, so Config() in Python is the same run.
    assert cfg == dataclasses.replace(Config(), experiment="digits_mlp")


def test_run_and_sweep_dirs_are_under_runs():
    cfg = compose_cfg("model=cnn", hydra=True)
    assert re.fullmatch(r"runs/digits_cnn/\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d", cfg.hydra.run.dir)
    assert cfg.hydra.sweep.dir.startswith("runs/digits_cnn/") and cfg.hydra.job.chdir is False
    assert compose_cfg("experiment=abc", hydra=True).hydra.run.dir.startswith("runs/abc/")


def test_env_cluster_reads_launcher_environment(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")
    monkeypatch.setenv("MASTER_PORT", "29611")
    cfg = from_dictconfig(compose_cfg("cluster=env"))
    assert (cfg.cluster.launcher, cfg.cluster.master_addr, cfg.cluster.master_port) == ("env", "10.0.0.7", 29611)


@pytest.mark.parametrize(
    "override,pattern",
    [
        ("optim.learning_rate=0.1", r"optim.learning_rate"),  # typo in a key
        ("cluster.num_servers=two", r"cluster.num_servers"),  # wrong type
        ("train.batch_size=3.5", r"train.batch_size"),
        ("logging.tensorboard=maybe", r"logging.tensorboard"),
        ("model.channels=[8,16]", r"model.channels"),  # a cnn field while model=mlp
        ("model=mlpp", r"model/mlpp"),  # unknown group option
    ],
)
def test_typos_and_wrong_types_fail_in_hydra(override, pattern):
    with pytest.raises(HydraException) as info:
        compose_cfg(override)
    text = str(info.value) + str(info.value.__cause__ or "")
    assert re.search(pattern, text), text


@pytest.mark.parametrize(
    "overrides,field",
    [
        (["cluster.num_trainers=0"], "cluster.num_trainers"),
        (["cluster.num_servers=0"], "cluster.num_servers"),
        (["cluster.num_servers=4"], "cluster.num_servers: 4 servers but model 'mlp' has only 3 stages"),
        (["model=resnet18", "cluster.num_servers=7"], "cluster.num_servers"),
        (["mode=ssp", "mode.staleness=-1"], "mode.staleness: -1 must be >= 0"),
        (["mode.staleness=2"], "mode.staleness: only used by mode=ssp"),
        (["mode.aggregate=avg"], "mode.aggregate: unknown rule 'avg'; choose one of ['mean', 'sum']"),
        (["mode=async", "mode.aggregate=sum"], "mode.aggregate: only used by mode=sync"),
        (["mode=ssp", "mode.staleness_rule=inverse"], "mode.staleness_rule: unknown rule 'inverse'"),
        (["mode.staleness_rule=none"], "mode.staleness_rule: only used by mode=async and mode=ssp"),
        (["model.name=transformer"], "model.name: unknown model 'transformer'"),
        (["model.name=cnn"], "model.name: 'cnn' does not match"),
        (["data.name=imagenet"], "data.name: unknown dataset 'imagenet'"),
        (["optim.name=lbfgs"], "optim.name: unknown optimizer 'lbfgs'"),
        (["optim=adam", "optim.momentum=0.9"], "optim.momentum: adam has no momentum"),
        (["optim.lr=0"], "optim.lr"),
        (["cluster.placement=random"], "cluster.placement"),
        (["cluster.launcher=slurmx"], "cluster.launcher"),
        (["cluster.master_port=70000"], "cluster.master_port"),
        (["train.epochs=3"], "train.steps/train.epochs: set exactly one"),
        (["train.batch_size=0"], "train.batch_size"),
        (["model=cnn", "model.channels=[4,4,4,4]"], "model.channels: 4 conv blocks"),
        (["model=cnn", "data=synthetic", "data.shape=[64]"], "model.channels"),
        (["model.dropout=1.5"], "model.dropout"),
        (["backend=tensorpipe"], "backend"),
        (["experiment=a/b"], "experiment"),
        (["resume=/nonexistent/run"], "resume: '/nonexistent/run' does not exist"),
        (["logging.level=LOUD"], "logging.level"),
        (["checkpoint.keep=-1"], "checkpoint.keep"),
        (["model=dlrm"], "data: model 'dlrm' and data 'digits' do not go together"),
        (["data=synthetic_ctr"], "data: model 'mlp' and data 'synthetic_ctr' do not go together"),
        (["model=dlrm", "data=synthetic_ctr", "model.table_optim=adam"], "model.table_optim: unknown 'adam'"),
        (["model=dlrm", "data=synthetic_ctr", "model.table_sharding=hash"], "model.table_sharding: unknown 'hash'"),
        (["model=dlrm", "data=synthetic_ctr", "model.embedding_dim=0"], "model.embedding_dim"),
        (["model=dlrm", "data=synthetic_ctr", "model.table_lr=0"], "model.table_lr"),
        (["model=dlrm", "data=synthetic_ctr", "data.table_sizes=[10,1]"], "data.table_sizes"),
        (["model=dlrm", "data=synthetic_ctr", "data.num_dense=0"], "data.num_dense"),
        (["model=dlrm", "data=criteo", "data.num_tables=8"], "Criteo has 26 categorical features"),
    ],
)
def test_invalid_combinations_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as info:
        from_dictconfig(compose_cfg(*overrides))
    assert field in str(info.value)


def test_force_added_keys_are_rejected():
    # Hydra lets `+key=value` add keys even to a schema node; the conversion refuses them.
    with pytest.raises(ConfigError, match=r"optim.learning_rate: not a field of OptimConfig \(fields: .*lr"):
        from_dictconfig(compose_cfg("+optim.learning_rate=0.1"))
    with pytest.raises(ConfigError, match=r"extra_top: not a field of Config"):
        from_dictconfig(compose_cfg("+extra_top=1"))


def test_all_problems_are_reported_at_once():
    with pytest.raises(ConfigError) as info:
        from_dictconfig(compose_cfg("cluster.num_trainers=0", "optim.lr=-1", "train.log_every=0"))
    msg = str(info.value)
    assert all(f in msg for f in ("cluster.num_trainers", "optim.lr", "train.log_every"))


def test_valid_alternatives_pass():
    for overrides in (
        ["train.steps=null", "train.epochs=2"],
        ["mode=ssp", "mode.staleness=0"],
        ["model=resnet18", "data=cifar10", "cluster.num_servers=6", "cluster.placement=round_robin"],
        ["model=cnn", "data=synthetic", "data.shape=[3,16,16]", "optim=adamw"],
        # tables live on every server, so any number of servers will do
        ["model=dlrm", "data=synthetic_ctr", "cluster.num_servers=5", "optim=adam", "model.table_optim=sparse_adam"],
    ):
        from_dictconfig(compose_cfg(*overrides))


def test_saved_plain_config_round_trips_with_the_same_checks(tmp_path):
    composed = compose_cfg("model=cnn", "data=mnist", "mode=ssp")
    path = tmp_path / "config.yaml"  # what Hydra saves in <run>/.hydra/config.yaml
    path.write_text(OmegaConf.to_yaml(composed, resolve=True))
    plain = OmegaConf.load(path)
    assert from_dictconfig(plain) == from_dictconfig(composed)
    plain.model.fc_sise = 3  # plain configs accept anything; the schema must not
    with pytest.raises(ConfigError, match="fc_sise"):
        from_dictconfig(plain)


def test_python_defaults_are_valid_and_serialisable():
    cfg = validate(Config())
    d = config_to_dict(cfg)
    assert d["model"]["hidden_sizes"] == [128, 64] and d["cluster"]["num_servers"] == 2
    with pytest.raises(ConfigError, match="cluster.num_trainers"):
        validate(dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, num_trainers=0)))


def test_cluster_serializer_is_checked_before_any_process_starts():
    cfg = from_dictconfig(compose_cfg("cluster.serializer=safe"))
    assert validate(cfg).cluster.serializer == "safe"
    with pytest.raises(ConfigError, match=r"cluster.serializer: unknown 'json'; choose one of \['pickle', 'safe'\]"):
        validate(from_dictconfig(compose_cfg("cluster.serializer=json")))
    with pytest.raises(ConfigError, match="cluster.serializer=safe needs backend=rpc_core"):
        validate(from_dictconfig(compose_cfg("cluster.serializer=safe", "backend=torch")))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_spec_builds_every_optimizer(name):
    cfg = from_dictconfig(compose_cfg(f"optim.name={name}", "optim.momentum=0.0"))
    cls, kwargs = optimizer_spec(cfg.optim)
    opt = cls([torch.nn.Parameter(torch.zeros(2))], **kwargs)
    assert opt.defaults["lr"] == cfg.optim.lr


def test_default_experiment_reaches_90_percent_single_process():
    # The default's hyper-parameters, replayed as sync mode does it in one process: each step
    # averages both trainers' gradients (rank order) and applies one optimizer step.
    cfg = from_dictconfig(compose_cfg())
    torch.manual_seed(cfg.seed)
    train, test = load_data(cfg.data)
    model = reference_model(build_stages(cfg.model, train.in_shape, train.num_classes, seed=cfg.seed))
    cls, kwargs = optimizer_spec(cfg.optim)
    opt = cls(model.parameters(), **kwargs)
    world = cfg.cluster.num_trainers
    iters = [BatchIterator(train, r, world, cfg.train.batch_size, cfg.seed) for r in range(world)]
    for _ in range(cfg.train.steps):
        opt.zero_grad()
        for it in iters:
            x, y = next(it)
            torch.nn.functional.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            p.grad.div_(world)  # mode.aggregate=mean
        opt.step()
    model.eval()
    with torch.no_grad():
        x, y = test[:]
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    assert accuracy >= 0.90
