"""The quality board: every registered variant trained under one recipe, quality beside cache and speed, with noise.

One corpus (the State of the Union addresses: up to 2000 train, 2001-2010 validate, 2011-2021 test), one byte-level
BPE trained on the training addresses alone, one recipe (configs/train/quality_board.yaml: optimizer, schedule,
batch, sequence length), one token budget, one width, depth and head count. A *cell* is one (variant, position type,
seed): every variant at its default position type, and `--position_variant` (gqa) with each of `--positions`.

Parameters are matched by the MLP width: each cell's `intermediate_size` is solved so that its non-embedding
parameters equal those of `--reference` (mha) at its default MLP, to the nearest multiple of 8; a variant whose
attention alone would need a negative MLP, or that lands more than 10% off, is refused naming it. Each variant's own
fields (window, k, bias rank, ...) come from its `small` preset, with `--fields` on top for every variant whose config
has them (the default narrows the sliding window to 64, a quarter of the training length, as the preset's 256 is of
its 1,024 positions; at 256 it would see every training token and train exactly as gqa. For the same reason BigBird's
blocks are 16 tokens: its 3 window, 2 global and 3 random blocks are then half of a training row's 16, where the
preset's blocks of 32 made them all 8 of them, full attention).

Positions: a model is built for the longest scored length (`--lengths`) unless that changes its parameters (learned
positions, AFT's position bias, Linformer's E and F are tables over positions): those are built for the training
length, and a longer window is refused with the model's own reason, recorded in the row.

Per cell (one JSON row in `<output_dir>/board.json`, written the moment the cell ends): test perplexity and bits per
byte (the project's harness, windows of the training length every half window), the same on Shakespeare (the first
`--ood_chars_per_work` characters of each of the 42 works: out of domain), the extrapolation scores at every length
(windows of L every L/2), parameters, training tokens/s and wall time, and the cache bytes per token after
`--cache_tokens` tokens of prefill (measured on the tensors the cache holds, on the cell's architecture).

A rerun skips finished cells (kill the board, rerun: only unfinished cells train); a cell that fails is recorded with
its error, the board goes on, and a rerun tries it again. board.json remembers the options that define the board
(budget, shape, recipe, ...); a rerun with others is refused rather than mixed in. The table (board.md), the claims
checked against the papers and the plots (frontier.png, walltime.png, extrapolation.png) are rewritten after every
cell. Every figure is a mean over seeds with its sample standard deviation; "A beats B" only where the seeds' ranges
do not overlap, "within noise" otherwise.

    python -m experiments quality [--variants gqa mqa] [--positions rope alibi] [--seeds 0 1 2] [--budget 2000000]

Data: `--data_dir` (default data/sotu in the checkout) and `--ood_dir` (data/shakespeare), fetched by the README's
commands ("Which variant?").
"""

import json
import math
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from experiments.common import (
    REPOSITORY,
    Benchmark,
    Board,
    Results,
    compare_seeds,
    config_fields,
    draw_figures,
    figure,
    main,
    mean_spread,
)
from experiments.speed.scaling import cache_nbytes
from experiments.uptraining.uptraining import split_by_year
from hf_attn_zoo.data import train_byte_level_bpe
from hf_attn_zoo.errors import one_line
from hf_attn_zoo.evaluation.perplexity import score_texts
from hf_attn_zoo.evaluation.plotting import (
    POSITION_STYLES,
    colour,
    headless_pyplot,
    house_style,
    place_labels,
    save_figure,
    ticks_at,
)
from hf_attn_zoo.models import POSITION_EMBEDDING_TYPES, VARIANTS, get_variant
from hf_attn_zoo.models.compat_zoo import returned_cache
from hf_attn_zoo.train import load_recipe, run_training
from hf_attn_zoo.train.build import non_embedding_parameters
from hf_attn_zoo.train.recipe import read_recipe

DATA = REPOSITORY / "data"
STUDY = Path(__file__).resolve().parent  # the board's results and its recipe's notes
MLP_MULTIPLE = 8  # intermediate sizes are rounded to this
MATCH_TOLERANCE = 0.10


