"""The model a run trains: built from a preset or from `init_from` (converted where asked; a translator for
sequence-to-sequence runs), the uptraining arithmetic that turns a fraction of the parent's tokens into steps,
parameter counts and training FLOPs per token."""

import json
import math
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM
from transformers.utils import logging

from ..convert import attention_transfer, from_llama, mha_to_gqa, seq2seq_attention_transfer, seq2seq_mha_to_gqa
from ..convert.calibrated import CALIBRATION_METHODS
from ..convert.transfer import mean_relative
from ..data import tokenizer_fields
from ..errors import MissingPathError, UserError, one_line
from ..models import SEQ2SEQ, ZooForCausalLM, get_variant
from .recipe import ConversionArguments, ModelArguments

logger = logging.get_logger(__name__)

TRANSFER_ROWS = 4  # blocks a step of a language model's attention transfer (a translator's: one pair)


def parent_train_tokens(init_from: str) -> int:
    """The pretraining tokens of `init_from`, from the training_summary.json that `hf-attn-zoo train` saves in it."""
    summary_path = Path(init_from) / "training_summary.json"
    if not summary_path.is_file():
        raise MissingPathError(
            f"convert.uptrain_fraction needs {summary_path} (written by hf-attn-zoo train) to know the parent's "
            f"pretraining tokens; set training.max_steps instead."
        )
    return json.loads(summary_path.read_text())["train_tokens"]


def warn_unapplied_config(model_args: ModelArguments, config) -> list[str]:
    """With `init_from` the checkpoint's config is the model's: the recipe's `model.config` fields are not applied.
    Say which of them differ from the checkpoint's (a dropout the recipe asks for, say), instead of dropping them in
    silence; returns their names."""
    missing = object()
    differing = {
        name: value for name, value in model_args.config_fields().items() if getattr(config, name, missing) != value
    }
    if differing:
        given = ", ".join(
            f"{name}={value!r} (the checkpoint: {getattr(config, name, 'absent')!r})"
            for name, value in differing.items()
        )
        logger.warning(
            f"model.config is not applied to model.init_from={model_args.init_from}; the checkpoint's config is kept "
            f"where the recipe says {given}. Change these in the checkpoint's config.json, or train a fresh model "
            f"(model.variant) to use them."
        )
    return sorted(differing)


def build_model(model_args: ModelArguments, tokenizer, block_size: int, train_blocks=None):
    """The model to train: from `init_from`, or a fresh one from the preset, the config fields and the tokenizer.
    A calibrated `convert.method` fits on the first `convert.calibration_tokens` of the run's `train_blocks`."""
    if model_args.init_from is not None:
        kwargs = {"attn_implementation": model_args.attn_implementation} if model_args.attn_implementation else {}
        model = AutoModelForCausalLM.from_pretrained(model_args.source, **kwargs)
        if not isinstance(model, ZooForCausalLM):
            model = from_llama(model)
        warn_unapplied_config(model_args, model.config)
        conversion = model_args.conversion
        if conversion.num_key_value_heads is not None:
            model = mha_to_gqa(
                model,
                conversion.num_key_value_heads,
                conversion.method,
                calibration=first_blocks(train_blocks, conversion.calibration_tokens, block_size)
                if conversion.method in CALIBRATION_METHODS
                else None,
                max_calibration_tokens=conversion.calibration_tokens,
            )
        if len(tokenizer) > model.config.vocab_size:
            raise UserError(
                f"the tokenizer has {len(tokenizer)} tokens but {model_args.init_from} only "
                f"{model.config.vocab_size} embeddings; leave data.tokenizer empty to use the checkpoint's own."
            )
    else:
        variant = get_variant(model_args.variant)
        fields_ = {**model_args.config_fields(), **tokenizer_fields(tokenizer)}
        try:
            model = variant.build(model_args.size, attn_implementation=model_args.attn_implementation, **fields_)
        except UserError:
            raise
        except ValueError as error:  # the config's validation names the field
            raise UserError(f"model: {one_line(error)}") from error
    if block_size > model.config.max_position_embeddings:
        raise UserError(
            f"data.block_size={block_size} is longer than the model's max_position_embeddings="
            f"{model.config.max_position_embeddings}; lower data.block_size or raise max_position_embeddings."
        )
    return model


def parameter_count(parameter: torch.Tensor) -> int:
    """A parameter's elements, whole: under ZeRO-3 a parameter is an empty placeholder and `ds_numel` its size
    (FSDP2's DTensors report their whole size themselves)."""
    return getattr(parameter, "ds_numel", parameter.numel())


