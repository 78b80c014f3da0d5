"""The click-through-rate workload (``CTR``), registered with ``ps_train.workload`` on import:
its dense stages, trainer, data check and table service, each imported when first asked for."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ps_train.config import CtrDataConfig, DataConfig, DLRMConfig, ModelConfig
from ps_train.workload import StagePlan, Workload, register_workload

if TYPE_CHECKING:
    from torch import nn

    from ps_train.table_service import TableSettings

__all__ = ["CTR"]


def _stages(model: ModelConfig, data: DataConfig, seed: int) -> StagePlan:
    """Its dense stages (bottom MLP; top MLP, after the cross layers for
    ``model.interaction=dcn``), one shard each, on at most two servers (its tables live on
    all of them: ``tables.service``)."""
    from ps_train.workloads.ctr.model import cross_spec, dense_stages

    m, d = model, data
    if not (isinstance(m, DLRMConfig) and isinstance(d, CtrDataConfig)):
        raise TypeError(f"model={m.name} needs CTR data (data=synthetic_ctr or data=criteo), not data={d.name}")
    stages: list[nn.Module] = list(
        dense_stages(d.dense_count(), len(d.sizes()), m.embedding_dim, m.bottom_mlp, m.top_mlp, seed, cross_spec(m))
    )
    return StagePlan(stages, merge=False, max_servers=len(stages))


def _trainer() -> type[Any]:
    from ps_train.workloads.ctr.trainer import CtrTrainer

    return CtrTrainer


def _check_data(data: DataConfig) -> int | None:
    if isinstance(data, CtrDataConfig):
        from ps_train.workloads.ctr.data.loading import check_ctr_data

        return check_ctr_data(data)
    return None


def _table_service(model: ModelConfig, data: DataConfig, settings: TableSettings, rank: int, run_dir: str) -> Any:
    from ps_train.workloads.ctr.tables.service import make_table_server

    return make_table_server(model, data, settings, rank, run_dir)


CTR = register_workload(
    Workload(
        name="ctr",
        models=("dlrm",),
        stages=_stages,
        trainer=_trainer,
        check_data=_check_data,
        table_service=_table_service,
        module=__name__,
        preload=("ps_train.workloads.ctr.trainer", "ps_train.workloads.ctr.tables.service"),
        rpc_modules=("ps_train.workloads.ctr.trainer",),  # a trainer's lookups, prefetches, cached rows' gradients
    )
)
