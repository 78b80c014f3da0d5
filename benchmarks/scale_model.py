"""A cost model of ps_train: fit per-step constants on measured runs, predict samples/s and the
binding resource for any trainers x servers x link x cores, check it, and size jobs.

    python -m benchmarks.scale_model fit RUNS.json [...] --out constants.json
    python -m benchmarks.scale_model predict constants.json --trainers 64 --servers 4 \\
        [--workload mlp] [--link-gbit 10] [--latency-us 50] [--trainer-cores 1] \\
        [--server-cores 1] [--shared-cores N] [--mode async]
    python -m benchmarks.scale_model validate constants.json RUNS.json [...]
    python -m benchmarks.scale_model plan constants.json [--png docs/scaling_plan.png]

RUNS.json: what ``scale_bench.py --json`` writes; constants.json: a calibration
(``ps_train/scaling/calibration.json``, what ``scale_calibrate.py`` writes) or the bare
constants ``fit`` prints. The arithmetic is ``ps_train/scaling/cost_model.py`` and
``fit.py``; what a step moves and computes per model is ``ps_train/scaling/shapes.py``;
docs/scaling.md explains them and holds the fitted figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from ps_train.scaling.cost_model import (
    Cluster,
    Constants,
    Prediction,
    busier_way,
    load_calibration,
    predict,
    suggest_servers,
)
from ps_train.scaling.fit import Observation, fit, measured_as_cluster, observation_from_run
from ps_train.scaling.shapes import WORKLOADS

PLAN_TRAINERS = (64, 256, 1024)
PLAN_LINKS_GBIT = (10, 25, 100)


def _runs(paths: list[Path]) -> list[Observation]:
    obs = []
    for p in paths:
        for run in json.loads(p.read_text()):
            o = observation_from_run(run)
            if o is None:
                print(f"[model] skipped a run of {p} without metrics (exit {run.get('exit_code')})", file=sys.stderr)
            else:
                obs.append(o)
    if not obs:
        raise SystemExit("no usable runs: each needs metrics.json figures and role CPU (scale_bench.py --json)")
    return obs


def _constants(path: Path) -> Constants:
    """The constants of a calibration file, or of a file of bare constants (``fit --out``)."""
    raw = json.loads(path.read_text())
    return load_calibration(path).constants if "constants" in raw else Constants(**raw)


def cmd_fit(args: argparse.Namespace) -> None:
    c = fit(_runs(args.runs), flop_rate=args.flop_rate)
    text = json.dumps(dataclasses.asdict(c), indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


def cmd_predict(args: argparse.Namespace) -> None:
    c = _constants(args.constants)
    cl = Cluster(
        args.trainers,
        args.servers,
        args.link_gbit * 1e9,
        args.latency_us * 1e-6,
        args.trainer_cores,
        args.server_cores,
        args.shared_cores,
        args.mode,
    )
    p = predict(c, WORKLOADS[args.workload], cl)
    print(f"{p.samples_per_s:,.0f} samples/s ({p.steps_per_s:.1f} steps/s per trainer); binds: {p.binding}")
    for name, rate in sorted(p.bounds.items(), key=lambda kv: kv[1]):
        print(f"  {name:<22} <= {rate:10.1f} steps/s per trainer")


def validation_rows(c: Constants, obs: list[Observation]) -> list[dict[str, Any]]:
    """Predicted vs measured samples/s of each run, with the cores it got as the machine."""
    rows = []
    for o in obs:
        p = predict(c, o.workload, measured_as_cluster(o))
        err = (p.samples_per_s - o.samples_per_s) / o.samples_per_s
        rows.append(
            {
                "mode": o.mode,
                "model": f"mlp {[st.out_floats for st in o.workload.stages[:-1]]}, batch {o.workload.batch}",
                "trainers": o.trainers,
                "servers": o.servers,
                "cores_used": o.cores_used,
                "load": o.load,
                "measured": o.samples_per_s,
                "predicted": p.samples_per_s,
                "error": err,
                "binding": p.binding,
            }
        )
    return rows


def cmd_validate(args: argparse.Namespace) -> None:
    rows = validation_rows(_constants(args.constants), _runs(args.runs))
    print("| model | mode | T | S | cores got | load | measured samples/s | predicted | error | binds |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['mode']} | {r['trainers']} | {r['servers']} | "
            f"{r['cores_used']:.2f} | {r['load']:.0f} | "
            f"{r['measured']:,.0f} | {r['predicted']:,.0f} | {r['error']:+.0%} | {r['binding']} |"
        )
    worst = max(abs(r["error"]) for r in rows)
    print(f"\nlargest error {worst:.0%} ({'within' if worst <= 0.25 else 'OUTSIDE'} the 25% target)")
    _plot_validation(rows, args.png)


def _pyplot(png: Path) -> Any:
    """matplotlib's pyplot (headless), or None when it is not installed (then no ``png``)."""
    try:
        import matplotlib  # type: ignore[import-not-found, unused-ignore]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        print(f"\n(matplotlib is not installed, `pip install matplotlib`: no {png}; the table above is its data)")
        return None
    return plt


