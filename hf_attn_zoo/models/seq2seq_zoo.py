"""The Transformer encoder-decoder of every zoo variant, written once: `ZooEncoderDecoderModel` (the bare model,
`AutoModel`) and `ZooForConditionalGeneration` (with the language-modelling head, `AutoModelForSeq2SeqLM`), and
`seq2seq_classes`, which builds a variant's two from its `ZooModel` subclass.

Vaswani et al. 2017 (arXiv 1706.03762): an encoder of bidirectional self-attention layers reads the source; a decoder
of masked (causal) self-attention layers, each with a cross-attention over the encoder's outputs, writes the target.
Here both stacks are the variant's own `ZooModel`, built with `role="encoder"` (its bidirectional form: the MHA
family and differential and MLA attention unmasked, sliding window as a two-sided band, top-k and additive over every
key, Linformer's paper form, AFT's non-causal form) and `role="decoder"` (its causal form, plus the cross-attention
`config.cross_attention` declares, `cross_attention_zoo.py`). One config class per variant serves both shapes, as
BART's does: `is_encoder_decoder=True` makes this model; `encoder_layers` / `decoder_layers` size the stacks.

Names follow BART/Marian: `model.shared` (one embedding for source and target, tied to `lm_head` with
`tie_word_embeddings`), `model.encoder`, `model.decoder`, `layers[i].self_attn`, `layers[i].encoder_attn`,
`encoder_attn_layer_norm`, `lm_head`; labels are shifted right behind `decoder_start_token_id`
(`shift_tokens_right`), as BART's are. Deviation from Vaswani et al.: the backbone's choices (pre-norm, RoPE or the
variant's positions, gated MLP by default) on both sides.

Generation is transformers' `generate()` (greedy, sampling, beam search, `decoder_start_token_id`,
`forced_bos_token_id`); the cache is transformers' `EncoderDecoderCache`: the variant's own self-attention cache (key
and value layers, or the state layers of Linformer and AFT, which beam search reorders the same way) and a
cross-attention cache of keys and values computed once from the encoder's outputs.

Like the backbone it travels next to every saved checkpoint (remote code), so it imports only torch, transformers and
its flat siblings.
"""

import copy
import inspect
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F
from transformers.cache_utils import Cache, EncoderDecoderCache
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import BaseModelOutput, Seq2SeqLMOutput, Seq2SeqModelOutput
from transformers.utils import can_return_tuple

from .compat_zoo import CACHE_KWARG, returned_cache, takes_past_key_values
from .configuration_zoo import ZooConfig
from .encoder_decoder_zoo import SharedEmbeddingModel, TranslatorHead, shift_tokens_right
from .heads_zoo import take_answers_of
from .modeling_zoo import ZooModel, ZooPreTrainedModel

__all__ = [
    "ZooEncoderDecoderModel",
    "ZooForConditionalGeneration",
    "ZooSeq2SeqPreTrainedModel",
    "seq2seq_classes",
    "shift_tokens_right",
]


class ZooSeq2SeqPreTrainedModel(ZooPreTrainedModel):
    """What the two encoder-decoder classes of a variant share: the variant (`base_model_class`, its decoder-only
    `ZooModel`, whose config class and backend flags they take), the refusal of a decoder-only config, and the
    checkpoint's `auto_map`."""

    base_model_class: type[ZooModel]
    # the variant's bare encoder-decoder and the one with the head (set by `seq2seq_classes`; plain `type`:
    # transformers evaluates the class annotations when the class is created)
    model_class: ClassVar[type]
    generation_class: ClassVar[type]
    config_defaults: ClassVar[dict] = {"is_encoder_decoder": True}  # what the registry's `config()` adds

    def __init_subclass__(cls, **kwargs) -> None:
        base = cls.__dict__.get("base_model_class")
        if base is not None:
            take_answers_of(cls, base)
        super().__init_subclass__(**kwargs)

    def __init__(self, config: ZooConfig) -> None:
        if not config.is_encoder_decoder:
            raise ValueError(
                f"{type(self).__name__} is the encoder-decoder of {config.model_type}, but this config has "
                f"is_encoder_decoder=False (a decoder-only language model): build it with is_encoder_decoder=True, "
                f"or load the decoder-only model with AutoModelForCausalLM."
            )
        super().__init__(config)

    def checkpoint_auto_map(self) -> dict[str, str]:
        def name(cls: type) -> str:
            return f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}"

        return {
            "AutoConfig": name(self.config_class),
            "AutoModel": name(self.model_class),
            "AutoModelForSeq2SeqLM": name(self.generation_class),
        }


