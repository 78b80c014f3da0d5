"""What a run shows: the servers' sampled TensorBoard metrics, the dashboard at tb/ (custom
scalars, HParams), profiler traces per role read back as one job, the console's warnings
and summary."""

import io
import json
import logging
import re
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.hparams import plugin_data_pb2

from ps_train.metrics import TensorBoardWriter
from ps_train.observe.console import CONSOLE, ConsoleHandler, summary_lines
from ps_train.observe.dashboard import LAYOUT, METRICS, SWEPT
from ps_train.observe.server_metrics import ByteCounts, ServerMetrics, UpdateCounters
from ps_train.observe.traces import TraceError, TraceEvent, load_job_traces, write_trace
from tests.ps_train._app import QUICK, cli, read_json, scalars


def _accumulator(tb_dir: Path) -> EventAccumulator:
    ea = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0, "tensors": 0, "histograms": 0})
    ea.Reload()
    return ea


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class _FakeServer:
    def __init__(self, tables: bool) -> None:
        self.version = 0
        self.counters = UpdateCounters()
        self.rows = {"rows_read": 0, "rows_updated": 0, "rows_live": 0} if tables else None

    def table_counts(self) -> dict[str, int]:
        return dict(self.rows) if self.rows is not None else {}


def test_server_metrics_are_rates_over_the_sampled_interval(tmp_path):
    clock, server = _Clock(), _FakeServer(tables=True)
    moved = [ByteCounts(1000, 500)]
    with TensorBoardWriter(tmp_path) as w:
        sampler = ServerMetrics(server, w, 1.0, staleness=True, byte_counts=lambda: moved[-1], clock=clock)
        # 2 s in which 4 updates were applied (10 ms each), with staleness 0, 1, 1, 4.
        for tau in (0, 1, 1, 4):
            server.counters.contributed()
            server.counters.applied(0.010)
            server.counters.stale(tau)
            server.version += 1
        server.rows.update(rows_read=300, rows_updated=120, rows_live=90)
        moved.append(ByteCounts(1000 + 4000, 500 + 6000, 3))
        clock.t += 2.0
        out = sampler.sample()
        clock.t += 1.0  # an idle second
        idle = sampler.sample()
    assert out["server/updates_per_s"] == pytest.approx(2.0)
    assert out["server/update_time_ms"] == pytest.approx(10.0)
    assert out["server/staleness_mean"] == pytest.approx(1.5)
    assert out["server/rows_read_per_s"] == pytest.approx(150.0)
    assert out["server/rows_updated_per_s"] == pytest.approx(60.0)
    assert out["server/rows_live"] == 90.0
    assert out["server/bytes_in_per_s"] == pytest.approx(2000.0)
    assert out["server/bytes_out_per_s"] == pytest.approx(3000.0)
    assert out["server/requests_in_flight"] == 3.0  # a level when sampled, not a rate
    assert out["server/peak_rss_mb"] > 10
    assert "server/contributions_per_round" not in out  # async/ssp: one gradient per update
    assert idle["server/updates_per_s"] == 0.0 and "server/staleness_mean" not in idle
    ea = _accumulator(tmp_path)
    assert [(e.step, e.value) for e in ea.Scalars("server/updates_per_s")] == [(4, 2.0), (4, 0.0)]
    (hist,) = ea.Histograms("server/staleness")
    assert hist.step == 4 and hist.histogram_value.num == 4 and hist.histogram_value.sum == 6.0
    assert (hist.histogram_value.min, hist.histogram_value.max) == (0.0, 4.0)


def test_sync_servers_report_gradients_per_round(tmp_path):
    clock, server = _Clock(), _FakeServer(tables=False)
    with TensorBoardWriter(tmp_path) as w:
        sampler = ServerMetrics(server, w, 1.0, staleness=False, clock=clock)
        for _ in range(3):  # 3 rounds of 2 trainers
            server.counters.contributed()
            server.counters.contributed()
            server.counters.applied(0.001)
            server.version += 1
        clock.t += 1.0
        out = sampler.sample()
    assert out["server/contributions_per_round"] == pytest.approx(2.0)
    assert not any(k.startswith("server/rows") or k.startswith("server/bytes") for k in out)


def _trace(path, role, rank, world, events):
    write_trace(path / f"{role}.json", role, rank, world, events)


def test_job_traces_need_distinct_ranks_and_one_world_size(tmp_path):
    ev = [TraceEvent("aten::add", 1_000_000.0, 5.0, 1, "cpu_op")]
    _trace(tmp_path, "ps0", 0, 2, ev)
    _trace(tmp_path, "trainer0", 1, 2, [ev[0]._replace(start_us=1_000_010.0)])
    job = load_job_traces(tmp_path)
    assert sorted(job.roles) == [0, 1] and job.roles[1].role == "trainer0"
    assert [(r, e.start_us) for r, e in job.events()] == [(0, 1_000_000.0), (1, 1_000_010.0)]  # wall clock back
    _trace(tmp_path, "trainer1", 1, 2, ev)
    with pytest.raises(TraceError, match="rank 1 is also"):
        load_job_traces(tmp_path)
    (tmp_path / "trainer1.json").write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(TraceError, match="no distributedInfo"):
        load_job_traces(tmp_path)


def test_marked_warnings_reach_the_console_one_line_each(tmp_path):
    stream = io.StringIO()
    log = logging.getLogger("ps_train.test_console")
    handler = ConsoleHandler("trainer1", stream)
    log.addHandler(handler)
    try:
        log.warning("data=criteo: skipped 2 malformed of 50 lines\nfirst: ...", extra=CONSOLE)
        log.warning("only in the role's log")
    finally:
        log.removeHandler(handler)
    assert stream.getvalue() == "[trainer1] warning: data=criteo: skipped 2 malformed of 50 lines\n"