@dataclass
class QualitySetup(Results):
    """Every registered variant trained under one recipe: quality, cache and speed side by side, over seeds."""

    output_dir: str = field(
        default=str(STUDY / "results"), metadata={"help": "board.json, board.md, plots, tokenizer"}
    )
    data_dir: str = field(default=str(DATA / "sotu"), metadata={"help": "State of the Union folder (YEAR_*.txt)"})
    ood_dir: str = field(
        default=str(DATA / "shakespeare"), metadata={"help": "Shakespeare's works (*.txt): the out-of-domain test"}
    )
    recipe: str = field(
        default=str(REPOSITORY / "configs" / "train" / "quality_board.yaml"), metadata={"help": "the one recipe"}
    )
    variants: list[str] = field(
        default_factory=lambda: list(VARIANTS), metadata={"help": "variants, each at its default position type"}
    )
    positions: list[str] = field(
        default_factory=lambda: list(POSITION_EMBEDDING_TYPES),
        metadata={"help": "position types trained on --position_variant (its default alone: no sweep)"},
    )
    position_variant: str = field(default="gqa", metadata={"help": "the variant the position sweep trains"})
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2], metadata={"help": "one cell per seed"})
    budget: int = field(default=2_000_000, metadata={"help": "training tokens per cell"})
    hidden_size: int = field(default=128, metadata={"help": "width of every cell"})
    num_hidden_layers: int = field(default=4, metadata={"help": "depth of every cell"})
    num_attention_heads: int = field(
        default=8, metadata={"help": "query heads of the variants whose small preset sets a head count"}
    )
    fields: str = field(
        default='{"sliding_window": 64, "attention_block_size": 16}',
        metadata={"help": "JSON config fields over the small presets, for every variant whose config has them"},
    )
    reference: str = field(
        default="mha", metadata={"help": "the variant whose non-embedding parameters every cell matches"}
    )
    lengths: list[int] = field(
        default_factory=lambda: [256, 512, 1024, 2048], metadata={"help": "extrapolation: window lengths scored"}
    )
    ood_chars_per_work: int = field(
        default=10_000, metadata={"help": "characters of each Shakespeare work scored (from its start)"}
    )
    cache_tokens: int = field(default=1024, metadata={"help": "prefill length the cache is measured after"})
    overrides: list[str] = field(
        default_factory=list,
        metadata={"help": "recipe overrides for every cell, e.g. --overrides --training.bf16 true (after the rest)"},
    )
    keep_models: bool = field(default=False, metadata={"help": "keep each cell's final model in <output_dir>/cells"})

    # the options that define what a row means: a board is resumed only with the same ones
    DEFINING = (
        "budget",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "fields",
        "reference",
        "lengths",
        "ood_chars_per_work",
        "cache_tokens",
        "overrides",
    )

    def defining(self) -> dict:
        # the recipe's contents, not its path: a board trained by an edited recipe is another board
        return {
            **{name: getattr(self, name) for name in self.DEFINING},
            "recipe": json.loads(json.dumps(read_recipe(self.recipe))),
        }

    def extra_fields(self) -> dict:
        return config_fields(self.fields)


@dataclass(frozen=True)
class Cell:
    variant: str
    positions: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.variant}-{self.positions}-seed{self.seed}"


def default_positions(variant: str) -> str:
    return get_variant(variant).config_class().position_embedding_type


