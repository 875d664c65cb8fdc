"""What a translation board is: its options (`TranslationSetup`: the corpus split, the cells, the recipe, the
scoring), its cells (`Cell`: one family, configuration and seed) in the order they run (`plan`), and the source-length
buckets its rows are scored by. The board runs them (board.py), the claims read its rows (claims.py), the report
draws and tabulates them (report.py)."""

from dataclasses import dataclass, field
from pathlib import Path

from experiments.common import REPOSITORY, Results, config_fields
from hf_attn_zoo.convert.calibrated import CALIBRATION_METHODS

STUDY = Path(__file__).resolve().parent
# how an uptraining cell repairs its conversion: cross-entropy, attention transfer, transfer then distillation
REPAIRS = ("ce", "transfer", "transfer_distill")


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
        default_factory=lambda: ["mha", "gqa", "mqa"],
        metadata={"help": "Transformer cells: mha, gqa, mqa (decoder self + cross pooled), additive cross-attention"},
    )
    natives: list[str] = field(
        default_factory=lambda: ["marian"],
        metadata={"help": "transformers' own encoder-decoders trained as controls of the MHA Transformer: marian"},
    )
    encoders: list[str] = field(
        default_factory=list,
        metadata={
            "help": "variants trained as whole encoder-decoders under MHA cross-attention: sliding_window, "
            "linformer, aft_simple, topk, ... (none by default: results/board_300k has them at the earlier scale)"
        },
    )
    uptrain_methods: list[str] = field(
        default_factory=lambda: ["mean", "grouped_aligned"],
        metadata={"help": f"MHA -> GQA/MQA conversions: mean, first, random, {', '.join(CALIBRATION_METHODS)}"},
    )
    repairs: list[str] = field(
        default_factory=lambda: list(REPAIRS),
        metadata={
            "help": "how an uptraining cell at alpha > 0 repairs its conversion with alpha of the parent's tokens: ce "
            "(cross-entropy uptraining), transfer (attention transfer alone: the decoder's self- and "
            "cross-attention trained on the parent's outputs), transfer_distill (transfer, then distillation from "
            "the parent); the last two for mean pooling"
        },
    )
    distill_temperature: float = field(default=2.0, metadata={"help": "temperature of the transfer_distill cells"})
    alphas: list[float] = field(
        default_factory=lambda: [0.0, 0.05], metadata={"help": "uptraining steps as a fraction of the parent's"}
    )
    recipe: str = field(
        default="configs/train/bible_en_es_transformer.yaml",
        metadata={
            "help": "training recipe of the Transformer, native and encoder cells: its training section and "
            "its model config (the layout), at the board's sizes"
        },
    )
    rnn_recipe: str = field(
        default="configs/train/bible_en_es_rnn.yaml",
        metadata={"help": "training recipe of the RNN cells: its training section and its model preset"},
    )
    cells_dir: str = field(
        default="", metadata={"help": "where the cells' runs train and save their models (default: output_dir/cells)"}
    )
    budget: int = field(default=2_000_000, metadata={"help": "training tokens (source + target) per cell"})
    hidden_size: int = field(default=256, metadata={"help": "width of every model (the RNN's embedding)"})
    num_layers: int = field(default=3, metadata={"help": "encoder layers and decoder layers of a Transformer"})
    num_attention_heads: int = field(default=4, metadata={"help": "query heads of every Transformer"})
    gqa_key_value_heads: int = field(default=2, metadata={"help": "key/value heads of GQA (decoder)"})
    vocab_size: int = field(default=8000, metadata={"help": "the shared BPE's vocabulary"})
    max_length: int = field(default=64, metadata={"help": "longest source / target in tokens (longer pairs dropped)"})
    warmup_fraction: float = field(
        default=0.3,
        metadata={
            "help": "warm-up steps as a fraction of a run's (a tenth left the post-norm Transformer at 943 steps "
            "unable to read its source: docs/translation.md)"
        },
    )
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
        "recipe",
        "rnn_recipe",
        "budget",
        "hidden_size",
        "num_layers",
        "num_attention_heads",
        "gqa_key_value_heads",
        "vocab_size",
        "max_length",
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

    @property
    def recipe_path(self) -> str:
        return repository_path(self.recipe)

    @property
    def rnn_recipe_path(self) -> str:
        return repository_path(self.rnn_recipe)


def repository_path(path: str) -> str:
    """A path option as given where it exists (or is absolute), else under the repository: the recipes' defaults,
    stored relative so that a board resumes from another clone."""
    return str(Path(path) if Path(path).is_absolute() or Path(path).exists() else REPOSITORY / path)


@dataclass(frozen=True)
class Cell:
    family: str  # rnn, transformer, native, encoder, parent, uptrain
    config: str  # bahdanau, mha, sliding_window, gqa-mean-0.05, ...
    seed: int

    @property
    def name(self) -> str:
        return f"{self.family}-{self.config}-seed{self.seed}"


def uptrain_config(target: str, method: str, alpha: float, repair: str = "ce") -> str:
    """`gqa-mean-0.05`; another repair than cross-entropy joins the method: `mqa-mean+transfer-0.05`."""
    return f"{target}-{method if repair == 'ce' else f'{method}+{repair}'}-{alpha:g}"


def plan(setup: TranslationSetup) -> list[Cell]:
    """Configuration-major (a board stopped early has whole configurations at every seed), the uptraining last: its
    parent comes after the board's own cells, its conversions after the parent."""
    unknown = [m for m in setup.uptrain_methods if m not in ("mean", "first", "random", *CALIBRATION_METHODS)]
    if unknown:
        raise SystemExit(f"--uptrain_methods {' '.join(unknown)}: unknown conversion method(s)")
    if set(setup.repairs) - set(REPAIRS):
        raise SystemExit(f"--repairs {' '.join(setup.repairs)}: use {', '.join(REPAIRS)}")
    if set(setup.natives) - {"marian"}:
        raise SystemExit(f"--natives {' '.join(setup.natives)}: the native control is marian")
    cells = [Cell("rnn", attention, seed) for attention in setup.rnns for seed in setup.seeds]
    cells += [Cell("transformer", kind, seed) for kind in setup.cross_attentions for seed in setup.seeds]
    cells += [Cell("native", name, seed) for name in setup.natives for seed in setup.seeds]
    cells += [Cell("encoder", variant, seed) for variant in setup.encoders for seed in setup.seeds]
    if setup.uptrain_methods and setup.alphas:
        cells.append(Cell("parent", "mha", setup.seeds[0]))
        for target in ("gqa", "mqa"):
            for method in setup.uptrain_methods:
                for alpha in setup.alphas:
                    seeds = setup.seeds if alpha > 0 else setup.seeds[:1]  # the conversion alone is deterministic
                    cells += [Cell("uptrain", uptrain_config(target, method, alpha), seed) for seed in seeds]
        # attention transfer and distillation (LoLCATs' two stages) on the same tokens, after every ce cell
        for target in ("gqa", "mqa"):
            for repair in [r for r in setup.repairs if r != "ce"]:
                for alpha in [a for a in setup.alphas if a > 0]:
                    config = uptrain_config(target, "mean", alpha, repair)
                    cells += [Cell("uptrain", config, seed) for seed in setup.seeds]
    return cells


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
