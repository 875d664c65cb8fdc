"""The decoder backbone every zoo variant shares, written once.

A variant contributes its attention module, a `ZooAttention` subclass; everything else is here, in the order of a
forward pass: norms, the MLP, the attention protocol, the pre-norm decoder layer, the shared model class
(initialisation, loading, saving) and `ZooModel` (embeddings, positions, masks, layers, final norm); the heads on it
(causal LM, sequence and token classification, question answering) are in `heads_zoo.py`. The same `ZooModel` is the
encoder of an encoder-decoder (`role="encoder"`: the variant's bidirectional form) and its decoder (`role="decoder"`:
the causal form with a cross-attention in every layer, `cross_attention_zoo.py`); `seq2seq_zoo.py` puts the two
together. Module layout and parameter
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
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.configuration_utils import PreTrainedConfig
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import (
    GradientCheckpointingLayer,
)
from transformers.modeling_outputs import BaseModelOutputWithPast, BaseModelOutputWithPastAndCrossAttentions
from transformers.modeling_utils import PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, logging
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .cache_zoo import ZooStateCache
from .cards_zoo import write_card
from .checkpoint_zoo import ShapeCheckedLoading, auto_map_for
from .clients_zoo import attribute_refusal, cache_refusal
from .compat_zoo import (
    CACHE_KWARG,
    add_cache_position,
    takes_past_key_values,
)
from .configuration_zoo import ZooConfig
from .cross_attention_zoo import ZooCrossAttention, cross_attention_class
from .masks_zoo import attention_mask_for, cross_attention_mask, encoder_mask_for
from .positions_zoo import ZooRotaryEmbedding, default_position_ids, sinusoidal_embedding

__all__ = [
    "ZooAttention",
    "ZooDecoderLayer",
    "ZooMLP",
    "ZooModel",
    "ZooModule",
    "ZooPreTrainedModel",
    "ZooRMSNorm",
]

logger = logging.get_logger(__name__)

BACKENDS = ("eager", "sdpa", "flash_attention_2", "flex_attention")  # transformers' `ALL_ATTENTION_FUNCTIONS`


class ZooRMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), as Llama's, on torch's fused kernel."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(hidden_states, self.weight.shape, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class ZooScaledEmbedding(nn.Embedding):
    """Token embeddings times sqrt(d), as Vaswani et al. (2017) scale them under sinusoidal positions: sinusoids of
    amplitude 1 would otherwise drown embeddings initialised at std `initializer_range` (0.02). The scale lives in
    the module, so `get_input_embeddings()(input_ids)` passed as `inputs_embeds` equals passing `input_ids`."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, padding_idx)
        self.embed_scale = math.sqrt(embedding_dim)

    def forward(self, input_ids: torch.LongTensor) -> torch.Tensor:
        return super().forward(input_ids) * self.embed_scale


def make_norm(config: ZooConfig) -> nn.Module:
    if config.norm_type == "layernorm":
        return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
    return ZooRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class ZooModule(nn.Module):
    """A zoo module with parameters that are not Linear, Embedding or norm weights (score vectors, Linformer's E and
    F): `_init_weights` calls its `init_parameters`. Every module also names the config fields that size its direct
    children's tensors (`sized_by`), so that a checkpoint that does not fit its config is reported with the fields
    to fix."""

    sized_by: ClassVar[dict[str, str]] = {}

    def init_parameters(self, config: ZooConfig) -> None:
        """Initialise the parameters transformers' `_init_weights` does not know; nothing by default."""


