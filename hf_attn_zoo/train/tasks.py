"""What differs between the kinds of run `run_training` trains, as data: one `Task` object per kind, the way
torchtitan's `TrainSpec` keeps one trainer for every model.

A task says how to prepare its data (`prepare`), build the model (`build`), collate a batch (`collator`), score an
evaluation (`metrics`), count the tokens and FLOPs of a step, which `Trainer` class runs it, what its summary adds
and what it writes beside the final model. Everything else -- resuming, the crash-safe checkpoints, throughput and
memory callbacks, the one tokenizer of all processes, the final save -- is `run.run_training`'s, once.

- `CausalLMTask`: a language model on text blocks (`hf_attn_zoo.data`), evaluated by validation perplexity against
  the unigram baseline; `convert.uptrain_fraction` turns a fraction of the parent's tokens into steps.
- `DistillationTask` / `TranslationDistillationTask`: a language model or a translator learning from a teacher's
  next-token distribution (`convert.distill`; `Distilling` holds what both add).
- `TranslationTask`: a translator on sentence pairs (`hf_attn_zoo.pairs`) with `Seq2SeqTrainer`, evaluated with
  `generate()` for BLEU and chrF through the shipped `evaluate` module, and the references' perplexity at the end;
  it writes the pairs it validated on (and held out) beside the final model, for `hf-attn-zoo translate-eval`.
"""

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, DataCollatorForSeq2Seq, Trainer

from ..convert.distill import precompute_teacher_topk, vocabulary_refusal
from ..data import DataArguments, prepare_data
from ..errors import UserError
from ..evaluation.translation import labelled_nll, set_generation_config, translation_metric
from ..models import get_variant
from ..pairs import build_pair_tokenizer, split_pairs, tokenize_pairs, write_pairs
from .build import (
    build_model,
    build_seq2seq_model,
    non_embedding_parameters,
    parent_train_tokens,
    training_flops_per_token,
    uptraining_steps,
)
from .recipe import ConversionArguments, ModelArguments, ZooTrainingArguments
from .trainer import (
    ZooDistillationTrainer,
    ZooSeq2SeqDistillationTrainer,
    ZooSeq2SeqTrainer,
    ZooTrainer,
    token_batches,
)


@dataclass
class Prepared:
    """A task's data: the tokenizer every process shares, the training and validation datasets, and what the task
    keeps for its summary and outputs (`extra`)."""

    tokenizer: Any
    train: Any
    validation: Any
    extra: dict = field(default_factory=dict)


class Task:
    """The parts of a training run that differ by kind; `run.run_training` calls them in this order."""

    name: ClassVar[str]
    trainer_class: ClassVar[type[Trainer]]

    def plan_steps(self, model_args: ModelArguments, data_args: DataArguments, args: ZooTrainingArguments) -> None:
        """Set what the recipe leaves to be derived before any data work (nothing by default)."""

    def prepare(self, data_args: DataArguments) -> Prepared:
        raise NotImplementedError

    def build(self, model_args: ModelArguments, data_args: DataArguments, prepared: Prepared):
        raise NotImplementedError

    def configure(self, model, prepared: Prepared, data_args: DataArguments, args: ZooTrainingArguments) -> None:
        """Adjust the model or the arguments once both exist (nothing by default)."""

    def collator(self, model, prepared: Prepared):
        return None  # the Trainer's default: the datasets hold ready blocks

    def metrics(self, prepared: Prepared):
        return None

    def trainer_arguments(self, model_args: ModelArguments) -> dict:
        """Keyword arguments of `trainer_class` beyond the Trainer's own."""
        return {}

    def tokens_per_step(self, prepared: Prepared, data_args: DataArguments, args: ZooTrainingArguments) -> int:
        raise NotImplementedError

    def flops_per_token(self, model, data_args: DataArguments) -> float:
        raise NotImplementedError

    def details(self, data_args: DataArguments, prepared: Prepared) -> dict:
        """What the model card says of the run's data."""
        raise NotImplementedError

    def scores(
        self,
        trainer: Trainer,
        evaluation: dict,
        prepared: Prepared,
        model_args: ModelArguments,
        data_args: DataArguments,
    ) -> dict:
        """What the summary says of the trained model (its variant, its scores after the final `trainer.evaluate()`,
        the data it read)."""
        raise NotImplementedError

    def outputs(self, output_dir: Path, prepared: Prepared, write: bool) -> dict:
        """The summary entries of the files the task keeps beside the final model, written where `write` (the main
        process)."""
        return {}


