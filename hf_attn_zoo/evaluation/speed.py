"""Speed of a zoo variant against transformers' `LlamaForCausalLM` at the same size, in the same process.

Both models get the same weights (the zoo model is converted from the Llama one when the variant is in the MHA
family) and the same attention backend. On a shared machine interference only ever adds time, so each sample is the
best of a few runs (timeit's rule); samples alternate between the two models (A B B A ...) so that drift falls on
both, and the ratio zoo / Llama is the median over repeats of the ratio of each back-to-back pair. Above 1.0 the zoo
model is faster.
"""

import copy
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ..convert.llama import from_llama, in_mha_family
from .plotting import headless_pyplot, save_figure


def alternating(order: list, repeat: int) -> list:
    """`order` on even repeats and reversed on odd ones, so that drift of the machine falls on every model alike."""
    return order if repeat % 2 == 0 else order[::-1]


def paired_ratio(numerators: list[float], denominators: list[float]) -> float:
    """Median of the ratios of samples taken back to back: slow drift of the machine cancels within each pair."""
    return statistics.median(a / b for a, b in zip(numerators, denominators))


@dataclass
class SpeedSetup:
    """What is measured. The defaults: an 8.4M-parameter model (6 layers x 256) trained at batch 8 x 256 tokens."""

    variant: str = field(default="gqa", metadata={"help": "registered variant to compare with Llama"})
    vocab_size: int = field(default=16384, metadata={"help": "vocabulary of both models"})
    hidden_size: int = field(default=256, metadata={"help": "model width"})
    intermediate_size: int = field(default=688, metadata={"help": "MLP width"})
    num_hidden_layers: int = field(default=6, metadata={"help": "layers"})
    num_attention_heads: int = field(default=8, metadata={"help": "query heads"})
    num_key_value_heads: int = field(default=2, metadata={"help": "key/value heads"})
    train_batch_size: int = field(default=8, metadata={"help": "training batch size"})
    train_seq_len: int = field(default=256, metadata={"help": "training sequence length"})
    train_steps: int = field(default=4, metadata={"help": "timed training steps per sample; the fastest counts"})
    prompt_len: int = field(default=128, metadata={"help": "generate(): prompt tokens"})
    new_tokens: int = field(default=128, metadata={"help": "generate(): new tokens per row"})
    decode_batch_sizes: list[int] = field(default_factory=lambda: [1, 8], metadata={"help": "generate() batches"})
    decode_runs: int = field(default=3, metadata={"help": "generate() calls per sample; the fastest counts"})
    repeats: int = field(default=5, metadata={"help": "alternating samples per model and metric"})
    attn_implementation: str = field(default="sdpa", metadata={"help": "attention backend of both models"})
    threads: int | None = field(default=None, metadata={"help": "torch threads (default: torch's choice)"})


@dataclass
class SpeedReport:
    setup: SpeedSetup
    parameters: int
    # metric name -> {"llama": [tokens/s per repeat], "zoo": [...]}
    samples: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    machine: str = field(default_factory=lambda: f"{platform.machine()}, torch {torch.__version__}")

    def median(self, metric: str, model: str) -> float:
        return statistics.median(self.samples[metric][model])

    def ratio(self, metric: str) -> float:
        """Median of the per-repeat ratios: each pair ran back to back, so slow drift of the machine cancels."""
        return paired_ratio(self.samples[metric]["zoo"], self.samples[metric]["llama"])

    def table(self) -> str:
        s = self.setup
        lines = [
            f"`{s.variant}` vs `LlamaForCausalLM`: {self.parameters / 1e6:.1f}M parameters "
            f"({s.num_hidden_layers} layers x {s.hidden_size}, {s.num_attention_heads} heads, "
            f"{s.num_key_value_heads} KV heads), {s.attn_implementation}, {torch.get_num_threads()} threads, "
            f"best-of-run samples, medians of {s.repeats} alternating repeats ({self.machine})",
            "",
            "| metric | Llama tokens/s | zoo tokens/s | zoo / Llama |",
            "| --- | ---: | ---: | ---: |",
        ]
        for metric in self.samples:
            lines.append(
                f"| {metric} | {self.median(metric, 'llama'):,.0f} | {self.median(metric, 'zoo'):,.0f} "
                f"| {self.ratio(metric):.3f} |"
            )
        return "\n".join(lines)

    def to_json(self) -> str:
        ratios = {metric: self.ratio(metric) for metric in self.samples}
        return json.dumps({**asdict(self), "ratios": ratios}, indent=2)


