"""The model shards a parameter server holds, and their forwards.

Every server builds the whole seeded model (cheap, and identical everywhere) and keeps the
shards placed on it (``ps_train.stage_sharding``). A shard's forward runs on the live
parameters (``run``), with dropout drawn from a generator seeded by (seed, shard, trainer,
step), so masks do not depend on which trainer's request came first; or on private copies of
the parameters (``copy``, ``run_with``), so an update applied while a backward through them is
pending cannot invalidate what it saved; evaluation (``predict``) runs on an eval-mode copy,
kept while no update changed the weights. Which of these a request gets is the update mode's
(``ps_train.modes``), through the server (``ps_train.roles.server``), which owns the lock
the parameters change under and counts the changes.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from ps_train.stage_sharding import Shard


class ServerShards:
    """A server's ``shards`` (``stage_sharding.shards_of_server``); ``seed``: the run's (its
    dropout masks); ``lock``: the server's, held while the parameters change; ``version()``:
    the server's count of the changes."""

    def __init__(self, shards: Sequence[Shard], seed: int, lock: threading.Lock, version: Callable[[], int]) -> None:
        self.modules: dict[int, nn.Module] = {s.index: s.module for s in shards}
        self.seed = seed
        modules = [x for m in self.modules.values() for x in m.modules()]
        self.has_dropout = any(isinstance(x, nn.Dropout) and x.p > 0 for x in modules)
        # BatchNorm updates its running statistics in place during the forward (sync mode
        # runs such forwards in trainer order, so the statistics are the same every run).
        self.has_running_stats = any(
            isinstance(x, nn.modules.batchnorm._NormBase) and x.track_running_stats for x in modules
        )
        self._lock = lock
        self._version = version
        self._eval_copies: dict[int, Any] = {}  # shard -> (version, eval-mode copy)
        self.forward_lock = threading.Lock()

    def run(self, shard: int, x: torch.Tensor, trainer: int, step: int) -> torch.Tensor:
        """``shard``'s forward on the live parameters."""
        module = self.modules[shard]
        if not self.has_dropout or step < 0:
            return module(x)
        # Dropout draws from a generator seeded by (seed, shard, trainer, step), so masks do
        # not depend on which trainer's request this server happened to serve first.
        with self._lock, torch.random.fork_rng(devices=[]):
            torch.manual_seed(hash((self.seed, shard, trainer, step)) & 0x7FFF_FFFF_FFFF_FFFF)
            return module(x)

    def copy(self, shard: int) -> dict[str, torch.Tensor]:
        """Private copies of ``shard``'s parameters (``clone`` keeps the gradient path), so an
        update applied while a backward through them is pending cannot invalidate the
        tensors it saved. The caller holds the server's lock."""
        return {n: p.clone() for n, p in self.modules[shard].named_parameters()}

    def run_with(self, shard: int, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """``shard``'s forward on ``params`` (from ``copy``)."""
        # functional_call swaps the module's parameters while it runs: one at a time.
        with self.forward_lock:
            return functional_call(self.modules[shard], params, (x,))

    def predict(self, shard: int, x: torch.Tensor) -> torch.Tensor:
        """``shard``'s forward for evaluation: in eval mode, without autograd."""
        with self._lock, self.forward_lock:
            # An eval-mode copy, so evaluation never disturbs training forwards; reused by
            # every batch of an evaluation while no update changed the weights.
            cached = self._eval_copies.get(shard)
            if cached is None or cached[0] != self._version():
                module = copy.deepcopy(self.modules[shard]).eval()
                self._eval_copies[shard] = cached = (self._version(), module)
        with torch.no_grad():
            return cached[1](x)

    def forget_eval_copies(self) -> None:
        """The weights were replaced (a checkpoint loaded): the eval-mode copies are stale."""
        self._eval_copies.clear()
