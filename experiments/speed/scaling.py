"""How every variant scales with sequence length: forward time, peak memory, decoding cache.

Model: each variant built from its own `small` preset (its head counts, window, k, bias rank ... as the preset
carries them) at the benchmark's width and depth (6 layers x 256, vocabulary 16384, positions up to the longest
length), with 8 query heads where the variant has a head count (options: --hidden_size, --num_hidden_layers,
--num_attention_heads, --vocab_size), on the variant's default backend. decode.py measures the same models.

Forward: the base model (no LM head, which is the same for all) on one sequence of T tokens, T from 512 to 8192, no
cache. The time is the best of a few runs after a warm-up at the same length. The peak memory is the growth of the
process' resident set during one forward, in a fresh process per variant where glibc returns freed blocks at once
(`MALLOC_MMAP_THRESHOLD_`) and the kernel's high-water mark is reset before the forward (`/proc/self/clear_refs`,
Linux), so the figure is what the forward really holds at its peak. Timing runs with the normal allocator, since
that setting makes every large allocation fault its pages in anew. The scaling exponent is the least-squares slope
of log(time) against log(T). A variant stops growing T when its next length could take longer than the time budget
at quadratic growth; the memory pass measures the same lengths.

Decoding: bytes held by the cache after generating `decode_tokens` tokens from a short prompt, measured by adding up
the tensors the cache holds.

Writes results/scaling.md, scaling.json and, with matplotlib, scaling.png (about 15 minutes on 2 cores):

    python -m experiments scaling [--variants gqa linformer] [--lengths 512 1024 2048] [--output_dir DIR]
"""

import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from experiments.common import REPOSITORY, Benchmark, Results, main, write_results
from hf_attn_zoo.evaluation.plotting import colour, headless_pyplot, house_style, save_figure, ticks_at
from hf_attn_zoo.models import VARIANTS, get_variant
from hf_attn_zoo.models.compat_zoo import returned_cache


@dataclass
class ScalingSetup(Results):
    """Forward time, peak memory and decoding cache of every variant against sequence length."""

    variants: list[str] = field(default_factory=lambda: list(VARIANTS), metadata={"help": "variants to measure"})
    lengths: list[int] = field(
        default_factory=lambda: [512, 1024, 2048, 4096, 8192], metadata={"help": "sequence lengths"}
    )
    hidden_size: int = field(default=256, metadata={"help": "model width"})
    num_hidden_layers: int = field(default=6, metadata={"help": "layers"})
    num_attention_heads: int = field(
        default=8, metadata={"help": "query heads of the variants whose preset sets a head count"}
    )
    vocab_size: int = field(default=16384, metadata={"help": "vocabulary"})
    runs: int = field(default=2, metadata={"help": "timed forwards per length; the fastest counts"})
    time_budget_s: float = field(
        default=60.0, metadata={"help": "stop at a length whose forward could take longer at the next (quadratic) one"}
    )
    decode_tokens: int = field(default=1024, metadata={"help": "tokens generated before the cache is measured"})
    threads: int | None = field(default=None, metadata={"help": "torch threads (default: torch's choice)"})
    add: bool = field(
        default=False,
        metadata={
            "help": "keep the rows of the other variants in the existing scaling.json (measured at the same sizes "
            "and lengths), so a new variant is measured beside a re-measured baseline without rerunning every row"
        },
    )

    # what makes two runs' rows comparable: everything but the variants, the thread count, --add and the time
    # budget (which decides where a variant stops, not what a row measures)
    def sizes(self) -> dict:
        ignored = ("variants", "threads", "add", "time_budget_s")
        return {name: value for name, value in asdict(self).items() if name not in ignored}


