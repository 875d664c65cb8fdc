"""The translation board: the notes' claims about attention in sequence to sequence, and GQA uptraining in the
encoder-decoder setting of Ainslie et al. 2023, measured through the training path with seeds and noise.

Corpus: English -> Spanish verse pairs of the Bible (`--data_dir`, a `pairs.tsv` with columns ref, en, es), split by
book: validation `--validation_books` (Mark), test `--test_books` (Luke, Acts), training every other book, so no verse
of a held-out book is trained on. One byte-level BPE of `--vocab_size`, trained once on the training books' English
and Spanish together and kept in `<output_dir>/tokenizer` (a resumed board tokenizes as it began). Training pairs
whose source or target is longer than `--max_length` tokens are dropped (the board states how many); the test sample
is `--test_pairs` verses of the test books drawn once with a fixed seed among those that fit.

A *cell* is one (family, configuration, seed), each a run of the package's training path (`hf-attn-zoo train`'s
`run_training`) on `--budget` source + target tokens of the board's pairs, tokenized by the board's BPE, under its
family's recipe: `--recipe` (the Transformer's hour recipe: token-count batches, label smoothing, dropout, its
optimizer and Marian's layer) for the Transformer, native and encoder cells, `--rnn_recipe` for the RNNs; the warm-up
is `--warmup_fraction` of a cell's steps, then the recipe's decay; the board scores the final model. The runs train
and save under `--cells_dir` (default `<output_dir>/cells`, not committed):
- `rnn`: the GRU encoder-decoder (`zoo_rnn`) without attention, with Bahdanau's and with Luong's attention;
- `transformer`: the zoo encoder-decoder with MHA, GQA and MQA (the decoder's self- and cross-attention pooled to
  `--gqa_key_value_heads` / one key/value head, the encoder multi-head, as the paper's T5) and with Bahdanau's
  additive cross-attention;
- `native`: transformers' own `MarianMTModel` of the MHA Transformer's sizes (post-norm, scaled tokens, sinusoids,
  biases; its SiLU MLP's width matched), the control the zoo's encoder-decoder is held to at equal steps;
- `encoder`: the variants with a bidirectional form as whole encoder-decoders (the zoo builds both stacks from one
  variant: the encoder its bidirectional form, the decoder its causal form) under MHA cross-attention;
- `parent` and `uptrain`: an MHA parent trained on `--parent_factor` budgets (one seed), converted by every
  `--uptrain_methods` to GQA and MQA in the decoder's self- and cross-attention (the recipe's
  `convert.num_key_value_heads`, calibrated methods fitted on the first `--calibration_pairs` training pairs), then
  uptrained on `--alphas` of the parent's tokens (`convert.uptrain_fraction`; alpha 0: the conversion alone,
  deterministic, one cell).
Parameters are matched within 1% of the MHA transformer's (total, the shared embedding counted once): a
transformer's (and Marian's) MLP width, an RNN's state size solved for it.

Per cell (one JSON row in `<output_dir>/board.json`, written the moment the cell ends): test BLEU and chrF (greedy
and beam search of `--num_beams`; uptraining cells greedy), greedy BLEU by source-length bucket, the test
references' perplexity, the validation references' perplexity, training tokens/s and wall time, greedy decode
tokens/s, and the cross-attention cache bytes per source token (measured on the cache `generate()` returns). A rerun
skips finished cells, retries failed ones and refuses other defining options. board.md (tables, the claims with
their verdicts) and the plots are rewritten after every cell; "A beats B" only where the seeds' ranges do not
overlap.

    python -m experiments translation [--seeds 0 1 2] [--budget 2000000] [--output_dir DIR]

This module runs the board (corpus, models, training, scoring through `hf_attn_zoo.evaluation.translation`, the loop
over cells); cells.py holds its options and cells, claims.py the verdicts, report.py the tables and figures.
"""

import csv
import functools
import json
import random
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, MarianMTModel
from transformers.cache_utils import EncoderDecoderCache