def training_tokens_per_second(model, batch_size: int, seq_len: int, steps: int, vocab_size: int) -> float:
    """Forward, backward and an AdamW step on random tokens (the data does not change the arithmetic); the fastest
    of `steps` timed steps."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=torch.Generator().manual_seed(0))

    def step():
        model(input_ids, labels=input_ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # allocate optimizer state outside the timing
    return batch_size * seq_len / _fastest(step, steps)


@torch.no_grad()
def decode_tokens_per_second(
    model, batch_size: int, prompt_len: int, new_tokens: int, vocab_size: int, runs: int = 3
) -> float:
    """Greedy `generate()` of exactly `new_tokens` tokens per row, prefill included as a user would see it; the
    fastest of `runs` calls."""
    model.eval()
    prompt = torch.randint(0, vocab_size, (batch_size, prompt_len), generator=torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return batch_size * new_tokens / _fastest(lambda: model.generate(prompt, **kwargs), runs)


def _fastest(fn: Callable[[], object], runs: int) -> float:
    """Seconds of the fastest of `runs` calls."""
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def build_pair(setup: SpeedSetup):
    """A Llama model and the zoo model with the same config and, for the MHA family, the same weights."""
    llama_config = LlamaConfig(
        vocab_size=setup.vocab_size,
        hidden_size=setup.hidden_size,
        intermediate_size=setup.intermediate_size,
        num_hidden_layers=setup.num_hidden_layers,
        num_attention_heads=setup.num_attention_heads,
        num_key_value_heads=setup.num_key_value_heads,
        max_position_embeddings=max(setup.train_seq_len, setup.prompt_len + setup.new_tokens),
        tie_word_embeddings=True,
        eos_token_id=None,
        attn_implementation=setup.attn_implementation,
    )
    torch.manual_seed(0)
    llama = LlamaForCausalLM(llama_config)
    if not in_mha_family(setup.variant):
        raise ValueError(f"variant={setup.variant!r}: the Llama comparison covers the MHA family (mha, gqa, mqa).")
    return llama, from_llama(llama, variant=setup.variant)


def compare_with_llama(setup: SpeedSetup, log: Callable[[str], None] = print) -> SpeedReport:
    if setup.threads:
        torch.set_num_threads(setup.threads)
    llama, zoo = build_pair(setup)
    report = SpeedReport(setup=copy.deepcopy(setup), parameters=sum(p.numel() for p in zoo.parameters()))
    metrics = {
        f"training (batch {setup.train_batch_size} x {setup.train_seq_len})": lambda m: training_tokens_per_second(
            m, setup.train_batch_size, setup.train_seq_len, setup.train_steps, setup.vocab_size
        )
    }
    for batch_size in setup.decode_batch_sizes:
        metrics[f"generate decode (batch {batch_size}, prompt {setup.prompt_len}, {setup.new_tokens} new)"] = (
            lambda m, b=batch_size: decode_tokens_per_second(
                m, b, setup.prompt_len, setup.new_tokens, setup.vocab_size, setup.decode_runs
            )
        )
    report.samples = {metric: {"llama": [], "zoo": []} for metric in metrics}
    for measure in metrics.values():  # warm-up: first calls pay for allocations and lazy initialisation
        measure(llama), measure(zoo)
    for repeat in range(setup.repeats):
        for metric, measure in metrics.items():
            for name, model in alternating([("llama", llama), ("zoo", zoo)], repeat):
                report.samples[metric][name].append(measure(model))
        ratios = (report.samples[m]["zoo"][-1] / report.samples[m]["llama"][-1] for m in metrics)
        log(f"repeat {repeat + 1}/{setup.repeats}: zoo / Llama " + ", ".join(f"{r:.3f}" for r in ratios))
    return report


@dataclass
class TrainingThroughputSetup:
    """Every variant's preset against `LlamaForCausalLM` of the same width, depth, MLP and head counts."""

    variants: list[str] = field(default_factory=list, metadata={"help": "variants (default: all registered)"})
    size: str = field(default="small", metadata={"help": "preset of configs/models/<variant>.json"})
    vocab_size: int = field(default=8192, metadata={"help": "vocabulary of both models"})
    batch_size: int = field(default=8, metadata={"help": "training batch size"})
    seq_len: int = field(default=256, metadata={"help": "training sequence length"})
    steps: int = field(default=3, metadata={"help": "timed steps per sample; the fastest counts"})
    repeats: int = field(default=3, metadata={"help": "alternating samples per model"})


