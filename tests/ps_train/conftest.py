"""Shared test settings for ps_train.

The test machine has 2 cores shared by several jobs: torch's default thread pool
oversubscribes them and makes tiny models ~10x slower, so tests use one intra-op thread.
"""

import pytest
import torch

from ps_train.workload import import_plugins
from ps_train.workloads import BUILTIN

torch.set_num_threads(1)
import_plugins(BUILTIN)  # as ps_train.app does: tests build roles and shards without it


@pytest.fixture(scope="session")
def sync_baseline(tmp_path_factory):
    """(run_dir, metrics) of one uninterrupted sync run of ``_app.BASELINE``: what the
    oracle, kill/resume and backend tests compare against."""
    from tests.ps_train._app import BASELINE, run_app

    run_dir = tmp_path_factory.mktemp("baseline")
    metrics = run_app(run_dir, *BASELINE)
    return run_dir, metrics
