"""llama.cpp on the zoo's GGUF export: tokens/s beside the zoo's own `generate()`, same checkpoint, same prompt.

llama-cpp-python builds llama.cpp from source (several minutes on 2 cores), so it lives in a virtual environment of
its own, built once and reused (`llama_cpp_python()`: `$HF_ATTN_ZOO_CACHE/llama_cpp_venv`, by default under
~/.cache/hf_attn_zoo), and runs as a subprocess (`run_llama_cpp`: a JSON request in, a JSON answer out). The test
of the GGUF export (tests/test_llama_cpp.py) uses the same two functions.

    python -m experiments llama-cpp [--prompt_len 128] [--new_tokens 128] [--threads 2]

The model: the `gqa` variant's `small` preset (the scaling benchmark's size: 6 layers x 256, 4 heads, 2 key/value
heads) with a byte-level BPE of 4,096 tokens trained on the first standard-library files, random weights (speed does
not depend on them). Exported at f32, f16 and q8_0; each row is the fastest of `--runs` greedy generations of
`--new_tokens` tokens after a `--prompt_len`-token prompt at batch 1: the prefill's tokens/s and the decode's.
Writes results/llama_cpp.md and llama_cpp.json.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from experiments.common import Benchmark, Results, main, write_results

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
CACHE = Path(os.environ.get("HF_ATTN_ZOO_CACHE", Path.home() / ".cache" / "hf_attn_zoo"))
VENV = CACHE / "llama_cpp_venv"
STAMP = "hf_attn_zoo_requirement.txt"  # inside the venv: what it was built for


class LlamaCppUnavailable(RuntimeError):
    """llama-cpp-python cannot be built here (no compiler, no cmake, a failed build): the reason."""


def llama_cpp_python(log=print) -> Path:
    """The Python of a virtual environment with `LLAMA_CPP_PYTHON` installed, built on first use (into a sibling
    folder renamed into place, so an interrupted build is never taken for a finished one)."""
    python = VENV / "bin" / "python"
    if python.exists() and (VENV / STAMP).is_file() and (VENV / STAMP).read_text() == LLAMA_CPP_PYTHON:
        return python
    missing = [tool for tool in ("cc", "c++", "cmake") if shutil.which(tool) is None]
    if missing:
        raise LlamaCppUnavailable(f"building llama.cpp needs {', '.join(missing)}, not found on PATH")
    staging = VENV.with_name(VENV.name + ".partial")
    if staging.exists():
        shutil.rmtree(staging)
    subprocess.run([sys.executable, "-m", "venv", str(staging)], check=True)
    log(f"building {LLAMA_CPP_PYTHON} into {VENV} (llama.cpp from source: several minutes)")
    env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", "2")}
    result = subprocess.run(
        [str(staging / "bin" / "python"), "-m", "pip", "install", "-q", LLAMA_CPP_PYTHON],
        env=env,
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        tail = " ".join(result.stderr.strip().splitlines()[-3:])
        raise LlamaCppUnavailable(f"pip install {LLAMA_CPP_PYTHON} failed: {tail}")
    (staging / STAMP).write_text(LLAMA_CPP_PYTHON)
    if VENV.exists():
        shutil.rmtree(VENV)  # built for another requirement
    staging.rename(VENV)
    return python


# Runs inside the llama-cpp-python environment: one request (JSON on stdin), one answer (JSON on stdout).
RUNNER = r"""
import json, sys, time
import numpy as np
import llama_cpp
from llama_cpp import Llama

request = json.load(sys.stdin)
llm = Llama(
    model_path=request["model"], n_ctx=request["n_ctx"], n_threads=request["threads"], n_batch=request["n_ctx"],
    logits_all=request["logits"], verbose=False, seed=0,
    # llama.cpp keeps its cache in float16 by default: float32 keeps an f32 file's numbers those of the weights
    type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32,
)
answer = {
    "tokens": {text: llm.tokenize(text.encode("utf-8"), add_bos=False, special=True) for text in request["strings"]},
    "vocab": llm.n_vocab(),
}
prompt = request["prompt"]
if request.get("logits"):
    llm.reset()
    llm.eval(prompt)
    answer["logits"] = np.asarray(llm.scores[: len(prompt)], dtype=np.float64).tolist()
