"""What every config group shares: the error type and the list of problems it is built from."""

from __future__ import annotations

__all__ = ["ConfigError", "Problems", "format_problems"]


class ConfigError(ValueError):
    """An invalid configuration; the message lists every problem as ``field: what, fix``."""


class Problems(list[str]):
    """Problems found so far, each ``field: what is wrong, how to fix it``.

    Groups collect problems instead of raising at the first, so one run of a bad command
    line reports everything wrong with it.
    """

    def need(self, ok: bool, msg: str) -> None:
        if not ok:
            self.append(msg)


def format_problems(problems: list[str]) -> str:
    return "invalid ps_train config:\n  - " + "\n  - ".join(problems)
