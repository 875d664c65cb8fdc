"""`python -m experiments NAME [options]`, from the repository's root: the experiment NAME (`--help` lists them).

Each experiment is a `Benchmark` of a study's script (`experiments/<study>/<script>.py`, its `BENCHMARKS`); the
script's own parser answers `python -m experiments NAME --help` with the experiment's options and their defaults.
The studies are scripts of the repository, never of the installed package: nothing in `hf_attn_zoo` imports them.
"""

import importlib
import sys

# name -> (module of the experiments package, what it measures)
EXPERIMENTS = {
    "llama": ("speed.speed", "training and generate() tokens/s of a variant against Llama, same weights"),
    "training": ("speed.speed", "training tokens/s of every variant's preset against the same-size Llama"),
    "scaling": ("speed.scaling", "forward time, peak memory and decoding cache against sequence length"),
    "decode": ("speed.decode", "prefill/decode tokens/s and cache bytes of every variant against Llama"),
    "fast-decode": ("speed.decode", "decode tokens/s: dynamic vs static cache vs compiled step, and Llama's"),
    "int8": ("speed.int8", "int8 weights and a 4-bit KV cache against float32: perplexity, size, speed"),
    "packing": ("speed.packing", "padding-free training against EOS packing: speed and held-out perplexity"),
    "sharded": ("speed.sharded", "FSDP2 and ZeRO-2/3 against DDP and one process: losses, tokens/s, memory"),
    "quality": ("quality.quality", "the quality board: every variant under one recipe, perplexity vs cache, seeds"),
    "quality-ablations": ("quality.ablations", "one-seed ablations of the differential, sinusoidal and learned cells"),
    "uptrain": ("uptraining.uptraining", "the MHA -> GQA/MQA uptraining ablation on the State of the Union"),
    "uptrain-smollm2": ("uptraining.uptraining", "SmolLM2-135M pooled to MQA and uptrained: the recovery curve"),
    "convert-demo": ("uptraining.conversion", "the demo's MHA model to GQA/MQA by every pooling method"),
    "convert-frontier": (
        "uptraining.frontier",
        "SmolLM2-135M converted, then repaired by CE, transfer or distillation",
    ),
    "convert-smollm2": ("uptraining.conversion", "SmolLM2-135M to MQA by every pooling method: perplexity, time"),
    "mla-smollm2": ("mla.latent", "SmolLM2-135M converted to MLA at three cache sizes, uptrained, against MQA"),
    "mla-decode": ("mla.latent", "batch-1 decoding of MLA, absorbed and expanded, against GQA of equal parameters"),
    "llama-cpp": ("speed.llama_cpp", "llama.cpp tokens/s on the GGUF export (f32, f16, q8_0) beside generate()"),
    "vllm": ("speed.vllm_throughput", "vLLM on the Llama export vs vLLM's transformers backend vs hf-attn-zoo serve"),
    "seq2seq": ("speed.seq2seq", "MHA encoder-decoder vs T5: training, generate(), cross-attention cache; the RNN"),
    "translation": ("translation.board", "the translation board: RNNs, Transformers, GQA uptraining, seeds"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in EXPERIMENTS:
        listing = "\n".join(f"  {name:17s}{help}" for name, (_, help) in EXPERIMENTS.items())
        asked = argv[:1] in (["-h"], ["--help"])
        print(
            f"usage: python -m experiments NAME [options]\n\nexperiments:\n{listing}",
            file=sys.stdout if asked else sys.stderr,
        )
        return 0 if asked else 2
    module = importlib.import_module(f"experiments.{EXPERIMENTS[argv[0]][0]}")
    from experiments.common import main as run

    return run(module.BENCHMARKS, argv, prog="python -m experiments")


if __name__ == "__main__":
    sys.exit(main())
