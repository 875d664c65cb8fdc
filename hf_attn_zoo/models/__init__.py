"""The registry of zoo variants.

A variant joins with one `register_variant(ForCausalLMClass)` line below. That registers its config, base model,
causal LM and task heads with transformers' Auto classes and for `trust_remote_code` saving, and adds its
`ZooVariant` record to `VARIANTS`: everything the package asks about a variant (presets, paper, backends, cache, LoRA
targets, family, how to build it) is read off its classes there, so no other module keeps a table of variants.

Sequence-to-sequence models join `SEQ2SEQ` instead, with `register_seq2seq(ForConditionalGenerationClass)`: they
are registered with `AutoConfig`, `AutoModel` and `AutoModelForSeq2SeqLM` the same way, but stay out of `VARIANTS`,
whose entries are decoder-only variants (the decoder conformance suite runs over every one of them). Every variant
with a bidirectional form (all but Mamba) is also a Transformer encoder-decoder (`seq2seq_zoo`): `SEQ2SEQ` lists it
under the variant's name, with the variant's config class (`is_encoder_decoder=True` selects that shape);
`AutoModel` keeps mapping the config class to the decoder-only base model, which hands encoder-decoder configs to the
variant's encoder-decoder base model.

The other modules of this folder are what a checkpoint carries for `trust_remote_code` loading, so they import nothing
else from the package; this file is the only one that is not copied.
"""

from dataclasses import dataclass

import transformers
from transformers import AutoConfig, PretrainedConfig

from . import additive, aft, bigbird, differential, linear, linformer, mamba, mha, mla, rnn, sliding_window, topk
from .configuration_zoo import POSITION_EMBEDDING_TYPES, ZooConfig
from .heads_zoo import ZooForCausalLM
from .layers_zoo import ZooAttention, ZooMLP
from .modeling_zoo import ZooModel, ZooPreTrainedModel


class RegisteredModel:
    """What a registry entry reads off its config class, alike for decoder variants and sequence-to-sequence models:
    the subclasses say where `config_class` comes from."""

    config_class: type[PretrainedConfig]

    @property
    def model_type(self) -> str:
        return self.config_class.model_type

    @property
    def description(self) -> str:
        return self.config_class.description

    @property
    def paper(self) -> str:
        return self.config_class.paper

    @property
    def arxiv(self) -> tuple[str, ...]:
        return self.config_class.arxiv

    @property
    def presets(self) -> dict[str, dict]:
        return {size: dict(fields) for size, fields in self.config_class.presets.items()}

    def preset(self, size: str) -> dict:
        return self.config_class.preset(size)

    @property
    def config_defaults(self) -> dict:
        """Fields the model's shape needs under any preset (none by default)."""
        return {}

    def config(self, size: str | None = None, **fields) -> PretrainedConfig:
        """A config of this model: `config_defaults`, preset `size` (tiny, small, base) if given, `fields` on top."""
        return self.config_class(**{**self.config_defaults, **(self.preset(size) if size else {}), **fields})


@dataclass(frozen=True)
class ZooVariant(RegisteredModel):
    """One registered variant: a name and its causal-LM class; every other fact is read off its classes."""

    name: str
    causal_lm_class: type[ZooForCausalLM]

    @property
    def model_class(self) -> type[ZooModel]:
        return self.causal_lm_class.base_model_class

    @property
    def config_class(self) -> type[ZooConfig]:
        return self.model_class.config_class

    @property
    def attention_class(self) -> type[ZooAttention]:
        return self.model_class.attention_class

    @property
    def heads(self) -> dict[str, type[ZooPreTrainedModel]]:
        """Auto class name -> the variant's class for it: the causal LM and the task heads."""
        return dict(self.model_class.heads)

    @property
    def family(self) -> str:
        """The variant family (`mha` for MHA, GQA, MQA and single head: Llama's layout, poolable key/value heads)."""
        return self.attention_class.family

    @property
    def position_types(self) -> tuple[str, ...]:
        return self.config_class.supported_position_types

    @property
    def backends(self) -> tuple[str, ...]:
        return self.attention_class.backends

    @property
    def default_backend(self) -> str:
        """The backend a model is built with unless told otherwise: sdpa where the kernel runs through it."""
        return "sdpa" if "sdpa" in self.backends else "eager"

    @property
    def decodes_from_state(self) -> bool:
        return self.attention_class.decodes_from_state()

    @property
    def cache_per_token(self) -> str:
        return self.config_class.cache_per_token

    @property
    def lora_targets(self) -> list[str]:
        """PEFT `target_modules` at the variant's default config: the attention's projections and the MLP's (what
        `"all-linear"` picks too)."""
        return self.lora_targets_for(self.config())

    def lora_targets_for(self, config: ZooConfig) -> list[str]:
        """PEFT `target_modules` of a model of `config` (a config can change which projections exist)."""
        mlp = ZooMLP.lora_targets if config.mlp_type != "none" else ()
        return [*self.attention_class.lora_modules(config), *mlp]

    def build(self, size: str | None = None, *, attn_implementation: str | None = None, **fields) -> ZooForCausalLM:
        """A freshly initialised causal LM of `config(size, **fields)` on `default_backend` unless told otherwise."""
        return self.causal_lm_class._from_config(
            self.config(size, **fields), attn_implementation=attn_implementation or self.default_backend
        )


VARIANTS: dict[str, ZooVariant] = {}


