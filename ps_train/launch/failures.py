"""What a failed role is, as the launcher reports it: ``RoleFailed``, and the names roles go by.

Ranks 0..S-1 are the parameter servers ``ps0..``, ranks S..S+T-1 the trainers ``trainer0..``
(``role_name``). The local launcher raises ``RoleFailed`` when a role dies or goes silent
(``ps_train.launch.local``), a ``cluster=env`` rank when it fails (``ps_train.launch.restarts``);
``python -m ps_train`` exits with code 1 on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from rpc_core.errors import failed_worker

__all__ = ["RoleFailed", "role_name", "RoleError", "FailedRole", "first_cause", "failure_report"]


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


MAX_ERROR_BYTES = 2000  # of a RoleError's text in UTF-8: the record stays one atomic pipe write (< PIPE_BUF)


class RoleError(NamedTuple):
    """What a role that failed with an exception tells the local launcher before it exits
    (its traceback goes to its own log only)."""

    role: str
    error: str  # "<exception type>: <message>", cut to MAX_ERROR_BYTES
    peer: str | None  # the other role its error is about (rpc_core's ``failed_worker``): it failed because that did

    @classmethod
    def of(cls, role: str, e: BaseException) -> RoleError:
        text = f"{type(e).__name__}: {e}".strip()
        if len(text.encode()) > MAX_ERROR_BYTES:
            text = text.encode()[: MAX_ERROR_BYTES - 3].decode(errors="ignore") + "..."
        peer = failed_worker(e)
        return cls(role, text, peer if peer != role else None)


@dataclass
class FailedRole:
    """A role of a failed local run, as the launcher saw it."""

    role: str
    rank: int
    how: str  # "exit code 1", "killed by signal SIGKILL", "unresponsive: no heartbeat for 31.0 s, ..."
    error: RoleError | None  # what it said, if it failed with an exception

    def blames(self) -> str | None:
        """The role this one says it failed because of, if any."""
        return self.error.peer if self.error is not None else None


def first_cause(failed: list[FailedRole]) -> FailedRole:
    """The role whose failure made the others fail: the first (in ``failed``'s order: the
    launcher lists them as it saw them fail) that blames no other role; if each blames
    another, the end of the chain of blame from the first (the first itself if the chain
    goes round)."""
    for f in failed:
        if f.blames() is None:
            return f
    by_role = {f.role: f for f in failed}
    f, seen = failed[0], {failed[0].role}
    while (peer := f.blames()) in by_role:
        if peer in seen:
            return failed[0]
        f = by_role[peer]
        seen.add(f.role)
    return f


_LISTED = 6  # roles named in a line of the report; more are counted


def _names(roles: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``; past ``_LISTED`` roles, ``a, b, ... and 60 others``."""
    if len(roles) > _LISTED:
        return f"{', '.join(roles[: _LISTED - 1])} and {len(roles) - _LISTED + 1} others"
    return roles[0] if len(roles) == 1 else f"{', '.join(roles[:-1])} and {roles[-1]}"


def failure_report(
    failed: list[FailedRole], everyone: list[str], run_dir: str, hint: str, checkpoint: str | None
) -> RoleFailed:
    """The one error a failed local run ends with: the first cause, with its own error (no
    traceback: that is in its log), then what the other roles of ``everyone`` (those that had
    not finished) did -- failed the same way, failed otherwise, or stopped because of it --
    and ``hint``, which names ``checkpoint``, the one to resume from."""
    cause = first_cause(failed)
    rank = cause.rank
    lines = [
        f"{cause.role} (rank {rank}, {cause.how}; log: {run_dir}/logs/{cause.role}.log) failed"
        + (f": {cause.error.error}" if cause.error is not None else "")
    ]
    alike = [
        f.role
        for f in failed
        if f is not cause
        and f.blames() is None
        and f.error is not None
        and cause.error is not None
        and f.error.error == cause.error.error
    ]
    other = [f for f in failed if f is not cause and f.blames() is None and f.role not in alike]
    after = [
        name for name in everyone if name != cause.role and name not in alike and name not in {f.role for f in other}
    ]
    if alike:
        lines.append(f"{_names(alike)} failed the same way")
    for f in other:
        lines.append(f"{f.role} also failed: {f.error.error if f.error is not None else f.how}")
    if after:
        lines.append(f"{_names(after)} stopped because {cause.role} failed")
    lines.append(hint)
    reason = cause.error.error if cause.error is not None else cause.how
    return RoleFailed("\n  ".join(lines), role=cause.role, reason=reason, checkpoint=checkpoint)
