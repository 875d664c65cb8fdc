"""Fast decoding: a preallocated static cache and a `torch.compile`d one-token decode step, through `generate()`.

gpt-fast's recipe, expressed with transformers' own machinery: the cache is allocated once for prompt + new tokens
(`StaticLayer`s: fixed shapes, writes in place), so every decode step has the same shapes and compiles to one graph;
`generate()` runs the prefill eagerly and the decode steps through `model.get_compiled_call(compile_config)`.

    from hf_attn_zoo.decoding import generate_compiled
    out = generate_compiled(model, **tokenizer(prompts, return_tensors="pt", padding=True), max_new_tokens=64)

`generate(cache_implementation="static")` alone (no compilation) works for every variant whose cache holds keys and
values; compilation is for the variants that declare `_can_compile_fullgraph` (the MHA family and sliding window)
and for transformers' own models (`LlamaForCausalLM`), so the benchmark compares like with like.

Sliding window: transformers' static sliding layer tracks its fill level in a Python int, which `torch.compile`
guards on, so every decode step recompiles (Mistral in transformers 5.23 hits the recompile limit the same way).
`static_cache` therefore gives sliding-window models full-length static layers, and the window lives in the mask:
one graph for the whole generation, at the price of a cache of prompt + new tokens instead of the window.

The first compilation takes tens of seconds on CPU (measured on 2 cores with an empty inductor cache: 38 s for a
2-layer test model, 79 s for the 6-layer `small` preset; 13 s and 25 s with a warm cache); `generate_compiled` logs
one warning before the first one of a process, so that the wait is not mistaken for a hang.
"""

import logging

import torch
from transformers import CompileConfig, PreTrainedModel
from transformers.cache_utils import Cache, StaticLayer

logger = logging.getLogger(__name__)

# whether this process has said that the decode step is being compiled (later compilations are for new shapes only)
_compile_announced = False


def static_cache(model: PreTrainedModel, max_cache_len: int) -> Cache:
    """A cache of full-attention `StaticLayer`s holding `max_cache_len` positions per layer (the batch size and
    dtype are taken from the first write)."""
    if not getattr(model, "_can_compile_fullgraph", False):
        raise ValueError(
            f"{type(model).__name__} does not declare _can_compile_fullgraph: its decode step does not compile to one "
            f"graph (its cache is a recurrent state or grows by concatenation); use generate() without compilation."
        )
    config = model.config.get_text_config(decoder=True)
    return Cache(layers=[StaticLayer(max_cache_len=max_cache_len) for _ in range(config.num_hidden_layers)])


def compile_config(device: torch.device | str = "cpu") -> CompileConfig:
    """`CompileConfig` for the decode step: one full graph with static shapes; CUDA graphs on a GPU."""
    on_gpu = torch.device(device).type == "cuda"
    config = CompileConfig(fullgraph=True, dynamic=False, mode="reduce-overhead" if on_gpu else "default")
    # transformers compiles the decode step only on accelerators unless told otherwise; on CPU it pays off too
    config._compile_all_devices = True
    return config


@torch.no_grad()
def generate_compiled(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 32,
    **generate_kwargs,
) -> torch.LongTensor:
    """`model.generate` with a static cache sized for the prompt and `max_new_tokens`, and the decode step compiled.

    The first call with a new batch size or total length compiles (tens of seconds on CPU; the first one in a process
    logs a warning before it); later calls with the same shapes reuse the graph. Tokens equal those of the dynamic
    cache (greedy decoding; tested)."""
    cache = static_cache(model, input_ids.shape[1] + max_new_tokens)
    global _compile_announced
    if not _compile_announced:
        _compile_announced = True
        logger.warning(
            "torch.compile is compiling the decode step: the first generate_compiled() call waits tens of seconds "
            "for it (on 2 CPU cores: 40 s for a 2-layer model, 80 s for the 6-layer `small` preset, a third of that "
            "with a warm inductor cache); calls with the same batch size and length reuse it..."
        )
    return model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        cache=cache,
        compile_config=compile_config(input_ids.device),
        **generate_kwargs,
    )
