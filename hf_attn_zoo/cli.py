"""`hf-attn-zoo`: the command line.

    hf-attn-zoo list                      the registered variants
    hf-attn-zoo train CONFIG [overrides]  train from a YAML recipe (configs/train/*.yaml), `--training.max_steps 100`
    hf-attn-zoo eval MODEL --data FILE... perplexity, bits per byte and word perplexity of any causal LM
    hf-attn-zoo lm-eval-task --data FILE... --out DIR   an lm-evaluation-harness task over local files
    hf-attn-zoo attention CHECKPOINT TEXT --out map.png [--layer L] [--head H]   one head's attention heatmap
    hf-attn-zoo convert SRC OUT --to gqa|mqa [--num_key_value_heads G] [--method mean]   pool key/value heads
    hf-attn-zoo push CHECKPOINT REPO [--revision R] [--private]   upload a saved checkpoint to the Hugging Face Hub
    hf-attn-zoo serve CHECKPOINT [--port P] [--continuous_batching]   transformers' OpenAI-compatible server
    hf-attn-zoo demo [options]            the main job: train a small model on Python's standard library, score it,
                                          generate a sample, save and reload it
    hf-attn-zoo bench NAME [options]      a benchmark of the repository's benchmarks/ folder (`bench --help` lists
                                          them); they are not part of the installed package

Each command is one entry of `COMMANDS`: its help line, the dataclass of its arguments and the function it runs.
Options are the dataclass's fields, parsed by transformers' `HfArgumentParser`: `--max_length 512`, and
`--max-length 512` as well; a field marked `positional` is given by position (`eval MODEL`). `train` and `bench NAME`
pass their arguments on: to the recipe loader (`--section.field value` overrides) and to the benchmark's script.
"""

import argparse
import dataclasses
import importlib
import json
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Literal, get_args

from transformers import HfArgumentParser

from .demo import DemoOptions, run_demo
from .models import VARIANTS
from .training import SECTIONS
from .training import main as train_main


def positional(help: str, **kwargs) -> dataclasses.Field:
    """A dataclass field given on the command line by position (`hf-attn-zoo eval MODEL`), not as `--name`."""
    return field(metadata={"positional": True, "help": help}, **kwargs)


class CommandParser(HfArgumentParser):
    """`HfArgumentParser` that adds the fields marked `positional` as positional arguments (optional ones when the
    field has a default); others become `--field_name` (and `--field-name`), as HfArgumentParser makes them."""

    @staticmethod
    def _parse_dataclass_field(parser: argparse.ArgumentParser, field: dataclasses.Field) -> None:
        # HfArgumentParser resolves each field's type and hands it here, one field at a time
        if not field.metadata.get("positional"):
            return HfArgumentParser._parse_dataclass_field(parser, field)
        kind = next((t for t in get_args(field.type) if t is not type(None)), field.type)  # `str | None` -> str
        optional = {"nargs": "?", "default": field.default} if field.default is not dataclasses.MISSING else {}
        parser.add_argument(field.name, type=kind, help=field.metadata["help"], **optional)


@dataclass(frozen=True)
class Command:
    """One command: its help line, what it runs and the dataclass of its arguments.

    `run(options)` gets the parsed dataclass (None where `options` is None) and may return an exit status. With
    `passes_through`, `run(argv)` gets the words after the command's name and parses them itself; the parser built
    here then only answers `--help` (unless `parser` turns that off too). `parser`: more arguments of its parser
    (usage, epilog); `subcommands`: commands under this one (`bench llama`)."""

    help: str
    run: Callable[..., int | None] | None = None
    options: type | None = None
    passes_through: bool = False
    parser: dict = field(default_factory=dict)
    subcommands: dict[str, "Command"] = field(default_factory=dict)


# list