from experiments.common import Benchmark, Board, claim, main
from experiments.speed.scaling import cache_nbytes
from experiments.translation.cells import Cell, TranslationSetup, bucket_names, bucket_of, plan
from experiments.translation.native import marian_config
from experiments.translation.report import board_figures, write_board
from hf_attn_zoo.data import train_byte_level_bpe
from hf_attn_zoo.errors import one_line
from hf_attn_zoo.evaluation.attention_maps import cross_attention_map
from hf_attn_zoo.evaluation.translation import (
    generate_translations,
    reference_perplexity,
    translation_metric,
)
from hf_attn_zoo.models import SEQ2SEQ
from hf_attn_zoo.models.compat_zoo import CACHE_KWARG
from hf_attn_zoo.pairs import seq2seq_tokenizer
from hf_attn_zoo.train import load_recipe, run_training
from hf_attn_zoo.train.batching import TokenBatchSampler

BOOK = re.compile(r"^(.*) \d+:\d+$")  # "1 John 3:16" -> "1 John"
MLP_MULTIPLE = 8
MATCH_TOLERANCE = 0.01


# ---------------------------------------------------------------------------------------------------------------
# The corpus


@dataclass
class Corpus:
    tokenizer: object
    train: list[tuple[list[int], list[int]]]  # token ids of (source, target), both ending in EOS
    dropped: int  # training pairs beyond --max_length
    test: list[tuple[str, str]]  # the scored sample, (English, Spanish)
    test_lengths: list[int]  # source tokens of each test pair
    validation: list[tuple[str, str]]


def read_books(data_dir: str) -> list[tuple[str, str, str]]:
    """(book, English, Spanish) of every verse of `<data_dir>/pairs.tsv`."""
    path = Path(data_dir) / "pairs.tsv"
    if not path.is_file():
        raise SystemExit(f"no {path}: link or build the Bible corpus there (docs/translation.md)")
    verses = []
    with path.open(encoding="utf-8", newline="") as handle:
        for row in csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE):
            match = BOOK.match(row["ref"])
            if match is None:
                raise SystemExit(f"{path}: reference {row['ref']!r} is not 'Book chapter:verse'")
            verses.append((match.group(1), row["en"], row["es"]))
    return verses


def split_books(verses: list[tuple[str, str, str]], setup: TranslationSetup) -> dict[str, list[tuple[str, str]]]:
    known = {book for book, _, _ in verses}
    unknown = sorted(set(setup.validation_books + setup.test_books) - known)
    if unknown:
        raise SystemExit(f"books {unknown} are not in the corpus (it has {sorted(known)[:6]} ...)")
    splits = {"train": [], "validation": [], "test": []}
    for book, english, spanish in verses:
        split = "test" if book in setup.test_books else "validation" if book in setup.validation_books else "train"
        splits[split].append((english, spanish))
    return splits


def board_tokenizer(setup: TranslationSetup, train: list[tuple[str, str]]):
    """The board's one BPE, trained on the training books' both sides once and kept in the output folder."""
    folder = Path(setup.output_dir) / "tokenizer"
    if not folder.is_dir():
        texts = [text for pair in train for text in pair]
        train_byte_level_bpe(texts, setup.vocab_size).save_pretrained(folder)
    return seq2seq_tokenizer(AutoTokenizer.from_pretrained(folder))


def load_corpus(setup: TranslationSetup) -> Corpus:
    splits = split_books(read_books(setup.data_dir), setup)
    tokenizer = board_tokenizer(setup, splits["train"])
    encoded = []
    for english, spanish in splits["train"]:
        source, target = tokenizer(english)["input_ids"], tokenizer(spanish)["input_ids"]
        if len(source) <= setup.max_length and len(target) <= setup.max_length:
            encoded.append((source, target))

    def sample(pairs: list[tuple[str, str]], count: int, seed: int) -> list[tuple[str, str]]:
        fitting = [
            pair
            for pair in pairs
            if max(len(tokenizer(pair[0])["input_ids"]), len(tokenizer(pair[1])["input_ids"])) <= setup.max_length
        ]
        return random.Random(seed).sample(fitting, min(count, len(fitting)))

    test = sample(splits["test"], setup.test_pairs, 0)
    return Corpus(
        tokenizer=tokenizer,
        train=encoded,
        dropped=len(splits["train"]) - len(encoded),
        test=test,
        test_lengths=[len(tokenizer(english)["input_ids"]) for english, _ in test],
        validation=sample(splits["validation"], setup.validation_pairs, 1),
    )