def llama_like(config) -> LlamaConfig:
    """The Llama config with a zoo config's width, depth, MLP, head counts and vocabulary."""
    return LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        attn_implementation="sdpa",
    )


def training_throughput(setup: TrainingThroughputSetup, log: Callable[[str], None] = print) -> list[dict]:
    """Training tokens/s of each variant's preset and of the same-size Llama, alternating, in this process."""
    from ..models import VARIANTS, get_variant

    rows = []
    for name in setup.variants or list(VARIANTS):
        torch.manual_seed(0)
        zoo = get_variant(name).build(setup.size, vocab_size=setup.vocab_size)
        config = zoo.config
        llama = LlamaForCausalLM(llama_like(config))
        measure = lambda model: training_tokens_per_second(  # noqa: E731
            model, setup.batch_size, setup.seq_len, setup.steps, setup.vocab_size
        )
        measure(zoo), measure(llama)  # warm-up
        samples = {"zoo": [], "llama": []}
        for repeat in range(setup.repeats):
            for label, model in alternating([("zoo", zoo), ("llama", llama)], repeat):
                samples[label].append(measure(model))
        row = {
            "variant": name,
            "parameters": sum(p.numel() for p in zoo.parameters()),
            "zoo_tokens_per_second": statistics.median(samples["zoo"]),
            "llama_tokens_per_second": statistics.median(samples["llama"]),
            "ratio": paired_ratio(samples["zoo"], samples["llama"]),
        }
        rows.append(row)
        log(
            f"{name:15s} {row['zoo_tokens_per_second']:8,.0f} tokens/s, Llama {row['llama_tokens_per_second']:8,.0f}"
            f" ({row['ratio']:.2f}x)"
        )
    return rows


def training_throughput_table(rows: list[dict], setup: TrainingThroughputSetup) -> str:
    lines = [
        f"Training tokens/s, `{setup.size}` presets (vocabulary {setup.vocab_size}), batch {setup.batch_size} x "
        f"{setup.seq_len}, forward + backward + AdamW, one process, {torch.get_num_threads()} CPU threads; "
        f"`LlamaForCausalLM` at the same width, depth, MLP and head counts, alternating in the same process, "
        f"medians of {setup.repeats} best-of-{setup.steps}-steps samples.",
        "",
        "| variant | parameters | zoo tokens/s | Llama tokens/s | zoo / Llama |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        lines.append(
            f"| `{row['variant']}` | {row['parameters'] / 1e6:.1f}M | {row['zoo_tokens_per_second']:,.0f} "
            f"| {row['llama_tokens_per_second']:,.0f} | {row['ratio']:.2f} |"
        )
    return "\n".join(lines)


