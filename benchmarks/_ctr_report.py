"""ctr_bench's report: the tables (samples/s, bytes per step against the ideal, peak RSS)
and the targets, PASS or FAIL, from every round's figures. The TorchRec column is "skipped"
(the reason under the tables) where torchrec does not import."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks._format import fmt

__all__ = ["render", "BYTES_LIMIT", "TRAINER_RSS_LIMIT"]

BYTES_LIMIT = 1.25  # measured bytes per step / ideal, on every server
MULTIHOT_BYTES_LIMIT = 1.1  # multihot (bags of 20, pooled on the servers): measured / pooled ideal
TRAINER_RSS_LIMIT = 1.5e9  # bytes (1.5 GB), every trainer of the large configuration
LARGE_SPEEDUP = 2.0  # large: rpc_core / torch samples/s
SMALL_VS_SINGLE = 0.8  # small 1 + 1: rpc_core / single-process samples/s


def _median(values: Sequence[float | None]) -> float | None:
    ok = [v for v in values if v is not None]
    return statistics.median(ok) if ok else None


def _table(head: list[str], body: list[list[str]]) -> list[str]:
    """A Markdown table, the first column left-aligned and the others right-aligned."""
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]

    def line(cols: list[str]) -> str:
        return (
            "| "
            + " | ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cols, widths, strict=True))
            )
            + " |"
        )

    rule = "|" + "|".join("-" * (w + 2) if i == 0 else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|"
    return [line(head), rule, *[line(b) for b in body]]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _cell(runs: list[dict[str, Any]]) -> tuple[float | None, str]:
    v = _median([r["samples_per_s"] for r in runs])
    if v is None and runs and all(r["status"] == "skipped" for r in runs):
        return None, "skipped"
    return v, (fmt(v) if v is not None else "error")


def render(
    names: Sequence[str],
    configs: dict[str, Any],
    backends: Sequence[str],
    raw: dict[tuple[Any, ...], list[dict[str, Any]]],
    ideal: dict[tuple[str, int, int], Any],
    info: dict[str, Any],
) -> tuple[str, dict[str, Any]]:
    """The report's text and its figures (for --json)."""
    out = [
        f"{info['time']}, commit {info['commit']}; {info['cpu']}, {info['cores']} cores, "
        f"{info['memory_gib']} GiB, kernel {info['kernel']}, torch {info['torch']}; load average "
        f"{info['loadavg_start']:.2f} at start, {info['loadavg_end']:.2f} at end",
        f"command: {info['command']}",
        "",
    ]
    rows: list[dict[str, Any]] = []
    targets: list[tuple[str, float | None, bool | None, str]] = []
    notes: list[str] = []
    speed_body: list[list[str]] = []
    bytes_body: list[list[str]] = []
    rss_body: list[list[str]] = []
    for n in names:
        single, single_txt = _cell(raw[(n, "single")])
        trec, trec_txt = _cell(raw.get((n, "torchrec"), []))
        for s, t in configs[n][1]:
            label = f"{n} {s}+{t}"
            cells = {b: _cell(raw[(n, s, t, b)]) for b in backends}
            core, torch_ = cells["rpc_core"][0], cells["torch"][0]
            row: dict[str, Any] = {
                "config": label,
                "single": single,
                "torch": torch_,
                "rpc_core": core,
                "rpc_core/torch": _ratio(core, torch_),
                "rpc_core/single": _ratio(core, single),
                "torchrec": trec,
                "rpc_core/torchrec": _ratio(core, trec),
            }
            speed_body.append(
                [
                    label,
                    single_txt,
                    cells["torch"][1],
                    cells["rpc_core"][1],
                    _x(row["rpc_core/torch"]),
                    _x(row["rpc_core/single"]),
                    trec_txt if (n, "torchrec") in raw else "-",
                    _x(row["rpc_core/torchrec"]),
                ]
            )
            if (s, t) == (1, 1):
                row["max_loss_diff"] = _loss_diff(raw[(n, "single")], raw[(n, s, t, "rpc_core")])
                notes.append(
                    f"{label}: largest per-step loss difference, rpc_core vs single process: "
                    + ("-" if row["max_loss_diff"] is None else f"{row['max_loss_diff']:.2g}")
                )
            row["bytes"] = _bytes_rows(label, raw[(n, s, t, "rpc_core")], ideal[(n, s, t)], bytes_body, notes)
            worst = max((v["ratio"] for v in row["bytes"].values() if v["ratio"] is not None), default=None)
            limit = MULTIHOT_BYTES_LIMIT if n == "multihot" else BYTES_LIMIT
            targets.append(
                (
                    f"{label}: bytes/step <= {limit}x ideal on every server (rpc_core)",
                    worst,
                    None if worst is None else worst <= limit,
                    _x(worst),
                )
            )
            if n == "large":
                targets.append(
                    (
                        f"{label}: rpc_core >= {LARGE_SPEEDUP:g}x backend=torch samples/s",
                        row["rpc_core/torch"],
                        _ge(row["rpc_core/torch"], LARGE_SPEEDUP),
                        _x(row["rpc_core/torch"]),
                    )
                )
                row["peak_rss_bytes"] = _rss_rows(label, {b: raw[(n, s, t, b)] for b in backends}, rss_body)
                for b in backends:
                    worst_rss = max(
                        (v for role, v in row["peak_rss_bytes"][b].items() if role.startswith("trainer")), default=None
                    )
                    targets.append(
                        (
                            f"{label}: every trainer's peak RSS < {TRAINER_RSS_LIMIT / 1e9:g} GB ({b})",
                            worst_rss,
                            None if worst_rss is None else worst_rss < TRAINER_RSS_LIMIT,
                            "-" if worst_rss is None else f"{worst_rss / 1e9:.2f} GB",
                        )
                    )
            if n == "small" and (s, t) == (1, 1):
                targets.append(
                    (
                        f"{label}: rpc_core >= {SMALL_VS_SINGLE:g}x single-process samples/s",
                        row["rpc_core/single"],
                        _ge(row["rpc_core/single"], SMALL_VS_SINGLE),
                        _x(row["rpc_core/single"]),
                    )
                )
            if info["rounds"] > 1:
                per = [
                    _ratio(a["samples_per_s"], b["samples_per_s"])
                    for a, b in zip(raw[(n, s, t, "rpc_core")], raw[(n, s, t, "torch")], strict=True)
                ]
                notes.append(f"{label}: rpc_core/torch per round: " + ", ".join(_x(v) for v in per))
            rows.append(row)
        if n == "large":
            rss = max((r.get("peak_rss_bytes") or 0 for r in raw[(n, "single")]), default=0)
            notes.append(f"{n} single process: peak RSS {rss / 1e9:.2f} GB")
    out += _table(
        [
            "config",
            "single process",
            "ps_train torch",
            "ps_train rpc_core",
            "rpc_core/torch",
            "rpc_core/single",
            "TorchRec DLRM",
            "rpc_core/TorchRec",
        ],
        speed_body,
    )
    out += [
        "samples/s (median over rounds); ps_train: all trainers' samples over the loop of the trainer that "
        "started last; single process: one trainer's batches, 1 thread; TorchRec DLRM: torchrec.models.dlrm.DLRM, "
        "the same shapes and batches, tables fused with their optimizer (FBGEMM CPU), 1 thread",
        "",
    ]
    out += _table(["config", "server", "ideal B/step", "rpc_core B/step", "rpc_core/ideal", "torch B/step"], bytes_body)
    out += [
        "bytes sent + received per trainer step by each server; ideal: ps_train/workloads/ctr/ideal_traffic.py "
        "(backend=torch records no byte counts)",
        "",
    ]
    if rss_body:
        out += _table(["config", "role", *[f"peak RSS {b}" for b in backends]], rss_body)
        out.append("")
    out += notes
    out += ["", "targets:"]
    width = max((len(t[0]) for t in targets), default=0)
    for label, _, met, shown in targets:
        out.append(f"  {label.ljust(width)}  {shown:>9}  {'PASS' if met else 'FAIL' if met is False else 'n/a'}")
    errors = [
        (" ".join(map(str, k)), i + 1, r["error"])
        for k, v in raw.items()
        for i, r in enumerate(v)
        if r["status"] == "error"
    ]
    skipped = sorted({r["skipped"] for v in raw.values() for r in v if r["status"] == "skipped"})
    if skipped:
        out += ["", "skipped:"] + [f"  {why}" for why in skipped]
    if errors:
        out += ["", "errors:"] + [f"  {k} (round {i}): {e}" for k, i, e in errors]
    warnings = [
        (" ".join(map(str, k)), i + 1, r["warning"])
        for k, v in raw.items()
        for i, r in enumerate(v)
        if r.get("warning")
    ]
    if warnings:
        out += ["", "failed after writing metrics.json (figures kept):"]
        out += [f"  {k} (round {i}): {w}" for k, i, w in warnings]
    doc = {"rows": rows, "targets": [{"target": t[0], "value": t[1], "met": t[2]} for t in targets]}
    return "\n".join(out), doc