def register_variant(causal_lm_class: type[ZooForCausalLM]) -> ZooVariant:
    """Add a variant to `VARIANTS` under its model type without `zoo_` (`zoo_gqa` -> `gqa`), register its config,
    base model, causal LM and task heads with transformers' Auto classes, and mark them for `trust_remote_code`
    saving (`register_for_auto_class`: `save_pretrained` then copies their code beside the weights)."""
    variant = ZooVariant(causal_lm_class.config_class.model_type.removeprefix("zoo_"), causal_lm_class)
    if variant.name in VARIANTS:
        raise ValueError(f"variant {variant.name!r} is already registered")
    register_auto_classes(variant, variant.heads)
    VARIANTS[variant.name] = variant
    return variant


def register_auto_classes(entry: RegisteredModel, heads: dict[str, type], map_auto_model: bool = True) -> None:
    """Register `entry`'s config with `AutoConfig`, its base model with `AutoModel` (unless `map_auto_model` is
    False) and each of `heads` (Auto class name -> class) with that Auto class, and mark them all for
    `trust_remote_code` saving (`register_for_auto_class`: `save_pretrained` then copies their code beside the
    weights and lists them in `auto_map`)."""
    AutoConfig.register(entry.model_type, entry.config_class, exist_ok=True)
    entry.config_class.register_for_auto_class()
    for auto_class, model_class in {"AutoModel": entry.model_class, **heads}.items():
        if auto_class != "AutoModel" or map_auto_model:
            getattr(transformers, auto_class).register(entry.config_class, model_class, exist_ok=True)
        model_class.register_for_auto_class(auto_class)


register_variant(mha.ZooMHAForCausalLM)
register_variant(mha.ZooMQAForCausalLM)
register_variant(mha.ZooGQAForCausalLM)
register_variant(mha.ZooSingleHeadForCausalLM)
register_variant(sliding_window.ZooSlidingWindowForCausalLM)
register_variant(linformer.ZooLinformerForCausalLM)
register_variant(aft.ZooAFTFullForCausalLM)
register_variant(aft.ZooAFTLocalForCausalLM)
register_variant(aft.ZooAFTSimpleForCausalLM)
register_variant(topk.ZooTopKForCausalLM)
register_variant(additive.ZooAdditiveForCausalLM)
register_variant(differential.ZooDifferentialForCausalLM)
register_variant(mla.ZooMLAForCausalLM)
register_variant(linear.ZooLinearForCausalLM)
register_variant(bigbird.ZooBigBirdForCausalLM)
register_variant(mamba.ZooMambaForCausalLM)


@dataclass(frozen=True)
class ZooSeq2SeqModel(RegisteredModel):
    """One registered sequence-to-sequence model: a name and its conditional-generation class (the one
    `AutoModelForSeq2SeqLM` builds); every other fact is read off its classes."""

    name: str
    generation_class: type

    @property
    def model_class(self) -> type:
        return self.generation_class.model_class

    @property
    def config_class(self) -> type:
        return self.generation_class.config_class

    @property
    def config_defaults(self) -> dict:
        """Fields the model's shape needs on top of its presets: `is_encoder_decoder=True` for a variant's
        encoder-decoder, whose config class is the decoder's."""
        return dict(getattr(self.generation_class, "config_defaults", {}))

    def build(self, size: str | None = None, **fields):
        """A freshly initialised model of `config(size, **fields)`, ready for `generate()`."""
        return self.generation_class(self.config(size, **fields))


SEQ2SEQ: dict[str, ZooSeq2SeqModel] = {}


def register_seq2seq(generation_class: type) -> ZooSeq2SeqModel:
    """Add a sequence-to-sequence model to `SEQ2SEQ` under its model type without `zoo_` (`zoo_rnn` -> `rnn`,
    `zoo_gqa` -> `gqa` for the GQA encoder-decoder), register its config, base model (`generation_class.model_class`)
    and itself with `AutoConfig`, `AutoModel` and `AutoModelForSeq2SeqLM` (a variant's encoder with
    `AutoModelForTextEncoding`), and mark them for `trust_remote_code` saving. A variant's encoder-decoder shares
    the variant's config class, which `AutoModel` keeps mapping to the decoder-only base model (one class per config
    class); that one hands encoder-decoder configs on."""
    entry = ZooSeq2SeqModel(generation_class.config_class.model_type.removeprefix("zoo_"), generation_class)
    variant = VARIANTS.get(entry.name)
    if entry.name in SEQ2SEQ or (variant is not None and variant.config_class is not entry.config_class):
        raise ValueError(f"model {entry.name!r} is already registered")
    heads = {"AutoModelForSeq2SeqLM": generation_class}
    if variant is not None:  # the encoder alone, as transformers' T5EncoderModel
        heads["AutoModelForTextEncoding"] = variant.model_class.encoder_class
    # a variant's encoder-decoder shares its config class, which AutoModel keeps mapping to the decoder's base model
    register_auto_classes(entry, heads, map_auto_model=variant is None)
    SEQ2SEQ[entry.name] = entry
    return entry


register_seq2seq(rnn.ZooRNNForConditionalGeneration)
for _variant in VARIANTS.values():
    if _variant.model_class.seq2seq_model_class is not None:  # none where no bidirectional form exists (Mamba)
        register_seq2seq(_variant.model_class.seq2seq_model_class.generation_class)


def get_variant(name_or_model_type: str) -> ZooVariant:
    """Look a variant up by registry name (`gqa`) or model type (`zoo_gqa`)."""
    for variant in VARIANTS.values():
        if name_or_model_type in (variant.name, variant.model_type):
            return variant
    raise ValueError(f"unknown variant {name_or_model_type!r}; registered: {sorted(VARIANTS)}")


__all__ = [
    "POSITION_EMBEDDING_TYPES",
    "SEQ2SEQ",
    "VARIANTS",
    "ZooConfig",
    "ZooForCausalLM",
    "ZooModel",
    "ZooPreTrainedModel",
    "ZooSeq2SeqModel",
    "ZooVariant",
    "get_variant",
    "register_seq2seq",
    "register_variant",
]
