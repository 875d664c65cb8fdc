"""The Transformer encoder-decoder of every zoo variant, written once: `ZooEncoderDecoderModel` (the bare model,
`AutoModel`) and `ZooForConditionalGeneration` (with the language-modelling head, `AutoModelForSeq2SeqLM`), both made
of what every translator shares (`translator_zoo.py`), and `seq2seq_classes`, which builds a variant's translator
classes (its encoder `ZooXEncoder`, its decoder `ZooXDecoder`, the two above) from its `ZooModel` subclass.

Vaswani et al. 2017 (arXiv 1706.03762): an encoder of bidirectional self-attention layers reads the source; a decoder
of masked (causal) self-attention layers, each with a cross-attention over the encoder's outputs, writes the target.
Here both stacks are the variant's own `ZooModel`: `ZooXEncoder` of `ZooEncoderLayer`s (its bidirectional form: the MHA
family and differential and MLA attention unmasked, sliding window as a two-sided band, top-k and additive over every
key, Linformer's paper form, AFT's non-causal form) and `ZooXDecoder` (its causal form, plus the cross-attention
`config.cross_attention` declares, `cross_attention_zoo.py`). One config class per variant serves both shapes, as
BART's does: `is_encoder_decoder=True` makes this model; `encoder_layers` / `decoder_layers` size the stacks.

Names follow BART/Marian: `model.shared` (one embedding for source and target, tied to `model.encoder.embed_tokens`
and `model.decoder.embed_tokens`, and to `lm_head` with
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
from typing import ClassVar

from transformers.generation import GenerationMixin

from .configuration_zoo import ZooConfig
from .heads_zoo import VariantClass, variant_class
from .modeling_zoo import ZooDecoder, ZooEncoder, ZooModel, ZooPreTrainedModel
from .translator_zoo import ZooTranslatorForConditionalGeneration, ZooTranslatorModel, shift_tokens_right

__all__ = [
    "ZooEncoderDecoderModel",
    "ZooForConditionalGeneration",
    "ZooSeq2SeqPreTrainedModel",
    "seq2seq_classes",
    "shift_tokens_right",
]


class ZooSeq2SeqPreTrainedModel(VariantClass, ZooPreTrainedModel):
    """What the two encoder-decoder classes of a variant share: the variant (`base_model_class`, its decoder-only
    `ZooModel`, whose config class and backend flags they take), the refusal of a decoder-only config, and the
    checkpoint's `auto_map`."""

    base_model_class: type[ZooModel]
    # the variant's bare encoder-decoder and the one with the head (set by `seq2seq_classes`; plain `type`:
    # transformers evaluates the class annotations when the class is created)
    model_class: ClassVar[type]
    generation_class: ClassVar[type]
    config_defaults: ClassVar[dict] = {"is_encoder_decoder": True}  # what the registry's `config()` adds

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
            "AutoModelForTextEncoding": name(self.base_model_class.encoder_class),
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


class ZooEncoderDecoderModel(ZooTranslatorModel, ZooSeq2SeqPreTrainedModel):
    """The variant's encoder (`ZooXEncoder`) and decoder (`ZooXDecoder`) over one vocabulary, returning the decoder's
    last hidden states."""

    def __init__(self, config: ZooConfig) -> None:
        super().__init__(config)
        self.encoder = self.base_model_class.encoder_class(encoder_config(config))
        self.decoder = self.base_model_class.decoder_class(config)
        # the embedding of the encoder's kind (scaled or not by the backbone's rule), tied to both sides'
        self.shared = copy.deepcopy(self.encoder.embed_tokens)
        for stack in (self.encoder, self.decoder):
            stack.inside_head = True  # returns its output object whatever return_dict says
        self.post_init()


class ZooForConditionalGeneration(ZooTranslatorForConditionalGeneration, ZooSeq2SeqPreTrainedModel, GenerationMixin):
    """The translator: the variant's `ZooEncoderDecoderModel` and a language-modelling head over the decoder."""


def seq2seq_classes(model_class: type[ZooModel]) -> tuple[type, type, type[ZooEncoderDecoderModel], type]:
    """The variant's translator classes over `model_class`, for the variant file to bind under their names:
    `ZooXEncoder, ZooXDecoder, ZooXSeq2SeqModel, ZooXForConditionalGeneration = seq2seq_classes(ZooXModel)` (the
    encoder and the decoder are also set on `model_class`, as `encoder_class` and `decoder_class`).

    Built by `variant_class`, as `variant_heads` builds the heads: every variant's classes are the same class body
    with another `base_model_class`. `model_class` learns its encoder-decoder (`seq2seq_model_class`), so that
    `AutoModel` hands it encoder-decoder configs."""
    model_class.encoder_class = variant_class(ZooEncoder, model_class, "Encoder")
    model_class.decoder_class = variant_class(ZooDecoder, model_class, "Decoder")
    base = variant_class(ZooEncoderDecoderModel, model_class, "Seq2SeqModel")
    generation = variant_class(ZooForConditionalGeneration, model_class, "ForConditionalGeneration", model_class=base)
    base.model_class = generation.model_class = base
    base.generation_class = generation.generation_class = generation
    model_class.seq2seq_model_class = base
    return model_class.encoder_class, model_class.decoder_class, base, generation