def configurations(setup: QualitySetup) -> list[tuple[str, str]]:
    """(variant, position type) pairs: every variant at its default, then the position sweep's others."""
    unknown = [name for name in [*setup.variants, setup.position_variant, setup.reference] if name not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {' '.join(unknown)}: registered are {' '.join(VARIANTS)}")
    supported = get_variant(setup.position_variant).position_types
    refused = [p for p in setup.positions if p not in supported]
    if refused:
        raise SystemExit(f"--positions {' '.join(refused)}: {setup.position_variant} supports {' '.join(supported)}")
    sweep = [p for p in setup.positions if p != default_positions(setup.position_variant)]
    pairs = []
    for variant in setup.variants:
        pairs.append((variant, default_positions(variant)))
        if variant == setup.position_variant:  # the sweep beside its default, so the two are read together
            pairs += [(variant, p) for p in sweep]
    if setup.position_variant not in setup.variants:
        pairs += [(setup.position_variant, p) for p in setup.positions]
    return pairs


def plan(setup: QualitySetup) -> list[Cell]:
    """Configuration-major: a board stopped early has each finished configuration at every seed, so its noise is
    measured and its claims can be judged, instead of everything at one seed and nothing judged."""
    return [Cell(variant, positions, seed) for variant, positions in configurations(setup) for seed in setup.seeds]


def non_embedding_count(variant: str, fields: dict) -> int:
    """Non-embedding parameters of a model of `fields`, counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model = get_variant(variant).build("small", **fields)
    return non_embedding_parameters(model)


def base_fields(setup: QualitySetup, variant: str, positions: str, vocab_size: int, block_size: int) -> dict:
    """The config fields of a cell before the MLP is matched: the board's shape, the position type, `--fields` where
    the variant has them, and the positions the model is built for (see the module's docstring)."""
    entry = get_variant(variant)
    fields = {"hidden_size": setup.hidden_size, "num_hidden_layers": setup.num_hidden_layers, "vocab_size": vocab_size}
    heads = entry.preset("small").get("num_attention_heads")
    if heads is not None:
        # as many heads as the reference's presets give it, scaled: differential's presets halve them (a head has two
        # query/key maps of the same width, as in the paper), so its heads stay as wide as the others'
        reference = get_variant(setup.reference).preset("small")["num_attention_heads"]
        if setup.num_attention_heads * heads % reference:
            raise ValueError(
                f"{variant}: --num_attention_heads {setup.num_attention_heads} gives it {heads}/{reference} as many, "
                f"not a whole number; pick a multiple of {reference // math.gcd(heads, reference)}"
            )
        fields["num_attention_heads"] = setup.num_attention_heads * heads // reference
    defaults = entry.config_class()
    fields |= {name: value for name, value in setup.extra_fields().items() if hasattr(defaults, name)}
    fields["position_embedding_type"] = positions
    # the board's training speeds were measured with the zoo's fused head + loss (an opt-in since): every cell alike
    fields["fuse_linear_cross_entropy"] = True
    longest = max([block_size, *setup.lengths])
    sized_by_length = non_embedding_count(variant, {**fields, "max_position_embeddings": block_size}) != (
        non_embedding_count(variant, {**fields, "max_position_embeddings": longest})
    )
    fields["max_position_embeddings"] = block_size if sized_by_length else longest
    return fields


def match_parameters(variant: str, fields: dict, target: int) -> tuple[dict, int]:
    """`fields` with the `intermediate_size` that brings the non-embedding parameters closest to `target` (they are
    linear in it), and the count reached; `ValueError` naming the variant where no MLP width gets within 10%."""
    start = get_variant(variant).config("small", **fields).intermediate_size
    at_start = non_embedding_count(variant, {**fields, "intermediate_size": start})
    per_unit = (non_embedding_count(variant, {**fields, "intermediate_size": start + 64}) - at_start) / 64
    width = round((start + (target - at_start) / per_unit) / MLP_MULTIPLE) * MLP_MULTIPLE
    if width < MLP_MULTIPLE:
        raise ValueError(
            f"{variant}: its attention alone has more parameters than the reference's whole layers ({at_start:,} at "
            f"an MLP of {start}, target {target:,}); pick a larger --reference or a smaller variant config"
        )
    matched = {**fields, "intermediate_size": width}
    count = non_embedding_count(variant, matched)
    if abs(count / target - 1) > MATCH_TOLERANCE:
        raise ValueError(f"{variant}: {count:,} non-embedding parameters, more than 10% from the target {target:,}")
    return matched, count


def cell_fields(setup: QualitySetup, cell: Cell, vocab_size: int, block_size: int) -> tuple[dict, int, int]:
    """(config fields, non-embedding parameters, the target they match) of a cell."""
    reference = base_fields(setup, setup.reference, default_positions(setup.reference), vocab_size, block_size)
    target = non_embedding_count(setup.reference, reference)
    fields = base_fields(setup, cell.variant, cell.positions, vocab_size, block_size)
    matched, count = match_parameters(cell.variant, fields, target)
    return matched, count, target


def cache_bytes_per_token(model, tokens: int) -> float:
    """Bytes the cache holds per token after a prefill of `tokens` (random ids), on the model's architecture; where
    its positions end sooner, on a fresh copy built for `tokens` positions (the cache does not depend on weights)."""
    config = model.config
    if config.max_position_embeddings < tokens:
        config = type(config).from_dict({**config.to_dict(), "max_position_embeddings": tokens})
        model = type(model)._from_config(config)
    input_ids = torch.randint(0, config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = returned_cache(model.eval()(input_ids, use_cache=True))
    return cache_nbytes(cache) / tokens


def read_texts(files: list[str]) -> list[str]:
    return [Path(f).read_text(encoding="utf-8") for f in files]


def ood_texts(ood_dir: str, chars: int) -> list[str]:
    """The first `chars` characters of every work (cut at a line end), in file-name order."""
    files = sorted(Path(ood_dir).glob("*.txt"))
    if not files:
        raise SystemExit(f"no texts (*.txt) in --ood_dir {ood_dir}: fetch Shakespeare's works there (README)")
    texts = []
    for path in files:
        text = path.read_text(encoding="utf-8")
        cut = text.rfind("\n", 0, chars)
        texts.append(text[: cut if cut > 0 else chars])
    return texts


def board_tokenizer(setup: QualitySetup, train_files: list[str], vocab_size: int):
    """The board's one tokenizer: a byte-level BPE trained on the training addresses, kept in the output folder (a
    resumed board must tokenize as it began)."""
    folder = Path(setup.output_dir) / "tokenizer"
    if not folder.is_dir():
        tokenizer = train_byte_level_bpe(read_texts(train_files), vocab_size)
        tokenizer.save_pretrained(folder)
    return folder, AutoTokenizer.from_pretrained(folder)


def score(model, tokenizer, texts: list[str], length: int) -> dict:
    result = score_texts(model, tokenizer, texts, max_length=length, stride=max(1, length // 2), batch_size=8)
    return {"perplexity": round(result.perplexity, 4), "bits_per_byte": round(result.bits_per_byte, 5)}


def run_cell(setup: QualitySetup, cell: Cell, data: dict) -> dict:
    """Train one cell by the recipe, score it, and return its row."""
    start = time.perf_counter()
    _, data_args, training_args = load_recipe(setup.recipe, setup.overrides)
    fields, parameters, target = cell_fields(setup, cell, len(data["tokenizer"]), data_args.block_size)
    run_dir = Path(setup.output_dir) / "cells" / cell.name
    tokens_per_step = (
        training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps * data_args.block_size
    )
    steps = max(1, math.ceil(setup.budget / tokens_per_step))
    overrides = ["--model.variant", cell.variant, "--model.config", json.dumps(fields)]
    overrides += ["--data.train_files", *data["train"], "--data.validation_files", *data["validation"]]
    overrides += ["--data.tokenizer", str(data["tokenizer_dir"]), "--training.max_steps", str(steps)]
    overrides += ["--training.seed", str(cell.seed), "--training.output_dir", str(run_dir), *setup.overrides]
    summary = run_training(*load_recipe(setup.recipe, overrides))
    final = Path(summary["final_model"])
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    tokenizer = data["tokenizer"]
    block = data_args.block_size
    extrapolation = {}
    for length in setup.lengths:
        try:
            extrapolation[str(length)] = score(model, tokenizer, data["test"], length)
        except ValueError as error:  # beyond a table of positions: the model's (or the harness's) reason
            extrapolation[str(length)] = {"refused": one_line(error)}
    test = extrapolation.get(str(block)) or score(model, tokenizer, data["test"], block)
    row = {
        "cell": cell.name,
        "variant": cell.variant,
        "positions": cell.positions,
        "seed": cell.seed,
        "parameters": sum(p.numel() for p in model.parameters()),
        "non_embedding_parameters": parameters,
        "reference_parameters": target,
        "intermediate_size": fields["intermediate_size"],
        "max_position_embeddings": fields["max_position_embeddings"],
        "train_tokens": summary["train_tokens"],
        "steps": summary["steps"],
        "train_seconds": summary["seconds"],
        "tokens_per_second": summary["tokens_per_second"],
        "validation_perplexity": summary["validation_perplexity"],
        "test_perplexity": test["perplexity"],
        "test_bits_per_byte": test["bits_per_byte"],
        **{f"ood_{k}": v for k, v in score(model, tokenizer, data["ood"], block).items()},
        "extrapolation": extrapolation,
        "cache_bytes_per_token": cache_bytes_per_token(model, setup.cache_tokens),
    }
    if not setup.keep_models:
        shutil.rmtree(run_dir, ignore_errors=True)
    return {**row, "cell_seconds": round(time.perf_counter() - start, 1)}


def run_board(setup: QualitySetup, log: Callable[[str], None] = print) -> list[dict]:
    """Train and score every unfinished cell, saving each at once; then the table, claims and plots."""
    cells = plan(setup)
    if setup.budget < 1:
        raise SystemExit(f"--budget {setup.budget}: give the training tokens per cell (>= 1)")
    splits = split_by_year(setup.data_dir)
    board = Board(setup)
    _, data_args, _ = load_recipe(setup.recipe, setup.overrides)
    tokenizer_dir, tokenizer = board_tokenizer(setup, splits["train"], data_args.vocab_size)
    log(f"{'variant':15s} {'positions':11s} {'MLP':>5s} {'non-embedding parameters':>25s}")
    for variant, positions in configurations(setup):  # the matching printed, and an unmatchable board refused at once
        try:
            fields, count, target = cell_fields(
                setup, Cell(variant, positions, 0), len(tokenizer), data_args.block_size
            )
        except ValueError as error:
            raise SystemExit(one_line(error)) from None
        log(f"{variant:15s} {positions:11s} {fields['intermediate_size']:5d} {count:15,d} ({count / target - 1:+.1%})")
    data = {
        **splits,
        "tokenizer_dir": tokenizer_dir,
        "tokenizer": tokenizer,
        "test": read_texts(splits["test"]),
        "ood": ood_texts(setup.ood_dir, setup.ood_chars_per_work),
    }
    board.run(
        cells,
        run=lambda cell: run_cell(setup, cell, data),
        keys=lambda cell: {"variant": cell.variant, "positions": cell.positions, "seed": cell.seed},
        done=lambda row: f"test perplexity {row['test_perplexity']:.2f}, {row['cell_seconds'] / 60:.1f} min",
        write=lambda rows: write_board(setup, rows, log=lambda _: None),
        desc="quality board",
        log=log,
    )
    write_board(setup, board.rows, log=log)
    return board.rows


# ---------------------------------------------------------------------------------------------------------------
# Aggregation over seeds, the tables, the claims and the plots


def groups(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """Finished rows by (variant, positions), in the board's order."""
    grouped: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        if "error" not in row:
            grouped.setdefault((row["variant"], row["positions"]), []).append(row)
    return grouped


def values(grouped: dict, key: tuple[str, str], metric: str = "test_perplexity") -> list[float]:
    return [row[metric] for row in grouped.get(key, [])]


def extrapolated(grouped: dict, key: tuple[str, str], length: int) -> list[float] | str:
    """Perplexities at `length` over seeds, or the reason it was refused."""
    scores = [row["extrapolation"].get(str(length), {}) for row in grouped.get(key, [])]
    refused = [s["refused"] for s in scores if "refused" in s]
    return refused[0] if refused else [s["perplexity"] for s in scores if "perplexity" in s]


def reads_longer(grouped: dict, key: tuple[str, str], trained: int, long: int) -> tuple[bool | None, str]:
    """Whether a configuration scores windows of `long` tokens no worse than windows of `trained` beyond noise (None:
    not measured), and the numbers as text."""
    if key not in grouped:
        return None, f"{key[1]} not measured"
    at_long, at_trained = extrapolated(grouped, key, long), extrapolated(grouped, key, trained)
    if isinstance(at_long, str):
        return False, f"{key[1]} refused at {long} ({at_long})"
    reads = compare_seeds(at_long, at_trained) <= 0
    worse = "no worse than" if reads else "worse than"
    return reads, f"{key[1]} {figure(at_long)} at {long}, {worse} {figure(at_trained)} at {trained}"


def claims(rows: list[dict], setup: QualitySetup) -> list[tuple[str, str]]:
    """(claim, verdict with the numbers) for each claim of the papers the board checks: holds, does not hold at this
    scale, within noise, or not measured."""
    grouped = groups(rows)

    def key(variant: str) -> tuple[str, str]:
        return variant, default_positions(variant)

    def show(k: tuple[str, str]) -> str:
        return f"{k[0]} ({k[1]}) {figure(values(grouped, k))}"

    def missing(*keys: tuple[str, str]) -> str | None:
        absent = [f"{k[0]} ({k[1]})" for k in keys if k not in grouped]
        return f"not measured (no finished cell of {', '.join(absent)})" if absent else None

    def beats(a: tuple[str, str], b: tuple[str, str]) -> str:
        verdict = {-1: "holds", 1: "does not hold at this scale", 0: "within noise"}
        return f"{verdict[compare_seeds(values(grouped, a), values(grouped, b))]}: {show(a)} against {show(b)}"

    mha, single, mqa, gqa = key("mha"), key("single_head"), key("mqa"), key("gqa")
    between = missing(mha, gqa, mqa)
    if between is None:
        means = [statistics.fmean(values(grouped, k)) for k in (mha, gqa, mqa)]
        where = "between them" if min(means[0], means[2]) <= means[1] <= max(means[0], means[2]) else "outside"
        between = f"{beats(mha, mqa)}; GQA's mean lies {where}: {show(gqa)}"
    trained, long = min(setup.lengths), max(setup.lengths)
    pv = setup.position_variant
    alibi, alibi_text = reads_longer(grouped, (pv, "alibi"), trained, long)
    others = [reads_longer(grouped, (pv, p), trained, long) for p in ("sinusoidal", "learned")]
    if alibi is None or any(reads is None for reads, _ in others):
        extrapolation = "not measured"
    else:
        extrapolation = "holds" if alibi and not any(reads for reads, _ in others) else "does not hold at this scale"
    extrapolation += ": " + "; ".join([alibi_text, *(text for _, text in others)])

    def close_to(a: tuple[str, str], b: tuple[str, str], within: float) -> tuple[str, str]:
        """(verdict, text): "holds" where a's mean is at most `within` above b's; further off, overlapping seeds
        cannot tell (within noise) and apart ones say no."""
        if (absent := missing(a, b)) is not None:
            return "not measured", absent
        gap = statistics.fmean(values(grouped, a)) / statistics.fmean(values(grouped, b)) - 1
        if gap <= within:
            verdict = "holds"
        elif compare_seeds(values(grouped, a), values(grouped, b)) <= 0:
            verdict = "within noise"
        else:
            verdict = "does not hold at this scale"
        return verdict, f"{show(a)} against {show(b)}, {gap:+.1%}"

    def all_of(verdicts: list[tuple[str, str]]) -> str:
        """One verdict over several comparisons: the worst of them, then each comparison with its own."""
        order = ["does not hold at this scale", "not measured", "within noise", "holds"]
        worst = min((verdict for verdict, _ in verdicts), key=order.index)
        return f"{worst}: " + "; ".join(f"{text} ({verdict})" for verdict, text in verdicts)

    def one(verdict: tuple[str, str]) -> str:
        return f"{verdict[0]}: {verdict[1]}" if verdict[0] != "not measured" else verdict[1]

    linformer = key("linformer")
    close = one(close_to(linformer, gqa, 0.05))
    absolute = all_of([close_to((pv, p), (pv, "rope"), 0.10) for p in ("sinusoidal", "learned")])
    differential = one(close_to(key("differential"), gqa, 0.10))
    # linear attention has no RoPE (its feature map would lose the rotation's relative form): against full attention
    # with the board's positions and without any, the comparison that isolates the softmax
    linear = all_of([close_to(key("linear"), gqa, 0.10), close_to(key("linear"), (pv, "none"), 0.10)])
    bigbird = one(close_to(key("bigbird"), gqa, 0.05))
    mamba = one(close_to(key("mamba"), gqa, 0.0))
    return [
        (
            "Multi-head attention beats one head of the same width (Vaswani et al. 2017)",
            missing(mha, single) or beats(mha, single),
        ),
        ("MQA loses quality against MHA, and GQA sits between them (Ainslie et al. 2023)", between),
        (
            f"ALiBi reads sequences longer than it was trained on ({trained} -> {long} tokens), sinusoidal and "
            "learned positions do not (Press et al. 2022)",
            extrapolation,
        ),
        (
            "AFT-local beats AFT-simple (Zhai et al. 2021)",
            missing(key("aft_local"), key("aft_simple")) or beats(key("aft_local"), key("aft_simple")),
        ),
        (
            "Linformer comes close to full attention (Wang et al. 2020): its mean at most 5% above gqa of the same "
            "heads",
            close,
        ),
        (
            "Sinusoidal and learned positions train within about 10% of rotary ones at the training length (Press et "
            "al. 2022: sinusoidal, rotary, T5 bias and ALiBi within a few percent; Su et al. 2021)",
            absolute,
        ),
        (
            "Differential attention trains within about 10% of a Transformer of the same parameters (Ye et al. 2024 "
            "find it better from 830M parameters up; a 162M replication finds it 3-4% worse)",
            differential,
        ),
        (
            "Linear attention trains close to softmax attention (Katharopoulos et al. 2020: comparable quality at a "
            "constant-size state): its mean at most 10% above gqa's, with RoPE and without positions",
            linear,
        ),
        (
            "BigBird's block-sparse attention comes close to full attention (Zaheer et al. 2020): its mean at most 5% "
            "above gqa's",
            bigbird,
        ),
        (
            "Mamba matches a Transformer of the same parameters in language modelling (Gu & Dao 2023, Fig. 4): its "
            "mean no higher than gqa's",
            mamba,
        ),
    ]


def board_table(rows: list[dict], setup: QualitySetup, before: dict | None = None) -> str:
    """The tables and claims; with `before` (before.json: rows a fix replaced and the fix of each configuration),
    a section of those configurations' numbers before and after."""
    grouped = groups(rows)
    failed = [row for row in rows if "error" in row]
    lines = [
        f"Quality board: every cell trained on {setup.budget / 1e6:g}M tokens of the State of the Union addresses "
        f"(up to 2000) by configs/train/quality_board.yaml at {setup.num_hidden_layers} x {setup.hidden_size}; "
        f"non-embedding parameters matched to {setup.reference}'s through the MLP width. Test: 2011-2021 addresses; "
        "out of domain: Shakespeare. Mean ± standard deviation over the seeds (n).",
        "",
        "| variant | positions | n | non-emb. params | MLP | test ppl | test bits/byte | Shakespeare ppl | "
        "cache B/token | train tokens/s | train min |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for (variant, positions), cells in grouped.items():
        first = cells[0]
        lines.append(
            f"| {variant} | {positions} | {len(cells)} | {first['non_embedding_parameters']:,} | "
            f"{first['intermediate_size']} | {figure(values(grouped, (variant, positions)))} | "
            f"{figure(values(grouped, (variant, positions), 'test_bits_per_byte'), 3)} | "
            f"{figure(values(grouped, (variant, positions), 'ood_perplexity'), 1)} | "
            f"{first['cache_bytes_per_token']:,.0f} | "
            f"{figure(values(grouped, (variant, positions), 'tokens_per_second'), 0)} | "
            f"{figure([r['train_seconds'] / 60 for r in cells], 1)} |"
        )
    lines += [
        "",
        f"Extrapolation: trained on {min(setup.lengths)} tokens, test perplexity with windows of L every L/2.",
        "",
        "| variant | positions | " + " | ".join(f"L = {n}" for n in setup.lengths) + " |",
        "| --- | --- | " + " | ".join("---:" for _ in setup.lengths) + " |",
    ]
    for key in grouped:
        scored = [extrapolated(grouped, key, n) for n in setup.lengths]
        lines.append(
            f"| {key[0]} | {key[1]} | "
            + " | ".join("refused" if isinstance(s, str) else figure(s) for s in scored)
            + " |"
        )
    lines += ["", "Claims of the papers, checked (A beats B only where the seeds' ranges do not overlap):", ""]
    lines += [f"- **{claim}**: {verdict}." for claim, verdict in claims(rows, setup)]
    if before:
        lines += before_and_after(grouped, before)
    if failed:
        lines += ["", "Failed cells (a rerun tries them again):", ""]
        lines += [f"- {row['cell']}: {row['error']}" for row in failed]
    return "\n".join(lines)


def before_and_after(grouped: dict, before: dict) -> list[str]:
    """Lines of the configurations a fixed defect changed: test perplexity before (the replaced rows) and after."""
    old = groups(before["rows"])
    lines = [
        "",
        "Cells rerun after a fix (before: the rows the fix replaced, kept in before.json):",
        "",
        "| variant | positions | fix | test ppl before | test ppl after |",
        "| --- | --- | --- | ---: | ---: |",
    ]
    for key in old:
        fix = before["fixes"][f"{key[0]} {key[1]}"]
        now = figure(values(grouped, key)) or "not rerun yet"
        lines.append(f"| {key[0]} | {key[1]} | {fix} | {figure(values(old, key))} | {now} |")
    return lines


def configuration_label(variant: str, positions: str) -> str:
    return variant if positions == default_positions(variant) else f"{variant} ({positions})"


def plot_against(rows: list[dict], path: Path, x_of: Callable[[list[dict]], float], x_label: str, log_x: bool) -> bool:
    """Test perplexity (mean, a bar of one standard deviation) of every configuration against `x_of(its rows)`, each
    point named where its name overlaps no other (configurations of one cache size sit in one column)."""
    plt = headless_pyplot()
    grouped = groups(rows)
    if plt is None or not grouped:
        return False
    with house_style():
        fig, axis = plt.subplots(figsize=(9, 6))
        points, labels, colours, spans = [], [], [], []
        for (variant, positions), cells in grouped.items():
            mean, spread = mean_spread([r["test_perplexity"] for r in cells])
            x = x_of(cells)
            style = POSITION_STYLES.get(positions, {})
            axis.errorbar([x], [mean], yerr=[spread], fmt=style.get("marker", "o"), color=colour(variant))
            points.append((x, mean))
            labels.append(configuration_label(variant, positions))
            colours.append(colour(variant))
            spans.append((mean - spread, mean + spread))
        if log_x:
            axis.set_xscale("log")
        axis.margins(x=0.12, y=0.08)  # room for the names of the outermost points
        axis.set_xlabel(x_label)
        axis.set_ylabel("test perplexity (per token, State of the Union 2011-2021)")
        axis.set_title("mean of the seeds, bar: one standard deviation; marker: position type (circle: default)")
        place_labels(axis, points, labels, colours, spans)
        save_figure(fig, path)
    return True


def plot_extrapolation(rows: list[dict], lengths: list[int], path: Path) -> bool:
    """Test perplexity against the scored window length, one line per configuration: colour by variant, line and
    marker by position type; the legend outside the axes, where it covers no line."""
    plt = headless_pyplot()
    grouped = groups(rows)
    if plt is None or not grouped:
        return False
    with house_style():
        fig, axis = plt.subplots(figsize=(10, 5.5), layout="constrained")
        for key in grouped:
            points = [(n, extrapolated(grouped, key, n)) for n in lengths]
            points = [(n, statistics.fmean(s)) for n, s in points if not isinstance(s, str) and s]
            if len(points) > 1:
                style = POSITION_STYLES.get(key[1], {"marker": "o"})
                axis.plot(*zip(*points), color=colour(key[0]), label=f"{key[0]} ({key[1]})", **style)
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        ticks_at(axis.xaxis, lengths)
        axis.set_xlabel(f"scored window length (tokens; trained on {min(lengths)})")
        axis.set_ylabel("test perplexity (per token)")
        axis.set_title("extrapolation: windows of L tokens every L/2, mean of the seeds")
        fig.legend(loc="outside right upper", title="variant (positions)")
        save_figure(fig, path)
    return True


def board_figures(board: dict) -> dict[str, Callable[[Path], bool]]:
    """The board's figures from board.json's contents (`{"defining": ..., "rows": ...}`), for a run and `--replot`."""
    rows, defining = board["rows"], board["defining"]
    return {
        "frontier.png": lambda path: plot_against(
            rows,
            path,
            lambda cells: cells[0]["cache_bytes_per_token"],
            f"cache (bytes per token, after {defining['cache_tokens']} tokens)",
            True,
        ),
        "walltime.png": lambda path: plot_against(
            rows,
            path,
            lambda cells: statistics.fmean(r["train_seconds"] / 60 for r in cells),
            "training wall time (minutes, 2 CPU cores)",
            False,
        ),
        "extrapolation.png": lambda path: plot_extrapolation(rows, defining["lengths"], path),
    }


def write_board(setup: QualitySetup, rows: list[dict], log: Callable[[str], None] = print) -> None:
    """board.md (the tables and the claims) and the plots, from the rows so far."""
    folder = Path(setup.output_dir)
    before = json.loads((folder / "before.json").read_text()) if (folder / "before.json").is_file() else None
    table = board_table(rows, setup, before)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "board.md").write_text(table + "\n")
    drawn = draw_figures(folder, board_figures({"defining": setup.defining(), "rows": rows}))
    log(table)
    log(f"written to {folder}: board.json, board.md, {', '.join(drawn)}")


BENCHMARKS = {"quality": Benchmark(QualitySetup, run_board, figures=board_figures, results="board")}

if __name__ == "__main__":
    sys.exit(main(BENCHMARKS))
