"""Training specjax models with optax: targets from scratch, drafts by distillation."""

from specjax.train.loop import TrainConfig, TrainState, train

__all__ = ["TrainConfig", "TrainState", "train"]
