"""`hf-attn-zoo`: the command line.

    hf-attn-zoo list                      the registered variants
    hf-attn-zoo train CONFIG [overrides]  train from a YAML recipe (configs/train/*.yaml), `--training.max_steps 100`
    hf-attn-zoo bench llama [options]     speed of a variant against LlamaForCausalLM at the same size
    hf-attn-zoo bench scaling [options]   time, memory and cache of every variant against sequence length
    hf-attn-zoo bench training [options]  training tokens/s of every variant's preset against the same-size Llama
    hf-attn-zoo demo [options]            the main job: train a small model on Python's standard library, score it,
                                          generate a sample, save and reload it

Options of each command are the fields of a dataclass, parsed by transformers' `HfArgumentParser`
(`hf-attn-zoo bench llama --help` lists them).
"""

import argparse
import dataclasses
import sys
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


def main(argv: Sequence[str] | None = None) -> int:
    from .demo import DemoOptions, run_demo
    from .evaluation.scaling import ScalingSetup, run_scaling
    from .evaluation.speed import (
        SpeedSetup,
        TrainingThroughputSetup,
        compare_with_llama,
        training_throughput,
        training_throughput_table,
    )

    parser = argparse.ArgumentParser(prog="hf-attn-zoo", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=HfArgumentParser)
    commands.add_parser("list", help="print the registered variants", dataclass_types=[])
    train = commands.add_parser("train", help="train from a YAML recipe", dataclass_types=[], add_help=False)
    train.add_argument("arguments", nargs=argparse.REMAINDER, help="CONFIG [--section.field value ...]")
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
    about = "train a small model on Python's standard library, score it, generate, save and reload it"
    commands.add_parser("demo", help=about, description=about, dataclass_types=[DemoOptions])
    args = parser.parse_args(argv)

    if args.command == "list":
        print(variant_table())
    elif args.command == "train":
        from .training import main as train_main

        train_main(args.arguments)
    elif args.command == "bench" and args.benchmark == "scaling":
        run_scaling(_options(args, ScalingSetup), args.output_dir)
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
