"""Multi-head latent attention converted from a real GQA checkpoint (TransMLA, MHA2MLA), against MQA at a like cache.

mla-smollm2  SmolLM2-135M-Instruct (GQA-3: 3 key/value heads of width 64, 384 cached values per token per layer)
             imported into `zoo_gqa` and converted into `zoo_mla` at each of `--shapes` (latent + RoPE widths: the
             default 128+64, 64+32 and 32+16 keep 1/2, 1/4 and 1/8 of that cache) by each of `--methods`, calibrated
             on the last training addresses, and scored before any training (held-out SOTU 2011-2021 and the
             reference text). At each shape the method with the better held-out perplexity is then uptrained by
             configs/uptrain/smollm2_mla.yaml, the budget of `bench uptrain-smollm2`'s MQA runs (120 steps, 246k
             tokens), whose results (uptrain/smollm2/runs/*.json) give the MQA points. Cache bytes per token are
             measured on each model's cache after a forward, in float32. Writes latent/smollm2/results.md,
             results.json and cache.png (perplexity against cache bytes per token); every conversion and run is kept
             in latent/smollm2/runs/<name>.json and read back on a rerun.

mla-decode   Greedy decoding at batch 1 after prompts of `--context_lengths` tokens: `zoo_mla` (the scaling
             benchmark's width and depth, its `small` preset's widths) on its absorbed path, the same model on its
             expanded path, and `zoo_gqa` with as many parameters (its MLP widened to match, printed). Decode tokens/s
             and the cache each holds per token; samples alternate between the three, ratios are medians of
             back-to-back pairs. Writes results/mla_decode.md and .json.

    python benchmarks/latent.py mla-smollm2 [--shapes 128+64 64+32 32+16] [--reference_text FILE]
    python benchmarks/latent.py mla-decode [--context_lengths 256 1024 2048]
    hf-attn-zoo bench mla-smollm2 ... | hf-attn-zoo bench mla-decode ...     (the same, from a source checkout)
"""

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from common import FOLDER, RESULTS, Benchmark, Results, alternate, compare, main, paired_ratio, write_results
from decode import prefill_and_decode
from scaling import ScalingSetup, benchmark_model
from transformers import AutoModelForCausalLM, AutoTokenizer
from uptraining import CONFIGS, SmolLM2Setup, reference_perplexity, split_by_year, uptrain_converted

from hf_attn_zoo.checkpoints import write_atomically
from hf_attn_zoo.convert import MLA_METHODS, from_llama, mha_to_gqa, to_mla
from hf_attn_zoo.convert.gguf import plain_checkpoint, smollm2_gguf
from hf_attn_zoo.evaluation.perplexity import score_texts
from hf_attn_zoo.evaluation.plotting import headless_pyplot, save_figure
from hf_attn_zoo.models.compat_zoo import returned_cache

HELD_OUT_WINDOW = 512  # as `bench uptrain-smollm2`


@dataclass
class LatentSetup(SmolLM2Setup):
    """SmolLM2-135M converted into MLA at several cache sizes, scored, the best of each size uptrained."""

    output_dir: str = field(default=str(FOLDER / "latent" / "smollm2"), metadata={"help": "runs, results, plot"})
    recipe: str = field(default=str(CONFIGS / "uptrain" / "smollm2_mla.yaml"), metadata={"help": "uptraining"})
    methods: list[str] = field(
        default_factory=lambda: list(MLA_METHODS), metadata={"help": "how the shared RoPE key is chosen (to_mla)"}
    )
    shapes: list[str] = field(
        default_factory=lambda: ["128+64", "64+32", "32+16"],
        metadata={"help": "kv_lora_rank+qk_rope_head_dim of each conversion (their sum is cached per layer)"},
    )
    uptrain: bool = field(
        default=True,
        metadata={"help": "uptrain the better method at each shape (--no_uptrain: report only uptrainings kept)"},
    )
    mqa_runs: str = field(
        default=str(FOLDER / "uptrain" / "smollm2" / "runs"),
        metadata={"help": "`bench uptrain-smollm2`'s runs: the MQA points (aligned and mean pooling)"},
    )


def parse_shape(shape: str) -> tuple[int, int]:
    try:
        rank, rope = (int(part) for part in shape.split("+"))
    except ValueError:
        raise SystemExit(f"--shapes {shape}: write kv_lora_rank+qk_rope_head_dim, e.g. 64+32") from None
    return rank, rope


def cache_bytes_per_token(model, tokens: int = 32) -> float:
    """Bytes the model's cache holds per token, summed over layers: measured on the cache after a forward."""
    input_ids = torch.arange(3, 3 + tokens)[None]
    with torch.no_grad():
        cache = returned_cache(model(input_ids, use_cache=True))
    held = sum(
        tensor.numel() * tensor.element_size() for layer in cache.layers for tensor in (layer.keys, layer.values)
    )
    return held / tokens


