"""The heads over a variant's base model, written once: causal LM, sequence and token classification, question
answering; and `variant_heads`, which builds a variant's four heads from its `ZooModel` subclass.

A variant file ends with its Model class and one statement binding `variant_heads(ZooXModel)` under the heads' names
(`ZooXForCausalLM, ...`). Those classes are built, not written, because they would be identical bodies differing only
in `base_model_class`; they are placed in the variant's module under those names, so a checkpoint's `auto_map`,
remote-code loading, pickling and transformers' Auto classes find them as if declared there. A variant whose head
needs behaviour of its own (Linformer's causal LM refuses to generate without a causal projection) subclasses a kind
here by hand, sets `base_model_class`, and `variant_heads` returns it as declared.

Like the backbone it travels next to every saved checkpoint (remote code), so it imports only torch, transformers and
its flat siblings.
"""

import copy
import inspect
from typing import ClassVar

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
)
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithCrossAttentions,
    CausalLMOutputWithPast,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple, logging

from .compat_zoo import CACHE_KWARG, build_mask, returned_cache, slice_logits_to_keep, takes_past_key_values
from .configuration_zoo import ZooConfig
from .loss_zoo import causal_lm_loss, causal_lm_loss_fused
from .modeling_zoo import ZooModel, ZooPreTrainedModel

__all__ = [
    "HEAD_KINDS",
    "ZooForCausalLM",
    "ZooForQuestionAnswering",
    "ZooForSequenceClassification",
    "ZooForTokenClassification",
    "ZooHead",
    "VariantClass",
    "variant_class",
    "variant_heads",
]

logger = logging.get_logger(__name__)


# what transformers reads off the top-level class: the base model's answers
FLAGS_OF_THE_BASE = (
    "_supports_sdpa",
    "_supports_flash_attn",
    "_supports_flex_attn",
    "_supports_attention_backend",
    "_can_compile_fullgraph",
)


def take_answers_of(cls: type, base: type[ZooModel]) -> None:
    """What transformers reads off a top-level class (a head, a variant's encoder-decoder), taken from the variant's
    base model: its config class, backend flags and whether it decodes from a state."""
    cls.config_class = base.config_class
    for flag in FLAGS_OF_THE_BASE:
        setattr(cls, flag, getattr(base, flag))
    # decodes from running sums that cannot be rolled back: generate refuses assisted and prompt lookup
    cls._is_stateful = base.attention_class.decodes_from_state()


class VariantClass:
    """A top-level class over a variant's `ZooModel` (a head, an encoder-decoder): a subclass that names its
    `base_model_class` takes the answers transformers reads off it (`take_answers_of`)."""

    base_model_class: type[ZooModel]

    def __init_subclass__(cls, **kwargs) -> None:
        if (base := cls.__dict__.get("base_model_class")) is not None:
            take_answers_of(cls, base)
        super().__init_subclass__(**kwargs)


def variant_class(kind: type, model_class: type[ZooModel], suffix: str | None = None, /, **namespace) -> type:
    """The class of `kind` over the variant of `model_class`, named after it (`ZooMHAModel` and `ZooForCausalLM` ->
    `ZooMHAForCausalLM`; `suffix` names it otherwise) and placed in its module, so that `auto_map`, remote-code
    loading (which imports the variant file and reads the class by name), pickling and the Auto classes find it
    there. A `VariantClass` kind (a head, an encoder-decoder) gets `model_class` as its `base_model_class`; any other
    kind (`ZooEncoder`, `ZooDecoder`) is mixed into a subclass of `model_class`. Every variant's classes of a kind are
    the same class body, so they are built here, once, from `variant_heads` and `seq2seq_classes`."""
    name = model_class.__name__.removesuffix("Model") + (suffix or kind.__name__.removeprefix("Zoo"))
    if issubclass(kind, VariantClass):
        bases = (kind, GenerationMixin) if issubclass(kind, GenerationMixin) else (kind,)
        namespace["base_model_class"] = model_class
    else:
        bases = (kind, model_class)
    namespace |= {
        "__module__": model_class.__module__,
        "__qualname__": name,
        "__doc__": f"`{kind.__name__}` of `{model_class.__name__}`'s variant.",
    }
    return type(model_class)(name, bases, namespace)