def variant_table() -> str:
    """The registered variants as a markdown table."""
    lines = [
        "| variant | model_type | attention | KV cache per token | backends | positions |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, variant in VARIANTS.items():
        lines.append(
            f"| `{name}` | `{variant.model_type}` | {variant.description} | {variant.cache_per_token} "
            f"| {', '.join(variant.backends)} | {', '.join(variant.position_types)} |"
        )
    return "\n".join(lines)


def list_command(options: None) -> None:
    print(variant_table())


# train


@dataclass
class TrainOptions:
    config: str | None = positional("YAML recipe (configs/train/*.yaml); fields given as overrides only", default=None)


def train_command(argv: list[str]) -> None:
    train_main(argv)  # the recipe loader parses the overrides; argparse would misread `--key 3`


def recipe_fields() -> str:
    """The fields of each recipe section, for `train --help`."""
    return "fields of each recipe section:\n" + "\n".join(
        textwrap.fill(
            ", ".join(f.name for f in dataclasses.fields(cls) if f.init),
            width=100,
            initial_indent=f"  {section}: ",
            subsequent_indent="    ",
        )
        for section, cls in SECTIONS.items()
    )


# eval


@dataclass
class EvalOptions:
    model: str = positional("checkpoint path or name (zoo or any AutoModelForCausalLM)")
    data: list[str] = field(metadata={"help": "text files or directories to score"})
    max_length: int | None = field(default=None, metadata={"help": "tokens per window; none: the model's"})
    stride: int | None = field(default=None, metadata={"help": "tokens between windows; none: the max length"})
    batch_size: int = field(default=1, metadata={"help": "windows per forward"})
    max_chars: int | None = field(default=None, metadata={"help": "score only the first N characters of each"})
    trust_remote_code: bool = field(default=False, metadata={"help": "run the code saved with the model"})
    gguf_file: str | None = field(default=None, metadata={"help": "GGUF file inside MODEL"})
    json: bool = field(default=False, metadata={"help": "print one JSON object"})


def evaluate_command(options: EvalOptions) -> dict:
    from .data import expand_files
    from .evaluation.perplexity import load_for_scoring, score_texts

    files = expand_files(options.data, "--data")
    texts = [path.read_text(encoding="utf-8", errors="replace")[: options.max_chars] for path in files]
    model, tokenizer = load_for_scoring(options.model, options.trust_remote_code, options.gguf_file)
    result = score_texts(
        model, tokenizer, texts, options.max_length, options.stride, options.batch_size, progress=not options.json
    ).as_dict()
    if options.json:
        keys = ("perplexity", "bits_per_byte", "word_perplexity", "tokens", "bytes", "max_length", "stride")
        print(json.dumps({key: result[key] for key in keys}))
    else:
        print(
            f"{options.model} on {len(files)} file(s), windows of {result['max_length']} tokens every "
            f"{result['stride']}:"
        )
        print("| metric | value |\n| --- | ---: |")
        for key in ("perplexity", "bits_per_byte", "word_perplexity", "tokens", "bytes", "words"):
            value = result[key]
            print(f"| {key} | {value:,.4f} |" if isinstance(value, float) else f"| {key} | {value:,} |")
    return result


# lm-eval-task


@dataclass
class LmEvalTaskOptions:
    data: list[str] = field(metadata={"help": "text files or directories (one document per file)"})
    out: Path = field(metadata={"help": "folder for the task (lm_eval's --include_path)"})
    name: str = field(default="zoo_text", metadata={"help": "task name"})
    checkpoint: str = field(default="CHECKPOINT", metadata={"help": "model for the printed command"})


def lm_eval_task_command(options: LmEvalTaskOptions) -> None:
    from .data import expand_files
    from .evaluation.lm_eval_task import command, write_task

    print(f"task written to {write_task(expand_files(options.data, '--data'), options.out, options.name)}; run:")
    print(command(options.checkpoint, options.out, options.name))


# attention


@dataclass
class AttentionOptions:
    checkpoint: str = positional("checkpoint folder or name")
    text: str = positional("the text to attend over")
    out: Path = field(default=Path("attention.png"), metadata={"help": "image file to write"})
    layer: int = field(default=0, metadata={"help": "layer index (negative counts from the end)"})
    head: int = field(default=0, metadata={"help": "query head index"})
    trust_remote_code: bool = field(default=False, metadata={"help": "run the code saved with the model"})


def attention_command(options: AttentionOptions) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .evaluation.attention_maps import plot_attention

    remote = options.trust_remote_code
    model = AutoModelForCausalLM.from_pretrained(options.checkpoint, trust_remote_code=remote)
    tokenizer = AutoTokenizer.from_pretrained(options.checkpoint, trust_remote_code=remote)
    plot_attention(model.eval(), tokenizer, options.text, options.layer, options.head, options.out)
    print(f"layer {options.layer}, head {options.head} of {options.checkpoint} written to {options.out}")


# convert


@dataclass
class ConvertOptions:
    src: str = positional("checkpoint folder or name; with --gguf_file, the folder holding the file")
    out: Path = positional("output folder (model, tokenizer, model card)")
    to: Literal["gqa", "mqa"] = field(metadata={"help": "mqa: one key/value head"})
    num_key_value_heads: int | None = field(default=None, metadata={"help": "G for --to gqa"})
    method: Literal["mean", "first", "random"] = field(default="mean", metadata={"help": "how heads are pooled"})
    gguf_file: str | None = field(default=None, metadata={"help": "GGUF file inside SRC"})


def convert_command(options: ConvertOptions) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .checkpoints import save_checkpoint
    from .convert import mha_to_gqa
    from .convert.gguf import plain_checkpoint

    if options.to == "gqa" and options.num_key_value_heads is None:
        raise SystemExit("--to gqa needs --num_key_value_heads G")
    groups = 1 if options.to == "mqa" else options.num_key_value_heads
    source = str(plain_checkpoint(Path(options.src) / options.gguf_file)) if options.gguf_file else options.src
    model = AutoModelForCausalLM.from_pretrained(source)
    tokenizer = AutoTokenizer.from_pretrained(source)
    before = model.config.num_key_value_heads
    converted = mha_to_gqa(model, groups, options.method)
    gguf = f" / {options.gguf_file}" if options.gguf_file else ""
    details = {
        "converted from": f"{options.src}{gguf} ({model.config.model_type})",
        "key/value heads": f"{before} -> {groups}, {options.method}-pooled (Ainslie et al. 2023)",
    }
    out = save_checkpoint(options.out, converted, tokenizer=tokenizer, training=details)
    print(f"{converted.config.model_type} with {groups} key/value heads ({options.method}) written to {out}")
    return out


# push


@dataclass
class PushOptions:
    checkpoint: Path = positional("folder written by save_pretrained, training or convert")
    repo: str = positional("model repo id, NAMESPACE/NAME (created if missing)")
    revision: str | None = field(default=None, metadata={"help": "branch to push to (created from main if missing)"})
    private: bool = field(default=False, metadata={"help": "create the repo private (an existing one is kept as is)"})


def push_command(options: PushOptions) -> None:
    from .hub import push_checkpoint

    print(push_checkpoint(options.checkpoint, options.repo, options.revision, options.private))


# serve


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


def serve_command(options: ServeOptions) -> int:
    from .serving import serve

    return serve(**dataclasses.asdict(options))


# bench


def checkout_root() -> Path:
    """The folder above the package: the repository in a source checkout or an editable install."""
    return Path(__file__).resolve().parents[1]


def benchmarks_folder() -> Path | None:
    """The repository's benchmarks/ folder: beside the package in a checkout, else in the current directory."""
    for root in (checkout_root(), Path.cwd()):
        if (root / "benchmarks" / "common.py").is_file():
            return root / "benchmarks"
    return None


def benchmark_script(stem: str) -> ModuleType:
    """Import `benchmarks/<stem>.py` from the repository (its folder goes on `sys.path`, where the scripts find
    `common.py`); FileNotFoundError outside a checkout."""
    folder = benchmarks_folder()
    if folder is None or not (folder / f"{stem}.py").is_file():
        raise FileNotFoundError(f"benchmarks/{stem}.py")
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    return importlib.import_module(stem)


def bench_command(name: str, script: str) -> Callable[[list[str]], int]:
    """What `hf-attn-zoo bench NAME` runs: the benchmark NAME of `benchmarks/<script>.py`."""

    def run(argv: list[str]) -> int:
        try:
            module = benchmark_script(script)
        except FileNotFoundError as missing:
            print(
                f"hf-attn-zoo bench {name}: no {missing} beside the package or in the current directory; the "
                "benchmarks live in the hf_attn_zoo repository, not the installed package: run this in a checkout",
                file=sys.stderr,
            )
            return 2
        return benchmark_script("common").main(module.BENCHMARKS, [name, *argv], prog="hf-attn-zoo bench")

    return run


# `hf-attn-zoo bench NAME`: the benchmark NAME of benchmarks/SCRIPT.py, and its help line
BENCHMARK_SCRIPTS = {
    "llama": ("speed", "training and generate() tokens/s of a variant against Llama, same weights"),
    "training": ("speed", "training tokens/s of every variant's preset against the same-size Llama"),
    "scaling": ("scaling", "forward time, peak memory and decoding cache against sequence length"),
    "decode": ("decode", "prefill/decode tokens/s and cache bytes of every variant against Llama"),
    "fast-decode": ("decode", "decode tokens/s: dynamic vs static cache vs compiled step, and Llama's"),
    "int8": ("int8", "int8 weights and a 4-bit KV cache against float32: perplexity, size, speed"),
    "uptrain": ("uptraining", "the MHA -> GQA/MQA uptraining ablation on the State of the Union addresses"),
    "uptrain-smollm2": ("uptraining", "SmolLM2-135M imported, pooled to MQA and uptrained: the recovery curve"),
    "packing": ("packing", "padding-free training against EOS packing: speed and held-out perplexity"),
}

# the script's own parser answers --help, with the benchmark's options
BENCHMARKS = {
    name: Command(help, bench_command(name, script), passes_through=True, parser={"add_help": False})
    for name, (script, help) in BENCHMARK_SCRIPTS.items()
}


COMMANDS = {
    "list": Command("print the registered variants", list_command),
    "train": Command(
        "train from a YAML recipe, with --section.field value overrides",
        train_command,
        TrainOptions,
        passes_through=True,
        parser={
            "description": "train from a YAML recipe, with --section.field value overrides (`training.*` are "
            "transformers' TrainingArguments).",
            "usage": "hf-attn-zoo train [CONFIG] [--section.field value ...]",
            "formatter_class": argparse.RawDescriptionHelpFormatter,
            "epilog": recipe_fields(),
        },
    ),
    "eval": Command(
        "corpus-level perplexity (sliding windows), bits per byte and word perplexity of a causal LM",
        evaluate_command,
        EvalOptions,
    ),
    "lm-eval-task": Command(
        "write an lm-evaluation-harness task scoring local text files, and print the lm_eval command",
        lm_eval_task_command,
        LmEvalTaskOptions,
    ),
    "attention": Command(
        "draw one head's attention weights over a text as a heatmap (tokens on both axes)",
        attention_command,
        AttentionOptions,
    ),
    "convert": Command(
        "pool the key/value heads of an MHA-family checkpoint (zoo, Llama, Mistral, Qwen2 or GGUF) into G",
        convert_command,
        ConvertOptions,
    ),
    "push": Command(
        "upload a saved checkpoint folder (model, tokenizer, model card) to a Hugging Face Hub model repo",
        push_command,
        PushOptions,
    ),
    "serve": Command(
        "serve a checkpoint with transformers' OpenAI-compatible server (chat, streaming, completions)",
        serve_command,
        ServeOptions,
    ),
    "demo": Command(
        "train a small model on Python's standard library, score it, generate, save and reload it",
        run_demo,
        DemoOptions,
    ),
    "bench": Command(
        "benchmarks against transformers' Llama and across variants (scripts in the repository's benchmarks/)",
        subcommands=BENCHMARKS,
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


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command and subcommand (each answers `--help`)."""
    parser = argparse.ArgumentParser(prog="hf-attn-zoo", description=__doc__.split("\n\n")[0])
    add_commands(parser, COMMANDS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # commands that pass their arguments on take words argparse does not know (`--training.max_steps 3`)
    namespace, rest = parser.parse_known_args(argv)
    command: Command = namespace.command_
    if command.passes_through:
        return command.run(argv[len(namespace.path_) :]) or 0
    if rest:
        parser.parse_args(argv)  # the usual error naming the unknown arguments
    options = None
    if command.options is not None:
        names = (f.name for f in dataclasses.fields(command.options) if f.init)
        options = command.options(**{name: getattr(namespace, name) for name in names})
    status = command.run(options)
    return status if isinstance(status, int) else 0


if __name__ == "__main__":
    sys.exit(main())
