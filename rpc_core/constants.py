"""rpc_core's defaults, under the names of ``torch.distributed.rpc.constants``.

Importable as ``rpc_core.constants`` and reached as ``rpc.constants`` after
``import rpc_core as rpc``, as torch's module is. ``rpc_core.options`` builds its defaults
from these.
"""

from __future__ import annotations

from datetime import timedelta

# For every call: seconds a call may take (0: no limit); the value meaning "the default".
DEFAULT_RPC_TIMEOUT_SEC: float = 60.0
UNSET_RPC_TIMEOUT: float = -1.0
DEFAULT_INIT_METHOD: str = "env://"
# shutdown(timeout=0): graceful shutdown waits without a limit.
DEFAULT_SHUTDOWN_TIMEOUT: float = 0.0
# Threads kept ready to run incoming calls (RpcBackendOptions.num_worker_threads).
DEFAULT_NUM_WORKER_THREADS: int = 16
# torch's timeout for the process group its agent keeps; rpc_core has none and reads it
# nowhere: kept, with torch's value, for programs that read it.
DEFAULT_PROCESS_GROUP_TIMEOUT: timedelta = timedelta(milliseconds=2**31 - 1)

# torch's module also has these private copies (from its C++ core).
_DEFAULT_RPC_TIMEOUT_SEC = DEFAULT_RPC_TIMEOUT_SEC
_UNSET_RPC_TIMEOUT = UNSET_RPC_TIMEOUT
_DEFAULT_INIT_METHOD = DEFAULT_INIT_METHOD
_DEFAULT_NUM_WORKER_THREADS = DEFAULT_NUM_WORKER_THREADS

__all__: list[str] = []  # as torch's: the names are reached as attributes, not star-imported
