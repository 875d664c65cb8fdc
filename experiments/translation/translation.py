"""The translation board: the notes' claims about attention in sequence to sequence, and GQA uptraining in the
encoder-decoder setting of Ainslie et al. 2023, measured under one recipe with seeds and noise.

Corpus: English -> Spanish verse pairs of the Bible (`--data_dir`, a `pairs.tsv` with columns ref, en, es), split by
book: validation `--validation_books` (Mark), test `--test_books` (Luke, Acts), training every other book, so no verse
of a held-out book is trained on. One byte-level BPE of `--vocab_size`, trained once on the training books' English
and Spanish together and kept in `<output_dir>/tokenizer` (a resumed board tokenizes as it began). Training pairs
whose source or target is longer than `--max_length` tokens are dropped (the board states how many); the test sample
is `--test_pairs` verses of the test books drawn once with a fixed seed among those that fit.

A *cell* is one (family, configuration, seed), each trained on `--budget` source + target tokens by one recipe
(AdamW, linear warm-up then cosine decay, batches of `--batch_size` pairs of similar length):
- `rnn`: the GRU encoder-decoder (`zoo_rnn`) without attention, with Bahdanau's and with Luong's attention;
- `transformer`: the zoo encoder-decoder with MHA, GQA and MQA (the decoder's self- and cross-attention pooled to
  `--gqa_key_value_heads` / one key/value head, the encoder multi-head, as the paper's T5) and with Bahdanau's
  additive cross-attention;
- `encoder`: the variants with a bidirectional form as whole encoder-decoders (the zoo builds both stacks from one
  variant: the encoder its bidirectional form, the decoder its causal form) under MHA cross-attention;
- `parent` and `uptrain`: an MHA parent trained on `--parent_factor` budgets (one seed), converted by every
  `--uptrain_methods` to GQA and MQA in the decoder's self- and cross-attention (`seq2seq_mha_to_gqa`), then
  uptrained on `--alphas` of the parent's steps (alpha 0: the conversion alone, deterministic, one cell).
Parameters are matched within 1% of the MHA transformer's (total, the shared embedding counted once): a
transformer's MLP width, an RNN's state size solved for it.

Per cell (one JSON row in `<output_dir>/board.json`, written the moment the cell ends): test BLEU and chrF (greedy
and beam search of `--num_beams`; uptraining cells greedy), greedy BLEU by source-length bucket, the test
references' perplexity, the validation references' perplexity, training tokens/s and wall time, greedy decode
tokens/s, and the cross-attention cache bytes per source token (measured on the cache `generate()` returns). A rerun
skips finished cells, retries failed ones and refuses other defining options. board.md (tables, the claims with
their verdicts) and the plots are rewritten after every cell; "A beats B" only where the seeds' ranges do not
overlap.

    python -m experiments translation [--seeds 0 1 2] [--budget 300000] [--hidden_size 128]
"""

import csv
import math
import random
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoTokenizer
from transformers.cache_utils import EncoderDecoderCache

from experiments.common import (
    REPOSITORY,
    Board,
    Results,
    compare_seeds,
    config_fields,
    draw_figures,
    figure,
    main,
    mean_spread,
)
from experiments.common import Benchmark as Study
from experiments.speed.scaling import cache_nbytes
from hf_attn_zoo.convert.calibrated import CALIBRATION_METHODS
from hf_attn_zoo.convert.pooling import seq2seq_mha_to_gqa
from hf_attn_zoo.data import train_byte_level_bpe
from hf_attn_zoo.errors import one_line
from hf_attn_zoo.evaluation.attention_maps import cross_attention_map
from hf_attn_zoo.evaluation.plotting import colour, headless_pyplot, house_style, place_labels, save_figure
from hf_attn_zoo.evaluation.translation import reference_nll
from hf_attn_zoo.models import SEQ2SEQ
from hf_attn_zoo.models.compat_zoo import CACHE_KWARG
from hf_attn_zoo.pairs import seq2seq_tokenizer

STUDY = Path(__file__).resolve().parent
DOCS = REPOSITORY / "docs" / "translation.md"
README = REPOSITORY / "README.md"
README_ROW = "| How much does attention help a small translator? |"
BOOK = re.compile(r"^(.*) \d+:\d+$")  # "1 John 3:16" -> "1 John"
MLP_MULTIPLE = 8
MATCH_TOLERANCE = 0.01
MARKERS = ("<!-- translation board verdicts: begin -->", "<!-- translation board verdicts: end -->")


@dataclass
class TranslationSetup(Results):
    """English -> Spanish translators under one recipe: RNNs with and without attention, Transformer cross- and
    self-attention variants, and GQA/MQA uptraining of an MHA encoder-decoder; quality, cache and speed over seeds."""

    output_dir: str = field(default=str(STUDY / "results"), metadata={"help": "board.json, board.md, plots"})
    data_dir: str = field(
        default=str(REPOSITORY / "data" / "bible_en_es"), metadata={"help": "folder of pairs.tsv (ref, en, es)"}
    )
    validation_books: list[str] = field(default_factory=lambda: ["Mark"], metadata={"help": "validation books"})
    test_books: list[str] = field(default_factory=lambda: ["Luke", "Acts"], metadata={"help": "test books"})
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2], metadata={"help": "one cell per seed"})
    rnns: list[str] = field(
        default_factory=lambda: ["none", "bahdanau", "luong"], metadata={"help": "attention of the RNN cells"}
    )
    cross_attentions: list[str] = field(
        default_factory=lambda: ["mha", "gqa", "mqa", "additive"],
        metadata={"help": "Transformer cells: mha, gqa, mqa (decoder self + cross pooled), additive cross-attention"},
    )
    encoders: list[str] = field(
        default_factory=lambda: ["sliding_window", "linformer", "aft_simple", "topk"],
        metadata={"help": "variants trained as whole encoder-decoders under MHA cross-attention"},
    )
    uptrain_methods: list[str] = field(
        default_factory=lambda: ["mean", *CALIBRATION_METHODS], metadata={"help": "MHA -> GQA/MQA conversions"}
    )
    alphas: list[float] = field(
        default_factory=lambda: [0.0, 0.05], metadata={"help": "uptraining steps as a fraction of the parent's"}
    )
    budget: int = field(default=300_000, metadata={"help": "training tokens (source + target) per cell"})
    hidden_size: int = field(default=128, metadata={"help": "width of every model (the RNN's embedding)"})
    num_layers: int = field(default=2, metadata={"help": "encoder layers and decoder layers of a Transformer"})
    num_attention_heads: int = field(default=4, metadata={"help": "query heads of every Transformer"})
    gqa_key_value_heads: int = field(default=2, metadata={"help": "key/value heads of GQA (decoder)"})
    vocab_size: int = field(default=4000, metadata={"help": "the shared BPE's vocabulary"})
    max_length: int = field(default=64, metadata={"help": "longest source / target in tokens (longer pairs dropped)"})
    batch_size: int = field(default=16, metadata={"help": "pairs per step"})
    learning_rate: float = field(default=2e-3, metadata={"help": "peak learning rate of every cell"})
    warmup_fraction: float = field(default=0.05, metadata={"help": "warm-up steps as a fraction of a run's"})
    uptrain_learning_rate: float = field(
        default=5e-4, metadata={"help": "peak learning rate of the uptraining runs (short: a lower peak)"}
    )
    fields: str = field(
        default='{"sliding_window": 16, "linformer_k": 16, "topk": 16}',
        metadata={"help": "JSON config fields for every Transformer whose config has them"},
    )
    test_pairs: int = field(default=300, metadata={"help": "verses of the test books scored"})
    validation_pairs: int = field(default=200, metadata={"help": "verses of the validation books scored"})
    num_beams: int = field(default=4, metadata={"help": "beam width of the beam-search scores"})
    buckets: list[int] = field(
        default_factory=lambda: [16, 24, 32, 64], metadata={"help": "upper edges of the source-length buckets"}
    )
    parent_factor: float = field(default=3.0, metadata={"help": "the MHA parent's budget, in cell budgets"})
    calibration_pairs: int = field(default=64, metadata={"help": "training pairs the calibrated conversions read"})
    alignment_verses: int = field(default=2, metadata={"help": "test verses whose cross-attention is drawn"})
    threads: int = field(default=1, metadata={"help": "torch threads"})
    device: str = field(
        default="cpu", metadata={"help": "where cells train and decode: cpu, or cuda for the GPU recipe"}
    )

    # the options that define what a row means: a board is resumed only with the same ones
    DEFINING = (
        "validation_books",
        "test_books",
        "budget",
        "hidden_size",
        "num_layers",
        "num_attention_heads",
        "gqa_key_value_heads",
        "vocab_size",
        "max_length",
        "batch_size",
        "learning_rate",
        "warmup_fraction",
        "uptrain_learning_rate",
        "fields",
        "test_pairs",
        "validation_pairs",
        "num_beams",
        "buckets",
        "parent_factor",
        "calibration_pairs",
    )

    def defining(self) -> dict:
        return {name: getattr(self, name) for name in self.DEFINING}

    def extra_fields(self) -> dict:
        return config_fields(self.fields)