@dataclass
class DecodeSetup:
    """Prefill and decode speed of every variant (the scaling benchmark's 8.4M configs) against the same-size Llama."""

    variants: list[str] = field(default_factory=list, metadata={"help": "variants (default: all registered)"})
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8], metadata={"help": "generate() batches"})
    prompt_len: int = field(default=512, metadata={"help": "prompt tokens"})
    new_tokens: int = field(default=256, metadata={"help": "generated tokens per row"})
    runs: int = field(default=2, metadata={"help": "calls per sample; the fastest counts"})
    repeats: int = field(default=3, metadata={"help": "alternating samples per model"})


@torch.no_grad()
def prefill_and_decode(model, batch_size: int, prompt_len: int, new_tokens: int, vocab_size: int, runs: int):
    """(prefill tokens/s, decode tokens/s, generate() output): prefill is generate() of one token; decoding is the
    rest of a generate() of `new_tokens` tokens, so both include what generate() adds around the model."""
    model.eval()
    prompt = torch.randint(0, vocab_size, (batch_size, prompt_len), generator=torch.Generator().manual_seed(1))
    kwargs = dict(do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    first = _fastest(lambda: model.generate(prompt, max_new_tokens=1, min_new_tokens=1, **kwargs), runs)
    output = None

    def full():
        nonlocal output
        output = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)

    whole = _fastest(full, runs)
    return batch_size * prompt_len / first, batch_size * (new_tokens - 1) / max(whole - first, 1e-9), output


def decode_benchmark(setup: DecodeSetup, log: Callable[[str], None] = print) -> list[dict]:
    from ..models import VARIANTS
    from .scaling import ScalingSetup, benchmark_model, cache_nbytes

    size = ScalingSetup()
    rows = []
    for name in setup.variants or list(VARIANTS):
        zoo = benchmark_model(name, size, max_length=setup.prompt_len + setup.new_tokens)
        llama = LlamaForCausalLM(llama_like(zoo.config)).eval()
        for batch_size in setup.batch_sizes:
            samples = {"zoo": [], "llama": []}
            cache = {}

            def measure(model, batch_size=batch_size):
                return prefill_and_decode(
                    model, batch_size, setup.prompt_len, setup.new_tokens, size.vocab_size, setup.runs
                )

            measure(zoo), measure(llama)  # warm-up
            for repeat in range(setup.repeats):
                for label, model in alternating([("zoo", zoo), ("llama", llama)], repeat):
                    prefill, decode, output = measure(model)
                    samples[label].append((prefill, decode))
                    cache[label] = cache_nbytes(output.past_key_values)
            tokens = batch_size * (setup.prompt_len + setup.new_tokens - 1)
            row = {"variant": name, "batch_size": batch_size}
            for index, kind in enumerate(("prefill", "decode")):
                zoo_values = [sample[index] for sample in samples["zoo"]]
                llama_values = [sample[index] for sample in samples["llama"]]
                row[f"{kind}_zoo"] = statistics.median(zoo_values)
                row[f"{kind}_llama"] = statistics.median(llama_values)
                row[f"{kind}_ratio"] = paired_ratio(zoo_values, llama_values)
            row["cache_bytes_per_token_zoo"] = cache["zoo"] / tokens
            row["cache_bytes_per_token_llama"] = cache["llama"] / tokens
            rows.append(row)
            log(
                f"{name:15s} batch {batch_size}: prefill {row['prefill_zoo']:8,.0f}/s ({row['prefill_ratio']:.2f}x), "
                f"decode {row['decode_zoo']:6,.0f}/s ({row['decode_ratio']:.2f}x), "
                f"cache {row['cache_bytes_per_token_zoo']:,.0f} B/token"
            )
    return rows


