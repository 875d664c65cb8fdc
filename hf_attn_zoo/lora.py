"""LoRA target modules for PEFT, per zoo variant.

Every variant keeps Llama's module names (`self_attn.q_proj` ... `mlp.down_proj`); what each projection means is the
variant's (for AFT, `q_proj` is the gate sigmoid(q) and `k_proj` the keys of its weights; for additive attention,
`q_proj`/`k_proj` are W_q and W_k of the score network, so LoRA adapts the scores). A variant declares its targets on
its attention class (`lora_targets`); the MLP adds its three projections. Left out everywhere: parameters that are
not Linear layers (Linformer's E and F, AFT's position bias, the additive score vector: maps indexed by position or
too small to make low-rank; train them through `modules_to_save` if wanted), the embeddings and the head tied to
them, and the norms. peft's `target_modules="all-linear"` picks exactly the same modules (it skips the output head);
`tests/test_peft.py` checks both.

    from peft import LoraConfig, get_peft_model
    from hf_attn_zoo.lora import lora_target_modules

    model = get_peft_model(model, LoraConfig(target_modules=lora_target_modules(model), task_type="CAUSAL_LM"))
"""

from transformers import PreTrainedConfig, PreTrainedModel

from .models import VARIANTS, get_variant


def lora_target_modules(config_or_model: PreTrainedConfig | PreTrainedModel | str) -> list[str]:
    """The LoRA `target_modules` of a zoo config, model (a `PeftModel` too) or variant name / model type."""
    if isinstance(config_or_model, str):
        return get_variant(config_or_model).lora_targets  # a new list each time: LoraConfig may keep and mutate it
    config = getattr(config_or_model, "config", config_or_model)
    name = getattr(config, "model_type", None)
    if not name:
        raise TypeError(f"expected a zoo config, model or variant name, got {type(config_or_model).__name__}")
    return get_variant(name).lora_targets_for(config)


def lora_table() -> str:
    """A markdown table `variant | target_modules` over the registered variants, for the README."""
    rows = ["| variant | target_modules |", "| --- | --- |"]
    for name, variant in VARIANTS.items():
        rows.append(f"| `{name}` | {', '.join(f'`{module}`' for module in variant.lora_targets)} |")
    return "\n".join(rows)
