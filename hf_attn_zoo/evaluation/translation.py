"""Scoring a translator on pairs: its translations' corpus BLEU and chrF (the shipped `evaluate` module,
`hf_attn_zoo.evaluation.TRANSLATION`, sacrebleu underneath) and the references' perplexity under the model.

    from hf_attn_zoo.evaluation.translation import load_translator, score_translation
    model, tokenizer = load_translator("runs/tiny_translation/final")
    score_translation(model, tokenizer, ["I see the book."], ["Yo veo el libro."], num_beams=4)

or `hf-attn-zoo translate-eval CHECKPOINT --data pairs.tsv [--num_beams 4] [--json]`. The perplexity is corpus-level
and token-weighted, as the language models' (`exp` of the summed negative log-likelihood of every reference token,
EOS included, over their count), with the model reading the source and the reference before each token (teacher
forcing): how likely the model finds the human translation, independent of the decoding.

Its parts serve callers that score in their own way: `generate_translations` (the translations and the tokens
generated, in batches of similar length if asked), `translation_metric` (the metric, loaded once a process) and
`reference_perplexity`.
"""

import functools
import json
import math
import os
import time
from pathlib import Path
from typing import NamedTuple

import torch
from torch.nn import functional as F

from ..errors import UserError
from ..loading import check_model_folder, from_pretrained


