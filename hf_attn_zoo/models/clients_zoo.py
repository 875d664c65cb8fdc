"""What third-party clients of a model can and cannot do with each variant, decided in one place.

Some tools reach inside a model on assumptions that hold for Llama's attention: transformers' continuous batching
(a paged key/value cache only its own attention functions read and write), kvpress's presses (which rebuild Llama's
RoPE queries from `q_proj` and evict cached keys and values), and caches built outside the model from the config's
head shapes (a static cache allocated before the first forward, as ExecuTorch's export recipe does, or PEFT's prefix
tuning, whose virtual tokens are such keys and values). A variant that breaks an assumption is refused up front,
with one line naming the tool, the reason and the fix, rather than failing inside the tool or giving other results.

Variants do not write these sentences. Their attention class declares facts about its math, on `ZooAttention`:
`decodes_from_state()` (a running state instead of per-token keys and values), `cached_widths` and `caches` (what a
layer keeps per token), `maps_per_head` (differential attention's two), `scores` (a score that is not a dot product),
`keeps_scores` (a selection before the softmax), `reads_positions` (a kernel that places keys by position), `backends`
(whether transformers' attention functions run it) and the config's position type. Every refusal below follows from
those, so a new variant answers every client by stating its math, and a new client is one function here. The backbone
(`ZooAttention.__setattr__`, `ZooModel._check_cache`, the vLLM path of the MHA family's attention),
`hf_attn_zoo.serving` and the client tests read this module.

Like its siblings it travels next to every saved checkpoint (remote code), so it imports only torch.
"""

import torch

__all__ = [
    "INSTEAD",
    "VLLM_ATTENTION",
    "attribute_refusal",
    "cache_refusal",
    "config_shaped_cache_refusal",
    "continuous_batching_refusal",
    "kv_compression_refusal",
    "vllm_refusal",
    "vllm_refusal_line",
]

# What a refused variant can do instead, per client (the client tests' table shows it after the reason)
INSTEAD = {
    "serve-cb": "serve it without `--continuous_batching`",
    "kvpress": "decode with the full cache",
    "native": "serve it with `hf-attn-zoo serve`, or load it with trust_remote_code",
    "llama_cpp": "export it `--to native` (transformers, vLLM) where it has a native architecture, or serve it with "
    "`hf-attn-zoo serve`",
    "vllm-native": "serve it with `hf-attn-zoo serve`, or load it with trust_remote_code",
    "vllm-transformers": (
        "export it `--to native` (`hf-attn-zoo export CKPT --to native OUT`) where it has a native architecture and "
        "serve that with vLLM, or serve it with `hf-attn-zoo serve`"
    ),
}

# The names vLLM's transformers backend registers in transformers' `ALL_ATTENTION_FUNCTIONS` and sets as the config's
# `_attn_implementation` before it builds a model: its own paged attention (and its multi-head-latent form)
VLLM_ATTENTION = ("vllm", "vllm_mla")

STATE = "it decodes from a running state per layer"


def continuous_batching_refusal(attention: type, config) -> str | None:
    """Why transformers' continuous batching cannot run `attention` exactly (a short clause), or None when it can.

    Continuous batching packs the requests into one row and keeps keys and values in a paged cache, which only
    transformers' attention functions (`ALL_ATTENTION_FUNCTIONS`: paged|eager, sdpa, flash) write and read, from the
    packed-batch keywords they receive, one map of per-head keys and values per layer."""
    if attention.decodes_from_state():
        return f"{STATE}, which transformers' paged key/value cache cannot hold"
    if attention.caches is not None:
        return (
            f"it caches {attention.caches} per token, which transformers' paged cache (keys and values of "
            f"num_key_value_heads x head_dim each) cannot hold"
        )
    if attention.maps_per_head > 1:
        # each attention call would write the layer's keys into the paged cache, the second over the first
        return f"it runs {attention.maps_per_head} attention maps per layer, and transformers' paged cache holds one"
    if attention.scores is not None:
        return f"its scores are {attention.scores}, which transformers' paged-attention functions do not compute"
    if attention.keeps_scores is not None:
        return f"it keeps {attention.keeps_scores}, which transformers' paged-attention functions do not select"
    if attention.backends == ("eager",):
        return "its kernel is its own, not one of transformers' paged-attention functions"
    if attention.mask_refusal(config) is not None:
        return f"{attention.mask_refusal(config)}, which the paged-attention mask does not keep"
    if config.position_embedding_type == "alibi":
        return "ALiBi's bias needs each key's position, which transformers' paged cache does not pass to the mask"
    return None


