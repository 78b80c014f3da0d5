"""The vision workload (``VISION``), registered with ``ps_train.workload`` on import: its
stages, trainer and data check."""

from __future__ import annotations

from typing import Any

from ps_train.config import DataConfig, ModelConfig, VisionDataConfig
from ps_train.workload import StagePlan, Workload, register_workload
from ps_train.workloads.vision.models import build_stages

__all__ = ["VISION"]


def _stages(model: ModelConfig, data: DataConfig, seed: int) -> StagePlan:
    stages = build_stages(model, data.sample_shape(), data.class_count(), seed=seed)
    return StagePlan(stages)


def _trainer() -> type[Any]:
    from ps_train.workloads.vision.trainer import VisionTrainer

    return VisionTrainer


def _check_data(data: DataConfig) -> int | None:
    if isinstance(data, VisionDataConfig):
        from ps_train.workloads.vision.data import check_vision_files

        check_vision_files(data)
    return None


def _prepare(data: DataConfig) -> None:
    from ps_train.workloads.vision.data import prepare_data

    prepare_data(data)  # synthetic and digits: drawn once, not by every trainer


VISION = register_workload(
    Workload(
        name="vision",
        models=("mlp", "cnn", "resnet18"),
        stages=_stages,
        trainer=_trainer,
        check_data=_check_data,
        module=__name__,
        preload=("ps_train.workloads.vision.trainer",),
        # scikit-learn (~1 CPU-second to import) only for its bundled digits
        preload_for=lambda data: ("sklearn.datasets", "sklearn.model_selection") if data.name == "digits" else (),
        prepare=_prepare,
    )
)