class ZooHead(VariantClass, ZooPreTrainedModel):
    """A variant's base model (`self.model`) under a head. A variant's head class names its `base_model_class`; that
    makes it the variant's head for `auto_class` (listed in `base_model_class.heads`, so in a checkpoint's
    `auto_map`) and gives it the base model's config class and backend flags."""

    auto_class: ClassVar[str]

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if (base := cls.__dict__.get("base_model_class")) is not None:
            base.heads[cls.auto_class] = cls

    def _build_base_model(self, config: ZooConfig) -> None:
        """`self.model`, built directly: transformers' generic heads go through `AutoModel.from_config`, which does
        not know the variant when the checkpoint is loaded as remote code. A cross-attending config (a decoder under
        `EncoderDecoderModel`) gets the variant's decoder class, which records the cross-attention weights."""
        ZooPreTrainedModel.__init__(self, config)
        cross = config.add_cross_attention and self.base_model_class.decoder_class is not None
        self.model = (self.base_model_class.decoder_class if cross else self.base_model_class)(config)
        self.model.inside_head = True


class ZooForSequenceClassification(GenericForSequenceClassification, ZooHead):
    """transformers' sequence classifier over the variant: the head reads the last non-padding token (the one that
    has seen the whole sequence in a causal model); `config.num_labels` classes, `config.problem_type` losses."""

    auto_class = "AutoModelForSequenceClassification"
    sized_by: ClassVar[dict[str, str]] = {"score": "num_labels, hidden_size"}

    def __init__(self, config: ZooConfig) -> None:
        self._build_base_model(config)
        self.num_labels = config.num_labels
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()


class ZooForTokenClassification(GenericForTokenClassification, ZooHead):
    """transformers' token classifier over the variant (dropout `hidden_dropout`, then a linear layer per token)."""

    auto_class = "AutoModelForTokenClassification"
    sized_by: ClassVar[dict[str, str]] = {"score": "num_labels, hidden_size"}

    def __init__(self, config: ZooConfig) -> None:
        self._build_base_model(config)
        self.num_labels = config.num_labels
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.score = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()


