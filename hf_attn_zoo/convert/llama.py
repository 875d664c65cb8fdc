"""Llama <-> zoo: the MHA family shares Llama's module layout and parameter names, so conversion is a config
translation and a plain `load_state_dict`.

`from_llama` picks the variant from the head counts (G = H: `mha`, G = 1: `mqa`, else `gqa`; one head:
`single_head`) unless told otherwise; `to_llama` refuses a zoo model whose backbone Llama cannot express.
"""

import os

from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedConfig

from ..models import ZooConfig, ZooForCausalLM, get_variant

# Fields with the same name and meaning on both sides.
SHARED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
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
    "mlp_bias",
)
# What a zoo backbone must be for Llama to express it.
LLAMA_BACKBONE = {"position_embedding_type": "rope", "norm_type": "rmsnorm", "mlp_type": "gated"}
MHA_FAMILY = ("mha", "gqa", "mqa", "single_head")


def default_variant(num_attention_heads: int, num_key_value_heads: int) -> str:
    if num_attention_heads == 1:
        return "single_head"
    if num_key_value_heads == num_attention_heads:
        return "mha"
    return "mqa" if num_key_value_heads == 1 else "gqa"


def zoo_config_from_llama(llama_config: PreTrainedConfig, variant: str | None = None) -> ZooConfig:
    """The zoo config describing the same network as a Llama-architecture config."""
    fields = {name: getattr(llama_config, name) for name in SHARED_FIELDS if hasattr(llama_config, name)}
    fields["rope_parameters"] = dict(llama_config.rope_parameters)
    variant = variant or default_variant(fields["num_attention_heads"], fields["num_key_value_heads"])
    if variant not in MHA_FAMILY:
        raise ValueError(f"variant={variant!r}: Llama weights load into the MHA family only, one of {MHA_FAMILY}.")
    # Llama has no residual dropout, and its weights are trained: keep GPT-2's init scaling out of it.
    return get_variant(variant).config(**fields, **LLAMA_BACKBONE, hidden_dropout=0.0, scale_residual_init=False)


def from_llama(
    model_or_path: LlamaForCausalLM | str | os.PathLike, variant: str | None = None, **from_pretrained_kwargs
) -> ZooForCausalLM:
    """A zoo MHA-family model with the weights of a `LlamaForCausalLM` (an instance, or a path / Hub id loaded with
    `LlamaForCausalLM.from_pretrained(path, **from_pretrained_kwargs)`)."""
    if isinstance(model_or_path, (str, os.PathLike)):
        llama = LlamaForCausalLM.from_pretrained(model_or_path, **from_pretrained_kwargs)
    else:
        llama = model_or_path
    config = zoo_config_from_llama(llama.config, variant)
    config._attn_implementation = llama.config._attn_implementation
    model = get_variant(config.model_type).causal_lm_class(config)
    model.load_state_dict(llama.state_dict(), strict=True)
    return model.to(llama.dtype).train(llama.training)


def to_llama(model: ZooForCausalLM) -> LlamaForCausalLM:
    """The `LlamaForCausalLM` computing the same function as a zoo MHA-family model with a Llama backbone."""
    config = model.config
    if config.model_type not in {get_variant(name).model_type for name in MHA_FAMILY}:
        raise ValueError(f"{config.model_type} is not an MHA-family model; Llama can only express zoo_mha/gqa/mqa.")
    for field, required in LLAMA_BACKBONE.items():
        if getattr(config, field) != required:
            raise ValueError(
                f"{field}={getattr(config, field)!r} has no Llama equivalent; only {field}={required!r} converts."
            )
    fields = {name: getattr(config, name) for name in SHARED_FIELDS}
    llama_config = LlamaConfig(**fields)
    llama_config._attn_implementation = config._attn_implementation
    llama = LlamaForCausalLM(llama_config)
    llama.load_state_dict(model.state_dict(), strict=True)
    return llama.to(model.dtype).train(model.training)


__all__ = ["default_variant", "from_llama", "to_llama", "zoo_config_from_llama"]
