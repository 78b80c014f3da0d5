"""Shared test settings for ps_train.

The test machine has 2 cores shared by several jobs: torch's default thread pool
oversubscribes them and makes tiny models ~10x slower, so tests use one intra-op thread.
"""

import torch

torch.set_num_threads(1)
