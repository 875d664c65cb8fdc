"""`ZooTrainer`, the transformers `Trainer` with its fixes (resuming, FSDP on CPU processes, saving a sharded model
as its own class), `ZooSeq2SeqTrainer` (the same fixes over `Seq2SeqTrainer`), and which checkpoint a run resumes
from."""

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import ClassVar

import torch
from torch.utils.data import DataLoader
from transformers import Seq2SeqTrainer, Trainer, TrainingArguments
from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..convert.distill import (
    TAIL_LOGPROB,
    TOPK_COLUMNS,
    TOPK_IDS,
    TOPK_LOGPROBS,
    check_precomputed_temperature,
    distillation_loss,
    topk_distillation_loss,
)
from ..errors import MissingPathError, UserError
from .batching import TokenBatchSampler
from .callbacks import COMPLETE_MARKER


def complete_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """The complete `checkpoint-N` folders of `output_dir`, oldest first."""
    folders = Path(output_dir).glob(f"{PREFIX_CHECKPOINT_DIR}-*")
    complete = [f for f in folders if f.name.split("-")[-1].isdigit() and (f / COMPLETE_MARKER).is_file()]
    return sorted(complete, key=lambda f: int(f.name.split("-")[-1]))


def resolve_resume(training_args: TrainingArguments) -> str | None:
    """The checkpoint to resume from (`latest`/`true`: the newest complete one), refusing to train over existing
    checkpoints unasked; incomplete checkpoints are renamed `incomplete-checkpoint-N`, never deleted."""
    output_dir = Path(training_args.output_dir)
    existing = sorted(output_dir.glob(f"{PREFIX_CHECKPOINT_DIR}-*")) if output_dir.is_dir() else []
    request = training_args.resume_from_checkpoint
    if not request:
        if existing:
            raise UserError(
                f"training.output_dir={output_dir} already holds {existing[-1].name}; resume with "
                f"--training.resume_from_checkpoint latest, or choose another output_dir."
            )
        return None
    if str(request).lower() not in ("latest", "true"):
        if not (Path(request) / COMPLETE_MARKER).is_file():
            raise MissingPathError(
                f"training.resume_from_checkpoint={request} is not a complete checkpoint (no {COMPLETE_MARKER}); "
                f"resume from a complete one, or latest."
            )
        return str(request)
    complete = complete_checkpoints(output_dir)
    if training_args.process_index == 0:
        newest = int(complete[-1].name.split("-")[-1]) if complete else -1
        for folder in existing:
            step = folder.name.split("-")[-1]
            if step.isdigit() and int(step) > newest and not (folder / COMPLETE_MARKER).is_file():
                folder.rename(folder.with_name(f"incomplete-{folder.name}"))
    if not complete:
        raise MissingPathError(f"nothing to resume: {output_dir} holds no complete checkpoint.")
    return str(complete[-1])


class ZooTrainer(Trainer):
    """The `Trainer`, with two fixes to resuming, and FSDP on CPU processes."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        enable_fsdp_on_cpu(self)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        with unsharded_class(self.model):
            super()._save(output_dir, state_dict=state_dict)

    def _init_training_state(
        self, max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
    ):
        # The Trainer checks max_steps only after a step (DefaultFlowCallback.on_step_end): a state restored at
        # global_step >= max_steps in the middle of an epoch would train one more step (and write a checkpoint) on
        # every resume. Starting past the last epoch runs none.
        epochs_trained, steps_trained_in_current_epoch = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        if max_steps > 0 and self.state.global_step >= max_steps:
            return num_train_epochs, 0
        return epochs_trained, steps_trained_in_current_epoch

    def _issue_warnings_after_load(self, load_result) -> None:
        # A tied lm_head.weight is not saved (save_pretrained keeps one copy of shared tensors), so loading a
        # checkpoint's state dict reports it missing on every resume; it is the embedding's, loaded with it.
        # Genuinely missing keys are still reported.
        tied = set(getattr(self.model, "all_tied_weights_keys", None) or {})
        missing = [key for key in load_result.missing_keys if key not in tied]
        if len(missing) < len(load_result.missing_keys):
            self.model.tie_weights()
        super()._issue_warnings_after_load(load_result._replace(missing_keys=missing))


def drop_words(tokens: torch.Tensor, rate: float, replacement: int, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Word dropout (Sennrich & Zhang 2019, after Gal & Ghahramani 2016): each token of `tokens` (B, T) replaced by
    `replacement` with probability `rate`, except where `keep` (B, T) is True (padding, a decoder's start token).
    On the decoder's inputs it takes away part of the history the decoder would otherwise predict from alone, so
    that the source is worth reading; on the source it is regularisation. Drawn from torch's generator, which the
    Trainer seeds."""
    if rate <= 0:
        return tokens
    dropped = torch.rand(tokens.shape, device=tokens.device) < rate  # (B, T)
    if keep is not None:
        dropped &= ~keep
    return tokens.masked_fill(dropped, replacement)


