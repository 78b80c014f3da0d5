"""The cost model and the SimPy simulator against runs on emulated hosts: every grid point of a
``scale_calibrate.py`` record file, then a straggler and a killed trainer.

    python -m benchmarks.scale_check --calibration ps_train/scaling/calibration_emulated.json \\
        --records emu_runs.json [--events events.json] [--result]
    sudo python -m benchmarks.scale_check ... --run-events events.json [--point 4x1] [--mode sync] \\
        [--cores 0.1] [--straggler-cores 0.05] [--steps 240] [--kill-after-step 120] [--kill-delay 3]

For each grid point: the measured samples/s (the long run's), the model's (``predict``) and the
simulator's (``simulate``, the same cluster: one rank per host at the record's cores, its link
rate, no delay), with their errors. ``--run-events`` measures, on emulated hosts
(``scale_hosts.run``), a baseline job, the same job with the last trainer's host at
``--straggler-cores`` (the simulator's ``one_in`` straggler, ``factor`` = cores / straggler
cores) and with trainer 1 SIGKILLed ``--kill-delay`` s after the checkpoint of step
``--kill-after-step``, the job then restarted from it as torchrun would; it writes them to the
file, which ``--events`` reads back. The kill is compared by the time it cost (its run's
elapsed time minus the baseline's) against the simulator's (the same ``Kill``, restarting in
``restart_s`` = the baseline's time outside its steady training: start-up, warm-up, shutdown).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks._results import add_result_option, run_recorded
from benchmarks.scale_calibrate import Record, cluster_of, record_from
from benchmarks.scale_hosts import CPU_PERIOD_S, LINK_BURST_BYTES
from ps_train.plan.simulator import Failures, Kill, Stragglers, simulate
from ps_train.plan.steps import step_plan
from ps_train.scaling.cost_model import Cluster, Constants, load_calibration, predict
from ps_train.scaling.shapes import mlp

SIM_STEPS = 60  # per trainer, for a grid point: the first is the warm-up


@dataclass(frozen=True)
class EventRuns:
    """One job on emulated hosts three ways: as is, with a straggler, with a killed trainer."""

    trainers: int
    servers: int
    mode: str
    rate_kbit: float
    cores: float
    straggler_cores: float
    steps: int
    kill_after_step: int
    kill_delay_s: float
    baseline: dict[str, float]  # samples_per_s, elapsed_s, wall_time_s
    straggler: dict[str, float]
    killed: dict[str, float]
    load: tuple[float, float]


def _err(x: float, measured: float) -> str:
    return f"{(x - measured) / measured:+.0%}"


def grid_table(c: Constants, records: list[Record]) -> tuple[list[str], float, float]:
    """The grid's table, and the model's and the simulator's largest errors."""
    rows = [
        "| point TxS | mode | link kbit/s | cores/host | measured samples/s | model | error | simulator | error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    worst_m = worst_s = 0.0
    for r in records:
        cl = cluster_of(r)
        m = predict(c, mlp(), cl).samples_per_s
        s = simulate(cl, step_plan(c, mlp(), cl.servers, cl.link_bps), SIM_STEPS).samples_per_s
        worst_m = max(worst_m, abs(m / r.samples_per_s - 1))
        worst_s = max(worst_s, abs(s / r.samples_per_s - 1))
        p = r.point
        rows.append(
            f"| {p.trainers}x{p.servers} | {p.mode} | {p.rate_kbit:g} | {r.cores:g} | {r.samples_per_s:,.0f} | "
            f"{m:,.0f} | {_err(m, r.samples_per_s)} | {s:,.0f} | {_err(s, r.samples_per_s)} |"
        )
    return rows, worst_m, worst_s


def _steady_s(run: dict[str, float], ev: EventRuns) -> float:
    """A run's steady training time: its samples at its steady rate."""
    return ev.steps * ev.trainers * mlp().batch / run["samples_per_s"]


def event_table(c: Constants, ev: EventRuns) -> list[str]:
    cl = Cluster(
        ev.trainers, ev.servers, ev.rate_kbit * 1e3, 0.0, ev.cores, ev.cores, None, ev.mode,
        LINK_BURST_BYTES, CPU_PERIOD_S,
    )  # fmt: skip
    plan = step_plan(c, mlp(), ev.servers, cl.link_bps)
    model = predict(c, mlp(), cl).samples_per_s
    free = simulate(cl, plan, ev.steps)
    factor = ev.cores / ev.straggler_cores  # the same CPU work on a smaller budget
    strag = simulate(cl, plan, ev.steps, Stragglers("one_in", every=ev.trainers, factor=factor)).samples_per_s
    restart_s = ev.baseline["elapsed_s"] - _steady_s(ev.baseline, ev)
    kill = Kill(1, ev.kill_after_step, ev.kill_delay_s)
    killed = simulate(cl, plan, ev.steps, failures=Failures(checkpoint_every=ev.kill_after_step, restart_s=restart_s,
                                                            kills=(kill,)))  # fmt: skip
    lost_sim = killed.sim_seconds - free.sim_seconds
    lost = ev.killed["elapsed_s"] - ev.baseline["elapsed_s"]
    b, s = ev.baseline["samples_per_s"], ev.straggler["samples_per_s"]
    return [
        f"Events: {ev.mode} {ev.trainers}x{ev.servers} at {ev.rate_kbit:g} kbit/s, {ev.cores:g} cores a host, "
        f"{ev.steps} steps (load {ev.load[0]:.1f}-{ev.load[1]:.1f})",
        "",
        "| run | measured | model | error | simulator | error |",
        "|---|---|---|---|---|---|",
        f"| baseline, samples/s | {b:,.0f} | {model:,.0f} | {_err(model, b)} | {free.samples_per_s:,.0f} | "
        f"{_err(free.samples_per_s, b)} |",
        f"| last trainer at {ev.straggler_cores:g} cores (x{factor:g}), samples/s | {s:,.0f} | {model:,.0f} "
        f"(knows no straggler) | {_err(model, s)} | {strag:,.0f} | {_err(strag, s)} |",
        f"| trainer 1 killed {ev.kill_delay_s:g} s after the checkpoint of step {ev.kill_after_step}, "
        f"seconds lost | {lost:,.1f} | - | - | {lost_sim:,.1f} (restart {restart_s:.1f} s, "
        f"{killed.steps_lost} steps lost) | {_err(lost_sim, lost)} |",
    ]


def _measure(args: argparse.Namespace) -> EventRuns:
    from benchmarks.scale_hosts import KillPlan, run  # needs root and network namespaces

    t, _, s = args.point.partition("x")
    trainers, servers = int(t), int(s)

    def one(**kw: Any) -> dict[str, float]:
        m = run(trainers, servers, args.steps, args.rate_kbit, args.timeout, args.cores, args.mode, **kw)
        print(f"[check] {kw or 'baseline'}: {m['samples_per_s']:,.1f} samples/s, {m['elapsed_s']:.1f} s", flush=True)
        return {k: float(m[k]) for k in ("samples_per_s", "elapsed_s", "wall_time_s")}

    before = os.getloadavg()[0]
    base = one()
    strag = one(straggler_cores=args.straggler_cores)
    killed = one(kill=KillPlan(1, args.kill_after_step, args.kill_delay))
    return EventRuns(
        trainers, servers, args.mode, args.rate_kbit, args.cores, args.straggler_cores, args.steps,
        args.kill_after_step, args.kill_delay, base, strag, killed, (before, os.getloadavg()[0]),
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calibration", type=Path, required=True)
    ap.add_argument("--records", type=Path, required=True, help="scale_calibrate.py --records")
    ap.add_argument("--events", type=Path, default=None, help="event runs measured before (--run-events)")
    ap.add_argument("--run-events", type=Path, default=None, help="measure the event runs, write them here")
    ap.add_argument("--point", default="4x1", help="TxS of the event runs")
    ap.add_argument("--mode", choices=("async", "sync"), default="sync")
    ap.add_argument("--rate-kbit", type=float, default=1_000_000.0)
    ap.add_argument("--cores", type=float, default=0.1)
    ap.add_argument("--straggler-cores", type=float, default=0.05)
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--kill-after-step", type=int, default=120)
    ap.add_argument("--kill-delay", type=float, default=3.0)
    ap.add_argument("--timeout", type=float, default=1800.0)
    add_result_option(ap, "scale_check")
    args = ap.parse_args()
    cal = load_calibration(args.calibration)
    records = [record_from(d) for d in json.loads(args.records.read_text())]
    print(f"Calibration {args.calibration} ({cal.machine.description}; {cal.machine.date}, {cal.machine.commit})")
    print()
    rows, worst_m, worst_s = grid_table(cal.constants, records)
    print("\n".join(rows))
    print()
    print(f"largest error: model {worst_m:.0%}, simulator {worst_s:.0%} over {len(records)} grid runs")
    events: list[EventRuns] = []
    if args.run_events:
        events = [_measure(args)]
        args.run_events.write_text(json.dumps([asdict(e) for e in events], indent=1) + "\n")
    elif args.events:
        events = [EventRuns(**{**d, "load": tuple(d["load"])}) for d in json.loads(args.events.read_text())]
    for ev in events:
        print()
        print("\n".join(event_table(cal.constants, ev)))


if __name__ == "__main__":
    sys.exit(run_recorded("scale_check", main))