@dataclass(frozen=True)
class Cell:
    family: str  # rnn, transformer, encoder, parent, uptrain
    config: str  # bahdanau, mha, sliding_window, gqa-mean-0.05, ...
    seed: int

    @property
    def name(self) -> str:
        return f"{self.family}-{self.config}-seed{self.seed}"


def uptrain_config(target: str, method: str, alpha: float) -> str:
    return f"{target}-{method}-{alpha:g}"


def plan(setup: TranslationSetup) -> list[Cell]:
    """Configuration-major (a board stopped early has whole configurations at every seed), the uptraining last: its
    parent comes after the board's own cells, its conversions after the parent."""
    unknown = [m for m in setup.uptrain_methods if m not in ("mean", "first", "random", *CALIBRATION_METHODS)]
    if unknown:
        raise SystemExit(f"--uptrain_methods {' '.join(unknown)}: unknown conversion method(s)")
    cells = [Cell("rnn", attention, seed) for attention in setup.rnns for seed in setup.seeds]
    cells += [Cell("transformer", kind, seed) for kind in setup.cross_attentions for seed in setup.seeds]
    cells += [Cell("encoder", variant, seed) for variant in setup.encoders for seed in setup.seeds]
    if setup.uptrain_methods and setup.alphas:
        cells.append(Cell("parent", "mha", setup.seeds[0]))
        for target in ("gqa", "mqa"):
            for method in setup.uptrain_methods:
                for alpha in setup.alphas:
                    seeds = setup.seeds if alpha > 0 else setup.seeds[:1]  # the conversion alone is deterministic
                    cells += [Cell("uptrain", uptrain_config(target, method, alpha), seed) for seed in seeds]
    return cells


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


def transformer_spec(setup: TranslationSetup, family: str, config: str, tokens: dict) -> tuple[str, dict]:
    """(variant, config fields before the MLP is matched) of a Transformer cell."""
    heads, layers = setup.num_attention_heads, setup.num_layers
    fields = {
        **tokens,
        "hidden_size": setup.hidden_size,
        "num_hidden_layers": layers,
        "encoder_layers": layers,
        "decoder_layers": layers,
        "num_attention_heads": heads,
        "max_position_embeddings": setup.max_length + 1,  # a target of max_length behind the start token
        "tie_word_embeddings": True,
    }
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


def parameter_count(variant: str, fields: dict) -> int:
    """Parameters of a model of `fields`, counted on the meta device (nothing allocated; tied weights once)."""
    with torch.device("meta"):
        model = SEQ2SEQ[variant].build(None, **fields)
    return sum(p.numel() for p in model.parameters())


def rnn_fields(setup: TranslationSetup, attention: str, tokens: dict, state: int) -> dict:
    return {
        **tokens,
        "hidden_size": setup.hidden_size,
        "rnn_hidden_size": state,
        "attention": attention,
        "dropout": 0.0,  # as the Transformers: one recipe, no regularisation at this budget
    }


def match_rnn(setup: TranslationSetup, attention: str, tokens: dict, target: int) -> tuple[dict, int]:
    """The RNN's fields with the state size whose parameter count is nearest `target` (bisection: the count grows
    with it)."""
    low, high = 1, 16 * setup.hidden_size
    while high - low > 1:
        middle = (low + high) // 2
        if parameter_count("rnn", rnn_fields(setup, attention, tokens, middle)) < target:
            low = middle
        else:
            high = middle
    state = min(
        (low, high), key=lambda n: abs(parameter_count("rnn", rnn_fields(setup, attention, tokens, n)) - target)
    )
    fields = rnn_fields(setup, attention, tokens, state)
    return fields, parameter_count("rnn", fields)


def match_mlp(variant: str, fields: dict, target: int) -> tuple[dict, int]:
    """`fields` with the MLP width (a multiple of 8) whose parameter count is nearest `target` (linear in it)."""
    start = SEQ2SEQ[variant].config(None, **fields).intermediate_size
    at_start = parameter_count(variant, {**fields, "intermediate_size": start})
    per_unit = (parameter_count(variant, {**fields, "intermediate_size": start + 64}) - at_start) / 64
    width = max(MLP_MULTIPLE, round((start + (target - at_start) / per_unit) / MLP_MULTIPLE) * MLP_MULTIPLE)
    matched = {**fields, "intermediate_size": width}
    return matched, parameter_count(variant, matched)


