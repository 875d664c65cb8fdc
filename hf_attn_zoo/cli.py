"""`hf-attn-zoo`: the command line.

    hf-attn-zoo list                      the registered variants
    hf-attn-zoo bench llama [options]     speed of a variant against LlamaForCausalLM at the same size
    hf-attn-zoo bench scaling [options]   time, memory and cache of every variant against sequence length
    hf-attn-zoo demo [options]            the main job: build, generate, score and save a model

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
    from .evaluation.speed import SpeedSetup, compare_with_llama

    parser = argparse.ArgumentParser(prog="hf-attn-zoo", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=HfArgumentParser)
    commands.add_parser("list", help="print the registered variants", dataclass_types=[])
    bench = commands.add_parser("bench", help="benchmarks", dataclass_types=[])
    benchmarks = bench.add_subparsers(dest="benchmark", required=True, parser_class=HfArgumentParser)
    about = "training and generate() tokens/s of a variant against LlamaForCausalLM at the same size"
    llama = benchmarks.add_parser("llama", help=about, description=about, dataclass_types=[SpeedSetup])
    llama.add_argument("--output_dir", type=Path, default=Path("benchmarks/results"), help="where the tables go")
    about = "forward time, peak memory and decoding cache of every variant against sequence length"
    scaling = benchmarks.add_parser("scaling", help=about, description=about, dataclass_types=[ScalingSetup])
    scaling.add_argument("--output_dir", type=Path, default=Path("benchmarks/results"), help="where the results go")
    about = "build a model, generate a sample, score it, save it"
    commands.add_parser("demo", help=about, description=about, dataclass_types=[DemoOptions])
    args = parser.parse_args(argv)

    if args.command == "list":
        print(variant_table())
    elif args.command == "bench" and args.benchmark == "scaling":
        run_scaling(_options(args, ScalingSetup), args.output_dir)
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
