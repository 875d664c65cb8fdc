"""Llama-family <-> zoo: the MHA family shares Llama's module layout and parameter names, so conversion is a config
translation and a plain `load_state_dict`.

`from_llama` takes Llama, Mistral (without an active sliding window) and Qwen2 models, and picks the variant from the
head counts (G = H: `mha`, G = 1: `mqa`, else `gqa`; one head: `single_head`) unless told otherwise. Qwen2 has
biases on the query, key and value projections but not on the output one: the zoo model gets a zero output bias,
which computes the same function. `from_mistral` takes a Mistral with its window into the `sliding_window` variant.

The other way, `to_native(model, "llama" | "qwen2" | "mistral")` (and `to_llama`): the MHA family becomes Llama
(biases and all) or Qwen2 (where its output projection has no bias), the sliding-window variant Mistral. Both sides
build the window with transformers' `create_sliding_window_causal_mask` from the same `sliding_window` (w keys, the
query's own included), so the window is the same by construction. `native_refusal` names what a target lacks for a
config, before any weight is read.
"""

import os

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

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
LLAMA_BACKBONE = {
    "position_embedding_type": "rope",
    "norm_type": "rmsnorm",
    "norm_position": "pre",
    "mlp_type": "gated",
}


def in_mha_family(name_or_model_type: str) -> bool:
    """Whether a variant shares Llama's attention (the `mha` family: MHA, GQA, MQA, single head). A name or model
    type the zoo does not register as a variant (`zoo_rnn`, `marian`, a typo) is not in it."""
    return any(
        name_or_model_type in (variant.name, variant.model_type) and variant.family == "mha"
        for variant in VARIANTS.values()
    )


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
    windowed = window is not None and uses_window and window < llama_config.max_position_embeddings
    if variant == "sliding_window":
        if llama_config.model_type != "mistral" or not windowed:
            raise ValueError(
                f"variant='sliding_window' takes a Mistral checkpoint with an active sliding_window, got "
                f"model_type={llama_config.model_type!r} with sliding_window={window!r}."
            )
    elif windowed:
        raise ValueError(
            f"sliding_window={window}: this checkpoint attends through a window, which the MHA family does not; "
            f"load it into the sliding_window variant instead."
        )
    fields = {name: getattr(llama_config, name) for name in SHARED_FIELDS if hasattr(llama_config, name)}
    fields["rope_parameters"] = dict(llama_config.rope_parameters)
    if llama_config.model_type == "qwen2":
        fields["attention_bias"] = True  # q/k/v biases; o_proj's is added as zeros
    variant = variant or default_variant(fields["num_attention_heads"], fields["num_key_value_heads"])
    if variant == "sliding_window":
        fields["sliding_window"] = window
    elif not in_mha_family(variant):
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


def from_mistral(model_or_path: PreTrainedModel | str | os.PathLike, **from_pretrained_kwargs) -> ZooForCausalLM:
    """A zoo `sliding_window` model with the weights of a Mistral causal LM whose window is active (its
    `sliding_window` is the zoo's: w keys, the query's own included); a Mistral without one becomes the MHA family
    variant `from_llama` picks."""
    if isinstance(model_or_path, (str, os.PathLike)):
        mistral = AutoModelForCausalLM.from_pretrained(model_or_path, **from_pretrained_kwargs)
    else:
        mistral = model_or_path
    if mistral.config.model_type != "mistral":
        raise ValueError(f"model_type={mistral.config.model_type!r}: from_mistral takes Mistral checkpoints.")
    window = mistral.config.sliding_window
    if window is None or window >= mistral.config.max_position_embeddings:
        return from_llama(mistral)  # no window within reach: full causal attention
    return from_llama(mistral, "sliding_window")


# native model_type -> (config class, causal LM class)
NATIVE_CLASSES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}


def native_refusal(config, target: str) -> str | None:
    """Why the native architecture `target` ("llama", "qwen2", "mistral") cannot compute what the zoo config
    `config` computes (a clause naming what it lacks), or None when it can."""
    family = get_variant(config.model_type).family
    wanted = "sliding_window" if target == "mistral" else "mha"
    if family != wanted:
        held = "the sliding_window variant" if target == "mistral" else "the MHA family (mha, gqa, mqa, single_head)"
        return f"{target} holds {held}, not {config.model_type}"
    for field, required in LLAMA_BACKBONE.items():
        if getattr(config, field) != required:
            return f"{field}={getattr(config, field)!r} has no {target} equivalent (its is {required!r})"
    masked = get_variant(config.model_type).attention_class.mask_refusal(config)
    if masked is not None:
        return f"{masked}, which {target}'s mask does not keep"
    if target in ("qwen2", "mistral") and config.mlp_bias:
        return f"mlp_bias=True: {target}'s MLP has no biases"
    if target == "mistral" and config.attention_bias:
        return "attention_bias=True: Mistral's attention projections have no biases"
    return None


def native_config(config, target: str) -> PreTrainedConfig:
    fields = {name: getattr(config, name) for name in SHARED_FIELDS}
    fields["rope_parameters"] = dict(config.rope_parameters)
    if target in ("qwen2", "mistral"):
        for name in ("attention_bias", "mlp_bias"):  # fixed by the architecture (checked by native_refusal)
            fields.pop(name)
    if target == "mistral":
        fields["sliding_window"] = config.sliding_window
    if target == "qwen2":
        fields["use_sliding_window"] = False
    return NATIVE_CLASSES[target][0](**fields)


def to_native(model: ZooForCausalLM, target: str) -> PreTrainedModel:
    """The native transformers causal LM (`target`: "llama", "qwen2" or "mistral") computing the same function as
    a zoo model; a `ValueError` naming what `target` lacks where it cannot."""
    config = model.config
    reason = native_refusal(config, target)
    if reason is not None:
        raise ValueError(f"{config.model_type} cannot be written as {target}: {reason}.")
    state = dict(model.state_dict())
    if target == "qwen2":
        for layer in range(config.num_hidden_layers):
            prefix = f"model.layers.{layer}.self_attn."
            output_bias = state.pop(prefix + "o_proj.bias", None)
            if output_bias is not None and bool(output_bias.any()):
                raise ValueError(
                    f"{config.model_type} cannot be written as qwen2: layer {layer}'s o_proj has a nonzero bias, "
                    f"which Qwen2 lacks; export it as llama."
                )
            for name in ("q_proj", "k_proj", "v_proj"):  # Qwen2 always has these biases: zero ones add nothing
                weight = state[prefix + name + ".weight"]
                state.setdefault(prefix + name + ".bias", weight.new_zeros(weight.shape[0]))
    native_config_ = native_config(config, target)
    native_config_._attn_implementation = config._attn_implementation
    native = NATIVE_CLASSES[target][1](native_config_)
    native.load_state_dict(state, strict=True)
    return native.to(model.dtype).train(model.training)


def to_llama(model: ZooForCausalLM) -> LlamaForCausalLM:
    """The `LlamaForCausalLM` computing the same function as a zoo MHA-family model with a Llama backbone."""
    return to_native(model, "llama")


__all__ = [
    "default_variant",
    "from_llama",
    "from_mistral",
    "in_mha_family",
    "native_refusal",
    "to_llama",
    "to_native",
    "zoo_config_from_llama",
]
