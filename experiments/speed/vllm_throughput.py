"""Serving throughput of one `zoo_gqa` checkpoint: vLLM on its Llama export, vLLM's transformers backend on the zoo
checkpoint itself, and `hf-attn-zoo serve` (transformers' own server), same prompts, same machine, same run.

vllm         The checkpoint (6 layers x 256, 8 query heads of 32 sharing 2 key/value heads, the character tokenizer of
             the serving tests) is exported to Llama (`hf_attn_zoo.export`, or `to_llama` where that is absent)
             and served offline by vLLM's own `LlamaForCausalLM`; the zoo checkpoint is served offline by vLLM's
             transformers backend (`model_impl="transformers"`, remote code); and `hf-attn-zoo serve` answers the
             same prompts as concurrent `/v1/completions` requests, without and with `--continuous_batching`.
             Every engine generates `new_tokens` greedy tokens for each of `prompts` prompts of `prompt_len`
             characters; throughput is generated tokens per second of wall time for the whole batch, the fastest of
             `repeats` batches after a first one (vLLM: compiled, as it runs by default, unless `--enforce_eager`).
             vLLM's CPU engine pins itself to one core of the machine and leaves the other to its front end; the
             transformers server runs with torch's default threads. Writes results/vllm.md and vllm.json.

vLLM runs in its own environment (`experiments/vllm_env.py`, built on first use).

    python -m experiments vllm [--prompts 16] [--new_tokens 64] [--enforce_eager]
"""

import concurrent.futures
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from experiments.common import REPOSITORY, Benchmark, Results, main, write_results
from experiments.vllm_env import run_vllm, vllm_python
from hf_attn_zoo.models import VARIANTS

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} | {% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@dataclass
class VllmSetup(Results):
    """vLLM (Llama export), vLLM's transformers backend and transformers' server on one `zoo_gqa` checkpoint."""

    prompts: int = field(default=16, metadata={"help": "prompts in the batch (concurrent requests for the server)"})
    prompt_len: int = field(default=96, metadata={"help": "characters (= tokens) per prompt"})
    new_tokens: int = field(default=64, metadata={"help": "greedy tokens generated per prompt"})
    repeats: int = field(default=3, metadata={"help": "timed batches after the first; the fastest counts"})
    enforce_eager: bool = field(default=False, metadata={"help": "run vLLM without torch.compile"})
    serve_startup_s: float = field(default=300.0, metadata={"help": "how long to wait for the server to listen"})


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character (97 ids; `<|endoftext|>` 0, `<|pad|>` 1), with a chat template."""
    vocab = {"<|endoftext|>": 0, "<|pad|>": 1, **{chr(c): c - 30 for c in range(32, 127)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|pad|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|pad|>")
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def save_gqa(folder: Path) -> Path:
    """The benchmark's `zoo_gqa` checkpoint (random weights: throughput does not depend on them), no EOS."""
    torch.manual_seed(0)
    config = VARIANTS["gqa"].config(
        vocab_size=97,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=1,
        bos_token_id=None,
        eos_token_id=None,
    )
    VARIANTS["gqa"].causal_lm_class(config).eval().save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder


def export_llama(checkpoint: Path, output_dir: Path) -> tuple[Path, str]:
    """The checkpoint as a native Llama folder, and what wrote it."""
    try:
        from hf_attn_zoo.export import export_checkpoint
    except ImportError:
        from hf_attn_zoo.convert.llama import to_llama

        to_llama(AutoModelForCausalLM.from_pretrained(checkpoint)).save_pretrained(output_dir)
        char_tokenizer().save_pretrained(output_dir)
        return output_dir, "hf_attn_zoo.convert.llama.to_llama"
    return Path(export_checkpoint(checkpoint, "llama", output_dir)), "hf_attn_zoo.export.export_checkpoint"


def make_prompts(setup: VllmSetup) -> list[str]:
    """`prompts` different texts of `prompt_len` printable characters."""
    generator = torch.Generator().manual_seed(0)
    return [
        "".join(chr(32 + int(c)) for c in torch.randint(0, 95, (setup.prompt_len,), generator=generator))
        for _ in range(setup.prompts)
    ]


def vllm_row(checkpoint: Path, prompts: list[str], setup: VllmSetup, work: Path, **request) -> dict:
    """vLLM's offline `LLM.generate` on the whole batch at once."""
    answer = run_vllm(
        {
            "model": str(checkpoint),
            "prompts": prompts,
            "max_tokens": setup.new_tokens,
            "repeats": setup.repeats,
            "enforce_eager": setup.enforce_eager,
            "max_model_len": 512,
            **request,
        },
        work,
        timeout=1800,
    )
    generated = sum(len(ids) for ids in answer["token_ids"])
    seconds = min(answer["generate_seconds"])
    return {
        "model class": answer["model_class"],
        "tokens/s": generated / seconds,
        "seconds": seconds,
        "generated": generated,
        "startup_s": answer["startup_seconds"],
        "token_ids": answer["token_ids"],
    }


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=1800) as response:
        return json.loads(response.read())


