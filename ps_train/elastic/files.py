"""What an elastic run (``cluster.elastic=true``) keeps in its run folder.

- ``elastic.json``: where the running job meets (address, port), its auth secret, its
  resolved config and which attempt of the job that is (0, then 1, 2, ... after each restart,
  ``cluster.max_restarts``), for trainers that join it (``python -m ps_train join=<run dir>``).
  Only the owner may read it (mode 0600): whoever has the secret can run code in the job. The
  local launcher writes it when each attempt starts (a restart rewrites it: a joiner sees a
  newer attempt and joins that) and removes it when the job ends.
- ``replacements.json``: every trainer the local launcher replaced, as it happens (role,
  reason, attempt); ``metrics.json`` lists them as ``replacements``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ps_train.config import ELASTIC_FILE
from ps_train.files import atomic_write_text

__all__ = [
    "ELASTIC_FILE",
    "REPLACEMENTS_FILE",
    "write_job_file",
    "read_job_file",
    "remove_job_file",
    "record_replacement",
    "read_replacements",
]

REPLACEMENTS_FILE = "replacements.json"


def write_job_file(run_dir: str, addr: str, port: int, secret: str, config: dict[str, Any], attempt: int = 0) -> None:
    path = Path(run_dir) / ELASTIC_FILE
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # never readable by others, not even briefly
    with os.fdopen(fd, "w") as f:
        json.dump(
            {"master_addr": addr, "master_port": port, "secret": secret, "attempt": attempt, "config": config},
            f,
            indent=2,
        )
    os.replace(tmp, path)  # a joiner reading it meanwhile sees the old attempt's or the new one's, whole


def read_job_file(run_dir: str) -> dict[str, Any]:
    """The job's ``elastic.json``; a clear error if the job is not running (any more)."""
    path = Path(run_dir) / ELASTIC_FILE
    try:
        return dict(json.loads(path.read_text()))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"join={run_dir}: no {ELASTIC_FILE} there: the job has finished, or was not started "
            "with cluster.elastic=true; pass the run dir of a running elastic job"
        ) from None


def remove_job_file(run_dir: str) -> None:
    try:
        os.unlink(Path(run_dir) / ELASTIC_FILE)
    except FileNotFoundError:
        pass


def read_replacements(run_dir: str) -> list[dict[str, Any]]:
    """The trainer replacements recorded in ``run_dir`` (oldest first)."""
    path = Path(run_dir) / REPLACEMENTS_FILE
    return list(json.loads(path.read_text())) if path.is_file() else []


def record_replacement(run_dir: str, role: str, reason: str, attempt: int) -> list[dict[str, Any]]:
    """Add one replacement to ``replacements.json``; returns all so far."""
    rows = read_replacements(run_dir) + [{"role": role, "reason": reason, "attempt": attempt}]
    atomic_write_text(Path(run_dir) / REPLACEMENTS_FILE, json.dumps(rows, indent=2) + "\n")
    return rows
