"""ctr_bench's TorchRec row: ``torchrec.models.dlrm.DLRM`` trained in one process on CPU.

The model has the shapes of a ``ctr_bench`` configuration: ``DLRM(EmbeddingBagCollection(T
tables of rows_t x d), dense_in_features=num_dense, dense_arch_layer_sizes=[*bottom_mlp, d],
over_arch_layer_sizes=[*top_mlp, 1])``. The collection is declared on the ``meta`` device
(nothing allocated) and ``fuse_embedding_optimizer`` then builds it on the CPU as a
``FusedEmbeddingBagCollection``: FBGEMM's CPU table-batched embeddings with the table
optimizer fused into the backward, TorchRec's way of training tables in one process (an
unfused collection would take dense gradients of whole tables: 2.56 GB a step for the large
configuration). ``model.table_optim`` picks the fused optimizer (``FUSED``); ``optim`` trains
the MLPs with torch's optimizer, as ps_train does.

Batches: trainer0's of a one-trainer run (``CtrBatchIterator``), each turned into a
``KeyedJaggedTensor`` inside the timed loop (TorchRec's input format; ps_train's data
sources yield ``Bags``). One intra-op thread, as every ps_train process. The tables start
from TorchRec's own initialisation, not ps_train's rows: the row measures speed only.
"""

from __future__ import annotations

import json
import resource
import time
from typing import Any

import torch
import torch.nn.functional as F

# model.table_optim -> (TorchRec's optimizer type to fuse, its kwargs beyond lr): what FBGEMM
# runs in the backward (EXACT_SGD, EXACT_ADAGRAD, EXACT_ROWWISE_ADAGRAD). torch's Adagrad's eps
# (1e-10) for adagrad; FBGEMM's default (1e-8) for row-wise Adagrad, as ps_train's.
FUSED = {"sgd": ("SGD", {}), "adagrad": ("Adagrad", {"eps": 1e-10}), "rowwise_adagrad": ("RowWiseAdagrad", {})}


def torchrec_missing() -> str | None:
    """Why the TorchRec row cannot run here, or None."""
    try:
        import torchrec  # noqa: F401
        from torchrec.modules.fused_embedding_modules import fuse_embedding_optimizer  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means the row is skipped, with its reason
        first = str(e).splitlines()[0] if str(e) else ""
        return (
            f"torchrec not importable ({type(e).__name__}: {first}); the `torchrec` extra, README 'Optional: TorchRec'"
        )
    return None


def _optimizer(name: str) -> tuple[Any, dict[str, Any]]:
    import torchrec.optim

    if name not in FUSED:
        raise ValueError(f"model.table_optim={name}: no fused TorchRec counterpart here; use one of {list(FUSED)}")
    kind, extra = FUSED[name]
    cls = getattr(torchrec.optim, kind) if kind == "RowWiseAdagrad" else getattr(torch.optim, kind)
    return cls, extra


def build(cfg: Any) -> Any:
    """TorchRec's DLRM for ``cfg`` (a ``model=dlrm`` Config), its tables fused with their optimizer."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.fused_embedding_modules import fuse_embedding_optimizer

    data, m = cfg.data, cfg.model
    sizes = data.sizes()
    names = m.feature_list(len(sizes))
    tables = [
        EmbeddingBagConfig(name=f"t{t}", embedding_dim=m.embedding_dim, num_embeddings=n, feature_names=[names[t]])
        for t, n in enumerate(sizes)
    ]
    model = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
        dense_in_features=data.dense_count(),
        dense_arch_layer_sizes=[*m.bottom_mlp, m.embedding_dim],
        over_arch_layer_sizes=[*m.top_mlp, 1],
        dense_device=torch.device("cpu"),
    )
    cls, extra = _optimizer(m.table_optim)
    lr = m.table_lr if m.table_lr is not None else cfg.optim.lr
    return fuse_embedding_optimizer(model, cls, {"lr": lr, **extra}, device=torch.device("cpu")), names


def worker(cfg: Any, steps: int, out_path: str) -> None:
    """Child process: train TorchRec's DLRM for ``steps`` steps; write the figures to ``out_path``."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from ps_train.config import optimizer_spec
    from ps_train.workloads.ctr.data.bags import as_bags
    from ps_train.workloads.ctr.data.batches import CtrBatchIterator
    from ps_train.workloads.ctr.data.loading import load_ctr_data

    torch.set_num_threads(1)  # as in every ps_train process
    model, names = build(cfg)
    cls, kwargs = optimizer_spec(cfg.optim)
    dense_opt = cls([*model.dense_arch.parameters(), *model.over_arch.parameters()], **kwargs)
    train = load_ctr_data(cfg.data).train
    batches = CtrBatchIterator(train, 0, 1, cfg.train.batch_size, cfg.seed)
    if cfg.data.has_id_weights():
        raise ValueError("the TorchRec row takes unweighted bags (ctr_bench's configurations have no id weights)")
    losses: list[float] = []
    samples = 0
    t0 = time.perf_counter()
    for _ in range(steps):
        dense, ids, labels = next(batches)  # [B, num_dense], [B, T] or Bags, [B]
        bags = as_bags(ids)
        kjt = KeyedJaggedTensor(keys=names, values=bags.values, lengths=bags.lengths())
        dense_opt.zero_grad(set_to_none=True)
        logit = model(dense, kjt).squeeze(1)  # [B]
        loss = F.binary_cross_entropy_with_logits(logit, labels)
        loss.backward()  # the fused tables update here
        dense_opt.step()
        ((logit.detach() > 0) == (labels > 0.5)).float().mean().item()  # as ps_train's trainer does
        losses.append(loss.item())
        samples += len(labels)
    wall = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    fused = FUSED[cfg.model.table_optim][0]
    with open(out_path, "w") as f:
        json.dump(
            {
                "samples_per_s": samples / wall,
                "wall_time_s": wall,
                "losses": losses,
                "peak_rss_bytes": rss,
                "table_optim": fused,
            },
            f,
        )
