"""What every zoo translator shares, whichever network it runs (the Transformer encoder-decoders of `seq2seq_zoo.py`,
the RNN translator of `rnn.py`), laid out as BART's: decoder inputs shifted from the labels; the bare model
(`ZooTranslatorModel`: three embeddings `shared`, `encoder.embed_tokens`, `decoder.embed_tokens` tied to one tensor,
the encoder run once, the decoder over its outputs, one `Seq2SeqModelOutput`); and the generation head
(`ZooTranslatorForConditionalGeneration`: `lm_head`, the loss, one `Seq2SeqLMOutput`, the decoding cache `generate`
starts).

A family's bare model provides `encoder` (a module returning `BaseModelOutput`) and `decoder` (a module taking
`input_ids`, `attention_mask`, `encoder_hidden_states`, `encoder_attention_mask`, `cache`, `inputs_embeds`,
`use_cache` and the output flags, returning `BaseModelOutputWithPastAndCrossAttentions`, and building its empty cache
with `make_cache()`); everything else is here. This module is copied next to their checkpoints (remote code), so it
imports only torch, transformers and its flat siblings.
"""

import inspect
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache, StaticCache
from transformers.modeling_outputs import BaseModelOutput, Seq2SeqLMOutput, Seq2SeqModelOutput
from transformers.utils import can_return_tuple

from .compat_zoo import CACHE_KWARG, returned_cache, takes_past_key_values

__all__ = ["ZooTranslatorForConditionalGeneration", "ZooTranslatorModel", "shift_tokens_right"]


def shift_tokens_right(
    input_ids: torch.Tensor, pad_token_id: int | None, decoder_start_token_id: int | None
) -> torch.Tensor:
    """BART's decoder inputs from labels: `decoder_start_token_id`, then the labels but the last, -100 as padding."""
    if decoder_start_token_id is None:
        raise ValueError(
            "decoder_start_token_id is not set: the decoder's inputs start with it (labels are shifted right behind "
            "it); set config.decoder_start_token_id (BART uses eos, T5 and Marian pad)."
        )
    if pad_token_id is None:
        raise ValueError(
            "pad_token_id is not set: label positions ignored as -100 become padding in the decoder's inputs; set "
            "config.pad_token_id."
        )
    shifted = input_ids.new_zeros(input_ids.shape)  # (B, T)
    shifted[:, 1:] = input_ids[:, :-1].clone()
    shifted[:, 0] = decoder_start_token_id
    return shifted.masked_fill(shifted == -100, pad_token_id)


def as_encoder_output(encoder_outputs: BaseModelOutput | tuple) -> BaseModelOutput:
    """`encoder_outputs` given as a tuple (last hidden state, hidden states, attentions), as a `BaseModelOutput`."""
    if isinstance(encoder_outputs, BaseModelOutput):
        return encoder_outputs
    return BaseModelOutput(
        last_hidden_state=encoder_outputs[0],
        hidden_states=encoder_outputs[1] if len(encoder_outputs) > 1 else None,
        attentions=encoder_outputs[2] if len(encoder_outputs) > 2 else None,
    )