# ---------------------------------------------------------------------------------------------------------------
# Models and matched parameters


def special_tokens(tokenizer) -> dict:
    return {
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "decoder_start_token_id": tokenizer.bos_token_id,
    }


def recipe_model(recipe: str) -> tuple[str | None, dict]:
    """(preset size, config fields) of a recipe's model section, as its run builds the model: the layout every cell
    of its family is built with."""
    size, fields = _recipe_model(recipe)
    return size, dict(fields)


@functools.cache
def _recipe_model(recipe: str) -> tuple[str | None, dict]:
    model_args, _, _ = load_recipe(recipe)
    return model_args.size or None, model_args.config_fields()


def transformer_spec(setup: TranslationSetup, family: str, config: str, tokens: dict) -> tuple[str, dict]:
    """(variant, config fields before the MLP is matched) of a Transformer cell: the Transformer recipe's layout
    (`--recipe`'s model config) at the board's sizes."""
    heads, layers = setup.num_attention_heads, setup.num_layers
    _, layout = recipe_model(setup.recipe_path)
    fields = {
        **layout,
        **tokens,
        "is_encoder_decoder": True,
        "hidden_size": setup.hidden_size,
        "num_hidden_layers": layers,
        "encoder_layers": layers,
        "decoder_layers": layers,
        "num_attention_heads": heads,
        "max_position_embeddings": setup.max_length + 1,  # a target of max_length behind the start token
        "tie_word_embeddings": True,
    }
    fields.pop("intermediate_size", None)  # matched per cell
    if family == "encoder":
        variant = config
        defaults = SEQ2SEQ[variant].config_class()
        fields |= {name: value for name, value in setup.extra_fields().items() if hasattr(defaults, name)}
        if getattr(defaults, "num_attention_heads", None) == 1:
            # AFT mixes channel by channel and refuses heads: its config (and so its cross-attention) has one head
            del fields["num_attention_heads"]
        elif hasattr(defaults, "num_key_value_heads"):
            fields["num_key_value_heads"] = heads  # multi-head projections, as the MHA cell's
        return variant, fields
    groups = {"gqa": setup.gqa_key_value_heads, "mqa": 1}.get(config)
    if groups is not None:  # the paper's layout: decoder self- and cross-attention pooled, the encoder multi-head
        return "gqa", fields | {
            "num_key_value_heads": groups,
            "cross_attention_num_key_value_heads": groups,
            "encoder_num_key_value_heads": heads,
        }
    if config == "additive":
        return "mha", fields | {"cross_attention": "additive"}
    if config == "mha":
        return "mha", fields
    raise SystemExit(f"unknown Transformer cell {config!r}: use mha, gqa, mqa or additive")


def parameter_count(variant: str, fields: dict, size: str | None) -> int:
    """Parameters of a model of `fields` (over preset `size`), counted on the meta device (nothing allocated; tied
    weights once)."""
    with torch.device("meta"):
        model = instantiate(variant, fields, size)
    return sum(p.numel() for p in model.parameters())


def instantiate(variant: str, fields: dict, size: str | None):
    """A fresh model: a zoo encoder-decoder of `variant` (over preset `size`, as the recipe's run builds it), or
    (`marian`) the native control, whose fields are the MHA Transformer's with Marian's MLP width (`marian_ffn`)."""
    if variant == "marian":
        zoo = SEQ2SEQ["mha"].config(size, **{k: v for k, v in fields.items() if k != "marian_ffn"})
        return MarianMTModel(marian_config(zoo, fields["marian_ffn"], fields["max_position_embeddings"]))
    return SEQ2SEQ[variant].build(size, **fields)


