"""A discrete-event simulation of a ps_train job on SimPy, priced by the cost model's constants.

What it plays: every trainer runs its steps (``steps.step_plan``: the calls of a step, in
phases) on its own host; each server is one core (a SimPy resource, FIFO) that serves a call
for the CPU seconds the constants give it; each host has a link of a rate each way (a
resource per direction: a message holds the sender's way out and the receiver's way in for
``bytes x 8 / rate``) and a one-way delay. The update modes wait as ps_train's do:

- ``sync``: a step-s forward waits on each server until that server has every trainer's
  step s-1 update (the round); the update is answered once its round is complete, and the
  trainer does not wait for that answer before its next forward (``ps_train/modes/sync.py``:
  pipelined on rpc_core): it takes it after that forward and its loss, before the backward;
- ``hybrid``: the dense rounds of sync, and the update is answered once its round is
  complete (``ps_train/modes/hybrid.py``); row lookups need no wait of their own then;
- ``ssp``: a trainer starts step s once the slowest has finished step s - staleness - 1;
- ``async``: no wait.

Stragglers slow a trainer's own CPU (``Stragglers``). Failures (``Failures``) strike a node
(trainer or server) at exponential times of the given MTBF: a server's, or any in sync and
hybrid (which cannot replace a trainer), restarts the job from its last checkpoint, losing
the steps since; in async and ssp a failed trainer is replaced and the others go on.

Not modelled: several roles sharing a machine's cores, the start-up and final evaluation,
checkpoint writing time, TCP's windows and the bursts of a shaped link.
"""

from __future__ import annotations

import math
import random
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import simpy

from ps_train.plan.steps import Call, StepPlan
from ps_train.scaling.cost_model import BARRIER_MODES, MODES, Cluster

__all__ = ["Stragglers", "Kill", "Failures", "SimResult", "Cpu", "Server", "simulate", "STRAGGLER_KINDS"]

STRAGGLER_KINDS = ("none", "one_in", "lognormal")
Proc = Generator[simpy.Event, Any, None]


@dataclass(frozen=True)
class Stragglers:
    """``one_in``: trainers ``every - 1``, ``2 every - 1``, ... run their CPU ``factor`` times
    slower; ``lognormal``: every step's CPU of every trainer times a lognormal draw of mean 1."""

    kind: str = "none"
    every: int = 100
    factor: float = 2.0
    sigma: float = 0.1

    def __post_init__(self) -> None:
        if self.kind not in STRAGGLER_KINDS:
            raise ValueError(f"stragglers.kind: unknown {self.kind!r}; choose one of {list(STRAGGLER_KINDS)}")
        if self.every < 1 or self.factor < 1.0 or self.sigma < 0:
            raise ValueError(
                f"stragglers: every={self.every} must be >= 1, factor={self.factor} >= 1, sigma={self.sigma} >= 0"
            )


@dataclass(frozen=True)
class Kill:
    """One node killed once, ``delay_s`` after every trainer has committed step ``after_step``
    (a measured run's kill, replayed: ``benchmarks/scale_hosts.py --kill-trainer``); the mode
    recovers from it as from any failure."""

    node: int  # 0..T-1 a trainer, then the servers
    after_step: int
    delay_s: float = 0.0

    def __post_init__(self) -> None:
        if self.node < 0 or self.after_step < 0 or self.delay_s < 0:
            raise ValueError(
                f"kill: node={self.node}, after_step={self.after_step} and delay_s={self.delay_s} must be >= 0"
            )


@dataclass(frozen=True)
class Failures:
    """Node failures at exponential times, ``mtbf_s`` per node (0: none), and ``kills`` at set
    points of the job."""

    mtbf_s: float = 0.0
    checkpoint_every: int = 100  # steps per trainer between checkpoints (what a restart resumes)
    restart_s: float = 30.0  # a restarted job's time to start again (processes, rendezvous, loading)
    replace_s: float = 10.0  # a replacement trainer's time to start and join
    kills: tuple[Kill, ...] = ()

    def __post_init__(self) -> None:
        if self.mtbf_s < 0 or self.checkpoint_every < 1 or self.restart_s < 0 or self.replace_s < 0:
            raise ValueError(
                f"failures: mtbf_s={self.mtbf_s} must be >= 0, checkpoint_every={self.checkpoint_every} >= 1, "
                f"restart_s={self.restart_s} and replace_s={self.replace_s} >= 0"
            )


