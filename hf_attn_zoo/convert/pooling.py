"""Multi-head to grouped-query (or multi-query) attention by pooling key/value heads (Ainslie et al. 2023, 2.1).

G new key/value heads replace the G0 heads of a model: contiguous groups, as transformers' `repeat_kv` reads them
(old head i goes to new head i // (G0 / G); query head h reads new head h // (H / G)). The K and V projection rows
(and biases) of each group are
- "mean": averaged (the paper's best; exact when the heads of a group are identical);
- "first": those of the group's first head;
- "random": initialised afresh, as a model trained from scratch would start.
Queries, outputs and everything else are copied. RoPE rotates every key head alike, so averaging the projections
equals averaging the rotated keys. The calibrated methods ("aligned", "grouped", "grouped_aligned": `calibrated.py`)
first rewrite the heads from what they compute on calibration text, then mean-pool.
"""

import torch

from ..models import ZooForCausalLM, get_variant
from .calibrated import (
    CALIBRATION_METHODS,
    calibration_batches,
    check_enough,
    key_value_activations,
    rewrite_for_pooling,
)
from .llama import default_variant, from_llama, in_mha_family

METHODS = ("mean", "first", "random", *CALIBRATION_METHODS)


def pool_heads(weight: torch.Tensor, heads: int, groups: int, method: str) -> torch.Tensor:
    """`(heads * d_h, ...)` rows of per-head projections -> `(groups * d_h, ...)`."""
    per_head = weight.reshape(groups, heads // groups, -1, *weight.shape[1:])  # (G, G0/G, d_h, ...)
    pooled = per_head.mean(dim=1) if method == "mean" else per_head[:, 0]
    return pooled.reshape(-1, *weight.shape[1:]).contiguous()


def mha_to_gqa(
    model,
    num_key_value_heads: int,
    method: str = "mean",
    calibration=None,
    tokenizer=None,
    max_calibration_tokens: int | None = None,
) -> ZooForCausalLM:
    """A new zoo model with `num_key_value_heads` key/value heads pooled from `model`'s (a zoo MHA-family model,
    or a transformers Llama / Mistral / Qwen2 model, converted first). G = 1 gives `zoo_mqa`, G = H `zoo_mha`,
    anything else `zoo_gqa`. The calibrated methods (`CALIBRATION_METHODS`) read `calibration`: texts (with the
    model's `tokenizer`), a `(B, T)` tensor of token ids or a list of id sequences, at least 4 x head_dim tokens
    (the first `max_calibration_tokens` of them, when given)."""
    if method not in METHODS:
        raise ValueError(f"method={method!r}: use one of {METHODS}.")
    if method not in CALIBRATION_METHODS and calibration is not None:
        raise ValueError(f"calibration is read by the calibrated methods {CALIBRATION_METHODS}, not {method!r}.")
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
    if method in CALIBRATION_METHODS and groups != old_groups:
        batches = calibration_batches(
            calibration, tokenizer, model.config.max_position_embeddings, max_calibration_tokens
        )
        rewrite_heads(model, state, groups, method, batches)
    for name, tensor in state.items():
        if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")) and groups != old_groups:
            if method == "random":
                state[name] = pooled.state_dict()[name]  # fresh initialisation of the new model
            else:
                state[name] = pool_heads(tensor, old_groups, groups, "first" if method == "first" else "mean")
    pooled.load_state_dict(state, strict=True)
    return pooled.to(model.dtype).train(model.training)


def rewrite_heads(model: ZooForCausalLM, state: dict, groups: int, method: str, batches: list) -> None:
    """Rewrite `state`'s attention projections in place as `method` chooses from `model`'s keys and values on the
    calibration `batches` (see `calibrated.py`): mean pooling of contiguous groups then pools the chosen, aligned
    heads."""
    tokens = sum(batch.numel() for batch in batches)
    check_enough(tokens, model.config.head_dim)
    rewrites = rewrite_for_pooling(key_value_activations(model, batches), model.config, groups, method)
    for index, rewrite in enumerate(rewrites):
        prefix = f"model.layers.{index}.self_attn."
        attention = {name[len(prefix) :]: tensor for name, tensor in state.items() if name.startswith(prefix)}
        for name, tensor in rewrite.apply(attention).items():
            state[prefix + name] = tensor


# the attention modules of an encoder-decoder's decoder layer that Ainslie et al. 2023 pool (the encoder keeps its
# heads): module name -> the config field counting its key/value heads
SEQ2SEQ_POOLED = {"self_attn": "num_key_value_heads", "encoder_attn": "cross_attention_num_key_value_heads"}


def seq2seq_mha_to_gqa(model, num_key_value_heads: int, method: str = "mean", calibration=None):
    """A new zoo encoder-decoder whose decoder self-attention and cross-attention have `num_key_value_heads` (G)
    key/value heads pooled from `model`'s (a zoo MHA-family encoder-decoder with dot-product cross-attention), the
    encoder's self-attention keeping its heads, as Ainslie et al. 2023 uptrain T5. G equal to the query heads gives
    `zoo_mha` (a copy), anything else `zoo_gqa` with `encoder_num_key_value_heads` keeping the encoder's count (G = 1
    is multi-query there: `zoo_mqa` fixes the encoder's heads to one as well). `method`: "mean", "first", "random"
    as `mha_to_gqa`, or a calibrated method (`CALIBRATION_METHODS`), which reads `calibration`: `(source ids,
    target ids)` pairs of `(1, S)` / `(1, T)` tensors, teacher-forced through the model."""
    from ..models import SEQ2SEQ

    if method not in METHODS:
        raise ValueError(f"method={method!r}: use one of {METHODS}.")
    if method not in CALIBRATION_METHODS and calibration is not None:
        raise ValueError(f"calibration is read by the calibrated methods {CALIBRATION_METHODS}, not {method!r}.")
    config = model.config
    if not getattr(config, "is_encoder_decoder", False) or not in_mha_family(config.model_type):
        raise ValueError(
            f"{config.model_type} is not an encoder-decoder of the MHA family (mha, gqa, mqa): use mha_to_gqa for a "
            "decoder-only model."
        )
    if config.cross_attention != "dot":
        raise ValueError(f"cross_attention={config.cross_attention!r} has no key/value heads to pool: use 'dot'.")
    heads, groups = config.num_attention_heads, num_key_value_heads
    for field_name in SEQ2SEQ_POOLED.values():
        old = getattr(config, field_name)
        if not isinstance(groups, int) or groups < 1 or old % groups != 0:
            divisors = [g for g in range(1, old + 1) if old % g == 0]
            raise ValueError(
                f"num_key_value_heads={groups!r} must divide the model's {old} {field_name} (each new head pools a "
                f"contiguous group of them): choose one of {divisors}."
            )
    encoder_heads = config.encoder_num_key_value_heads or config.num_key_value_heads
    target = "mha" if groups == heads and encoder_heads == heads else "gqa"
    fields = {
        key: value
        for key, value in config.to_dict().items()
        if key in SEQ2SEQ[target].config_class.__dataclass_fields__
        and key
        not in ("architectures", "model_type", "auto_map", "encoder_num_key_value_heads", *SEQ2SEQ_POOLED.values())
    }
    pooled = SEQ2SEQ[target].build(
        None,
        **fields,
        num_key_value_heads=groups,
        cross_attention_num_key_value_heads=groups,
        encoder_num_key_value_heads=encoder_heads,
    )
    pooled.config._attn_implementation = config._attn_implementation
    pooled.generation_config = model.generation_config
    state = model.state_dict()
    if method in CALIBRATION_METHODS:
        rewrite_seq2seq_heads(model, state, groups, method, calibration)
    fresh = pooled.state_dict() if method == "random" else {}
    for name, tensor in state.items():
        parts = name.split(".")
        # model.decoder.layers.<i>.<module>.<k_proj|v_proj>.<weight|bias>
        if parts[:3] != ["model", "decoder", "layers"] or parts[4] not in SEQ2SEQ_POOLED:
            continue
        old = getattr(config, SEQ2SEQ_POOLED[parts[4]])
        if parts[5] in ("k_proj", "v_proj") and groups != old:
            if method == "random":
                state[name] = fresh[name]
            else:
                state[name] = pool_heads(tensor, old, groups, "first" if method == "first" else "mean")
    pooled.load_state_dict(state, strict=True)
    return pooled.to(model.dtype).train(model.training)


def rewrite_seq2seq_heads(model, state: dict, groups: int, method: str, calibration) -> None:
    """Rewrite `state`'s decoder self- and cross-attention projections in place as `method` chooses from the keys
    and values they compute on the calibration pairs (`calibrated.py`): self-attention keys are fitted by the
    rotations that commute with the model's positions, cross-attention keys (which read no positions) by any
    orthogonal map."""
    from types import SimpleNamespace

    from .calibrated import seq2seq_key_value_activations

    if calibration is None:
        raise ValueError("calibration=None: calibrated methods need (source ids, target ids) pairs.")
    activations = seq2seq_key_value_activations(model, calibration)
    config = model.config
    for module, field_name in SEQ2SEQ_POOLED.items():
        layers = activations[module]
        check_enough(layers[0][0].shape[0], layers[0][0].shape[-1])
        positions = config.position_embedding_type if module == "self_attn" else "none"
        view = SimpleNamespace(
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=getattr(config, field_name),
            position_embedding_type=positions,
        )
        for index, rewrite in enumerate(rewrite_for_pooling(layers, view, groups, method)):
            prefix = f"model.decoder.layers.{index}.{module}."
            attention = {name[len(prefix) :]: tensor for name, tensor in state.items() if name.startswith(prefix)}
            for name, tensor in rewrite.apply(attention).items():
                state[prefix + name] = tensor
