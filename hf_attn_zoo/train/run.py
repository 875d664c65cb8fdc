"""Training any zoo variant with the transformers `Trainer`, from a YAML recipe, on one process or many.

A recipe has sections, each parsed by `HfArgumentParser` into a dataclass: `model` (`ModelArguments`), `convert`
(`ConversionArguments`, optional: pooling `model.init_from`'s key/value heads and uptraining it), `data`
(`hf_attn_zoo.data.DataArguments`) and `training` (`transformers.TrainingArguments`). Command-line overrides
name the section: `--training.learning_rate 1e-3`, `--model.size small`. A key that does not exist is an error
naming it, as are missing files, an empty corpus or a block size beyond the model's positions, all before training.

Launching: one process (`hf-attn-zoo train CONFIG`, `python training/train.py CONFIG`), or several with
`torchrun --nproc_per_node N training/train.py CONFIG` / `accelerate launch --config_file
configs/accelerate/multi_gpu.yaml training/train.py CONFIG` (DDP; gloo on a machine without GPUs). Sharded:
`configs/accelerate/fsdp.yaml` (FSDP2 on GPUs), `fsdp_cpu.yaml` (FSDP2 over gloo CPU processes, switched on by
`ZooTrainer`, which accelerate does not do there), `zero2.yaml` / `zero3.yaml` (DeepSpeed, the `deepspeed` extra).

Checkpoints are crash-safe: `checkpoint-N` counts as complete only once its marker file is written, after every file
of it; resuming (`--training.resume_from_checkpoint latest`) takes the newest complete one and moves an incomplete one
aside. Every checkpoint carries the tokenizer, the `auto_map` for `trust_remote_code` and a model card. The final
model goes to `output_dir/final`, written beside and renamed into place.
"""

import json
import math
import os
import sys
import time
from dataclasses import fields
from pathlib import Path

from accelerate.utils import gather_object
from transformers import EarlyStoppingCallback, Trainer, TrainerCallback, TrainingArguments, set_seed

from ..checkpoints import publish_folder, write_atomically
from ..data import DataArguments
from ..errors import UserError
from .build import parameter_count, transfer_from_parent
from .callbacks import MemoryCallback, ThroughputCallback, run_callbacks, throughput_first
from .lora import add_mlp_lora, merge_lora
from .recipe import SECTIONS, ModelArguments, ZooTrainingArguments, load_recipe
from .tasks import Prepared, task_for
from .trainer import average_last_checkpoints, checkpoint_step, resolve_resume


def finished_summary(resume: str | None, training_args: TrainingArguments) -> dict | None:
    """The saved summary of a run that `resume` shows already finished (its checkpoint at or past max_steps, the
    summary and final model written from that step), or None: there is training (or the final save) left."""
    if resume is None or training_args.max_steps <= 0:
        return None
    step = checkpoint_step(resume)
    summary_path = Path(training_args.output_dir) / "training_summary.json"
    if step < training_args.max_steps or not summary_path.is_file():
        return None
    summary = json.loads(summary_path.read_text())
    if summary.get("steps") != step or not Path(summary.get("final_model", "")).is_dir():
        return None
    return summary


def save_final(trainer: Trainer, summary: dict, details: dict) -> Path:
    """The trained model, tokenizer, card and training summary in `output_dir/final`, written beside and renamed
    into place (a previous `final` is kept under another name). `trainer.save_model` (not the model's own
    `save_pretrained`), since sharded and distributed runs gather the weights there."""
    final = Path(trainer.args.output_dir) / "final"
    trainer.model.card_details = details  # read by save_pretrained: the card names the run

    def write(staging: Path) -> None:
        trainer.save_model(str(staging))  # model, config with auto_map, card, tokenizer (the processing class)
        if trainer.args.should_save:
            (staging / "training_summary.json").write_text(json.dumps(summary, indent=2))

    if trainer.args.should_save:
        publish_folder(final, write)
    else:
        trainer.save_model(str(final.with_name("final.partial")))  # collective on some setups: every rank calls it
    trainer.accelerator.wait_for_everyone()
    return final


def check_validation_fills_a_batch(blocks: int, data_args: DataArguments, training_args: TrainingArguments) -> None:
    """With `dataloader_drop_last` the evaluation drops a partial batch; fewer validation blocks than one batch would
    leave it empty, and the run would end without a validation loss. Refused before training."""
    per_device, processes = training_args.per_device_eval_batch_size, training_args.world_size
    if training_args.dataloader_drop_last and blocks < per_device * processes:
        raise UserError(
            f"the validation text gives {blocks} block(s) of data.block_size={data_args.block_size} tokens, fewer "
            f"than one evaluation batch (training.per_device_eval_batch_size={per_device} x {processes} process(es)) "
            f"with training.dataloader_drop_last: add validation text (data.validation_files, "
            f"data.validation_fraction) or lower training.per_device_eval_batch_size."
        )


