"""The decoder backbone every zoo variant shares, written once.

A variant contributes its attention module, a `ZooAttention` subclass; everything else is the backbone: the layers
(norms, the MLP, the attention protocol, the pre-norm decoder layer) in `layers_zoo.py`, and here the shared model
class (initialisation, loading, saving) and `ZooModel` (embeddings, positions, masks, layers, final norm); the
heads on it (causal LM, sequence and token classification, question answering) are in `heads_zoo.py`. The same
`ZooModel` is the encoder of an encoder-decoder (`ZooEncoder`, of `ZooEncoderLayer`s: the variant's bidirectional form)
and its decoder (`ZooDecoder`: the causal form with a cross-attention in every layer, `cross_attention_zoo.py`);
`seq2seq_zoo.py` builds a variant's two and puts them together. Module layout and parameter
names are Llama's (`model.embed_tokens`, `model.layers.N.self_attn.q_proj`, `mlp.gate_proj`, `input_layernorm`,
`lm_head`), so a Llama state dict loads unchanged into the MHA family.

The backbone talks to a variant only through the protocol declared on `ZooAttention`: its backends, how it decodes
(a key/value cache or a state layer), its mask kind, its rotary width, whether it reads positions, which config
fields size its tensors, its LoRA targets, whether it has attention weights, parameters shared by all layers. Every
answer has a default; a variant overrides what differs. The `_supports_*` flags transformers reads, `_is_stateful`,
the cache `forward` starts, the mask each layer receives and the width of RoPE all follow from it.

Positions (`positions_zoo.py`), masks (`masks_zoo.py`), the fused loss (`loss_zoo.py`), state caches
(`cache_zoo.py`), model cards (`cards_zoo.py`), checkpoint metadata (`checkpoint_zoo.py`) and fallbacks for older
transformers releases (`compat_zoo.py`) are flat siblings. This module is copied next to every saved checkpoint with
them (remote code), so it imports only torch, transformers and those siblings.
"""

import copy
import functools
import math
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_outputs import BaseModelOutputWithPast, BaseModelOutputWithPastAndCrossAttentions
from transformers.modeling_utils import PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, logging
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .cache_zoo import ZooStateCache
from .cards_zoo import write_card
from .checkpoint_zoo import ShapeCheckedLoading, auto_map_for
from .clients_zoo import VLLM_ATTENTION, cache_refusal, vllm_refusal_line
from .compat_zoo import (
    CACHE_KWARG,
    add_cache_position,
    takes_past_key_values,
)
from .configuration_zoo import ZooConfig
from .cross_attention_zoo import ZooCrossAttention, cross_attention_class
from .layers_zoo import (
    BACKENDS,
    ZooAttention,
    ZooDecoderLayer,
    ZooEncoderLayer,
    ZooLearnedPositions,
    ZooModule,
    ZooScaledEmbedding,
    make_norm,
)
from .masks_zoo import attention_mask_for, cross_attention_mask, encoder_mask_for
from .positions_zoo import ZooRotaryEmbedding, default_position_ids, sinusoidal_embedding

__all__ = ["ZooDecoder", "ZooEncoder", "ZooModel", "ZooPreTrainedModel"]

logger = logging.get_logger(__name__)