def benchmark_model(name: str, setup: ScalingSetup, max_length: int):
    """The benchmark's model of variant `name`: its `small` preset at the setup's width, depth and vocabulary."""
    variant = get_variant(name)
    heads = (
        {"num_attention_heads": setup.num_attention_heads} if "num_attention_heads" in variant.preset("small") else {}
    )
    torch.manual_seed(0)
    return variant.build(
        "small",
        hidden_size=setup.hidden_size,
        num_hidden_layers=setup.num_hidden_layers,
        vocab_size=setup.vocab_size,
        max_position_embeddings=max_length,
        **heads,
    ).eval()


def cache_nbytes(cache) -> int:
    """Bytes of every tensor a transformers `Cache` holds (key/value layers or zoo state layers)."""
    total = 0
    for layer in cache.layers:
        if hasattr(layer, "nbytes"):
            total += layer.nbytes()
        else:
            total += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values) if t is not None)
    return total


def _memory_status(key: str) -> int:
    with open("/proc/self/status") as status:
        return int(re.search(rf"{key}:\s+(\d+) kB", status.read()).group(1)) * 1024


def _reset_peak_memory() -> None:
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # reset the resident set's high-water mark (VmHWM)


def _input(model, length: int) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))


@torch.inference_mode()
def time_forward(model, length: int, runs: int) -> float:
    """Seconds of the fastest of `runs` forwards, after one warm-up forward at the same length."""
    input_ids = _input(model, length)
    model.model(input_ids, use_cache=False)
    best = math.inf
    for _ in range(runs):
        start = time.perf_counter()
        model.model(input_ids, use_cache=False)
        best = min(best, time.perf_counter() - start)
    return best


@torch.inference_mode()
def peak_memory_of_forward(model, length: int) -> int:
    """Bytes the resident set grew by at the peak of one forward (run with `MALLOC_MMAP_THRESHOLD_` set)."""
    input_ids = _input(model, length)
    model.model(input_ids[:, :64], use_cache=False)  # first-call allocations out of the way
    baseline = _memory_status("VmRSS")
    _reset_peak_memory()
    model.model(input_ids, use_cache=False)
    return _memory_status("VmHWM") - baseline


@torch.inference_mode()
def measure_decode_cache(model, tokens: int) -> int:
    prompt = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    out = model.generate(
        prompt,
        max_new_tokens=tokens,
        min_new_tokens=tokens,
        do_sample=False,
        pad_token_id=0,
        return_dict_in_generate=True,
    )
    return cache_nbytes(returned_cache(out))


def measure_time(setup: ScalingSetup, log=print) -> dict:
    """Forward times (up to the budget) and decoding caches of every variant, in this process."""
    if setup.threads:
        torch.set_num_threads(setup.threads)
    results = {}
    for name in setup.variants:
        model = benchmark_model(name, setup, max_length=max(max(setup.lengths), setup.decode_tokens + 16))
        rows = []
        for length in setup.lengths:
            seconds = time_forward(model, length, setup.runs)
            rows.append({"length": length, "seconds": seconds})
            log(f"{name:15s} T={length:5d}: {seconds:8.3f} s")
            next_lengths = [n for n in setup.lengths if n > length]
            if next_lengths and seconds * (next_lengths[0] / length) ** 2 > setup.time_budget_s:
                break  # the next length could take 4x as long: over the budget
        cache = measure_decode_cache(model, setup.decode_tokens)
        results[name] = {
            "measured": time.strftime("%Y-%m-%d"),
            "load_average": round(os.getloadavg()[0], 1),  # what else ran: rows of one run compare, other runs less
            "parameters": sum(p.numel() for p in model.parameters()),
            "forward": rows,
            "cache_bytes": cache,
            "cached_tokens": 16 + setup.decode_tokens - 1,
        }
        log(f"{name:15s} cache after {setup.decode_tokens} generated tokens: {cache / 2**10:.1f} KiB")
    return results


