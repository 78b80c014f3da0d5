import json
import math

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from ps_train.metrics import (
    LatencyStats,
    MetricsWriter,
    NullWriter,
    TensorBoardWriter,
    ThroughputMeter,
    flatten_hparams,
    make_writer,
    mark_session_start,
    write_metrics_json,
)


def _read(log_dir):
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return acc


def test_tensorboard_scalars_read_back(tmp_path):
    with TensorBoardWriter(tmp_path, filename_suffix=".trainer0") as w:
        assert isinstance(w, MetricsWriter)
        for step in range(3):
            w.add_scalar("train/loss/trainer0", 1.0 / (step + 1), step)
        w.add_scalars({"throughput/samples_per_s": 250.0, "rpc/ps0/latency_ms": 1.5}, step=2)
    assert any(p.name.endswith(".trainer0") for p in tmp_path.iterdir())
    acc = _read(tmp_path)
    assert {"train/loss/trainer0", "throughput/samples_per_s", "rpc/ps0/latency_ms"} <= set(acc.Tags()["scalars"])
    loss = acc.Scalars("train/loss/trainer0")
    assert [e.step for e in loss] == [0, 1, 2]
    assert [e.value for e in loss] == pytest.approx([1.0, 0.5, 1 / 3])
    assert acc.Scalars("throughput/samples_per_s")[0].value == 250.0


def test_restarted_attempt_supersedes_the_failed_one_even_within_the_same_second(tmp_path):
    """A failed attempt wrote steps 1..6 and the restart resumes after step 4: TensorBoard shows
    1..4 of the first attempt and 5..8 of the second, whatever the two processes' pids."""
    with TensorBoardWriter(tmp_path) as first:
        mark_session_start(first, 1)
        for step in range(1, 7):
            first.add_scalar("train/loss", 1.0, step)
    # As if another process with a pid that sorts after ours had written it this second.
    (old,) = tmp_path.iterdir()
    parts = old.name.split(".")
    parts[-2] = "9" * 12  # events.out.tfevents.<seconds>.<host>.<pid>.<counter>
    old.rename(tmp_path / ".".join(parts))
    with TensorBoardWriter(tmp_path) as second:
        mark_session_start(second, 5)
        for step in range(5, 9):
            second.add_scalar("train/loss", 2.0, step)
    curve = [(e.step, e.value) for e in _read(tmp_path).Scalars("train/loss")]
    assert curve == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 1.0), (5, 2.0), (6, 2.0), (7, 2.0), (8, 2.0)]


def test_hparams_with_final_metrics_in_the_run_folder(tmp_path):
    config = {
        "optim": {"name": "sgd", "lr": 0.05},
        "model": {"hidden_sizes": [128, 64]},
        "resume": None,
        "cluster": {"num_servers": 2},
    }
    with TensorBoardWriter(tmp_path) as w:
        w.add_hparams(config, {"final/test_accuracy": 0.97, "final/samples_per_s": 1234.0})
    # One folder per run (no timestamped sub-run), so runs/ compares runs row by row.
    assert all(p.is_file() for p in tmp_path.iterdir())
    acc = _read(tmp_path)
    content = acc.PluginTagToContent("hparams")
    assert {"_hparams_/experiment", "_hparams_/session_start_info", "_hparams_/session_end_info"} <= set(content)
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["optim.lr"].number_value == pytest.approx(0.05)
    assert start.hparams["optim.name"].string_value == "sgd"
    assert start.hparams["model.hidden_sizes"].string_value == "[128, 64]"
    assert start.hparams["cluster.num_servers"].number_value == 2
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert {m.name.tag for m in experiment.metric_infos} == {"final/test_accuracy", "final/samples_per_s"}
    assert acc.Scalars("final/test_accuracy")[0].value == pytest.approx(0.97)


def test_null_writer_and_make_writer(tmp_path):
    off = make_writer(False, tmp_path / "tb")
    assert isinstance(off, NullWriter) and isinstance(off, MetricsWriter)
    off.add_scalar("a", 1.0, 0)
    off.add_scalars({"b": 2.0}, 0)
    off.add_hparams({"x": 1}, {"m": 1.0})
    off.flush()
    off.close()
    assert not (tmp_path / "tb").exists()
    on = make_writer(True, tmp_path / "tb")
    on.add_scalar("a", 1.0, 0)
    on.close()
    on.close()  # idempotent
    assert _read(tmp_path / "tb").Tags()["scalars"] == ["a"]


def test_flatten_hparams():
    flat = flatten_hparams({"a": {"b": 1, "c": {"d": True}}, "e": None, "f": [1, 2], "g": "x", "h": 0.5})
    assert flat == {"a.b": 1, "a.c.d": True, "e": "None", "f": "[1, 2]", "g": "x", "h": 0.5}


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_throughput_meter_windowed_and_overall():
    clock = FakeClock()
    meter = ThroughputMeter(window_s=2.0, clock=clock)
    assert meter.rate() == 0.0 and meter.overall() == 0.0
    for _ in range(4):  # 100 samples/s for 4 s
        clock.t += 1.0
        meter.update(100)
    assert meter.overall() == pytest.approx(100.0)
    for _ in range(2):  # then 400 samples/s for 2 s
        clock.t += 1.0
        meter.update(400)
    assert meter.rate() == pytest.approx(400.0)  # the window sees only the recent rate
    assert meter.overall() == pytest.approx(1200 / 6)
    assert meter.total == 1200
    meter.start()
    assert meter.total == 0 and meter.rate() == 0.0


def test_latency_stats():
    stats = LatencyStats()
    assert stats.mean_s == 0.0
    for s, b in ((0.001, 100), (0.003, 300)):
        stats.record(s, b)
    assert stats.summary("rpc/ps0/") == pytest.approx(
        {"rpc/ps0/latency_ms": 2.0, "rpc/ps0/max_latency_ms": 3.0, "rpc/ps0/calls": 2.0, "rpc/ps0/bytes": 400.0}
    )
    stats.reset()
    assert stats.count == 0 and stats.bytes == 0


def test_metrics_json_is_strict_and_atomic(tmp_path):
    path = tmp_path / "run" / "metrics.json"
    write_metrics_json(
        path, {"test_accuracy": 0.95, "test_loss": math.nan, "steps": 300, "per_trainer": {"trainer0": math.inf}}
    )
    data = json.loads(path.read_text())
    assert data == {"test_accuracy": 0.95, "test_loss": None, "steps": 300, "per_trainer": {"trainer0": None}}
    write_metrics_json(path, {"steps": 301})
    assert json.loads(path.read_text()) == {"steps": 301}
    assert [p.name for p in path.parent.iterdir()] == ["metrics.json"]  # no temp files left
