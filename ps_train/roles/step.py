"""One step of a trainer: its forward through the shards over RPC, the distributed backward,
and the update requests; the protocol is described in ``ps_train.roles.trainer``'s docstring.

``StepTrainer`` is a trainer as far as a step goes: its data, its servers, ``train_step``
(which sends a step's update requests) and ``settle`` (which waits for their answers).
``ps_train.roles.trainer.Trainer`` adds what goes around the steps: the loop, evaluation,
the metrics and the end of the run. A model with another forward
(every workload's trainer: ``ps_train.workload``) defines ``load`` and ``step_loss``.

A trainer takes the run's whole config (``self.cfg``): its workload's subclass may read any
group of it. What the trainer builds takes the groups it reads (the shards, the update mode,
the elastic role's ``TrainerSplit``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ps_train import backend
from ps_train.config import Config
from ps_train.elastic.trainer import ElasticRole
from ps_train.faults import die, fault_at
from ps_train.metrics import LatencyStats, ThroughputMeter, make_writer
from ps_train.modes import make_mode
from ps_train.modes.base import UPDATE_IN_BACKWARD, UpdateRequest, resolved
from ps_train.partition import TrainerSplit, total_steps
from ps_train.sample_log import SampleLog
from ps_train.stage_sharding import shard_layout

log = logging.getLogger("ps_train.trainer")

# A step metric (``StepTrainer.step_loss``): its value, or a function that computes it after the backward.
StepMetric = float | Callable[[], float]


def update_in_backward(cfg: Config, applies_after_answer: bool) -> bool:
    """Whether the update rides on the backward (on rpc_core): ``cluster.update_in_backward``,
    or when that is null (auto) where it trains faster: a mode whose servers apply the
    update after answering (sync), without a hot-row cache (which pushes its rows' gradients
    before the update request)."""
    wanted = cfg.cluster.update_in_backward
    if wanted is not None:
        return wanted
    return applies_after_answer and getattr(cfg.model, "cache_rows", 0) == 0


class InFlight(NamedTuple):
    """A step whose update requests are sent but not yet settled."""

    scope: ExitStack | None  # its autograd context, still open (None: closed already, pipelined)
    futures: list[torch.futures.Future[Any]]  # every server's answer to its update request
    step: int
    # The answers say the update was taken, not that it is applied (``Mode.applies_after_answer``).
    accepted: bool = False


class StepTrainer:
    """A trainer's data, its servers and the protocol of one step (see the module docstring)."""

    # Set by ``load``; their kinds depend on the model (TensorSplit and BatchIterator here,
    # CtrSplit and CtrBatchIterator in ps_train.workloads.ctr.trainer): the loop needs only len() and next().
    train_set: Any
    test_set: Any
    batches: Any

    def __init__(
        self, cfg: Config, index: int, run_dir: str, start_step: int = 0, data_state: dict[str, int] | None = None
    ) -> None:
        self.cfg = cfg
        self.index = index
        self.name = f"trainer{index}"
        # The partition load() builds: a joiner's (index >= num_trainers) comes per epoch from ps0.
        self.data_slot = index % cfg.cluster.num_trainers
        self.run_dir = run_dir
        self.rpc = backend.rpc()
        self.dist_autograd = backend.dist_autograd()
        self.load()
        if data_state is not None and not cfg.cluster.elastic:  # elastic: ElasticRole places the batches
            self.batches.load_state_dict(data_state)
        self.steps = total_steps(
            cfg.train.steps, cfg.train.epochs, len(self.train_set), cfg.cluster.num_trainers, cfg.train.batch_size
        )
        self.step = start_step
        # The shard layout is computed, not asked for: every process derives the same one.
        self.shard_servers = list(shard_layout(cfg.model, cfg.data, cfg.cluster, cfg.seed))
        # All asked at once: the servers' answers come back side by side, not one after the other.
        asked = [self.rpc.rpc_async(f"ps{r}", _get_server_rref) for r in range(cfg.cluster.num_servers)]
        self.servers = [f.wait() for f in asked]
        # cluster.elastic: start step, batches and length come from ps0 (ps_train.elastic.trainer).
        split = TrainerSplit(cfg.cluster.num_trainers, cfg.train.batch_size, cfg.seed)
        self.elastic = ElasticRole(self, split) if cfg.cluster.elastic else None
        self.writer = make_writer(cfg.logging.tensorboard, f"{run_dir}/tb/{self.name}", filename_suffix=f".{self.name}")
        self.latency = {r: LatencyStats() for r in range(cfg.cluster.num_servers)}
        self.meter = ThroughputMeter()
        self.sample_log = SampleLog(run_dir, self.name)  # which samples each step trained on: off by default
        self.max_steps_ahead = 0  # ssp: the most steps this trainer ran ahead of the slowest
        self._in_flight: InFlight | None = None
        self.mode = make_mode(cfg)  # what an update asks for and waits for (ps_train.modes)
        self.pipelined = self.mode.pipelined  # see ps_train.roles.trainer's docstring
        # cluster.update_in_backward (rpc_core): the update rides on the backward
        # (rpc_core.autograd.hooks); torch's RPC has no such extension, so there, and with
        # cluster.update_in_backward=false, the trainer sends its update requests after the backward.
        self.in_backward = update_in_backward(cfg, self.mode.applies_after_answer) and backend.name() == "rpc_core"

    def load(self) -> None:
        """Set ``train_set``, ``test_set`` and ``batches`` (this trainer's batch iterator):
        the workload's (``ps_train.workload``; e.g. ``ps_train.workloads.vision.trainer``)."""
        raise NotImplementedError(f"{type(self).__name__} must define load(): its workload's data")

    # -- one step ---------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, step: int = -1) -> torch.Tensor:
        h = x
        for shard, server in self.shard_servers:
            h = self.call_server(server, "forward", shard, h, self.index, step)
        return h

    def call_server(self, server: int, method: str, *args: Any) -> torch.Tensor:
        """``method(*args)`` of server ``server``'s ParameterServer, timed into its RPC latency."""
        t0 = time.perf_counter()
        out: torch.Tensor = getattr(self.servers[server].rpc_sync(), method)(*args)
        self.latency[server].record(time.perf_counter() - t0)
        return out

    def step_loss(self, batch: Any) -> tuple[torch.Tensor, Mapping[str, StepMetric]]:
        """The forward of one step through the servers: the loss to backpropagate, and the
        step's metrics besides the loss (the workload's). A metric may be a function of no
        arguments, called once the step's backward returned: its work then stays off the
        path between the forward's answer and the backward's request, which the servers
        wait on."""
        raise NotImplementedError(f"{type(self).__name__} must define step_loss(): its workload's forward")

    def train_step(self, batch: Any) -> dict[str, float]:
        """Forward, backward, and the update requests of one step; ``settle()`` completes
        them. Until then this step's autograd context stays open (the servers read their
        gradients from it), except when ``pipelined``."""
        if self._in_flight is not None and not self.pipelined:
            raise RuntimeError("train_step called before the previous step's updates were settled")
        with ExitStack() as scope:  # a failure closes the context, seeing the error
            ctx = scope.enter_context(self.dist_autograd.context())
            loss, out = self.step_loss(batch)
            self.settle(ordered=True)  # pipelined: the forward ran after the previous update, so this is done
            pos = self._position()
            self.sample_log.trained(self.step + 1)  # as its update goes out (debug record, off by default)
            if self.in_backward:  # the update rides on the backward: done when it returns
                self.dist_autograd.set_backward_info(ctx, UPDATE_IN_BACKWARD, UpdateRequest(self.index, self.step, pos))
                self.dist_autograd.backward(ctx, [loss])
                futs = self._updates_in_backward(ctx, pos)
            else:
                self.dist_autograd.backward(ctx, [loss])
                if fault_at(self.name, self.step + 1, "partial"):  # test-only, see ps_train.faults
                    [version] = torch.futures.wait_all(
                        self.mode.send_update(_Ps0Only(self.index, self.servers[:1]), ctx, self.step, pos)
                    )
                    log.warning(
                        "the step-%d update went to ps0 only, which applied it (version %s)", self.step + 1, version
                    )
                    die(self.name, self.step + 1)
                futs = self.mode.send_update(self, ctx, self.step, pos)
            # Kept open until settle() (the servers read the gradients from it); pipelined: closed here.
            kept = None if self.pipelined else scope.pop_all()
        self._in_flight = InFlight(kept, futs, self.step, self.in_backward and self.mode.applies_after_answer)
        return {"loss": loss.item(), **{k: v() if callable(v) else v for k, v in out.items()}}

    def _position(self) -> dict[str, int] | None:
        """The data position after the step being trained, sent with its update: every server
        notes it (async/ssp: a checkpoint resumes this trainer from it; elastic: a replacement
        does, from ps0's). None in sync mode, where every trainer is at trainer0's step when
        it checkpoints."""
        if self.elastic is not None:
            return self.elastic.position()
        if self.mode.per_trainer_positions:
            state: dict[str, int] = self.batches.state_dict()
            return state
        return None

    def _updates_in_backward(self, ctx: int, pos: dict[str, int] | None) -> list[torch.futures.Future[Any]]:
        """The servers' answers to the update that rode on the backward, in server order; a
        server the backward did not reach (no gradient of its parameters) gets the update
        request of its own."""
        results = self.dist_autograd.backward_results(ctx)
        futs = []
        for r, server in enumerate(self.servers):
            got = results.get(f"ps{r}", {})
            if UPDATE_IN_BACKWARD in got:
                futs.append(resolved(got[UPDATE_IN_BACKWARD]))
            else:
                futs.append(server.rpc_async().update(ctx, self.index, self.step, pos))
        return futs

    def settle(self, ordered: bool = False) -> dict[str, float]:
        """Wait until every server applied the last step's update (and, in ssp mode, until
        this trainer may run ahead again); returns that step's update metrics. ``ordered``:
        right after the next step's forward, which every server ran only once the update
        was applied there (``pipelined``), so an update answered before it was applied
        (``InFlight.accepted``) needs no further word; elsewhere each server is asked."""
        if self._in_flight is None:
            return {}
        scope, futs, step, accepted = self._in_flight
        self._in_flight = None
        if accepted and not ordered:
            futs = [server.rpc_async().applied(step) for server in self.servers]
        with scope if scope is not None else nullcontext():  # then the step's context is closed
            if all(f.done() for f in futs):  # answers that came with the backward: no collect_all
                results = [f.wait() for f in futs]
            else:
                results = torch.futures.wait_all(futs)
        out = self.mode.settled(self, results, step)  # staleness; ssp: waits while too far ahead
        if "steps_ahead" in out:
            self.max_steps_ahead = max(self.max_steps_ahead, int(out["steps_ahead"]))
        return out

    @contextmanager
    def _closing_on_failure(self) -> Iterator[None]:
        """A failure between a step's update requests and its ``settle`` leaves the step's
        autograd context open: close it (seeing the error) and let the error go on."""
        try:
            yield
        except BaseException:
            in_flight, self._in_flight = self._in_flight, None
            scope = in_flight.scope if in_flight is not None else None
            with scope if scope is not None else nullcontext():
                raise


@dataclass(frozen=True)
class _Ps0Only:
    """A trainer as the update mode sees it, but with ps0 as its only server: a test fault
    (``:partial``, ``ps_train.faults``) sends a step's update there alone."""

    index: int
    servers: list[Any]


@backend.called_by_name
def _get_server_rref() -> Any:
    from ps_train.roles.server import get_server_rref

    return get_server_rref()
