"""transformers' Mamba <-> the zoo's `mamba` variant: a config translation and a renaming of tensors.

A `MambaForCausalLM` is the zoo's backbone with `mlp_type="none"`: the same embedding, pre-norm blocks `x +
mixer(RMSNorm(x))`, final RMSNorm and (tied) head, and a mixer whose parameters carry `MambaMixer`'s names. Only the
module paths differ:

    backbone.embeddings            model.embed_tokens
    backbone.layers.N.norm         model.layers.N.input_layernorm
    backbone.layers.N.mixer.X      model.layers.N.self_attn.X   (in_proj, conv1d, x_proj, dt_proj, A_log, D, out_proj)
    backbone.norm_f                model.norm
    lm_head                        lm_head

`from_mamba` reads a `MambaForCausalLM` (an instance or a folder) into a zoo model computing the same function;
`to_mamba` writes a zoo `mamba` model back as a native `MambaForCausalLM` (`hf-attn-zoo export --to mamba`), and
`mamba_refusal` names what Mamba lacks for a config before any weight is read. One difference that only matters
below float32: `MambaConfig.residual_in_fp32` keeps the residual stream in float32 under a half-precision model,
the zoo's backbone keeps it in the model's dtype.
"""

import os
import re

from transformers import AutoModelForCausalLM, MambaConfig, MambaForCausalLM, PreTrainedModel

from ..models import ZooForCausalLM, get_variant

# Fields with the same name and meaning on both sides.
SHARED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "state_size",
    "conv_kernel",
    "time_step_rank",
    "use_bias",
    "use_conv_bias",
    "hidden_act",
    "initializer_range",
    "time_step_scale",
    "time_step_min",
    "time_step_max",
    "time_step_floor",
    "use_cache",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "tie_word_embeddings",
)
# What a zoo backbone must be for Mamba to express it.
MAMBA_BACKBONE = {
    "position_embedding_type": "none",
    "norm_type": "rmsnorm",
    "norm_position": "pre",
    "mlp_type": "none",
}
# native tensor name pattern -> zoo name
TO_ZOO = (
    (r"^backbone\.embeddings\.", "model.embed_tokens."),
    (r"^backbone\.layers\.(\d+)\.norm\.", r"model.layers.\1.input_layernorm."),
    (r"^backbone\.layers\.(\d+)\.mixer\.", r"model.layers.\1.self_attn."),
    (r"^backbone\.norm_f\.", "model.norm."),
)
TO_NATIVE = (
    (r"^model\.embed_tokens\.", "backbone.embeddings."),
    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"backbone.layers.\1.norm."),
    (r"^model\.layers\.(\d+)\.self_attn\.", r"backbone.layers.\1.mixer."),
    (r"^model\.norm\.", "backbone.norm_f."),
)


def renamed(state: dict, rules: tuple[tuple[str, str], ...]) -> dict:
    out = {}
    for name, tensor in state.items():
        for pattern, replacement in rules:
            name, count = re.subn(pattern, replacement, name)
            if count:
                break
        out[name] = tensor
    return out


def zoo_config_from_mamba(mamba_config: MambaConfig):
    """The zoo `mamba` config describing the same network as a `MambaConfig`."""
    if mamba_config.model_type != "mamba":
        raise ValueError(f"model_type={mamba_config.model_type!r}: from_mamba takes mamba checkpoints only.")
    fields = {name: getattr(mamba_config, name) for name in SHARED_FIELDS}
    fields["rms_norm_eps"] = mamba_config.layer_norm_epsilon
    # trained weights: no residual dropout and no GPT-2 init scaling on top of them
    return get_variant("mamba").config(**fields, **MAMBA_BACKBONE, hidden_dropout=0.0, scale_residual_init=False)


def from_mamba(model_or_path: PreTrainedModel | str | os.PathLike, **from_pretrained_kwargs) -> ZooForCausalLM:
    """A zoo `mamba` model with the weights of a transformers `MambaForCausalLM` (an instance, or a folder loaded with
    `AutoModelForCausalLM.from_pretrained(path, **from_pretrained_kwargs)`)."""
    if isinstance(model_or_path, (str, os.PathLike)):
        mamba = AutoModelForCausalLM.from_pretrained(model_or_path, **from_pretrained_kwargs)
    else:
        mamba = model_or_path
    config = zoo_config_from_mamba(mamba.config)
    model = get_variant("mamba").causal_lm_class(config)
    model.load_state_dict(renamed(mamba.state_dict(), TO_ZOO), strict=True)
    return model.to(mamba.dtype).train(mamba.training)


def mamba_refusal(config) -> str | None:
    """Why a native `MambaForCausalLM` cannot compute what the zoo config `config` computes (a clause), or None."""
    if config.model_type != "zoo_mamba":
        return f"mamba holds the zoo's mamba variant, not {config.model_type}"
    for field, required in MAMBA_BACKBONE.items():
        if getattr(config, field) != required:
            return f"{field}={getattr(config, field)!r} has no mamba equivalent (its is {required!r})"
    if config.scale_embedding:
        return "scale_embedding=True: Mamba does not scale its token embeddings"
    if config.add_cross_attention:
        return "add_cross_attention=True: Mamba has no cross-attention"
    return None


def to_mamba(model: ZooForCausalLM) -> MambaForCausalLM:
    """The `MambaForCausalLM` computing the same function as a zoo `mamba` model; a `ValueError` naming what Mamba
    lacks where it cannot."""
    config = model.config
    reason = mamba_refusal(config)
    if reason is not None:
        raise ValueError(f"{config.model_type} cannot be written as mamba: {reason}.")
    fields = {name: getattr(config, name) for name in SHARED_FIELDS}
    native = MambaForCausalLM(MambaConfig(**fields, layer_norm_epsilon=config.rms_norm_eps))
    native.load_state_dict(renamed(model.state_dict(), TO_NATIVE), strict=True)
    return native.to(model.dtype).train(model.training)


__all__ = ["from_mamba", "mamba_refusal", "to_mamba", "zoo_config_from_mamba"]
