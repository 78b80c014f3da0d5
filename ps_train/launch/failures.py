"""What a failed role is, as the launcher reports it: ``RoleFailed``, and the names roles go by.

Ranks 0..S-1 are the parameter servers ``ps0..``, ranks S..S+T-1 the trainers ``trainer0..``
(``role_name``). The local launcher raises ``RoleFailed`` when a role dies or goes silent
(``ps_train.launch.local``), a ``cluster=env`` rank when it fails (``ps_train.launch.restarts``);
``python -m ps_train`` exits with code 1 on it.
"""

from __future__ import annotations

__all__ = ["RoleFailed", "role_name"]


class RoleFailed(RuntimeError):
    """A server or trainer process failed (or the run hit its time limit); the message names
    the role, its log, and the latest complete checkpoint.

    ``role``: the failed role (``ps1``), None when the run ran out of time; ``reason``: how
    it failed (``killed by signal SIGKILL``, ``unresponsive: ...``); ``checkpoint``: the
    latest complete checkpoint of the run folder, if any.
    """

    def __init__(self, message: str, role: str | None = None, reason: str = "", checkpoint: str | None = None) -> None:
        super().__init__(message)
        self.role = role
        self.reason = reason
        self.checkpoint = checkpoint


def role_name(rank: int, num_servers: int) -> str:
    """The name of rank ``rank`` in a run with ``num_servers`` servers: ``ps<rank>`` or ``trainer<k>``."""
    return f"ps{rank}" if rank < num_servers else f"trainer{rank - num_servers}"
