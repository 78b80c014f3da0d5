"""One trainer step as the simulator plays it: the calls it makes, in phases, each with its
wire bytes both ways and the server CPU it costs, priced by the cost model's constants.

The split follows ``shapes`` and ``cost``: per step a DLRM first looks its rows up on every
server at once; then the forward through the shards in order and the backward in reverse
(the first shard's backward answers no input gradient); then the update to every server at
once (a DLRM's row gradients with it). A call's server CPU is ``a + b x its wire bytes`` plus
its arithmetic (a shard's forward one third of its flops, the backward two thirds; the row
updates on the gradient call), so a step's calls add up to the model's ``u_s`` on each server,
and the trainer's ``c0`` (at the step's start) and ``c1`` (per call sent) to its ``c``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ps_train.plan.cost import Constants
from ps_train.plan.shapes import FLOAT, Workload, shards

__all__ = ["Call", "StepPlan", "step_plan"]


@dataclass(frozen=True)
class Call:
    server: int
    kind: str  # lookup | forward | backward | update | row gradients
    out_bytes: float  # trainer -> server, on the wire
    back_bytes: float  # server -> trainer
    service_s: float  # the server's CPU seconds (one core)


@dataclass(frozen=True)
class StepPlan:
    batch: int  # samples per step
    trainer_cpu_s: float  # c0: before the step's first call
    per_call_cpu_s: float  # c1: for each call the trainer sends
    phases: tuple[tuple[Call, ...], ...]  # a phase's calls go out together; the next waits for all answers

    def calls(self) -> int:
        return sum(len(p) for p in self.phases)


def step_plan(c: Constants, w: Workload, servers: int) -> StepPlan:
    """The calls of one trainer step of ``w`` on ``servers`` servers, priced by ``c``."""
    frame = c.gamma / 2  # a request's framing, half each way

    def call(server: int, kind: str, out_payload: float, back_payload: float, flops: float) -> Call:
        out, back = c.beta * out_payload + frame, c.beta * back_payload + frame
        service = c.server_cpu_per_message + c.server_cpu_per_byte * (out + back) + flops / c.flop_rate
        return Call(server, kind, out, back, service)

    b = w.batch * FLOAT  # bytes per float of a batch
    held = shards(w, servers)
    phases: list[tuple[Call, ...]] = []
    share = w.table_bytes / servers / 2  # one way: the rows pulled, or their gradients
    if w.table_bytes:
        phases.append(tuple(call(r, "lookup", 0.0, share, 0.0) for r in range(servers)))
    for sh in held:
        phases.append((call(sh.server, "forward", b * sh.forward_in, b * sh.forward_out, w.batch * sh.flops),))
    for sh in reversed(held):
        grads = (b * sh.backward_in, b * sh.backward_out)
        phases.append((call(sh.server, "backward", *grads, 2.0 * w.batch * sh.flops),))
    last = [call(r, "update", 0.0, 0.0, 0.0) for r in range(servers)]
    if w.table_bytes:
        last += [call(r, "row gradients", share, 0.0, w.table_flops / servers) for r in range(servers)]
    phases.append(tuple(last))
    return StepPlan(w.batch, c.trainer_cpu_base, c.trainer_cpu_per_message, tuple(phases))