def serve_row(checkpoint: Path, prompts: list[str], setup: VllmSetup, work: Path, *flags: str) -> dict:
    """`hf-attn-zoo serve` answering every prompt as one concurrent `/v1/completions` request per prompt."""
    import socket

    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        port = probe.getsockname()[1]
    log = work / f"serve{'-'.join(flags)}.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "hf_attn_zoo_cli", "serve", str(checkpoint), "--port", str(port), *flags]
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=REPOSITORY)
    url = f"http://localhost:{port}"
    start = time.perf_counter()
    try:
        while True:
            if process.poll() is not None or time.perf_counter() - start > setup.serve_startup_s:
                raise RuntimeError(f"hf-attn-zoo serve did not start:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.5)
        startup = time.perf_counter() - start

        def complete(prompt: str) -> dict:
            body = {"model": str(checkpoint), "prompt": prompt, "max_tokens": setup.new_tokens, "temperature": 0}
            return post(f"{url}/v1/completions", body)

        def batch() -> tuple[float, list[dict]]:
            begin = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(max_workers=len(prompts)) as pool:
                answers = list(pool.map(complete, prompts))
            return time.perf_counter() - begin, answers

        batch()  # the first batch warms the server up, as vLLM's first generation does
        timed = [batch() for _ in range(setup.repeats)]
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
    seconds, answers = min(timed, key=lambda sample: sample[0])
    tokenizer = char_tokenizer()
    token_ids = [tokenizer(answer["choices"][0]["text"])["input_ids"] for answer in answers]
    generated = sum(len(ids) for ids in token_ids)
    return {
        "model class": "ZooGQAForCausalLM (generate())",
        "tokens/s": generated / seconds,
        "seconds": seconds,
        "generated": generated,
        "startup_s": startup,
        "token_ids": token_ids,
    }


def reference_tokens(checkpoint: Path, prompts: list[str], new_tokens: int) -> list[list[int]]:
    """The checkpoint's own greedy `generate()` per prompt: what every engine should have answered."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    tokenizer = char_tokenizer()
    tokens = []
    for prompt in prompts:
        inputs = tokenizer(prompt, return_tensors="pt")
        output = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
        tokens.append(output[0, inputs["input_ids"].shape[1] :].tolist())
    return tokens


def run_vllm_benchmark(setup: VllmSetup, log: Callable[[str], None] = print) -> dict:
    vllm_python()  # build vLLM's environment first, so that its minutes are not in any measurement
    work = Path(tempfile.mkdtemp(prefix="vllm-bench-"))
    checkpoint = save_gqa(work / "zoo_gqa")
    llama, exporter = export_llama(checkpoint, work / "llama")
    prompts = make_prompts(setup)
    reference = reference_tokens(checkpoint, prompts, setup.new_tokens)
    engines = {
        "vLLM, Llama export": lambda: vllm_row(llama, prompts, setup, work / "native"),
        "vLLM, transformers backend": lambda: vllm_row(
            checkpoint, prompts, setup, work / "transformers", model_impl="transformers"
        ),
        "hf-attn-zoo serve": lambda: serve_row(checkpoint, prompts, setup, work),
        "hf-attn-zoo serve --continuous_batching": lambda: serve_row(
            checkpoint, prompts, setup, work, "--continuous_batching"
        ),
    }
    rows = []
    for engine, measure in engines.items():
        log(f"measuring {engine} ...")
        row = {"engine": engine, **measure()}
        row["same tokens as generate()"] = sum(a == b for a, b in zip(row.pop("token_ids"), reference, strict=True))
        rows.append(row)
        log(f"  {row['tokens/s']:.1f} tokens/s")
    return {
        "rows": rows,
        "exporter": exporter,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "setup": {k: v for k, v in vars(setup).items() if k != "output_dir"},
    }


def vllm_table(results: dict) -> str:
    setup = results["setup"]
    baseline = next(row for row in results["rows"] if row["engine"] == "hf-attn-zoo serve")["tokens/s"]
    lines = [
        f"One `zoo_gqa` checkpoint (6 layers x 256, 8 query heads of 32, 2 key/value heads, vocabulary 97), "
        f"{setup['prompts']} prompts of {setup['prompt_len']} tokens, {setup['new_tokens']} greedy tokens each, "
        f"float32 on CPU ({results['machine']}); tokens/s: generated tokens over the wall time of the whole batch, "
        f"fastest of {setup['repeats']} batches after a first. vLLM "
        f"{'eager' if setup['enforce_eager'] else 'compiled (its default)'}; the Llama export by "
        f"`{results['exporter']}`.",
        "",
        "| engine | served by | tokens/s | vs `hf-attn-zoo serve` | start-up s | answers equal to generate() |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for row in results["rows"]:
        lines.append(
            f"| {row['engine']} | {row['model class']} | {row['tokens/s']:.1f} | {row['tokens/s'] / baseline:.2f}x "
            f"| {row['startup_s']:.0f} | {row['same tokens as generate()']}/{setup['prompts']} |"
        )
    return "\n".join(lines)


def run(setup: VllmSetup) -> dict:
    results = run_vllm_benchmark(setup)
    write_results(setup.output_dir, "vllm", results, vllm_table(results))
    return results


BENCHMARKS = {"vllm": Benchmark(VllmSetup, run)}

if __name__ == "__main__":
    sys.exit(main(BENCHMARKS))
