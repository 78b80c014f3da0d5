"""The vision workload's trainer: in-memory image splits, cross-entropy over the logits of
the last shard, accuracy as its metric."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ps_train.faults import die, fault_at
from ps_train.roles.step import StepMetric
from ps_train.roles.trainer import Trainer
from ps_train.workloads.vision.data import BatchIterator, iter_eval_batches, load_data

__all__ = ["VisionTrainer"]


class VisionTrainer(Trainer):
    """A classifier's trainer; the loop and the update protocol are ``Trainer``'s."""

    def load(self) -> None:
        cfg = self.cfg
        self.train_set, self.test_set = load_data(cfg.data)
        self.batches = BatchIterator(
            self.train_set, self.data_slot, cfg.cluster.num_trainers, cfg.train.batch_size, cfg.seed
        )

    def step_loss(self, batch: Any) -> tuple[torch.Tensor, dict[str, StepMetric]]:
        """Cross-entropy of the logits [B, num_classes] the shards compute; the batch accuracy
        (computed after the backward: see ``StepTrainer.step_loss``)."""
        x, y = batch
        logits = self.forward(x, self.step)
        scores = logits.detach()
        return F.cross_entropy(logits, y), {"accuracy": lambda: (scores.argmax(1) == y).float().mean().item()}

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
        return f"test accuracy {ev['accuracy']:.4f}"
