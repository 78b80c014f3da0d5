"""``python -m ps_train [overrides]``: compose the Hydra config, convert it once, run it.

Exit codes: 0 done; 1 a role failed (the message names it and the checkpoint to resume
from; with ``cluster.max_restarts`` only once the restarts are used up); 2 invalid
configuration, setup or data (nothing was started).
"""

from __future__ import annotations

import os

# Before anything imports numpy: its OpenBLAS starts a pool of (cores - 1) threads at import,
# and a launcher with a thread beside its own does not fork its roles from the fork server
# (ps_train.launch.role_processes: a fork could copy a lock another thread holds); they would
# start from multiprocessing's forkserver instead, slower, and without the preload phase.
# A role computes with one thread anyway (torch.set_num_threads(1) in each rank); the roles
# inherit the setting. A value the user set is kept.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import logging  # noqa: E402
import sys  # noqa: E402

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

import ps_train.config  # noqa: E402, F401  (registers the config schemas with Hydra)
from ps_train.app import run  # noqa: E402
from ps_train.checkpoint.files import CheckpointError  # noqa: E402
from ps_train.config import ConfigError, from_dictconfig  # noqa: E402
from ps_train.launch.failures import RoleFailed  # noqa: E402
from ps_train.launch.prechecks import DataCheckError  # noqa: E402
from ps_train.workload import DatasetNotFoundError  # noqa: E402

log = logging.getLogger("ps_train")


def _shown(path: str) -> str:
    """``path`` relative to the working directory when it lies inside it (the default
    ``runs/...``), else as given."""
    rel = os.path.relpath(path)
    return path if rel == os.pardir or rel.startswith(os.pardir + os.sep) else rel


def _to_run_log(message: str) -> None:
    """``message`` as an error into the run's log file (``<run_dir>/__main__.log``) only: the
    console shows it once, on stderr."""
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "%s", (message,), None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(dcfg: DictConfig) -> float:
    try:
        cfg = from_dictconfig(dcfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    hc = HydraConfig.get()
    run_dir = hc.runtime.output_dir
    if cfg.cluster.launcher == "env" and not any(o.startswith("hydra.run.dir=") for o in hc.overrides.hydra):
        log.warning(
            "cluster.launcher=env without hydra.run.dir=...: each rank names its run folder by its own "
            "start time, so logs may be split over several folders; pass the same "
            "hydra.run.dir=<folder> to every rank"
        )
    print(f"[ps_train] run dir: {_shown(run_dir)}", flush=True)
    try:
        metrics = run(cfg, run_dir, overrides=list(hc.overrides.task))
    except (ConfigError, CheckpointError, DatasetNotFoundError, DataCheckError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except RoleFailed as e:
        _to_run_log(str(e))
        print(f"error: {e}", file=sys.stderr)
        # Leave at once: the interpreter's teardown of torch (and, for one rank of an env job
        # whose peers failed, of RPC threads left behind by a failed shutdown) takes seconds on
        # a busy machine, or hangs; torchrun or SLURM restart the job as soon as a rank exits.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    # Hydra's sweepers read the return value: the workload's first test metric (accuracy, AUC, ...).
    tests = [v for k, v in (metrics or {}).items() if k.startswith("test_") and isinstance(v, (int, float))]
    return float(tests[0]) if tests else 0.0


if __name__ == "__main__":
    main()
    # Done: skip the interpreter's teardown of torch (seconds on a busy machine; nothing is
    # left to clean up: the roles have exited and every file is written).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
