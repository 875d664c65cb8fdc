"""DeepSeek <-> zoo `mla`: multi-head latent attention in transformers' DeepSeek-V3 layout, and back.

The zoo's MLA uses DeepSeek-V2's names for every projection (`q_proj` or `q_a_proj`/`q_a_layernorm`/`q_b_proj`,
`kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`), so a zoo `mla` model and a `DeepseekV3ForCausalLM`
whose layers are all dense (`first_k_dense_replace = num_hidden_layers`: no mixture of experts) share one state dict.
DeepSeek-V3 is the target rather than V2 because its `rope_interleave=False` rotates the RoPE channels as the zoo
does (`rotate_half`: channel i pairs with i + d/2); V2, and V3 with `rope_interleave=True`, pair channels 2i and
2i + 1, which `from_deepseek` turns into the zoo's layout by permuting the rows that produce the RoPE channels.

An MLA converted from MHA/GQA (`hf-attn-zoo convert --to mla`, `to_mla`) differs in two ways, both written exactly:

- RoPE frequencies per layer (`rope_frequencies`: a subset of the parent's ladder `rope_theta^(-2i/head_dim)`): the
  DeepSeek model rotates `qk_rope_head_dim = head_dim` channels, whose ladder is the parent's whole one, and each
  layer's query and shared-key rows put its chosen frequencies at their channels and zeros at the others, which add
  nothing to a score. The queries are scaled by sqrt((nope + head_dim) / (nope + rope)), so that DeepSeek's softmax
  scale over the wider head gives the zoo's.
- No latent norm (`latent_norm=False`; DeepSeek always normalises the latent with `kv_a_layernorm`): the latent gains
  one channel whose value is a constant K (a bias of `kv_a_proj_with_mqa`; DeepSeek has it with `attention_bias`)
  that `kv_b_proj` never reads. RMS-normalising `[c; K]` divides by sqrt((|c|^2 + K^2) / (r + 1)), and the norm's
  weight K / sqrt(r + 1) multiplies back, so the latent reaching `kv_b_proj` is `c · (1 + |c|^2 / K^2)^(-1/2)`. K is
  10^4 times a bound on |c| over every input (the layer's input norm bounds its output's length by sqrt(d) times its
  largest weight; the latent rows' largest singular value bounds the rest), so the factor is 1 within 5e-9, below
  float32's resolution.

What DeepSeek cannot express, refused by `deepseek_refusal`: a backbone other than Llama's, an `rms_norm_eps` other
than 1e-6 where the latent is normalised (DeepSeek builds `kv_a_layernorm` and `q_a_layernorm` with 1e-6 whatever the
config says), a bias on `q_proj` (DeepSeek has none there), MLP biases, and YaRN RoPE (DeepSeek multiplies its softmax
scale by YaRN's mscale; the zoo does not).
"""

import math
import os

import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM, PreTrainedModel

from ..models import ZooForCausalLM, get_variant
from .llama import LLAMA_BACKBONE

DEEPSEEK_NORM_EPS = 1e-6  # DeepseekV3RMSNorm's default, which q_a_layernorm and kv_a_layernorm keep
SHARED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "hidden_act",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "use_cache",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "tie_word_embeddings",
    "rope_parameters",
    "attention_bias",
    "attention_dropout",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)
DEEPSEEK_TYPES = ("deepseek_v2", "deepseek_v3")