class ZooMLP(ZooModule):
    """Position-wise feed-forward: gated `down(act(gate(x)) * up(x))` (Llama's SwiGLU) or plain `down(act(up(x)))`."""

    sized_by: ClassVar[dict[str, str]] = dict.fromkeys(
        ("gate_proj", "up_proj", "down_proj"), "intermediate_size, hidden_size"
    )
    lora_targets: ClassVar[tuple[str, ...]] = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, config: ZooConfig) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, inner, bias=bias) if config.mlp_type == "gated" else None
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is None:
            return self.down_proj(self.act_fn(self.up_proj(x)))
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class ZooAttention(ZooModule):
    """Base of every variant's token mixer, and the protocol through which the backbone asks a variant what it needs.

    Contract: `forward(hidden_states, attention_mask, position_embeddings, cache, **kwargs)` maps
    `(B, T, hidden_size)` to `(output (B, T, hidden_size), attention weights (B, H, T, S) or None)`. It writes its
    cache with `cache.update(..., self.layer_idx)` (or into its state layer) and ends with `o_proj`, the
    projection back into the residual stream (GPT-2's scaled init applies to it). `position_embeddings` is Llama's RoPE
    `(cos, sin)` pair for `apply_rotary` at width `rotary_dim(config)` when `position_embedding_type ==
    "rope"`, else None; ALiBi arrives inside `attention_mask`; `position_ids` (true positions) and the resolved
    `output_attentions` come in `kwargs`.
    """

    # The variant's family: the module it lives in (the MHA family shares Llama's layout and converts to and from it)
    family: ClassVar[str] = ""
    # Backends of transformers' `ALL_ATTENTION_FUNCTIONS` the kernel runs through; kernels of their own say "eager"
    backends: ClassVar[tuple[str, ...]] = ("eager",)
    # A static-cache decode step compiles to one graph (caches written in place, masks of fixed shape)
    compiles_fullgraph: ClassVar[bool] = False
    # None: keys and values in transformers' DynamicCache; else the class of the state layer it decodes from
    cache_layer: ClassVar[type | None] = None
    # What the backbone builds for `attention_mask` (`masks_zoo`): "dense", "blockwise" or "tokens"
    mask_type: ClassVar[str] = "dense"
    dense_mask_function = staticmethod(create_causal_mask)  # transformers' builder for the dense kind
    # True when the kernel indexes parameters by position (Linformer's E, AFT's bias): positions are then always
    # counted over real tokens, as for absolute position embeddings
    reads_positions: ClassVar[bool] = False
    # The outputs it returns with `output_attentions`: softmax weights whose rows sum to one, unless declared
    attention_weights_sum_to_one: ClassVar[bool] = True
    # Facts about the math that clients of the cache and the kernel depend on (`clients_zoo` derives their refusals):
    # what a layer caches per token when it is not per-head keys and values (a phrase), else None
    caches: ClassVar[str | None] = None
    # query/key maps per head (softmax maps combined per head; differential attention's two)
    maps_per_head: ClassVar[int] = 1
    # the score of a query and a key when it is not their scaled dot product (a formula), else None
    scores: ClassVar[str | None] = None
    # which of a query's visible scores reach the softmax when not all of them (a phrase), else None
    keeps_scores: ClassVar[str | None] = None
    lora_targets: ClassVar[tuple[str, ...]] = ("q_proj", "k_proj", "v_proj", "o_proj")

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        # a variant writes `forward(..., cache=None, ...)`; callers of any transformers release may say past_key_values
        if "forward" in cls.__dict__:
            cls.forward = takes_past_key_values(cls.forward)

    def __init__(self, config: ZooConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx

    @classmethod
    def decodes_from_state(cls) -> bool:
        return cls.cache_layer is not None

    @classmethod
    def mask_kind(cls, config: ZooConfig, query_length: int, output_attentions: bool) -> str:
        """The mask kind for a forward of `query_length` new tokens; `mask_type` unless the kernel switches."""
        return cls.mask_type

    @classmethod
    def window(cls, config: ZooConfig) -> int | None:
        """How many keys a query sees at most (itself included) in a blockwise mask; None: all earlier ones."""
        return None

    @classmethod
    def query_key_width(cls, config: ZooConfig) -> int:
        """Width of a query or key head."""
        return config.head_dim

    @classmethod
    def value_width(cls, config: ZooConfig) -> int:
        """Width of a value head, and of a head's output."""
        return config.head_dim

    @classmethod
    def mixing_flops_per_token(cls, config: ZooConfig, seq_len: int) -> float:
        """Forward FLOPs of one layer's sequence mixing outside its Linear layers, for one token whose query sees
        `seq_len` positions: the full length, as PaLM counts (no halving for the causal mask), multiply-adds as 2.
        Softmax and other O(1)-per-score elementwise work is left out, as PaLM leaves it. Default: dot-product
        attention, per query head a score against each key (2·d_qk) and a weighted value (2·d_v)."""
        return 2 * config.num_attention_heads * seq_len * (cls.query_key_width(config) + cls.value_width(config))

    @classmethod
    def rotary_dim(cls, config: ZooConfig) -> int:
        """Width RoPE rotates: the query/key width by default."""
        return cls.query_key_width(config)

    @classmethod
    def attention_weights_absence(cls, config: ZooConfig) -> str | None:
        """Why `output_attentions` gives no weights over the tokens (a short clause: AFT has none, causal
        Linformer's change at every step), or None when it does. Without weights the model warns once and returns
        no attentions."""
        return None

    @classmethod
    def bidirectional_refusal(cls, config: ZooConfig) -> str | None:
        """Why the variant has no bidirectional form for an encoder (a sentence naming the variant), or None when it
        has one. The dense and blockwise mask kinds carry the direction in the mask (`masks_zoo.encoder_mask_for`),
        so kernels that read their mask need nothing more; a kernel of running sums reads a `TokenMask` and must
        declare that it honours `TokenMask.causal=False`."""
        if cls.mask_type in ("dense", "blockwise"):
            return None
        return (
            f"{config.model_type} has no bidirectional form: its kernel keeps causal running sums, so it cannot be "
            f"the encoder of an encoder-decoder; use it as the decoder of an EncoderDecoderModel (is_decoder=True, "
            f"add_cross_attention=True) under another encoder, or choose a variant with one (mha, gqa, linformer ...)."
        )

    @classmethod
    def backend_refusal(cls, config: ZooConfig, backend: str) -> str:
        """Why `backend`, one of transformers' attention functions this kernel does not declare, cannot run it."""
        if cls.backends == ("eager",):
            what = f"computes its attention with a kernel of its own ({config.description})"
        else:
            what = f"runs its attention ({config.description}) through {' and '.join(cls.backends)} only"
        return (
            f"{config.model_type} {what}, not through transformers' {backend!r} attention function; load it with "
            f"attn_implementation in {list(cls.backends)}."
        )

    @classmethod
    def lora_modules(cls, config: ZooConfig) -> tuple[str, ...]:
        """The attention's LoRA targets in a model of `config`: `lora_targets`, unless the config changes which
        projections exist."""
        return cls.lora_targets

    @classmethod
    def cached_widths(cls, config: ZooConfig) -> tuple[int, int, int] | None:
        """What a layer caches per token: (key/value heads, key width, value width); None for a state."""
        if cls.decodes_from_state():
            return None
        return config.num_key_value_heads, cls.query_key_width(config), cls.value_width(config)

    def __setattr__(self, name: str, value) -> None:
        # clients that attach attributes to attention layers (kvpress's rotary embedding) are answered by
        # `clients_zoo`, from the facts above, before any token runs
        if (refusal := attribute_refusal(self, name)) is not None:
            raise AttributeError(refusal)
        super().__setattr__(name, value)

    @classmethod
    def share_across_layers(cls, model: "ZooModel") -> None:
        """Parameters all layers share (Linformer's layerwise projection): built on `model` before initialisation
        and handed to its layers; none by default."""


class ZooDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: `x + attn(norm(x))`, then `x + mlp(norm(x))`, each branch with residual dropout.

    With `cross_attention` (a decoder of an encoder-decoder) a third branch sits between the two, as in Vaswani et
    al. 2017: `x + encoder_attn(encoder_attn_layer_norm(x), encoder outputs)`. With `causal=False` (an encoder layer)
    the self-attention is told so (`is_causal`, which transformers' sdpa reads when no mask is needed); its mask
    carries the rest."""

    sized_by: ClassVar[dict[str, str]] = {
        "input_layernorm": "hidden_size",
        "post_attention_layernorm": "hidden_size",
        "encoder_attn_layer_norm": "hidden_size",
    }

    def __init__(
        self,
        config: ZooConfig,
        layer_idx: int,
        attention_class: type[ZooAttention],
        cross_attention: bool = False,
        causal: bool = True,
    ) -> None:
        super().__init__()
        self.input_layernorm = make_norm(config)
        self.self_attn = attention_class(config, layer_idx)
        if not causal:
            self.self_attn.is_causal = False
        self.encoder_attn_layer_norm = make_norm(config) if cross_attention else None
        self.encoder_attn = cross_attention_class(config)(config, layer_idx) if cross_attention else None
        self.post_attention_layernorm = make_norm(config)
        self.mlp = ZooMLP(config)
        self.hidden_dropout = config.hidden_dropout
        # the projections that write into the residual stream: `_init_weights` gives them GPT-2's scaled init
        for projection in (self.self_attn.o_proj, self.mlp.down_proj):
            projection.writes_residual = True
        if self.encoder_attn is not None:
            self.encoder_attn.o_proj.writes_residual = True

    @takes_past_key_values
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask=None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: Cache | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        cross_attention_mask=None,
        cross_cache: EncoderDecoderCache | None = None,
        cross_attentions: list | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        """`cache` is the self-attention's (an `EncoderDecoderCache`'s `self_attention_cache`); the cross-attention
        reads and fills `cross_cache`, and appends its weights to `cross_attentions` when that list is given."""
        # keywords, as Llama's layer passes them: hooks registered `with_kwargs` (kvpress) find `hidden_states`, and
        # the cache under this transformers release's name for it
        attn_output, _ = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
            **{CACHE_KWARG: cache},
            **kwargs,
        )
        hidden_states = hidden_states + self._dropout(attn_output)
        if self.encoder_attn is not None:
            cross_output, weights = self.encoder_attn(
                self.encoder_attn_layer_norm(hidden_states),
                encoder_hidden_states,
                cross_attention_mask,
                cross_cache,
                output_attentions=cross_attentions is not None,
            )
            hidden_states = hidden_states + self._dropout(cross_output)
            if cross_attentions is not None:
                cross_attentions.append(weights)
        return hidden_states + self._dropout(self.mlp(self.post_attention_layernorm(hidden_states)))

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.hidden_dropout, training=True) if self.training and self.hidden_dropout else x


class ZooPreTrainedModel(ShapeCheckedLoading, PreTrainedModel):
    config: ZooConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["ZooDecoderLayer"]
    _skip_keys_device_placement = [CACHE_KWARG]
    _can_record_outputs = {"hidden_states": ZooDecoderLayer, "attentions": ZooAttention}
    # Set on each variant's classes from its attention's `backends` (`ZooModel.__init_subclass__`)
    _supports_sdpa = False
    _supports_flash_attn = False
    _supports_flex_attn = False

    def __init__(self, config: ZooConfig, *inputs, **kwargs) -> None:
        # A config may have been mutated after construction: check it again before building anything.
        config.validate()
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
        if isinstance(module, (ZooModule, ZooCrossAttention)):
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

    `role` is set by an encoder-decoder only (`seq2seq_zoo`): `"encoder"` builds `encoder_layers` layers of the
    variant's bidirectional form, `"decoder"` `decoder_layers` causal layers with cross-attention. Without it the
    model is the decoder-only language model, with cross-attention when the config says `add_cross_attention` (a
    decoder under another model's encoder, `EncoderDecoderModel`), or that model's encoder when the config says
    `is_decoder=False` (transformers' flag for the bidirectional form). A config with `is_encoder_decoder=True` is
    refused there, naming the encoder-decoder classes (`AutoModel` and `from_config` hand it to them)."""

    attention_class: type[ZooAttention]
    causal_lm_class = None  # the variant's ZooForCausalLM subclass, set by `ZooHead.__init_subclass__`
    seq2seq_model_class = None  # the variant's encoder-decoder base model, set by `seq2seq_zoo`
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
        scaled = position_type == "sinusoidal" if config.scale_embedding is None else config.scale_embedding
        embedding = ZooScaledEmbedding if scaled else nn.Embedding
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.embed_positions = (
            nn.Embedding(config.max_position_embeddings, config.hidden_size) if position_type == "learned" else None
        )
        self.rotary_emb = (
            ZooRotaryEmbedding(config, self.attention_class.rotary_dim(config)) if position_type == "rope" else None
        )
        self.layers = nn.ModuleList(
            [
                ZooDecoderLayer(config, layer_idx, self.attention_class, has_cross, causal=not self.is_encoder)
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
            cache = DynamicCache(config=config)
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
            cross["cross_attentions"] = [] if kwargs["output_attentions"] else None

        for decoder_layer in self.layers:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                **{CACHE_KWARG: cache},
                **cross,
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        if self.cross_attention_class is None:
            return BaseModelOutputWithPast(last_hidden_state=hidden_states, **{CACHE_KWARG: cache})
        weights = cross["cross_attentions"]
        return BaseModelOutputWithPastAndCrossAttentions(
            last_hidden_state=hidden_states,
            **{CACHE_KWARG: full_cache},
            cross_attentions=tuple(weights) if weights is not None else None,
        )

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
                attention_mask=mask,
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
            hidden_states = hidden_states + sinusoidal_embedding(
                position_ids, self.config.hidden_size, hidden_states.dtype
            )
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