def cell_spec(setup: TranslationSetup, cell: Cell, tokens: dict) -> tuple[str, dict, int, int]:
    """(variant, config fields, parameters, the MHA Transformer's parameters they match) of a cell; `ValueError`
    where no width gets within 1%."""
    reference_variant, reference = transformer_spec(setup, "transformer", "mha", tokens)
    target = parameter_count(reference_variant, reference)
    if cell.family == "rnn":
        variant, (fields, count) = "rnn", match_rnn(setup, cell.config, tokens, target)
    elif cell.family in ("parent", "uptrain"):
        variant, fields, count = reference_variant, reference, target  # conversions keep the parent's MLP
    else:
        variant, fields = transformer_spec(setup, cell.family, cell.config, tokens)
        fields, count = match_mlp(variant, fields, target)
    if cell.family != "uptrain" and abs(count / target - 1) > MATCH_TOLERANCE:
        raise ValueError(f"{cell.config}: {count:,} parameters, more than 1% from the MHA Transformer's {target:,}")
    return variant, fields, count, target


def build(variant: str, fields: dict, seed: int, max_length: int):
    """The model of a cell, initialised from `seed`, with what `generate()` needs (start, end and padding tokens, a
    translation of at most `max_length` tokens)."""
    torch.manual_seed(seed)
    model = SEQ2SEQ[variant].build(None, **fields)
    generation = model.generation_config
    generation.max_length = max_length + 1
    generation.decoder_start_token_id = fields["decoder_start_token_id"]
    generation.bos_token_id, generation.eos_token_id = fields["bos_token_id"], fields["eos_token_id"]
    generation.pad_token_id = fields["pad_token_id"]
    return model


# ---------------------------------------------------------------------------------------------------------------
# Training and evaluation


def batches(pairs: list[tuple[list[int], list[int]]], size: int, seed: int) -> Iterator[list]:
    """Endless batches of `size` pairs: each epoch shuffled by `seed`, then sorted by length within chunks of 50
    batches (little padding) and the batches shuffled again."""
    epoch = 0
    while True:
        order = list(pairs)
        rng = random.Random(seed * 1000 + epoch)
        rng.shuffle(order)
        chunk = 50 * size
        epoch_batches = []
        for start in range(0, len(order), chunk):
            part = sorted(order[start : start + chunk], key=lambda pair: len(pair[0]) + len(pair[1]))
            epoch_batches += [part[i : i + size] for i in range(0, len(part), size)]
        rng.shuffle(epoch_batches)
        yield from epoch_batches
        epoch += 1