def deepseek_refusal(config) -> str | None:
    """Why DeepSeek-V3's layout cannot compute what the zoo config `config` computes (a clause naming the field and
    what DeepSeek lacks), or None when it can."""
    if get_variant(config.model_type).family != "mla":
        return f"{config.model_type} is not multi-head latent attention; DeepSeek's layout holds the zoo_mla variant"
    for field, required in LLAMA_BACKBONE.items():
        if getattr(config, field) != required:
            return f"{field}={getattr(config, field)!r} has no DeepSeek equivalent (DeepSeek's is {required!r})"
    if config.rms_norm_eps != DEEPSEEK_NORM_EPS and (config.latent_norm or config.q_lora_rank is not None):
        return (
            f"rms_norm_eps={config.rms_norm_eps}: DeepSeek's latent and query norms use {DEEPSEEK_NORM_EPS} whatever "
            f"the config says"
        )
    if config.attention_bias and config.q_lora_rank is None:
        return "attention_bias=True with q_proj: DeepSeek's q_proj has no bias"
    if config.mlp_bias:
        return "mlp_bias=True: DeepSeek's MLP has no biases"
    if config.rope_parameters.get("rope_type", "default") == "yarn":
        return "YaRN RoPE: DeepSeek multiplies the softmax scale by YaRN's mscale, the zoo does not"
    return None


def deepseek_config(config) -> DeepseekV3Config:
    """The all-dense DeepSeek-V3 config of a zoo `mla` config (a converted MLA's wider RoPE part and extra latent
    channel included: module docstring)."""
    fields = {name: getattr(config, name) for name in SHARED_FIELDS}
    fields["rope_parameters"] = dict(config.rope_parameters)
    if config.rope_frequencies is not None:
        fields["qk_rope_head_dim"] = config.head_dim  # the parent's whole ladder; unchosen channels get zero rows
    if not config.latent_norm:
        fields["kv_lora_rank"] = config.kv_lora_rank + 1  # the constant channel
        fields["attention_bias"] = True  # which holds the constant
    return DeepseekV3Config(
        **fields,
        # every query head reads its own up-projected keys and values: no grouping on the expanded path
        num_key_value_heads=config.num_attention_heads,
        first_k_dense_replace=config.num_hidden_layers,  # every layer's MLP dense, as the zoo's
        rope_interleave=False,  # rotate_half pairs, the zoo's
        # no layer has experts; the fields are only validated, so the smallest consistent values
        n_routed_experts=1,
        num_experts_per_tok=1,
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        moe_intermediate_size=config.intermediate_size,
    )


