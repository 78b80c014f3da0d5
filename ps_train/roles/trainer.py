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
forward (``ps_train.workloads.ctr.trainer.CtrTrainer``, model=dlrm) overrides them and keeps the
loop, the update protocol and checkpoints.

The step and its update protocol are ``StepTrainer``'s (``ps_train.roles.step``); ``Trainer``
adds the loop around the steps, evaluation, the metrics and the end of the run.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ps_train import backend
from ps_train.elastic.membership import stop_requested
from ps_train.faults import maybe_inject_fault
from ps_train.metrics import peak_rss_bytes, write_metrics_json
from ps_train.observe import phases
from ps_train.observe.console import summary_lines
from ps_train.observe.dashboard import end_session
from ps_train.observe.server_metrics import rpc_byte_counts
from ps_train.roles.step import StepTrainer
from ps_train.roles.step import update_in_backward as update_in_backward  # where tests and callers find it
from rpc_core.functions import async_execution

log = logging.getLogger("ps_train.trainer")

# On ps0: the final totals of trainer1.. as each finishes, and trainer0's request for them.
# They meet on ps0, which every trainer calls anyway, so no trainer connects to another.
_finished: list[dict[str, Any]] = []
_collect: list[tuple[int, torch.futures.Future[Any]]] = []
_finish_lock = threading.Lock()


@backend.called_by_name
def deposit_stats(stats: dict[str, Any]) -> None:
    """Called by trainer1.. on ps0 when they finish: their totals, for trainer0."""
    with _finish_lock:
        _finished.append(stats)
        ready = [f for n, f in _collect if len(_finished) == n]
        got = list(_finished)
    for f in ready:
        f.set_result(got)


@async_execution
@backend.called_by_name
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


class Trainer(StepTrainer):
    """A trainer: ``StepTrainer``'s steps in a loop to the last one, with evaluation, the
    metrics and, on trainer0, the run's final metrics (see the module docstring)."""

    checkpoint_wait_s = 0.0  # trainer0: seconds after its last step waiting for the last checkpoint

    # -- evaluation -------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """The workload's metrics on the test split (trainer0, at the end and every
        ``train.eval_every`` steps)."""
        raise NotImplementedError(f"{type(self).__name__} must define evaluate(): its workload's metrics")

    def describe_eval(self, ev: dict[str, float]) -> str:
        """``evaluate()``'s result for a log line."""
        return ", ".join(f"test {k} {v:.4f}" for k, v in ev.items())

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
        self.checkpoint_wait_s = 0.0  # trainer0: after its last step, for the last checkpoint
        phases.mark("loop_start")
        self._first_step = self.step
        self.meter.start()
        losses: list[float] = []
        batch = next(self.batches) if self.step < self.steps else None
        self.sample_log.fetched(self.batches)
        with self._closing_on_failure():
            last = self._loop(batch, losses, on_step)
            self.settle()
        # The training loop's time: the wait for the last checkpoint to become durable is
        # reported on its own (final_checkpoint_wait_s), not as slower training.
        wall = time.perf_counter() - t_start - self.checkpoint_wait_s
        moved = rpc_byte_counts()
        self.mode.trainer_done(self)  # ssp: this trainer no longer holds the others back
        mine = {
            "steps": self.step,
            "first_step": self._first_step,
            "samples": self.meter.total,
            "wall_time_s": wall,
            "samples_per_s": self.meter.total / wall if wall > 0 else 0.0,
            "final_checkpoint_wait_s": self.checkpoint_wait_s,
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

    def _loop(self, batch: Any, losses: list[float], on_step: StepHook | None) -> dict[str, float]:
        """Steps until the last one; returns the last step's metrics."""
        cfg = self.cfg
        log_every = max(1, cfg.train.log_every)
        is_chief = self.index == 0
        last: dict[str, float] = {}
        while self.step < self.steps and batch is not None and not stop_requested():  # None: elastic job over
            last = self.train_step(batch)
            if not losses:
                phases.mark("first_step")
            losses.append(last["loss"])
            self.step += 1
            self.meter.update(len(batch[-1]))  # every batch ends with its labels [B]
            step = self.step
            if step < self.steps:
                batch = next(self.batches)  # overlaps the servers' update
                self.sample_log.fetched(self.batches)
                if batch is not None:
                    self.upcoming(batch)
            logs = step % log_every == 0 or step == self.steps
            evaluates = is_chief and cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < self.steps
            if not self.pipelined or logs or evaluates:
                last.update(self.settle())
            if logs:
                self.log_train(step, last)
            if evaluates:
                ev = self.evaluate()
                for key, value in ev.items():
                    self.writer.add_scalar(f"test/{key}", value, step)
                log.info("step %d: %s", step, self.describe_eval(ev))
            if on_step is not None:
                on_step(self, step)
            maybe_inject_fault(self.name, step, self.servers[0])  # test-only, see ps_train.faults
        return last

    def upcoming(self, batch: Any) -> None:
        """The next step's batch, fetched while the servers apply this step's update: a
        workload may tell its servers what that step will ask for (table rows to prefetch)."""

    def waited_for_checkpoint(self, seconds: float) -> None:
        """``ps_train.checkpoint.protocol.CheckpointingTrainer``: trainer0 waited ``seconds``
        after its last step for the last checkpoint to be complete."""
        self.checkpoint_wait_s += seconds

    def log_train(self, step: int, last: dict[str, float]) -> None:
        """TensorBoard scalars and the progress line of a logged step (a workload adds its own)."""
        rate = self.meter.rate()
        w = self.writer
        w.add_scalar("train/loss", last["loss"], step)
        if "accuracy" in last:  # a classifier's (the vision workload's step metric)
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
                acc = f"acc {last['accuracy']:.3f}  " if "accuracy" in last else ""
                print(
                    f"[{self.name}] step {step}/{self.steps}  loss {last['loss']:.4f}  "
                    f"{acc}{rate:,.0f} samples/s  eta {eta:.0f}s",
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
        phases.mark("eval_start")
        ev = self.evaluate()
        phases.mark("eval_end")
        wall = max(s["wall_time_s"] for s in all_stats)
        samples = sum(s["samples"] for s in all_stats)
        metrics = {
            **{f"test_{key}": value for key, value in ev.items()},
            "final_train_loss": last.get("loss"),
            "steps": self.step,
            "samples": samples,
            "samples_per_s": samples / wall if wall > 0 else 0.0,
            "wall_time_s": wall,
            # trainer0, after the last step: until the last checkpoint was durable (not in wall_time_s)
            "final_checkpoint_wait_s": mine["final_checkpoint_wait_s"],
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
        end_session(
            cfg.logging.tensorboard, self.run_dir
        )  # the HParams table reads these test/* points (ps_train.observe.dashboard)
        write_metrics_json(f"{self.run_dir}/metrics.json", metrics)
        if self.elastic is not None:
            self.elastic.release_servers()
        print(
            f"[{self.name}] done: {self.step} steps, {self.describe_eval(ev)}, "
            f"{metrics['samples_per_s']:,.0f} samples/s over {cfg.cluster.num_trainers} trainer(s), "
            f"{wall:.1f}s",
            flush=True,
        )
        if self.checkpoint_wait_s:
            print(
                f"[{self.name}] then waited {self.checkpoint_wait_s:.1f}s for the last checkpoint to become "
                "durable (not counted in samples/s)",
                flush=True,
            )
        print("\n".join(summary_lines(all_stats, server_stats)), flush=True)
        return metrics
