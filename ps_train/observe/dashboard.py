"""What TensorBoard opens on: a custom-scalars layout and the HParams experiment, at ``tb/``.

Both are written once per run into the run's TensorBoard root (``<run>/tb/``, next to the
roles' folders), by trainer0 when it starts (``write_dashboard``); the session's end (its
status, for the HParams table) when it finishes (``end_session``).

- The layout groups the tags a user compares across roles -- throughput, loss / accuracy /
  AUC, staleness, each server's load, bytes and memory -- one line per role in each chart,
  so one page shows whether the servers are balanced.
- The HParams experiment declares the hyperparameters a user sweeps (``SWEPT``) and the
  metrics (``METRICS``: trainer0's last ``test/*`` and ``train/*`` points); the table reads
  the metrics from the curves the roles write anyway, so there are no one-point
  ``hparam/*`` scalars. Every other key (checkpointing, ports, ...) is in ``.hydra/``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, NamedTuple

from ps_train.metrics import HParamValue, TensorBoardWriter, flatten_hparams

__all__ = ["SWEPT", "METRICS", "LAYOUT", "Metric", "write_dashboard", "end_session", "swept_values"]

# The config keys a user sweeps, in the HParams table's column order; those a model lacks
# (the table settings, except for model=dlrm) are left out of its runs.
SWEPT = (
    "model.name",
    "data.name",
    "mode.name",
    "mode.staleness",
    "optim.name",
    "optim.lr",
    "optim.momentum",
    "train.batch_size",
    "cluster.num_trainers",
    "cluster.num_servers",
    "cluster.placement",
    "backend",
    "model.embedding_dim",
    "model.table_optim",
    "model.table_lr",
    "model.table_sharding",
    "seed",
)


class Metric(NamedTuple):
    role: str  # the TensorBoard run under tb/ that writes it
    tag: str
    title: str


METRICS = (
    Metric("trainer0", "test/accuracy", "test accuracy"),
    Metric("trainer0", "test/auc", "test AUC"),
    Metric("trainer0", "test/loss", "test loss"),
    Metric("trainer0", "train/loss", "train loss"),
    Metric("trainer0", "train/samples_per_s", "samples/s (trainer0)"),
)


def _chart(*tags: str) -> list[Any]:
    return ["Multiline", [f"^{t}$" for t in tags]]  # regexes; each run (role) a line


LAYOUT: dict[str, dict[str, list[Any]]] = {
    "throughput": {
        "samples/s per trainer": _chart("train/samples_per_s"),
        "updates applied/s per server": _chart("server/updates_per_s"),
    },
    "quality": {
        "train loss": _chart("train/loss"),
        "test accuracy": _chart("test/accuracy"),
        "test AUC": _chart("test/auc"),
        "test loss": _chart("test/loss"),
    },
    "staleness": {
        "staleness per trainer": _chart("train/staleness"),
        "mean staleness applied per server": _chart("server/staleness_mean"),
        "steps ahead of the slowest (ssp)": _chart("train/steps_ahead"),
    },
    "server load": {
        "update time (ms)": _chart("server/update_time_ms"),
        "gradients per sync round": _chart("server/contributions_per_round"),
        "table rows read/s": _chart("server/rows_read_per_s"),
        "table rows updated/s": _chart("server/rows_updated_per_s"),
        "table rows live": _chart("server/rows_live"),
    },
    "bytes and memory": {
        "bytes in/s per server": _chart("server/bytes_in_per_s"),
        "bytes out/s per server": _chart("server/bytes_out_per_s"),
        "peak RSS (MB) per server": _chart("server/peak_rss_mb"),
    },
}


def swept_values(config: dict[str, Any]) -> dict[str, HParamValue]:
    """The run's values of ``SWEPT`` (keys it lacks, or set to null, left out), from its
    config as a plain dict (``ps_train.config.config_to_dict``)."""
    flat = flatten_hparams(config)
    return {k: flat[k] for k in SWEPT if k in flat and flat[k] != "None"}


def _summary(tag: str, content: Any) -> Any:
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.plugins.hparams import metadata

    meta = SummaryMetadata(
        plugin_data=SummaryMetadata.PluginData(plugin_name=metadata.PLUGIN_NAME, content=content.SerializeToString())
    )
    return Summary(value=[Summary.Value(tag=tag, metadata=meta)])


def _value(v: HParamValue) -> Any:
    from google.protobuf import struct_pb2  # type: ignore[import-untyped]

    if isinstance(v, bool):
        return struct_pb2.Value(bool_value=v)
    if isinstance(v, (int, float)):
        return struct_pb2.Value(number_value=float(v))
    return struct_pb2.Value(string_value=str(v))


def _experiment() -> Any:
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

    exp = api_pb2.Experiment(
        hparam_infos=[api_pb2.HParamInfo(name=k, display_name=k) for k in SWEPT],
        metric_infos=[
            api_pb2.MetricInfo(name=api_pb2.MetricName(group=m.role, tag=m.tag), display_name=m.title) for m in METRICS
        ],
    )
    return _summary(metadata.EXPERIMENT_TAG, plugin_data_pb2.HParamsPluginData(version=0, experiment=exp))


def _session_start(values: dict[str, HParamValue]) -> Any:
    from tensorboard.plugins.hparams import metadata, plugin_data_pb2

    start = plugin_data_pb2.SessionStartInfo(start_time_secs=time.time())
    for k, v in values.items():
        start.hparams[k].CopyFrom(_value(v))
    return _summary(
        metadata.SESSION_START_INFO_TAG, plugin_data_pb2.HParamsPluginData(version=0, session_start_info=start)
    )


def _session_end(ok: bool) -> Any:
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

    end = plugin_data_pb2.SessionEndInfo(
        status=api_pb2.STATUS_SUCCESS if ok else api_pb2.STATUS_FAILURE, end_time_secs=time.time()
    )
    return _summary(metadata.SESSION_END_INFO_TAG, plugin_data_pb2.HParamsPluginData(version=0, session_end_info=end))


def _root(run_dir: str) -> Path:
    return Path(run_dir) / "tb"


def write_dashboard(tensorboard: bool, hparams: dict[str, HParamValue], run_dir: str) -> bool:
    """The layout, the HParams experiment and this run's session start (``hparams``: its
    ``swept_values``), in ``<run>/tb/``; once per run (a restarted attempt finds them there).
    Nothing without ``tensorboard`` (``logging.tensorboard``). Returns whether it wrote them."""
    root = _root(run_dir)
    if not tensorboard or (root.is_dir() and any(p.name.startswith("events.out.tfevents.") for p in root.iterdir())):
        return False
    with TensorBoardWriter(root, filename_suffix=".run") as w:
        w.add_custom_scalars(LAYOUT)
        for summary in (_experiment(), _session_start(hparams)):
            w.add_summary(summary)
    return True


def end_session(tensorboard: bool, run_dir: str, ok: bool = True) -> None:
    """The HParams session's end (its status in the table), in ``<run>/tb/``."""
    if not tensorboard:
        return
    os.makedirs(_root(run_dir), exist_ok=True)
    with TensorBoardWriter(_root(run_dir), filename_suffix=".run") as w:
        w.add_summary(_session_end(ok))
