"""Multi-head latent attention converted from a real GQA checkpoint (TransMLA, MHA2MLA), against MQA at a like cache.

mla-smollm2  SmolLM2-135M-Instruct (GQA-3: 3 key/value heads of width 64, 384 cached values per token per layer)
             imported into `zoo_gqa` and converted into `zoo_mla` at each of `--shapes` (latent + RoPE widths: the
             default 128+64, 64+32 and 32+16 keep 1/2, 1/4 and 1/8 of that cache) by each of `--methods`, calibrated
             on the last training addresses, and scored before any training (held-out SOTU 2011-2021 and the
             reference text). At each shape the method with the better held-out perplexity is then uptrained by
             configs/uptrain/smollm2_mla.yaml, the budget of `uptrain-smollm2`'s MQA runs (120 steps, 246k tokens),
             whose results (uptraining/smollm2/runs/*.json) give the MQA points. Cache bytes per token are
             measured on each model's cache after a forward, in float32. Writes mla/smollm2/results.md,
             results.json and cache.png (perplexity against cache bytes per token); every conversion and run is kept
             in mla/smollm2/runs/<name>.json and read back on a rerun.

mla-decode   Greedy decoding at batch 1 after prompts of `--context_lengths` tokens, with generate()'s dynamic and
             static caches: `zoo_mla` on its absorbed path, the same model on its expanded path, and `zoo_gqa` with
             as many parameters (its MLP widened or narrowed to match, printed), at two `--shapes`: the scaling
             benchmark's model with each variant's `small` preset, and SmolLM2-135M's shape with MLA as
             `mla-smollm2` converts it at a quarter of the cache against the parent's GQA-3 (random weights). Decode
             tokens/s timed step by step inside generate() (the prefill left out) and the cache each holds per token;
             samples alternate between the three, ratios are medians of back-to-back pairs. Writes
             results/mla_decode.md and .json.

    python -m experiments mla-smollm2 [--shapes 128+64 64+32 32+16] [--reference_text FILE]
    python -m experiments mla-decode [--shapes small smollm2] [--caches dynamic static] [--context_lengths 256]
"""

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

from experiments.common import Benchmark, Results, alternate, compare, main, paired_ratio, write_results
from experiments.speed.scaling import ScalingSetup, benchmark_model, cache_nbytes
from experiments.uptraining.uptraining import (
    CONFIGS,
    SmolLM2Setup,
    reference_perplexity,
    split_by_year,
    uptrain_converted,
)
from hf_attn_zoo.checkpoints import write_atomically
from hf_attn_zoo.convert import MLA_METHODS, from_llama, mha_to_gqa, to_mla
from hf_attn_zoo.convert.gguf import plain_checkpoint, smollm2_gguf
from hf_attn_zoo.evaluation.perplexity import score_texts
from hf_attn_zoo.evaluation.plotting import colour, headless_pyplot, house_style, save_figure
from hf_attn_zoo.models import get_variant
from hf_attn_zoo.models.compat_zoo import returned_cache

STUDY = Path(__file__).resolve().parent  # runs, tables and plots of this study

HELD_OUT_WINDOW = 512  # as the `uptrain-smollm2` experiment


@dataclass
class LatentSetup(SmolLM2Setup):
    """SmolLM2-135M converted into MLA at several cache sizes, scored, the best of each size uptrained."""

    output_dir: str = field(default=str(STUDY / "smollm2"), metadata={"help": "runs, results, plot"})
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
        default=str(STUDY.parent / "uptraining" / "smollm2" / "runs"),
        metadata={"help": "the `uptrain-smollm2` experiment's runs: the MQA points (aligned and mean pooling)"},
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
    write_results(out, "results", result, latent_table(setup, result), latent_figures(result), log=log)
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
    """Held-out perplexity against cache bytes per token (log-log): conversions hollow, uptrained filled; MLA by
    conversion method in its house colour (circles), MQA by pooling method (squares); the legend outside the axes."""
    plt = headless_pyplot()
    if plt is None:
        return False
    with house_style():
        figure, axis = plt.subplots(figsize=(9.5, 5), layout="constrained")
        gqa = result["gqa"]
        axis.scatter(
            [gqa["cache_bytes_per_token"]], [gqa["held_out_perplexity"]], color=colour("gqa"), label="GQA-3, imported"
        )
        for method in dict.fromkeys(c["method"] for c in result["conversions"]):
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
                color=colour(method),
                label=f"MLA, {method}, converted",
            )
            trained = [
                (u["cache_bytes_per_token"], u["held_out_perplexity"]["uptrained"])
                for u in result["uptrained"]
                if u["method"] == method
            ]
            if trained:
                axis.plot(*zip(*sorted(trained)), marker="o", color=colour(method), label=f"MLA, {method}, uptrained")
        for method, run in result["mqa"].items():
            cache = run["cache_bytes_per_token"]
            held = run["held_out_perplexity"]
            axis.scatter(
                [cache],
                [held["converted"]],
                marker="s",
                facecolors="none",
                edgecolors=colour(method),
                label=f"MQA, {method}-pooled",
            )
            axis.scatter(
                [cache], [held["uptrained"]], marker="s", color=colour(method), label=f"MQA, {method}, uptrained"
            )
        axis.set(
            xscale="log",
            yscale="log",
            xlabel="cache (bytes per token, all layers, float32)",
            ylabel="held-out perplexity (per token, SOTU 2011-2021)",
            title="SmolLM2-135M: GQA-3 -> MLA / MQA",
        )
        figure.legend(loc="outside right upper")
        save_figure(figure, path)
    return True