class ZooTranslatorModel:
    """The bare translator, a mixin of a `PreTrainedModel` that builds `shared`, `encoder` and `decoder`.

    Source and target share one vocabulary, as BART's and Marian's do: three embedding modules, `shared`,
    `encoder.embed_tokens` and `decoder.embed_tokens`, whose weights transformers ties (`_tied_weights_keys`), so a
    checkpoint names the tensor once (`shared.weight`), a checkpoint without it reports it missing, and one written
    with a name per tensor (safetensors' `save_model`) loads. The tie holds whatever `tie_word_embeddings` says (that
    flag is about the output head): the zoo's translators have always had one embedding for both sides."""

    shared: nn.Embedding
    encoder: nn.Module
    decoder: nn.Module
    _tied_weights_keys: ClassVar[dict[str, str]] = {
        "encoder.embed_tokens.weight": "shared.weight",
        "decoder.embed_tokens.weight": "shared.weight",
    }
    sized_by: ClassVar[dict[str, str]] = {"shared": "vocab_size, hidden_size"}

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict:
        # transformers ties nothing when `tie_word_embeddings` is False; the source and target embeddings are one
        # vocabulary's in every zoo translator, with or without a tied head
        return super().get_expanded_tied_weights_keys(all_submodels) | (
            {} if all_submodels else dict(self._tied_weights_keys)
        )

    def get_input_embeddings(self) -> nn.Embedding:
        return self.shared

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.shared = self.encoder.embed_tokens = self.decoder.embed_tokens = value  # as BART's set_input_embeddings

    def get_encoder(self) -> nn.Module:
        return self.encoder

    def get_decoder(self) -> nn.Module:
        return self.decoder

    def make_cache(self) -> Cache:
        """An empty decoding cache, the decoder's own: the first forward fills it."""
        return self.decoder.make_cache()

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
        cache: the decoder's decoding cache (`model.make_cache()`); once filled, the source may be left out.
        """
        flags = {"output_attentions": output_attentions, "output_hidden_states": output_hidden_states}
        flags = {name: value for name, value in flags.items() if value is not None}
        if decoder_input_ids is None and decoder_inputs_embeds is None:
            if input_ids is None:
                raise ValueError("Pass decoder_input_ids (or decoder_inputs_embeds), or input_ids to shift right.")
            decoder_input_ids = shift_tokens_right(
                input_ids, self.config.pad_token_id, self.config.decoder_start_token_id
            )
        no_source = input_ids is None and inputs_embeds is None
        if encoder_outputs is not None:
            encoder_outputs = as_encoder_output(encoder_outputs)
        elif not (no_source and cache is not None and cache.get_seq_length() > 0):  # a filled cache holds the source
            encoder_outputs = self.encoder(
                input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, **flags, **kwargs
            )
        decoder_outputs = self.decoder(
            input_ids=decoder_input_ids,
            attention_mask=decoder_attention_mask,
            encoder_hidden_states=encoder_outputs.last_hidden_state if encoder_outputs is not None else None,
            encoder_attention_mask=attention_mask,
            cache=cache,
            inputs_embeds=decoder_inputs_embeds,
            use_cache=use_cache,
            **flags,
            **kwargs,
        )
        encoder_outputs = encoder_outputs if encoder_outputs is not None else BaseModelOutput()
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


def unwindowed_cross_attention_cache(cache: EncoderDecoderCache, config, source_length: int) -> None:
    """Put a cross-attention cache of full layers into `cache` where transformers built it from the decoder's config
    and so, for a sliding-window config, of window layers that would keep only the last `sliding_window` source
    tokens: the cross-attention reads the whole source, whatever the self-attention's cache is."""
    cross = cache.cross_attention_cache
    if not any(getattr(layer, "is_sliding", False) for layer in cross.layers):
        return
    offloading = getattr(cross, "offloading", False)
    if isinstance(cross, StaticCache):  # sized for the source, as transformers sizes it
        cache.cross_attention_cache = StaticCache(config=config, max_cache_len=source_length, offloading=offloading)
    else:
        cache.cross_attention_cache = DynamicCache(offloading=offloading)


class ZooTranslatorForConditionalGeneration:
    """The generation head, a mixin of a `PreTrainedModel` + `GenerationMixin` over a `ZooTranslatorModel`
    (`self.model`, built from `model_class`) with a language-modelling head (`lm_head`, tied to `model.shared` with
    `tie_word_embeddings`)."""

    model_class: ClassVar[type]
    model: ZooTranslatorModel
    lm_head: nn.Linear
    _tied_weights_keys: ClassVar[dict[str, str]] = {"lm_head.weight": "model.shared.weight"}
    sized_by: ClassVar[dict[str, str]] = {"lm_head": "vocab_size, hidden_size"}

    def __init__(self, config) -> None:
        super().__init__(config)
        self.model = self.model_class(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.shared

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.set_input_embeddings(value)

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def get_encoder(self) -> nn.Module:
        return self.model.encoder

    def get_decoder(self) -> nn.Module:
        return self.model.decoder

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        return shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id)

    def make_cache(self) -> Cache:
        """An empty decoding cache, the decoder's own: the first forward fills it."""
        return self.model.make_cache()

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs) -> None:
        """`generate` builds key/value caches from the config. The decoder's own (`make_cache`: state layers for a
        model that decodes from a state, as many layers as the decoder has, a cross-attention cache of full layers)
        is started here for the default (dynamic) cache; other implementations (static, quantized, offloaded) go to
        transformers for key/value decoders, with the cross-attention cache's layers made full, and are refused for
        those that decode from a state."""
        cache = model_kwargs.get(CACHE_KWARG)
        if cache is not None:  # checked by the decoder at the first step
            cache._is_user_defined = True  # returned by generate, as transformers does for a cache it was given
            return
        if generation_config.use_cache is False:
            return
        if generation_config.cache_implementation in (None, "dynamic"):
            model_kwargs[CACHE_KWARG] = self.make_cache()
            return
        if self._is_stateful:
            raise ValueError(
                f"{self.config.model_type} decodes from a state, not from keys and values: cache_implementation="
                f"{generation_config.cache_implementation!r} does not apply; leave it unset."
            )
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        if isinstance(cache := model_kwargs.get(CACHE_KWARG), EncoderDecoderCache):
            source_length = model_kwargs["encoder_outputs"][0].shape[1]
            unwindowed_cross_attention_cache(cache, self.model.decoder.unwindowed_config(), source_length)

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
ZooTranslatorForConditionalGeneration.forward.__signature__ = inspect.signature(
    ZooTranslatorForConditionalGeneration.forward
)
