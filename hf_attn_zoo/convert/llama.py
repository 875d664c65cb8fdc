"""Llama-family <-> zoo: the MHA family shares Llama's module layout and parameter names, so conversion is a config
translation and a plain `load_state_dict`.

`from_llama` takes Llama, Mistral (without an active sliding window) and Qwen2 models, and picks the variant from the
head counts (G = H: `mha`, G = 1: `mqa`, else `gqa`; one head: `single_head`) unless told otherwise. Qwen2 has
biases on the query, key and value projections but not on the output one: the zoo model gets a zero output bias,
which computes the same function. `to_llama` refuses a zoo model whose backbone Llama cannot express.
"""

import os

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedConfig, PreTrainedModel

from ..models import VARIANTS, ZooConfig, ZooForCausalLM, get_variant

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


def in_mha_family(name_or_model_type: str) -> bool:
    """Whether a variant shares Llama's attention (the `mha` family: MHA, GQA, MQA, single head)."""
    return get_variant(name_or_model_type).family == "mha"


def default_variant(num_attention_heads: int, num_key_value_heads: int) -> str:
    if num_attention_heads == 1:
        return "single_head"
    if num_key_value_heads == num_attention_heads:
        return "mha"
    return "mqa" if num_key_value_heads == 1 else "gqa"


LLAMA_FAMILY = ("llama", "mistral", "qwen2")


def zoo_config_from_llama(llama_config: PreTrainedConfig, variant: str | None = None) -> ZooConfig:
    """The zoo config describing the same network as a Llama-architecture config (Llama, Mistral, Qwen2)."""
    if llama_config.model_type not in LLAMA_FAMILY:
        raise ValueError(f"model_type={llama_config.model_type!r}: only {LLAMA_FAMILY} checkpoints convert.")
    window = getattr(llama_config, "sliding_window", None)
    uses_window = getattr(llama_config, "use_sliding_window", True)
    if window is not None and uses_window and window < llama_config.max_position_embeddings:
        raise ValueError(
            f"sliding_window={window}: this checkpoint attends through a window, which the MHA family does not; "
            f"load it into the sliding_window variant instead."
        )
    fields = {name: getattr(llama_config, name) for name in SHARED_FIELDS if hasattr(llama_config, name)}
    fields["rope_parameters"] = dict(llama_config.rope_parameters)
    if llama_config.model_type == "qwen2":
        fields["attention_bias"] = True  # q/k/v biases; o_proj's is added as zeros
    variant = variant or default_variant(fields["num_attention_heads"], fields["num_key_value_heads"])
    if not in_mha_family(variant):
        family = [name for name in VARIANTS if in_mha_family(name)]
        raise ValueError(f"variant={variant!r}: Llama weights load into the MHA family only, one of {family}.")
    # Llama has no residual dropout, and its weights are trained: keep GPT-2's init scaling out of it.
    return get_variant(variant).config(**fields, **LLAMA_BACKBONE, hidden_dropout=0.0, scale_residual_init=False)


def from_llama(
    model_or_path: PreTrainedModel | str | os.PathLike, variant: str | None = None, **from_pretrained_kwargs
) -> ZooForCausalLM:
    """A zoo MHA-family model with the weights of a Llama, Mistral or Qwen2 causal LM (an instance, or a path / Hub id
    loaded with `AutoModelForCausalLM.from_pretrained(path, **from_pretrained_kwargs)`)."""
    if isinstance(model_or_path, (str, os.PathLike)):
        llama = AutoModelForCausalLM.from_pretrained(model_or_path, **from_pretrained_kwargs)
    else:
        llama = model_or_path
    config = zoo_config_from_llama(llama.config, variant)
    config._attn_implementation = llama.config._attn_implementation
    model = get_variant(config.model_type).causal_lm_class(config)
    state = llama.state_dict()
    for name, tensor in model.state_dict().items():
        if name.endswith("o_proj.bias") and name not in state:  # Qwen2: no output bias, i.e. a zero one
            state[name] = torch.zeros_like(tensor)
    model.load_state_dict(state, strict=True)
    return model.to(llama.dtype).train(llama.training)


def to_llama(model: ZooForCausalLM) -> LlamaForCausalLM:
    """The `LlamaForCausalLM` computing the same function as a zoo MHA-family model with a Llama backbone."""
    config = model.config
    if not in_mha_family(config.model_type):
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


__all__ = ["default_variant", "from_llama", "in_mha_family", "to_llama", "zoo_config_from_llama"]