def _plot_validation(rows: list[dict[str, Any]], png: Path | None) -> None:
    """Measured against predicted samples/s, one point a run, with the +-25% band."""
    if png is None or (plt := _pyplot(png)) is None:
        return
    fig, ax = plt.subplots(figsize=(4.5, 4.2))
    lo = 0.8 * min(min(r["measured"], r["predicted"]) for r in rows)
    hi = 1.25 * max(max(r["measured"], r["predicted"]) for r in rows)
    ax.loglog([lo, hi], [lo, hi], color="black", linewidth=0.8, label="predicted = measured")
    ax.fill_between([lo, hi], [lo * 0.75, hi * 0.75], [lo * 1.25, hi * 1.25], color="grey", alpha=0.2, label="+-25%")
    ax.scatter([r["measured"] for r in rows], [r["predicted"] for r in rows], label="runs")
    ax.set_xlabel("measured samples/s")
    ax.set_ylabel("predicted samples/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    print(f"\nwrote {png}")


def servers_needed(c: Constants, workload: str, trainers: int, link: float, latency: float) -> tuple[int, Prediction]:
    """The fewest servers with which ``trainers`` async trainers reach 95% of the best (``suggest_servers``)."""
    return suggest_servers(c, WORKLOADS[workload], Cluster(trainers, 1, link, latency, 1.0, 1.0, None, "async"))


def cmd_plan(args: argparse.Namespace) -> None:
    c = _constants(args.constants)
    lat = args.latency_us * 1e-6
    print(f"one-way latency {args.latency_us} us, one core per trainer and per server (one Python process each)\n")
    print("## Servers needed (async: the fewest for 95% of the best), samples/s with them")
    print("| model | trainers | link | servers | samples/s | binds | of T lone trainers | busiest server's link used |")
    print("|---|---|---|---|---|---|---|---|")
    for name, w in WORKLOADS.items():
        for t in PLAN_TRAINERS:
            rows = []
            for g in PLAN_LINKS_GBIT:
                s, p = servers_needed(c, name, t, g * 1e9, lat)
                lone = predict(c, w, Cluster(1, s, g * 1e9, lat, 1.0, 1.0, None, "async"))
                share = p.samples_per_s / (t * lone.samples_per_s)  # of what the trainers alone would do
                used = p.steps_per_s * t * max(busier_way(c, w, s)) * 8 / (g * 1e9)
                rows.append((g, f"{s} | {p.samples_per_s:,.0f} | {p.binding}", f"{share:.1%}", f"{used:.1%}"))
            if len({r[1] for r in rows}) == 1:  # the link does not change the answer: one row
                shares, uses = ", ".join(r[2] for r in rows), ", ".join(r[3] for r in rows)
                links = "/".join(str(g) for g in PLAN_LINKS_GBIT)
                print(f"| {name} | {t} | {links} Gbit/s | {rows[0][1]} | {shares} | {uses} |")
            else:
                for g, text, share_text, used_text in rows:
                    print(f"| {name} | {t} | {g} Gbit/s | {text} | {share_text} | {used_text} |")
    print("\n## Sync vs async, 10 Gbit/s, with the servers the table above gives 64 trainers")
    print("| model | servers | trainers | async samples/s | sync samples/s | async/sync | sync binds |")
    print("|---|---|---|---|---|---|---|")
    curves: dict[str, list[tuple[int, float, float]]] = {}
    for name, w in WORKLOADS.items():
        s = servers_needed(c, name, 64, 10e9, lat)[0]
        curve = []
        for k in range(0, 13):
            t = 2**k
            a = predict(c, w, Cluster(t, s, 10e9, lat, 1.0, 1.0, None, "async"))
            y = predict(c, w, Cluster(t, s, 10e9, lat, 1.0, 1.0, None, "sync"))
            curve.append((t, a.samples_per_s, y.samples_per_s))
            if t in (1, 4, 16, 64, 256, 1024):
                print(
                    f"| {name} | {s} | {t} | {a.samples_per_s:,.0f} | {y.samples_per_s:,.0f} | "
                    f"{a.samples_per_s / y.samples_per_s:.2f} | {y.binding} |"
                )
        curves[name] = curve
        stop = next((t for (t, _, y), (_, _, y2) in zip(curve, curve[1:], strict=False) if y2 < 1.1 * y), None)
        print(f"| {name} | {s} | sync stops scaling (doubling T adds < 10%) at T = {stop} | | | | |")
    _plot(curves, args.png)


def _plot(curves: dict[str, list[tuple[int, float, float]]], png: Path | None) -> None:
    if png is None or (plt := _pyplot(png)) is None:
        return
    fig, axes = plt.subplots(1, len(curves), figsize=(4 * len(curves), 3.2))
    for ax, (name, curve) in zip(axes, curves.items(), strict=True):
        ts = [t for t, _, _ in curve]
        ax.loglog(ts, [a for _, a, _ in curve], label="async")
        ax.loglog(ts, [y for _, _, y in curve], label="sync")
        ax.set_title(name)
        ax.set_xlabel("trainers")
    axes[0].set_ylabel("samples/s (predicted)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    print(f"\nwrote {png}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fit", help="runs -> constants")
    f.add_argument("runs", type=Path, nargs="+")
    f.add_argument("--out", type=Path)
    f.add_argument("--flop-rate", type=float, default=5e9, help="a core's FLOP/s on these small ops (assumed)")
    p = sub.add_parser("predict", help="samples/s and the binding resource of one cluster")
    p.add_argument("constants", type=Path)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="mlp")
    p.add_argument("--trainers", type=int, required=True)
    p.add_argument("--servers", type=int, required=True)
    p.add_argument("--link-gbit", type=float, default=10.0, help="each host's link, each way")
    p.add_argument("--latency-us", type=float, default=50.0, help="one way")
    p.add_argument("--trainer-cores", type=float, default=1.0)
    p.add_argument("--server-cores", type=float, default=1.0)
    p.add_argument("--shared-cores", type=float, default=None, help="all ranks on one machine with this many cores")
    p.add_argument("--mode", choices=("async", "sync"), default="async")
    v = sub.add_parser("validate", help="predicted vs measured samples/s")
    v.add_argument("constants", type=Path)
    v.add_argument("runs", type=Path, nargs="+")
    v.add_argument("--png", type=Path, default=None, help="also plot measured against predicted")
    pl = sub.add_parser("plan", help="servers needed for 64/256/1024 trainers; sync vs async")
    pl.add_argument("constants", type=Path)
    pl.add_argument("--latency-us", type=float, default=50.0)
    pl.add_argument("--png", type=Path, default=None)
    args = ap.parse_args()
    {"fit": cmd_fit, "predict": cmd_predict, "validate": cmd_validate, "plan": cmd_plan}[args.cmd](args)


if __name__ == "__main__":
    main()