def vllm_refusal(attention: type, config) -> str | None:
    """Why vLLM's transformers backend (`LLM(..., model_impl="transformers", trust_remote_code=True)`) cannot run
    `attention` exactly (a short clause), or None when it can.

    vLLM builds the model from its remote code, replaces every attention call that goes through
    `ALL_ATTENTION_FUNCTIONS` with its own: plain softmax over scaled dot products of per-head queries and keys of
    `head_dim`, keys and values kept in its paged cache (`num_key_value_heads` of them), causal, windowed only where
    `layer_types` says "sliding_attention", and no bias or mask from the model (it packs every request into one row
    and masks by itself). A variant whose attention is anything else would give other text."""
    if attention.decodes_from_state():
        return f"{STATE}, which vLLM's paged key/value cache cannot hold"
    if attention.caches is not None:
        return (
            f"it caches {attention.caches} per token, which vLLM's transformers backend does not keep (its paged "
            f"cache holds keys and values of num_key_value_heads x head_dim)"
        )
    if attention.maps_per_head > 1:
        return f"it runs {attention.maps_per_head} attention maps per layer, and vLLM's attention computes one"
    if attention.scores is not None:
        return f"its scores are {attention.scores}, which vLLM's attention does not compute"
    if attention.keeps_scores is not None:
        return f"it keeps {attention.keeps_scores}, which vLLM's attention does not select"
    if attention.backends == ("eager",):
        return "its kernel is its own, not an attention function vLLM can replace with its own"
    if attention.mask_refusal(config) is not None:
        return f"{attention.mask_refusal(config)}, which vLLM's own causal (or windowed) mask does not keep"
    if config.position_embedding_type == "alibi":
        return "ALiBi's bias arrives in the attention mask, which vLLM's attention does not read"
    return None


def vllm_refusal_line(attention: type, config) -> str | None:
    """The one line refusing vLLM's transformers backend for a model of `config` (the reason and what to run
    instead), or None when it runs exactly there."""
    reason = vllm_refusal(attention, config)
    if reason is None:
        return None
    return (
        f'{config.model_type} cannot be served by vLLM\'s transformers backend (model_impl="transformers"): '
        f"{reason}; {INSTEAD['vllm-transformers']}."
    )


def kv_compression_refusal(attention: type, config) -> str | None:
    """Why a key/value cache compressor that assumes Llama's attention (kvpress's presses) cannot be faithful to
    `attention` (one line), or None when it can. The presses rebuild a layer's queries as Llama's `q_proj` rotated by
    RoPE, score the cached per-head keys with them, and evict tokens. (A state layer's keys and values also refuse to
    be read, `ZooStateLayer`, for clients that reach the cache without entering a press.)"""
    if attention.decodes_from_state():
        return f"{STATE}, with no per-token keys and values to evict"
    every_press = "; refused for every press"
    if attention.reads_positions:
        # the kernel finds a cached key's position from its slot (keys are contiguous): evicting tokens would move
        # every later key into another position, and so into another block or none
        return f"it reads each cached key's position from its slot, which evicting tokens shifts{every_press}"
    if attention.caches is not None:
        return (
            f"its cache holds {attention.caches} per token, not per-head keys and values, so presses that rebuild "
            f"per-head RoPE queries from q_proj and score per-head keys do not apply{every_press}"
        )
    if attention.maps_per_head > 1:
        return (
            f"each head attends with {attention.maps_per_head} query/key maps (side by side in q_proj and k_proj), "
            f"so presses that rebuild one RoPE query per head from q_proj (ExpectedAttention, SnapKV) do not "
            f"apply{every_press}"
        )
    if attention.scores is not None:
        # a press's key norms or rebuilt dot-product queries say nothing of another score; and ALiBi's bias takes a
        # cached key's position from its slot (`key_positions`), which evicting earlier tokens would shift
        alibi = (
            ", and evicting tokens shifts ALiBi's key positions" if config.position_embedding_type == "alibi" else ""
        )
        return (
            f"its scores are {attention.scores}, not dot products, so presses that rebuild rotated dot-product "
            f"queries (ExpectedAttention, SnapKV) score another kernel{alibi}{every_press}"
        )
    if config.position_embedding_type != "rope":
        # the presses rotate the queries they rebuild with the model's rotary embedding, which this config lacks
        position = config.position_embedding_type
        return f"presses rebuild RoPE queries, and this model has position_embedding_type={position!r}"
    if attention.mask_refusal(config) is not None:
        return f"{attention.mask_refusal(config)}, found by their slots, which evicting tokens shifts{every_press}"
    return None


