"""Which RPC stack the application runs on: rpc_core (default) or torch.distributed.rpc.

Both expose the same names (that is rpc_core's contract), so the rest of ps_train only
asks for ``rpc()``, ``dist_autograd()`` and builds options through ``make_options``.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

T = TypeVar("T")

_name: str | None = None


def select(name: str) -> None:
    global _name
    if name not in ("rpc_core", "torch"):
        raise ValueError(f"backend: unknown backend {name!r}; choose rpc_core or torch")
    _name = name


def name() -> str:
    return _name or "rpc_core"


def rpc() -> ModuleType:
    if name() == "torch":
        import torch.distributed.rpc as m
    else:
        import rpc_core as m  # type: ignore[no-redef]
    return m


def dist_autograd() -> ModuleType:
    if name() == "torch":
        import torch.distributed.autograd as m
    else:
        import rpc_core.autograd as m  # type: ignore[no-redef]
    return m


def gradients_handed_over() -> bool:
    """Whether ``take_gradients`` hands the context's gradients over: on rpc_core the caller
    then owns them (``rpc_core.autograd.take_gradients``: freed once it drops them, changeable
    in place); on torch they stay the context's until it is released."""
    return name() != "torch"


def take_gradients(context_id: int) -> dict[Any, Any]:
    """The gradients accumulated on this worker in autograd context ``context_id``, handed
    over where the backend can (``gradients_handed_over``)."""
    if not gradients_handed_over():
        return dict(dist_autograd().get_gradients(context_id))
    import rpc_core.autograd

    return rpc_core.autograd.take_gradients(context_id)


def after_response(fn: Callable[[], Any]) -> None:
    """Run ``fn`` once the answer of the request being served is written (rpc_core's
    ``rpc_core.functions.after_response``); on torch, which has no such call, at once."""
    if name() == "torch":
        fn()
    else:
        from rpc_core.functions import after_response as later

        later(fn)


def make_options(
    init_method: str,
    rpc_timeout: float,
    num_worker_threads: int,
    secret: str | None,
    init_timeout: float,
    serializer: str = "pickle",
) -> Any:
    """Backend options: calls time out after ``rpc_timeout`` s (0: never), the rendezvous
    after ``init_timeout`` s. torch's rendezvous waits ``rpc_timeout``, so its options carry
    the longer of the two until ``init_rpc`` returns (then ``restore_rpc_timeout``)."""
    if name() == "torch":
        import torch.distributed.rpc as trpc

        # torch RPC has no authentication: anyone reaching its ports can run code in it.
        wait = max(rpc_timeout, init_timeout) if rpc_timeout > 0 else rpc_timeout
        return trpc.TensorPipeRpcBackendOptions(
            num_worker_threads=num_worker_threads, rpc_timeout=wait, init_method=init_method
        )
    import rpc_core

    return rpc_core.RpcBackendOptions(
        num_worker_threads=num_worker_threads,
        rpc_timeout=rpc_timeout,
        init_method=init_method,
        auth_secret=secret,
        init_timeout=init_timeout,
        serializer=serializer,
    )


def restore_rpc_timeout(rpc_timeout: float) -> None:
    """After ``init_rpc``: torch's default call timeout back to ``rpc_timeout`` (see make_options)."""
    if name() == "torch" and rpc_timeout > 0:
        import torch.distributed.rpc as trpc

        trpc._set_rpc_timeout(rpc_timeout)  # type: ignore[attr-defined]  # torch exports it implicitly


def called_by_name(obj: T) -> T:
    """Mark a function or class that other roles call (or receive records of) over RPC:
    under ``cluster.serializer=safe`` rpc_core lets messages name only these
    (``rpc_core.safe.allow``; the modules holding them: ``ps_train.rpc_allowlist``)."""
    import rpc_core.safe

    return rpc_core.safe.allow(obj)