def decode_table(rows: list[dict], setup: DecodeSetup) -> str:
    lines = [
        f"`generate()` of {setup.new_tokens} tokens after a {setup.prompt_len}-token prompt, greedy, the scaling "
        f"benchmark's configs (6 layers x 256), {torch.get_num_threads()} CPU threads; `LlamaForCausalLM` of the same "
        f"width, depth and head counts alternating in the same process; medians of {setup.repeats} best-of-"
        f"{setup.runs} samples. Cache: bytes the cache holds per token (prompt and generated) at the end.",
        "",
        "| variant | batch | prefill tok/s | vs Llama | decode tok/s | vs Llama | cache B/token | Llama's |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        lines.append(
            f"| `{row['variant']}` | {row['batch_size']} | {row['prefill_zoo']:,.0f} | {row['prefill_ratio']:.2f} "
            f"| {row['decode_zoo']:,.0f} | {row['decode_ratio']:.2f} | {row['cache_bytes_per_token_zoo']:,.0f} "
            f"| {row['cache_bytes_per_token_llama']:,.0f} |"
        )
    return "\n".join(lines)


def decode_plot(rows: list[dict], path) -> bool:
    plt = headless_pyplot()
    if plt is None:
        return False
    batch_sizes = sorted({row["batch_size"] for row in rows})
    variants = list(dict.fromkeys(row["variant"] for row in rows))
    figure, axes = plt.subplots(1, len(batch_sizes), figsize=(7 * len(batch_sizes), 5), squeeze=False)
    for axis, batch_size in zip(axes[0], batch_sizes):
        by_variant = {row["variant"]: row for row in rows if row["batch_size"] == batch_size}
        x = range(len(variants))
        axis.bar(x, [by_variant[v]["decode_zoo"] for v in variants], color="tab:blue", label="zoo variant")
        axis.scatter(
            x,
            [by_variant[v]["decode_llama"] for v in variants],
            color="tab:red",
            marker="_",
            s=400,
            linewidths=3,
            label="LlamaForCausalLM, same size",
            zorder=3,
        )
        axis.set_xticks(list(x), variants, rotation=45, ha="right")
        axis.set(ylabel="decode tokens/s", title=f"generate() decode speed, batch {batch_size}")
        axis.grid(True, axis="y", alpha=0.3)
        axis.legend(fontsize=8)
    save_figure(figure, path)
    return True


@dataclass
class FastDecodeSetup:
    """Decode tokens/s with the dynamic cache, the static cache and the compiled decode step, against the same-size
    `LlamaForCausalLM` doing the same (the scaling benchmark's 8.4M configs)."""

    variants: list[str] = field(
        default_factory=lambda: ["mha", "gqa", "mqa", "sliding_window"], metadata={"help": "variants to measure"}
    )
    batch_size: int = field(default=1, metadata={"help": "rows per generate()"})
    prompt_len: int = field(default=128, metadata={"help": "prompt tokens"})
    new_tokens: int = field(default=128, metadata={"help": "generated tokens per row"})
    runs: int = field(default=2, metadata={"help": "calls per sample; the fastest counts"})
    repeats: int = field(default=3, metadata={"help": "alternating samples per model"})


FAST_DECODE_MODES = ("dynamic", "static", "compiled")


@torch.no_grad()
def decode_rate(model, mode: str, prompt: torch.Tensor, new_tokens: int, runs: int) -> tuple[float, torch.Tensor]:
    """(decode tokens/s, tokens) of greedy generation in `mode`: the time of `new_tokens` tokens minus the time of
    one (the prefill), so only decode steps count; a compiled step is warmed up (compiled) before timing."""
    from ..decoding import generate_compiled

    kwargs = dict(do_sample=False, pad_token_id=0)

    def generate(count: int) -> torch.Tensor:
        if mode == "compiled":
            # the same total cache length for both calls, so they share one compiled graph
            return generate_compiled(model, prompt, max_new_tokens=count, min_new_tokens=count, **kwargs)
        cache = {"cache_implementation": "static"} if mode == "static" else {}
        return model.generate(prompt, max_new_tokens=count, min_new_tokens=count, **cache, **kwargs)

    tokens = generate(new_tokens)  # warm-up: compiles the decode step
    whole = _fastest(lambda: generate(new_tokens), runs)
    first = _fastest(lambda: generate(1), runs)
    return prompt.shape[0] * (new_tokens - 1) / max(whole - first, 1e-9), tokens