def config_shaped_cache_refusal(attention: type, config) -> str | None:
    """Why a cache built outside the model from the config's head shapes (keys and values of num_key_value_heads x
    head_dim each: a static cache allocated before the first forward, or PEFT's prefix tuning) cannot hold
    `attention`'s, or None."""
    widths = attention.cached_widths(config)
    if widths is None:
        return f"{STATE}, with no per-token keys and values"
    if widths == (config.num_key_value_heads, config.head_dim, config.head_dim):
        return None
    heads, key, value = widths
    if attention.caches is not None:
        return f"it caches {attention.caches} per token, {key} and {value} wide, not keys and values of one head_dim"
    return f"it caches {heads} key/value head(s) per token with keys {key} and values {value} wide"


def attribute_refusal(module, name: str) -> str | None:
    """Why attention layer `module` refuses the attribute `name` a client attaches to it, or None.

    kvpress's presses start by attaching the model's rotary embedding to every attention layer (`rotary_emb`), to
    rebuild the layer's queries as Llama's: a variant whose attention is not that refuses there, before any token
    runs, rather than failing in a press's scorer or keeping the wrong tokens."""
    if name != "rotary_emb":
        return None
    reason = kv_compression_refusal(type(module), module.config)
    if reason is None:
        return None
    return (
        f"{type(module).__name__} takes no `rotary_emb`: key/value cache compression that rebuilds Llama's attention "
        f"from the layer (kvpress's presses) cannot apply to this variant: {reason}."
    )


def cache_refusal(attention: type, config, cache) -> str | None:
    """Why `cache`, handed to the model from outside, cannot hold `attention`'s, or None; checked before any layer
    runs, so that exporters tracing with such a cache and PEFT users read why rather than a shape error from inside
    a layer. Refused: key/value layers for a variant that decodes from a state, and keys and values of other widths
    (a static cache allocated from the config's head shapes, PEFT's prefix tuning)."""
    layers = getattr(cache, "layers", None)
    if not layers:
        return None
    model_type, cache_name = config.model_type, type(cache).__name__
    if attention.decodes_from_state():
        if all(isinstance(layer, attention.cache_layer) for layer in layers):
            return None
        # what a cache holds is data to a tracer (a static cache counts its filled slots): exporters get the second
        # message, PEFT (eager) the first
        held = 0 if torch.compiler.is_compiling() else int(cache.get_seq_length())
        if held:
            return (
                f"{model_type} decodes from a running state per layer, but was handed a {cache_name} already holding "
                f"{held} tokens of keys and values: that is how PEFT's prefix tuning passes its virtual tokens, and a "
                f"running state has no per-token keys and values to put them before, so prefix tuning cannot apply "
                f"to this variant; use prompt tuning (PEFT's PromptTuningConfig: virtual token embeddings) or LoRA "
                f"instead."
            )
        return (
            f"{model_type} decodes from a running state per layer, which a {cache_name} of keys and values cannot "
            f"hold, so it cannot decode from (or be exported with) a static key/value cache. Pass "
            f"cache=model.model.make_cache() or let generate() create it; to export, export the forward without a "
            f"cache (use_cache=False)."
        )
    layer = layers[0]
    if attention.cache_config(config) is not config and any(getattr(layer, "is_sliding", False) for layer in layers):
        return (
            f"{model_type} cannot use the cache handed in: its {cache_name} drops keys past the window, and "
            f"{attention.mask_refusal(config)}, which it would drop with them. Pass cache=model.model.make_cache() "
            f"(it keeps the sinks), let generate() create it, or export the forward without a cache (use_cache=False)."
        )
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    if not getattr(layer, "is_initialized", False) or keys is None or values is None or keys.dim() != 4:
        return None
    heads, key_width, value_width = attention.cached_widths(config)
    # keys and values are (B, heads, S, width)
    if (keys.shape[1], keys.shape[-1], values.shape[1], values.shape[-1]) == (heads, key_width, heads, value_width):
        return None
    return (
        f"{model_type} cannot use the cache handed in: its layer 0 holds keys of {keys.shape[1]} head(s) x "
        f"{keys.shape[-1]} and values of {values.shape[1]} x {values.shape[-1]}, but "
        f"{config_shaped_cache_refusal(attention, config)}. A cache sized from the config's head shapes "
        f"(num_key_value_heads x head_dim) cannot hold it: PEFT's prefix tuning, whose virtual tokens are such keys "
        f"and values, cannot apply to this variant (use prompt tuning or LoRA instead), and a static cache must size "
        f"itself from its first write (generate(cache_implementation='static') does) or be left out (export the "
        f"forward with use_cache=False)."
    )