def test_summary_has_a_line_per_role():
    servers = [{"version": 10, "update_seconds": 0.02, "peak_rss_bytes": 3e8, "bytes_received": 2e6, "bytes_sent": 1e6}]
    trainers = [{"trainer": "trainer0", "steps": 10, "samples_per_s": 1234.5, "peak_rss_bytes": 2e8}]
    assert summary_lines(trainers, servers) == [
        "  ps0: 10 updates (2.00 ms each), 2.0 MB in / 1.0 MB out, peak RSS 300.0 MB",
        "  trainer0: 10 steps, 1,234 samples/s, peak RSS 200.0 MB",
    ]


@pytest.mark.timeout(240)
def test_an_async_run_shows_its_servers_dashboard_and_traces(tmp_path):
    # Run as a user does (``python -m ps_train``): the roles print the summary on the
    # console of the command that started them.
    run_dir = tmp_path / "run"
    r = cli(
        *QUICK,
        "mode=async",
        "train.steps=12",
        "logging.server_every=0.2",
        "profile.enabled=true",
        "profile.warmup=3",
        "profile.steps=3",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        timeout=180,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    m = read_json(run_dir / "metrics.json")
    out = r.stdout
    # The servers' own TensorBoard runs: the last sample is at the server's final version.
    for r in (0, 1):
        ea = _accumulator(run_dir / "tb" / f"ps{r}")
        tags = set(ea.Tags()["scalars"])
        want = {"server/updates_per_s", "server/update_time_ms", "server/staleness_mean", "server/bytes_in_per_s"}
        assert want <= tags, sorted(tags)
        assert ea.Scalars("server/updates_per_s")[-1].step == m["server_updates"][r] == 24
        stale = ea.Histograms("server/staleness")
        assert sum(h.histogram_value.num for h in stale) == 24  # every applied update, once
        assert max(h.histogram_value.max for h in stale) <= m["max_staleness"]
    # No one-point hparam/* cards; the HParams experiment and layout sit at tb/ itself.
    for role in ("trainer0", "trainer1", "ps0", "ps1"):
        assert not [t for t in scalars(run_dir / "tb" / role) if t.startswith("hparam/")]
    root = _accumulator(run_dir / "tb")
    hp = root.PluginTagToContent("hparams")
    exp = plugin_data_pb2.HParamsPluginData.FromString(hp["_hparams_/experiment"]).experiment
    assert [h.name for h in exp.hparam_infos] == list(SWEPT)
    assert [(x.name.group, x.name.tag) for x in exp.metric_infos] == [(x.role, x.tag) for x in METRICS]
    start = plugin_data_pb2.HParamsPluginData.FromString(hp["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["mode.name"].string_value == "async"
    assert start.hparams["optim.lr"].number_value == pytest.approx(0.05)
    assert set(start.hparams) <= set(SWEPT) and "checkpoint.every" not in start.hparams
    assert "_hparams_/session_end_info" in hp
    # Every declared metric the run has is a curve trainer0 wrote.
    t0 = scalars(run_dir / "tb" / "trainer0")
    assert {x.tag for x in METRICS if x.tag != "test/auc"} <= set(t0)
    (layout_tag,) = root.Tags()["tensors"]
    layout = layout_pb2.Layout.FromString(root.Tensors(layout_tag)[0].tensor_proto.string_val[0])
    assert [c.title for c in layout.category] == list(LAYOUT)
    # Traces: one per role, distinct ranks, and each server's events lie inside the trainer
    # RPC that asked for them (one timeline for the job).
    job = load_job_traces(run_dir / "traces")
    assert {t.role: r for r, t in job.roles.items()} == {"ps0": 0, "ps1": 1, "trainer0": 2, "trainer1": 3}
    assert {t.world_size for t in job.roles.values()} == {4}
    rpcs = {}
    for r in (2, 3):
        for e in job.roles[r].events:
            if e.cat == "rpc":
                rpcs.setdefault(e.name, []).append(e)
    for r in (0, 1):
        served = job.roles[r].events
        assert served
        for e in served:
            caller, _, _ = e.name.partition("#remote_op: ")
            assert caller.endswith(f"-> ps{r})")
            assert any(
                c.start_us - 1 <= e.start_us and e.start_us + e.dur_us <= c.start_us + c.dur_us + 1
                for c in rpcs[caller]
            )
    # The console: one summary line per role.
    for role, n in (("ps0", 24), ("ps1", 24)):
        assert re.search(rf"^  {role}: {n} updates \(.* ms each\), .* MB in / .* MB out, peak RSS", out, re.M), out
    for role in ("trainer0", "trainer1"):
        assert re.search(rf"^  {role}: 12 steps, [\d,]+ samples/s, .* MB in", out, re.M), out


def test_a_role_with_logging_quiet_still_shows_marked_warnings(tmp_path, capfd):
    from ps_train.launch.rank import setup_role_logging

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        setup_role_logging(str(tmp_path), "ps0", "WARNING")  # logging=quiet's level
        log = logging.getLogger("ps_train")
        log.warning("trainer2 joined the job; 3 trainer(s) now", extra=CONSOLE)
        log.warning("a warning for the log only")
        log.info("below the level", extra=CONSOLE)
    finally:
        for h in root.handlers:
            h.close()
        root.handlers[:] = handlers
        root.setLevel(level)
    err = capfd.readouterr().err
    assert err.splitlines() == ["[ps0] warning: trainer2 joined the job; 3 trainer(s) now"]
    text = (tmp_path / "logs" / "ps0.log").read_text()
    assert "trainer2 joined the job" in text and "a warning for the log only" in text
