"""One trainer step as the simulator plays it: the calls it makes, in phases, each with its
wire bytes both ways and the server CPU it costs, priced by the cost model's constants.

The split follows ``shapes`` and ``cost``: per step a DLRM first looks its rows up on every
server at once; then the forward through the shards in order and the backward in reverse
(the first shard's backward answers no input gradient); then the update to every server at
once (a DLRM's row gradients with it). A call's server CPU is ``a + b x its wire bytes`` plus
its arithmetic (a shard's forward one third of its flops, the backward two thirds; the row
updates on the gradient call), so a step's calls add up to the model's ``u_s`` on each server,
and the trainer's ``c0`` (once a step, between the forward and the backward, where a trainer
computes its loss: so that sync's barrier, which holds the next forward, cannot hide it) and
``c1`` (per call sent) to its ``c``.

Servers that hold no stage (a DLRM's beyond its two, an MLP's beyond its layers) get the same
calls from every trainer at the same moments: one of them stands for all (``Call.copies``),
so that a step costs the simulation a few calls however many servers there are. The trainer
still pays its CPU and its link for every copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ps_train.scaling.cost_model import Constants
from ps_train.scaling.shapes import FLOAT, Workload, shards

__all__ = ["Call", "StepPlan", "step_plan"]


@dataclass(frozen=True)
class Call:
    server: int
    kind: str  # lookup | forward | backward | update | row gradients
    out_bytes: float  # trainer -> server, on the wire
    back_bytes: float  # server -> trainer
    service_s: float  # the server's CPU seconds (one core)
    copies: int = 1  # identical calls to as many servers without stages, this one standing for all
    # The trainer's CPU for this call: half to send it (before), half to take its answer
    # (after); None: the plan's ``per_call_cpu_s``.
    trainer_cpu_s: float | None = None


@dataclass(frozen=True)
class StepPlan:
    batch: int  # samples per step
    trainer_cpu_s: float  # c0: once a step, before phase ``cpu_at``
    per_call_cpu_s: float  # c1: for each call the trainer sends (a call's own ``trainer_cpu_s`` first)
    phases: tuple[tuple[Call, ...], ...]  # a phase's calls go out together; the next waits for all answers
    cpu_at: int = 0  # the phase c0 comes before: a model's after its forward (the loss, the backward's start)

    def call_cpu_s(self, call: Call) -> float:
        """The trainer's CPU seconds for one copy of ``call``, sending and taking its answer."""
        return self.per_call_cpu_s if call.trainer_cpu_s is None else call.trainer_cpu_s

    def calls(self) -> int:
        """Calls the simulation plays per step (copies count once)."""
        return sum(len(p) for p in self.phases)


def step_plan(c: Constants, w: Workload, servers: int, link_bps: float = math.inf) -> StepPlan:
    """The calls of one trainer step of ``w`` on ``servers`` servers, priced by ``c``, on links
    of ``link_bps`` (a slow one costs both ends CPU per byte: ``Constants.paced``)."""
    frame = c.gamma / 2  # a request's framing, half each way
    paced = c.paced(link_bps)
    per_byte = c.server_cpu_per_byte + (c.server_cpu_per_paced_byte if paced else 0.0)
    trainer_per_byte = c.trainer_cpu_per_paced_byte if paced else 0.0

    def call(server: int, kind: str, out_payload: float, back_payload: float, flops: float) -> Call:
        out, back = c.beta * out_payload + frame, c.beta * back_payload + frame
        service = c.server_cpu_per_message + per_byte * (out + back) + flops / c.flop_rate
        trainer = c.trainer_cpu_per_message + trainer_per_byte * (out + back)
        return Call(server, kind, out, back, service, trainer_cpu_s=trainer)

    b = w.batch * FLOAT  # bytes per float of a batch
    held = shards(w, servers)
    stageless = [r for r in range(len(held), servers)]  # shards() places on servers 0, 1, ... in order

    def to_all(kind: str, out_payload: float, back_payload: float, flops: float) -> tuple[Call, ...]:
        """A call to every server: one each to those with stages, one standing for the rest."""
        calls = [call(sh.server, kind, out_payload, back_payload, flops) for sh in held]
        if stageless:
            rest = call(stageless[0], kind, out_payload, back_payload, flops)
            calls.append(replace(rest, copies=len(stageless)))
        return tuple(calls)

    phases: list[tuple[Call, ...]] = []
    share = w.table_bytes / servers / 2  # one way: the rows pulled, or their gradients
    if w.table_bytes:
        phases.append(to_all("lookup", 0.0, share, 0.0))
    for sh in held:
        phases.append((call(sh.server, "forward", b * sh.forward_in, b * sh.forward_out, w.batch * sh.flops),))
    cpu_at = len(phases)
    for sh in reversed(held):
        grads = (b * sh.backward_in, b * sh.backward_out)
        phases.append((call(sh.server, "backward", *grads, 2.0 * w.batch * sh.flops),))
    last = to_all("update", 0.0, 0.0, 0.0)
    if w.table_bytes:
        last += to_all("row gradients", share, 0.0, w.table_flops / servers)
    phases.append(last)
    return StepPlan(w.batch, c.trainer_cpu_base, c.trainer_cpu_per_message, tuple(phases), cpu_at)
