"""What the local launcher checks of the data before it starts any role.

The config is checked as soon as it is composed (``ps_train.config``), the trainers' share
of the samples included when the config alone says how many there are. What only the data
files can tell is checked here, cheaply, before any process starts: the files exist, the
first lines of each parse (``ps_train.workloads.ctr.data.criteo.check_criteo_files``), a prepared folder
is whole, and each trainer's share of its samples holds a full batch. A mistake there is
then one error, with exit code 2, instead of the same error from every trainer a few
seconds later and the failures it causes in every other role. A malformed line deeper into
a file is still found only by the trainers that read it all (``ps_train.launch.local``
then reports it once).

Only the local launcher runs these: under ``cluster=env`` the data may live only where the
trainers run.
"""

from __future__ import annotations

from ps_train.config import DataConfig, ModelConfig, batch_problems
from ps_train.workload import workload_for

__all__ = ["DataCheckError", "check_data"]


class DataCheckError(ValueError):
    """The data a run names cannot be trained on as it is: the message says what, where, and
    how to fix it."""


def check_data(model: ModelConfig, data: DataConfig, num_trainers: int, batch_size: int) -> None:
    """Raise ``DataCheckError`` if ``data`` would make the trainers fail at start-up: the check
    of the workload that trains ``model``, and each of ``num_trainers`` trainers' share of the
    samples holding a full batch of ``batch_size``."""
    samples = data.train_samples()
    try:
        samples = workload_for(model).check_data(data) or samples
    except (OSError, ValueError) as e:  # missing files, malformed lines, an incomplete prepared folder
        raise DataCheckError(str(e)) from e
    problems = batch_problems(samples, num_trainers, batch_size)
    if problems:
        raise DataCheckError(problems[0])