def run_latent(setup: LatentSetup, log=print) -> dict:
    """Import, convert at every shape by every method (kept in runs/<method>-<shape>.json), uptrain the better of
    each shape (runs/<method>-<shape>-uptrained.json), then the table and the plot with the MQA runs beside."""
    out = Path(setup.output_dir)
    unknown = sorted(set(setup.methods) - set(MLA_METHODS))
    if unknown:
        raise SystemExit(f"--methods {' '.join(unknown)}: use some of {' '.join(MLA_METHODS)}")
    if setup.reference_text is not None and not Path(setup.reference_text).is_file():
        raise SystemExit(f"--reference_text {setup.reference_text}: no such file")
    shapes = [parse_shape(shape) for shape in setup.shapes]
    splits = split_by_year(setup.data_dir)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    held_out = out / "held_out.txt"
    held_out.write_text("\n\n".join(Path(f).read_text() for f in splits["test"])[: setup.held_out_chars])
    source = plain_checkpoint(smollm2_gguf())
    tokenizer = AutoTokenizer.from_pretrained(source)
    calibration = [Path(f).read_text() for f in splits["train"][-setup.calibration_addresses :]]
    imported = {}

    def gqa_model():
        if not imported:
            imported["model"] = from_llama(AutoModelForCausalLM.from_pretrained(source)).eval()
        return imported["model"]

    def scores(model) -> dict:
        return {
            "held_out_perplexity": score_texts(
                model, tokenizer, [held_out.read_text()], max_length=HELD_OUT_WINDOW, batch_size=4
            ).perplexity,
            "reference_perplexity": reference_perplexity(model, tokenizer, setup.reference_text),
            "cache_bytes_per_token": cache_bytes_per_token(model),
        }

    def kept(name: str, compute) -> dict:
        path = out / "runs" / f"{name}.json"
        if not path.is_file():
            write_atomically(path, json.dumps(compute(), indent=2))
        return json.loads(path.read_text())

    gqa = kept("gqa", lambda: {"name": "GQA-3, imported", **scores(gqa_model())})
    mqa_cache = kept("mqa-cache", lambda: {"cache_bytes_per_token": cache_bytes_per_token(mha_to_gqa(gqa_model(), 1))})
    conversions, uptrained = [], []
    for rank, rope in shapes:

        def convert(method, rank=rank, rope=rope):
            start = time.perf_counter()
            model = to_mla(gqa_model(), rank, rope, method, calibration, tokenizer, setup.calibration_tokens).eval()
            seconds = time.perf_counter() - start
            result = {"method": method, "kv_lora_rank": rank, "qk_rope_head_dim": rope, "seconds": round(seconds, 1)}
            log(f"MLA {rank}+{rope}, {method}: converted in {seconds:.1f} s")
            return {**result, **scores(model)}, model

        models = {}  # method -> (scores, model), for the uptraining of the better one

        def converted(method, models=models, convert=convert):
            if method not in models:
                models[method] = convert(method)
            return models[method]

        for method in setup.methods:
            conversions.append(kept(f"{method}-{rank}+{rope}", lambda method=method: converted(method)[0]))
        shape = [c for c in conversions if (c["kv_lora_rank"], c["qk_rope_head_dim"]) == (rank, rope)]
        best = min(shape, key=lambda c: c["held_out_perplexity"])
        name = f"{best['method']}-{rank}+{rope}"
        if not setup.uptrain:  # none started; one finished before is still reported
            finished = out / "runs" / f"{name}-uptrained.json"
            uptrained += [json.loads(finished.read_text())] if finished.is_file() else []
            continue

        def uptrain(best=best, name=name, converted=converted):
            run = uptrain_converted(setup, out / name, converted(best["method"])[1], tokenizer, splits, held_out)
            return {**best, **run}

        uptrained.append(kept(f"{name}-uptrained", uptrain))
    mqa = {
        path.stem: json.loads(path.read_text())
        for path in sorted(Path(setup.mqa_runs).glob("*.json"))
        if path.stem != "gqa"
    }
    mqa = {method: {**run, **mqa_cache} for method, run in mqa.items()}
    result = {"setup": asdict(setup), "gqa": gqa, "conversions": conversions, "uptrained": uptrained, "mqa": mqa}
    plots = {"cache.png": lambda path: plot_cache(result, path)}
    write_results(out, "results", result, latent_table(setup, result), plots=plots, log=log)
    return result


