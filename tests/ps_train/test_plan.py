"""ps_train.plan: the simulator's queueing arithmetic on cases with known answers, its
agreement with the analytic model where that model is exact, the update modes' waits,
stragglers and failures, and ``python -m ps_train.plan``."""

from __future__ import annotations

import math
import random
import subprocess
import sys
from collections.abc import Generator
from typing import Any

import pytest
import simpy

from ps_train.plan.cli import compose_job, main
from ps_train.plan.simulator import Cpu, Failures, Kill, Server, Stragglers, simulate
from ps_train.plan.steps import Call, StepPlan, step_plan
from ps_train.scaling.cost_model import Cluster, load_calibration, predict
from ps_train.scaling.shapes import WORKLOADS, Stage

CONSTANTS = load_calibration().constants


def _cluster(t: int, s: int, mode: str = "async", gbit: float = math.inf, latency: float = 0.0) -> Cluster:
    return Cluster(t, s, gbit * 1e9, latency, 1.0, 1.0, None, mode)


@pytest.mark.parametrize("mode", ["sync", "async", "ssp", "hybrid"])
def test_one_trainer_one_server_steps_at_compute_plus_two_transfers_plus_service(mode: str) -> None:
    batch, c0, c1, service, nbytes = 32, 2e-3, 5e-4, 3e-3, 25_000.0
    plan = StepPlan(batch, c0, c1, ((Call(0, "forward", nbytes, nbytes, service),),))
    cl = _cluster(1, 1, mode, gbit=1.0, latency=1e-4)
    transfer = nbytes * 8 / 1e9 + 1e-4  # one way: the bytes at the link's rate, then the delay
    expected = batch / (c0 + c1 + 2 * transfer + service)
    assert simulate(cl, plan, steps=10).samples_per_s == pytest.approx(expected, rel=1e-9)
    # Half a core: the trainer's CPU takes twice as long.
    half = Cluster(1, 1, 1e9, 1e-4, 0.5, 1.0, None, mode)
    slower = batch / (2 * (c0 + c1) + 2 * transfer + service)
    assert simulate(half, plan, steps=10).samples_per_s == pytest.approx(slower, rel=1e-9)


def test_a_shaped_links_bucket_passes_what_it_holds_at_once() -> None:
    # A token bucket of 8,192 bytes on every way at 1 Mbit/s, refilled while the trainer
    # computes (100 ms a step: 12.5 KB): a message within it takes no time on the wire, and
    # one beyond it waits for what the bucket lacks, at the rate; the answer's half of the
    # trainer's CPU for the call comes after it.
    batch, c0, c1, service, burst = 32, 0.1, 4e-3, 3e-3, 8192.0
    cl = Cluster(1, 1, 1e6, 0.0, 1.0, 1.0, None, "async", burst)
    small = StepPlan(batch, c0, c1, ((Call(0, "forward", 4000.0, 4000.0, service),),))
    assert simulate(cl, small, steps=10).samples_per_s == pytest.approx(batch / (c0 + c1 + service), rel=1e-9)
    big = StepPlan(batch, c0, c1, ((Call(0, "forward", 12_000.0, 12_000.0, service),),))
    lacking = 2 * (12_000 - burst) * 8 / 1e6  # both ways
    assert simulate(cl, big, steps=10).samples_per_s == pytest.approx(batch / (c0 + c1 + service + lacking), rel=1e-9)


