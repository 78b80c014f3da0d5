"""The cost model's arithmetic (ps_train/scaling/{cost_model,fit,shapes}.py): what a
step moves by hand, the fit recovering known constants from points generated with them, and
the binding resource switching where the formulas put the switch."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from ps_train.scaling.cost_model import Cluster, Constants, load_calibration, predict, server_costs
from ps_train.scaling.fit import Observation, fit, observation_from_run
from ps_train.scaling.shapes import WORKLOADS, mlp, server_loads

MLP = WORKLOADS["mlp"]
# The emulated hosts' token bucket (benchmarks/scale_hosts.py; tests import nothing from there).
LINK_BURST_BYTES = 8 * 1024
TRUE = Constants(
    beta=1.1,
    gamma=300.0,
    server_cpu_per_message=4e-4,
    server_cpu_per_byte=2e-8,
    trainer_cpu_base=2e-3,
    trainer_cpu_per_message=3e-4,
    flop_rate=5e9,
    jitter=0.2,
)


def _server_cpu(c: Constants, servers: int) -> tuple[list[float], list[float]]:
    """Each server's wire bytes and CPU seconds per trainer step, by the formulas of the doc."""
    loads = server_loads(MLP, servers)
    wire = [c.beta * ld.bytes + c.gamma * ld.messages for ld in loads]
    a, b, f = c.server_cpu_per_message, c.server_cpu_per_byte, c.flop_rate
    cpu = [a * ld.messages + b * w + ld.flops / f for ld, w in zip(loads, wire, strict=True)]
    return wire, cpu


def _synthetic(c: Constants, trainers: int, servers: int, cores: float, mode: str) -> Observation:
    """A run as the model says it goes, with the model's own per-step figures."""
    loads = server_loads(MLP, servers)
    wire, cpu = _server_cpu(c, servers)
    trainer = c.trainer_cpu_base + c.trainer_cpu_per_message * sum(ld.messages for ld in loads)
    p = predict(c, MLP, Cluster(trainers, servers, math.inf, 0.0, 1.0, 1.0, cores, mode))
    return Observation(mode, trainers, servers, 50, p.samples_per_s, trainer, tuple(cpu), tuple(wire), cores, 1.0, MLP)


def test_bytes_of_an_mlp_step_by_hand() -> None:
    # One server holds all three stages: x [32, 64] in, logits [32, 10] out, their gradient in.
    [one] = server_loads(MLP, 1)
    assert one.bytes == 32 * 4 * (64 + 10 + 10) and one.messages == 3 and one.shard
    # Two: the largest stage alone ([64 -> 128]), the other two together; the second server
    # also sends back the gradient of its input [32, 128].
    first, second = server_loads(MLP, 2)
    assert first.bytes == 32 * 4 * (64 + 128 + 128)
    assert second.bytes == 32 * 4 * (128 + 10 + 10 + 128)
    # Servers beyond the stages hold nothing: only the update request reaches them.
    *_, idle = server_loads(MLP, 5)
    assert (idle.bytes, idle.messages, idle.shard) == (0.0, 1, False)
    with pytest.raises(ValueError, match="servers must be >= 1"):
        server_loads(MLP, 0)


