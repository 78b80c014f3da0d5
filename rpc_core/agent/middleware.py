"""The hooks by which higher layers (RRefs, distributed autograd, the profiler) take part in
every call without touching sockets: the agent calls each installed ``Middleware`` at fixed
points of a request's and a response's way, in a fixed order (see the class)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


class Middleware:
    """Hooks for higher layers; every method is optional and may be left as is.

    A request passes ``admit`` (in arrival order), ``incoming``, ``enter_call``, ``exit_call``,
    then ``outgoing`` and ``response_extras`` for its answer, and ``finish`` once, just
    before the answer (or error) is sent."""

    def admit(self, src: int, extras: dict[str, Any]) -> None:
        """A request from ``src`` arrived. Called on the thread that read it, before any later
        message from ``src`` is looked at: what a request says here is in effect for every
        message that came after it, however threads run the requests themselves."""

    def finish(self, extras: dict[str, Any]) -> None:
        """The request is answered (its answer or error leaves next); called once."""

    def outgoing(
        self, dst: int, tensors: list[torch.Tensor], extras: dict[str, Any], request_extras: dict[str, Any] | None
    ) -> None:
        """Before a message leaves: add entries to ``extras`` (request_extras is set for responses)."""

    def incoming(
        self, src: int, tensors: list[torch.Tensor], extras: dict[str, Any], is_response: bool
    ) -> list[torch.Tensor]:
        """After a message's tensors are rebuilt, before the body is unpickled."""
        return tensors

    def enter_call(self, src: int, extras: dict[str, Any]) -> Any:
        """Around a user function on the callee; returns a token for ``exit_call``."""

    def exit_call(self, token: Any, extras: dict[str, Any], result_future: torch.futures.Future[Any] | None) -> None:
        """After the function returned (result_future is set for async execution)."""

    def response_extras(self, extras: dict[str, Any], response: dict[str, Any]) -> None:
        """Add entries to a response's extras from the request's extras."""

    def on_response(self, extras: dict[str, Any] | None, call_extras: dict[str, Any]) -> None:
        """On the caller, when a response with extras arrives."""


def incoming_hook(
    middleware: list[Middleware], src: int, is_response: bool
) -> Callable[[list[torch.Tensor], Sequence[Any], dict[str, Any]], list[torch.Tensor]] | None:
    """What ``serialization.deserialize`` calls with a message's rebuilt tensors: each
    middleware's ``incoming`` in turn (None without middleware: nothing to call)."""
    if not middleware:
        return None

    def hook(tensors: list[torch.Tensor], metas: Sequence[Any], extras: dict[str, Any]) -> list[torch.Tensor]:
        for m in middleware:
            tensors = m.incoming(src, tensors, extras, is_response)
        return tensors

    return hook