def first_blocks(blocks, tokens: int, block_size: int) -> list[list[int]] | None:
    """The token ids of the first blocks holding `tokens` tokens (None without blocks)."""
    if blocks is None:
        return None
    return blocks.select(range(min(math.ceil(tokens / block_size), len(blocks))))["input_ids"]


def non_embedding_parameters(model) -> int:
    embedding = parameter_count(model.get_input_embeddings().weight)
    return sum(parameter_count(p) for p in model.parameters()) - embedding


def training_flops_per_token(model, seq_len: int) -> float:
    """Training FLOPs per token of `model` on blocks of `seq_len` tokens, forward and backward (3x the forward):
    6·N for the weights every token meets (N non-embedding parameters, as the PaLM appendix counts them) plus
    3·L times the variant's sequence mixing (`ZooAttention.mixing_flops_per_token`). For MHA this is PaLM's
    6·N + 12·L·H·d_h·T."""
    config = model.config
    mixing = get_variant(config.model_type).attention_class.mixing_flops_per_token(config, seq_len)
    return 6 * non_embedding_parameters(model) + 3 * config.num_hidden_layers * mixing


def uptraining_steps(fraction: float, parent_tokens: int, tokens_per_step: int) -> int:
    """Optimizer steps for `fraction` of the parent's pretraining tokens. Rounded to the nearest step, not up: the
    grid compares fractions by the tokens they train, and the nearest step is off by at most half a step either way,
    where ceil would always overshoot (a fraction worth 0.1 step would train a whole one, 10 times too much). So a
    fraction worth less than half a step gives 0 steps: refused, since 0 means "score without training"."""
    steps = round(fraction * parent_tokens / tokens_per_step)
    if fraction > 0 and steps == 0:
        half_step = tokens_per_step / (2 * parent_tokens)  # round() takes exactly half a step to 0 (to even)
        smallest = _round_up(half_step * (1 + 1e-9))
        raise UserError(
            f"convert.uptrain_fraction={fraction} of the parent's {parent_tokens} tokens is less than half a step of "
            f"{tokens_per_step} tokens, so it would train 0 steps; the smallest fraction that gives one step is just "
            f"over {half_step:.3g}: set convert.uptrain_fraction to {smallest:g} or more (or 0 to score the converted "
            f"model without training)."
        )
    return steps


def _round_up(value: float, digits: int = 2) -> float:
    """`value` rounded up to `digits` significant digits (a suggestion that still clears the bound)."""
    scale = 10.0 ** (math.floor(math.log10(value)) - digits + 1)
    return round(math.ceil(value / scale) * scale, 12)


def freeze_fixed_positions(model) -> list[str]:
    """Freeze the fixed sinusoid tables of transformers' BART-family translators (`MarianSinusoidalPositionalEmbedding`
    and its kin). A fresh model builds them frozen, but `from_pretrained` hands them back trainable (transformers
    5.24), and they are not saved: trained, the saved model would read other positions than the one that was
    evaluated (measured on the Bible recipe's Marian control, docs/translation.md). Returns the names frozen."""
    frozen = []
    for name, module in model.named_modules():
        if type(module).__name__.endswith("SinusoidalPositionalEmbedding"):
            for parameter_name, parameter in module.named_parameters():
                if parameter.requires_grad:
                    parameter.requires_grad_(False)
                    frozen.append(f"{name}.{parameter_name}")
    return frozen