def test_fit_recovers_known_constants() -> None:
    obs = [_synthetic(TRUE, t, s, 1.5, "async") for t in (1, 2, 4) for s in (1, 2, 3)]
    obs += [_synthetic(TRUE, t, 2, 100.0, "sync") for t in (2, 4)]  # cores to spare: the barrier shows
    got = fit(obs, flop_rate=TRUE.flop_rate)
    for name in (
        "beta",
        "gamma",
        "server_cpu_per_message",
        "server_cpu_per_byte",
        "trainer_cpu_base",
        "trainer_cpu_per_message",
    ):
        assert getattr(got, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
    assert got.jitter_fitted and got.jitter == pytest.approx(TRUE.jitter, abs=1e-3)


def test_fit_recovers_the_cpu_of_bytes_on_a_paced_link() -> None:
    # Runs on a fast and a slow link: on the slow one every wire byte costs the server and
    # the trainer more CPU; the fit separates it from the per-byte cost everywhere.
    true = Constants(**{**TRUE.__dict__, "server_cpu_per_paced_byte": 5e-8, "trainer_cpu_per_paced_byte": 3e-8})
    obs = []
    for link in (math.inf, 1e9, 2e6):
        for t, s in ((1, 1), (2, 2), (4, 3)):
            sc = server_costs(true, MLP, s, link)
            p = predict(true, MLP, Cluster(t, s, link, 0.0, 1.0, 1.0, None, "async"))
            obs.append(
                Observation("async", t, s, 50, p.samples_per_s, sc.trainer_cpu, tuple(sc.cpu), tuple(sc.wire), 1.0,
                            1.0, MLP, link)
            )  # fmt: skip
    got = fit(obs, flop_rate=true.flop_rate)
    for name in ("server_cpu_per_byte", "server_cpu_per_paced_byte", "trainer_cpu_per_message",
                 "trainer_cpu_per_paced_byte"):  # fmt: skip
        assert getattr(got, name) == pytest.approx(getattr(true, name), rel=1e-6), name
    assert not true.paced(1e9) and true.paced(2e6)


def test_async_binding_switches_from_the_trainers_step_to_server_cpu_at_t_star() -> None:
    # Links without limit: a trainer's serial step t_1 against T x the busiest server's CPU u.
    u = max(_server_cpu(TRUE, 2)[1])
    alone = predict(TRUE, MLP, Cluster(1, 2, math.inf, 0.0, 1.0, 1.0, None, "async"))
    t_star = (1.0 / alone.steps_per_s) / u
    below, above = math.floor(t_star), math.floor(t_star) + 1
    p_below = predict(TRUE, MLP, Cluster(below, 2, math.inf, 0.0, 1.0, 1.0, None, "async"))
    p_above = predict(TRUE, MLP, Cluster(above, 2, math.inf, 0.0, 1.0, 1.0, None, "async"))
    assert p_below.binding in ("trainer CPU", "server compute on the path")
    assert p_below.samples_per_s == pytest.approx(below * alone.samples_per_s)  # linear until T*
    assert p_above.binding == "server CPU"
    assert p_above.samples_per_s == pytest.approx(MLP.batch / u)  # flat after it: the server's rate


def test_link_binds_below_the_bandwidth_the_formula_gives() -> None:
    # One server: it receives x [32, 64] and the logits' gradient [32, 10], sends the logits.
    [load] = server_loads(MLP, 1)
    assert load.received == 32 * 4 * (64 + 10)
    [w], [u] = _server_cpu(TRUE, 1)
    one_way = TRUE.beta * load.received + TRUE.gamma * load.messages / 2
    # Its link binds instead of its CPU when T one_way x 8 / B > T u, i.e. B < 8 one_way / u.
    b_switch = 8 * one_way / u
    slow = predict(TRUE, MLP, Cluster(64, 1, 0.9 * b_switch, 0.0, 1.0, 1.0, None, "async"))
    fast = predict(TRUE, MLP, Cluster(64, 1, 1.1 * b_switch, 0.0, 1.0, 1.0, None, "async"))
    assert (slow.binding, fast.binding) == ("server link", "server CPU")
    assert slow.samples_per_s == pytest.approx(MLP.batch * 0.9 * b_switch / (8 * one_way))
    # One trainer on a slow link: its own step binds, the busier way of its link (what it sends:
    # the server's in, with half of each request's framing) over the rate, after its CPU.
    alone = predict(TRUE, MLP, Cluster(1, 1, 1e5, 0.0, 1.0, 1.0, None, "async"))
    cpu = TRUE.trainer_cpu_base + 3 * TRUE.trainer_cpu_per_message + u
    assert alone.binding == "trainer link"
    assert 1 / alone.steps_per_s == pytest.approx(cpu + one_way * 8 / 1e5)


def test_latency_binds_a_lone_trainer_on_a_long_link_and_sync_pays_the_barrier() -> None:
    far = predict(TRUE, MLP, Cluster(1, 3, 100e9, 0.01, 1.0, 1.0, None, "async"))
    assert far.binding == "round trips"
    assert far.steps_per_s < 1 / (7 * 2 * 0.01)  # 3 shards: 2 x 3 + 1 round trips of 20 ms
    # Below the servers' limit sync pays the slowest of T trainers' own steps, a barrier that
    # grows with T, on a step that sends its next forward without waiting for its update's
    # answer (c1 and a round trip less); at the limit the servers, working in parallel and
    # serving one trainer while the others compute, bind both modes alike.
    for t in (2, 8, 64):
        cl = Cluster(t, 3, 10e9, 5e-5, 1.0, 1.0, None, "async")
        a = predict(TRUE, MLP, cl)
        s = predict(TRUE, MLP, Cluster(**{**cl.__dict__, "mode": "sync"}))
        if a.binding != "server CPU":
            own = (1 / a.steps_per_s - TRUE.trainer_cpu_per_message - 2 * 5e-5) * (
                1 + TRUE.jitter * math.sqrt(2 * math.log(t))
            )
            assert s.steps_per_s == pytest.approx(1 / own)
        else:
            assert s.samples_per_s == pytest.approx(a.samples_per_s)
    jittery = Constants(**{**TRUE.__dict__, "jitter": 50.0})
    assert predict(jittery, MLP, Cluster(8, 3, 10e9, 5e-5, 1.0, 1.0, None, "sync")).binding == "sync barrier"
    with pytest.raises(ValueError, match="mode must be one of sync, async, ssp, hybrid"):
        Cluster(1, 1, 1e9, 0.0, 1.0, 1.0, None, "bsp")


def test_a_scale_bench_record_becomes_an_observation() -> None:
    run = {
        "mode": "async",
        "trainers": 2,
        "servers": 1,
        "steps": 10,
        "samples_per_s": 640.0,
        "samples": 640,
        "overrides": ["model.hidden_sizes=[16,16]"],
        "server_bytes_per_step": {"ps0": {"sent": 100.0, "received": 300.0}},
        "role_cpu": {n: {"training_s": v} for n, v in (("ps0", 0.4), ("trainer0", 9.0), ("trainer1", 0.1))},
        "cores_used": 0.5,
        "load_mean": 3.0,
    }
    o = observation_from_run(run)
    assert o is not None
    # trainer0's CPU (it also evaluates) is left out when there are others; the server's is per trainer step.
    assert (o.trainer_cpu_per_step, o.server_cpu_per_step, o.server_bytes_per_step) == (0.01, (0.02,), (400.0,))
    assert o.workload == mlp((16, 16), 32)  # its overrides and samples / (trainers x steps)
    assert observation_from_run({**run, "samples_per_s": None}) is None
    assert observation_from_run({**run, "overrides": ["model=cnn"]}) is None  # the fit takes MLPs
    # With a steady window, its figures: every trainer's CPU over its steps, its rate and cores.
    cpu = {"ps0": 0.8, "trainer0": 0.2, "trainer1": 0.4}
    window = {"steps": 20, "seconds": 2.0, "cpu_s": cpu, "samples_per_s": 700.0, "cores_used": 0.7}
    o = observation_from_run({**run, "steady": window})
    assert o is not None
    assert o.trainer_cpu_per_step == pytest.approx(0.015)
    assert o.server_cpu_per_step == pytest.approx((0.02,))
    assert (o.samples_per_s, o.cores_used, o.server_bytes_per_step) == (700.0, 0.7, (400.0,))


@pytest.mark.timeout(120)
def test_scale_calibrate_refits_recorded_host_runs_into_a_calibration(tmp_path: Path) -> None:
    # Runs as the model says they go on hosts of a quarter core: each rank's CPU over a 60- and
    # a 240-step run (a start-up cost of 3 s each), its bytes, and its samples/s.
    cores, steps, records = 0.25, (60, 240), []
    for t, s in ((2, 1), (4, 1), (4, 2), (8, 2)):
        wire, cpu = _server_cpu(TRUE, s)
        trainer = TRUE.trainer_cpu_base + TRUE.trainer_cpu_per_message * sum(ld.messages for ld in server_loads(MLP, s))
        for mode in ("async", "sync"):
            for kbit in (1e6, 2e4):
                cl = Cluster(t, s, kbit * 1e3, 0.0, cores, cores, None, mode, LINK_BURST_BYTES)  # as the hosts
                p = predict(TRUE, MLP, cl)
                ranks = [[3.0 + n * t * u for u in cpu] + [3.0 + n * trainer] * t for n in steps]
                point = {"trainers": t, "servers": s, "mode": mode, "rate_kbit": kbit}
                records.append(
                    {"point": point, "cores": cores, "steps": list(steps), "rank_cpu_s": ranks,
                     "samples_per_s": p.samples_per_s, "server_bytes_per_step": wire, "load": [0.1, 0.2]}
                )  # fmt: skip
    raw, out = tmp_path / "records.json", tmp_path / "calibration.json"
    raw.write_text(json.dumps(records))
    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "benchmarks.scale_calibrate", "--out", str(out), "--from-records", str(raw)]
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    cal = load_calibration(out)
    for name in ("beta", "gamma", "server_cpu_per_message", "trainer_cpu_base", "trainer_cpu_per_message"):
        assert getattr(cal.constants, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
    assert cal.constants.jitter == pytest.approx(TRUE.jitter, abs=1e-3)
    assert cal.error_where_fitted < 0.01 and "largest error 0%" in done.stdout
    assert cal.machine.cpus >= 1 and "scale_calibrate" in cal.machine.method
