"""DeepSeek <-> zoo `mla`: multi-head latent attention in transformers' DeepSeek-V3 layout, and back.

The zoo's MLA uses DeepSeek-V2's names for every projection (`q_proj` or `q_a_proj`/`q_a_layernorm`/`q_b_proj`,
`kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`), so a zoo `mla` model and a `DeepseekV3ForCausalLM`
whose layers are all dense (`first_k_dense_replace = num_hidden_layers`: no mixture of experts) share one state dict.
DeepSeek-V3 is the target rather than V2 because its `rope_interleave=False` rotates the RoPE channels as the zoo
does (`rotate_half`: channel i pairs with i + d/2); V2, and V3 with `rope_interleave=True`, pair channels 2i and
2i + 1, which `from_deepseek` turns into the zoo's layout by permuting the rows that produce the RoPE channels.

What DeepSeek cannot express, refused by `deepseek_refusal`: a latent without its norm (`latent_norm=False`, what
`convert --to mla` writes: DeepSeek always normalises the latent), per-layer RoPE frequency subsets
(`rope_frequencies`, also a conversion's), a backbone other than Llama's, an `rms_norm_eps` other than 1e-6 (DeepSeek
builds `kv_a_layernorm` and `q_a_layernorm` with 1e-6 whatever the config says), a bias on `q_proj` (DeepSeek has
none there), MLP biases, and YaRN RoPE (DeepSeek multiplies its softmax scale by YaRN's mscale; the zoo does not).
"""

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
    if not config.latent_norm:
        return (
            "latent_norm=False (a converted MLA): DeepSeek always normalises the latent (kv_a_layernorm), which "
            "changes the function; fine-tune it with latent_norm=True or serve it with `hf-attn-zoo serve`"
        )
    if config.rope_frequencies is not None:
        return (
            "rope_frequencies picks each layer's RoPE frequencies out of the parent's ladder, and DeepSeek rotates "
            "every layer by one ladder of its own"
        )
    if config.rms_norm_eps != DEEPSEEK_NORM_EPS:
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
    """The all-dense DeepSeek-V3 config of a zoo `mla` config."""
    fields = {name: getattr(config, name) for name in SHARED_FIELDS}
    fields["rope_parameters"] = dict(config.rope_parameters)
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


def to_deepseek(model: ZooForCausalLM) -> DeepseekV3ForCausalLM:
    """The `DeepseekV3ForCausalLM` computing the same function as a zoo `mla` model."""
    reason = deepseek_refusal(model.config)
    if reason is not None:
        raise ValueError(f"{model.config.model_type} cannot be written as DeepSeek-V3: {reason}.")
    native_config = deepseek_config(model.config)
    native_config._attn_implementation = model.config._attn_implementation
    native = DeepseekV3ForCausalLM(native_config)
    native.load_state_dict(model.state_dict(), strict=True)
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
    if config.attention_bias and config.q_lora_rank is None:  # the zoo's q_proj would have a bias DeepSeek lacks
        raise ValueError("attention_bias=True without q_lora_rank: the zoo's q_proj would gain a bias; not converted.")
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
    zoo.load_state_dict(state, strict=True)
    return zoo.to(native.dtype).train(native.training)


__all__ = ["deepseek_config", "deepseek_refusal", "from_deepseek", "to_deepseek"]
