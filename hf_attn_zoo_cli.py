"""`hf-attn-zoo`: the command line.

    hf-attn-zoo list                      the registered variants
    hf-attn-zoo train CONFIG [overrides]  train from a YAML recipe (configs/train/*.yaml), `--training.max_steps 100`
    hf-attn-zoo eval MODEL --data FILE... perplexity, bits per byte and word perplexity of any causal LM
    hf-attn-zoo translate MODEL [TEXT ...] [--file F] [--num_beams 4]   translations, one per line (stdin without
                                          texts: transformers 5 has no translation pipeline)
    hf-attn-zoo translate-eval MODEL --data PAIRS... [--num_beams 4]   BLEU, chrF and the references' perplexity
    hf-attn-zoo lm-eval-task --data FILE... --out DIR   an lm-evaluation-harness task over local files
    hf-attn-zoo attention CHECKPOINT TEXT --out map.png [--layer L] [--head H]   one head's attention heatmap (a
                                          translator: its cross-attention over the source, per head)
    hf-attn-zoo convert SRC OUT --to gqa|mqa [--num_key_value_heads G] [--method mean]   pool key/value heads
    hf-attn-zoo convert SRC OUT --to VARIANT --transfer --tokens N --data FILE...   any variant, each attention
                                          layer trained to reproduce the original's
    hf-attn-zoo export CKPT --to native|llama|qwen2|mistral|deepseek_v3|mamba|gguf OUT [--dtype q8_0]   the native
                                          transformers model (no remote code) or a GGUF file for llama.cpp
    hf-attn-zoo import CKPT OUT           a Llama, Mistral, Qwen2, dense DeepSeek, Mamba checkpoint as its zoo variant
    hf-attn-zoo push CHECKPOINT REPO [--revision R] [--private]   upload a saved checkpoint to the Hugging Face Hub
    hf-attn-zoo serve CHECKPOINT [--port P] [--continuous_batching]   transformers' OpenAI-compatible server
    hf-attn-zoo demo [options]            the main job: train a small model on Python's standard library, score it,
                                          generate a sample, save and reload it

Each command is one entry of `COMMANDS`: its help line, the dataclass of its arguments and the function it runs,
named `module:function` (they live in `hf_attn_zoo.cli`). Options are the dataclass's fields, parsed by
transformers' `HfArgumentParser`: `--max_length 512`, and `--max-length 512` as well; a field marked `positional` is
given by position (`eval MODEL`). `train` passes its arguments on to the recipe loader (`--section.field value`
overrides). The experiments (benchmarks and studies) are not commands of the package: they run from a checkout of
the repository, `python -m experiments NAME`.

This module sits beside the `hf_attn_zoo` package, not in it, and imports the package only once a command runs:
`import hf_attn_zoo` registers every variant with transformers' Auto classes, which imports torch and transformers'
modeling code (about 5 s on 2 cores), and answering `--help`, `--version` or a misspelt option needs none of that.

A user's mistake (`hf_attn_zoo.errors.UserError`: a bad recipe, path or value) is printed as one line on stderr
with exit status 2, as argparse does for a bad option; any other exception is a bug and keeps its traceback.
"""

import argparse
import dataclasses
import functools
import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Literal, get_args, get_origin

from transformers import HfArgumentParser

PROG = "hf-attn-zoo"


def positional(help: str, **kwargs) -> dataclasses.Field:
    """A dataclass field given on the command line by position (`hf-attn-zoo eval MODEL`), not as `--name`."""
    return field(metadata={"positional": True, "help": help}, **kwargs)