def encoder_config(config: ZooConfig) -> ZooConfig:
    """The config the encoder is built from: `config` itself, or, where `encoder_num_key_value_heads` differs from the
    decoder's `num_key_value_heads`, a shallow copy with the encoder's count (one config class serves both stacks,
    and the attention modules read their head counts from the config they are built with). The copy is validated
    by the encoder as any config: a variant fixed to one count (`zoo_mqa`, `zoo_mha`) refuses another, so a decoder
    of one key/value head over a multi-head encoder is `zoo_gqa` with `num_key_value_heads=1`."""
    heads = config.encoder_num_key_value_heads
    if heads is None or heads == config.num_key_value_heads:
        return config
    copied = copy.copy(config)
    copied.num_key_value_heads = heads
    return copied


class ZooEncoderDecoderModel(SharedEmbeddingModel, ZooSeq2SeqPreTrainedModel):
    """The variant's encoder and decoder over one shared embedding, returning the decoder's last hidden states."""

    _tied_weights_keys: ClassVar[dict[str, str]] = {
        "encoder.embed_tokens.weight": "shared.weight",
        "decoder.embed_tokens.weight": "shared.weight",
    }
    sized_by: ClassVar[dict[str, str]] = {"shared": "vocab_size, hidden_size"}

    def __init__(self, config: ZooConfig) -> None:
        super().__init__(config)
        self.encoder = self.base_model_class(encoder_config(config), role="encoder")
        self.decoder = self.base_model_class(config, role="decoder")
        self.shared = self.encoder.embed_tokens  # the encoder's embedding, scaled or not by the backbone's rule
        self.decoder.embed_tokens = self.shared
        for stack in (self.encoder, self.decoder):
            stack.inside_head = True  # returns its output object whatever return_dict says
        self.post_init()

    @takes_past_key_values
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,  # consumed by @can_return_tuple: False returns a tuple
        **kwargs,
    ) -> Seq2SeqModelOutput:
        r"""
        input_ids, attention_mask: the source and its padding mask (1 for real tokens), left or right padded.
        decoder_input_ids, decoder_attention_mask: the target so far; without them, the source shifted right behind
            `decoder_start_token_id` (BART's denoising default).
        encoder_outputs: the encoder's output for these sources, reused instead of running the encoder again.
        cache (`EncoderDecoderCache`): the decoder's self-attention cache and the cross-attention's keys and values.
        """
        flags = {"output_attentions": output_attentions, "output_hidden_states": output_hidden_states}
        flags = {name: value for name, value in flags.items() if value is not None}
        if decoder_input_ids is None and decoder_inputs_embeds is None:
            if input_ids is None:
                raise ValueError("Pass decoder_input_ids (or decoder_inputs_embeds), or input_ids to shift right.")
            decoder_input_ids = shift_tokens_right(
                input_ids, self.config.pad_token_id, self.config.decoder_start_token_id
            )
        if encoder_outputs is None:
            encoder_outputs = self.encoder(
                input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, **flags, **kwargs
            )
        elif not isinstance(encoder_outputs, BaseModelOutput):
            encoder_outputs = BaseModelOutput(
                last_hidden_state=encoder_outputs[0],
                hidden_states=encoder_outputs[1] if len(encoder_outputs) > 1 else None,
                attentions=encoder_outputs[2] if len(encoder_outputs) > 2 else None,
            )
        decoder_outputs = self.decoder(
            input_ids=decoder_input_ids,
            attention_mask=decoder_attention_mask,
            encoder_hidden_states=encoder_outputs.last_hidden_state,
            encoder_attention_mask=attention_mask,
            cache=cache,
            inputs_embeds=decoder_inputs_embeds,
            use_cache=use_cache,
            **flags,
            **kwargs,
        )
        return Seq2SeqModelOutput(
            last_hidden_state=decoder_outputs.last_hidden_state,
            **{CACHE_KWARG: returned_cache(decoder_outputs)},
            decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
        )