class ZooForQuestionAnswering(GenericForQuestionAnswering, ZooHead):
    """transformers' extractive question answering head over the variant: start and end logits per token."""

    auto_class = "AutoModelForQuestionAnswering"
    sized_by: ClassVar[dict[str, str]] = {"qa_outputs": "hidden_size"}

    def __init__(self, config: ZooConfig) -> None:
        self._build_base_model(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()


class ZooForCausalLM(ZooHead, GenerationMixin):
    """A `ZooModel` with a language-modelling head; each variant subclasses it and sets `base_model_class`."""

    auto_class = "AutoModelForCausalLM"
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    sized_by: ClassVar[dict[str, str]] = {"lm_head": "vocab_size, hidden_size"}

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        base = cls.__dict__.get("base_model_class")
        if base is not None:
            base.causal_lm_class = cls

    # a translator checkpoint's names for its decoder's tensors (its encoder's are not the decoder's)
    translator_key_mapping: ClassVar[dict[str, str]] = {
        r"^model\.decoder\.": "model.",
        r"^model\.shared\.": "model.embed_tokens.",
    }

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """As `PreTrainedModel.from_pretrained`; a translator checkpoint (`is_encoder_decoder=True`, as `AutoModel...`
        passes its config) gives its decoder alone, as BART's checkpoints give `BartForCausalLM`: the decoder's
        `decoder_layers` layers with their cross-attention (`add_cross_attention=True`: it reads
        `encoder_hidden_states`, under transformers' `EncoderDecoderModel` or beside the translator's encoder), the
        shared embedding and the head."""
        config = kwargs.get("config")
        if config is None:  # the checkpoint's own, read as a plain dict first: only a translator's is rebuilt here
            names = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "gguf_file")
            hub = {name: kwargs[name] for name in names if name in kwargs}
            try:
                translator = cls.config_class.get_config_dict(pretrained_model_name_or_path, **hub)[0].get(
                    "is_encoder_decoder"
                )
            except OSError:  # no config to read: transformers' own loading below says so
                translator = False
            if translator:
                config = cls.config_class.from_pretrained(pretrained_model_name_or_path, **hub)
        if isinstance(config, ZooConfig) and config.is_encoder_decoder:
            config = copy.deepcopy(config)
            config.num_hidden_layers = config.decoder_layers or config.num_hidden_layers
            config.is_encoder_decoder, config.is_decoder, config.add_cross_attention = False, True, True
            kwargs["config"] = config
            kwargs.setdefault("key_mapping", cls.translator_key_mapping)
        return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)

    def __init__(self, config: ZooConfig) -> None:
        if not config.is_decoder and not config.is_encoder_decoder:
            raise ValueError(
                f"is_decoder=False builds {config.model_type}'s bidirectional form (an encoder), which cannot be a "
                f"causal language model: leave is_decoder=True, or load the encoder with AutoModel."
            )
        self._build_base_model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """`generate` builds a cache of key/value layers from the config; a variant that decodes from a state, or
        whose layers keep other keys than the config's fields say (a window with sink tokens), puts the model's own
        in place, and refuses cache implementations (static, quantized, offloaded) that would build another."""
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        attention = self.model.attention_class
        if attention.decodes_from_state():
            why = "decodes from a state per layer, not from keys and values"
        elif attention.cache_config(self.config) is not self.config:
            why = "keeps other keys than transformers' cache for its config would (sink tokens beside its window)"
        else:
            return
        cache = model_kwargs.get(CACHE_KWARG)
        if cache is None or getattr(cache, "_is_user_defined", False):
            return
        if generation_config.cache_implementation not in (None, "dynamic"):
            raise ValueError(
                f"{self.config.model_type} {why}: cache_implementation={generation_config.cache_implementation!r} "
                f"does not apply; leave it unset."
            )
        model_kwargs[CACHE_KWARG] = self.model.make_cache()

    @takes_past_key_values
    def create_masks_for_generate(
        self,
        config: ZooConfig,
        inputs_embeds: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: Cache | None,
        position_ids: torch.LongTensor | None = None,
        **kwargs,
    ) -> torch.Tensor | None:
        """With a static cache `generate` builds the 4D mask outside the model, so that a compiled decode step sees
        fixed shapes. That suits the dense kind (the forward adds ALiBi's bias to it, in `dense_mask`); kernels that
        walk over blocks build their mask from the 2D padding mask, so for them it stays 2D."""
        attention = self.model.attention_class
        if attention.mask_kind(config, inputs_embeds.shape[1], False) != "dense":
            return attention_mask
        padding = attention_mask if attention_mask is not None and attention_mask.ndim == 2 else None
        builder, extra = attention.dense_mask_builder(config, padding)
        return build_mask(  # transformers' builder; before 5.3 it also takes generate's `cache_position`
            builder,
            config=config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
            cache_position=kwargs.get("cache_position"),
            **extra,
        )

    @property
    def loss_function(self):
        """transformers' causal LM loss (`loss_type` "ForCausalLM"), computed by the zoo's `causal_lm_loss`: the same
        value from the same logits, with a shorter backward (`loss_zoo.CrossEntropy`). A loss function set on the model
        (`model.loss_function = ...`) or another `loss_type` is used as transformers would."""
        if hasattr(self, "_loss_function") or self.loss_type != "ForCausalLM":
            return super().loss_function
        return causal_lm_loss

    @loss_function.setter
    def loss_function(self, value) -> None:
        self._loss_function = value

    def _fuse_loss(self, logits_to_keep: int | torch.Tensor) -> bool:
        """Whether training can skip the logits: only a plain `nn.Linear` head (not one wrapped by PEFT or a
        quantizer) over every position, with gradients on."""
        return (
            self.config.fuse_linear_cross_entropy
            and self.training
            and torch.is_grad_enabled()
            and type(self.lm_head) is nn.Linear
            and isinstance(logits_to_keep, int)
            and logits_to_keep == 0
        )

    @takes_past_key_values
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,  # consumed by @can_return_tuple: False returns a tuple
        logits_to_keep: int | torch.Tensor = 0,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast | CausalLMOutputWithCrossAttentions:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            Targets for the next-token loss; they are shifted inside, and -100 is ignored. With
            `config.fuse_linear_cross_entropy` (off by default) the head and the loss run fused in training mode
            (with gradients) and `logits` is None.
        logits_to_keep (`int` or `torch.Tensor`, *optional*):
            Compute logits for the last `logits_to_keep` positions only (0 keeps all), or for the given indices.
        encoder_hidden_states, encoder_attention_mask (*optional*):
            Another model's encoder outputs and the source's padding mask, for a model built with
            `add_cross_attention=True` (a decoder under `EncoderDecoderModel`).
        """
        if encoder_hidden_states is not None or encoder_attention_mask is not None:
            kwargs["encoder_hidden_states"] = encoder_hidden_states
            kwargs["encoder_attention_mask"] = encoder_attention_mask
        for name, flag in (("output_attentions", output_attentions), ("output_hidden_states", output_hidden_states)):
            if flag is not None:
                kwargs[name] = flag
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = loss = None
        if labels is not None and self._fuse_loss(logits_to_keep):
            logger.warning_once(
                "config.fuse_linear_cross_entropy=True: in training with labels the head and the loss run fused and "
                "the output's `logits` is None; set model.config.fuse_linear_cross_entropy = False for logits."
            )
            loss = causal_lm_loss_fused(
                hidden_states,
                self.lm_head,
                labels,
                num_items_in_batch=kwargs.get("num_items_in_batch"),
                shift_labels=kwargs.get("shift_labels"),
            )
        else:
            logits = self.lm_head(hidden_states)  # (B, T_kept, vocab)
            if labels is not None:
                loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        fields = {
            "loss": loss,
            "logits": logits,
            CACHE_KWARG: returned_cache(outputs),
            "hidden_states": outputs.hidden_states,
            "attentions": outputs.attentions,
        }
        if self.model.cross_attention_class is None:
            return CausalLMOutputWithPast(**fields)
        return CausalLMOutputWithCrossAttentions(**fields, cross_attentions=outputs.cross_attentions)


HEAD_KINDS = (ZooForCausalLM, ZooForSequenceClassification, ZooForTokenClassification, ZooForQuestionAnswering)


def variant_heads(model_class: type[ZooModel]) -> tuple[type[ZooHead], ...]:
    """The variant's heads over `model_class`, one per kind of `HEAD_KINDS` and in that order, for the variant file to
    bind under their names: `ZooXForCausalLM, ZooXForSequenceClassification, ZooXForTokenClassification,
    ZooXForQuestionAnswering = variant_heads(ZooXModel)`.

    Each is built by `variant_class`. A variant whose head needs behaviour of its own declares it by hand, with
    `base_model_class` set, before calling this: a kind the model already has is returned as declared."""
    # ZooHead.__init_subclass__ lists each new head in model_class.heads
    return tuple(model_class.heads.get(kind.auto_class) or variant_class(kind, model_class) for kind in HEAD_KINDS)


# Classes registered with `register_for_auto_class` count as remote code, for which `generate` runs
# `inspect.signature(self.forward)` at every decoding step (looking for a legacy `cache_position` argument). A
# precomputed signature turns that lookup into an attribute read: 3-4% of batch-1 decoding time on CPU.
ZooForCausalLM.forward.__signature__ = inspect.signature(ZooForCausalLM.forward)