def spread_rope_rows(rows: torch.Tensor, chosen: list[int], head_dim: int) -> torch.Tensor:
    """A RoPE block's rows `(rope, ...)` (the zoo's channels k and k + rope/2 rotate by frequency `chosen[k]`) placed
    at DeepSeek's channels over the whole ladder `(head_dim, ...)`: frequency i at channels i and i + head_dim/2."""
    half = len(chosen)
    spread = rows.new_zeros(head_dim, *rows.shape[1:])
    index = torch.tensor(chosen)
    spread[index] = rows[:half]
    spread[index + head_dim // 2] = rows[half:]
    return spread


def latent_bound(layer_state: dict[str, torch.Tensor], input_norm: torch.Tensor, rank: int, hidden: int) -> float:
    """An upper bound on the latent's length |c| over every input: the layer's input norm has an output of RMS 1 at
    most, so of length sqrt(hidden) times its largest weight, and the latent rows stretch a vector by their largest
    singular value at most."""
    weight = layer_state["kv_a_proj_with_mqa.weight"][:rank].double()
    bias = layer_state.get("kv_a_proj_with_mqa.bias")
    stretch = torch.linalg.matrix_norm(weight, ord=2).item()
    bound = stretch * math.sqrt(hidden) * input_norm.abs().max().item()
    return bound + (bias[:rank].double().norm().item() if bias is not None else 0.0)


def deepseek_state(model: ZooForCausalLM, native_config: DeepseekV3Config) -> dict[str, torch.Tensor]:
    """The zoo model's state dict in the DeepSeek-V3 layout of `native_config` (module docstring)."""
    config = model.config
    state = dict(model.state_dict())
    widened = config.rope_frequencies is not None
    constant = not config.latent_norm
    if not widened and not constant:
        return state
    heads, nope, rope = config.num_attention_heads, config.qk_nope_head_dim, config.qk_rope_head_dim
    rank = config.kv_lora_rank
    new_rope = native_config.qk_rope_head_dim
    scale = math.sqrt((nope + new_rope) / (nope + rope))  # DeepSeek's softmax scale over the wider head -> the zoo's
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.self_attn."
        layer_state = {name[len(prefix) :]: state[name] for name in state if name.startswith(prefix)}
        chosen = config.rope_frequencies[layer] if widened else list(range(rope // 2))
        query = "q_proj.weight" if config.q_lora_rank is None else "q_b_proj.weight"
        weight = layer_state[query]
        per_head = weight.reshape(heads, nope + rope, -1)  # (H * (nope + rope), in) -> (H, nope + rope, in)
        rotated = torch.stack([spread_rope_rows(head[nope:], chosen, config.head_dim) for head in per_head])
        if not widened:
            rotated = per_head[:, nope:]
        state[prefix + query] = (torch.cat((per_head[:, :nope], rotated), dim=1) * scale).reshape(-1, weight.shape[1])
        kv_a = layer_state["kv_a_proj_with_mqa.weight"]  # (rank + rope, hidden)
        latent_rows, rope_rows = kv_a[:rank], kv_a[rank:]
        if widened:
            rope_rows = spread_rope_rows(rope_rows, chosen, config.head_dim)
        kv_a_bias = layer_state.get("kv_a_proj_with_mqa.bias")
        if constant:
            input_norm = state[f"model.layers.{layer}.input_layernorm.weight"]
            value = 1e4 * max(latent_bound(layer_state, input_norm, rank, config.hidden_size), 1.0)
            latent_rows = torch.cat((latent_rows, latent_rows.new_zeros(1, latent_rows.shape[1])))
            latent_bias = kv_a_bias[:rank] if kv_a_bias is not None else kv_a.new_zeros(rank)
            rope_bias = kv_a_bias[rank:] if kv_a_bias is not None else kv_a.new_zeros(rope)
            if widened:
                rope_bias = spread_rope_rows(rope_bias, chosen, config.head_dim)
            state[prefix + "kv_a_proj_with_mqa.bias"] = torch.cat((latent_bias, kv_a.new_full((1,), value), rope_bias))
            state[prefix + "kv_a_layernorm.weight"] = kv_a.new_full((rank + 1,), value / math.sqrt(rank + 1))
            kv_b = layer_state["kv_b_proj.weight"]  # (H * (nope + v), rank): the constant channel is never read
            state[prefix + "kv_b_proj.weight"] = torch.cat((kv_b, kv_b.new_zeros(kv_b.shape[0], 1)), dim=1)
            for name, width in (("o_proj.bias", config.hidden_size), ("q_a_proj.bias", config.q_lora_rank)):
                if name not in layer_state and (name != "q_a_proj.bias" or config.q_lora_rank is not None):
                    state[prefix + name] = kv_a.new_zeros(width)  # the biases attention_bias adds: zero
        elif widened and kv_a_bias is not None:
            state[prefix + "kv_a_proj_with_mqa.bias"] = torch.cat(
                (kv_a_bias[:rank], spread_rope_rows(kv_a_bias[rank:], chosen, config.head_dim))
            )
        state[prefix + "kv_a_proj_with_mqa.weight"] = torch.cat((latent_rows, rope_rows))
    return state


def to_deepseek(model: ZooForCausalLM) -> DeepseekV3ForCausalLM:
    """The `DeepseekV3ForCausalLM` computing the same function as a zoo `mla` model."""
    reason = deepseek_refusal(model.config)
    if reason is not None:
        raise ValueError(f"{model.config.model_type} cannot be written as DeepSeek-V3: {reason}.")
    native_config = deepseek_config(model.config)
    native_config._attn_implementation = model.config._attn_implementation
    native = DeepseekV3ForCausalLM(native_config)
    native.load_state_dict(deepseek_state(model, native_config), strict=True)
    return native.to(model.dtype).train(model.training)


def rope_rows_deinterleaved(weight: torch.Tensor, heads: int, nope: int, rope: int) -> torch.Tensor:
    """`weight` (heads * (nope + rope) rows; one head of `rope` rows when nope = 0 and heads = 1) with each head's
    RoPE rows reordered from interleaved pairs (2i, 2i + 1) to rotate_half's (i, i + rope / 2)."""
    order = torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2)))  # (rope,)
    # (heads * (nope + rope), ...) -> (heads, nope + rope, ...)
    per_head = weight.reshape(heads, nope + rope, *weight.shape[1:])
    reordered = torch.cat((per_head[:, :nope], per_head[:, nope:][:, order]), dim=1)
    return reordered.reshape(weight.shape)  # back to (heads * (nope + rope), ...)


