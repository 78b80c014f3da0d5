"""Fault injection for tests: make a chosen role die at a chosen step.

``PS_TRAIN_FAULT=<role>@<step>`` in the launcher's environment (every role inherits it)
makes that role SIGKILL itself -- a trainer right after finishing step ``<step>``, a server
right after applying its ``<step>``-th update -- so tests can check how the launcher reports
a dead role and that resuming from the last checkpoint works. Never set it in real runs.

It lives apart from the launcher so that the server and trainer, which call the hook, do
not import the launcher that starts them.
"""
from __future__ import annotations

import logging
import os
import signal
import time

__all__ = ["FAULT_ENV", "maybe_inject_fault"]

log = logging.getLogger("ps_train")

FAULT_ENV = "PS_TRAIN_FAULT"


def maybe_inject_fault(role: str, step: int) -> None:
    """SIGKILL this process if ``PS_TRAIN_FAULT`` is ``<role>@<step>``; else do nothing."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    who, _, at = spec.partition("@")
    if who == role and at.isdigit() and int(at) == step:
        log.warning("%s=%s: test fault injection, killing %s (pid %d) at step %d at unix time %.3f",
                    FAULT_ENV, spec, role, os.getpid(), step, time.time())
        # SIGKILL skips every handler: flush the log first so the test can read the line.
        for h in logging.getLogger().handlers:
            h.flush()
        os.kill(os.getpid(), signal.SIGKILL)