class ZooPreTrainedModel(ShapeCheckedLoading, PreTrainedModel):
    config: ZooConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["ZooDecoderLayer", "ZooEncoderLayer"]
    _skip_keys_device_placement = [CACHE_KWARG]
    # what transformers' output capturing records with output_hidden_states / output_attentions (`ZooDecoder` adds
    # the cross-attention weights)
    _can_record_outputs = {"hidden_states": ZooDecoderLayer, "attentions": ZooAttention}
    # Set on each variant's classes from its attention's `backends` (`ZooModel.__init_subclass__`)
    _supports_sdpa = False
    _supports_flash_attn = False
    _supports_flex_attn = False

    def __init__(self, config: ZooConfig, *inputs, **kwargs) -> None:
        # A config may have been mutated after construction: check it again before building anything.
        config.validate()
        if config._attn_implementation in VLLM_ATTENTION:
            # vLLM's transformers backend builds the model with its own attention function set: a variant it would
            # compute another function for stops it here, before any weight loads, saying why
            if (refusal := vllm_refusal_line(self.zoo_attention_class(), config)) is not None:
                raise ValueError(refusal)
        super().__init__(config, *inputs, **kwargs)

    @classmethod
    def zoo_attention_class(cls) -> type["ZooAttention"]:
        return cls.attention_class if issubclass(cls, ZooModel) else cls.base_model_class.attention_class

    def get_correct_attn_implementation(self, requested_attention: str | None, is_init_check: bool = False) -> str:
        """transformers' choice of backend, with the variant's own reason for a backend its kernel does not declare
        (transformers' message asks users to request support on its tracker)."""
        attention = self.zoo_attention_class()
        if requested_attention in BACKENDS and requested_attention not in attention.backends:
            raise ValueError(attention.backend_refusal(self.config, requested_attention))
        return super().get_correct_attn_implementation(requested_attention, is_init_check)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, (ZooModule, ZooCrossAttention, ZooScaledEmbedding, ZooLearnedPositions)):
            module.init_parameters(self.config)
        # GPT-2: the projections writing into the residual stream start smaller, std / sqrt(2L), so the variance of
        # the stream does not grow with depth. Decided on the projection itself, not on its decoder layer:
        # transformers never calls `_init_weights` on a module without parameters of its own for custom-code models.
        if getattr(module, "writes_residual", False) and self.config.scale_residual_init:
            std = self.config.initializer_range / math.sqrt(2 * self.config.num_hidden_layers)
            init.normal_(module.weight, mean=0.0, std=std)

    card_details: dict | None = None  # training details for the model card (set by a training run)

    def save_pretrained(self, save_directory, *args, training: dict | None = None, **kwargs):
        """`PreTrainedModel.save_pretrained`, plus an `auto_map` naming every class of the variant and the model
        card (README.md, with `training` details, or `card_details`, when given; a card already in the folder is
        kept)."""
        self.config.auto_map = self.checkpoint_auto_map()
        result = super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", args[0] if args else True):
            write_card(save_directory, self.config, training if training is not None else self.card_details)
        return result

    def checkpoint_auto_map(self) -> dict[str, str]:
        """The `auto_map` a checkpoint of this model carries: every class of the variant, for remote code."""
        return auto_map_for(type(self) if isinstance(self, ZooModel) else self.base_model_class)

    def _upload_modified_files(self, working_dir, repo_id, *args, **kwargs):
        # `push_to_hub` overwrites the README.md `save_pretrained` wrote, with the repo's card or, for a repo without
        # one, a generic template (transformers' `create_and_tag_model_card`); this hook sees the folder just before
        # the upload and puts the zoo card in place of that template.
        write_card(working_dir, self.config, repo_id=repo_id, replace_generic=True)
        return super()._upload_modified_files(working_dir, repo_id, *args, **kwargs)


def returns_output_to_its_head(forward):
    """A base model inside a head (causal LM, classifier ...) returns its output object whatever
    `config.return_dict` says: the head reads fields off it and applies `return_dict` to its own output. (Native
    transformers models break there: with `config.return_dict = False` Llama's head gets a tuple and fails.)"""

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        if self.inside_head and kwargs.get("return_dict") is None:
            kwargs["return_dict"] = True
        return forward(self, *args, **kwargs)

    return wrapper