def match_marian(fields: dict, target: int, size: str | None) -> tuple[dict, int]:
    """The MHA Transformer's `fields` with the Marian MLP width (a multiple of 8) whose parameter count is nearest
    `target` (linear in it), starting from 1.5 times the zoo's gated width (as many MLP weights)."""
    start = 3 * SEQ2SEQ["mha"].config(size, **fields).intermediate_size // 2
    at_start = parameter_count("marian", {**fields, "marian_ffn": start}, size)
    per_unit = (parameter_count("marian", {**fields, "marian_ffn": start + 64}, size) - at_start) / 64
    width = max(MLP_MULTIPLE, round((start + (target - at_start) / per_unit) / MLP_MULTIPLE) * MLP_MULTIPLE)
    matched = {**fields, "marian_ffn": width}
    return matched, parameter_count("marian", matched, size)


def rnn_fields(setup: TranslationSetup, attention: str, tokens: dict, state: int) -> dict:
    """The RNN recipe's config fields (`--rnn_recipe`) with the board's width, the attention and the state size."""
    _, fields = recipe_model(setup.rnn_recipe_path)
    return {**fields, **tokens, "hidden_size": setup.hidden_size, "rnn_hidden_size": state, "attention": attention}


def match_rnn(setup: TranslationSetup, attention: str, tokens: dict, target: int) -> tuple[dict, int]:
    """The RNN's fields with the state size whose parameter count is nearest `target` (bisection: the count grows
    with it)."""
    size, _ = recipe_model(setup.rnn_recipe_path)

    def count(state: int) -> int:
        return parameter_count("rnn", rnn_fields(setup, attention, tokens, state), size)

    low, high = 1, 16 * setup.hidden_size
    while high - low > 1:
        middle = (low + high) // 2
        if count(middle) < target:
            low = middle
        else:
            high = middle
    state = min((low, high), key=lambda n: abs(count(n) - target))
    return rnn_fields(setup, attention, tokens, state), count(state)


def match_mlp(variant: str, fields: dict, target: int, size: str | None) -> tuple[dict, int]:
    """`fields` with the MLP width (a multiple of 8) whose parameter count is nearest `target` (linear in it)."""
    start = SEQ2SEQ[variant].config(size, **fields).intermediate_size
    at_start = parameter_count(variant, {**fields, "intermediate_size": start}, size)
    per_unit = (parameter_count(variant, {**fields, "intermediate_size": start + 64}, size) - at_start) / 64
    width = max(MLP_MULTIPLE, round((start + (target - at_start) / per_unit) / MLP_MULTIPLE) * MLP_MULTIPLE)
    matched = {**fields, "intermediate_size": width}
    return matched, parameter_count(variant, matched, size)


def cell_spec(setup: TranslationSetup, cell: Cell, tokens: dict) -> tuple[str, dict, int, int]:
    """(variant, config fields, parameters, the MHA Transformer's parameters they match) of a cell; `ValueError`
    where no width gets within 1%."""
    size, _ = recipe_model(setup.recipe_path)
    reference_variant, reference = transformer_spec(setup, "transformer", "mha", tokens)
    target = parameter_count(reference_variant, reference, size)
    if cell.family == "rnn":
        variant, (fields, count) = "rnn", match_rnn(setup, cell.config, tokens, target)
    elif cell.family == "native":
        variant, (fields, count) = cell.config, match_marian(reference, target, size)
    elif cell.family in ("parent", "uptrain"):
        variant, fields, count = reference_variant, reference, target  # conversions keep the parent's MLP
    else:
        variant, fields = transformer_spec(setup, cell.family, cell.config, tokens)
        fields, count = match_mlp(variant, fields, target, size)
    if cell.family != "uptrain" and abs(count / target - 1) > MATCH_TOLERANCE:
        raise ValueError(f"{cell.config}: {count:,} parameters, more than 1% from the MHA Transformer's {target:,}")
    return variant, fields, count, target


# ---------------------------------------------------------------------------------------------------------------
# Training: every cell is a run of the package's training path (`hf_attn_zoo.train.run_training`)


def cell_folder(setup: TranslationSetup, cell: Cell) -> Path:
    """Where a cell's run trains and saves its model (`final`): under `--cells_dir`, never the results folder."""
    return Path(setup.cells_dir or Path(setup.output_dir) / "cells") / cell.name


