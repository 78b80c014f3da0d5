"""Backend options: the knobs of an rpc_core agent.

Field names follow ``torch.distributed.rpc.TensorPipeRpcBackendOptions`` so that programs
that build options port unchanged; ``TensorPipeRpcBackendOptions`` is an alias of this class.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

from . import knobs

# re-exported (the `as` form): options was their home before rpc_core.constants
from .constants import DEFAULT_INIT_METHOD as DEFAULT_INIT_METHOD
from .constants import DEFAULT_NUM_WORKER_THREADS as DEFAULT_NUM_WORKER_THREADS
from .constants import DEFAULT_RPC_TIMEOUT_SEC as DEFAULT_RPC_TIMEOUT_SEC
from .constants import DEFAULT_SHUTDOWN_TIMEOUT as DEFAULT_SHUTDOWN_TIMEOUT
from .constants import UNSET_RPC_TIMEOUT as UNSET_RPC_TIMEOUT
from .errors import RpcValueError

AUTH_SECRET_ENV = knobs.AUTH_SECRET.name
SERIALIZERS = ("pickle", "safe")


class RpcBackendOptions:
    """Options of an rpc_core worker.

    Args:
        num_worker_threads: threads kept ready to run incoming calls. The pool grows past
            this when every thread is blocked (nested calls), so it never deadlocks.
        rpc_timeout: default per-call timeout in seconds; 0 means no timeout.
        init_method: ``env://`` (MASTER_ADDR/MASTER_PORT) or ``tcp://host:port``.
        auth_secret: shared secret peers must prove they know before any byte of theirs is
            unpickled. ``None`` reads the ``RPC_CORE_AUTH_SECRET`` environment variable.
        init_timeout: seconds to wait for every worker to join at ``init_rpc``; ``None``
            uses ``rpc_timeout`` (or 60 s when that is 0).
        heartbeat_timeout: seconds a peer this worker waits on (calls pending to it) may send
            nothing before those calls fail with ``WorkerUnavailableError``: a frozen process or
            a link that silently drops packets. Idle connections carry a small heartbeat call
            after a quarter of this; a peer answering it or anything else is alive. 0 turns
            heartbeats off; ``None`` reads ``RPC_CORE_HEARTBEAT_TIMEOUT`` (default 30 s).
        serializer: ``"pickle"`` (the default, as torch) or ``"safe"``: messages in rpc_core's
            own encoding, nothing unpickled; calls and records may name only allowed functions
            and classes (``rpc_core.safe.allow``, ``allow_modules``). Every worker of a group
            must use the same. See docs/torch_compatibility.md, "Safe calls".
        allow_modules: under ``serializer="safe"``, modules (with their submodules) whose
            functions and classes messages may name, added to the allowlist at ``init_rpc``.
        device_maps / devices: accepted for torch compatibility; only CPU is supported, so a
            non-empty value raises ``ValueError`` saying so.
    """

    def __init__(
        self,
        *,
        num_worker_threads: int = DEFAULT_NUM_WORKER_THREADS,
        rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC,
        init_method: str = DEFAULT_INIT_METHOD,
        auth_secret: str | bytes | None = None,
        init_timeout: float | None = None,
        heartbeat_timeout: float | None = None,
        serializer: str = "pickle",
        allow_modules: Sequence[str] = (),
        device_maps: dict[str, dict[Any, Any]] | None = None,
        devices: list[Any] | None = None,
        _transports: list[str] | None = None,
        _channels: list[str] | None = None,
    ) -> None:
        if isinstance(rpc_timeout, datetime.timedelta) or not isinstance(rpc_timeout, (int, float)):
            raise TypeError(  # torch's words first ("incompatible constructor arguments"), which programs match
                "incompatible constructor arguments: rpc_timeout must be a number of seconds (float), "
                f"got {type(rpc_timeout).__name__}; "
                "pass e.g. rpc_timeout=60.0"
            )
        # torch's words (and class: RuntimeError) first; RpcValueError is a ValueError as well
        if rpc_timeout < 0:
            raise RpcValueError(
                f"RPC Timeout must be non-negative: rpc_timeout must be >= 0 seconds "
                f"(0 = no timeout), got {rpc_timeout}"
            )
        if not isinstance(num_worker_threads, int) or num_worker_threads <= 0:
            raise RpcValueError(f"num_worker_threads must be positive, got {num_worker_threads!r} (an int >= 1)")
        if not isinstance(init_method, str) or not (
            init_method.startswith("env://") or init_method.startswith("tcp://")
        ):
            raise ValueError(
                f"init_method {init_method!r} is not supported: use 'env://' (reads MASTER_ADDR and "
                "MASTER_PORT) or 'tcp://HOST:PORT'"
            )
        if device_maps or devices:
            raise ValueError(
                "rpc_core moves CPU tensors only: device_maps/devices are not supported. Move tensors "
                "to the CPU before sending them and drop device_maps/devices from the options."
            )
        if init_timeout is not None and init_timeout <= 0:
            raise ValueError(f"init_timeout must be > 0 seconds, got {init_timeout}")
        if heartbeat_timeout is not None and (
            isinstance(heartbeat_timeout, bool)
            or not isinstance(heartbeat_timeout, (int, float))
            or not 0 <= heartbeat_timeout < float("inf")
        ):
            raise ValueError(
                f"heartbeat_timeout must be a number of seconds >= 0 (0: off) or None (read "
                f"{knobs.HEARTBEAT_TIMEOUT.name}), got {heartbeat_timeout!r}"
            )
        if serializer not in SERIALIZERS:
            raise ValueError(
                f"serializer must be one of {', '.join(map(repr, SERIALIZERS))}, got {serializer!r}: 'pickle' "
                "(torch's behaviour) or 'safe' (nothing unpickled; calls name allowed functions only)"
            )
        if isinstance(allow_modules, str) or not all(isinstance(m, str) and m for m in allow_modules):
            raise ValueError(
                f"allow_modules must be a list of module names such as ['mypkg.calls'], got {allow_modules!r}"
            )
        if allow_modules and serializer != "safe":
            raise ValueError("allow_modules is the allowlist of serializer='safe'; set serializer='safe' as well")
        self.serializer = serializer
        self.allow_modules: list[str] = list(allow_modules)
        self.num_worker_threads = num_worker_threads
        self.rpc_timeout = float(rpc_timeout)
        self.init_method = init_method
        self.init_timeout = init_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.device_maps: dict[str, dict[Any, Any]] = {}
        self.devices: list[Any] = []
        # Transports/channels are TensorPipe internals; ours is always TCP (+ same-host fast paths).
        self._transports = _transports
        self._channels = _channels
        self._auth_secret = auth_secret

    @property
    def auth_secret(self) -> bytes:
        secret = self._auth_secret
        if secret is None:
            secret = knobs.auth_secret()
        return secret.encode() if isinstance(secret, str) else bytes(secret)

    @auth_secret.setter
    def auth_secret(self, value: str | bytes | None) -> None:
        self._auth_secret = value

    def effective_init_timeout(self) -> float:
        if self.init_timeout is not None:
            return self.init_timeout
        return self.rpc_timeout if self.rpc_timeout > 0 else DEFAULT_RPC_TIMEOUT_SEC

    def effective_heartbeat_timeout(self) -> float:
        """``heartbeat_timeout``, or ``RPC_CORE_HEARTBEAT_TIMEOUT`` when it is None; 0: off."""
        if self.heartbeat_timeout is not None:
            return float(self.heartbeat_timeout)
        return knobs.heartbeat_timeout()

    def set_device_map(self, to: str, device_map: dict[Any, Any]) -> None:
        raise ValueError(
            f"set_device_map({to!r}, ...): rpc_core moves CPU tensors only; move tensors to the CPU before sending them"
        )

    def set_devices(self, devices: list[Any]) -> None:
        raise ValueError("set_devices: rpc_core moves CPU tensors only")

    def __repr__(self) -> str:
        return (
            f"RpcBackendOptions(num_worker_threads={self.num_worker_threads}, "
            f"rpc_timeout={self.rpc_timeout}, init_method={self.init_method!r}, serializer={self.serializer!r})"
        )


# Torch programs build this name; it is the same class here.
TensorPipeRpcBackendOptions = RpcBackendOptions