@dataclass(frozen=True)
class SimResult:
    samples_per_s: float  # in the steady window (no failures) or over the horizon (failures)
    sim_seconds: float  # simulated time
    steps_done: int  # committed steps over all trainers
    failures: int = 0
    restarts: int = 0
    replacements: int = 0
    steps_lost: int = 0  # rolled back by restarts or lost in a replaced trainer's step
    server_busy: list[float] = field(default_factory=list)  # each server's share of the time busy


class Cpu:
    """A host's CPU for ``cores`` below 1: a slower core (``period`` 0), or a CFS quota of
    ``cores x period`` seconds of a full-speed core per period, the work waiting for the next
    period once it is spent (a cgroup's ``cpu.cfs_quota_us``). A quota lets a host that was
    idle catch up at full speed; a slower core does not."""

    def __init__(self, env: simpy.Environment, cores: float, period: float = 0.0) -> None:
        self.env, self.speed, self.period = env, min(cores, 1.0), period
        self.left, self.ends = self.speed * period, period  # this period's budget, and its end

    def run(self, seconds: float) -> Proc:
        """``seconds`` of a full core's work."""
        if not self.period or self.speed >= 1.0:
            yield self.env.timeout(seconds / self.speed)
            return
        while seconds > 1e-12:
            now = self.env.now
            if now >= self.ends - 1e-12:  # a new period: a new budget
                self.left = self.speed * self.period
                self.ends = (math.floor(now / self.period + 1e-9) + 1) * self.period
            if self.left <= 1e-12:
                yield self.env.timeout(self.ends - now)  # throttled to the period's end
                continue
            run = min(seconds, self.left, self.ends - now)
            yield self.env.timeout(run)
            self.left -= run
            seconds -= run


class Server:
    """One server core: calls queue for it in arrival order and hold it for their service time."""

    def __init__(self, env: simpy.Environment, cores: float, period: float = 0.0) -> None:
        self.env, self.cpu = env, Cpu(env, cores, period)
        self.core = simpy.Resource(env, capacity=1)
        self.busy_s = 0.0

    def serve(self, seconds: float) -> Proc:
        with self.core.request() as turn:
            yield turn
            started = self.env.now
            yield from self.cpu.run(seconds)
            self.busy_s += self.env.now - started


class _Way(simpy.Resource):
    """One direction of a host's link: one message at a time, and a token bucket of ``burst``
    bytes (a shaped link's) that refills at the link's rate while the way is idle."""

    def __init__(self, env: simpy.Environment, burst: float) -> None:
        super().__init__(env, capacity=1)
        self.burst, self.tokens, self.stamp = burst, burst, 0.0

    def wait_s(self, nbytes: float, bps: float) -> float:
        """Seconds until ``nbytes`` have passed, starting now: what the bucket lacks, at the rate."""
        self.tokens = min(self.burst, self.tokens + (self._env.now - self.stamp) * bps / 8)
        self.stamp = self._env.now
        return max(0.0, nbytes - self.tokens) * 8 / bps

    def passed(self, nbytes: float, seconds: float, bps: float) -> None:
        """``nbytes`` went out over ``seconds`` since ``wait_s``: the bucket spent them, refilling."""
        self.tokens = max(0.0, min(self.burst, self.tokens + seconds * bps / 8) - nbytes)
        self.stamp = self._env.now


class _Link:
    """A host's link: one way out, one way in."""

    def __init__(self, env: simpy.Environment, burst: float) -> None:
        self.out, self.into = _Way(env, burst), _Way(env, burst)