class ZooForConditionalGeneration(TranslatorHead, ZooSeq2SeqPreTrainedModel, GenerationMixin):
    """The translator: the variant's `ZooEncoderDecoderModel` and a language-modelling head over the decoder."""

    _tied_weights_keys: ClassVar[dict[str, str]] = {"lm_head.weight": "model.shared.weight"}
    sized_by: ClassVar[dict[str, str]] = {"lm_head": "vocab_size, hidden_size"}

    def __init__(self, config: ZooConfig) -> None:
        super().__init__(config)
        self.model = self.model_class(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def make_cache(self) -> EncoderDecoderCache:
        """An empty decoding cache: the decoder's self-attention cache (the variant's) and a cross-attention cache."""
        return self.model.decoder.make_cache()

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs) -> None:
        """`generate` builds two caches from the config; the decoder's self-attention needs the variant's own (state
        layers for Linformer and AFT, as many layers as `decoder_layers`) and the cross-attention plain key/value
        layers (a sliding-window config would make them windows), so a dynamic cache is built here. Other cache
        implementations (static, quantized, offloaded) go to transformers for key/value variants and are refused
        for those that decode from a state."""
        if model_kwargs.get(CACHE_KWARG) is not None or generation_config.use_cache is False:
            return
        if generation_config.cache_implementation not in (None, "dynamic"):
            if self._is_stateful:
                raise ValueError(
                    f"{self.config.model_type} decodes from a state per layer, not from keys and values: "
                    f"cache_implementation={generation_config.cache_implementation!r} does not apply; leave it unset."
                )
            super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
            return
        model_kwargs[CACHE_KWARG] = self.make_cache()

    @takes_past_key_values
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,  # consumed by @can_return_tuple: False returns a tuple
        **kwargs,
    ) -> Seq2SeqLMOutput:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, target_length)`, *optional*): target tokens, -100 where
            ignored. Without decoder inputs they are shifted right into them (`shift_tokens_right`), as BART does; the
            loss is the mean cross-entropy over the labels that are not -100 (or their sum over
            `num_items_in_batch`, which the Trainer passes under gradient accumulation).
        """
        num_items = kwargs.pop("num_items_in_batch", None)
        if labels is not None:
            use_cache = False  # training: no decoding state to keep
            if decoder_input_ids is None and decoder_inputs_embeds is None:
                decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask,
            encoder_outputs=encoder_outputs,
            cache=cache,
            inputs_embeds=inputs_embeds,
            decoder_inputs_embeds=decoder_inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            **kwargs,
        )
        logits = self.lm_head(outputs.last_hidden_state)  # (B, T, vocab)
        loss = None
        if labels is not None:
            flat_logits, flat_labels = logits.flatten(0, 1).float(), labels.to(logits.device).flatten()  # (B*T, V)
            if num_items is None:
                loss = F.cross_entropy(flat_logits, flat_labels, ignore_index=-100)
            else:
                loss = F.cross_entropy(flat_logits, flat_labels, ignore_index=-100, reduction="sum") / num_items
        return Seq2SeqLMOutput(
            loss=loss,
            logits=logits,
            **{CACHE_KWARG: returned_cache(outputs)},
            decoder_hidden_states=outputs.decoder_hidden_states,
            decoder_attentions=outputs.decoder_attentions,
            cross_attentions=outputs.cross_attentions,
            encoder_last_hidden_state=outputs.encoder_last_hidden_state,
            encoder_hidden_states=outputs.encoder_hidden_states,
            encoder_attentions=outputs.encoder_attentions,
        )


# Registered classes count as remote code, for which `generate` reads `inspect.signature(self.forward)` at every
# decoding step: a precomputed signature makes that an attribute read.
ZooForConditionalGeneration.forward.__signature__ = inspect.signature(ZooForConditionalGeneration.forward)


def seq2seq_classes(
    model_class: type[ZooModel],
) -> tuple[type[ZooEncoderDecoderModel], type[ZooForConditionalGeneration]]:
    """The variant's encoder-decoder classes over `model_class`, for the variant file to bind under their names:
    `ZooXSeq2SeqModel, ZooXForConditionalGeneration = seq2seq_classes(ZooXModel)`.

    Built here, as `variant_heads` builds the heads, because every variant's pair is the same class body with another
    `base_model_class`; they are placed in the variant's module under those names, so that `auto_map`, remote-code
    loading, pickling and the Auto classes find them there. `model_class` learns its encoder-decoder
    (`seq2seq_model_class`), so that `AutoModel` hands it encoder-decoder configs."""
    prefix = model_class.__name__.removesuffix("Model")  # ZooMHAModel -> ZooMHA

    def build(kind: type, name: str, bases: tuple[type, ...], **namespace) -> type:
        namespace |= {
            "base_model_class": model_class,
            "__module__": model_class.__module__,
            "__qualname__": name,
            "__doc__": f"`{kind.__name__}` of `{model_class.__name__}`'s variant.",
        }
        return type(kind)(name, bases, namespace)

    base = build(ZooEncoderDecoderModel, f"{prefix}Seq2SeqModel", (ZooEncoderDecoderModel,))
    generation = build(
        ZooForConditionalGeneration,
        f"{prefix}ForConditionalGeneration",
        (ZooForConditionalGeneration, GenerationMixin),
        model_class=base,
    )
    base.model_class = generation.model_class = base
    base.generation_class = generation.generation_class = generation
    model_class.seq2seq_model_class = base
    return base, generation