def _ge(v: float | None, limit: float) -> bool | None:
    return None if v is None else v >= limit


def _loss_diff(single: list[dict[str, Any]], core: list[dict[str, Any]]) -> float | None:
    ref = next((r["losses"] for r in single if r["status"] == "ok"), None)
    diffs = [
        max(abs(a - b) for a, b in zip(ref, r["losses"], strict=True))
        for r in core
        if ref is not None and r["status"] == "ok" and len(r["losses"]) == len(ref)
    ]
    return max(diffs) if diffs else None


def _bytes_rows(
    label: str, runs: list[dict[str, Any]], replay: Any, body: list[list[str]], notes: list[str]
) -> dict[str, dict[str, float | None]]:
    """Per server: the ideal, the measured median and their ratio; a note if the replayed
    batches are not the run's (their distinct rows per step differ)."""
    ok = [r for r in runs if r["status"] == "ok" and r.get("server_bytes_per_step")]
    for r in ok:
        if abs(r["rows_pulled_per_step"] - replay.rows_per_step) > 1e-6 * replay.rows_per_step:
            notes.append(
                f"{label}: WARNING the run pulled {r['rows_pulled_per_step']:.1f} rows per step, the "
                f"replayed batches {replay.rows_per_step:.1f}: the ideal is not this run's"
            )
    out: dict[str, dict[str, float | None]] = {}
    for server, want in replay.ideal_per_step.items():
        got = _median(
            [r["server_bytes_per_step"][server]["sent"] + r["server_bytes_per_step"][server]["received"] for r in ok]
        )
        out[server] = {"ideal": want, "rpc_core": got, "ratio": _ratio(got, want)}
        body.append([label, server, fmt(want), fmt(got), _x(out[server]["ratio"]), "n/a"])
    return out


def _rss_rows(label: str, runs: dict[str, list[dict[str, Any]]], body: list[list[str]]) -> dict[str, dict[str, int]]:
    """Per backend and role: the largest peak RSS over the rounds."""
    out: dict[str, dict[str, int]] = {}
    for b, rs in runs.items():
        out[b] = {}
        for r in rs:
            for role, v in (r.get("peak_rss_bytes") or {}).items():
                out[b][role] = max(out[b].get(role, 0), v)
    roles = sorted({role for v in out.values() for role in v}, key=lambda x: (not x.startswith("ps"), x))
    for role in roles:
        body.append([label, role, *[f"{out[b][role] / 1e9:.2f} GB" if role in out[b] else "-" for b in runs]])
    return out