def measure_memory(setup: ScalingSetup, lengths: dict[str, list[int]], log=print) -> dict[str, list[int]]:
    """Peak bytes of one forward per variant and length, in this process (started with `MALLOC_MMAP_THRESHOLD_`)."""
    if setup.threads:
        torch.set_num_threads(setup.threads)
    peaks = {}
    for name, variant_lengths in lengths.items():
        model = benchmark_model(name, setup, max_length=max(setup.lengths))
        peaks[name] = [peak_memory_of_forward(model, length) for length in variant_lengths]
        log(f"{name:15s} peak MiB: " + ", ".join(f"{peak / 2**20:.1f}" for peak in peaks[name]))
    return peaks


def exponent(rows: list[dict], key: str = "seconds") -> float:
    """Least-squares slope of log(value) against log(length)."""
    xs = [math.log(row["length"]) for row in rows]
    ys = [math.log(max(row[key], 1e-12)) for row in rows]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    covariance = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys))
    return covariance / sum((x - mean_x) ** 2 for x in xs)


def measured(result: dict) -> str:
    """When a row was measured and the machine's 1-minute load then (rows measured before both were kept: —)."""
    if "measured" not in result:
        return "—"
    return f"{result['measured']} ({result['load_average']})"


def table(results: dict, setup: ScalingSetup) -> str:
    lengths = setup.lengths
    header = " | ".join(f"T={n}" for n in lengths)
    threads = setup.threads or torch.get_num_threads()
    lines = [
        f"Forward time in seconds and peak memory in MiB (batch 1, {setup.num_hidden_layers} layers x "
        f"{setup.hidden_size}, base model without the LM head, {threads} thread{'s' if threads != 1 else ''}; "
        f"— : over the time budget), fitted exponents, the decoding cache after {setup.decode_tokens} generated "
        "tokens, and when each row was measured with the machine's 1-minute load average then (rows of one date "
        "are one run, one process).",
        "",
        f"| variant | params | {header} | time exp. | memory exp. | cache (KiB) | cache bytes/token "
        "| measured (load) |",
        "| --- | ---: | " + " | ".join("---:" for _ in lengths) + " | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, result in results.items():
        by_length = {row["length"]: row for row in result["forward"]}
        cells = [
            f"{by_length[n]['seconds']:.2f} s / {by_length[n]['peak_bytes'] / 2**20:.0f}" if n in by_length else "—"
            for n in lengths
        ]
        rows = result["forward"]
        time_exponent = f"{exponent(rows):.2f}" if len(rows) >= 2 else "—"
        measurable = len(rows) >= 2 and all(row["peak_bytes"] >= 2**20 for row in rows)  # below 1 MiB is noise
        exponents = f"{time_exponent} | {exponent(rows, 'peak_bytes'):.2f}" if measurable else f"{time_exponent} | —"
        cache = result["cache_bytes"]
        lines.append(
            f"| `{name}` | {result['parameters'] / 1e6:.1f}M | {' | '.join(cells)} | {exponents} "
            f"| {cache / 2**10:,.0f} | {cache / result['cached_tokens']:,.0f} | {measured(result)} |"
        )
    return "\n".join(lines)


def plot(results: dict, path: Path) -> bool:
    """Forward time and peak memory against T (log-log), one line per variant in its house colour; one legend for
    both panels, outside them, naming each variant with its fitted time exponent."""
    plt = headless_pyplot()
    if plt is None:
        return False
    with house_style():
        figure, (time_axis, memory_axis) = plt.subplots(1, 2, figsize=(13, 5.5), layout="constrained")
        for index, (name, result) in enumerate(results.items()):
            rows = result["forward"]
            lengths = [row["length"] for row in rows]
            style = dict(color=colour(name), marker="os^Dv<>p*hX"[index % 11])
            label = f"{name} (time ∝ T^{exponent(rows):.2f})" if len(rows) >= 2 else name
            time_axis.loglog(lengths, [row["seconds"] for row in rows], label=label, **style)
            memory_axis.loglog(lengths, [row["peak_bytes"] / 2**20 for row in rows], **style)
        time_axis.set(xlabel="sequence length T (tokens)", ylabel="forward time (s)", title="forward time")
        memory_axis.set(
            xlabel="sequence length T (tokens)", ylabel="peak memory (MiB)", title="peak memory of the forward"
        )
        measured = [row["length"] for result in results.values() for row in result["forward"]]
        for axis in (time_axis, memory_axis):
            axis.set_xscale("log", base=2)
            ticks_at(axis.xaxis, measured)
        figure.legend(loc="outside right upper", title="variant (fitted exponent)")
        save_figure(figure, path)
    return True


def scaling_figures(data: dict) -> dict:
    """scaling.png from scaling.json's contents, for a run and `--replot`."""
    return {"scaling.png": lambda path: plot(data["results"], path)}


# the first argument of this script in the child processes of `run_scaling`
CHILD = "--measure-in-child"


def _child(task: str, payload: dict, env: dict) -> dict:
    command = [sys.executable, "-m", __spec__.name, CHILD, task, json.dumps(payload)]
    # run as a module of the experiments package, from the repository's root, as the parent was
    child = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True, check=True, cwd=REPOSITORY)
    return json.loads(child.stdout.strip().splitlines()[-1])


