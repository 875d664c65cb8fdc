"""Sequence-to-sequence runs (`model.task: seq2seq`, or a model that is one): a translator trained on pairs with
`Seq2SeqTrainer` and `DataCollatorForSeq2Seq`, evaluated with `generate()` (`predict_with_generate`) for BLEU and
chrF through the shipped `evaluate` module, and the references' perplexity at the end.

Everything else is the language models' path (`run`): resuming, crash-safe checkpoints, throughput and memory
callbacks, one tokenizer for all processes, the final save. The pairs, their split and the shared tokenizer are
`hf_attn_zoo.pairs`'. The final model carries a generation config (decoder start token, `max_length`,
`num_beams`), and the run writes the pairs it validated on (and, with `data.test_groups`, those it held out) as JSON
lines beside it, for `hf-attn-zoo translate-eval`.
"""

import json
import math
from pathlib import Path

import numpy as np
from torch.utils.data import DataLoader
from transformers import DataCollatorForSeq2Seq, TrainerCallback, set_seed

from ..checkpoints import write_atomically
from ..data import DataArguments
from ..errors import UserError
from ..evaluation.translation import labelled_nll, set_generation_config
from ..loading import resolve_source
from ..pairs import build_pair_tokenizer, split_pairs, tokenize_pairs, write_pairs
from .build import build_seq2seq_model, non_embedding_parameters, parameter_count
from .callbacks import (
    MemoryCallback,
    run_callbacks,
    throughput_first,
)
from .recipe import ModelArguments, ZooTrainingArguments
from .run import (
    check_validation_fills_a_batch,
    finished_summary,
    prepare_on_every_process,
    report_finished,
    save_final,
    train_measured,
)
from .trainer import ZooSeq2SeqTrainer


def prepare_pairs(data_args: DataArguments) -> tuple:
    """(tokenizer, training inputs, validation inputs, the split pairs)."""
    splits = split_pairs(data_args)
    tokenizer = build_pair_tokenizer(data_args, splits["train"])
    train = tokenize_pairs(splits["train"], tokenizer, data_args, "the training pairs")
    validation = tokenize_pairs(splits["validation"], tokenizer, data_args, "the validation pairs")
    if len(train) == 0 or len(validation) == 0:
        raise UserError(
            "no pair fits data.max_source_length / data.max_target_length (data.long_pairs drop): raise them."
        )
    return tokenizer, train, validation, splits


def translation_metrics(tokenizer):
    """`compute_metrics` for `predict_with_generate`: corpus BLEU and chrF of the generations against the labels,
    through the shipped `evaluate` module (`hf_attn_zoo.evaluation.TRANSLATION`)."""
    import evaluate

    from ..evaluation import TRANSLATION

    metric = evaluate.load(TRANSLATION)
    pad = tokenizer.pad_token_id

    def compute(prediction) -> dict[str, float]:
        # generations and labels are padded with -100 where batches of different lengths were joined
        generated = np.where(prediction.predictions < 0, pad, prediction.predictions)  # (N, T)
        labels = np.where(prediction.label_ids < 0, pad, prediction.label_ids)  # (N, T')
        translations = [text.strip() for text in tokenizer.batch_decode(generated, skip_special_tokens=True)]
        references = [text.strip() for text in tokenizer.batch_decode(labels, skip_special_tokens=True)]
        scores = metric.compute(predictions=translations, references=references)
        return {"bleu": round(scores["bleu"], 3), "chrf": round(scores["chrf"], 3)}

    return compute


def validation_perplexity(trainer: ZooSeq2SeqTrainer, validation, collator, batch_size: int) -> float:
    """The validation references' perplexity, corpus-level and token-weighted (the Trainer's `eval_loss` is a mean
    of batch means). Every process scores every batch, as sharded models need all processes in each forward."""
    model = trainer.model
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    for batch in DataLoader(validation, batch_size=batch_size, collate_fn=collator):
        nll, count = labelled_nll(model, batch.to(trainer.args.device))
        total, tokens = total + nll, tokens + count
    model.train(was_training)
    return math.exp(min(total / max(tokens, 1), 700.0))