def processes_batch(args: ZooTrainingArguments) -> int:
    """Examples one optimizer step reads, over every process and accumulation step."""
    return args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size


class CausalLMTask(Task):
    name = "causal_lm"
    trainer_class = ZooTrainer

    def plan_steps(self, model_args: ModelArguments, data_args: DataArguments, args: ZooTrainingArguments) -> None:
        if args.batch_tokens is not None:
            raise UserError(
                f"training.batch_tokens={args.batch_tokens} batches pairs by length for a translator; a language "
                f"model's blocks are all data.block_size tokens: set training.per_device_train_batch_size instead."
            )
        fraction = model_args.conversion.uptrain_fraction
        if fraction is not None:  # before any data work: the parent must say how long it trained
            tokens_per_step = processes_batch(args) * data_args.block_size
            args.max_steps = uptraining_steps(fraction, parent_train_tokens(model_args.init_from), tokens_per_step)

    def prepare(self, data_args: DataArguments) -> Prepared:
        tokenizer, train, validation, unigram = prepare_data(data_args)
        return Prepared(tokenizer, train, validation, {"unigram": unigram})

    def build(self, model_args: ModelArguments, data_args: DataArguments, prepared: Prepared):
        return build_model(model_args, prepared.tokenizer, data_args.block_size, prepared.train)

    def tokens_per_step(self, prepared: Prepared, data_args: DataArguments, args: ZooTrainingArguments) -> int:
        return processes_batch(args) * data_args.block_size

    def flops_per_token(self, model, data_args: DataArguments) -> float:
        return training_flops_per_token(model, data_args.block_size)

    def details(self, data_args: DataArguments, prepared: Prepared) -> dict:
        return {
            "data": ", ".join(data_args.train_files) or "Python standard-library sources",
            "block size": data_args.block_size,
            "packing": data_args.packing,
            "unigram baseline perplexity": round(prepared.extra["unigram"], 2),
        }

    def scores(
        self,
        trainer: Trainer,
        evaluation: dict,
        prepared: Prepared,
        model_args: ModelArguments,
        data_args: DataArguments,
    ) -> dict:
        return {
            "variant": get_variant(trainer.model.config.model_type).name,
            "packing": data_args.packing,
            "validation_perplexity": round(math.exp(min(evaluation["eval_loss"], 700.0)), 3),
            "unigram_perplexity": round(prepared.extra["unigram"], 3),
        }