def latent_table(setup: LatentSetup, result: dict) -> str:
    gqa = result["gqa"]
    reference = setup.reference_text or "`--reference_text`"
    lines = [
        "SmolLM2-135M-Instruct (GQA-3) converted into MLA at several latent + RoPE widths and into MQA, before and "
        f"after the same uptraining (120 steps, 246k tokens); held-out: the first {setup.held_out_chars:,} characters "
        f"of the 2011-2021 addresses (windows of {HELD_OUT_WINDOW}); reference: BOS + 2047 tokens of {reference}. "
        "Cache: bytes per token over all layers, float32, measured. Conversion seconds on this machine, calibration "
        f"({setup.calibration_tokens:,} tokens of the last {setup.calibration_addresses} addresses up to 2000) "
        "included.",
        "",
        "| model | cache bytes / token | of GQA-3 | held-out | reference | conversion s |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]

    def row(name, cache, held, ref, seconds=""):
        share = cache / gqa["cache_bytes_per_token"]
        ref = "" if ref is None else f"{ref:,.1f}"
        lines.append(f"| {name} | {cache:,.0f} | {share:.3f} | {held:,.1f} | {ref} | {seconds} |")

    row("GQA-3, imported", gqa["cache_bytes_per_token"], gqa["held_out_perplexity"], gqa["reference_perplexity"])
    for c in result["conversions"]:
        name = f"MLA {c['kv_lora_rank']}+{c['qk_rope_head_dim']}, {c['method']}"
        row(name, c["cache_bytes_per_token"], c["held_out_perplexity"], c["reference_perplexity"], c["seconds"])
    for u in result["uptrained"]:
        name = f"MLA {u['kv_lora_rank']}+{u['qk_rope_head_dim']}, {u['method']}, uptrained"
        row(
            name,
            u["cache_bytes_per_token"],
            u["held_out_perplexity"]["uptrained"],
            u["reference_perplexity"]["uptrained"],
        )
    for method, run in result["mqa"].items():
        cache = run["cache_bytes_per_token"]
        held, ref = run["held_out_perplexity"], run["reference_perplexity"]
        row(f"MQA, {method}-pooled", cache, held["converted"], ref["converted"], f"{run['conversion_seconds']:.1f}")
        row(f"MQA, {method}-pooled, uptrained", cache, held["uptrained"], ref["uptrained"])
    return "\n".join(lines)


def plot_cache(result: dict, path: Path) -> bool:
    """Held-out perplexity against cache bytes per token (log-log): conversions hollow, uptrained filled."""
    plt = headless_pyplot()
    if plt is None:
        return False
    figure, axis = plt.subplots(figsize=(7.5, 5))
    gqa = result["gqa"]
    axis.scatter([gqa["cache_bytes_per_token"]], [gqa["held_out_perplexity"]], color="black", label="GQA-3, imported")
    for index, method in enumerate(dict.fromkeys(c["method"] for c in result["conversions"])):
        points = [
            (c["cache_bytes_per_token"], c["held_out_perplexity"])
            for c in result["conversions"]
            if c["method"] == method
        ]
        axis.plot(
            *zip(*sorted(points)),
            marker="o",
            fillstyle="none",
            linestyle=":",
            color=f"C{index}",
            label=f"MLA, {method}, converted",
        )
        trained = [
            (u["cache_bytes_per_token"], u["held_out_perplexity"]["uptrained"])
            for u in result["uptrained"]
            if u["method"] == method
        ]
        if trained:
            axis.plot(*zip(*sorted(trained)), marker="o", color=f"C{index}", label=f"MLA, {method}, uptrained")
    for index, (method, run) in enumerate(result["mqa"].items(), start=2):
        cache = run["cache_bytes_per_token"]
        held = run["held_out_perplexity"]
        axis.scatter(
            [cache],
            [held["converted"]],
            marker="s",
            facecolors="none",
            edgecolors=f"C{index}",
            label=f"MQA, {method}-pooled",
        )
        axis.scatter([cache], [held["uptrained"]], marker="s", color=f"C{index}", label=f"MQA, {method}, uptrained")
    axis.set(
        xscale="log",
        yscale="log",
        xlabel="cache bytes per token (all layers, float32)",
        ylabel="held-out perplexity (SOTU 2011-2021)",
        title="SmolLM2-135M: GQA-3 -> MLA / MQA",
    )
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=7)
    save_figure(figure, path)
    return True


@dataclass
class LatentDecodeSetup(Results):
    """Batch-1 decoding of MLA, absorbed and expanded, against GQA of equal parameters."""

    output_dir: str = field(default=str(RESULTS), metadata={"help": "folder for mla_decode.md and .json"})
    context_lengths: list[int] = field(default_factory=lambda: [256, 1024, 2048], metadata={"help": "prompt tokens"})
    new_tokens: int = field(default=64, metadata={"help": "generated tokens"})
    runs: int = field(default=2, metadata={"help": "calls per sample; the fastest counts"})
    repeats: int = field(default=3, metadata={"help": "alternating samples per model"})


def parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def equal_parameter_gqa(mla, size: ScalingSetup, max_length: int):
    """`zoo_gqa` at MLA's backbone (its `small` preset's key/value heads) with the MLP widened until the parameter
    counts agree (to one MLP column per layer)."""
    gqa = benchmark_model("gqa", size, max_length)
    config = gqa.config
    per_column = 3 * config.hidden_size * config.num_hidden_layers  # gate, up and down weights of one MLP column
    extra = round((parameters(mla) - parameters(gqa)) / per_column)
    torch.manual_seed(0)
    return (
        type(gqa)
        ._from_config(
            type(config)(**{**config.to_dict(), "intermediate_size": config.intermediate_size + extra}),
            attn_implementation=config._attn_implementation,
        )
        .eval()
    )


def run_latent_decode(setup: LatentDecodeSetup, log=print) -> list[dict]:
    size = ScalingSetup()
    max_length = max(setup.context_lengths) + setup.new_tokens
    absorbed = benchmark_model("mla", size, max_length)
    expanded = benchmark_model("mla", size, max_length)  # the same weights (seeded), decoding by expansion
    for layer in expanded.model.layers:
        layer.self_attn.absorb_for_decoding = False
    gqa = equal_parameter_gqa(absorbed, size, max_length)
    models = {"absorbed": absorbed, "expanded": expanded, "gqa": gqa}
    counts = {label: parameters(model) for label, model in models.items()}
    log(f"parameters: {counts} (gqa intermediate_size {gqa.config.intermediate_size})")
    rows = []
    for length in setup.context_lengths:
        prompt = torch.randint(0, size.vocab_size, (1, length), generator=torch.Generator().manual_seed(1))

        def measure(model, prompt=prompt):
            return prefill_and_decode(model, prompt, setup.new_tokens, setup.runs)

        samples = alternate(models, {"generate": measure}, setup.repeats)["generate"]
        decode = {label: [s[1] for s in samples[label]] for label in samples}
        row = {"context": length, "parameters": counts}
        row.update(compare({"absorbed": decode["absorbed"], "gqa": decode["gqa"]}, "decode"))
        row["decode_expanded"] = compare({"expanded": decode["expanded"], "gqa": decode["gqa"]}, "d")["d_expanded"]
        row["absorbed_over_expanded"] = paired_ratio(decode["absorbed"], decode["expanded"])
        tokens = length + setup.new_tokens - 1
        row["cache_bytes_per_token"] = {label: samples[label][-1][2] / tokens for label in ("absorbed", "gqa")}
        rows.append(row)
        log(
            f"context {length}: absorbed {row['decode_absorbed']:,.0f}/s, expanded {row['decode_expanded']:,.0f}/s, "
            f"gqa {row['decode_gqa']:,.0f}/s; absorbed/gqa {row['decode_ratio']:.2f}x, absorbed/expanded "
            f"{row['absorbed_over_expanded']:.2f}x"
        )
    lines = [
        f"Greedy decoding at batch 1, {setup.new_tokens} new tokens after the prompt: `zoo_mla` "
        f"({size.num_hidden_layers} x {size.hidden_size}, {counts['absorbed']:,} parameters) on its absorbed and "
        f"its expanded path, against `zoo_gqa` with {counts['gqa']:,} (MLP widened to match). Decode tokens/s "
        "(medians; ratios: medians of back-to-back pairs) and cache bytes per token (float32, all layers, measured).",
        "",
        "| context | MLA absorbed | MLA expanded | GQA | absorbed / GQA | absorbed / expanded | cache MLA "
        "| cache GQA |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        cache = row["cache_bytes_per_token"]
        lines.append(
            f"| {row['context']} | {row['decode_absorbed']:,.0f} | {row['decode_expanded']:,.0f} | "
            f"{row['decode_gqa']:,.0f} | {row['decode_ratio']:.2f}x | {row['absorbed_over_expanded']:.2f}x | "
            f"{cache['absorbed']:,.0f} | {cache['gqa']:,.0f} |"
        )
    write_results(Path(setup.output_dir), "mla_decode", rows, "\n".join(lines), log=log)
    return rows


BENCHMARKS = {
    "mla-smollm2": Benchmark(LatentSetup, run_latent),
    "mla-decode": Benchmark(LatentDecodeSetup, run_latent_decode),
}

if __name__ == "__main__":
    sys.exit(main(BENCHMARKS))
