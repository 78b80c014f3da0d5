"""What ``python -m ps_train.plan`` takes besides ps_train's own config: the link, the hosts'
cores, the simulation's bounds, stragglers and failures, and the calibration to use. Set on
the command line as ``link.gbit=25``, ``sim.stragglers.kind=one_in``, ... (``PLAN_GROUPS``);
every other override goes to ps_train's Hydra config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ps_train.config import ConfigError
from ps_train.config.base import Problems, format_problems
from ps_train.plan.simulator import STRAGGLER_KINDS, Failures, Stragglers

__all__ = ["LinkSettings", "HostSettings", "SimSettings", "PlanSettings", "PLAN_GROUPS", "plan_settings"]

PLAN_GROUPS = ("link", "hosts", "sim", "calibration")


@dataclass
class LinkSettings:
    gbit: float = 10.0  # each host's link, each way
    latency_us: float = 50.0  # one way


@dataclass
class HostSettings:
    trainer_cores: float = 1.0  # a role is one Python process: more than 1 does not count
    server_cores: float = 1.0


@dataclass
class StragglerSettings:
    kind: str = "none"  # none | one_in (one trainer in `every` slowed by `factor`) | lognormal (per step, `sigma`)
    every: int = 100
    factor: float = 2.0
    sigma: float = 0.1


@dataclass
class FailureSettings:
    mtbf_h: float = 0.0  # hours between failures of one node (trainer or server); 0: none
    horizon_h: float = 0.0  # simulated hours with failures; 0: 20 x the job's mean time between failures
    checkpoint_every: int = 100  # steps per trainer
    restart_s: float = 30.0  # a restarted job's time to start again
    replace_s: float = 10.0  # a replacement trainer's time to start and join


@dataclass
class SimSettings:
    steps: int = 30  # most steps per trainer
    budget: int = 40000  # most calls simulated in all (fewer steps each for many trainers, at least 4)
    seed: int = 0
    stragglers: StragglerSettings = field(default_factory=StragglerSettings)
    failures: FailureSettings = field(default_factory=FailureSettings)

    def steps_per_trainer(self, trainers: int, calls_per_step: int) -> int:
        return max(4, min(self.steps, self.budget // (trainers * calls_per_step)))

    def straggler_spec(self) -> Stragglers:
        s = self.stragglers
        return Stragglers(s.kind, s.every, s.factor, s.sigma)

    def failure_spec(self) -> Failures:
        f = self.failures
        return Failures(f.mtbf_h * 3600, f.checkpoint_every, f.restart_s, f.replace_s)


@dataclass
class PlanSettings:
    link: LinkSettings = field(default_factory=LinkSettings)
    hosts: HostSettings = field(default_factory=HostSettings)
    sim: SimSettings = field(default_factory=SimSettings)
    calibration: str | None = None  # a calibration file (benchmarks/scale_calibrate.py); null: ps_train's

    def problems(self) -> Problems:
        p = Problems()
        p.need(self.link.gbit > 0, f"link.gbit: {self.link.gbit} must be > 0 (Gbit/s each way)")
        p.need(self.link.latency_us >= 0, f"link.latency_us: {self.link.latency_us} must be >= 0")
        p.need(self.hosts.trainer_cores > 0, f"hosts.trainer_cores: {self.hosts.trainer_cores} must be > 0")
        p.need(self.hosts.server_cores > 0, f"hosts.server_cores: {self.hosts.server_cores} must be > 0")
        p.need(self.sim.steps >= 4, f"sim.steps: {self.sim.steps} must be >= 4 (the first is the warm-up)")
        p.need(self.sim.budget >= 1, f"sim.budget: {self.sim.budget} must be >= 1 call")
        s = self.sim.stragglers
        p.need(
            s.kind in STRAGGLER_KINDS, f"sim.stragglers.kind: unknown {s.kind!r}; choose one of {list(STRAGGLER_KINDS)}"
        )
        p.need(s.every >= 1, f"sim.stragglers.every: {s.every} must be >= 1 (one trainer in every)")
        p.need(s.factor >= 1, f"sim.stragglers.factor: {s.factor} must be >= 1 (how many times slower)")
        p.need(s.sigma >= 0, f"sim.stragglers.sigma: {s.sigma} must be >= 0")
        f = self.sim.failures
        p.need(f.mtbf_h >= 0, f"sim.failures.mtbf_h: {f.mtbf_h} must be >= 0 hours (0: no failures)")
        p.need(f.horizon_h >= 0, f"sim.failures.horizon_h: {f.horizon_h} must be >= 0 hours (0: automatic)")
        p.need(f.checkpoint_every >= 1, f"sim.failures.checkpoint_every: {f.checkpoint_every} must be >= 1 step")
        p.need(f.restart_s >= 0 and f.replace_s >= 0, "sim.failures.restart_s and replace_s: must be >= 0 seconds")
        return p


def plan_settings(overrides: list[str]) -> PlanSettings:
    """``overrides`` (``key=value``, keys under ``PLAN_GROUPS``) onto the defaults, checked."""
    base = OmegaConf.structured(PlanSettings)
    try:
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(overrides))
        settings = cast(PlanSettings, OmegaConf.to_object(merged))
    except OmegaConfBaseException as e:
        raise ConfigError(f"invalid plan setting: {e}".rstrip()) from e
    problems = settings.problems()
    if problems:
        raise ConfigError(format_problems(problems))
    return settings