def earlier_results(setup: ScalingSetup) -> dict:
    """The rows of the scaling.json `--add` adds to ({} where there is none), refused before anything is measured
    when they were measured at other sizes or lengths."""
    path = Path(setup.output_dir) / "scaling.json"
    if not path.is_file():
        return {}
    earlier = json.loads(path.read_text())
    earlier_sizes = ScalingSetup(**{**asdict(setup), **earlier["setup"]}).sizes()
    differ = [name for name, value in setup.sizes().items() if earlier_sizes[name] != value]
    if differ:
        raise SystemExit(f"--add: {path} was measured with other {', '.join(differ)}; rerun without --add")
    return earlier["results"]


def run_scaling(setup: ScalingSetup, log=print) -> dict:
    """Times in one child process, peak memory in another with glibc returning freed memory at once; then the
    table, the JSON and the plot."""
    earlier = earlier_results(setup) if setup.add else {}
    results = _child("time", {"setup": asdict(setup)}, dict(os.environ))
    lengths = {name: [row["length"] for row in result["forward"]] for name, result in results.items()}
    memory_env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    peaks = {}  # a fresh process per variant: nothing resident from another model's run to reuse
    for name in results:
        peaks.update(_child("memory", {"setup": asdict(setup), "lengths": {name: lengths[name]}}, memory_env))
    for name, result in results.items():
        for row, peak in zip(result["forward"], peaks[name]):
            row["peak_bytes"] = peak
    if earlier:  # this run's rows in place of (or beside) the earlier ones, in the registry's order
        merged = {**earlier, **results}
        order = [name for name in VARIANTS if name in merged] + [name for name in merged if name not in VARIANTS]
        results = {name: merged[name] for name in order}
        setup = ScalingSetup(**{**asdict(setup), "variants": order})
    data = {"setup": asdict(setup), "results": results}
    write_results(setup.output_dir, "scaling", data, table(results, setup), scaling_figures(data))
    return results


BENCHMARKS = {"scaling": Benchmark(ScalingSetup, run_scaling, figures=scaling_figures, results="scaling")}

if __name__ == "__main__":
    if sys.argv[1:2] == [CHILD]:  # a child process of `run_scaling`: progress on stderr, results as JSON on stdout
        task, payload = sys.argv[2], json.loads(sys.argv[3])
        progress = lambda line: print(line, file=sys.stderr)  # noqa: E731
        if task == "time":
            print(json.dumps(measure_time(ScalingSetup(**payload["setup"]), log=progress)))
        else:
            print(json.dumps(measure_memory(ScalingSetup(**payload["setup"]), payload["lengths"], log=progress)))
    else:
        sys.exit(main(BENCHMARKS))