class ZooSeq2SeqTrainer(ZooTrainer, Seq2SeqTrainer):
    """`Seq2SeqTrainer` (evaluation with `generate()` under `predict_with_generate`) with `ZooTrainer`'s fixes: the
    method resolution order puts them first, and their `super()` calls reach `Seq2SeqTrainer`, then `Trainer`. With
    `training.batch_tokens` it trains on batches of pairs of similar length by token count (`token_batches`); with
    `training.source_word_dropout` / `target_word_dropout` its training batches lose words (`drop_words`)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training:
            inputs = self.drop_words(model, inputs)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def drop_words(self, model, inputs: dict) -> dict:
        """The training batch `inputs` with source and decoder-input tokens replaced by the pad token at the
        recipe's rates: the pad token's embedding stands for an unknown word (a byte-level BPE has no unknown
        token). Padding and the decoder's start token stay; the labels are untouched."""
        source_rate = getattr(self.args, "source_word_dropout", 0.0)
        target_rate = getattr(self.args, "target_word_dropout", 0.0)
        if not source_rate and not target_rate:
            return inputs
        config = model.config
        inputs = dict(inputs)
        if source_rate:
            source = inputs["input_ids"]
            keep = inputs["attention_mask"] == 0 if "attention_mask" in inputs else None
            inputs["input_ids"] = drop_words(source, source_rate, config.pad_token_id, keep)
        if target_rate:
            decoder_inputs = inputs.get("decoder_input_ids")
            if decoder_inputs is None:  # the model shifts the labels itself: do it here, then drop
                decoder_inputs = model.prepare_decoder_input_ids_from_labels(labels=inputs["labels"])
            keep = decoder_inputs == config.pad_token_id
            keep[:, 0] = True  # the start token: every target begins with it
            inputs["decoder_input_ids"] = drop_words(decoder_inputs, target_rate, config.pad_token_id, keep)
        return inputs

    def get_train_dataloader(self) -> DataLoader:
        if not getattr(self.args, "batch_tokens", None):
            return super().get_train_dataloader()
        dataset = self._remove_unused_columns(self.train_dataset, description="Training")
        loader = DataLoader(
            dataset,
            batch_sampler=token_batches(dataset, self.args),
            collate_fn=self.data_collator,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
        )
        return self.accelerator.prepare(loader)  # each process takes every world_size-th batch