def fast_decode_benchmark(setup: FastDecodeSetup, log: Callable[[str], None] = print) -> list[dict]:
    from .scaling import ScalingSetup, benchmark_model

    size = ScalingSetup()
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, size.vocab_size, (setup.batch_size, setup.prompt_len), generator=generator)
    rows = []
    for name in setup.variants:
        zoo = benchmark_model(name, size, max_length=setup.prompt_len + setup.new_tokens)
        llama = LlamaForCausalLM(llama_like(zoo.config)).eval()
        row = {"variant": name, "batch_size": setup.batch_size}
        reference = None
        # every repeat measures every mode and model back to back, so that each ratio (zoo / Llama in one mode,
        # compiled / dynamic for one model) compares samples taken moments apart on a machine whose load drifts
        samples = {(mode, label): [] for mode in FAST_DECODE_MODES for label in ("zoo", "llama")}
        for repeat in range(setup.repeats):
            for mode in FAST_DECODE_MODES:
                for label, model in alternating([("zoo", zoo), ("llama", llama)], repeat):
                    rate, tokens = decode_rate(model, mode, prompt, setup.new_tokens, setup.runs)
                    samples[mode, label].append(rate)
                    if label == "zoo":  # every mode must produce the dynamic cache's tokens
                        reference = tokens if reference is None else reference
                        row[f"{mode}_same_tokens"] = row.get(f"{mode}_same_tokens", True) and torch.equal(
                            tokens, reference
                        )
        for mode in FAST_DECODE_MODES:
            zoo_rates, llama_rates = samples[mode, "zoo"], samples[mode, "llama"]
            row[f"{mode}_zoo"] = statistics.median(zoo_rates)
            row[f"{mode}_llama"] = statistics.median(llama_rates)
            row[f"{mode}_ratio"] = paired_ratio(zoo_rates, llama_rates)
        for label in ("zoo", "llama"):
            row[f"compiled_over_dynamic_{label}"] = paired_ratio(samples["compiled", label], samples["dynamic", label])
        torch._dynamo.reset()  # the next variant compiles its own graphs
        rows.append(row)
        log(
            f"{name:15s} "
            + ", ".join(
                f"{mode} {row[f'{mode}_zoo']:6,.0f}/s ({row[f'{mode}_ratio']:.2f}x)" for mode in FAST_DECODE_MODES
            )
        )
    return rows


def fast_decode_table(rows: list[dict], setup: FastDecodeSetup) -> str:
    threads = torch.get_num_threads()
    lines = [
        f"Decode tokens/s, greedy, batch {setup.batch_size}, {setup.new_tokens} tokens after a {setup.prompt_len}-"
        f"token prompt, {threads} CPU threads, the scaling benchmark's configs (6 layers x 256): dynamic cache, "
        f'`cache_implementation="static"`, and the static cache with the `torch.compile`d decode step '
        f"(`hf_attn_zoo.decoding.generate_compiled`); `LlamaForCausalLM` of the same size doing the same, "
        f"alternating in the same process, medians of {setup.repeats} best-of-{setup.runs} samples; compiled/dyn.: "
        f"the compiled step's speed-up for each model; same: every mode gave the dynamic cache's tokens.",
        "",
        "| variant | dynamic | vs Llama | static | vs Llama | compiled | vs Llama | compiled/dyn. | Llama's | same |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in rows:
        same = all(row[f"{mode}_same_tokens"] for mode in FAST_DECODE_MODES)
        lines.append(
            f"| `{row['variant']}` | "
            + " | ".join(f"{row[f'{mode}_zoo']:,.0f} | {row[f'{mode}_ratio']:.2f}" for mode in FAST_DECODE_MODES)
            + f" | {row['compiled_over_dynamic_zoo']:.2f} | {row['compiled_over_dynamic_llama']:.2f} "
            f"| {'yes' if same else 'NO'} |"
        )
    return "\n".join(lines)
