"""Multi-head to grouped-query (or multi-query) attention by pooling key/value heads (Ainslie et al. 2023, 2.1).

G new key/value heads replace the G0 heads of a model: contiguous groups, as transformers' `repeat_kv` reads them
(old head i goes to new head i // (G0 / G); query head h reads new head h // (H / G)). The K and V projection rows
(and biases) of each group are
- "mean": averaged (the paper's best; exact when the heads of a group are identical);
- "first": those of the group's first head;
- "random": initialised afresh, as a model trained from scratch would start.
Queries, outputs and everything else are copied. RoPE rotates every key head alike, so averaging the projections
equals averaging the rotated keys.
"""

import torch

from ..models import ZooForCausalLM, get_variant
from .llama import default_variant, from_llama, in_mha_family

METHODS = ("mean", "first", "random")


def pool_heads(weight: torch.Tensor, heads: int, groups: int, method: str) -> torch.Tensor:
    """`(heads * d_h, ...)` rows of per-head projections -> `(groups * d_h, ...)`."""
    per_head = weight.reshape(groups, heads // groups, -1, *weight.shape[1:])  # (G, G0/G, d_h, ...)
    pooled = per_head.mean(dim=1) if method == "mean" else per_head[:, 0]
    return pooled.reshape(-1, *weight.shape[1:]).contiguous()


def mha_to_gqa(model, num_key_value_heads: int, method: str = "mean") -> ZooForCausalLM:
    """A new zoo model with `num_key_value_heads` key/value heads pooled from `model`'s (a zoo MHA-family model,
    or a transformers Llama / Mistral / Qwen2 model, converted first). G = 1 gives `zoo_mqa`, G = H `zoo_mha`,
    anything else `zoo_gqa`."""
    if method not in METHODS:
        raise ValueError(f"method={method!r}: use one of {METHODS}.")
    if not isinstance(model, ZooForCausalLM):
        model = from_llama(model)
    config = model.config
    if not in_mha_family(config.model_type):
        raise ValueError(
            f"{config.model_type} is not in the MHA family (mha, gqa, mqa, single_head): it has no key/value heads "
            f"to pool."
        )
    heads, old_groups, groups = config.num_attention_heads, config.num_key_value_heads, num_key_value_heads
    if not isinstance(groups, int) or groups < 1 or old_groups % groups != 0:
        divisors = [g for g in range(1, old_groups + 1) if old_groups % g == 0]
        raise ValueError(
            f"num_key_value_heads={groups!r} must divide the model's {old_groups} key/value heads (each new head "
            f"pools a contiguous group of them): choose one of {divisors}."
        )
    target = get_variant(default_variant(heads, groups))
    fields = {
        key: value
        for key, value in config.to_dict().items()
        if key in target.config_class.__dataclass_fields__
        and key not in ("architectures", "model_type", "num_key_value_heads", "auto_map")
    }
    new_config = target.config(**fields, num_key_value_heads=groups)
    new_config._attn_implementation = config._attn_implementation
    pooled = target.causal_lm_class(new_config)
    state = model.state_dict()
    for name, tensor in state.items():
        if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")) and groups != old_groups:
            if method == "random":
                state[name] = pooled.state_dict()[name]  # fresh initialisation of the new model
            else:
                state[name] = pool_heads(tensor, old_groups, groups, method)
    pooled.load_state_dict(state, strict=True)
    return pooled.to(model.dtype).train(model.training)