best_prefill = best_decode = float("inf")
for _ in range(request.get("runs", 1)):
    llm.reset()
    generated = []
    start = time.perf_counter()
    # greedy, and it never stops by itself (no EOS check)
    for token in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
        if not generated:
            first = time.perf_counter()
        generated.append(token)
        if len(generated) == request["new_tokens"]:
            break
    end = time.perf_counter()
    best_prefill, best_decode = min(best_prefill, first - start), min(best_decode, end - first)
answer.update(generated=generated, prefill_seconds=best_prefill, decode_seconds=best_decode)
print(json.dumps(answer))
"""


def run_llama_cpp(
    python: Path,
    model: Path,
    prompt: list[int],
    new_tokens: int,
    strings: list[str] = (),
    logits: bool = False,
    threads: int = 2,
    runs: int = 1,
) -> dict:
    """llama.cpp (through llama-cpp-python) on a GGUF file: its tokenization of `strings`, the greedy continuation of
    `prompt` (`generated`), the prompt's logits when asked, and the fastest prefill and decode seconds of `runs`."""
    request = {
        "model": str(model),
        "prompt": list(prompt),
        "new_tokens": new_tokens,
        "strings": list(strings),
        "logits": logits,
        "threads": threads,
        "runs": runs,
        "n_ctx": len(prompt) + new_tokens + 8,
    }
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "run_llama_cpp.py"
        script.write_text(RUNNER)
        result = subprocess.run(
            [str(python), str(script)], input=json.dumps(request), capture_output=True, text=True, check=False
        )
    if result.returncode != 0:
        raise RuntimeError(f"llama.cpp failed on {model}: {result.stderr.strip()[-2000:]}")
    return json.loads(result.stdout)


@dataclass
class LlamaCppSetup(Results):
    """llama.cpp tokens/s on the GGUF export (f32, f16, q8_0) beside the zoo's generate() on the same checkpoint."""

    checkpoint: str | None = field(
        default=None, metadata={"help": "a zoo MHA-family checkpoint with a tokenizer (default: gqa `small`, random)"}
    )
    prompt_len: int = field(default=128, metadata={"help": "prompt tokens"})
    new_tokens: int = field(default=128, metadata={"help": "generated tokens"})
    threads: int = field(default=2, metadata={"help": "threads for llama.cpp and torch alike"})
    runs: int = field(default=3, metadata={"help": "generations per engine; the fastest counts"})


def default_checkpoint(folder: Path) -> Path:
    """The `gqa` variant's `small` preset with a 4,096-token byte-level BPE of the standard library's first files."""
    import torch

    from hf_attn_zoo.checkpoints import save_checkpoint
    from hf_attn_zoo.data import stdlib_corpus_files, tokenizer_fields, train_byte_level_bpe
    from hf_attn_zoo.models import VARIANTS

    texts = [path.read_text(encoding="utf-8", errors="replace") for path in stdlib_corpus_files()[:200]]
    tokenizer = train_byte_level_bpe(texts, vocab_size=4096)
    torch.manual_seed(0)
    fields = {**tokenizer_fields(tokenizer), "eos_token_id": None}  # generate() runs to new_tokens, as llama.cpp does
    config = VARIANTS["gqa"].config("small", **fields, max_position_embeddings=1024)
    return save_checkpoint(folder, VARIANTS["gqa"].causal_lm_class(config).eval(), tokenizer=tokenizer)


