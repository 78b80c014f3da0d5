"""A trainer's side of an elastic run (``cluster.elastic=true``; ps0's side is ``ps_train.elastic.membership``).

- ``join_group``: every role enters the run's dynamic rpc_core group (ps0 founds it). A
  replacement takes its dead predecessor's rank and name, which the group frees as soon as
  ps0 has seen the old connection drop; a joiner (``join=<run dir>``) takes the first free
  trainer rank.
- ``ElasticBatches``: the trainer's batches, one epoch at a time, from the partition ps0
  assigns it for that epoch (``Assignment``: slot ``s`` of ``world``); the position after each
  step goes to every server with the step's update (``ps_train.checkpoint.positions``), so a
  replacement continues with the next batch after its predecessor's last step ps0 applied.
- ``ElasticRole``: where a trainer starts -- a replacement after its predecessor's last step
  that ps0 applied, a launched trainer after its own step in the checkpoint (or 0), a joiner at the
  slowest trainer's step -- and how it hands in its totals at the end.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ps_train import backend
from ps_train.elastic import membership
from ps_train.elastic.membership import Assignment
from ps_train.observe.console import CONSOLE
from ps_train.partition import TrainerSplit
from rpc_core.errors import WorkerLeftError

__all__ = ["ElasticBatches", "ElasticRole", "join_group", "wait_for_servers", "JOINER_STEPS"]

log = logging.getLogger("ps_train.elastic")

JOINER_STEPS = 1 << 62  # a joiner trains until ps0 says the job is over
_RETRY_FIRST, _RETRY_MAX = 0.05, 1.0  # s between attempts at a rank that is still being freed


def join_group(name_of: Callable[[int], str], rank: int, options: Any, timeout: float, next_free: bool) -> int:
    """``init_rpc`` into the run's dynamic group as ``name_of(rank)``; returns the rank taken.

    A rank or name held by a member is refused by ps0 (the registry). ``next_free``: try the
    next rank (a joiner); else wait for it to be freed (a replacement: the dead predecessor is
    removed once ps0 sees its connection drop, a moment after the launcher saw it die).
    """
    rpc = backend.rpc()
    deadline = time.monotonic() + timeout
    delay = _RETRY_FIRST
    while True:
        try:
            rpc.init_rpc(name_of(rank), rank=rank, world_size=None, rpc_backend_options=options)
            return rank
        except Exception as e:
            if "is not unique" not in str(e) or time.monotonic() + delay > deadline:
                raise
            if next_free:
                rank += 1
                continue
            log.info("rank %d is still held by its predecessor; retrying in %.2f s", rank, delay)
            time.sleep(delay)  # retry backoff while ps0 removes the dead member; not a test wait
            delay = min(2 * delay, _RETRY_MAX)


def wait_for_servers(num_servers: int, timeout: float) -> None:
    """Return once ps0..ps<S-1> are all in the group (a trainer may join before them)."""
    agent = backend.rpc()._get_current_rpc_agent()
    wanted = {f"ps{r}" for r in range(num_servers)}
    cond = threading.Condition()

    def missing() -> set[str]:
        return wanted - {w.name for w in agent.get_worker_infos()}

    def changed(info: Any, joined: bool) -> None:
        with cond:
            cond.notify_all()

    backend.rpc().add_membership_listener(changed)
    try:
        with cond:
            if not cond.wait_for(lambda: not missing(), timeout=timeout or None):
                raise TimeoutError(
                    f"servers {sorted(missing())} did not join the group within {timeout:g} s "
                    "(cluster.init_timeout); see their logs"
                )
    finally:
        backend.rpc().remove_membership_listener(changed)


class ElasticBatches:
    """Batches of the partitions ps0 assigns, epoch by epoch; ``None`` once the job is over.

    ``make(slot, world)``: the model's batch iterator (``BatchIterator`` or
    ``CtrBatchIterator``) for that partition; ``assign(epoch)``: ps0's ``Assignment`` for the
    next epoch (blocking until it has one), None when the job is over.
    """

    def __init__(
        self,
        make: Callable[[int, int], Any],
        assign: Callable[[int], Assignment | None],
        first: Assignment | None,
        offset: int = 0,
    ) -> None:
        self.make, self.assign = make, assign
        self.inner: Any = None
        self.current: Assignment | None = None
        if first is not None:
            self._start(first, offset)

    def _start(self, a: Assignment, offset: int) -> None:
        self.current = a
        self.inner = self.make(a.slot, a.world)
        self.inner.epoch, self.inner.offset = a.epoch, offset

    def __next__(self) -> Any:
        if self.current is None:
            return None
        inner = self.inner
        if inner.offset + inner.batch_size > inner.n_items // inner.world:  # this epoch's share is used up
            nxt = self.assign(self.current.epoch + 1)
            if nxt is None:
                self.current = None
                return None
            self._start(nxt, 0)
        return next(self.inner)

    @property
    def last_batch(self) -> tuple[int, Any] | None:
        """(epoch, training-split indices [batch_size]) of the last batch, for the debug record
        of trained samples (``ps_train.sample_log``)."""
        return None if self.inner is None else getattr(self.inner, "last_batch", None)

    def position(self) -> dict[str, int]:
        """JSON-safe: where the next batch comes from (epoch, slot, world, samples used)."""
        if self.current is None:
            return {}
        a = self.current
        return {"epoch": a.epoch, "slot": a.slot, "world": a.world, "offset": self.inner.offset}


class ElasticTrainer(Protocol):
    """What an elastic run sets up and uses of a trainer (``ps_train.roles.trainer.Trainer``)."""

    step: int  # the step it trains next
    steps: int  # the step it trains to
    batches: Any  # its batch iterator (replaced by ElasticBatches)

    @property
    def index(self) -> int: ...

    @property
    def name(self) -> str: ...

    @property
    def train_set(self) -> Any: ...

    @property
    def servers(self) -> Sequence[Any]:
        """RRefs to the ParameterServers."""


class ElasticRole:
    """Sets up ``trainer`` for an elastic run: its first step, its batches, and for a joiner
    its length. ``split``: how the run deals its data out to the trainers it launched."""

    def __init__(self, trainer: ElasticTrainer, split: TrainerSplit) -> None:
        self.trainer = trainer
        self.split = split
        self.rpc = backend.rpc()
        self.joiner = trainer.index >= split.world
        template = trainer.batches  # built for slot index % T; only its type and data are used here

        def make(slot: int, world: int) -> Any:
            return type(template)(trainer.train_set, slot, world, split.batch_size, split.seed)

        point = self._ps0(membership.resume_point, trainer.index)
        if self.joiner:
            trainer.steps = JOINER_STEPS
        if self.joiner and "position" not in point:
            trainer.step = self._ps0(membership.join_step)
            first = self._ps0(membership.assignment, trainer.index, -1)
            offset = 0
            log.info(
                "%s joined the job at step %d; %s",
                trainer.name,
                trainer.step,
                f"training from epoch {first.epoch} as {first.slot} of {first.world}"
                if first
                else "the job is over already",
            )
        elif "position" in point:  # a replacement (of a launched trainer or a joiner): continue after
            # the predecessor's last step
            trainer.step, pos = point["step"], point["position"]
            first, offset = Assignment(pos["epoch"], pos["slot"], pos["world"]), pos["offset"]
            log.warning(
                "%s replaces a trainer that died: continuing after its step %d (epoch %d, slot %d of %d, "
                "%d samples of the epoch done)",
                trainer.name,
                trainer.step,
                first.epoch,
                first.slot,
                first.world,
                offset,
                extra=CONSOLE,
            )
        else:  # where the attempt started (step 0 or its checkpoint's)
            trainer.step, data_state = point["step"], point["data_state"]
            epoch, offset = (data_state["epoch"], data_state["offset"]) if data_state else (0, 0)
            first = self._ps0(membership.assignment, trainer.index, epoch)
        trainer.batches = ElasticBatches(
            make, lambda e: self._ps0(membership.assignment, trainer.index, e), first, offset
        )

    def _ps0(self, func: Callable[..., Any], *args: Any) -> Any:
        return self.rpc.rpc_sync("ps0", func, args=args, timeout=0)  # may wait for an epoch: no time limit

    def position(self) -> dict[str, int]:
        return self.trainer.batches.position()

    def finish(self, stats: dict[str, Any]) -> None:
        """Hand this trainer's totals to ps0 (it may leave the group right after)."""
        self._ps0(membership.finish, self.trainer.index, stats)

    def all_stats(self) -> list[dict[str, Any]]:
        """trainer0: every trainer's totals, once the job is over (joiners included)."""
        reports = self._ps0(membership.final_reports)
        return [reports[k] for k in sorted(reports)]

    def extra_metrics(self, server_stats: list[dict[str, Any]]) -> dict[str, Any]:
        """metrics.json entries of an elastic run: updates and samples per trainer as the
        servers counted them (a replaced trainer's predecessors included), and the membership."""
        per_server = {f"ps{r}": s["updates_by_trainer"] for r, s in enumerate(server_stats)}
        samples = {name: n * self.split.batch_size for name, n in server_stats[0]["updates_by_trainer"].items()}
        return {
            "updates_by_trainer": per_server,
            "samples_by_trainer": samples,
            "samples": sum(samples.values()),
            "membership": self._ps0(membership.events),
        }

    def release_servers(self) -> None:
        """trainer0, after writing the results: the servers may leave the group."""
        for fut in [s.rpc_async().release() for s in self.trainer.servers]:
            try:
                fut.wait()
            except WorkerLeftError:
                pass  # it left at once, before its answer reached us: released all the same