class TranslationTask(Task):
    name = "seq2seq"
    trainer_class = ZooSeq2SeqTrainer

    def __init__(self) -> None:
        self.uptraining: tuple[float, int] | None = None  # (convert.uptrain_fraction, the parent's training tokens)

    def plan_steps(self, model_args: ModelArguments, data_args: DataArguments, args: ZooTrainingArguments) -> None:
        fraction = model_args.conversion.uptrain_fraction
        if fraction is not None:  # the parent must say how long it trained before any data work; steps in configure
            self.uptraining = (fraction, parent_train_tokens(model_args.init_from))

    def prepare(self, data_args: DataArguments) -> Prepared:
        splits = split_pairs(data_args)
        tokenizer = build_pair_tokenizer(data_args, splits["train"])
        train = tokenize_pairs(splits["train"], tokenizer, data_args, "the training pairs")
        validation = tokenize_pairs(splits["validation"], tokenizer, data_args, "the validation pairs")
        if len(train) == 0 or len(validation) == 0:
            raise UserError(
                "no pair fits data.max_source_length / data.max_target_length (data.long_pairs drop): raise them."
            )
        return Prepared(tokenizer, train, validation, {"splits": splits})

    def build(self, model_args: ModelArguments, data_args: DataArguments, prepared: Prepared):
        return build_seq2seq_model(model_args, prepared.tokenizer, data_args.max_source_length, prepared.train)

    def configure(self, model, prepared: Prepared, data_args: DataArguments, args: ZooTrainingArguments) -> None:
        if self.uptraining is not None:
            # a step's tokens depend on the pairs' lengths (and with training.batch_tokens on the batching), known
            # only now: the steps of the fraction are counted in this run's real tokens a step, as the parent's
            fraction, parent_tokens = self.uptraining
            args.max_steps = uptraining_steps(fraction, parent_tokens, self.tokens_per_step(prepared, data_args, args))
        set_generation_config(
            model,
            prepared.tokenizer,
            max_length=args.generation_max_length or data_args.max_target_length + 1,
            num_beams=args.generation_num_beams or 1,
            length_penalty=args.generation_length_penalty,
        )
        args.predict_with_generate = True  # BLEU and chrF are scores of translations

    def collator(self, model, prepared: Prepared):
        return DataCollatorForSeq2Seq(prepared.tokenizer, model=model, label_pad_token_id=-100)

    def metrics(self, prepared: Prepared):
        return translation_metrics(prepared.tokenizer)

    def tokens_per_step(self, prepared: Prepared, data_args: DataArguments, args: ZooTrainingArguments) -> int:
        # pairs differ in length: a step counts the real (unpadded) source + target tokens of its batches, on average
        train = prepared.train
        if args.batch_tokens:
            batches = token_batches(train, args)
            prepared.extra["padding_fraction"] = round(batches.padding_fraction(), 4)
            return round(batches.mean_batch_tokens() * args.gradient_accumulation_steps * args.world_size)
        pair_tokens = (sum(map(len, train["input_ids"])) + sum(map(len, train["labels"]))) / len(train)
        return round(processes_batch(args) * pair_tokens)

    def flops_per_token(self, model, data_args: DataArguments) -> float:
        # the weights every token meets, forward and backward (6·N); the attention over the source is left out
        return 6 * non_embedding_parameters(model)

    def details(self, data_args: DataArguments, prepared: Prepared) -> dict:
        return {
            "data": ", ".join(data_args.train_files)
            or data_args.dataset_name
            or "the embedded English/Spanish phrases",
            "pairs": f"{data_args.source_field} -> {data_args.target_field}",
        }

    def scores(
        self,
        trainer: Trainer,
        evaluation: dict,
        prepared: Prepared,
        model_args: ModelArguments,
        data_args: DataArguments,
    ) -> dict:
        splits, model = prepared.extra["splits"], trainer.model
        perplexity = validation_perplexity(trainer, prepared.validation, trainer.data_collator)
        return {
            "variant": model_args.variant if model_args.init_from is None else model.config.model_type,
            "task": self.name,
            "train_pairs": len(prepared.train),
            "validation_pairs": len(prepared.validation),
            "test_pairs": len(splits["test"]) if "test" in splits else 0,
            "validation_bleu": evaluation["eval_bleu"],
            "validation_chrf": evaluation["eval_chrf"],
            "validation_perplexity": round(perplexity, 3),
            **{key: prepared.extra[key] for key in ("padding_fraction",) if key in prepared.extra},
            "num_beams": model.generation_config.num_beams,
            "generation_max_length": model.generation_config.max_length,
        }

    def outputs(self, output_dir: Path, prepared: Prepared, write: bool) -> dict:
        """The pairs validated on and, with `data.test_groups`, those held out, as JSON lines for translate-eval."""
        splits = prepared.extra["splits"]
        names = {"validation_file": "validation", "test_file": "test"}
        files = {key: output_dir / f"{split}_pairs.jsonl" for key, split in names.items() if split in splits}
        if write:
            for key, path in files.items():
                write_pairs(splits[names[key]], path)
        return {key: str(path) for key, path in files.items()}


def translation_metrics(tokenizer):
    """`compute_metrics` for `predict_with_generate`: corpus BLEU and chrF of the generations against the labels,
    through the shipped `evaluate` module (`hf_attn_zoo.evaluation.TRANSLATION`)."""
    metric = translation_metric()
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


def validation_perplexity(trainer: Trainer, validation, collator) -> float:
    """The validation references' perplexity, corpus-level and token-weighted (the Trainer's `eval_loss` is a mean
    of batch means). Every process scores every batch, as sharded models need all processes in each forward."""
    model = trainer.model
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    for batch in DataLoader(validation, batch_size=trainer.args.per_device_eval_batch_size, collate_fn=collator):
        nll, count = labelled_nll(model, batch.to(trainer.args.device))
        total, tokens = total + nll, tokens + count
    model.train(was_training)
    return math.exp(min(total / max(tokens, 1), 700.0))


