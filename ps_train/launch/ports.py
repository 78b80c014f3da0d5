"""Free TCP ports: where a run's roles meet when nobody chose a port.

The one helper for the launcher, the tests and the benchmarks. It imports only the
standard library, so rpc_core's tests and benchmarks can use it without loading the
application.
"""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (bind port 0, read it, release it).

    Another process may take it before the caller binds it; rendezvous on a port picked
    this way is for one machine's tests, benchmarks and local runs.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