class ZooModel(ZooPreTrainedModel):
    """Embeddings, `num_hidden_layers` decoder layers built around `attention_class`, and the final norm. A variant's
    subclass names its `config_class` and `attention_class`; transformers' backend flags follow from the latter.

    `role` is set by the variant's `ZooEncoder` and `ZooDecoder` classes: `"encoder"` builds `encoder_layers` layers of
    the variant's bidirectional form, `"decoder"` `decoder_layers` causal layers with cross-attention. Without it the
    model is the decoder-only language model, with cross-attention when the config says `add_cross_attention` (a
    decoder under another model's encoder, `EncoderDecoderModel`), or that model's encoder when the config says
    `is_decoder=False` (transformers' flag for the bidirectional form). A config with `is_encoder_decoder=True` is
    refused there, naming the encoder-decoder classes (`AutoModel` and `from_config` hand it to them)."""

    attention_class: type[ZooAttention]
    causal_lm_class = None  # the variant's ZooForCausalLM subclass, set by `ZooHead.__init_subclass__`
    seq2seq_model_class = None  # the variant's encoder-decoder base model, set by `seq2seq_zoo`
    encoder_class = None  # the variant's `ZooEncoder` and `ZooDecoder` classes, set by `seq2seq_zoo`
    decoder_class = None
    heads: ClassVar[dict[str, type]] = {}  # auto class name -> this variant's head of that kind (a `ZooHead`)
    inside_head = False  # set on the instance a head builds (see `returns_output_to_its_head`)
    sized_by: ClassVar[dict[str, str]] = {
        "embed_tokens": "vocab_size, hidden_size",
        "embed_positions": "max_position_embeddings, hidden_size",
        "norm": "hidden_size",
    }

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.heads = {}  # each variant lists its own heads
        attention = cls.__dict__.get("attention_class")
        if attention is not None:
            unknown = set(attention.backends) - set(BACKENDS)
            if unknown or "eager" not in attention.backends:
                raise TypeError(f"{attention.__name__}.backends={attention.backends}: eager and any of {BACKENDS}")
            cls._supports_sdpa = "sdpa" in attention.backends
            cls._supports_flash_attn = "flash_attention_2" in attention.backends
            cls._supports_flex_attn = "flex_attention" in attention.backends
            cls._supports_attention_backend = len(attention.backends) > 1  # goes through ALL_ATTENTION_FUNCTIONS
            cls._can_compile_fullgraph = attention.compiles_fullgraph

    def __init__(self, config: ZooConfig, role: str | None = None) -> None:
        if role is None and config.is_encoder_decoder:
            raise ValueError(self.encoder_decoder_refusal(config))
        if role is None and not config.is_decoder:
            role = "encoder" if not config.add_cross_attention else None  # a cross-attending model is a decoder
        if role not in (None, "encoder", "decoder"):
            raise ValueError(
                f"role={role!r}: a ZooModel is built as an 'encoder', a 'decoder' or (None) decoder-only."
            )
        if role == "encoder" and (refusal := self.attention_class.bidirectional_refusal(config)) is not None:
            raise ValueError(refusal)
        super().__init__(config)
        self.is_encoder = role == "encoder"
        num_layers = config.num_hidden_layers
        if config.is_encoder_decoder:  # encoder_layers / decoder_layers, unless unset (switched after construction)
            num_layers = getattr(config, f"{role}_layers") or num_layers
        has_cross = role == "decoder" or (role is None and config.add_cross_attention)
        self.padding_idx = config.pad_token_id
        # read once: config attribute access is slow, and the forward runs once per generated token
        self.position_embedding_type = position_type = config.position_embedding_type
        scaled = bool(config.scale_embedding)  # Vaswani's sqrt(d), opt-in: see ZooScaledEmbedding
        embedding = ZooScaledEmbedding if scaled else nn.Embedding
        self.sinusoid_amplitude = config.sinusoid_amplitude  # read once, as the position type
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.embed_positions = (
            ZooLearnedPositions(config.max_position_embeddings, config.hidden_size)
            if position_type == "learned"
            else None
        )
        self.rotary_emb = (
            ZooRotaryEmbedding(config, self.attention_class.rotary_dim(config)) if position_type == "rope" else None
        )
        self.layers = nn.ModuleList(
            [
                ZooEncoderLayer(config, layer_idx, self.attention_class)
                if self.is_encoder
                else ZooDecoderLayer(config, layer_idx, self.attention_class, has_cross)
                for layer_idx in range(num_layers)
            ]
        )
        self.cross_attention_class = cross_attention_class(config) if has_cross else None
        self.norm = make_norm(config)
        self.gradient_checkpointing = False
        self.attention_class.share_across_layers(self)
        self.post_init()

    def make_cache(self) -> Cache:
        """The cache `forward` (and `generate`) starts when none is given: transformers' key/value layers
        (sliding-window ones when the config has `sliding_window`), or the variant's state layers; with
        cross-attention, that as the self-attention cache of an `EncoderDecoderCache` whose cross-attention cache
        (plain key/value layers, whatever the variant) the first step fills."""
        num_layers = len(self.layers)
        if self.attention_class.decodes_from_state():
            cache = ZooStateCache(num_layers, self.attention_class.cache_layer)
        else:
            config = self.config
            if num_layers != config.num_hidden_layers:  # a decoder of `decoder_layers`: transformers sizes by this
                config = copy.copy(config)
                config.num_hidden_layers = num_layers
            cache = self.attention_class.key_value_cache(config)
        return cache if self.cross_attention_class is None else EncoderDecoderCache(cache, DynamicCache())

    @classmethod
    def encoder_decoder_refusal(cls, config: ZooConfig) -> str:
        names = "its encoder-decoder classes"
        if cls.seq2seq_model_class is not None:
            names = (
                f"{cls.seq2seq_model_class.__name__} (AutoModel) or "
                f"{cls.seq2seq_model_class.generation_class.__name__} (AutoModelForSeq2SeqLM)"
            )
        return (
            f"this {config.model_type} config has is_encoder_decoder=True, which {cls.__name__} (the decoder-only "
            f"model, and the causal LM over it) does not build: load it with {names}, or set is_encoder_decoder=False "
            f"for a decoder-only language model."
        )

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """As `ZooPreTrainedModel.from_pretrained`; an encoder-decoder checkpoint's config (`AutoModel` passes it)
        loads the variant's encoder-decoder base model, as `AutoModel` gives BART's for a BART checkpoint."""
        config = kwargs.get("config")
        if isinstance(config, PreTrainedConfig) and config.is_encoder_decoder and cls.seq2seq_model_class is not None:
            return cls.seq2seq_model_class.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)

    @classmethod
    def _from_config(cls, config: ZooConfig, **kwargs):
        if config.is_encoder_decoder and cls.seq2seq_model_class is not None:  # AutoModel.from_config
            return cls.seq2seq_model_class._from_config(config, **kwargs)
        if config.add_cross_attention and cls.decoder_class is not None and cls is not cls.decoder_class:
            return cls.decoder_class._from_config(config, **kwargs)  # records the cross-attention weights
        return super()._from_config(config, **kwargs)

    @takes_past_key_values
    @returns_output_to_its_head
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast | BaseModelOutputWithPastAndCrossAttentions:
        r"""
        encoder_hidden_states (`torch.Tensor` of shape `(batch_size, source_length, hidden_size)`, *optional*):
            The encoder's outputs, which the cross-attention of every layer reads (a model with cross-attention only;
            once a cache holds their keys and values they may be left out).
        encoder_attention_mask (`torch.Tensor` of shape `(batch_size, source_length)`, *optional*):
            The source's padding mask (1 for real tokens): padded source tokens are never attended to.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)  # (B, T, d)
        if self.is_encoder:
            return self._encode(inputs_embeds, attention_mask, position_ids, **kwargs)
        if encoder_hidden_states is not None and self.cross_attention_class is None:
            raise ValueError(
                f"encoder_hidden_states were given, but this {self.config.model_type} model has no cross-attention: "
                f"build it with add_cross_attention=True (and is_decoder=True) to attend to an encoder."
            )
        if use_cache and cache is None:
            cache = self.make_cache()
        full_cache, cross_cache = cache, None
        if isinstance(cache, EncoderDecoderCache):  # the variant's layers see their own; cross-attention the whole
            cross_cache, cache = cache, cache.self_attention_cache
        if cache is not None:
            self._check_cache(cache)
        add_cache_position(kwargs, cache, inputs_embeds)
        if position_ids is None:
            # the cache's length is read only here, as in Llama: continuous batching gives positions with a paged
            # cache that has no single length
            past_length = cache.get_seq_length() if cache is not None else 0
            position_ids = default_position_ids(inputs_embeds, attention_mask, past_length, self.counts_real_tokens)
        hidden_states, position_embeddings = self._add_positions(inputs_embeds, position_ids)

        # a flag left at None falls back to the config, as in transformers; kernels read the resolved value
        if kwargs.get("output_attentions") is None:
            kwargs["output_attentions"] = self.config.output_attentions
        if kwargs["output_attentions"] and (absent := self.attention_class.attention_weights_absence(self.config)):
            logger.warning_once(
                f"output_attentions=True, but {self.config.model_type} has no attention weights to return: {absent}; "
                f"the output's `attentions` stays empty."
            )
        if self.config._attn_implementation in VLLM_ATTENTION:
            # vLLM's attention masks by itself, from the requests it packed into this one row and its paged cache
            causal_mask = None
        else:
            causal_mask = attention_mask_for(
                self.attention_class,
                self.config,
                inputs_embeds,
                attention_mask,
                cache,
                position_ids,
                kwargs["output_attentions"],
            )

        cross = {}
        if self.cross_attention_class is not None:
            cross = self._cross_inputs(inputs_embeds, encoder_hidden_states, encoder_attention_mask, cross_cache)
        encoder_hidden_states = cross.pop("encoder_hidden_states", None)

        for decoder_layer in self.layers:
            # the tensors that carry gradients positionally, as BART passes them (see `ZooDecoderLayer.forward`)
            hidden_states = decoder_layer(
                hidden_states,
                causal_mask,
                encoder_hidden_states,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                **{CACHE_KWARG: cache},
                **cross,
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        if self.cross_attention_class is None:
            return BaseModelOutputWithPast(last_hidden_state=hidden_states, **{CACHE_KWARG: cache})
        # the cross-attention weights are filled in by output capturing where they are recorded (`ZooDecoder`)
        return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=hidden_states, **{CACHE_KWARG: full_cache})

    def _cross_inputs(
        self,
        inputs_embeds: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None,
        encoder_attention_mask: torch.Tensor | None,
        cross_cache: EncoderDecoderCache | None,
    ) -> dict:
        """What every layer's cross-attention reads: the encoder's outputs, their mask, the cache holding their keys
        and values."""
        source = encoder_hidden_states
        if source is None:
            if cross_cache is None or not cross_cache.is_updated.get(0):
                raise ValueError(
                    f"this {self.config.model_type} decoder attends to an encoder: pass encoder_hidden_states (or "
                    f"encoder_outputs to the encoder-decoder)."
                )
            source = cross_cache.cross_attention_cache.layers[0].keys[:, 0]  # (B, S, width): the source's length
        if source.shape[0] != inputs_embeds.shape[0]:
            raise ValueError(
                f"encoder_hidden_states hold {source.shape[0]} sources for {inputs_embeds.shape[0]} target rows; "
                f"give one source per row."
            )
        if encoder_hidden_states is not None and encoder_hidden_states.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"encoder_hidden_states are {encoder_hidden_states.shape[-1]} wide, but the cross-attention reads "
                f"hidden_size={self.config.hidden_size}; project them (EncoderDecoderModel's enc_to_dec_proj does) or "
                f"build the decoder with the encoder's hidden_size."
            )
        if encoder_attention_mask is not None and encoder_attention_mask.shape[-1] != source.shape[1]:
            raise ValueError(
                f"encoder_attention_mask covers {encoder_attention_mask.shape[-1]} source tokens, but the encoder "
                f"outputs hold {source.shape[1]}; pass the source's own attention_mask."
            )
        mask = cross_attention_mask(
            self.cross_attention_class.mask_kind, self.config, inputs_embeds, source, encoder_attention_mask
        )
        return {
            "encoder_hidden_states": encoder_hidden_states,
            "cross_attention_mask": mask,
            "cross_cache": cross_cache,
        }

    def _encode(
        self,
        inputs_embeds: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.LongTensor | None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """The encoder's forward: every layer in the variant's bidirectional form over the whole source, no cache."""
        if attention_mask is not None and tuple(attention_mask.shape) != tuple(inputs_embeds.shape[:2]):
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)}, but the source is "
                f"{tuple(inputs_embeds.shape[:2])} (batch, source length): pass the source's own padding mask."
            )
        if position_ids is None:
            position_ids = default_position_ids(inputs_embeds, attention_mask, 0, self.counts_real_tokens)
        hidden_states, position_embeddings = self._add_positions(inputs_embeds, position_ids)
        if kwargs.get("output_attentions") is None:
            kwargs["output_attentions"] = self.config.output_attentions
        mask = encoder_mask_for(self.attention_class, self.config, inputs_embeds, attention_mask, position_ids)
        for layer in self.layers:
            hidden_states = layer(
                hidden_states,
                mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                **kwargs,
            )
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states))

    @property
    def counts_real_tokens(self) -> bool:
        """Whether default positions count real tokens only (absolute positions, ALiBi, kernels that index
        parameters by position), so that a left-padded row sees what it sees alone."""
        return self.attention_class.reads_positions or self.position_embedding_type in (
            "alibi",
            "sinusoidal",
            "learned",
        )

    def _add_positions(
        self, inputs_embeds: torch.Tensor, position_ids: torch.LongTensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """The first layer's input (absolute positions added, embedding dropout) and RoPE's (cos, sin) or None."""
        hidden_states = inputs_embeds
        if self.position_embedding_type == "learned":
            self._check_learned_positions(position_ids)
            hidden_states = hidden_states + self.embed_positions(position_ids)
        elif self.position_embedding_type == "sinusoidal":
            sinusoids = sinusoidal_embedding(position_ids, self.config.hidden_size, hidden_states.dtype)
            hidden_states = hidden_states + self.sinusoid_amplitude * sinusoids
        if self.training and self.config.hidden_dropout:
            hidden_states = F.dropout(hidden_states, self.config.hidden_dropout, training=True)
        position_embeddings = self.rotary_emb(hidden_states, position_ids) if self.rotary_emb is not None else None
        return hidden_states, position_embeddings

    def _check_cache(self, cache: Cache) -> None:
        """Refuse, before any layer runs, a cache built outside the model that cannot hold this variant's (the
        reasons are in `clients_zoo.cache_refusal`)."""
        if (refusal := cache_refusal(self.attention_class, self.config, cache)) is not None:
            raise TypeError(refusal)

    def _check_learned_positions(self, position_ids: torch.LongTensor) -> None:
        if torch.compiler.is_compiling():
            return
        longest = int(position_ids.max())
        if longest >= self.config.max_position_embeddings:
            raise ValueError(
                f"position {longest} is beyond max_position_embeddings={self.config.max_position_embeddings} of the "
                f"learned position table; shorten the input or build the model with a larger max_position_embeddings."
            )


class ZooEncoder:
    """A variant's encoder, as BART's `BartEncoder`: the embeddings, `encoder_layers` `ZooEncoderLayer`s of the
    variant's bidirectional form, the final norm. `seq2seq_classes` builds it per variant over the variant's
    `ZooModel` (`ZooXEncoder(ZooEncoder, ZooXModel)`).

    It is also the encoder alone, as transformers' `T5EncoderModel` (`AutoModelForTextEncoding`): `from_pretrained`
    of a translator checkpoint loads the encoder's weights out of it (`model.encoder.*`, the embedding from
    `model.shared`), for embeddings and feature extraction."""

    # a translator checkpoint's names for the encoder's tensors; its decoder and head are not the encoder's
    translator_key_mapping: ClassVar[dict[str, str]] = {r"^model\.encoder\.": "", r"^model\.shared\.": "embed_tokens."}
    _keys_to_ignore_on_load_unexpected: ClassVar[list[str]] = [r"^model\.decoder\.", r"^lm_head\."]

    def __init__(self, config: ZooConfig) -> None:
        ZooModel.__init__(self, config, role="encoder")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        kwargs.setdefault("key_mapping", cls.translator_key_mapping)
        return ZooPreTrainedModel.from_pretrained.__func__(cls, pretrained_model_name_or_path, *model_args, **kwargs)

    @classmethod
    def _from_config(cls, config: ZooConfig, **kwargs):
        return ZooPreTrainedModel._from_config.__func__(cls, config, **kwargs)


class ZooDecoder:
    """A variant's decoder in an encoder-decoder, as BART's `BartDecoder`: the variant's causal layers, each with the
    cross-attention `config.cross_attention` declares, over `decoder_layers` layers; also the decoder of a
    cross-attending causal LM (`add_cross_attention=True`, under transformers' `EncoderDecoderModel`). Its
    cross-attention weights are recorded as transformers records BART's (`OutputRecorder` on `encoder_attn`).
    `seq2seq_classes` builds it per variant (`ZooXDecoder(ZooDecoder, ZooXModel)`)."""

    _can_record_outputs: ClassVar[dict] = {
        **ZooPreTrainedModel._can_record_outputs,
        "cross_attentions": OutputRecorder(ZooCrossAttention, index=1, layer_name="encoder_attn"),
    }

    def __init__(self, config: ZooConfig) -> None:
        ZooModel.__init__(self, config, role="decoder")

    def unwindowed_config(self) -> ZooConfig:
        """The config without a sliding window: what a cross-attention cache built from a config is built from."""
        config = copy.copy(self.config)
        config.sliding_window = None
        return config