def check_checkpoints_to_average(training_args: ZooTrainingArguments) -> None:
    """`training.average_checkpoints` needs as many checkpoints as the run will write (one every `save_steps` and one
    at the last step): refused before training, not after it, once the number of steps is known."""
    count, steps = training_args.average_checkpoints, training_args.max_steps
    if count < 2 or steps <= 0:  # nothing averaged, or a run by epochs (its steps known only from the data)
        return
    if training_args.save_strategy == "no":
        written, how = 0, "training.save_strategy=no"
    elif training_args.save_strategy != "steps":  # by epoch, or the best: how many is known only as the run goes
        return
    else:
        every = training_args.save_steps
        every = math.ceil(every * steps) if every < 1 else int(every)  # a float below 1 is a fraction of the run
        written, how = math.ceil(steps / every), f"one every training.save_steps={every} of {steps} steps"
    if written < count:
        raise UserError(
            f"training.average_checkpoints={count}, but the run writes {written} checkpoint(s) ({how}): save more "
            f"often (training.save_steps), average fewer, or set training.average_checkpoints 1."
        )


def report_finished(finished: dict, training_args: TrainingArguments) -> dict:
    """Say that a resumed run had already finished (nothing trained or written) and return its saved summary."""
    if training_args.process_index == 0:
        print(
            f"{training_args.output_dir}: training already finished at step {finished['steps']} (training.max_steps="
            f"{training_args.max_steps}), validation perplexity {finished['validation_perplexity']}; nothing "
            f"trained or written (raise training.max_steps to train on)."
        )
    return finished


def prepare_on_every_process(prepare, data_args: DataArguments, training_args: TrainingArguments) -> Prepared:
    """`prepare(data_args)` (a task's data, `tasks.Prepared`) with one tokenizer for all processes: the main process
    trains (or loads) it and saves it in `output_dir/tokenizer`, the others then read that copy."""
    shared_tokenizer = Path(training_args.output_dir) / "tokenizer"
    with training_args.main_process_first(desc="data preparation", local=False):
        if training_args.process_index != 0 and data_args.tokenizer is None:
            data_args.tokenizer = str(shared_tokenizer)
        prepared = prepare(data_args)
        if training_args.process_index == 0:
            prepared.tokenizer.save_pretrained(shared_tokenizer)
    return prepared


def train_measured(trainer: Trainer, memory: MemoryCallback, resume: str | None) -> tuple[float, list[dict]]:
    """Train (resuming from `resume`; `training.max_steps` 0 trains nothing) and return the seconds it took and
    every process's peak memory (`MemoryCallback.report`), gathered on every process."""
    start = time.perf_counter()
    memory.start()
    if trainer.args.max_steps != 0:  # uptraining with a fraction of 0: the converted model as it is
        trainer.train(resume_from_checkpoint=resume)
    seconds = time.perf_counter() - start
    return seconds, gather_object([{"rank": trainer.args.process_index, **memory.report(trainer)}])