class ZooDistillationTrainer(ZooTrainer):
    """`ZooTrainer` whose training loss is distillation (`hf_attn_zoo.convert.distill`): KL(teacher || student) at
    `temperature` mixed with cross-entropy by `alpha`, against `teacher` run alongside, or against the teacher's top-k
    columns a batch carries (precomputed once). Evaluation keeps the labels' cross-entropy, so that validation
    perplexity means what it means for every other run."""

    # a language model's logits at t predict label t + 1 (transformers' shift); a decoder's predict label t
    shifted_labels: ClassVar[bool] = True

    def __init__(self, *args, teacher=None, temperature: float = 1.0, alpha: float = 0.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.teacher, self.temperature, self.alpha = teacher, temperature, alpha
        if teacher is not None:
            teacher.to(self.args.device)

    def _set_signature_columns_if_needed(self) -> None:
        super()._set_signature_columns_if_needed()
        # the precomputed teacher columns reach compute_loss, which takes them out before the model's forward
        self._signature_columns = [*self._signature_columns, *TOPK_COLUMNS]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        columns = {name: inputs.pop(name) for name in TOPK_COLUMNS if name in inputs}
        if not model.training or self.alpha == 1:  # evaluation, or no KL term: the labels' cross-entropy
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        labels = inputs.pop("labels", None)
        outputs = model(**inputs, use_cache=False)  # (B, T, V) logits, no loss
        settings = {"temperature": self.temperature, "alpha": self.alpha, "num_items_in_batch": num_items_in_batch}
        if columns:  # precomputed over a language model's blocks (refused for a translator by its task)
            check_precomputed_temperature(columns, self.temperature)
            teacher_columns = (columns[TOPK_IDS].long(), columns[TOPK_LOGPROBS], columns[TAIL_LOGPROB])
            loss = topk_distillation_loss(outputs.logits, *teacher_columns, labels, **settings)
        elif self.teacher is not None:
            with torch.no_grad():
                teacher_logits = self.teacher(**inputs, use_cache=False).logits  # (B, T, V)
            loss = distillation_loss(outputs.logits, teacher_logits, labels, shift=self.shifted_labels, **settings)
        else:
            raise ValueError("distillation needs a teacher to run alongside or its top-k columns in every batch.")
        return (loss, outputs) if return_outputs else loss


class ZooSeq2SeqDistillationTrainer(ZooDistillationTrainer, ZooSeq2SeqTrainer):
    """A translator learning from a teacher translator's distribution over each next target token, given the same
    source and target prefix (word-level distillation, Kim & Rush 2016): `ZooDistillationTrainer`'s loss on the
    decoder's logits, which predict their labels in place, with `ZooSeq2SeqTrainer`'s batches, word dropout (the
    teacher reads the same dropped inputs as the student) and evaluation by `generate()`."""

    shifted_labels = False

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # the distillation loss; at alpha 1 the loss is ZooSeq2SeqTrainer's own, which drops the words itself
        if model.training and self.alpha != 1:
            inputs = dict(inputs)
            if "decoder_input_ids" not in inputs:  # the loss pops the labels: the decoder reads them shifted first
                inputs["decoder_input_ids"] = model.prepare_decoder_input_ids_from_labels(labels=inputs["labels"])
            inputs = self.drop_words(model, inputs)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def token_batches(pairs, args: TrainingArguments) -> TokenBatchSampler:
    """The token-count batches (`training.batch_tokens`) of tokenized pairs, shuffled by the run's data seed."""
    seed = args.data_seed if args.data_seed is not None else args.seed
    lengths = [list(map(len, pairs[column])) for column in ("input_ids", "labels")]
    return TokenBatchSampler(*lengths, args.batch_tokens, seed=seed)


def average_last_checkpoints(trainer: Trainer, count: int) -> list[Path]:
    """Put the mean of the weights of the last `count` complete checkpoints of the run into `trainer.model` (as
    fairseq's average_checkpoints: the mean of nearby points of the trajectory generalises better than its end).
    Returns the checkpoints averaged; fewer than `count` on disk is refused. Tied weights are stored once and tied
    again after loading."""
    from safetensors.torch import load_file

    checkpoints = complete_checkpoints(trainer.args.output_dir)[-count:]
    if len(checkpoints) < count:
        raise UserError(
            f"training.average_checkpoints={count}, but {trainer.args.output_dir} holds {len(checkpoints)} complete "
            f"checkpoint(s): save more often (training.save_steps) or average fewer."
        )
    total: dict[str, torch.Tensor] = {}
    for checkpoint in checkpoints:
        for shard in sorted(checkpoint.glob("*.safetensors")):  # one file, or the shards of a large model
            for name, tensor in load_file(str(shard)).items():
                total[name] = total[name] + tensor.double() if name in total else tensor.double()
    model = trainer.accelerator.unwrap_model(trainer.model)
    state = model.state_dict()
    averaged = {name: (tensor / count).to(state[name].dtype) for name, tensor in total.items()}
    model.load_state_dict(averaged, strict=False)
    model.tie_weights()
    return checkpoints


@contextmanager
def unsharded_class(model: torch.nn.Module) -> Iterator[None]:
    """The model saved as its own class, not FSDP2's: `fully_shard` gives the model a class of its own
    (`FSDPZooGQAForCausalLM`, in a torch module), and `save_pretrained` would name it in the config's `auto_map`
    and copy torch's FSDP sources beside the weights as "remote code". Saving reads the state dict it is given and
    runs no forward, so the class is swapped back for the save only."""
    from torch.distributed.fsdp import FSDPModule

    sharded = type(model)
    if not isinstance(model, FSDPModule):
        yield
        return
    model.__class__ = next(cls for cls in sharded.__mro__ if not issubclass(cls, FSDPModule))
    try:
        yield
    finally:
        model.__class__ = sharded


def enable_fsdp_on_cpu(trainer: Trainer) -> None:
    """Shard with FSDP over gloo CPU processes when the launch asked for FSDP (accelerate's FSDP config, or the
    Trainer's `fsdp`). accelerate turns FSDP on only over accelerator devices: on CPU processes (MULTI_CPU) it drops
    the FSDP plugin and would run plain DDP, although FSDP2 (`fully_shard`) itself shards over gloo. So the state
    is switched to FSDP after the fact, with the plugin the launch described; `accelerator.prepare` then shards the
    model as on GPUs. FSDP version 1 is not switched on: on CPU it is left to run as DDP, as accelerate does."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    wanted = os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true" or trainer.args.fsdp_plugin_args is not None
    if not wanted or state.distributed_type != DistributedType.MULTI_CPU or getattr(state, "fsdp_plugin", None):
        return
    plugin_args = trainer.args.fsdp_plugin_args or {}
    plugin = FullyShardedDataParallelPlugin(**plugin_args)  # unset fields come from accelerate's FSDP_* variables
    if plugin.fsdp_version != 2:
        raise UserError(
            "FSDP version 1 on CPU processes: accelerate does not shard with it there; use fsdp_version: 2 "
            "(configs/accelerate/fsdp_cpu.yaml)."
        )
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    # as accelerate does for GPUs: every later AcceleratorState() copies the process state's distributed type
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    trainer.is_fsdp_enabled = True


def checkpoint_step(checkpoint: str | os.PathLike) -> int:
    """The optimizer steps a checkpoint holds (its trainer state's global step; else its folder name's)."""
    state = Path(checkpoint) / "trainer_state.json"
    if state.is_file():
        return TrainerState.load_from_json(str(state)).global_step
    return int(Path(checkpoint).name.split("-")[-1])
