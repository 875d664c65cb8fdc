"""Training with the transformers `Trainer` from a YAML recipe, one concern per module: `recipe` (sections,
overrides, checks), `build` (the model, conversion, uptraining arithmetic, parameter counts), `callbacks`,
`trainer` (`ZooTrainer` and resuming) and `run` (`run_training`, the summary, the final save, `main`)."""

from .callbacks import CheckpointCallback, ThroughputCallback
from .recipe import ConversionArguments, ModelArguments, ZooTrainingArguments, load_recipe
from .run import main, run_training

__all__ = [
    "CheckpointCallback",
    "ConversionArguments",
    "ModelArguments",
    "ThroughputCallback",
    "ZooTrainingArguments",
    "load_recipe",
    "main",
    "run_training",
]