def run_training(
    model_args: ModelArguments,
    data_args: DataArguments,
    training_args: ZooTrainingArguments,
    callbacks: list[TrainerCallback] = (),
) -> dict:
    """Prepare data, build the model, train, evaluate and save, for every task (`tasks.task_for`: a language model on
    text or a translator on pairs). Returns the training summary (also written to
    `output_dir/training_summary.json`)."""
    if not isinstance(training_args, ZooTrainingArguments):
        raise TypeError(
            f"run_training takes ZooTrainingArguments (hf_attn_zoo.train), not {type(training_args).__name__}: its "
            f"fields (batch_tokens, average_checkpoints, ...) are read by every run."
        )
    task = task_for(model_args)
    resume = resolve_resume(training_args)
    output_dir = Path(training_args.output_dir)
    task.plan_steps(model_args, data_args, training_args)
    check_checkpoints_to_average(training_args)
    finished = finished_summary(resume, training_args)
    if finished is not None:  # nothing to train: report the run as it ended, writing nothing
        return report_finished(finished, training_args)
    set_seed(training_args.seed)  # the model's initialisation must not depend on what ran before in the process
    if model_args.init_from is not None and data_args.tokenizer is None:
        data_args.tokenizer = model_args.source
    prepared = prepare_on_every_process(task.prepare, data_args, training_args)
    check_validation_fills_a_batch(len(prepared.validation), data_args, training_args)
    model = task.build(model_args, data_args, prepared)
    transfer = {}
    if model_args.conversion.transfer_tokens is not None and resume is None:  # a resumed run's weights are trained
        transfer = {
            "attention_transfer": transfer_from_parent(model_args, model, prepared.train, data_args.block_size)
        }
    lora = {}
    if model_args.conversion.lora_rank is not None:
        trainable = add_mlp_lora(model, model_args.conversion.lora_rank)
        lora = {"lora_rank": model_args.conversion.lora_rank, "trainable_parameters": trainable}
    task.configure(model, prepared, data_args, training_args)
    check_checkpoints_to_average(training_args)  # again: a translator's uptraining steps are known only now
    tokens_per_step = task.tokens_per_step(prepared, data_args, training_args)
    flops_per_token = task.flops_per_token(model, data_args)
    details = task.details(data_args, prepared)
    memory = MemoryCallback()
    if training_args.early_stopping_patience is not None:
        callbacks = [*callbacks, EarlyStoppingCallback(training_args.early_stopping_patience)]
    trainer = task.trainer_class(
        model=model,
        args=training_args,
        train_dataset=prepared.train,
        eval_dataset=prepared.validation,
        processing_class=prepared.tokenizer,
        data_collator=task.collator(model, prepared),
        compute_metrics=task.metrics(prepared),
        callbacks=run_callbacks(tokens_per_step, flops_per_token, details, memory, callbacks),
        **task.trainer_arguments(model_args),
    )
    throughput_first(trainer)
    first_step = checkpoint_step(resume) if resume else 0
    seconds, memory_per_process = train_measured(trainer, memory, resume)
    carried = next(c.carried_seconds for c in trainer.callback_handler.callbacks if isinstance(c, ThroughputCallback))
    averaged = []
    if training_args.average_checkpoints > 1:
        averaged = [path.name for path in average_last_checkpoints(trainer, training_args.average_checkpoints)]
    if model_args.conversion.lora_rank is not None:
        merge_lora(model)  # the final model is a plain checkpoint
    scores = task.scores(trainer, final_evaluation(trainer, changed=bool(averaged)), prepared, model_args, data_args)
    steps = trainer.state.global_step
    summary = {
        "variant": scores.pop("variant"),
        "parameters": sum(parameter_count(p) for p in model.parameters()),
        "world_size": training_args.world_size,
        "distributed": trainer.accelerator.distributed_type.value,
        "steps": steps,
        "train_tokens": steps * tokens_per_step,
        "seconds": round(carried + seconds, 1),  # the launches before the resumed checkpoint's save too
        # this launch's steps over this launch's seconds, every process's tokens
        "tokens_per_second": round((steps - first_step) * tokens_per_step / max(seconds, 1e-9), 1),
        **({"resumed_from_step": first_step, "seconds_before_resume": carried} if resume else {}),
        "flops_per_token": flops_per_token,
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "evaluations": [
            {key: value for key, value in entry.items() if key == "step" or key in EVALUATION_KEYS}
            for entry in trainer.state.log_history
            if "eval_loss" in entry
        ],
        **scores,
        **({"averaged_checkpoints": averaged} if averaged else {}),
        **transfer,
        **lora,
        "memory_per_process": sorted(memory_per_process, key=lambda entry: entry["rank"]),
        "final_model": str(output_dir / "final"),
        **task.outputs(output_dir, prepared, write=training_args.process_index == 0),
    }
    card = {**details, **{CARD_NAMES[key]: summary[key] for key in CARD_NAMES if key in summary}, "steps": steps}
    save_final(trainer, summary, card)
    if training_args.process_index == 0:
        write_atomically(output_dir / "training_summary.json", json.dumps(summary, indent=2))
    return summary


def final_evaluation(trainer: Trainer, changed: bool) -> dict:
    """The evaluation of the final model: the Trainer's own of the last step where it ran one there (`eval_steps`
    dividing `max_steps`) and the weights are still that step's, else a new one -- not the same evaluation twice
    (a translator's is a pass of `generate()` over every validation pair)."""
    last = next((entry for entry in reversed(trainer.state.log_history) if "eval_loss" in entry), None)
    if last is None or changed or trainer.args.load_best_model_at_end or last["step"] != trainer.state.global_step:
        return trainer.evaluate()
    return last


# What an evaluation entry of the summary keeps besides its step (its scores, and the seconds since training began:
# the curve of a score against time), and the summary's scores the model card names
EVALUATION_KEYS = ("eval_loss", "eval_bleu", "eval_chrf", "elapsed_seconds")
CARD_NAMES = {
    "validation_bleu": "validation BLEU",
    "validation_chrf": "validation chrF",
    "validation_perplexity": "validation perplexity",
}


def main(argv: list[str] | None = None) -> dict:
    """`train CONFIG [--section.field value ...]`: the entry of `hf-attn-zoo train` and `training/train.py`."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        for section, dataclass_type in SECTIONS.items():
            print(f"\n[{section}] fields: " + ", ".join(f.name for f in fields(dataclass_type) if f.init))
        return {}
    recipe, overrides = (None, argv) if argv[0].startswith("--") else (argv[0], argv[1:])
    summary = run_training(*load_recipe(recipe, overrides))
    if summary and int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({k: v for k, v in summary.items() if k != "losses"}, indent=2))
    return summary