def latent_figures(result: dict) -> dict:
    """cache.png from results.json's contents, for a run and `--replot`."""
    return {"cache.png": lambda path: plot_cache(result, path)}


# SmolLM2-135M's shape, and what `mla-smollm2` converts it into at a quarter of its cache (64+32): the parent's
# GQA-3 and MLA as `to_mla` leaves it (no-RoPE queries as wide as the latent, no latent norm, 16 of 32 frequencies)
SMOLLM2_SHAPE = dict(
    hidden_size=576,
    num_hidden_layers=30,
    num_attention_heads=9,
    intermediate_size=1536,
    vocab_size=49152,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)
SMOLLM2_MLA = dict(kv_lora_rank=64, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, latent_norm=False)
DECODE_SHAPES = ("small", "smollm2")
CACHES = ("dynamic", "static")


@dataclass
class LatentDecodeSetup(Results):
    """Batch-1 decoding of MLA, absorbed and expanded, against GQA of equal parameters."""

    output_dir: str = field(default=str(STUDY / "results"), metadata={"help": "folder for mla_decode.md and .json"})
    shapes: list[str] = field(
        default_factory=lambda: list(DECODE_SHAPES),
        metadata={
            "help": "small: the scaling benchmark's 6 x 256, 8 heads, MLA's preset (latent 128 + RoPE 16) against "
            "GQA's (2 key/value heads); smollm2: SmolLM2-135M's 30 x 576, MLA at 64+32 as converted against GQA-3"
        },
    )
    caches: list[str] = field(
        default_factory=lambda: list(CACHES),
        metadata={
            "help": "generate()'s dynamic cache (grown by concatenation) and/or its static one (written in place)"
        },
    )
    context_lengths: list[int] = field(default_factory=lambda: [256, 1024, 2048], metadata={"help": "prompt tokens"})
    new_tokens: int = field(default=32, metadata={"help": "generated tokens (the first is the prefill's)"})
    runs: int = field(default=1, metadata={"help": "generations per sample; the fastest counts"})
    repeats: int = field(default=3, metadata={"help": "alternating samples per model"})


def parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def equal_parameter_gqa(mla, fields: dict):
    """`zoo_gqa` of `fields` with its MLP widened (or narrowed) until its parameter count is MLA's (to one MLP column
    per layer)."""
    gqa = get_variant("gqa")
    config = gqa.config(**fields)
    per_column = 3 * config.hidden_size * config.num_hidden_layers  # gate, up and down weights of one MLP column
    extra = round((parameters(mla) - parameters(gqa.causal_lm_class._from_config(config))) / per_column)
    torch.manual_seed(0)
    return gqa.build(**{**fields, "intermediate_size": config.intermediate_size + extra}).eval()


