"""Training with the transformers `Trainer` from a YAML recipe, one concern per module: `recipe` (sections,
overrides, checks), `build` (the model, conversion, uptraining arithmetic, parameter counts), `tasks` (what differs
between a language model and a translator run, as one object per kind), `callbacks`, `trainer` (`ZooTrainer` and
resuming) and `run` (the one `run_training`, the summary, the final save, `main`)."""

from .callbacks import CheckpointCallback, ThroughputCallback
from .recipe import ConversionArguments, ModelArguments, ZooTrainingArguments, load_recipe
from .run import main, run_training
from .tasks import TASKS, CausalLMTask, Task, TranslationTask, task_for

__all__ = [
    "TASKS",
    "CausalLMTask",
    "CheckpointCallback",
    "ConversionArguments",
    "ModelArguments",
    "Task",
    "ThroughputCallback",
    "TranslationTask",
    "ZooTrainingArguments",
    "load_recipe",
    "main",
    "run_training",
    "task_for",
]
