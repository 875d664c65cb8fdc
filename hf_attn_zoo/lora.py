"""LoRA target modules for PEFT, per zoo variant.

Every variant keeps Llama's module names (`self_attn.q_proj` ... `mlp.down_proj`), so one list of names fits them all;
what differs is what those projections mean and which variant-specific parameters are left out (see the comments
below). peft's `target_modules="all-linear"` picks exactly the same modules on every variant (it skips the output
head itself); `tests/test_peft.py` checks both.

    from peft import LoraConfig, get_peft_model
    from hf_attn_zoo.lora import lora_target_modules

    model = get_peft_model(model, LoraConfig(target_modules=lora_target_modules(model), task_type="CAUSAL_LM"))
"""

from transformers import PreTrainedConfig, PreTrainedModel

from .models import VARIANTS, get_variant

ATTENTION_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP_PROJECTIONS = ["gate_proj", "up_proj", "down_proj"]
# Left out of every variant: `embed_tokens` and the `lm_head` tied to it (tied by default: adapting the head alone
# would make the output side differ from the input side; peft's "all-linear" skips the output head too) and the
# RMSNorm weights (not Linear layers; train them fully through `modules_to_save` if wanted).


def _projections() -> list[str]:
    """Every Linear layer of a decoder block; a fresh list per variant so that editing one entry edits only it."""
    return ATTENTION_PROJECTIONS + MLP_PROJECTIONS


LORA_TARGET_MODULES: dict[str, list[str]] = {
    # one implementation for the four; k_proj/v_proj are narrower (G heads) for MQA/GQA, LoRA does not mind
    "mha": _projections(),
    "mqa": _projections(),
    "gqa": _projections(),
    "single_head": _projections(),
    "sliding_window": _projections(),
    "topk": _projections(),
    # E and F (`projection.key_projection` / `value_projection`) are bare `nn.Parameter`s of shape (P, k, n) that mix
    # positions, not features: LoRA wraps Linear layers only, and a low-rank update of a map indexed by position is
    # not what LoRA is for. Train them explicitly if needed; with `linformer_sharing="layerwise"` they are shared.
    "linformer": _projections(),
    # The pairwise position bias w = u·vᵀ (`position_bias_u`, `position_bias_v`, nn.Embedding over positions) is
    # already a rank-`aft_bias_rank` factorisation: a LoRA on top of it adds nothing a rank change would not, and it
    # is indexed by position, not by features. q_proj here is the gate sigmoid(q), k_proj the AFT weights' keys.
    "aft_full": _projections(),
    "aft_local": _projections(),
    # no position bias at all: the projections are every attention parameter
    "aft_simple": _projections(),
    # q_proj and k_proj are W_q and W_k of the score network vᵀtanh(W_q q + W_k k) (width `additive_dim` per head),
    # so LoRA adapts the scores themselves. The read-out v (`score_vector`, an (H, additive_dim) nn.Parameter) is not
    # a Linear layer and has H·additive_dim entries: nothing to make low-rank.
    "additive": _projections(),
}


def lora_target_modules(config_or_model: PreTrainedConfig | PreTrainedModel | str) -> list[str]:
    """The LoRA `target_modules` of a zoo config, model (a `PeftModel` too) or variant name / model type."""
    if isinstance(config_or_model, str):
        name = config_or_model
    else:
        config = getattr(config_or_model, "config", config_or_model)
        name = getattr(config, "model_type", None)
        if not name:
            raise TypeError(f"expected a zoo config, model or variant name, got {type(config_or_model).__name__}")
    variant = get_variant(name)  # raises ValueError naming the registered variants
    if variant.name not in LORA_TARGET_MODULES:
        raise ValueError(
            f"variant {variant.name!r} has no entry in hf_attn_zoo.lora.LORA_TARGET_MODULES; add one, or pass "
            f'target_modules="all-linear" to LoraConfig.'
        )
    return list(LORA_TARGET_MODULES[variant.name])  # a copy: LoraConfig may keep and mutate what it is given


def lora_table() -> str:
    """A markdown table `variant | target_modules` over the registered variants, for the README."""
    rows = ["| variant | target_modules |", "| --- | --- |"]
    for name in VARIANTS:
        modules = ", ".join(f"`{module}`" for module in LORA_TARGET_MODULES.get(name, []))
        rows.append(f"| `{name}` | {modules or '(none)'} |")
    return "\n".join(rows)