def first_pairs(pairs, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first training pairs holding `tokens` source + target tokens, as the `(1, S)` / `(1, T)` id tensors the
    encoder-decoder conversions teacher-force (at least one pair)."""
    chosen, seen = [], 0
    for source, target in zip(pairs["input_ids"], pairs["labels"]):
        chosen.append((torch.tensor([source]), torch.tensor([target])))  # (1, S), (1, T)
        seen += len(source) + len(target)
        if seen >= tokens:
            break
    return chosen


def convert_seq2seq(model, conversion: ConversionArguments, train_pairs):
    """`model` (a zoo MHA encoder-decoder) with its decoder's self- and cross-attention pooled to
    `convert.num_key_value_heads` key/value heads by `convert.method`, the encoder keeping its heads (Ainslie et al.
    2023 uptrain T5 so); a calibrated method reads the first `convert.calibration_tokens` of the training pairs."""
    calibration = None
    if conversion.method in CALIBRATION_METHODS:
        calibration = first_pairs(train_pairs, conversion.calibration_tokens)
    try:
        return seq2seq_mha_to_gqa(model, conversion.num_key_value_heads, conversion.method, calibration=calibration)
    except ValueError as error:  # the conversion names what does not fit: say it as the recipe's field
        raise UserError(f"convert.num_key_value_heads={conversion.num_key_value_heads}: {one_line(error)}") from error


def build_seq2seq_model(model_args: ModelArguments, tokenizer, max_source_length: int, train_pairs=None):
    """The translator to train: from `init_from` (its decoder's key/value heads pooled where `convert` says, a
    calibrated method fitted on `train_pairs`), or fresh from `ModelArguments.seq2seq_config` with the tokenizer's
    vocabulary and special tokens (the decoder starts from BOS, as the tokenizer's texts end with EOS). A source
    length beyond the encoder's positions is refused."""
    from ..evaluation.translation import encoder_positions

    kwargs = {"attn_implementation": model_args.attn_implementation} if model_args.attn_implementation else {}
    if model_args.init_from is not None:
        model = AutoModelForSeq2SeqLM.from_pretrained(model_args.source, **kwargs)
        warn_unapplied_config(model_args, model.config)
        freeze_fixed_positions(model)
        if model_args.conversion.num_key_value_heads is not None:
            model = convert_seq2seq(model, model_args.conversion, train_pairs)
        if len(tokenizer) > model.config.vocab_size:
            raise UserError(
                f"the tokenizer has {len(tokenizer)} tokens but {model_args.init_from} only "
                f"{model.config.vocab_size} embeddings; leave data.tokenizer empty to use the checkpoint's own."
            )
    else:
        fields_ = tokenizer_fields(tokenizer) | {"decoder_start_token_id": tokenizer.bos_token_id}
        config = model_args.seq2seq_config(**fields_)
        try:
            model = AutoModelForSeq2SeqLM.from_config(config, **kwargs)
        except ValueError as error:  # no encoder-decoder class registered for this config
            raise UserError(
                f"model.variant={model_args.variant!r} has no encoder-decoder model registered with "
                f"AutoModelForSeq2SeqLM ({one_line(error)}); choose one of {sorted(SEQ2SEQ)}."
            ) from error
    positions = encoder_positions(model.config)
    if positions is not None and max_source_length > positions:
        raise UserError(
            f"data.max_source_length={max_source_length} is longer than the encoder's {positions} positions "
            f"(max_position_embeddings); lower data.max_source_length or raise max_position_embeddings."
        )
    return model


def transfer_from_parent(model_args: ModelArguments, model, train, block_size: int) -> dict:
    """`convert.transfer_tokens`: attention transfer of the converted `model` from its parent (`model.init_from`,
    loaded again) on the first training tokens, before training: a language model's attention layers on its first
    blocks (`attention_transfer`, `TRANSFER_ROWS` a step), a translator's decoder self- and cross-attention on its
    first pairs (`seq2seq_attention_transfer`). Returns what the summary says of it."""
    conversion = model_args.conversion
    start = time.perf_counter()
    seq2seq = bool(getattr(model.config, "is_encoder_decoder", False))
    parent = (AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM).from_pretrained(model_args.source)
    parent = parent.to(model.device)
    settings = {"epochs": conversion.transfer_epochs, "learning_rate": conversion.transfer_learning_rate}
    if seq2seq:
        pairs = first_pairs(train, conversion.transfer_tokens)
        tokens = sum(source.numel() + target.numel() for source, target in pairs)
        results = seq2seq_attention_transfer(parent, model, pairs, **settings)
    else:
        rows = torch.tensor(first_blocks(train, conversion.transfer_tokens, block_size))  # (N, block_size)
        tokens = rows.numel()
        results = attention_transfer(parent, model, list(rows.split(TRANSFER_ROWS)), **settings)
    return {
        "tokens": tokens,
        **settings,
        "seconds": round(time.perf_counter() - start, 1),
        # the attention output's squared error relative to the parent's output, mean over the trained modules
        "relative_error_before": round(mean_relative(results, "relative_before"), 5),
        "relative_error_after": round(mean_relative(results, "relative_after"), 5),
        "modules": [
            {
                "layer": r.layer,
                "module": r.module,
                "before": round(r.relative_before, 5),
                "after": round(r.relative_after, 5),
            }
            for r in results
        ],
    }