def test_a_cpu_quota_is_a_budget_per_period_at_full_speed() -> None:
    # 0.1 core as a CFS quota of a 100 ms period: 3 ms of work take 3 ms; 25 ms more take
    # the 7 ms left of that period's budget, 10 of the next and 8 of the third, throttled to
    # each period's end in between.
    env = simpy.Environment()
    cpu = Cpu(env, 0.1, 0.1)
    ends: list[float] = []

    def job(seconds: float) -> Generator[simpy.Event, Any, None]:
        yield from cpu.run(seconds)
        ends.append(env.now)

    env.process(job(0.003))
    env.run()
    env.process(job(0.025))
    env.run()
    assert ends == pytest.approx([0.003, 0.208])
    # A slower core (no period) takes 10x as long.
    slow = Cpu(env, 0.1)
    env.process(slow.run(0.003))
    start = env.now
    env.run()
    assert env.now - start == pytest.approx(0.03)
    # One trainer and one server within their budgets (0.6 core: 60 ms a period, each using
    # under 55) step at full speed; at 0.1 core the server's 3 ms a step bind: 10 ms of its
    # budget a period is 3.33 steps per 100 ms.
    batch, c0, c1, service = 32, 2e-3, 5e-4, 3e-3
    plan = StepPlan(batch, c0, c1, ((Call(0, "forward", 0.0, 0.0, service),),))
    within = Cluster(1, 1, math.inf, 0.0, 0.6, 0.6, None, "async", cpu_period_s=0.1)
    assert simulate(within, plan, steps=50).samples_per_s == pytest.approx(batch / (c0 + c1 + service), rel=1e-9)
    over = Cluster(1, 1, math.inf, 0.0, 0.1, 0.1, None, "async", cpu_period_s=0.1)
    assert simulate(over, plan, steps=200).samples_per_s == pytest.approx(batch * 0.1 / service, rel=0.05)


def test_md1_waiting_time_matches_pollaczek_khinchine() -> None:
    # Poisson arrivals at rate lam to one server of fixed service time d: the mean wait in the
    # queue is rho d / (2 (1 - rho)), rho = lam d.
    lam, d, arrivals = 0.6, 1.0, 200_000
    env = simpy.Environment()
    server = Server(env, cores=1.0)
    waits: list[float] = []
    rng = random.Random(7)

    def customer() -> Generator[simpy.Event, Any, None]:
        arrived = env.now
        with server.core.request() as turn:
            yield turn
            waits.append(env.now - arrived)
            yield env.timeout(d)

    def source() -> Generator[simpy.Event, Any, None]:
        for _ in range(arrivals):
            yield env.timeout(rng.expovariate(lam))
            env.process(customer())

    env.process(source())
    env.run()
    rho = lam * d
    assert sum(waits) / len(waits) == pytest.approx(rho * d / (2 * (1 - rho)), rel=0.03)
    # The job's server class does the same through serve(): a lone call waits for nothing.
    env2 = simpy.Environment()
    lone = Server(env2, cores=0.5)
    env2.process(lone.serve(1.0))
    env2.run()
    assert (env2.now, lone.busy_s) == (2.0, 2.0)  # half a core: twice the service time


@pytest.mark.parametrize("name", sorted(WORKLOADS))
@pytest.mark.parametrize("mode", ["sync", "async", "ssp", "hybrid"])
def test_simulator_agrees_with_the_model_where_the_model_is_exact(name: str, mode: str) -> None:
    w = WORKLOADS[name]
    # One trainer on one server: a step is its parts in series, in every mode. Exactly so
    # without tables; a DLRM sends its update and its row gradients together, and the
    # simulated trainer overlaps the second's sending (c1) with the first call.
    cl = _cluster(1, 1, mode, gbit=math.inf, latency=5e-5)
    alone = simulate(cl, step_plan(CONSTANTS, w, 1), steps=6).samples_per_s
    overlap = CONSTANTS.trainer_cpu_per_message if w.table_bytes else 0.0
    serial = w.batch / predict(CONSTANTS, w, cl).samples_per_s
    assert alone == pytest.approx(w.batch / (serial - overlap), rel=1e-6)
    # Many trainers: the busiest server binds and both give its rate (the model within 25%).
    many = _cluster(64, 2, mode, gbit=10.0, latency=5e-5)
    got = simulate(many, step_plan(CONSTANTS, w, 2), steps=8).samples_per_s
    want = predict(CONSTANTS, w, many)
    assert want.binding == "server CPU"
    assert got == pytest.approx(want.samples_per_s, rel=0.25)


def _light_plan() -> StepPlan:
    """A step whose time is the trainer's own CPU (10 ms, after its forward); the server's share is small."""
    return StepPlan(10, 0.01, 0.0, ((Call(0, "forward", 0.0, 0.0, 1e-5),), (Call(0, "update", 0.0, 0.0, 1e-5),)), 1)


