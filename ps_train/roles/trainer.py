"""The trainer: data -> forward through the shards over RPC -> distributed backward -> update.

Each trainer owns a partition of the training data. Per step (batch x: [B, *in_shape]):

    with dist_autograd.context() as ctx:
        h = x
        for shard in shards:                        # forward order; each on its server
            h = server[shard].forward(shard, h)     # [B, features_k] over RPC
        loss = cross_entropy(h, y)                  # logits h: [B, num_classes]
        dist_autograd.backward(ctx, [loss])         # gradients land on the servers, and
                                                    # each server's update rides on it (rpc_core)
        backend=torch, or cluster.update_in_backward off:
            every server: update(ctx, me, step)     # sync: its answer waits for all trainers
        x, y = next batch                           # while the servers update
        wait for the updates                        # before the next forward
    ssp: ps0.clock(me, step + 1)                    # wait if too far ahead (rpc_core: in the backward)

On rpc_core with ``cluster.update_in_backward`` (by default in sync mode) the update request rides on
the backward (``rpc_core.autograd.hooks``): each server takes it as soon as its part of
the backward is done and the answer comes back with the backward, so a step sends each
server two requests, the forward and the gradient call (sync servers apply the round once
that answer is written: ``ps_train.modes.sync``).

The update requests are sent asynchronously and waited for only after the next batch is
ready (``settle``), so the trainer's end-of-step work (metrics, the next batch) overlaps
the servers' optimizer step. Nothing else moves: the next forward, a checkpoint, an
evaluation or a log line still starts only once every server has applied this step's
update, so results are the same as with a blocking update.

A mode may go one step further (``Mode.pipelined``: sync on rpc_core, ``ps_train.modes.sync``):
the trainer leaves the context and sends the next forward without waiting for the update at
all; each server runs a step-``s`` forward only once its step-``s - 1`` round is applied, and
the trainer collects the update's answer after that forward. What the trainer asks for, what
it learns from the answers (staleness) and whether it waits for the others (ssp's clock) is
the update mode's (``ps_train.modes``).

trainer0 also evaluates on the test split, prints progress, and writes metrics.json.

What a step computes is in ``load``, ``step_loss`` and ``evaluate``; a model with another
forward (``ps_train.ctr.trainer.CtrTrainer``, model=dlrm) overrides them and keeps the
loop, the update protocol and checkpoints.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from ps_train import backend
from ps_train.config import Config
from ps_train.data import BatchIterator, iter_eval_batches, load_data, total_steps
from ps_train.elastic.membership import stop_requested
from ps_train.elastic.trainer import ElasticRole
from ps_train.faults import die, fault_at, maybe_inject_fault
from ps_train.metrics import (
    LatencyStats,
    ThroughputMeter,
    make_writer,
    peak_rss_bytes,
    write_metrics_json,
)
from ps_train.modes import make_mode
from ps_train.modes.base import UPDATE_IN_BACKWARD, UpdateRequest, resolved
from ps_train.observe.console import summary_lines
from ps_train.observe.dashboard import end_session
from ps_train.observe.server_metrics import rpc_byte_counts
from ps_train.sample_log import SampleLog
from ps_train.stage_sharding import model_shards
from rpc_core.functions import async_execution

log = logging.getLogger("ps_train.trainer")

# On ps0: the final totals of trainer1.. as each finishes, and trainer0's request for them.
# They meet on ps0, which every trainer calls anyway, so no trainer connects to another.
_finished: list[dict[str, Any]] = []
_collect: list[tuple[int, torch.futures.Future[Any]]] = []
_finish_lock = threading.Lock()


def deposit_stats(stats: dict[str, Any]) -> None:
    """Called by trainer1.. on ps0 when they finish: their totals, for trainer0."""
    with _finish_lock:
        _finished.append(stats)
        ready = [f for n, f in _collect if len(_finished) == n]
        got = list(_finished)
    for f in ready:
        f.set_result(got)


@async_execution
def collect_stats(others: int) -> torch.futures.Future[Any]:
    """Called by trainer0 on ps0: the totals of the ``others`` other trainers, once all came."""
    f: torch.futures.Future[Any] = torch.futures.Future()
    with _finish_lock:
        if len(_finished) == others:
            f.set_result(list(_finished))
        else:
            _collect.append((others, f))
    return f


StepHook = Callable[["Trainer", int], None]  # after each step: (trainer, step)


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


class Trainer:
    # Set by ``load``; their kinds depend on the model (TensorSplit and BatchIterator here,
    # CtrSplit and CtrBatchIterator in ps_train.ctr.trainer): the loop needs only len() and next().
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
        self.shard_servers = [(s.index, s.server) for s in model_shards(cfg)]
        self.servers = [self.rpc.rpc_sync(f"ps{r}", _get_server_rref) for r in range(cfg.cluster.num_servers)]
        # cluster.elastic: start step, batches and length come from ps0 (ps_train.elastic.trainer).
        self.elastic = ElasticRole(self) if cfg.cluster.elastic else None
        self.writer = make_writer(cfg.logging.tensorboard, f"{run_dir}/tb/{self.name}", filename_suffix=f".{self.name}")
        self.latency = {r: LatencyStats() for r in range(cfg.cluster.num_servers)}
        self.meter = ThroughputMeter()
        self.sample_log = SampleLog(run_dir, self.name)  # which samples each step trained on: off by default
        self.max_steps_ahead = 0  # ssp: the most steps this trainer ran ahead of the slowest
        self._in_flight: InFlight | None = None
        self.mode = make_mode(cfg)  # what an update asks for and waits for (ps_train.modes)
        self.pipelined = self.mode.pipelined  # see module docstring
        # cluster.update_in_backward (rpc_core): the update rides on the backward
        # (rpc_core.autograd.hooks); torch's RPC has no such extension, so there, and with
        # cluster.update_in_backward=false, the trainer sends its update requests after the backward.
        self.in_backward = update_in_backward(cfg, self.mode.applies_after_answer) and backend.name() == "rpc_core"

    def load(self) -> None:
        """Set ``train_set``, ``test_set`` and ``batches`` (this trainer's batch iterator)."""
        cfg = self.cfg
        self.train_set, self.test_set = load_data(cfg.data)
        self.batches = BatchIterator(
            self.train_set, self.data_slot, cfg.cluster.num_trainers, cfg.train.batch_size, cfg.seed
        )

    # -- one step ---------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, step: int = -1) -> torch.Tensor:
        h = x
        for shard, server in self.shard_servers:
            h = self._call(server, "forward", shard, h, self.index, step)
        return h

    def _call(self, server: int, method: str, *args: Any) -> torch.Tensor:
        """``method(*args)`` of server ``server``'s ParameterServer, timed into its RPC latency."""
        t0 = time.perf_counter()
        out: torch.Tensor = getattr(self.servers[server].rpc_sync(), method)(*args)
        self.latency[server].record(time.perf_counter() - t0)
        return out

    def step_loss(self, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        """The forward of one step through the servers: the loss to backpropagate, and the
        step's metrics besides the loss (here the batch accuracy)."""
        x, y = batch
        logits = self.forward(x, self.step)  # [B, num_classes]
        acc = (logits.detach().argmax(1) == y).float().mean().item()
        return F.cross_entropy(logits, y), {"accuracy": acc}

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
        return {"loss": loss.item(), **out}

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
            results = torch.futures.wait_all(futs)
        out = self.mode.settled(self, results, step)  # staleness; ssp: waits while too far ahead
        if "steps_ahead" in out:
            self.max_steps_ahead = max(self.max_steps_ahead, int(out["steps_ahead"]))
        return out

    # -- evaluation -------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        correct, total, loss_sum = 0, 0, 0.0
        for x, y in iter_eval_batches(self.test_set, self.cfg.train.eval_batch_size):
            if total and fault_at(self.name, self.step, "eval"):  # test-only, see ps_train.faults
                die(self.name, self.step)
            h = x
            for shard, server in self.shard_servers:
                h = self.servers[server].rpc_sync().predict(shard, h)
            loss_sum += F.cross_entropy(h, y, reduction="sum").item()
            correct += int((h.argmax(1) == y).sum())
            total += len(y)
        return {"accuracy": correct / max(total, 1), "loss": loss_sum / max(total, 1)}

    def describe_eval(self, ev: dict[str, float]) -> str:
        """``evaluate()``'s result for a log line."""
        return f"test accuracy {ev['accuracy']:.4f}"

    def totals(self) -> dict[str, Any]:
        """This trainer's own totals for metrics.json (trainer0 gathers every trainer's)."""
        return {"peak_rss_bytes": peak_rss_bytes()}

    def extra_metrics(self, all_stats: list[dict[str, Any]], server_stats: list[dict[str, Any]]) -> dict[str, Any]:
        """metrics.json entries beyond the common ones, from every trainer's ``totals()``
        (``all_stats``, in trainer order) and every server's ``stats()``: here each server's
        bytes per trainer step, both ways (rpc_core's byte counters; ``benchmarks/scale_model.py``
        fits its link terms to them)."""
        if not all("bytes_sent" in s for s in server_stats):
            return {}  # backend=torch has no byte counters
        steps = self.steps_taken(all_stats)
        return {
            "server_bytes_per_step": {
                f"ps{r}": {"sent": s["bytes_sent"] / steps, "received": s["bytes_received"] / steps}
                for r, s in enumerate(server_stats)
            }
        }

    def steps_taken(self, all_stats: list[dict[str, Any]]) -> int:
        """The steps every trainer took in this run (a resumed one: from where each started;
        async/ssp trainers resume at steps of their own), at least one each: what per-step
        metrics divide by."""
        return sum(max(s["steps"] - s.get("first_step", self._first_step), 1) for s in all_stats)

    # -- the loop ---------------------------------------------------------------------------------
    def run(self, on_step: StepHook | None = None) -> dict[str, Any] | None:
        """Train to the last step; trainer0 returns the run's final metrics, others None.
        ``on_step(trainer, step)`` runs after each step (trainer0 checkpoints there)."""
        is_chief = self.index == 0
        t_start = self._t_start = time.perf_counter()
        self._first_step = self.step
        self.meter.start()
        losses: list[float] = []
        batch = next(self.batches) if self.step < self.steps else None
        self.sample_log.fetched(self.batches)
        with self._closing_on_failure():
            last = self._loop(batch, losses, on_step)
            self.settle()
        wall = time.perf_counter() - t_start
        moved = rpc_byte_counts()
        self.mode.trainer_done(self)  # ssp: this trainer no longer holds the others back
        mine = {
            "steps": self.step,
            "first_step": self._first_step,
            "samples": self.meter.total,
            "wall_time_s": wall,
            "samples_per_s": self.meter.overall(),
            "losses": losses,
            "max_steps_ahead": self.max_steps_ahead,
            "trainer": self.name,
            **self.totals(),
            **({"bytes_received": moved.received, "bytes_sent": moved.sent} if moved is not None else {}),
        }
        if self.elastic is not None:
            self.elastic.finish(mine)  # to ps0: this trainer may leave the group right after
        elif not is_chief:
            self.rpc.rpc_sync("ps0", deposit_stats, args=(mine,), timeout=0)
        if not is_chief:
            self.writer.close()
            return None
        return self._finish(mine, last)

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

    def _loop(self, batch: Any, losses: list[float], on_step: StepHook | None) -> dict[str, float]:
        """Steps until the last one; returns the last step's metrics."""
        cfg = self.cfg
        log_every = max(1, cfg.train.log_every)
        is_chief = self.index == 0
        last: dict[str, float] = {}
        while self.step < self.steps and batch is not None and not stop_requested():  # None: elastic job over
            last = self.train_step(batch)
            losses.append(last["loss"])
            self.step += 1
            self.meter.update(len(batch[-1]))  # every batch ends with its labels [B]
            step = self.step
            if step < self.steps:
                batch = next(self.batches)  # overlaps the servers' update
                self.sample_log.fetched(self.batches)
            logs = step % log_every == 0 or step == self.steps
            evaluates = is_chief and cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < self.steps
            if not self.pipelined or logs or evaluates:
                last.update(self.settle())
            if logs:
                self._log_train(step, last)
            if evaluates:
                ev = self.evaluate()
                for key, value in ev.items():
                    self.writer.add_scalar(f"test/{key}", value, step)
                log.info("step %d: %s", step, self.describe_eval(ev))
            if on_step is not None:
                on_step(self, step)
            maybe_inject_fault(self.name, step, self.servers[0])  # test-only, see ps_train.faults
        return last

    def _log_train(self, step: int, last: dict[str, float]) -> None:
        rate = self.meter.rate()
        w = self.writer
        w.add_scalar("train/loss", last["loss"], step)
        w.add_scalar("train/accuracy", last["accuracy"], step)
        w.add_scalar("train/samples_per_s", rate, step)
        for tag, value in self.mode.train_scalars(last, self.cfg.optim.lr).items():  # lr, staleness, ...
            w.add_scalar(tag, value, step)
        for r, stats in self.latency.items():
            if stats.count:
                w.add_scalar(f"rpc/forward_latency_ms/ps{r}", stats.mean_s * 1e3, step)
            stats.reset()
        if self.index == 0:
            for r, s in enumerate(self.servers):
                st = s.rpc_sync().stats()
                for shard, n in st["updates"].items():
                    w.add_scalar(f"server/updates/shard{shard}", n, step)
                if "bytes_sent" in st:
                    w.add_scalar(f"rpc/bytes_sent/ps{r}", st["bytes_sent"], step)
                    w.add_scalar(f"rpc/bytes_received/ps{r}", st["bytes_received"], step)
            if self.cfg.logging.progress:
                eta = (self.steps - step) * (time.perf_counter() - self._t_start) / max(step - self._first_step, 1)
                print(
                    f"[{self.name}] step {step}/{self.steps}  loss {last['loss']:.4f}  "
                    f"acc {last['accuracy']:.3f}  {rate:,.0f} samples/s  eta {eta:.0f}s",
                    flush=True,
                )

    def _finish(self, mine: dict[str, Any], last: dict[str, float]) -> dict[str, Any]:
        cfg = self.cfg
        if self.elastic is not None:
            all_stats = self.elastic.all_stats()
        else:
            others = self.rpc.rpc_sync("ps0", collect_stats, args=(cfg.cluster.num_trainers - 1,), timeout=0)
            all_stats = [mine] + sorted(others, key=lambda s: int(s["trainer"].removeprefix("trainer")))
        # Before the final evaluation, so the servers' byte counts are the training's.
        server_stats = [s.rpc_sync().stats() for s in self.servers]
        ev = self.evaluate()
        wall = max(s["wall_time_s"] for s in all_stats)
        samples = sum(s["samples"] for s in all_stats)
        metrics = {
            **{f"test_{key}": value for key, value in ev.items()},
            "final_train_loss": last.get("loss"),
            "steps": self.step,
            "samples": samples,
            "samples_per_s": samples / wall if wall > 0 else 0.0,
            "wall_time_s": wall,
            "mode": cfg.mode.name,
            "backend": backend.name(),
            "num_servers": cfg.cluster.num_servers,
            "num_trainers": cfg.cluster.num_trainers,
            "server_updates": [s["version"] for s in server_stats],
            # rpc_core: requests each server served until the final evaluation (every call
            # since the trainers started; backend=torch keeps no count)
            **(
                {"server_requests": [s["requests_received"] for s in server_stats]}
                if "requests_received" in server_stats[0]
                else {}
            ),
            "max_staleness": max([s["max_staleness"] for s in server_stats] + [0]),
            "max_steps_ahead": max(s["max_steps_ahead"] for s in all_stats),
            "losses": {s["trainer"]: s["losses"] for s in all_stats},
            "peak_rss_bytes": {
                **{f"ps{r}": s["peak_rss_bytes"] for r, s in enumerate(server_stats)},
                **{s["trainer"]: s["peak_rss_bytes"] for s in all_stats},
            },
            **self.extra_metrics(all_stats, server_stats),
            **(self.elastic.extra_metrics(server_stats) if self.elastic is not None else {}),
        }
        for key, value in ev.items():
            self.writer.add_scalar(f"test/{key}", value, self.step)
        self.writer.close()
        end_session(cfg, self.run_dir)  # the HParams table reads these test/* points (ps_train.observe.dashboard)
        write_metrics_json(f"{self.run_dir}/metrics.json", metrics)
        if self.elastic is not None:
            self.elastic.release_servers()
        print(
            f"[{self.name}] done: {self.step} steps, {self.describe_eval(ev)}, "
            f"{metrics['samples_per_s']:,.0f} samples/s over {cfg.cluster.num_trainers} trainer(s), "
            f"{wall:.1f}s",
            flush=True,
        )
        print("\n".join(summary_lines(all_stats, server_stats)), flush=True)
        return metrics


@dataclass(frozen=True)
class _Ps0Only:
    """A trainer as the update mode sees it, but with ps0 as its only server: a test fault
    (``:partial``, ``ps_train.faults``) sends a step's update there alone."""

    index: int
    servers: list[Any]


def _get_server_rref() -> Any:
    from ps_train.roles.server import get_server_rref

    return get_server_rref()
