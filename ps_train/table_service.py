"""What a parameter server takes from a workload whose model has embedding tables (model=dlrm).

``TablePart`` is a model's tables on one server, split by rows: its rows of every table and
their optimizer; ``TableCheckpoint`` is one checkpoint of them being written. The server
(``ps_train.roles.server``) and its checkpoint writer (``ps_train.roles.checkpointing``) use
them through these Protocols only, so ``roles/`` does not import the workload: the CTR
workload's are ``ps_train.workloads.ctr.tables.service.TableServer`` and ``TableSnapshot``, which
its ``Workload.table_service`` builds (``ps_train.workload``) from the model's and data's
configs and a ``TableSettings``: the little else of the run's config that tables read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

from ps_train.checkpoint.files import ShardFile
from ps_train.checkpoint.forked_writer import FrozenRows
from ps_train.config import OptimConfig

T = TypeVar("T")


@dataclass(frozen=True)
class TableSettings:
    """What a server's tables read of the run besides the model's and the data's configs,
    built where the run's whole config is (``ps_train.launch.rank.table_settings``)."""

    optim: OptimConfig  # the tables' optimizer: its hyper-parameters, unless the model's own
    num_servers: int  # the tables' rows are split over them
    num_trainers: int  # with batch_size: how many new rows one step may bring (dynamic tables,
    batch_size: int  # a disk tier's rows in memory)
    seed: int  # the rows' initial values


class TableCheckpoint(Protocol):
    """A checkpoint of a server's tables being written (``ps_train.workloads.ctr.tables.service.TableSnapshot``)."""

    @property
    def base(self) -> str | None:
        """The checkpoint it builds on (None: it holds every row)."""

    @property
    def state(self) -> dict[str, Any]:
        """What goes into the server's ``.pt`` file for the tables."""

    @property
    def row_count(self) -> int: ...

    @property
    def rows_copied_aside(self) -> int: ...

    def write(self, ckpt_dir: str, shard_name: str) -> ShardFile:
        """Write the rows file; returns its manifest entry."""


class TablePart(Protocol):
    """A model's embedding tables on one server, split by rows: its rows of every table and
    their optimizer (model=dlrm: ``ps_train.workloads.ctr.tables.service.TableServer``)."""

    @property
    def params(self) -> list[nn.Parameter]: ...

    def lookup(
        self,
        rows: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None,
        ids: torch.Tensor | None = None,
        step: int = -1,
        trainer: int = 0,
    ) -> torch.Tensor:
        """For training: one vector per row, or per bag of rows (summed, times ``weights``),
        of the request (``ps_train.workloads.ctr.tables.plan.ServerRequest``): [P, dim]; ``ids``: the raw ids
        of its dynamic tables' rows, by ``trainer`` at ``step``."""

    def read(
        self, rows: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None, ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The same vectors without autograd, for evaluation."""

    def prefetch(self, rows: torch.Tensor) -> None:
        """A hint: a coming request names these rows; a storage with a disk tier brings them
        into RAM in the background. Returns at once."""

    def step(self, grads: Mapping[torch.Tensor, torch.Tensor], lr_factor: float = 1.0) -> None:
        """Update the rows ``grads`` (sparse, by table weight) name, at ``lr_factor`` times the
        rate; the caller holds the server's lock."""

    def stats(self) -> dict[str, Any]:
        """Cumulative counts, among them ``table_rows_read``, ``table_rows_updated``,
        ``table_rows_live`` (rows updated at least once)."""

    def state_dict(self, copy: bool = True) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def begin_snapshot(self, name: str, base: str | None) -> TableCheckpoint:
        """Freeze the rows for checkpoint ``name`` (differential on ``base`` if it can); the
        caller holds the server's lock."""

    @property
    def forks_writer(self) -> bool:
        """Whether ``freeze_rows`` can hand its rows to a forked writer (else the writer is a thread)."""

    def freeze_rows(self, name: str, base: str | None, take: Callable[[FrozenRows], T]) -> T:
        """Freeze the rows for checkpoint ``name`` as ``begin_snapshot`` does, but without
        copying anything: call ``take`` with the live rows while nothing can change them
        (the caller holds the server's lock; this holds the storage's own) and return its
        result. ``take`` forks a writer (``ps_train.checkpoint.forked_writer``), so the rows
        must be CPU tensors in private memory. ``end_snapshot`` once written."""

    def end_snapshot(self, written: bool) -> None: ...