def test_one_slow_trainer_holds_back_sync_but_not_async() -> None:
    # Four trainers, trainer 3 (one in four) 3x slower: sync steps at its pace, async loses a third of one trainer.
    slow = Stragglers("one_in", every=4, factor=3.0)
    sync = simulate(_cluster(4, 1, "sync"), _light_plan(), steps=20, stragglers=slow).samples_per_s
    asyn = simulate(_cluster(4, 1, "async"), _light_plan(), steps=20, stragglers=slow).samples_per_s
    assert sync == pytest.approx(4 * 10 / 0.03, rel=0.02)
    assert asyn == pytest.approx(3 * 10 / 0.01 + 10 / 0.03, rel=0.02)
    # ssp: the fast trainers may run ahead by the bound, then they wait; over a long run they
    # too step at the slow one's pace.
    ssp = simulate(_cluster(4, 1, "ssp"), _light_plan(), steps=60, stragglers=slow, staleness=2).samples_per_s
    assert sync * 0.98 <= ssp < asyn
    # Lognormal jitter of mean 1: async keeps its rate on average, sync pays the slowest each step.
    jitter = Stragglers("lognormal", sigma=0.3)
    j_async = simulate(_cluster(8, 1, "async"), _light_plan(), steps=200, stragglers=jitter).samples_per_s
    j_sync = simulate(_cluster(8, 1, "sync"), _light_plan(), steps=200, stragglers=jitter).samples_per_s
    assert j_async == pytest.approx(8 * 10 / 0.01, rel=0.05)
    assert j_sync < 0.85 * j_async
    with pytest.raises(ValueError, match="stragglers.kind"):
        Stragglers("gamma")


def test_a_failure_restarts_sync_from_its_checkpoint_and_replaces_an_async_trainer() -> None:
    plan = _light_plan()
    fail = Failures(mtbf_s=40.0, checkpoint_every=50, restart_s=2.0, replace_s=2.0)
    free = simulate(_cluster(4, 1, "async"), plan, steps=50).samples_per_s
    a = simulate(_cluster(4, 1, "async"), plan, failures=fail, horizon_s=200.0, seed=3)
    s = simulate(_cluster(4, 1, "sync"), plan, failures=fail, horizon_s=200.0, seed=3)
    assert a.failures == s.failures > 5  # same seed, same failure times: 5 nodes over 200 s at 40 s each
    # Every failure restarts sync; in async a server's restarts it, a trainer's replaces that
    # trainer (a failure of one already being replaced costs nothing more).
    assert s.restarts == s.failures and a.restarts + a.replacements <= a.failures and a.replacements > 0
    # Async loses a replaced trainer's step in flight and its start-up; sync loses every
    # trainer's steps since the checkpoint and the restart.
    assert s.steps_lost > a.steps_lost
    assert s.samples_per_s < a.samples_per_s < free
    # Sync's time lost per failure: the restart's 2 s plus on average half a checkpoint interval
    # (50 steps at 100 a second: 0.5 s); less when failures strike during a restart.
    lost = 200.0 * (1 - s.samples_per_s / free) / s.failures
    assert 0.8 * 2.0 < lost < 2.0 + 0.5
    with pytest.raises(ValueError, match="needs horizon_s"):
        simulate(_cluster(4, 1, "sync"), plan, failures=fail)


