"""``python -m ps_train.plan [--simulate] [overrides]``: size a ps_train job before running it.

Overrides are ps_train's own (``model=dlrm cluster.num_trainers=1024 cluster.num_servers=64
mode=async``: the job's config is composed as ``python -m ps_train`` composes it, so the
model's sizes, the batch and the mode are the job's) plus the plan's settings
(``ps_train.plan.settings``: ``link.gbit=10 link.latency_us=50 hosts.server_cores=1 sim.*``).
Prints the analytic model's samples/s, the binding resource and the suggested number of
servers, with the model's stated error; ``--simulate`` also runs the SimPy simulator for the
same job (a bounded number of steps) and prints its samples/s beside the model's.

Exit codes: 0 done; 2 a bad override or a model the cost model does not know.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

import ps_train
from ps_train.config import Config, ConfigError, from_dictconfig
from ps_train.config.base import format_problems
from ps_train.config.root import validate
from ps_train.plan.settings import PLAN_GROUPS, PlanSettings, plan_settings
from ps_train.plan.simulator import Failures, SimResult, simulate
from ps_train.plan.steps import step_plan
from ps_train.scaling.cost_model import Calibration, Cluster, Prediction, load_calibration, predict, suggest_servers
from ps_train.scaling.shapes import Workload, workload_from_config
from ps_train.workload import import_plugins
from ps_train.workloads import BUILTIN

__all__ = ["PlanJob", "compose_job", "main"]

CONF_DIR = Path(ps_train.__file__).resolve().parent / "conf"
USAGE = __doc__.split("\n\n")[0] + "\n\nusage: python -m ps_train.plan [--simulate] [key=value ...]"


@dataclass(frozen=True)
class PlanJob:
    """A job to plan: ps_train's config of it, its shapes, the cluster and the plan's settings."""

    config: Config
    workload: Workload
    cluster: Cluster
    settings: PlanSettings
    calibration: Calibration


def _is_plan_key(override: str) -> bool:
    key = override.split("=", 1)[0].lstrip("+~")
    return key.split(".", 1)[0] in PLAN_GROUPS


def _checked(cfg: Config) -> Config:
    """``cfg`` checked as ``python -m ps_train`` checks it, except that the data need not give
    every planned trainer a batch (a plan is for data of any size): the rules across groups are
    checked for one trainer, the cluster's own with its numbers."""
    problems = cfg.cluster.problems()
    if problems:
        raise ConfigError(format_problems(problems))
    validate(replace(cfg, cluster=replace(cfg.cluster, num_trainers=1)))
    return cfg


def compose_job(overrides: list[str]) -> PlanJob:
    """The job ``overrides`` describe; ``ConfigError`` (naming the setting) if they are bad."""
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"not an override: {bad}; write key=value, e.g. cluster.num_trainers=64 or link.gbit=10")
    settings = plan_settings([o for o in overrides if _is_plan_key(o)])
    import_plugins(BUILTIN)  # the models' schemas register with their workloads
    import_plugins()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            dcfg = compose("config", overrides=[o for o in overrides if not _is_plan_key(o)])
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(f"invalid ps_train override: {e}") from e
    cfg = _checked(from_dictconfig(dcfg, check=False))
    try:
        workload = workload_from_config(cfg.model, cfg.data, cfg.train.batch_size)
        cal = load_calibration(Path(settings.calibration) if settings.calibration else None)
        cluster = Cluster(
            cfg.cluster.num_trainers,
            cfg.cluster.num_servers,
            settings.link.gbit * 1e9,
            settings.link.latency_us * 1e-6,
            settings.hosts.trainer_cores,
            settings.hosts.server_cores,
            None,
            cfg.mode.name,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from e
    return PlanJob(cfg, workload, cluster, settings, cal)


def _describe(job: PlanJob) -> str:
    cfg, cl = job.config, job.cluster
    return (
        f"model={cfg.model.name} data={cfg.data.name} batch {cfg.train.batch_size}, {cl.trainers} trainers, "
        f"{cl.servers} servers, mode={cl.mode}, link {job.settings.link.gbit:g} Gbit/s "
        f"+ {job.settings.link.latency_us:g} us, {cl.trainer_cores:g}/{cl.server_cores:g} cores per trainer/server"
    )


def _simulate(job: PlanJob, failures: Failures | None = None, horizon_s: float | None = None) -> SimResult:
    c, cl, sim = job.calibration.constants, job.cluster, job.settings.sim
    plan = step_plan(c, job.workload, cl.servers, cl.link_bps)
    staleness = job.config.mode.staleness
    steps = sim.steps_per_trainer(cl.trainers, plan.calls())
    return simulate(cl, plan, steps, sim.straggler_spec(), failures, staleness, horizon_s, sim.seed)


def report(job: PlanJob, simulated: bool) -> list[str]:
    """The lines ``main`` prints."""
    c = job.calibration.constants
    p: Prediction = predict(c, job.workload, job.cluster)
    best_s, best = suggest_servers(c, job.workload, job.cluster)
    lines = [
        f"[plan] {_describe(job)}",
        f"  predicted samples/s: {p.samples_per_s:,.0f} ({p.steps_per_s:,.2f} steps/s per trainer)",
        f"  binding resource:    {p.binding}",
        f"  suggested servers:   {best_s} ({best.samples_per_s:,.0f} samples/s; the fewest for 95% of the best any "
        "number gives)",
        f"  stated error:        {job.calibration.stated_error()}",
    ]
    if not simulated:
        return lines
    sim = job.settings.sim
    started = time.monotonic()
    r = _simulate(job)
    took = time.monotonic() - started
    steps = sim.steps_per_trainer(job.cluster.trainers, step_plan(c, job.workload, job.cluster.servers).calls())
    lines.append(
        f"  simulated samples/s: {r.samples_per_s:,.0f} ({r.samples_per_s / p.samples_per_s - 1:+.0%} against the "
        f"model; {steps} steps per trainer, stragglers: {sim.stragglers.kind}; {took:.1f} s)"
    )
    fail = sim.failure_spec()
    if fail.mtbf_s > 0:
        nodes = job.cluster.trainers + job.cluster.servers
        horizon = sim.failures.horizon_h * 3600
        if not horizon:  # 20 of the job's failures, or as many as ten budgets of calls allow
            calls_per_s = r.samples_per_s / job.workload.batch * step_plan(c, job.workload, job.cluster.servers).calls()
            horizon = min(20 * fail.mtbf_s / nodes, 10 * sim.budget / calls_per_s)
        rf = _simulate(job, fail, horizon)
        lost = horizon * (1 - rf.samples_per_s / r.samples_per_s) / rf.failures if rf.failures else 0.0
        lines.append(
            f"  with failures:       {rf.samples_per_s:,.0f} samples/s over {horizon / 3600:.3f} h simulated: "
            f"{rf.failures} failures ({rf.restarts} restarts, {rf.replacements} trainers replaced), "
            f"{lost:,.1f} s lost per failure"
        )
        if rf.failures < 5:
            lines.append(
                "  (too few failures to measure their cost: raise sim.failures.horizon_h or sim.budget, "
                "or lower sim.failures.mtbf_h)"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        print(USAGE)
        return 0
    simulated = "--simulate" in args
    args = [a for a in args if a != "--simulate"]
    flags = [a for a in args if a.startswith("-")]
    try:
        if flags:
            raise ConfigError(f"unknown option {flags[0]!r}; the options are --simulate and --help")
        job = compose_job(args)
        lines = report(job, simulated)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0
