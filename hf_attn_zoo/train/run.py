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
from transformers import Trainer, TrainerCallback, TrainingArguments, set_seed

from ..checkpoints import publish_folder, write_atomically
from ..data import DataArguments, prepare_data
from ..errors import UserError
from ..loading import resolve_source
from ..models import ZooConfig, get_variant
from .build import build_model, parameter_count, parent_train_tokens, training_flops_per_token, uptraining_steps
from .callbacks import (
    MemoryCallback,
    run_callbacks,
    throughput_first,
)
from .recipe import SECTIONS, ModelArguments, load_recipe, refuse_gpu_recipe_without_gpu
from .trainer import ZooTrainer, checkpoint_step, resolve_resume


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


def report_finished(finished: dict, training_args: TrainingArguments) -> dict:
    """Say that a resumed run had already finished (nothing trained or written) and return its saved summary."""
    if training_args.process_index == 0:
        print(
            f"{training_args.output_dir}: training already finished at step {finished['steps']} (training.max_steps="
            f"{training_args.max_steps}), validation perplexity {finished['validation_perplexity']}; nothing "
            f"trained or written (raise training.max_steps to train on)."
        )
    return finished


def prepare_on_every_process(prepare, data_args: DataArguments, training_args: TrainingArguments) -> tuple:
    """`prepare(data_args)` (a tuple whose first item is the tokenizer) with one tokenizer for all processes: the
    main process trains (or loads) it and saves it in `output_dir/tokenizer`, the others then read that copy."""
    shared_tokenizer = Path(training_args.output_dir) / "tokenizer"
    with training_args.main_process_first(desc="data preparation", local=False):
        if training_args.process_index != 0 and data_args.tokenizer is None:
            data_args.tokenizer = str(shared_tokenizer)
        prepared = prepare(data_args)
        if training_args.process_index == 0:
            prepared[0].save_pretrained(shared_tokenizer)
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
    training_args: TrainingArguments,
    callbacks: list[TrainerCallback] = (),
) -> dict:
    """Prepare data, build the model, train, evaluate and save. Returns the training summary (also written to
    `output_dir/training_summary.json`)."""
    refuse_gpu_recipe_without_gpu(
        getattr(training_args, "requires_gpu", False), getattr(training_args, "cpu_recipe", None), "the recipe"
    )
    resume = resolve_resume(training_args)
    output_dir = Path(training_args.output_dir)
    tokens_per_step = (
        training_args.per_device_train_batch_size
        * training_args.gradient_accumulation_steps
        * training_args.world_size
        * data_args.block_size
    )
    if model_args.seq2seq:
        from .seq2seq import run_seq2seq

        return run_seq2seq(model_args, data_args, training_args, resume, callbacks)
    conversion = model_args.conversion
    conversion.check_parent(model_args.init_from)  # arguments built in Python skip load_recipe's check
    if conversion.uptrain_fraction is not None:  # before any data work: the parent must say how long it trained
        parent_tokens = parent_train_tokens(model_args.init_from)
        training_args.max_steps = uptraining_steps(conversion.uptrain_fraction, parent_tokens, tokens_per_step)
    finished = finished_summary(resume, training_args)
    if finished is not None:  # nothing to train: report the run as it ended, writing nothing
        return report_finished(finished, training_args)
    set_seed(training_args.seed)  # the model's initialisation must not depend on what ran before in the process
    if model_args.init_from is not None and data_args.tokenizer is None:
        data_args.tokenizer = resolve_source(model_args.init_from)
    tokenizer, train_blocks, validation_blocks, unigram = prepare_on_every_process(
        prepare_data, data_args, training_args
    )
    check_validation_fills_a_batch(len(validation_blocks), data_args, training_args)
    model = build_model(model_args, tokenizer, data_args.block_size, train_blocks)
    config: ZooConfig = model.config
    flops_per_token = training_flops_per_token(model, data_args.block_size)
    details = {
        "data": ", ".join(data_args.train_files) or "Python standard-library sources",
        "block size": data_args.block_size,
        "packing": data_args.packing,
        "unigram baseline perplexity": round(unigram, 2),
    }
    memory = MemoryCallback()
    trainer = ZooTrainer(
        model=model,
        args=training_args,
        train_dataset=train_blocks,
        eval_dataset=validation_blocks,
        processing_class=tokenizer,
        callbacks=run_callbacks(tokens_per_step, flops_per_token, details, memory, callbacks),
    )
    throughput_first(trainer)
    first_step = int(Path(resume).name.split("-")[-1]) if resume else 0
    seconds, memory_per_process = train_measured(trainer, memory, resume)
    evaluation = trainer.evaluate()
    perplexity = math.exp(min(evaluation["eval_loss"], 700.0))
    summary = {
        "variant": get_variant(config.model_type).name,
        "parameters": sum(parameter_count(p) for p in model.parameters()),
        "world_size": training_args.world_size,
        "distributed": trainer.accelerator.distributed_type.value,
        "steps": trainer.state.global_step,
        "packing": data_args.packing,
        "train_tokens": trainer.state.global_step * tokens_per_step,
        "seconds": round(seconds, 1),
        "tokens_per_second": round((trainer.state.global_step - first_step) * tokens_per_step / max(seconds, 1e-9), 1),
        "flops_per_token": flops_per_token,
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "evaluations": [
            {"step": entry["step"], "eval_loss": entry["eval_loss"]}
            for entry in trainer.state.log_history
            if "eval_loss" in entry
        ],
        "validation_perplexity": round(perplexity, 3),
        "unigram_perplexity": round(unigram, 3),
        "memory_per_process": sorted(memory_per_process, key=lambda entry: entry["rank"]),
    }
    details["validation perplexity"] = summary["validation_perplexity"]
    summary["final_model"] = str(output_dir / "final")
    save_final(trainer, summary, {**details, "steps": summary["steps"]})
    if training_args.process_index == 0:
        write_atomically(output_dir / "training_summary.json", json.dumps(summary, indent=2))
    return summary


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