def zoo_rates(checkpoint: Path, prompt: list[int], setup: LlamaCppSetup) -> dict:
    """The zoo's greedy `generate()` (float32, batch 1): tokens, fastest prefill and decode seconds."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(setup.threads)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    settings = dict(do_sample=False, eos_token_id=None, pad_token_id=model.config.pad_token_id)
    best_prefill = best_total = float("inf")
    with torch.no_grad():
        for _ in range(setup.runs):
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, **settings)
            best_prefill = min(best_prefill, time.perf_counter() - start)
            start = time.perf_counter()
            output = model.generate(ids, max_new_tokens=setup.new_tokens, min_new_tokens=setup.new_tokens, **settings)
            best_total = min(best_total, time.perf_counter() - start)
    return {
        "generated": output[0, len(prompt) :].tolist(),
        "prefill_seconds": best_prefill,
        "decode_seconds": max(best_total - best_prefill, 1e-9),
    }


def run(setup: LlamaCppSetup) -> list[dict]:
    from transformers import AutoTokenizer

    from hf_attn_zoo.data import stdlib_corpus_files
    from hf_attn_zoo.export import export_checkpoint

    python = llama_cpp_python()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        checkpoint = Path(setup.checkpoint) if setup.checkpoint else default_checkpoint(work / "zoo")
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        text = stdlib_corpus_files()[-1].read_text(encoding="utf-8", errors="replace")
        prompt = tokenizer(text).input_ids[: setup.prompt_len]
        zoo = zoo_rates(checkpoint, prompt, setup)
        rows.append({"engine": "zoo generate() (transformers, float32)", **zoo, "same_tokens_as_zoo": 1.0})
        for dtype in ("f32", "f16", "q8_0"):
            gguf = export_checkpoint(checkpoint, "gguf", work / f"gguf_{dtype}", dtype=dtype)
            answer = run_llama_cpp(python, gguf, prompt, setup.new_tokens, threads=setup.threads, runs=setup.runs)
            same = sum(a == b for a, b in zip(answer["generated"], zoo["generated"])) / setup.new_tokens
            rows.append(
                {
                    "engine": f"llama.cpp {dtype} ({gguf.stat().st_size / 2**20:.1f} MiB)",
                    "generated": answer["generated"],
                    "prefill_seconds": answer["prefill_seconds"],
                    "decode_seconds": answer["decode_seconds"],
                    "same_tokens_as_zoo": same,
                }
            )
    load = os.getloadavg()[0]  # the machine is shared: a load above its cores slows every engine alike
    for row in rows:
        row["load_average"] = load
        row["prefill_tokens_per_second"] = len(prompt) / row["prefill_seconds"]
        row["decode_tokens_per_second"] = (setup.new_tokens - 1) / row["decode_seconds"]
    write_results(setup.output_dir, "llama_cpp", rows, table(rows, setup))
    return rows


def table(rows: list[dict], setup: LlamaCppSetup) -> str:
    model = setup.checkpoint or "`gqa` small preset (6 x 256, 4 heads, 2 key/value heads, 4,096-token BPE)"
    base = rows[0]
    lines = [
        f"{model}; greedy, batch 1, {setup.new_tokens} tokens after a {setup.prompt_len}-token prompt, "
        f"{setup.threads} threads, fastest of {setup.runs}; {LLAMA_CPP_PYTHON}; load average "
        f"{base['load_average']:.1f} on {os.cpu_count()} cores at the end of the run.",
        "",
        "| engine | prefill tok/s | decode tok/s | decode vs zoo | greedy tokens equal to the zoo's |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        lines.append(
            f"| {row['engine']} | {row['prefill_tokens_per_second']:,.0f} | {row['decode_tokens_per_second']:,.1f} "
            f"| {row['decode_tokens_per_second'] / base['decode_tokens_per_second']:.2f} "
            f"| {100 * row['same_tokens_as_zoo']:.0f}% |"
        )
    return "\n".join(lines)


BENCHMARKS = {"llama-cpp": Benchmark(LlamaCppSetup, run)}

if __name__ == "__main__":
    sys.exit(main(BENCHMARKS))