def decode_models(shape: str, max_length: int) -> dict:
    """The three models of a shape: MLA decoding absorbed, the same weights decoding expanded, GQA of as many
    parameters."""
    if shape == "small":
        size = ScalingSetup()
        absorbed = benchmark_model("mla", size, max_length)
        expanded = benchmark_model("mla", size, max_length)  # the same weights (seeded)
        gqa_fields = {
            **get_variant("gqa").preset("small"),
            "hidden_size": size.hidden_size,
            "num_hidden_layers": size.num_hidden_layers,
            "num_attention_heads": size.num_attention_heads,
            "vocab_size": size.vocab_size,
            "max_position_embeddings": max_length,
        }
    elif shape == "smollm2":
        fields = {**SMOLLM2_SHAPE, "max_position_embeddings": max_length}
        frequencies = [list(range(SMOLLM2_MLA["qk_rope_head_dim"] // 2))] * fields["num_hidden_layers"]
        mla = get_variant("mla")
        models = []
        for _ in range(2):
            torch.manual_seed(0)
            models.append(mla.build(**fields, **SMOLLM2_MLA, rope_frequencies=frequencies).eval())
        absorbed, expanded = models
        gqa_fields = {**fields, "num_key_value_heads": 3}
    else:
        raise SystemExit(f"--shapes {shape}: use some of {' '.join(DECODE_SHAPES)}")
    for layer in expanded.model.layers:
        layer.self_attn.absorb_for_decoding = False
    return {"absorbed": absorbed, "expanded": expanded, "gqa": equal_parameter_gqa(absorbed, gqa_fields)}


class StepClock(LogitsProcessor):
    """Stamps the time whenever `generate()` has the logits of a new token: once after the prefill, then once per
    decode step, so consecutive stamps are one step apart, `generate()`'s own work included."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return scores


@torch.no_grad()
def decode_step_seconds(model, prompt: torch.Tensor, new_tokens: int, cache: str) -> tuple[float, float]:
    """(seconds per decode step after the prefill, bytes the cache holds per position it holds), greedy."""
    clock = StepClock()
    output = model.generate(
        prompt,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        logits_processor=LogitsProcessorList([clock]),
        cache_implementation=None if cache == "dynamic" else cache,
        return_dict_in_generate=True,
    )
    held = returned_cache(output)
    positions = held.layers[0].keys.shape[-2]  # a static cache holds its whole length from the start
    return (clock.stamps[-1] - clock.stamps[0]) / (len(clock.stamps) - 1), cache_nbytes(held) / positions


def run_latent_decode(setup: LatentDecodeSetup, log=print) -> list[dict]:
    unknown = sorted(set(setup.caches) - set(CACHES))
    if unknown:
        raise SystemExit(f"--caches {' '.join(unknown)}: use some of {' '.join(CACHES)}")
    if setup.new_tokens < 2:
        raise SystemExit(f"--new_tokens {setup.new_tokens}: at least 2, the first token is the prefill's")
    max_length = max(setup.context_lengths) + setup.new_tokens
    rows = []
    for shape in setup.shapes:
        models = decode_models(shape, max_length)
        counts = {label: parameters(model) for label, model in models.items()}
        log(f"{shape}: parameters {counts} (gqa intermediate_size {models['gqa'].config.intermediate_size})")
        for cache in setup.caches:
            for length in setup.context_lengths:
                prompt = torch.randint(
                    0, models["gqa"].config.vocab_size, (1, length), generator=torch.Generator().manual_seed(1)
                )

                def measure(model, prompt=prompt, cache=cache):
                    best = min(decode_step_seconds(model, prompt, setup.new_tokens, cache) for _ in range(setup.runs))
                    return 1 / best[0], best[1]

                samples = alternate(models, {"decode": measure}, setup.repeats)["decode"]
                rate = {label: [tokens_per_s for tokens_per_s, _ in samples[label]] for label in samples}
                row = {"shape": shape, "cache": cache, "context": length, "parameters": counts}
                row.update(compare({"absorbed": rate["absorbed"], "gqa": rate["gqa"]}, "decode"))
                row["decode_expanded"] = compare({"expanded": rate["expanded"], "gqa": rate["gqa"]}, "d")["d_expanded"]
                row["absorbed_over_expanded"] = paired_ratio(rate["absorbed"], rate["expanded"])
                row["cache_bytes_per_token"] = {label: samples[label][-1][1] for label in ("absorbed", "gqa")}
                rows.append(row)
                log(
                    f"{shape}, {cache} cache, context {length}: absorbed {row['decode_absorbed']:,.1f}/s, expanded "
                    f"{row['decode_expanded']:,.1f}/s, gqa {row['decode_gqa']:,.1f}/s; absorbed/gqa "
                    f"{row['decode_ratio']:.2f}x, absorbed/expanded {row['absorbed_over_expanded']:.2f}x"
                )
    write_results(Path(setup.output_dir), "mla_decode", rows, decode_table(setup, rows), log=log)
    return rows


def decode_table(setup: LatentDecodeSetup, rows: list[dict]) -> str:
    lines = [
        f"Greedy decoding at batch 1, {setup.new_tokens - 1} decode steps after the prompt: `zoo_mla` on its absorbed "
        "and its expanded path against `zoo_gqa` with as many parameters (its MLP widened or narrowed to match). "
        "small: 6 x 256, 8 heads, MLA latent 128 + RoPE 16 against GQA's 2 key/value heads of 32; smollm2: "
        "SmolLM2-135M's 30 x 576, 9 heads, MLA 64 + 32 as `to_mla` leaves it against GQA-3 (heads of 64); random "
        "weights. Decode tokens/s (medians; ratios: medians of back-to-back pairs) and cache bytes per token "
        "(float32, all layers, measured).",
        "",
        "| shape | cache | context | parameters MLA / GQA | MLA absorbed | MLA expanded | GQA | absorbed / GQA "
        "| absorbed / expanded | cache MLA | cache GQA |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        cache, counts = row["cache_bytes_per_token"], row["parameters"]
        lines.append(
            f"| {row['shape']} | {row['cache']} | {row['context']} | {counts['absorbed']:,} / {counts['gqa']:,} | "
            f"{row['decode_absorbed']:,.1f} | {row['decode_expanded']:,.1f} | {row['decode_gqa']:,.1f} | "
            f"{row['decode_ratio']:.2f}x | {row['absorbed_over_expanded']:.2f}x | {cache['absorbed']:,.0f} | "
            f"{cache['gqa']:,.0f} |"
        )
    return "\n".join(lines)


BENCHMARKS = {
    "mla-smollm2": Benchmark(LatentSetup, run_latent, figures=latent_figures, results="results"),
    "mla-decode": Benchmark(LatentDecodeSetup, run_latent_decode),
}

if __name__ == "__main__":
    sys.exit(main(BENCHMARKS))
