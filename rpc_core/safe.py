"""The allowlist of ``RpcBackendOptions(serializer="safe")``: what messages may name.

Under the safe serializer nothing from the wire is unpickled; a call names its function
(module + qualified name) and a record its class, and the receiving worker runs or builds
only what it allows::

    import rpc_core
    from rpc_core import safe

    @safe.allow
    def forward(x): ...

    safe.allow(torch.add)            # a function of another library
    safe.allow_module("mypkg.calls")  # everything defined in a module (and its submodules)

Anything else fails with ``NotAllowedError`` naming it, before anything of the call runs.
Register the same on every worker (a worker decodes its answers with its own allowlist).
"""

from __future__ import annotations

from .errors import NotAllowedError
from .protocol.allowlist import allow, allow_module, allowed_modules

__all__ = ["NotAllowedError", "allow", "allow_module", "allowed_modules"]