def collate(pairs: list, pad: int) -> dict[str, torch.Tensor]:
    """Sources padded on the right with `pad` (and their mask), labels with -100."""
    width_source = max(len(source) for source, _ in pairs)
    width_target = max(len(target) for _, target in pairs)
    input_ids = torch.full((len(pairs), width_source), pad)  # (B, S)
    labels = torch.full((len(pairs), width_target), -100)  # (B, T)
    for row, (source, target) in enumerate(pairs):
        input_ids[row, : len(source)] = torch.tensor(source)
        labels[row, : len(target)] = torch.tensor(target)
    mask = torch.zeros_like(input_ids)
    for row, (source, _) in enumerate(pairs):
        mask[row, : len(source)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def steps_for(tokens: float, corpus: Corpus, setup: TranslationSetup) -> int:
    per_pair = statistics.fmean(len(s) + len(t) for s, t in corpus.train)
    return max(1, round(tokens / (per_pair * setup.batch_size)))


def train(model, corpus: Corpus, setup: TranslationSetup, steps: int, seed: int, learning_rate: float) -> dict:
    """`steps` AdamW steps (warm-up, cosine decay, gradients clipped at 1); tokens, seconds and the losses."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = max(1, round(setup.warmup_fraction * steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    model.train()
    stream = batches(corpus.train, setup.batch_size, seed)
    pad = corpus.tokenizer.pad_token_id
    tokens, losses = 0, []
    start = time.perf_counter()
    for _ in range(steps):
        pairs = next(stream)
        batch = {name: tensor.to(model.device) for name, tensor in collate(pairs, pad).items()}
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += sum(len(s) + len(t) for s, t in pairs)
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    model.eval()
    tail = losses[-max(1, len(losses) // 10) :]
    return {
        "steps": steps,
        "train_tokens": tokens,
        "train_seconds": round(seconds, 2),
        "tokens_per_second": round(tokens / max(seconds, 1e-9), 1),
        "final_loss": round(statistics.fmean(tail), 4),
    }


_METRIC = {}


def bleu_chrf(translations: list[str], references: list[str]) -> tuple[float, float]:
    """Corpus BLEU and chrF (0-100) through the shipped `evaluate` module (sacrebleu underneath)."""
    if "metric" not in _METRIC:
        import evaluate

        from hf_attn_zoo.evaluation import TRANSLATION

        _METRIC["metric"] = evaluate.load(TRANSLATION)
    if not translations:
        return 0.0, 0.0
    scores = _METRIC["metric"].compute(predictions=translations, references=references)
    return round(scores["bleu"], 3), round(scores["chrf"], 3)


@torch.no_grad()
def translate(model, tokenizer, sources: list[str], num_beams: int, max_new_tokens: int) -> tuple[list[str], int]:
    """Translations (greedy or beam search) and the tokens generated, in batches of sources of similar length."""
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    out, generated_tokens = [""] * len(sources), 0
    size = 50 if num_beams == 1 else 25
    for start in range(0, len(order), size):
        chosen = order[start : start + size]
        inputs = tokenizer([sources[i] for i in chosen], return_tensors="pt", padding=True).to(model.device)
        generated = model.generate(
            **inputs, num_beams=num_beams, do_sample=False, max_new_tokens=max_new_tokens
        )  # (B, 1 + T)
        body = generated[:, 1:]  # (B, T): behind the start token
        # EOS is generated once per row and counts; the padding after it does not (pad is EOS here)
        ended = (body == tokenizer.eos_token_id).cumsum(1)
        generated_tokens += int(((ended == 0) | ((ended == 1) & (body == tokenizer.eos_token_id))).sum())
        for index, text in zip(chosen, tokenizer.batch_decode(generated, skip_special_tokens=True)):
            out[index] = text.strip()
    return out, generated_tokens


def bucket_of(length: int, edges: list[int]) -> str:
    low = 1
    for edge in edges:
        if length <= edge:
            return f"{low}-{edge}"
        low = edge + 1
    return f">{edges[-1]}"


def bucket_names(edges: list[int]) -> list[str]:
    names, low = [], 1
    for edge in edges:
        names.append(f"{low}-{edge}")
        low = edge + 1
    return names


def perplexity(model, tokenizer, pairs: list[tuple[str, str]]) -> float:
    nll, tokens = reference_nll(model, tokenizer, [s for s, _ in pairs], [t for _, t in pairs], batch_size=50)
    return round(math.exp(min(nll / max(tokens, 1), 700.0)), 3)


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
        max_new_tokens=2,
        min_new_tokens=2,
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


def parent_folder(setup: TranslationSetup) -> Path:
    return Path(setup.output_dir) / "parent"


def parent_model(setup: TranslationSetup, corpus: Corpus):
    """The trained MHA parent, as the parent cell saved it, on the CPU (conversions run there)."""
    path = parent_folder(setup) / "model.pt"
    if not path.is_file():
        raise FileNotFoundError(f"no {path}: the parent cell has not finished")
    variant, fields, _, _ = cell_spec(setup, Cell("parent", "mha", setup.seeds[0]), special_tokens(corpus.tokenizer))
    model = build(variant, fields, setup.seeds[0], setup.max_length)
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return model.eval()


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
    else:
        row["intermediate_size"] = fields.get("intermediate_size")
    if cell.family == "uptrain":
        target_kind, method, alpha = cell.config.split("-")
        alpha = float(alpha)
        parent = parent_model(setup, corpus)
        groups = setup.gqa_key_value_heads if target_kind == "gqa" else 1
        calibration = None
        if method in CALIBRATION_METHODS:
            calibration = [
                (torch.tensor([s]), torch.tensor([t])) for s, t in corpus.train[: setup.calibration_pairs]
            ]  # (1, S), (1, T) each
        start = time.perf_counter()
        model = seq2seq_mha_to_gqa(parent, groups, method, calibration=calibration).to(setup.device)
        row["conversion_seconds"] = round(time.perf_counter() - start, 2)
        row |= {"target": target_kind, "method": method, "alpha": alpha, "key_value_heads": groups}
        row["parameters"] = sum(p.numel() for p in model.parameters())
        parent_steps = steps_for(setup.parent_factor * setup.budget, corpus, setup)
        if alpha > 0:
            torch.manual_seed(cell.seed)
            steps = max(1, round(alpha * parent_steps))
            row |= train(model, corpus, setup, steps, cell.seed, setup.uptrain_learning_rate)
        else:
            row |= {"steps": 0, "train_tokens": 0, "train_seconds": 0.0, "tokens_per_second": 0.0}
        row |= evaluate(model, corpus, setup, beams=False)
    else:
        model = build(variant, fields, cell.seed, setup.max_length).to(setup.device)
        factor = setup.parent_factor if cell.family == "parent" else 1.0
        steps = steps_for(factor * setup.budget, corpus, setup)
        row |= train(model, corpus, setup, steps, cell.seed, setup.learning_rate)
        row |= evaluate(model, corpus, setup, beams=True)
        if cell.family == "parent":
            parent_folder(setup).mkdir(parents=True, exist_ok=True)
            torch.save(model.state_dict(), parent_folder(setup) / "model.pt")
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
    for cell in {(c.family, c.config): c for c in cells if c.family in ("rnn", "transformer", "encoder")}.values():
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
    write_board(setup, board.rows, log=log)
    return board.rows


# ---------------------------------------------------------------------------------------------------------------
# Aggregation over seeds, the tables, the claims and the plots

LABELS = {
    ("rnn", "none"): "RNN, no attention",
    ("rnn", "bahdanau"): "RNN + Bahdanau",
    ("rnn", "luong"): "RNN + Luong",
    ("transformer", "mha"): "Transformer MHA",
    ("transformer", "gqa"): "Transformer GQA",
    ("transformer", "mqa"): "Transformer MQA",
    ("transformer", "additive"): "Transformer, additive cross",
    ("parent", "mha"): "MHA parent",
}
VERDICT = {1: "holds", -1: "does not hold at this scale", 0: "within noise"}


# the RNNs in colours of their own, dark enough to read as text (the variants keep the house colours)
RNN_COLOURS = {"none": "dimgray", "bahdanau": "#8b0000", "luong": "#006400"}


def shade(key: tuple[str, str]) -> str:
    return RNN_COLOURS.get(key[1], "black") if key[0] == "rnn" else colour(key[1])


def label(key: tuple[str, str]) -> str:
    return LABELS.get(key, f"{key[1]} encoder-decoder" if key[0] == "encoder" else f"{key[0]} {key[1]}")


def groups(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """Finished rows by (family, configuration), in the board's order."""
    grouped: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        if "error" not in row:
            grouped.setdefault((row["family"], row["config"]), []).append(row)
    return grouped


def values(grouped: dict, key: tuple[str, str], metric: str = "bleu") -> list[float]:
    return [row[metric] for row in grouped.get(key, []) if metric in row]


def spread_text(numbers: list[float], digits: int = 2) -> str:
    """Mean ± standard deviation and the seeds' range."""
    if len(numbers) < 2:
        return figure(numbers, digits) + " (one run)"
    return f"{figure(numbers, digits)} [{min(numbers):.{digits}f} to {max(numbers):.{digits}f}]"


def show(grouped: dict, key: tuple[str, str], metric: str = "bleu", digits: int = 2) -> str:
    return f"{label(key)} {spread_text(values(grouped, key, metric), digits)}"


def missing(grouped: dict, *keys: tuple[str, str]) -> str | None:
    absent = [label(k) for k in keys if k not in grouped]
    return f"not measured (no finished cell of {', '.join(absent)})" if absent else None


def higher(grouped: dict, a: tuple[str, str], b: tuple[str, str], metric: str = "bleu", digits: int = 2) -> str:
    """Whether `a` scores above `b` beyond noise (every seed of a above every seed of b), with the numbers."""
    verdict = VERDICT[compare_seeds(values(grouped, a, metric), values(grouped, b, metric))]
    text = f"{verdict}: {show(grouped, a, metric, digits)} against {show(grouped, b, metric, digits)}"
    return text + (lower_perplexity(grouped, a, b) if metric == "bleu" else "")


def lower_perplexity(grouped: dict, a: tuple[str, str], b: tuple[str, str]) -> str:
    """The same comparison on the test references' perplexity (lower is better), which separates models that BLEU,
    near the floor at this scale, cannot; empty where the rows have none."""
    ours, theirs = values(grouped, a, "test_perplexity"), values(grouped, b, "test_perplexity")
    if not ours or not theirs:
        return ""
    verdict = VERDICT[-compare_seeds(ours, theirs)]
    return (
        f"; on test perplexity {verdict}: {label(a)} {spread_text(ours, 1)} against {label(b)} "
        f"{spread_text(theirs, 1)}"
    )


def bucket_bleu(rows: list[dict], bucket: str) -> list[float]:
    return [row["bleu_by_length"][bucket]["bleu"] for row in rows]


def length_gap(grouped: dict, setup: TranslationSetup) -> str:
    """The attention RNN's BLEU minus the plain RNN's, seed by seed, in the shortest and the longest bucket."""
    attended, plain = ("rnn", "bahdanau"), ("rnn", "none")
    absent = missing(grouped, attended, plain)
    if absent:
        return absent
    names = bucket_names(setup.buckets)
    by_seed = {row["seed"]: row for row in grouped[plain]}
    pairs = [(row, by_seed[row["seed"]]) for row in grouped[attended] if row["seed"] in by_seed]
    gaps = {
        name: [a["bleu_by_length"][name]["bleu"] - b["bleu_by_length"][name]["bleu"] for a, b in pairs]
        for name in names
    }
    short, long = names[0], names[-1]
    verdict = VERDICT[compare_seeds(gaps[long], gaps[short])]
    per_bucket = "; ".join(f"{name} tokens {spread_text(gaps[name])}" for name in names)
    return f"{verdict}: BLEU gap (Bahdanau - none) by source length, per seed: {per_bucket}"


def matches(grouped: dict, a: tuple[str, str], b: tuple[str, str]) -> str:
    """A claim that `a` is as good as `b`: holds unless b is above a beyond noise."""
    relation = compare_seeds(values(grouped, a), values(grouped, b))
    verdict = "does not hold at this scale" if relation < 0 else "holds"
    if relation == 0:
        verdict += " (within noise)"
    elif relation > 0:
        verdict += f" ({label(a)} above, beyond noise)"
    return f"{verdict}: {show(grouped, a)} against {show(grouped, b)}{lower_perplexity(grouped, a, b)}"


def close_to(grouped: dict, a: tuple[str, str], b: tuple[str, str]) -> str:
    """Close: a mean BLEU at least 90% of b's; further off, overlapping seeds cannot tell, apart ones say no."""
    mean_a, mean_b = statistics.fmean(values(grouped, a)), statistics.fmean(values(grouped, b))
    ratio = mean_a / mean_b if mean_b else float("nan")
    if ratio >= 0.9:
        verdict = "holds"
    elif compare_seeds(values(grouped, a), values(grouped, b)) == 0:
        verdict = "within noise"
    else:
        verdict = "does not hold at this scale"
    return f"{verdict}: {show(grouped, a)}, {ratio:.0%} of {show(grouped, b)}{lower_perplexity(grouped, a, b)}"


def cache_of(grouped: dict, key: tuple[str, str]) -> float:
    return grouped[key][0]["cache_bytes_per_source_token"]


def up(target: str, method: str, alpha: float) -> tuple[str, str]:
    return "uptrain", uptrain_config(target, method, alpha)


METRIC_NAMES = {"bleu": "BLEU", "test_perplexity": "test perplexity"}


def better(metric: str) -> int:
    """The sign of `compare_seeds(a, b)` when a is the better: BLEU higher, perplexity lower."""
    return 1 if metric == "bleu" else -1


def digits_of(metric: str) -> int:
    return 2 if metric == "bleu" else 1


def mean_against_others(grouped: dict, setup: TranslationSetup, target: str, alpha: float, metric: str) -> str:
    """Whether mean pooling is no worse than any other conversion beyond noise, at one alpha and metric."""
    mean = up(target, "mean", alpha)
    others = [up(target, m, alpha) for m in setup.uptrain_methods if m != "mean" and up(target, m, alpha) in grouped]
    if mean not in grouped or not others or not values(grouped, mean, metric):
        return ""
    digits = digits_of(metric)
    relations = {
        o: better(metric) * compare_seeds(values(grouped, mean, metric), values(grouped, o, metric)) for o in others
    }
    verdict = "does not hold" if any(r < 0 for r in relations.values()) else "holds"
    if all(r == 0 for r in relations.values()):
        verdict += " (within noise)"
    text = ", ".join(f"{o[1].split('-')[1]} {spread_text(values(grouped, o, metric), digits)}" for o in others)
    return (
        f"{target.upper()} alpha {alpha:g} {METRIC_NAMES[metric]}: {verdict}: mean "
        f"{spread_text(values(grouped, mean, metric), digits)} against {text}"
    )


def recovery(grouped: dict, target: str, alpha: float, metric: str) -> str:
    """The mean-pooled conversion before and after uptraining, against the parent, and the share regained."""
    parent, before, after = ("parent", "mha"), up(target, "mean", 0.0), up(target, "mean", alpha)
    if any(not values(grouped, k, metric) for k in (parent, before, after)):
        return ""
    digits, sign = digits_of(metric), better(metric)
    relation = sign * compare_seeds(values(grouped, after, metric), values(grouped, before, metric))
    mean = {k: statistics.fmean(values(grouped, k, metric)) for k in (parent, before, after)}
    lost, regained = sign * (mean[parent] - mean[before]), sign * (mean[after] - mean[before])
    share = f", {regained / lost:.0%} of the {lost:.{digits}f} lost regained" if lost > 0 else ""
    return (
        f"{target.upper()} {METRIC_NAMES[metric]}: {VERDICT[relation]}: alpha {alpha:g} "
        f"{spread_text(values(grouped, after, metric), digits)} against alpha 0 "
        f"{spread_text(values(grouped, before, metric), digits)}, parent "
        f"{spread_text(values(grouped, parent, metric), digits)}{share}"
    )


def uptraining_claims(grouped: dict, setup: TranslationSetup) -> list[tuple[str, str]]:
    parent = ("parent", "mha")
    alpha = max(setup.alphas)
    metrics = ("bleu", "test_perplexity")
    out = []
    # Fig. 5: mean pooling against the other conversions, as converted and after uptraining
    lines = [
        mean_against_others(grouped, setup, target, a, metric)
        for target in ("gqa", "mqa")
        for a in sorted(setup.alphas)
        for metric in metrics
    ]
    out.append(
        (
            "Mean pooling converts best (Ainslie et al. 2023, Fig. 5: mean > first > random), here against the "
            "calibrated conversions, as converted (alpha 0, one run each) and after uptraining",
            "; ".join(line for line in lines if line) or "not measured",
        )
    )
    # Fig. 4: uptraining recovers what the conversion lost
    lines = [recovery(grouped, target, alpha, metric) for target in ("gqa", "mqa") for metric in metrics]
    out.append(
        (
            f"Uptraining on {alpha:g} of the parent's steps recovers the quality the mean-pooled conversion lost "
            "(Fig. 4: MQA/GQA at alpha 0 well below, most of it back by 0.05)",
            "; ".join(line for line in lines if line) or "not measured",
        )
    )
    # Table 1: uptrained GQA close to the MHA parent, MQA further
    gqa, mqa = up("gqa", "mean", alpha), up("mqa", "mean", alpha)
    absent = missing(grouped, parent, gqa, mqa)
    if absent is None:
        parts = []
        for metric in metrics:
            if any(not values(grouped, k, metric) for k in (parent, gqa, mqa)):
                continue
            digits, sign = digits_of(metric), better(metric)
            means = [sign * statistics.fmean(values(grouped, k, metric)) for k in (parent, gqa, mqa)]
            order = "holds" if means[0] >= means[1] >= means[2] else "does not hold at this scale"
            relation = sign * compare_seeds(values(grouped, gqa, metric), values(grouped, parent, metric))
            where = {-1: "worse", 0: "within noise", 1: "better"}[relation]
            parts.append(
                f"{METRIC_NAMES[metric]}: {order} (order of the means): parent "
                f"{spread_text(values(grouped, parent, metric), digits)}, GQA-{setup.gqa_key_value_heads} uptrained "
                f"{spread_text(values(grouped, gqa, metric), digits)}, MQA uptrained "
                f"{spread_text(values(grouped, mqa, metric), digits)}; uptrained GQA against the parent (the "
                f"uptraining seeds' range against one parent): {where}"
            )
        absent = "; ".join(parts)
    out.append(
        (
            "Uptrained GQA comes close to the MHA parent and MQA falls further (Table 1, T5-XXL: MHA 47.2, GQA-8 "
            "47.1, MQA 46.6 average)",
            absent,
        )
    )
    lines = []
    for target in ("gqa", "mqa"):
        scratch, uptrained = ("transformer", target), up(target, "mean", alpha)
        for metric in metrics:
            if values(grouped, scratch, metric) and values(grouped, uptrained, metric):
                digits, sign = digits_of(metric), better(metric)
                relation = sign * compare_seeds(values(grouped, uptrained, metric), values(grouped, scratch, metric))
                lines.append(
                    f"{target.upper()} {METRIC_NAMES[metric]}: {VERDICT[relation]}: uptrained "
                    f"{spread_text(values(grouped, uptrained, metric), digits)} against from scratch "
                    f"{spread_text(values(grouped, scratch, metric), digits)}"
                )
    out.append(
        (
            f"Uptraining beats training GQA/MQA from scratch (the paper's motivation; compute here: parent "
            f"{setup.parent_factor:g} budgets + {alpha:g} of them, against 1 budget for the scratch cells)",
            "; ".join(lines) or "not measured",
        )
    )
    return out


def claims(rows: list[dict], setup: TranslationSetup) -> list[tuple[str, str]]:
    """(claim, verdict with the numbers) for each claim of the notes the board checks."""
    grouped = groups(rows)
    none, bahdanau, luong = ("rnn", "none"), ("rnn", "bahdanau"), ("rnn", "luong")
    mha, gqa, mqa, additive = (("transformer", k) for k in ("mha", "gqa", "mqa", "additive"))
    out = [
        (
            "Attention beats the same RNN without it (Bahdanau et al. 2015), greedy test BLEU",
            missing(grouped, bahdanau, none) or higher(grouped, bahdanau, none),
        ),
        (
            "Luong's attention beats the same RNN without it (Luong et al. 2015)",
            missing(grouped, luong, none) or higher(grouped, luong, none),
        ),
        (
            "The gain from attention grows with source length (Bahdanau et al. 2015, Fig. 2): the gap in the longest "
            "bucket above the gap in the shortest",
            length_gap(grouped, setup),
        ),
        (
            "The Transformer beats the RNN with attention at the same parameters (Vaswani et al. 2017)",
            missing(grouped, mha, bahdanau) or higher(grouped, mha, bahdanau),
        ),
        (
            "The Transformer trains faster per token than the RNN (parallel over the sequence), training tokens/s",
            missing(grouped, mha, bahdanau, none)
            or "; ".join(higher(grouped, mha, rnn, "tokens_per_second", 0) for rnn in (bahdanau, none)),
        ),
    ]
    if missing(grouped, mha, gqa) is None:
        ratio = cache_of(grouped, mha) / cache_of(grouped, gqa)
        gqa_text = (
            f"{matches(grouped, gqa, mha)}; cache {cache_of(grouped, gqa):,.0f} against "
            f"{cache_of(grouped, mha):,.0f} bytes per source token ({ratio:g}x less)"
        )
    else:
        gqa_text = missing(grouped, mha, gqa)
    out.append(
        (
            "GQA cross- and decoder self-attention match MHA's quality at a fraction of its cache "
            "(Ainslie et al. 2023)",
            gqa_text,
        )
    )
    if missing(grouped, mha, mqa) is None:
        ratio = cache_of(grouped, mha) / cache_of(grouped, mqa)
        mqa_text = (
            f"{higher(grouped, mha, mqa)}; cache {cache_of(grouped, mqa):,.0f} against "
            f"{cache_of(grouped, mha):,.0f} bytes per source token ({ratio:g}x less)"
        )
    else:
        mqa_text = missing(grouped, mha, mqa)
    out.append(("MQA loses quality against MHA (Shazeer 2019; Ainslie et al. 2023)", mqa_text))
    out.append(
        (
            "Dot-product cross-attention matches additive (Vaswani et al. 2017, 3.2.1: similar quality, faster)",
            missing(grouped, mha, additive)
            or f"{matches(grouped, mha, additive)}; decode tokens/s "
            f"{higher(grouped, mha, additive, 'decode_tokens_per_second', 0)}",
        )
    )
    for variant in setup.encoders:
        key = ("encoder", variant)
        out.append(
            (
                f"An efficient encoder ({variant}) comes close to full attention in translation: a mean BLEU at "
                "least 90% of the MHA Transformer's",
                missing(grouped, key, mha) or close_to(grouped, key, mha),
            )
        )
    if setup.uptrain_methods and setup.alphas:
        out += uptraining_claims(grouped, setup)
    return out


def verdict_block(rows: list[dict], setup: TranslationSetup) -> str:
    return "\n".join(f"- **{claim}**: {verdict}." for claim, verdict in claims(rows, setup))


ALIGNMENT_ERROR_NOTE = (
    "No alignment-error figure: the corpus is aligned by verse only, it has no gold word alignments, and making them "
    "(annotating verses by hand, or a statistical aligner such as fast_align run over the corpus as a silver "
    "reference) is not cheap here; the maps in alignment.png are shown for reading, not scored."
)


def board_table(rows: list[dict], setup: TranslationSetup) -> str:
    grouped = groups(rows)
    failed = [row for row in rows if "error" in row]
    first = next(iter(grouped.values()))[0] if grouped else {}
    lines = [
        "Translation board: English -> Spanish Bible verses, split by book (validation "
        f"{', '.join(setup.validation_books)}; "
        f"test {', '.join(setup.test_books)}); one BPE of {setup.vocab_size} tokens trained on the training books; "
        f"{first.get('train_pairs', 0):,} training pairs ({first.get('dropped_pairs', 0):,} longer than "
        f"{setup.max_length} tokens dropped). Every cell trained on {setup.budget / 1e3:g}k source + target tokens "
        f"(batches of {setup.batch_size}, AdamW at {setup.learning_rate:g}, warm-up and cosine decay), Transformers "
        f"{setup.num_layers} + {setup.num_layers} layers x {setup.hidden_size} with {setup.num_attention_heads} "
        "heads; "
        f"parameters matched within 1% of the MHA Transformer's. Test: {setup.test_pairs} verses of the test books; "
        f"BLEU/chrF greedy and beam {setup.num_beams}. Mean ± standard deviation over the seeds (n).",
        "",
        "| model | n | params | RNN state / MLP | BLEU | chrF | BLEU beam | chrF beam | test ppl | val ppl | "
        "cross cache B/src token | train tokens/s | train min | decode tokens/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key, cells in grouped.items():
        if key[0] == "uptrain":
            continue
        head = cells[0]
        width = head.get("rnn_hidden_size", head.get("intermediate_size")) or "as MHA's"
        lines.append(
            f"| {label(key)} | {len(cells)} | {head['parameters']:,} | {width} | {figure(values(grouped, key))} | "
            f"{figure(values(grouped, key, 'chrf'))} | {figure(values(grouped, key, 'bleu_beam'))} | "
            f"{figure(values(grouped, key, 'chrf_beam'))} | {figure(values(grouped, key, 'test_perplexity'), 1)} | "
            f"{figure(values(grouped, key, 'validation_perplexity'), 1)} | "
            f"{head['cache_bytes_per_source_token']:,.0f} | "
            f"{figure(values(grouped, key, 'tokens_per_second'), 0)} | "
            f"{figure([r['train_seconds'] / 60 for r in cells], 1)} | "
            f"{figure(values(grouped, key, 'decode_tokens_per_second'), 0)} |"
        )
    names = bucket_names(setup.buckets)
    counts = first.get("bleu_by_length", {})
    lines += [
        "",
        "Greedy test BLEU by source length (tokens; verses per bucket in the header):",
        "",
        "| model | " + " | ".join(f"{n} ({counts.get(n, {}).get('pairs', 0)})" for n in names) + " |",
        "| --- | " + " | ".join("---:" for _ in names) + " |",
    ]
    for key, cells in grouped.items():
        if key[0] in ("rnn", "transformer", "parent"):
            lines.append(f"| {label(key)} | " + " | ".join(figure(bucket_bleu(cells, n)) for n in names) + " |")
    uptrained = [k for k in grouped if k[0] == "uptrain"]
    if uptrained:
        lines += [
            "",
            f"Uptraining: the MHA parent ({setup.parent_factor:g} budgets, seed {setup.seeds[0]}: one parent) "
            f"converted to GQA-{setup.gqa_key_value_heads} and MQA in the decoder's self- and cross-attention (the "
            "encoder keeps MHA), then uptrained on alpha of the parent's steps (greedy test BLEU/chrF).",
            "",
            "| model | method | alpha | n | params | BLEU | chrF | test ppl | cross cache B/src token | uptrain s |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for key in [("parent", "mha"), ("transformer", "gqa"), ("transformer", "mqa")]:
            if key in grouped:
                head = grouped[key][0]
                lines.append(
                    f"| {label(key)} | {'trained' if key[0] == 'parent' else 'from scratch'} | | "
                    f"{len(grouped[key])} | {head['parameters']:,} | {figure(values(grouped, key))} | "
                    f"{figure(values(grouped, key, 'chrf'))} | {figure(values(grouped, key, 'test_perplexity'), 1)} | "
                    f"{head['cache_bytes_per_source_token']:,.0f} | |"
                )
        for key in uptrained:
            cells, head = grouped[key], grouped[key][0]
            lines.append(
                f"| {head['target'].upper()} uptrained | {head['method']} | {head['alpha']:g} | {len(cells)} | "
                f"{head['parameters']:,} | {figure(values(grouped, key))} | {figure(values(grouped, key, 'chrf'))} | "
                f"{figure(values(grouped, key, 'test_perplexity'), 1)} | "
                f"{head['cache_bytes_per_source_token']:,.0f} | "
                f"{figure([r['train_seconds'] + r['conversion_seconds'] for r in cells], 0)} |"
            )
    total = sum(row.get("cell_seconds", 0) for row in rows)
    lines += [
        "",
        f"Time: {total / 60:.0f} minutes of cells in all (training, evaluation and conversion; one thread each).",
        "",
        "Claims of the notes and the papers, checked (A beats B only where the seeds' ranges, in brackets, do not "
        "overlap):",
        "",
        verdict_block(rows, setup),
        "",
        "Alignment: alignment.png draws the last decoder layer's cross-attention (mean over heads) of "
        f"{setup.alignment_verses} test verses for the attention RNNs and the MHA Transformer. {ALIGNMENT_ERROR_NOTE}",
    ]
    if failed:
        lines += ["", "Failed cells (a rerun tries them again):", ""]
        lines += [f"- {row['cell']}: {row['error']}" for row in failed]
    return "\n".join(lines)


def plot_frontier(rows: list[dict], path: Path) -> bool:
    """Greedy test BLEU (mean, a bar of one standard deviation) of every model against the bytes its decoder keeps
    per source token."""
    plt = headless_pyplot()
    grouped = {k: v for k, v in groups(rows).items() if k[0] in ("rnn", "transformer", "encoder")}
    if plt is None or not grouped:
        return False
    with house_style():
        fig, axis = plt.subplots(figsize=(9, 6))
        points, names, colours, spans = [], [], [], []
        for key, cells in grouped.items():
            mean, spread = mean_spread([r["bleu"] for r in cells])
            x = cells[0]["cache_bytes_per_source_token"]
            tint = shade(key)
            axis.errorbar([x], [mean], yerr=[spread], fmt="s" if key[0] == "rnn" else "o", color=tint)
            points.append((x, mean))
            names.append(label(key))
            colours.append(tint)
            spans.append((mean - spread, mean + spread))
        axis.margins(x=0.15, y=0.12)
        axis.set_xlabel("cross-attention cache (bytes per token of the source, float32)")
        axis.set_ylabel("test score (BLEU, greedy)")
        axis.set_title("mean of the seeds, bar: one standard deviation; square: RNN, circle: Transformer")
        place_labels(axis, points, names, colours, spans)
        save_figure(fig, path)
    return True


def plot_lengths(rows: list[dict], buckets: list[int], path: Path) -> bool:
    """Greedy test BLEU by source-length bucket for the RNNs and the MHA Transformer (Bahdanau et al.'s Fig. 2)."""
    plt = headless_pyplot()
    grouped = groups(rows)
    shown = [
        k for k in [("rnn", "none"), ("rnn", "bahdanau"), ("rnn", "luong"), ("transformer", "mha")] if k in grouped
    ]
    if plt is None or not shown:
        return False
    names = bucket_names(buckets)
    with house_style():
        fig, axis = plt.subplots(figsize=(8, 5), layout="constrained")
        for key in shown:
            means = [mean_spread(bucket_bleu(grouped[key], n)) for n in names]
            axis.errorbar(
                range(len(names)),
                [m for m, _ in means],
                yerr=[s for _, s in means],
                marker="o",
                color=shade(key),
                label=label(key),
            )
        axis.set_xticks(range(len(names)), [f"{n} tokens" for n in names])
        axis.set_xlabel("source length (tokens)")
        axis.set_ylabel("test score (BLEU, greedy)")
        axis.set_title("BLEU by source length, mean of the seeds, bar: one standard deviation")
        fig.legend(loc="outside right upper")
        save_figure(fig, path)
    return True


def plot_uptraining(rows: list[dict], path: Path) -> bool:
    """Greedy test BLEU against alpha, one line per conversion method, GQA and MQA side by side; the parent and the
    from-scratch cells as horizontal lines."""
    plt = headless_pyplot()
    grouped = groups(rows)
    uptrained = [k for k in grouped if k[0] == "uptrain"]
    if plt is None or not uptrained:
        return False
    with house_style():
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True, layout="constrained")
        for axis, target in zip(axes, ("gqa", "mqa")):
            methods = sorted({grouped[k][0]["method"] for k in uptrained if grouped[k][0]["target"] == target})
            for method in methods:
                points = sorted(
                    (grouped[k][0]["alpha"], mean_spread(values(grouped, k)))
                    for k in uptrained
                    if grouped[k][0]["target"] == target and grouped[k][0]["method"] == method
                )
                axis.errorbar(
                    [a for a, _ in points],
                    [m for _, (m, _) in points],
                    yerr=[s for _, (_, s) in points],
                    marker="o",
                    color=colour(method),
                    label=method,
                )
            for key, name, style in ((("parent", "mha"), "parent", "--"), (("transformer", target), "scratch", ":")):
                if key in grouped:
                    axis.axhline(
                        statistics.fmean(values(grouped, key)),
                        color=colour(name),
                        linestyle=style,
                        label=f"{label(key)}",
                    )
            axis.set_title(f"{target.upper()} in the decoder (self + cross)")
            axis.set_xlabel("alpha (fraction of the parent's steps)")
            axis.legend(loc="lower right")
        axes[0].set_ylabel("test score (BLEU, greedy)")
        save_figure(fig, path)
    return True


ALIGNMENT_ROWS = 40  # target tokens drawn per verse: a weak model's translation can run to the length limit


def plot_alignment(rows: list[dict], path: Path) -> bool:
    """The stored cross-attention maps: one row per model, one column per verse, each panel as tall as its
    translation (at most `ALIGNMENT_ROWS` tokens) so that its token names never overlap."""
    plt = headless_pyplot()
    drawn = [row for row in rows if "error" not in row and row.get("alignment")]
    if plt is None or not drawn:
        return False
    columns = max(len(row["alignment"]) for row in drawn)
    tall = [max(min(len(e["target"]), ALIGNMENT_ROWS) for e in row["alignment"]) for row in drawn]
    heights = [1.6 + 0.16 * n for n in tall]  # inches: a 7-point token name is about 0.12 inch
    with house_style():
        fig, axes = plt.subplots(
            len(drawn),
            columns,
            figsize=(6.5 * columns, sum(heights) + 0.6),
            squeeze=False,
            layout="constrained",
            gridspec_kw={"height_ratios": heights},
        )
        for row, line in zip(drawn, axes):
            for axis, entry in zip(line, row["alignment"]):
                entry = {**entry, "target": entry["target"][:ALIGNMENT_ROWS]}
                weights = entry["weights"][:ALIGNMENT_ROWS]
                axis.imshow(weights, cmap="Greys", vmin=0, vmax=1, aspect="auto")
                axis.grid(False)
                axis.set_xticks(
                    range(len(entry["source"])),
                    [repr(t)[1:-1] or "␣" for t in entry["source"]],
                    rotation=90,
                    fontsize=7,
                )
                axis.set_yticks(
                    range(len(entry["target"])), [repr(t)[1:-1] or "␣" for t in entry["target"]], fontsize=7
                )
                axis.set_title(label((row["family"], row["config"])), fontsize=9)
                axis.set_xlabel("source tokens (English)")
                axis.set_ylabel("translation tokens (Spanish)")
            for axis in line[len(row["alignment"]) :]:
                axis.set_visible(False)
        fig.suptitle(
            "cross-attention weight of each target token (rows) on the source tokens (columns), last layer, "
            f"first {ALIGNMENT_ROWS} target tokens"
        )
        save_figure(fig, path)
    return True


def board_figures(board: dict) -> dict[str, Callable[[Path], bool]]:
    """The board's figures from board.json's contents, for a run and `--replot`."""
    rows, defining = board["rows"], board["defining"]
    return {
        "frontier.png": lambda path: plot_frontier(rows, path),
        "lengths.png": lambda path: plot_lengths(rows, defining["buckets"], path),
        "uptraining.png": lambda path: plot_uptraining(rows, path),
        "alignment.png": lambda path: plot_alignment(rows, path),
    }


def write_docs(block: str, docs: Path = DOCS) -> bool:
    """Replace the verdicts between the markers of docs/translation.md with the board's own; False where the page
    has no markers."""
    if not docs.is_file():
        return False
    text = docs.read_text()
    begin, end = MARKERS
    if begin not in text or end not in text:
        return False
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    docs.write_text(f"{head}{begin}\n{block}\n{end}{tail}")
    return True


def readme_row(rows: list[dict], setup: TranslationSetup) -> str:
    """The README's results row, from the board: greedy test BLEU and test perplexity of the RNNs and the
    Transformers (means of the seeds)."""
    grouped = groups(rows)
    keys = [
        ("rnn", "none"),
        ("rnn", "bahdanau"),
        ("transformer", "mha"),
        ("transformer", "gqa"),
        ("transformer", "mqa"),
    ]
    shown = [k for k in keys if k in grouped]
    bleu = ", ".join(f"{label(k)} {statistics.fmean(values(grouped, k)):.2f}" for k in shown)
    ppl = ", ".join(f"{statistics.fmean(values(grouped, k, 'test_perplexity')):.0f}" for k in shown)
    measured = (
        f"English -> Spanish at {setup.budget / 1e3:g}k tokens a cell, 1.5M parameters, mean of the seeds: greedy "
        f"test BLEU {bleu}; test perplexity {ppl}"
    )
    return f"{README_ROW} {measured} | [translation study](docs/translation.md#the-translation-study) |"


def write_readme(row: str, readme: Path = README) -> bool:
    """Replace the README's translation row (the line that starts with `README_ROW`); False where it has none."""
    if not readme.is_file():
        return False
    lines = readme.read_text().split("\n")
    found = [i for i, line in enumerate(lines) if line.startswith(README_ROW)]
    for index in found:
        lines[index] = row
    if found:
        readme.write_text("\n".join(lines))
    return bool(found)


def write_board(setup: TranslationSetup, rows: list[dict], log: Callable[[str], None] = print) -> None:
    """board.md (tables, claims) and the plots, from the rows so far; the docs' verdicts for the committed board."""
    folder = Path(setup.output_dir)
    table = board_table(rows, setup)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "board.md").write_text(table + "\n")
    drawn = draw_figures(folder, board_figures({"defining": setup.defining(), "rows": rows}))
    if folder.resolve() == (STUDY / "results").resolve():
        write_docs(verdict_block(rows, setup))
        write_readme(readme_row(rows, setup))
    log(table)
    log(f"written to {folder}: board.json, board.md, {', '.join(drawn)}")


BENCHMARKS = {"translation": Study(TranslationSetup, run_board, figures=board_figures, results="board")}

if __name__ == "__main__":
    sys.exit(main(BENCHMARKS))