class Distilling:
    """What a run that learns from a teacher's next-token distribution adds to its task (`convert.distill`; Hinton
    et al. 2015, as LoLCATs and X-EcoMLA repair a converted model): KL at `convert.temperature`, mixed with the
    labels' cross-entropy by `convert.alpha`, against the teacher run alongside or, with `convert.teacher_topk`, its
    top-k log-probabilities precomputed once over the training blocks (`hf_attn_zoo.convert.distill`; a language
    model's). The teacher is `convert.teacher`, else the parent the model is converted from, loaded by
    `teacher_class`; at `convert.alpha` 1 (cross-entropy uptraining through the same path) it is never loaded.
    Validation stays the labels' perplexity."""

    teacher_class: ClassVar[type]

    def __init__(self, conversion: ConversionArguments) -> None:
        super().__init__()
        self.conversion = conversion
        self._teacher = None

    def teacher(self, model_args: ModelArguments):
        if self._teacher is None:
            source = self.conversion.teacher_source or model_args.source
            self._teacher = self.teacher_class.from_pretrained(source).eval().requires_grad_(False)
        return self._teacher

    def build(self, model_args: ModelArguments, data_args: DataArguments, prepared: Prepared):
        model = super().build(model_args, data_args, prepared)
        if self.conversion.alpha == 1:  # the labels' cross-entropy alone: the KL's weight is 0, no teacher is read
            return model
        teacher = self.teacher(model_args)
        if (refusal := vocabulary_refusal(teacher, model)) is not None:
            raise UserError(f"convert.distill: {refusal}")
        if self.conversion.teacher_topk is not None:  # the teacher's one pass over the training blocks
            prepared.train = precompute_teacher_topk(
                teacher, prepared.train, self.conversion.teacher_topk, self.conversion.temperature
            )
            self._teacher = None  # not run again: the loss reads the columns
        return model

    def trainer_arguments(self, model_args: ModelArguments) -> dict:
        conversion = self.conversion
        teacher = self._teacher if conversion.teacher_topk is None else None
        return {"teacher": teacher, "temperature": conversion.temperature, "alpha": conversion.alpha}

    def details(self, data_args: DataArguments, prepared: Prepared) -> dict:
        conversion = self.conversion
        teacher = f"top-{conversion.teacher_topk} precomputed" if conversion.teacher_topk else "run alongside"
        teacher = "not read (alpha=1: the labels' cross-entropy alone)" if conversion.alpha == 1 else teacher
        distilled = {"distillation": f"T={conversion.temperature}, alpha={conversion.alpha}, teacher {teacher}"}
        return super().details(data_args, prepared) | distilled


class DistillationTask(Distilling, CausalLMTask):
    """A language model learning from a teacher language model (`Distilling`)."""

    name = "distill"
    trainer_class = ZooDistillationTrainer
    teacher_class = AutoModelForCausalLM


class TranslationDistillationTask(Distilling, TranslationTask):
    """A translator learning from a teacher translator's distribution over each next target token given the same
    source and target prefix (`Distilling`; word-level distillation, Kim & Rush 2016), as a converted translator
    (`convert.num_key_value_heads`) learns from the MHA parent it was pooled from. The teacher runs alongside:
    `convert.teacher_topk` precomputes over a language model's blocks and is refused here."""

    name = "seq2seq_distill"
    trainer_class = ZooSeq2SeqDistillationTrainer
    teacher_class = AutoModelForSeq2SeqLM

    def __init__(self, conversion: ConversionArguments) -> None:
        if conversion.teacher_topk is not None:
            raise UserError(
                f"convert.teacher_topk={conversion.teacher_topk} precomputes over a language model's blocks; a "
                f"translator distils from its teacher run alongside: leave convert.teacher_topk empty."
            )
        super().__init__(conversion)


TASKS: dict[str, type[Task]] = {
    task.name: task for task in (CausalLMTask, TranslationTask, DistillationTask, TranslationDistillationTask)
}


def task_for(model_args: ModelArguments) -> Task:
    """The task of a run: `model.task` or what the model is (`ModelArguments.seq2seq`), distillation where the
    `convert` section asks for it."""
    conversion = model_args.conversion
    if model_args.seq2seq:
        return TranslationDistillationTask(conversion) if conversion.distill else TranslationTask()
    return DistillationTask(conversion) if conversion.distill else CausalLMTask()