def test_a_kill_at_a_set_step_costs_the_restart_and_the_steps_since_the_checkpoint() -> None:
    # Four trainers stepping every 10 ms (the light plan, sync): trainer 1 killed 50 ms after
    # every trainer committed step 20, which the checkpoint holds. The kill lands in step 25:
    # steps 21-24 of every trainer are lost, so the job ends the restart's 1 s plus those 4
    # steps' 40 ms and step 25's first 10 ms later than without the kill.
    plan, steps = _light_plan(), 50
    fail = Failures(checkpoint_every=20, restart_s=1.0, replace_s=1.0, kills=(Kill(1, 20, 0.05),))
    free = simulate(_cluster(4, 1, "sync"), plan, steps=steps)
    s = simulate(_cluster(4, 1, "sync"), plan, steps=steps, failures=fail)
    assert (s.failures, s.restarts, s.replacements, s.steps_lost) == (1, 1, 0, 4 * 4)
    assert s.steps_done == 4 * steps  # the job still runs all its steps
    assert s.sim_seconds - free.sim_seconds == pytest.approx(1.0 + 0.05, rel=0.01)
    assert s.samples_per_s == pytest.approx(4 * steps * 10 / s.sim_seconds, rel=1e-9)
    # Async replaces the trainer, which goes on from its own last step: only its start-up and
    # its step in flight are lost, and the others finish meanwhile.
    a = simulate(_cluster(4, 1, "async"), plan, steps=steps, failures=fail)
    assert (a.restarts, a.replacements, a.steps_lost) == (0, 1, 1)
    assert a.sim_seconds - free.sim_seconds == pytest.approx(1.0 + 0.01, rel=0.01)
    # A server's kill restarts async too (node 4: the first server after the four trainers).
    srv = Failures(checkpoint_every=20, restart_s=1.0, kills=(Kill(4, 20, 0.05),))
    assert simulate(_cluster(4, 1, "async"), plan, steps=steps, failures=srv).restarts == 1
    with pytest.raises(ValueError, match="outside the job"):
        simulate(_cluster(4, 1, "sync"), plan, steps=steps, failures=Failures(kills=(Kill(5, 20),)))
    with pytest.raises(ValueError, match="outside the job"):
        simulate(_cluster(4, 1, "sync"), plan, steps=steps, failures=Failures(kills=(Kill(1, 50),)))


def test_the_plan_takes_the_models_sizes_from_the_composed_config() -> None:
    job = compose_job(["model=dlrm", "data=synthetic_ctr", "cluster.num_trainers=8", "cluster.num_servers=4"])
    # 13 dense features -> [64, 32] -> 16; 8 tables of dim 16: 16 + 9 * 8 / 2 = 52 -> [64, 32] -> 1.
    bottom = 13 * 64 + 64 + 64 * 32 + 32 + 32 * 16 + 16
    top = 52 * 64 + 64 + 64 * 32 + 32 + 32 * 1 + 1
    assert job.workload.stages == (
        Stage(13, 16, bottom, 2.0 * (13 * 64 + 64 * 32 + 32 * 16)),
        Stage(52, 1, top, 2.0 * (52 * 64 + 64 * 32 + 32)),
    )
    assert (job.workload.batch, job.cluster.trainers, job.cluster.servers, job.cluster.mode) == (256, 8, 4, "sync")
    # Every lookup one row of 16 floats, pulled and pushed back: 2 x 256 x 8 x 16 x 4 bytes.
    assert job.workload.table_bytes == 2 * 256 * 8 * 16 * 4


def test_the_cli_prints_the_three_figures_and_the_simulated_one(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["model=mlp", "cluster.num_trainers=64", "cluster.num_servers=2", "mode=async", "link.gbit=10"]
    assert main(args) == 0
    out = capsys.readouterr().out
    for label in ("predicted samples/s:", "binding resource:    server CPU", "suggested servers:", "stated error:"):
        assert label in out
    assert "simulated" not in out
    assert main([*args, "--simulate", "sim.steps=6"]) == 0
    out = capsys.readouterr().out
    assert "simulated samples/s:" in out and "6 steps per trainer" in out


@pytest.mark.parametrize(
    ("override", "names"),
    [
        ("cluster.num_trainer=4", "num_trainer"),
        ("cluster.num_trainers=0", "cluster.num_trainers"),
        ("link.gbit=-1", "link.gbit"),
        ("link.speed=10", "speed"),
        ("sim.stragglers.kind=gamma", "sim.stragglers.kind"),
        ("model=resnet18", "model=resnet18"),
        ("cluster.num_trainers", "key=value"),
    ],
)
def test_the_cli_rejects_a_bad_override_naming_it(
    override: str, names: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["data=cifar10"] if override == "model=resnet18" else []
    assert main([*args, override]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and names in err


@pytest.mark.timeout(120)
def test_python_m_ps_train_plan_runs() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ps_train.plan", "model=cnn", "cluster.num_trainers=16", "cluster.num_servers=2"],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert done.returncode == 0, done.stderr
    assert "predicted samples/s:" in done.stdout