def run_seq2seq(
    model_args: ModelArguments,
    data_args: DataArguments,
    training_args: ZooTrainingArguments,
    resume: str | None,
    callbacks: list[TrainerCallback] = (),
) -> dict:
    """Prepare the pairs, build the translator, train, evaluate and save (`run.run_training` hands over here after
    resolving `resume`). Returns the training summary (also in `output_dir/training_summary.json`)."""
    model_args.conversion.check_parent(model_args.init_from)
    output_dir = Path(training_args.output_dir)
    finished = finished_summary(resume, training_args)
    if finished is not None:
        return report_finished(finished, training_args)
    set_seed(training_args.seed)
    if model_args.init_from is not None and data_args.tokenizer is None:
        data_args.tokenizer = resolve_source(model_args.init_from)
    tokenizer, train, validation, splits = prepare_on_every_process(prepare_pairs, data_args, training_args)
    check_validation_fills_a_batch(len(validation), data_args, training_args)
    model = build_seq2seq_model(model_args, tokenizer, data_args.max_source_length)
    set_generation_config(
        model,
        tokenizer,
        max_length=training_args.generation_max_length or data_args.max_target_length + 1,
        num_beams=training_args.generation_num_beams or 1,
    )
    training_args.predict_with_generate = True  # BLEU and chrF are scores of translations
    # pairs differ in length: throughput counts the mean source + target tokens of a training pair per pair
    pair_tokens = sum(map(len, train["input_ids"])) / len(train) + sum(map(len, train["labels"])) / len(train)
    pairs_per_step = (
        training_args.per_device_train_batch_size
        * training_args.gradient_accumulation_steps
        * training_args.world_size
    )
    tokens_per_step = round(pairs_per_step * pair_tokens)
    # the weights every token meets, forward and backward (6·N); the attention over the source is left out
    flops_per_token = 6 * non_embedding_parameters(model)
    details = {
        "data": ", ".join(data_args.train_files) or data_args.dataset_name or "the embedded English/Spanish phrases",
        "pairs": f"{data_args.source_field} -> {data_args.target_field}",
    }
    memory = MemoryCallback()
    collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)
    trainer = ZooSeq2SeqTrainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=validation,
        processing_class=tokenizer,
        data_collator=collator,
        compute_metrics=translation_metrics(tokenizer),
        callbacks=run_callbacks(tokens_per_step, flops_per_token, details, memory, callbacks),
    )
    throughput_first(trainer)
    first_step = int(Path(resume).name.split("-")[-1]) if resume else 0
    seconds, memory_per_process = train_measured(trainer, memory, resume)
    evaluation = trainer.evaluate()
    perplexity = validation_perplexity(trainer, validation, collator, training_args.per_device_eval_batch_size)
    steps = trainer.state.global_step
    summary = {
        "variant": model_args.variant if model_args.init_from is None else model.config.model_type,
        "task": "seq2seq",
        "parameters": sum(parameter_count(p) for p in model.parameters()),
        "world_size": training_args.world_size,
        "distributed": trainer.accelerator.distributed_type.value,
        "steps": steps,
        "train_pairs": len(train),
        "validation_pairs": len(validation),
        "test_pairs": len(splits["test"]) if "test" in splits else 0,
        "train_tokens": steps * tokens_per_step,
        "seconds": round(seconds, 1),
        "tokens_per_second": round((steps - first_step) * tokens_per_step / max(seconds, 1e-9), 1),
        "flops_per_token": flops_per_token,
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "evaluations": [
            {key: entry[key] for key in ("step", "eval_loss", "eval_bleu", "eval_chrf") if key in entry}
            for entry in trainer.state.log_history
            if "eval_loss" in entry
        ],
        "validation_bleu": evaluation["eval_bleu"],
        "validation_chrf": evaluation["eval_chrf"],
        "validation_perplexity": round(perplexity, 3),
        "num_beams": model.generation_config.num_beams,
        "generation_max_length": model.generation_config.max_length,
        "memory_per_process": sorted(memory_per_process, key=lambda entry: entry["rank"]),
        "validation_file": str(output_dir / "validation_pairs.jsonl"),
    }
    if "test" in splits:
        summary["test_file"] = str(output_dir / "test_pairs.jsonl")
    details |= {
        "validation BLEU": summary["validation_bleu"],
        "validation chrF": summary["validation_chrf"],
        "validation perplexity": summary["validation_perplexity"],
    }
    summary["final_model"] = str(output_dir / "final")
    save_final(trainer, summary, {**details, "steps": steps})
    if training_args.process_index == 0:
        write_pairs(splits["validation"], output_dir / "validation_pairs.jsonl")
        if "test" in splits:
            write_pairs(splits["test"], output_dir / "test_pairs.jsonl")
        write_atomically(output_dir / "training_summary.json", json.dumps(summary, indent=2))
    return summary