def tokens_per_step(corpus: Corpus, recipe: str) -> float:
    """Real source + target tokens a step of `recipe`'s batches reads on the board's training pairs, as the training
    path counts them: token-count batches over length buckets (`training.batch_tokens`), or a number of pairs."""
    _, _, training = load_recipe(recipe)
    sources, targets = [len(s) for s, _ in corpus.train], [len(t) for _, t in corpus.train]
    if training.batch_tokens:
        return TokenBatchSampler(sources, targets, training.batch_tokens, seed=training.seed).mean_batch_tokens()
    return training.per_device_train_batch_size * statistics.fmean(s + t for s, t in zip(sources, targets))


def steps_for(tokens: float, corpus: Corpus, recipe: str) -> int:
    return max(1, round(tokens / tokens_per_step(corpus, recipe)))


def run_arguments(setup: TranslationSetup, cell: Cell, recipe: str, folder: Path, steps: int) -> list[str]:
    """The command-line overrides that make `recipe` train one cell: the board's data, split and tokenizer, `steps`
    steps with the warm-up a fraction of them, the cell's seed, no evaluation or checkpoint during the run (the
    board scores the final model), on `--device`."""
    corpus_file = str(Path(setup.data_dir) / "pairs.tsv")
    return [
        *("--model.task", "seq2seq"),
        *("--data.train_files", corpus_file, "--data.source_field", "en", "--data.target_field", "es"),
        *("--data.split_by", "ref", "--data.split_pattern", BOOK.pattern),
        *("--data.validation_groups", *setup.validation_books, "--data.test_groups", *setup.test_books),
        *("--data.tokenizer", str(Path(setup.output_dir) / "tokenizer")),
        *("--data.max_source_length", str(setup.max_length), "--data.max_target_length", str(setup.max_length)),
        *("--data.long_pairs", "drop"),
        *("--training.output_dir", str(folder), "--training.max_steps", str(steps)),
        *("--training.warmup_steps", str(max(1, round(setup.warmup_fraction * steps)))),
        *("--training.eval_strategy", "no", "--training.save_strategy", "no", "--training.average_checkpoints", "1"),
        *("--training.logging_steps", str(max(1, steps // 20)), "--training.seed", str(cell.seed)),
        *("--training.report_to", "none", "--training.use_cpu", str(setup.device == "cpu").lower()),
    ]


def train_cell(setup: TranslationSetup, cell: Cell, recipe: str, steps: int, model_args: list[str]) -> dict:
    """Train one cell through the training path; what its summary says of the run."""
    folder = cell_folder(setup, cell)
    arguments = [*model_args, *run_arguments(setup, cell, recipe, folder, steps)]
    start = time.perf_counter()
    summary = run_training(*load_recipe(recipe, arguments))
    run_seconds = time.perf_counter() - start  # data, model (and conversion), training, the run's own evaluation
    losses = summary["losses"]
    tail = losses[-max(1, len(losses) // 10) :]
    return {
        "steps": summary["steps"],
        "train_tokens": summary["train_tokens"],
        "train_seconds": summary["seconds"],
        "tokens_per_second": summary["tokens_per_second"],
        "final_loss": round(statistics.fmean(tail), 4) if tail else None,
        "validation_bleu_full": summary["validation_bleu"],  # greedy, every verse of the validation books
        "run_seconds": round(run_seconds, 1),
        **({"transfer": transfer_report(summary["attention_transfer"])} if "attention_transfer" in summary else {}),
    }


def transfer_report(transfer: dict) -> dict:
    """What a row keeps of a run's attention transfer: its tokens and seconds, and the decoder modules' mean error
    relative to the parent's output before and after it."""
    return {key: transfer[key] for key in ("tokens", "seconds", "relative_error_before", "relative_error_after")}


def trained(setup: TranslationSetup, cell: Cell):
    """The final model a cell's run saved, on `--device`, for scoring."""
    final = cell_folder(setup, cell) / "final"
    return AutoModelForSeq2SeqLM.from_pretrained(final).to(setup.device).eval()


# ---------------------------------------------------------------------------------------------------------------
# Evaluation


def bleu_chrf(translations: list[str], references: list[str]) -> tuple[float, float]:
    """Corpus BLEU and chrF (0-100) through the package's metric (sacrebleu underneath); 0 for no translations (an
    empty length bucket)."""
    if not translations:
        return 0.0, 0.0
    scores = translation_metric().compute(predictions=translations, references=references)
    return round(scores["bleu"], 3), round(scores["chrf"], 3)


def translate(model, tokenizer, sources: list[str], num_beams: int, max_new_tokens: int) -> tuple[list[str], int]:
    """Translations (greedy or beam search) and the tokens generated, in batches of sources of similar length."""
    size = 50 if num_beams == 1 else 25
    out = generate_translations(model, tokenizer, sources, num_beams, max_new_tokens, batch_size=size, by_length=True)
    return out.texts, out.generated_tokens


def perplexity(model, tokenizer, pairs: list[tuple[str, str]]) -> float:
    """The references' corpus perplexity given their sources, rounded as the board stores it."""
    value, _ = reference_perplexity(model, tokenizer, [s for s, _ in pairs], [t for _, t in pairs], batch_size=50)
    return round(value, 3)


@torch.no_grad()
def cross_cache_bytes(model, setup: TranslationSetup) -> float:
    """Bytes per source token of what the decoder keeps of the source while it decodes, measured on the cache a
    greedy `generate()` returns: a Transformer's cross-attention keys and values (`cross_attention_cache`); an RNN's
    encoder outputs and projected keys where it attends (its cache's `memory` and `keys`), nothing without attention
    (the decoder reads the bridged final state alone)."""
    source_length, rows = setup.max_length, 2
    config = model.config
    source = torch.randint(3, config.vocab_size, (rows, source_length), generator=torch.Generator().manual_seed(2))
    out = model.generate(
        source.to(model.device),
        max_length=3,  # the start token and two new ones, said as the saved generation config says its limit
        min_length=3,
        do_sample=False,
        num_beams=1,
        return_dict_in_generate=True,
    )
    cache = getattr(out, CACHE_KWARG)
    if isinstance(cache, EncoderDecoderCache):
        return cache_nbytes(cache.cross_attention_cache) / (rows * source_length)
    if config.attention == "none":
        return 0.0
    state = cache.layers[0].state  # the RNN cache's one state layer: memory (B, S, E), keys (B, S, A), ...
    held = [state.get(name) for name in ("memory", "keys")]
    return sum(t.numel() * t.element_size() for t in held if t is not None) / (rows * source_length)


def alignment(model, tokenizer, corpus: Corpus, setup: TranslationSetup) -> list[dict]:
    """The last decoder layer's cross-attention (mean over heads) of the shortest test verses of 8-20 source tokens,
    as the model translates them greedily."""
    candidates = sorted(
        (length, english)
        for english, length in zip((e for e, _ in corpus.test), corpus.test_lengths)
        if 8 <= length <= 20
    )
    maps = []
    for _, english in candidates[: setup.alignment_verses]:
        sources, targets, weights = cross_attention_map(model, tokenizer, english, layer=-1)
        maps.append(
            {
                "source": sources,
                "target": targets,
                "weights": [[round(w, 3) for w in row] for row in weights.mean(0).tolist()],  # (T, S)
            }
        )
    return maps


def evaluate(model, corpus: Corpus, setup: TranslationSetup, beams: bool) -> dict:
    tokenizer = corpus.tokenizer
    sources, references = [s for s, _ in corpus.test], [t for _, t in corpus.test]
    start = time.perf_counter()
    greedy, generated = translate(model, tokenizer, sources, 1, setup.max_length)
    decode_seconds = time.perf_counter() - start
    row = {"test_pairs": len(sources)}
    row["bleu"], row["chrf"] = bleu_chrf(greedy, references)
    row["decode_tokens_per_second"] = round(generated / max(decode_seconds, 1e-9), 1)
    row["bleu_by_length"] = {}
    for name in bucket_names(setup.buckets):
        chosen = [i for i, length in enumerate(corpus.test_lengths) if bucket_of(length, setup.buckets) == name]
        row["bleu_by_length"][name] = {
            "pairs": len(chosen),
            "bleu": bleu_chrf([greedy[i] for i in chosen], [references[i] for i in chosen])[0],
        }
    if beams:
        beam, _ = translate(model, tokenizer, sources, setup.num_beams, setup.max_length)
        row["bleu_beam"], row["chrf_beam"] = bleu_chrf(beam, references)
    row["test_perplexity"] = perplexity(model, tokenizer, corpus.test)
    row["validation_perplexity"] = perplexity(model, tokenizer, corpus.validation)
    row["cache_bytes_per_source_token"] = cross_cache_bytes(model, setup)
    row["examples"] = [{"source": sources[i], "reference": references[i], "greedy": greedy[i]} for i in range(2)]
    return row


# ---------------------------------------------------------------------------------------------------------------
# Cells


def parent_cell(setup: TranslationSetup) -> Cell:
    return Cell("parent", "mha", setup.seeds[0])


def model_arguments(setup: TranslationSetup, cell: Cell, variant: str, fields: dict) -> tuple[str, list[str]]:
    """(the recipe a cell trains by, the model overrides that build it): the RNN recipe for RNNs, the Transformer
    recipe for the rest; a fresh model of `variant` and `fields` over the recipe's own config, or, for the native
    control, the fresh `MarianMTModel` written first into the cell's folder (`init`) for `model.init_from`."""
    recipe, rnn_recipe = setup.recipe_path, setup.rnn_recipe_path
    if cell.family == "rnn":
        return rnn_recipe, ["--model.variant", "rnn", "--model.config", json.dumps(fields)]
    if cell.family == "native":
        init = cell_folder(setup, cell) / "init"
        torch.manual_seed(cell.seed)
        instantiate(variant, fields, recipe_model(setup.recipe_path)[0]).save_pretrained(init)
        AutoTokenizer.from_pretrained(Path(setup.output_dir) / "tokenizer").save_pretrained(init)
        return recipe, ["--model.init_from", str(init)]
    return recipe, ["--model.variant", variant, "--model.config", json.dumps(fields)]


def train_parent(setup: TranslationSetup, corpus: Corpus, tokens: dict) -> dict:
    """Train the uptraining cells' MHA parent (`--parent_factor` budgets, the first seed) into its cell folder."""
    cell = parent_cell(setup)
    variant, fields, _, _ = cell_spec(setup, cell, tokens)
    recipe, model_args = model_arguments(setup, cell, variant, fields)
    return train_cell(setup, cell, recipe, steps_for(setup.parent_factor * setup.budget, corpus, recipe), model_args)


def run_cell(setup: TranslationSetup, cell: Cell, corpus: Corpus) -> dict:
    began = time.perf_counter()
    tokens = special_tokens(corpus.tokenizer)
    variant, fields, count, target = cell_spec(setup, cell, tokens)
    row = {
        "cell": cell.name,
        "family": cell.family,
        "config": cell.config,
        "seed": cell.seed,
        "variant": variant,
        "parameters": count,
        "matched_to": target,
        "train_pairs": len(corpus.train),
        "dropped_pairs": corpus.dropped,
    }
    if cell.family == "rnn":
        row["rnn_hidden_size"] = fields["rnn_hidden_size"]
    elif cell.family == "native":
        row["intermediate_size"] = fields["marian_ffn"]
    else:
        row["intermediate_size"] = fields.get("intermediate_size")
    if cell.family == "uptrain":
        # the parent's run converted (convert.num_key_value_heads, fitted on the first training pairs where the
        # method is calibrated) and uptrained for alpha of the parent's tokens, all in the training path
        target_kind, method, alpha = cell.config.split("-")
        method, _, repair = method.partition("+")
        alpha, repair = float(alpha), repair or "ce"
        groups = setup.gqa_key_value_heads if target_kind == "gqa" else 1
        parent = cell_folder(setup, parent_cell(setup)) / "final"
        with claim(Path(setup.output_dir), parent_cell(setup).name, wait=True):  # another process may be training it
            if not parent.is_dir():
                # its row is in board.json but its checkpoint is not (checkpoints are not committed: a board resumed
                # in another clone): the same run again, the seed and data order the same
                train_parent(setup, corpus, tokens)
        calibration = sum(len(s) + len(t) for s, t in corpus.train[: setup.calibration_pairs])
        model_args = ["--model.init_from", str(parent), "--convert.num_key_value_heads", str(groups)]
        model_args += ["--convert.method", method, "--convert.calibration_tokens", str(calibration)]
        parent_summary = json.loads((parent / "training_summary.json").read_text())
        if repair == "ce":
            model_args += ["--convert.uptrain_fraction", str(alpha)]
        else:  # alpha of the parent's tokens read by the transfer; as many again by the distillation after it
            model_args += ["--convert.transfer_tokens", str(round(alpha * parent_summary["train_tokens"]))]
            if repair == "transfer":
                model_args += ["--convert.uptrain_fraction", "0"]
            else:
                model_args += ["--convert.uptrain_fraction", str(alpha), "--convert.distill", "true"]
                model_args += ["--convert.temperature", str(setup.distill_temperature)]
        model_args += ["--training.learning_rate", str(setup.uptrain_learning_rate)]
        parent_steps = parent_summary["steps"]
        steps = max(1, round(alpha * parent_steps))  # for the warm-up; the fraction sets the run's own steps
        shown = method if repair == "ce" else f"{method}+{repair}"
        row |= {"target": target_kind, "method": shown, "repair": repair, "alpha": alpha, "key_value_heads": groups}
        row |= train_cell(setup, cell, setup.recipe_path, steps, model_args)
        model = trained(setup, cell)
        row["parameters"] = sum(p.numel() for p in model.parameters())
        row |= evaluate(model, corpus, setup, beams=False)
    else:
        if cell.family == "parent":
            row |= train_parent(setup, corpus, tokens)
        else:
            recipe, model_args = model_arguments(setup, cell, variant, fields)
            row |= train_cell(setup, cell, recipe, steps_for(setup.budget, corpus, recipe), model_args)
        model = trained(setup, cell)
        row |= evaluate(model, corpus, setup, beams=True)
        drawn = {("rnn", "bahdanau"), ("rnn", "luong"), ("transformer", "mha")}
        if cell.seed == setup.seeds[0] and (cell.family, cell.config) in drawn:
            row["alignment"] = alignment(model, corpus.tokenizer, corpus, setup)
    row["cell_seconds"] = round(time.perf_counter() - began, 1)
    return row


def run_board(setup: TranslationSetup, log: Callable[[str], None] = print) -> list[dict]:
    torch.set_num_threads(setup.threads)
    board = Board(setup)
    cells = plan(setup)
    corpus = load_corpus(setup)
    log(
        f"{len(corpus.train):,} training pairs ({corpus.dropped:,} beyond {setup.max_length} tokens dropped), "
        f"{len(corpus.test)} test and {len(corpus.validation)} validation verses scored"
    )
    tokens = special_tokens(corpus.tokenizer)
    log(f"{'cell':28s} {'parameters':>12s} (against the MHA Transformer's)")
    matched = ("rnn", "transformer", "native", "encoder")
    for cell in {(c.family, c.config): c for c in cells if c.family in matched}.values():
        try:  # an unmatchable board is refused at once
            _, _, count, target = cell_spec(setup, cell, tokens)
        except ValueError as error:
            raise SystemExit(one_line(error)) from None
        log(f"{cell.family + '-' + cell.config:28s} {count:12,d} ({count / target - 1:+.2%})")
    board.run(
        cells,
        run=lambda cell: run_cell(setup, cell, corpus),
        keys=lambda cell: {"family": cell.family, "config": cell.config, "seed": cell.seed},
        done=lambda row: f"BLEU {row['bleu']:.2f}, {row['cell_seconds'] / 60:.1f} min",
        write=lambda rows: write_board(setup, rows, log=lambda _: None),
        desc="translation board",
        log=log,
    )
    board.refresh()  # rows other processes of this board recorded after this one's last cell
    write_board(setup, board.rows, log=log)
    return board.rows


BENCHMARKS = {"translation": Benchmark(TranslationSetup, run_board, figures=board_figures, results="board")}

if __name__ == "__main__":
    sys.exit(main(BENCHMARKS))