def encoder_positions(config) -> int | None:
    """The longest source the encoder reads, or None where it has no limit (an RNN)."""
    for name in ("max_source_positions", "max_position_embeddings"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def check_checkpoint_config(name: str | os.PathLike, command: str) -> None:
    """Refuse, before any weights load, a local checkpoint that is not an encoder-decoder (a language model: the LM
    commands score it) or one without `decoder_start_token_id`, the first token the decoder reads."""
    folder = Path(name).expanduser()
    config_path = folder / "config.json"
    if not config_path.is_file():
        return  # a Hub id: transformers' config tells below
    config = json.loads(config_path.read_text())
    check_seq2seq_fields(config, str(name), command, folder)


def check_seq2seq_fields(config: dict, name: str, command: str, folder: Path | None = None) -> None:
    if not config.get("is_encoder_decoder"):
        raise UserError(
            f"{name} is a decoder-only model ({config.get('model_type')}), not an encoder-decoder translator: score "
            f"it with hf-attn-zoo eval; {command} needs a checkpoint with is_encoder_decoder (hf-attn-zoo train with "
            f"model.task seq2seq)."
        )
    start = config.get("decoder_start_token_id")
    if start is None and folder is not None and (folder / "generation_config.json").is_file():
        start = json.loads((folder / "generation_config.json").read_text()).get("decoder_start_token_id")
    if start is None:
        raise UserError(
            f"{name}: config.json has no decoder_start_token_id (the first token the decoder reads); set it in "
            f"config.json to the id training used (the tokenizer's bos_token_id)."
        )


def load_translator(name: str | os.PathLike, command: str = "translate-eval", trust_remote_code: bool = False):
    """(sequence-to-sequence model in eval mode, tokenizer) of a checkpoint, refused in one line when it is not one
    (`check_checkpoint_config`)."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    check_model_folder(name)
    check_checkpoint_config(name, command)
    tokenizer = from_pretrained(AutoTokenizer, name, trust_remote_code=trust_remote_code)
    model = from_pretrained(AutoModelForSeq2SeqLM, name, trust_remote_code=trust_remote_code)
    return model.eval(), tokenizer


def check_source_lengths(tokenizer, sources: list[str], limit: int | None, name: str, option: str) -> None:
    """Refuse a source longer than `limit` tokens (the encoder's positions, or the user's `option`), naming it."""
    if limit is None:
        return
    for row, ids in enumerate(tokenizer(sources)["input_ids"], start=1):
        if len(ids) > limit:
            raise UserError(
                f"{name}: pair {row} has a source of {len(ids)} tokens, more than {option}={limit}; shorten or split "
                f"that source, or raise {option}."
            )


def set_generation_config(
    model, tokenizer, *, max_length: int, num_beams: int = 1, length_penalty: float = 1.0
) -> None:
    """What `generate()` needs and every translator checkpoint carries: the tokenizer's special tokens, the decoder's
    start token (`config.decoder_start_token_id`), `max_length` (start token included), `num_beams` and beam
    search's `length_penalty`."""
    generation = model.generation_config
    generation.decoder_start_token_id = model.config.decoder_start_token_id
    generation.bos_token_id, generation.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    generation.pad_token_id = tokenizer.pad_token_id
    generation.max_length = max_length
    generation.num_beams = num_beams
    generation.length_penalty = length_penalty


class Translations(NamedTuple):
    """What `generate_translations` returns: the translations, detokenized, in the order of the sources, and the
    tokens generated (behind the decoder's start token, each row's first EOS counted, the padding after it not)."""

    texts: list[str]
    generated_tokens: int


def generated_token_count(generated: torch.Tensor, eos_token_id: int | None) -> int:
    """Tokens of `generated` (B, T: behind the start token) up to and including each row's first EOS: the padding
    `generate()` puts after a finished row is not generated work, whether the pad token is EOS or another."""
    if eos_token_id is None:
        return generated.numel()
    is_eos = generated == eos_token_id  # (B, T)
    ended = is_eos.cumsum(1)  # (B, T): EOS tokens so far in the row, this one included
    return int(((ended == 0) | ((ended == 1) & is_eos)).sum())


def translation_budget(model, source_tokens: int) -> int:
    """New tokens a translation may take where the caller sets no limit: the checkpoint's generation length (its
    training targets' longest), or one and a half times the longest source plus 10 where that is longer, so that a
    source longer than any the model trained on is not cut at the training length (fairseq bounds translations the
    same way, `a * source + b`)."""
    return max(model.generation_config.max_length - 1, source_tokens + source_tokens // 2 + 10)


@torch.no_grad()
def generate_translations(
    model,
    tokenizer,
    sources: list[str],
    num_beams: int = 1,
    max_new_tokens: int | None = None,
    batch_size: int = 16,
    by_length: bool = False,
) -> Translations:
    """The model's translations of `sources` (greedy, or beam search with `num_beams`) and the tokens it generated,
    at most `max_new_tokens` each (default: `translation_budget` of the longest source). `by_length`: batches of
    sources of similar length (sorted by characters), so that a batch pads less; the translations come back in the
    sources' order either way."""
    order = sorted(range(len(sources)), key=lambda i: len(sources[i])) if by_length else list(range(len(sources)))
    if not max_new_tokens:
        longest = max((len(ids) for ids in tokenizer(sources)["input_ids"]), default=0)
        max_new_tokens = translation_budget(model, longest)
    # An encoder-decoder's output is its start token and the new tokens: the limit is said as `max_length`, which the
    # saved generation config also sets, since generate() warns on every call when both limits are set.
    encoder_decoder = model.config.is_encoder_decoder
    limit = {"max_length": 1 + max_new_tokens} if encoder_decoder else {"max_new_tokens": max_new_tokens}
    texts, generated_tokens = [""] * len(sources), 0
    for start in range(0, len(order), batch_size):
        chosen = order[start : start + batch_size]
        inputs = tokenizer([sources[i] for i in chosen], return_tensors="pt", padding=True).to(model.device)
        generated = model.generate(**inputs, num_beams=num_beams, do_sample=False, **limit)  # (B, 1 + T)
        generated_tokens += generated_token_count(generated[:, 1:], tokenizer.eos_token_id)  # behind the start
        for index, text in zip(chosen, tokenizer.batch_decode(generated, skip_special_tokens=True)):
            texts[index] = text.strip()
    return Translations(texts, generated_tokens)


def translate(
    model,
    tokenizer,
    sources: list[str],
    num_beams: int = 1,
    max_new_tokens: int | None = None,
    batch_size: int = 16,
    by_length: bool = False,
) -> list[str]:
    """The model's translations of `sources` (greedy, or beam search with `num_beams`), detokenized."""
    return generate_translations(model, tokenizer, sources, num_beams, max_new_tokens, batch_size, by_length).texts


@functools.cache
def translation_metric():
    """The shipped BLEU/chrF `evaluate` module (`hf_attn_zoo.evaluation.TRANSLATION`), loaded once a process."""
    import evaluate

    from . import TRANSLATION

    return evaluate.load(TRANSLATION)


@torch.no_grad()
def labelled_nll(model, batch: dict) -> tuple[float, int]:
    """(summed negative log-likelihood in nats, tokens) of a batch's `labels` (-100 where padded) under `model`."""
    labels = batch["labels"]  # (B, T)
    logits = model(**batch).logits  # (B, T, V)
    nll = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")
    return nll.item(), int((labels != -100).sum())


def reference_nll(model, tokenizer, sources: list[str], targets: list[str], batch_size: int = 16) -> tuple[float, int]:
    """(summed negative log-likelihood in nats, tokens) of the reference `targets` (EOS included) given `sources`."""
    from transformers import DataCollatorForSeq2Seq

    collate = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100, return_tensors="pt")
    source_ids = tokenizer(sources)["input_ids"]
    target_ids = tokenizer(text_target=targets)["input_ids"]
    total, tokens = 0.0, 0
    for start in range(0, len(sources), batch_size):
        features = [
            {"input_ids": source, "labels": target}
            for source, target in zip(source_ids[start : start + batch_size], target_ids[start : start + batch_size])
        ]
        nll, count = labelled_nll(model, collate(features).to(model.device))
        total, tokens = total + nll, tokens + count
    return total, tokens


def reference_perplexity(
    model, tokenizer, sources: list[str], targets: list[str], batch_size: int = 16
) -> tuple[float, int]:
    """(corpus perplexity, tokens) of the reference `targets` given `sources`: `exp` of the summed negative
    log-likelihood over the token count (capped at `exp(700)`, below float overflow)."""
    nll, tokens = reference_nll(model, tokenizer, sources, targets, batch_size)
    return math.exp(min(nll / max(tokens, 1), 700.0)), tokens


def score_translation(
    model,
    tokenizer,
    sources: list[str],
    targets: list[str],
    num_beams: int = 1,
    max_new_tokens: int | None = None,
    batch_size: int = 16,
) -> dict:
    """BLEU, chrF (0-100, sacrebleu's corpus scores and signatures) of the model's translations, the references'
    perplexity, how long decoding took (seconds, generated tokens and tokens per second), and the translations."""
    start = time.perf_counter()
    translations, generated = generate_translations(model, tokenizer, sources, num_beams, max_new_tokens, batch_size)
    seconds = time.perf_counter() - start
    scores = translation_metric().compute(predictions=translations, references=targets)
    perplexity, tokens = reference_perplexity(model, tokenizer, sources, targets, batch_size)
    return {
        "bleu": scores["bleu"],
        "chrf": scores["chrf"],
        "reference_perplexity": perplexity,
        "reference_tokens": tokens,
        "pairs": len(sources),
        "num_beams": num_beams,
        "decode_seconds": round(seconds, 6),  # microseconds: a tiny set decodes in ~10 ms
        "generated_tokens": generated,
        "generated_tokens_per_second": round(generated / max(seconds, 1e-9), 1),
        "bleu_signature": scores["bleu_signature"],
        "chrf_signature": scores["chrf_signature"],
        "translations": translations,
    }
