"""The registry of zoo variants.

Importing this package registers every variant with `AutoConfig`, `AutoModel`, `AutoModelForCausalLM` and the task
heads (`AutoModelForSequenceClassification`, `AutoModelForTokenClassification`, `AutoModelForQuestionAnswering`). A
variant joins with one `register_variant(name, ForCausalLMClass)` line below; its config class, base model class,
heads, backends, position types and cache formula are read off the classes.

The modules of this folder are what a checkpoint carries for `trust_remote_code` loading, so they import nothing
else from the package; this file is the only one that is not copied.
"""

from dataclasses import dataclass

import transformers
from transformers import AutoConfig, AutoModel

from . import additive, aft, linformer, mha, sliding_window, topk
from .configuration_zoo import POSITION_EMBEDDING_TYPES, ZooConfig
from .modeling_zoo import ZooForCausalLM, ZooModel, ZooPreTrainedModel


@dataclass(frozen=True)
class ZooVariant:
    """One registered variant: a name and its causal-LM class; everything else is derived from the classes."""

    name: str
    causal_lm_class: type[ZooForCausalLM]

    @property
    def config_class(self) -> type[ZooConfig]:
        return self.causal_lm_class.config_class

    @property
    def model_class(self) -> type[ZooModel]:
        return self.causal_lm_class.base_model_class

    @property
    def heads(self) -> dict[str, type[ZooPreTrainedModel]]:
        """Auto class name -> the variant's class for it: the causal LM and the task heads."""
        return dict(self.model_class.heads)

    @property
    def model_type(self) -> str:
        return self.config_class.model_type

    @property
    def position_types(self) -> tuple[str, ...]:
        return self.config_class.supported_position_types

    @property
    def backends(self) -> tuple[str, ...]:
        cls = self.causal_lm_class
        flags = (
            ("sdpa", cls._supports_sdpa),
            ("flash_attention_2", cls._supports_flash_attn),
            ("flex_attention", cls._supports_flex_attn),
        )
        return ("eager",) + tuple(name for name, supported in flags if supported)

    @property
    def cache_per_token(self) -> str:
        return self.config_class.cache_per_token

    @property
    def description(self) -> str:
        return self.config_class.description

    @property
    def paper(self) -> str:
        return self.config_class.paper

    def config(self, **kwargs) -> ZooConfig:
        return self.config_class(**kwargs)


VARIANTS: dict[str, ZooVariant] = {}


def register_variant(name: str, causal_lm_class: type[ZooForCausalLM]) -> ZooVariant:
    """Add a variant to `VARIANTS` and to transformers' Auto classes."""
    if name in VARIANTS:
        raise ValueError(f"variant {name!r} is already registered")
    variant = ZooVariant(name, causal_lm_class)
    AutoConfig.register(variant.model_type, variant.config_class, exist_ok=True)
    AutoModel.register(variant.config_class, variant.model_class, exist_ok=True)
    for auto_class, head in variant.heads.items():
        getattr(transformers, auto_class).register(variant.config_class, head, exist_ok=True)
    VARIANTS[name] = variant
    return variant


register_variant("mha", mha.ZooMHAForCausalLM)
register_variant("mqa", mha.ZooMQAForCausalLM)
register_variant("gqa", mha.ZooGQAForCausalLM)
register_variant("single_head", mha.ZooSingleHeadForCausalLM)
register_variant("sliding_window", sliding_window.ZooSlidingWindowForCausalLM)
register_variant("linformer", linformer.ZooLinformerForCausalLM)
register_variant("aft_full", aft.ZooAFTFullForCausalLM)
register_variant("aft_local", aft.ZooAFTLocalForCausalLM)
register_variant("aft_simple", aft.ZooAFTSimpleForCausalLM)
register_variant("topk", topk.ZooTopKForCausalLM)
register_variant("additive", additive.ZooAdditiveForCausalLM)


def get_variant(name_or_model_type: str) -> ZooVariant:
    """Look a variant up by registry name (`gqa`) or model type (`zoo_gqa`)."""
    for variant in VARIANTS.values():
        if name_or_model_type in (variant.name, variant.model_type):
            return variant
    raise ValueError(f"unknown variant {name_or_model_type!r}; registered: {sorted(VARIANTS)}")


__all__ = [
    "POSITION_EMBEDDING_TYPES",
    "VARIANTS",
    "ZooConfig",
    "ZooForCausalLM",
    "ZooModel",
    "ZooPreTrainedModel",
    "ZooVariant",
    "get_variant",
    "register_variant",
]