def from_deepseek(model_or_path: PreTrainedModel | str | os.PathLike, **from_pretrained_kwargs) -> ZooForCausalLM:
    """A zoo `mla` model with the weights of a dense DeepSeek-V2 or V3 causal LM (an instance, or a path / Hub id).
    A checkpoint with mixture-of-experts layers is refused: the zoo's MLP is dense."""
    if isinstance(model_or_path, (str, os.PathLike)):
        native = AutoModelForCausalLM.from_pretrained(model_or_path, **from_pretrained_kwargs)
    else:
        native = model_or_path
    config = native.config
    if config.model_type not in DEEPSEEK_TYPES:
        raise ValueError(f"model_type={config.model_type!r}: only {DEEPSEEK_TYPES} checkpoints convert to zoo_mla.")
    if config.first_k_dense_replace < config.num_hidden_layers:
        raise ValueError(
            f"first_k_dense_replace={config.first_k_dense_replace} < num_hidden_layers={config.num_hidden_layers}: "
            f"layers with a mixture of experts have no zoo equivalent (the zoo's MLP is dense)."
        )
    fields = {name: getattr(config, name) for name in SHARED_FIELDS if name != "attention_bias"}
    fields["rope_parameters"] = dict(config.rope_parameters)
    zoo_config = get_variant("mla").config(
        **fields,
        attention_bias=config.attention_bias,
        mlp_bias=False,
        **LLAMA_BACKBONE,
        hidden_dropout=0.0,
        scale_residual_init=False,
    )
    zoo_config._attn_implementation = config._attn_implementation
    zoo = get_variant("mla").causal_lm_class(zoo_config)
    state = dict(native.state_dict())
    # V2 (complex RoPE) and V3 with rope_interleave rotate interleaved pairs: reorder the rows making RoPE channels
    interleaved = config.model_type == "deepseek_v2" or getattr(config, "rope_interleave", False)
    if interleaved:
        heads, nope, rope = config.num_attention_heads, config.qk_nope_head_dim, config.qk_rope_head_dim
        for name in list(state):
            if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
                state[name] = rope_rows_deinterleaved(state[name], heads, nope, rope)
            elif name.endswith("self_attn.kv_a_proj_with_mqa.weight") or name.endswith("kv_a_proj_with_mqa.bias"):
                latent, key_rope = state[name].split((config.kv_lora_rank, rope), dim=0)
                state[name] = torch.cat((latent, rope_rows_deinterleaved(key_rope, 1, 0, rope)), dim=0)
    if config.attention_bias and config.q_lora_rank is None:  # the zoo's q_proj has a bias then, DeepSeek's none
        for layer in range(config.num_hidden_layers):
            weight = state[f"model.layers.{layer}.self_attn.q_proj.weight"]
            state[f"model.layers.{layer}.self_attn.q_proj.bias"] = weight.new_zeros(weight.shape[0])
    zoo.load_state_dict(state, strict=True)
    return zoo.to(native.dtype).train(native.training)


__all__ = ["deepseek_config", "deepseek_refusal", "from_deepseek", "to_deepseek"]
