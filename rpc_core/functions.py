"""``async_execution``: remote functions that return a Future instead of a value.

The callee runs the function, gets a ``torch.futures.Future`` back, and answers the caller
from that future's callback, so no server thread sits waiting (e.g. while the function
waits for other workers, or batches requests from several callers).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def async_execution(fn: F) -> F:
    """Mark ``fn`` as returning a ``torch.futures.Future`` when run through RPC.

    With ``@staticmethod`` or ``@classmethod`` put this decorator innermost. Called locally,
    the function behaves as written (it returns the Future).
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    wrapper._wrapped_async_rpc_function = fn  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]