def load(target: str) -> Callable:
    """The function `module:function` names, imported now."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


class CommandParser(HfArgumentParser):
    """`HfArgumentParser` that adds the fields marked `positional` as positional arguments (optional ones when the
    field has a default); others become `--field_name` (and `--field-name`), as HfArgumentParser makes them.
    `epilog_from` (`module:function`) gives an epilog that needs the package, built only when help is printed."""

    def __init__(self, *args, epilog_from: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.epilog_from = epilog_from

    def format_help(self) -> str:
        if self.epilog_from is not None:
            self.epilog = load(self.epilog_from)()
        return super().format_help()

    @staticmethod
    def _parse_dataclass_field(parser: argparse.ArgumentParser, field: dataclasses.Field) -> None:
        # HfArgumentParser resolves each field's type and hands it here, one field at a time
        if not field.metadata.get("positional"):
            return HfArgumentParser._parse_dataclass_field(parser, field)
        kind = next((t for t in get_args(field.type) if t is not type(None)), field.type)  # `str | None` -> str
        if get_origin(field.type) is list:  # any number of them, none included (`translate CKPT [TEXT ...]`)
            parser.add_argument(field.name, type=kind, nargs="*", help=field.metadata["help"])
            return
        optional = {"nargs": "?", "default": field.default} if field.default is not dataclasses.MISSING else {}
        parser.add_argument(field.name, type=kind, help=field.metadata["help"], **optional)


@dataclass(frozen=True)
class Command:
    """One command: its help line, what it runs and the dataclass of its arguments.

    `run` names the function (`module:function`, called with `args` first): it gets the parsed dataclass (None
    where `options` is None) and may return an exit status. With `passes_through`, it gets the words after the
    command's name and parses them itself; the parser built here then only answers `--help` (unless `parser` turns
    that off too). `parser`: more arguments of its parser (usage, epilog, epilog_from); `subcommands`: commands under
    this one (`bench llama`)."""

    help: str
    run: str | None = None
    options: type | None = None
    passes_through: bool = False
    args: tuple = ()
    parser: dict = field(default_factory=dict)
    subcommands: dict[str, "Command"] = field(default_factory=dict)

    def function(self) -> Callable[..., int | None]:
        """The function the command runs, imported now (this imports the package)."""
        return functools.partial(load(self.run), *self.args)


# the options of each command


@dataclass
class EvalOptions:
    model: str = positional("checkpoint folder or Hub name (zoo or any AutoModelForCausalLM)")
    data: list[str] = field(metadata={"help": "text files or directories to score"})
    max_length: int | None = field(
        default=None,
        metadata={
            "help": "tokens per window (default: the model's max_position_embeddings); a longer window is refused, "
            "except for positions that extrapolate by design (alibi, none), which are scored with a notice"
        },
    )
    stride: int | None = field(default=None, metadata={"help": "tokens between windows, at most max_length (default)"})
    batch_size: int = field(default=1, metadata={"help": "windows per forward"})
    max_chars: int | None = field(default=None, metadata={"help": "score only the first N characters of each"})
    trust_remote_code: bool = field(default=False, metadata={"help": "run the code saved with the model"})
    gguf_file: str | None = field(default=None, metadata={"help": "GGUF file inside MODEL"})
    json: bool = field(default=False, metadata={"help": "print one JSON object"})


@dataclass
class TranslateEvalOptions:
    model: str = positional(
        "sequence-to-sequence checkpoint folder or Hub name (hf-attn-zoo train, model.task seq2seq)"
    )
    data: list[str] = field(metadata={"help": "pair files (.tsv, .csv, .jsonl) with a source and a target column"})
    source_field: str = field(default="source", metadata={"help": "source column (or key of a translation column)"})
    target_field: str = field(default="target", metadata={"help": "target (reference) column"})
    num_beams: int = field(default=1, metadata={"help": "1: greedy; more: beam search"})
    max_new_tokens: int | None = field(
        default=None, metadata={"help": "longest translation (default: the checkpoint's generation config)"}
    )
    max_source_length: int | None = field(
        default=None, metadata={"help": "refuse sources over this many tokens (the encoder's positions always)"}
    )
    batch_size: int = field(default=16, metadata={"help": "pairs per generate() call"})
    trust_remote_code: bool = field(default=False, metadata={"help": "run the code saved with the model"})
    json: bool = field(default=False, metadata={"help": "print one JSON object"})
    out: Path | None = field(default=None, metadata={"help": "also write the scores and the translations as JSON"})


@dataclass
class TranslateOptions:
    model: str = positional(
        "sequence-to-sequence checkpoint folder or Hub name (hf-attn-zoo train, model.task seq2seq)"
    )
    text: list[str] = positional("texts to translate, one translation per line (none: --file, else standard input)")
    file: Path | None = field(default=None, metadata={"help": "translate this file's lines instead"})
    num_beams: int | None = field(default=None, metadata={"help": "1: greedy (default: the checkpoint's)"})
    max_new_tokens: int | None = field(
        default=None, metadata={"help": "longest translation (default: twice the longest source in a batch, + 10)"}
    )
    batch_size: int = field(default=16, metadata={"help": "texts per generate() call"})
    trust_remote_code: bool = field(default=False, metadata={"help": "run the code saved with the model"})


@dataclass
class LmEvalTaskOptions:
    data: list[str] = field(metadata={"help": "text files or directories (one document per file)"})
    out: Path = field(metadata={"help": "folder for the task (lm_eval's --include_path)"})
    name: str = field(default="zoo_text", metadata={"help": "task name"})
    checkpoint: str = field(default="CHECKPOINT", metadata={"help": "model for the printed command"})


@dataclass
class AttentionOptions:
    checkpoint: str = positional("checkpoint folder or Hub name")
    text: str = positional("the text to attend over")
    out: Path = field(default=Path("attention.png"), metadata={"help": "image file to write"})
    layer: int = field(default=0, metadata={"help": "layer index (negative counts from the end)"})
    head: int | None = field(
        default=None,
        metadata={"help": "query head index (default: 0 for a language model, every head for a translator)"},
    )
    trust_remote_code: bool = field(default=False, metadata={"help": "run the code saved with the model"})


@dataclass
class ConvertOptions:
    src: str = positional("checkpoint folder or Hub name; with --gguf_file, the folder holding the file")
    out: Path = positional("output folder (model, tokenizer, model card)")
    to: Literal[
        "mha",
        "gqa",
        "mqa",
        "mla",
        "sliding_window",
        "linformer",
        "aft_full",
        "aft_local",
        "aft_simple",
        "topk",
        "additive",
        "differential",
        "linear",
        "bigbird",
    ] = field(
        metadata={
            "help": "gqa/mqa: key/value heads pooled; mla: a latent and a shared RoPE key per token (DeepSeek-V2); "
            "any other variant: the parent's projections copied where they mean the same (see --config), the rest "
            "fresh: follow with --transfer"
        }
    )
    num_key_value_heads: int | None = field(default=None, metadata={"help": "G for --to gqa"})
    method: Literal["mean", "first", "random", "aligned", "grouped", "grouped_aligned", "rorope"] | None = field(
        default=None,
        metadata={
            "help": "gqa/mqa: how heads are pooled (default mean; aligned, grouped and grouped_aligned are fitted "
            "on --calibration); mla: how the shared RoPE key is chosen (default rorope, TransMLA's principal "
            "axes; mean: the heads' mean first)"
        },
    )
    kv_lora_rank: int | None = field(default=None, metadata={"help": "--to mla: the latent's width"})
    qk_rope_head_dim: int | None = field(
        default=None, metadata={"help": "--to mla: the shared RoPE key's width (default head_dim: every frequency)"}
    )
    calibration: list[str] | None = field(
        default=None,
        metadata={
            "help": "text files, directories or globs the calibrated methods read (not your test text); "
            "optional for --to mla, where it weighs the fits"
        },
    )
    calibration_tokens: int = field(default=4096, metadata={"help": "read at most this many calibration tokens"})
    gguf_file: str | None = field(default=None, metadata={"help": "GGUF file inside SRC"})
    config: str | None = field(
        default=None,
        metadata={
            "help": "JSON mapping of the target's config fields, e.g. '{\"sliding_window\": 64}' (linformer_k, "
            "topk, additive_dim ...); the backbone stays the parent's"
        },
    )
    transfer: bool = field(
        default=False,
        metadata={
            "help": "attention transfer: train each converted attention layer to reproduce the parent's attention "
            "output on --data, one layer at a time (LoLCATs)"
        },
    )
    data: list[str] | None = field(
        default=None, metadata={"help": "text files, directories or globs --transfer learns from (not your test text)"}
    )
    tokens: int = field(default=60_000, metadata={"help": "read at most this many tokens of --data"})
    block_size: int = field(default=256, metadata={"help": "tokens per calibration row"})
    transfer_batch_size: int = field(default=1, metadata={"help": "rows per transfer step"})
    transfer_epochs: int = field(default=1, metadata={"help": "passes over the tokens per layer"})
    transfer_learning_rate: float = field(default=1e-3, metadata={"help": "Adam's learning rate for each layer"})
    distill: bool = field(
        default=False,
        metadata={
            "help": "then train the converted model end to end on the parent's next-token distribution over --data "
            "(--tokens of it), through the training path (convert.distill)"
        },
    )
    temperature: float = field(default=1.0, metadata={"help": "--distill: the temperature of the KL"})
    alpha: float = field(
        default=0.0,
        metadata={"help": "--distill: weight of the labels' cross-entropy (0 to 1; 1: cross-entropy uptraining)"},
    )
    topk: int | None = field(
        default=None, metadata={"help": "--distill: precompute the parent's top-k once instead of running it"}
    )
    lora_rank: int | None = field(
        default=None,
        metadata={
            "help": "--distill: train the MLPs only through LoRA updates of this rank (merged into the saved model), "
            "the embeddings and head frozen, the converted attention in full"
        },
    )
    learning_rate: float = field(
        default=5e-4,
        metadata={"help": "--distill: peak learning rate (cosine, warming up over the first twentieth of the steps)"},
    )
    batch_size: int = field(default=4, metadata={"help": "--distill: rows of --block_size tokens per step"})
    eval_data: list[str] | None = field(
        default=None,
        metadata={"help": "held-out text: the summary scores the parent and the converted model before/after on it"},
    )
    eval_max_chars: int | None = field(default=None, metadata={"help": "score only the first N characters of each"})
    eval_max_length: int | None = field(
        default=None, metadata={"help": "tokens per scoring window (default: the model's max_position_embeddings)"}
    )


@dataclass
class ExportOptions:
    checkpoint: str = positional("zoo checkpoint folder (as training, convert or save_pretrained wrote it)")
    out: Path = positional("output folder: new or empty (native: model, tokenizer, card; gguf: OUT/OUT.gguf)")
    to: Literal["native", "llama", "qwen2", "mistral", "deepseek_v3", "mamba", "gguf"] = field(
        default="native",
        metadata={
            "help": "native: the variant's own architecture (MHA family: llama, sliding window: mistral, mla: "
            "deepseek_v3, mamba: mamba); gguf: one file for llama.cpp / ollama with the tokenizer inside"
        },
    )
    dtype: str | None = field(
        default=None,
        metadata={"help": "gguf: f32, f16 (default) or q8_0; native: float32, float16 or bfloat16 (default: saved)"},
    )


@dataclass
class ImportOptions:
    checkpoint: str = positional("Llama, Mistral, Qwen2 or dense DeepSeek-V2/V3 checkpoint folder")
    out: Path = positional("output folder for the zoo checkpoint: new or empty")


@dataclass
class PushOptions:
    checkpoint: Path = positional("folder written by save_pretrained, training or convert")
    repo: str = positional("model repo id, NAMESPACE/NAME (created if missing)")
    revision: str | None = field(default=None, metadata={"help": "branch to push to (created from main if missing)"})
    private: bool = field(default=False, metadata={"help": "create the repo private (an existing one is kept as is)"})


@dataclass
class ServeOptions:
    checkpoint: str = positional("checkpoint folder (model and tokenizer, as save_pretrained writes them)")
    port: int = field(default=8000, metadata={"help": "port to listen on"})
    host: str = field(default="localhost", metadata={"help": "address to listen on"})
    continuous_batching: bool = field(
        default=False, metadata={"help": "transformers' continuous batching (paged attention); refused where inexact"}
    )
    attn_implementation: str | None = field(default=None, metadata={"help": "attention backend: eager, sdpa ..."})
    device: str = field(default="auto", metadata={"help": "auto, cpu, cuda:0 ..."})
    dtype: str = field(default="auto", metadata={"help": "weights dtype; auto: as saved"})
    trust_remote_code: bool = field(default=False, metadata={"help": "run the code saved with a non-zoo model"})
    log_level: str = field(default="warning", metadata={"help": "transformers' log level"})


@dataclass
class DemoOptions:
    variant: str = field(default="gqa", metadata={"help": "registered variant (see `hf-attn-zoo list`)"})
    max_steps: int = field(default=600, metadata={"help": "optimizer steps (about 3 minutes on 2 CPU cores)"})
    max_documents: int | None = field(
        default=None, metadata={"help": "train on the first N documents only (quick runs)"}
    )
    prompt: str = field(default="def ", metadata={"help": "text to continue"})
    max_new_tokens: int = field(default=60, metadata={"help": "tokens to generate"})
    output_dir: str = field(default="outputs/demo", metadata={"help": "where the run and the final model go"})
    seed: int = field(default=0, metadata={"help": "random seed"})
    packing: str = field(
        default="eos",
        metadata={"help": "eos (documents joined with EOS) or documents (padding-free, each document alone)"},
    )


COMMANDS = {
    "list": Command("print the registered variants", "hf_attn_zoo.cli:list_command"),
    "train": Command(
        "train from a YAML recipe, with --section.field value overrides",
        "hf_attn_zoo.train:main",  # the recipe loader parses the overrides; argparse would misread `--key 3`
        passes_through=True,
        parser={
            "description": "train from a YAML recipe, with --section.field value overrides (`training.*` are "
            "transformers' TrainingArguments).",
            "usage": f"{PROG} train [CONFIG] [--section.field value ...]",
            "formatter_class": argparse.RawDescriptionHelpFormatter,
            "epilog_from": "hf_attn_zoo.cli:recipe_fields",
        },
    ),
    "eval": Command(
        "corpus-level perplexity (sliding windows), bits per byte and word perplexity of a causal LM",
        "hf_attn_zoo.cli:evaluate_command",
        EvalOptions,
    ),
    "translate-eval": Command(
        "BLEU and chrF (greedy or beam search) and the references' perplexity of a translator on pairs",
        "hf_attn_zoo.cli:translate_eval_command",
        TranslateEvalOptions,
    ),
    "translate": Command(
        "translate texts (arguments, a file's lines or standard input) with a translator checkpoint",
        "hf_attn_zoo.cli:translate_command",
        TranslateOptions,
    ),
    "lm-eval-task": Command(
        "write an lm-evaluation-harness task scoring local text files, and print the lm_eval command",
        "hf_attn_zoo.cli:lm_eval_task_command",
        LmEvalTaskOptions,
    ),
    "attention": Command(
        "draw one head's attention weights over a text as a heatmap (a translator: its cross-attention, per head)",
        "hf_attn_zoo.cli:attention_command",
        AttentionOptions,
    ),
    "convert": Command(
        "convert an MHA-family checkpoint (zoo, Llama, Mistral, Qwen2 or GGUF) to another attention variant (pooled "
        "key/value heads, MLA, any zoo variant), with attention transfer from the original",
        "hf_attn_zoo.cli:convert_command",
        ConvertOptions,
    ),
    "export": Command(
        "write a zoo checkpoint as the native transformers model computing it, or as a GGUF file for llama.cpp",
        "hf_attn_zoo.cli:export_command",
        ExportOptions,
    ),
    "import": Command(
        "read a Llama, Mistral, Qwen2 or dense DeepSeek checkpoint into the zoo variant computing it",
        "hf_attn_zoo.cli:import_command",
        ImportOptions,
    ),
    "push": Command(
        "upload a saved checkpoint folder (model, tokenizer, model card) to a Hugging Face Hub model repo",
        "hf_attn_zoo.cli:push_command",
        PushOptions,
    ),
    "serve": Command(
        "serve a checkpoint with transformers' OpenAI-compatible server (chat, streaming, completions)",
        "hf_attn_zoo.cli:serve_command",
        ServeOptions,
    ),
    "demo": Command(
        "train a small model on Python's standard library, score it, generate, save and reload it",
        "hf_attn_zoo.demo:run_demo",
        DemoOptions,
    ),
}


def add_commands(parser: argparse.ArgumentParser, commands: dict[str, Command], path: tuple[str, ...] = ()) -> None:
    """A subcommand parser per command, recursively; each leaf records its command and path as defaults."""
    subparsers = parser.add_subparsers(dest="_".join((*path, "command")), required=True, parser_class=CommandParser)
    for name, command in commands.items():
        kwargs = {"help": command.help, "description": command.help, **command.parser}
        options = [command.options] if command.options else []
        subparser = subparsers.add_parser(name, dataclass_types=options, **kwargs)
        if command.subcommands:
            add_commands(subparser, command.subcommands, (*path, name))
        else:
            subparser.set_defaults(command_=command, path_=(*path, name))


def package_version() -> str:
    try:
        return version("hf-attn-zoo")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command and subcommand (each answers `--help`)."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    add_commands(parser, COMMANDS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # commands that pass their arguments on take words argparse does not know (`--training.max_steps 3`)
    namespace, rest = parser.parse_known_args(argv)
    command: Command = namespace.command_
    try:
        if command.passes_through:
            status = command.function()(argv[len(namespace.path_) :])
        else:
            if rest:
                parser.parse_args(argv)  # the usual error naming the unknown arguments
            options = None
            if command.options is not None:
                names = (f.name for f in dataclasses.fields(command.options) if f.init)
                options = command.options(**{name: getattr(namespace, name) for name in names})
            status = command.function()(options)
    except Exception as error:
        from hf_attn_zoo.errors import UserError, report  # the package is imported by now: a command ran

        if not isinstance(error, UserError):
            raise
        return report(error, " ".join((PROG, *namespace.path_)))
    return status if isinstance(status, int) else 0  # functions may return what they made (a summary, a path)


if __name__ == "__main__":
    sys.exit(main())