class _Job:
    def __init__(
        self, cl: Cluster, plan: StepPlan, stragglers: Stragglers, failures: Failures, staleness: int, seed: int
    ) -> None:
        self.env = simpy.Environment()
        self.cl, self.plan, self.strag, self.fail, self.staleness = cl, plan, stragglers, failures, staleness
        self.rng = random.Random(seed)
        self.servers = [Server(self.env, cl.server_cores, cl.cpu_period_s) for _ in range(cl.servers)]
        finite = math.isfinite(cl.link_bps)
        burst = cl.link_burst_bytes
        self.trainer_links = [_Link(self.env, burst) for _ in range(cl.trainers)] if finite else []
        self.server_links = [_Link(self.env, burst) for _ in range(cl.servers)] if finite else []
        # A trainer's core, for the answers of a phase's calls taken one after the other.
        self.trainer_cpu = [simpy.Resource(self.env, capacity=1) for _ in range(cl.trainers)]
        # Each trainer's host: a straggler of ``one_in`` has its cores over ``factor``.
        kt = min(cl.trainer_cores, 1.0)
        self.hosts = [Cpu(self.env, kt / self._fixed_slowdown(k), cl.cpu_period_s) for k in range(cl.trainers)]
        self.done = [0] * cl.trainers  # committed steps per trainer
        self.finished: list[list[float]] = [[] for _ in range(cl.trainers)]  # when each trainer finished each step
        self.procs: list[simpy.Process | None] = [None] * cl.trainers
        self.children: list[list[simpy.Process]] = [[] for _ in range(cl.trainers)]
        self.rounds: dict[tuple[int, int], int] = {}  # (server, step) -> updates served this generation
        self.round_events: dict[tuple[int, int], simpy.Event] = {}
        self.level_events: dict[int, simpy.Event] = {}  # ssp: fires when every trainer has done that many steps
        self.restarts = self.replacements = self.steps_lost = self.failures = 0
        self.generation = 0  # restarts so far: a restart's or a replacement's timer acts only in its own
        self.down: set[int] = set()  # trainers waiting to be started again
        self.resumed_at = 0  # the step the job last (re)started from: no round before it to wait for

    # -- the network and the servers ------------------------------------------------------------
    def _send(self, src: _Way | None, dst: _Way | None, nbytes: float, delay: bool = True) -> Proc:
        """A message: it holds the sender's way out and the receiver's way in (None: free, or
        no link limit) while its bytes pass (those either bucket lacks, at the rate), then
        travels the delay."""
        if math.isfinite(self.cl.link_bps):
            bps = self.cl.link_bps
            ways = [r for r in (src, dst) if r is not None]
            held = [r.request() for r in ways]
            for turn in held:  # always the way out before the way in: no cycle of waits
                yield turn
            try:
                passing = max((w.wait_s(nbytes, bps) for w in ways), default=nbytes * 8 / bps)
                yield self.env.timeout(passing)
                for w in ways:
                    w.passed(nbytes, passing, bps)
                if delay and self.cl.latency_s > 0:
                    yield self.env.timeout(self.cl.latency_s)
            finally:
                for turn in held:
                    turn.cancel()  # not granted yet (interrupted while queueing): leave the queue
                    if turn.triggered:
                        turn.resource.release(turn)
        elif delay and self.cl.latency_s > 0:
            yield self.env.timeout(self.cl.latency_s)

    def _round(self, server: int, step: int) -> simpy.Event:
        key = (server, step)
        if key not in self.round_events:
            self.round_events[key] = self.env.event()
        return self.round_events[key]

    def _call(self, k: int, step: int, call: Call, slow: float) -> Proc:
        try:
            yield from self._play(k, step, call, slow)
        except simpy.Interrupt:
            pass  # its trainer failed or the job restarts: the call is lost with it

    def _play(self, k: int, step: int, call: Call, slow: float, alone: bool = False) -> Proc:
        """``alone``: the trainer's only call in flight, so its own link is free both ways and
        the message holds the server's side only. The trainer has spent its CPU to send the
        call; it spends as much again to take the answer (``slow``: its straggler factor over
        its cores), on its one core, after the other answers that came before."""
        mode = self.cl.mode
        tl = self.trainer_links[k] if self.trainer_links and not alone else None
        sl = self.server_links[call.server] if self.server_links else None
        # The trainer's link carries every copy; the server standing for them, its own.
        if tl is not None and call.copies > 1:
            yield from self._send(tl.out, None, call.out_bytes * (call.copies - 1), delay=False)
        yield from self._send(tl.out if tl else None, sl.into if sl else None, call.out_bytes)
        if mode in BARRIER_MODES and call.kind in ("forward", "lookup") and step > self.resumed_at:
            yield self._round(call.server, step - 1)  # the previous round applied on this server
        yield from self.servers[call.server].serve(call.service_s)
        if call.kind == "update" and mode in BARRIER_MODES:
            key = (call.server, step)
            self.rounds[key] = self.rounds.get(key, 0) + 1
            if self.rounds[key] == self.cl.trainers:
                self._round(call.server, step).succeed()
            yield self._round(call.server, step)  # answered once the round is applied
        yield from self._send(sl.out if sl else None, tl.into if tl else None, call.back_bytes)
        if tl is not None and call.copies > 1:
            yield from self._send(None, tl.into, call.back_bytes * (call.copies - 1), delay=False)
        receive = self.plan.call_cpu_s(call) / 2 * call.copies * slow
        if alone:
            yield from self.hosts[k].run(receive)
        else:
            with self.trainer_cpu[k].request() as turn:
                yield turn
                yield from self.hosts[k].run(receive)

    # -- the trainers ---------------------------------------------------------------------------
    def _fixed_slowdown(self, k: int) -> float:
        """A ``one_in`` straggler's factor (its host's cores over it), else 1."""
        s = self.strag
        return s.factor if s.kind == "one_in" and k % s.every == s.every - 1 else 1.0

    def _slowdown(self, k: int) -> float:
        """This step's factor on trainer ``k``'s CPU work, beyond its host's (lognormal draws)."""
        s = self.strag
        return self.rng.lognormvariate(-(s.sigma**2) / 2, s.sigma) if s.kind == "lognormal" else 1.0

    def _level(self, steps: int) -> simpy.Event:
        if steps not in self.level_events:
            self.level_events[steps] = self.env.event()
            if min(self.done) >= steps:
                self.level_events[steps].succeed()
        return self.level_events[steps]

    def _trainer(self, k: int, steps: float) -> Proc:
        plan, cpu = self.plan, self.hosts[k]
        # Sync sends its next forward without waiting for its update's answer, once the step
        # has a forward to send first (a plan whose update is its only phase has none).
        pipelined = self.cl.mode == "sync" and 0 < plan.cpu_at < len(plan.phases)
        pending: list[simpy.Process] = []
        try:
            while self.done[k] < steps:
                s = self.done[k]
                if self.cl.mode == "ssp" and s - self.staleness > 0:
                    yield self._level(s - self.staleness)  # the slowest is at most `staleness` steps behind
                slow = self._slowdown(k)
                for at, phase in enumerate(plan.phases):
                    if at == plan.cpu_at:
                        yield from cpu.run(plan.trainer_cpu_s * slow)
                        if pending:  # sync: the previous step's update answers, before the backward
                            yield self.env.all_of(pending)
                            pending = []
                    last = at == len(plan.phases) - 1
                    if len(phase) == 1 and not (pipelined and last):  # inline: a process costs more than a call
                        yield from cpu.run(plan.call_cpu_s(phase[0]) / 2 * slow)
                        yield from self._play(k, s, phase[0], slow, alone=True)
                        continue
                    calls = []
                    for call in phase:
                        yield from cpu.run(plan.call_cpu_s(call) / 2 * call.copies * slow)
                        calls.append(self.env.process(self._call(k, s, call, slow)))
                    self.children[k] = pending + calls
                    if pipelined and last:
                        pending = calls  # the next forward goes out at once
                    else:
                        yield self.env.all_of(calls)
                self.children[k] = list(pending)
                self._commit(k)  # pipelined: as its update goes out, as ps_train's trainer counts it
            if pending:
                yield self.env.all_of(pending)  # the last step's answers
        except simpy.Interrupt:
            for child in self.children[k]:
                if child.is_alive:
                    child.interrupt()
            self.children[k] = []

    def _commit(self, k: int) -> None:
        self.done[k] += 1
        self.finished[k].append(self.env.now)
        low = min(self.done)
        ev = self.level_events.get(low)
        if ev is not None and not ev.triggered:
            ev.succeed()

    def start(self, k: int, steps: float) -> None:
        self.procs[k] = self.env.process(self._trainer(k, steps))

    # -- failures -------------------------------------------------------------------------------
    def _stop(self, k: int) -> None:
        proc = self.procs[k]
        if proc is not None and proc.is_alive:
            proc.interrupt()

    def failures_process(self, steps: float) -> Proc:
        """Failures at exponential times over all nodes (their own random stream, so that every
        mode sees the same failures for a seed), each handled by the mode's recovery."""
        nodes = self.cl.trainers + self.cl.servers
        rng = random.Random(self.rng.random())
        while True:
            yield self.env.timeout(rng.expovariate(nodes / self.fail.mtbf_s))
            self._fail(rng.randrange(nodes), steps)

    def kill_process(self, kill: Kill, steps: float) -> Proc:
        """``kill``: once every trainer has committed its step, wait its delay, fail its node."""
        yield self._level(kill.after_step)
        yield self.env.timeout(kill.delay_s)
        self._fail(kill.node, steps)

    def _fail(self, node: int, steps: float) -> None:
        self.failures += 1
        if node < self.cl.trainers and self.cl.mode in ("async", "ssp"):
            self.env.process(self._replace(node, steps))
        else:
            self.env.process(self._restart(steps))

    def _replace(self, k: int, steps: float) -> Proc:
        """Async and ssp: the failed trainer's step in flight is lost; a new one takes its place."""
        if k in self.down:
            return  # it failed again while being replaced: nothing more to lose
        self.replacements += 1
        self.down.add(k)
        self._stop(k)
        self.steps_lost += 1
        generation = self.generation
        yield self.env.timeout(self.fail.replace_s)
        if generation == self.generation:  # a restart meanwhile starts every trainer itself
            self.down.discard(k)
            self.start(k, steps)

    def _restart(self, steps: float) -> Proc:
        """The job restarts from its last checkpoint: every trainer's steps since are lost."""
        self.restarts += 1
        self.generation += 1
        generation = self.generation
        for k in range(self.cl.trainers):
            self._stop(k)
        every = self.fail.checkpoint_every
        if self.cl.mode in BARRIER_MODES:
            kept = [(min(self.done) // every) * every] * self.cl.trainers  # a checkpoint holds a settled round
        else:
            kept = [(d // every) * every for d in self.done]
        self.steps_lost += sum(d - c for d, c in zip(self.done, kept, strict=True))
        self.done = kept
        self.resumed_at = min(kept)
        self.rounds, self.round_events, self.level_events = {}, {}, {}
        self.down = set(range(self.cl.trainers))
        yield self.env.timeout(self.fail.restart_s)
        if generation == self.generation:  # else a later failure restarts it again
            self.down = set()
            for k in range(self.cl.trainers):
                self.start(k, steps)


def simulate(
    cl: Cluster,
    plan: StepPlan,
    steps: int = 20,
    stragglers: Stragglers | None = None,
    failures: Failures | None = None,
    staleness: int = 0,
    horizon_s: float | None = None,
    seed: int = 0,
) -> SimResult:
    """Simulate ``cl`` running ``plan`` for ``steps`` steps per trainer.

    Without failures, samples/s is the sum of every trainer's own steady rate, each measured
    between its steps' completions before the first trainer is done (``_steady_steps_per_s``).
    With failures, it is the committed samples over ``horizon_s`` simulated seconds (the job
    runs until then; ``steps`` is not a bound). With ``failures.kills`` and no MTBF, the job runs
    its ``steps`` through the kills, and samples/s is every committed sample over the whole
    simulated time (``sim_seconds``: compare it with a run without the kills for the time lost)."""
    if cl.mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {cl.mode!r}")
    if steps < 2:
        raise ValueError(f"steps: {steps} must be >= 2 (the first step is the warm-up)")
    fail = failures or Failures()
    if fail.mtbf_s > 0 and not (horizon_s and horizon_s > 0):
        raise ValueError("failures: a simulation with failures needs horizon_s > 0 (the simulated time to run)")
    nodes = cl.trainers + cl.servers
    bad = [k for k in fail.kills if k.node >= nodes or k.after_step >= steps]
    if bad:
        raise ValueError(
            f"failures.kills: {bad[0]} is outside the job: nodes 0..{nodes - 1} (trainers first), "
            f"after_step below its {steps} steps"
        )
    job = _Job(cl, plan, stragglers or Stragglers(), fail, staleness, seed)
    bound = steps if not fail.mtbf_s else math.inf
    for k in range(cl.trainers):
        job.start(k, bound)  # inf with failures: until the horizon
    for kill in fail.kills:
        job.env.process(job.kill_process(kill, bound))
    if fail.kills and not fail.mtbf_s:
        job.env.run()
        rate = sum(job.done) * plan.batch / job.env.now
    elif fail.mtbf_s:
        job.env.process(job.failures_process(bound))
        job.env.run(until=horizon_s)
        rate = sum(job.done) * plan.batch / job.env.now
    else:
        job.env.run()
        rate = plan.batch * _steady_steps_per_s(job.finished)
    now = job.env.now
    return SimResult(
        rate,
        now,
        sum(job.done),
        job.failures,
        job.restarts,
        job.replacements,
        job.steps_lost,
        [s.busy_s / now for s in job.servers] if now > 0 else [],
    )


def _steady_steps_per_s(finished: list[list[float]]) -> float:
    """Steps per second over all trainers, from when each trainer finished each step: each
    trainer's rate from its first completion to its last one before the first trainer was
    done (neither the start, when the queues fill, nor trainers running dry count); a trainer
    with fewer than two completions by then counts them over the time elapsed."""
    stop = min(times[-1] for times in finished)
    total = 0.0
    for times in finished:
        seen = [t for t in times if t <= stop]
        if len(seen) >= 2 and seen[-1] > seen[0]:
            total += (len(seen) - 1) / (seen[-1] - seen[0])
        else:
            total += len(seen) / stop
    return total
