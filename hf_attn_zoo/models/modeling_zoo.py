"""The decoder backbone every zoo variant shares, written once.

A variant contributes its attention module, a `ZooAttention` subclass; everything else is here, in the order of a
forward pass: norms, the MLP, the attention protocol, the pre-norm decoder layer, the shared model class
(initialisation, loading, saving), `ZooModel` (embeddings, positions, masks, layers, final norm), and the heads built
on it (causal LM, sequence and token classification, question answering). Module layout and parameter names are
Llama's (`model.embed_tokens`, `model.layers.N.self_attn.q_proj`, `mlp.gate_proj`, `input_layernorm`, `lm_head`), so
a Llama state dict loads unchanged into the MHA family.

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

import functools
import inspect
import math
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
    GradientCheckpointingLayer,
)
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple, logging
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .cache_zoo import ZooStateCache
from .cards_zoo import write_card
from .checkpoint_zoo import CheckpointMismatchError, auto_map_for, describe_mismatch
from .compat_zoo import (
    CACHE_KWARG,
    PASSES_CACHE_POSITION,
    build_mask,
    returned_cache,
    slice_logits_to_keep,
    takes_past_key_values,
)
from .configuration_zoo import ZooConfig
from .loss_zoo import causal_lm_loss_fused
from .masks_zoo import attention_mask_for
from .positions_zoo import ZooRotaryEmbedding, default_position_ids, sinusoidal_embedding

__all__ = [
    "ZooAttention",
    "ZooDecoderLayer",
    "ZooForCausalLM",
    "ZooForQuestionAnswering",
    "ZooForSequenceClassification",
    "ZooForTokenClassification",
    "ZooHead",
    "ZooMLP",
    "ZooModel",
    "ZooModule",
    "ZooPreTrainedModel",
    "ZooRMSNorm",
    "weighted_values",
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
    def continuous_batching_refusal(cls, config: ZooConfig) -> str | None:
        """Why transformers' continuous batching cannot run this variant exactly (a short clause), or None when it can.

        Continuous batching packs the requests into one row and keeps keys and values in a paged cache, which only
        transformers' attention functions (`ALL_ATTENTION_FUNCTIONS`: paged|eager, sdpa, flash) write and read, from
        the packed-batch keywords they receive. A kernel of its own never sees that cache: refused by default."""
        if cls.decodes_from_state():
            return "it decodes from a running state per layer, which transformers' paged key/value cache cannot hold"
        return "its kernel is its own, not one of transformers' paged-attention functions"

    @classmethod
    def kv_compression_refusal(cls, config: ZooConfig) -> str | None:
        """Why a key/value cache compressor that assumes Llama's attention (kvpress's presses) cannot be faithful to
        this variant (one line), or None when it can. (A state layer's keys and values also refuse to be read,
        `ZooStateLayer`, for clients that reach the cache without entering a press.)"""
        if cls.decodes_from_state():
            return "it decodes from a running state per layer, with no per-token keys and values to evict"
        if config.position_embedding_type != "rope":
            # the presses rotate the queries they rebuild with the model's rotary embedding, which this config lacks
            position = config.position_embedding_type
            return f"presses rebuild RoPE queries, and this model has position_embedding_type={position!r}"
        return None

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

    @classmethod
    def config_shaped_cache_refusal(cls, config: ZooConfig) -> str | None:
        """Why a cache built outside the model from the config's head shapes (keys and values of num_key_value_heads
        x head_dim each: a static cache allocated before the first forward, as ExecuTorch's export recipe does, or
        PEFT's prefix tuning, whose virtual tokens are such keys and values) cannot hold this variant's, or None."""
        widths = cls.cached_widths(config)
        if widths is None:
            return "it decodes from a running state per layer, with no per-token keys and values"
        if widths == (config.num_key_value_heads, config.head_dim, config.head_dim):
            return None
        heads, key, value = widths
        return f"it caches {heads} key/value head(s) per token with keys {key} and values {value} wide"

    def __setattr__(self, name: str, value) -> None:
        # kvpress's presses start by attaching the model's rotary embedding to every attention layer (`rotary_emb`),
        # to rebuild the layer's queries as Llama's `q_proj` rotated by RoPE: a variant whose attention is not that
        # refuses there, before any token runs, rather than failing in a press's scorer or keeping the wrong tokens
        if name == "rotary_emb" and (reason := self.kv_compression_refusal(self.config)) is not None:
            raise AttributeError(
                f"{type(self).__name__} takes no `rotary_emb`: key/value cache compression that rebuilds Llama's "
                f"attention from the layer (kvpress's presses) cannot apply to this variant: {reason}."
            )
        super().__setattr__(name, value)

    @classmethod
    def share_across_layers(cls, model: "ZooModel") -> None:
        """Parameters all layers share (Linformer's layerwise projection): built on `model` before initialisation
        and handed to its layers; none by default."""


def weighted_values(
    outputs: list[torch.Tensor], weights: list[torch.Tensor], value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The result of a chunked kernel: `(B, T, H, d)` and the attention weights `(B, H, T, S)` or None.

    Without weights the chunks' outputs `(B, H, C, d)` are joined. With weights (`output_attentions`) the chunks
    gave their weight rows instead, and the output is computed from the joined matrix, so the weights returned are
    the ones the output depends on (their gradients exist, as for transformers' eager attention)."""
    if weights:
        weights = torch.cat(weights, dim=2)  # (B, H, T, S)
        return torch.matmul(weights, value).transpose(1, 2), weights
    return torch.cat(outputs, dim=2).transpose(1, 2), None  # (B, H, T, d) -> (B, T, H, d)


class ZooDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: `x + attn(norm(x))`, then `x + mlp(norm(x))`, each branch with residual dropout."""

    sized_by: ClassVar[dict[str, str]] = {"input_layernorm": "hidden_size", "post_attention_layernorm": "hidden_size"}

    def __init__(self, config: ZooConfig, layer_idx: int, attention_class: type[ZooAttention]) -> None:
        super().__init__()
        self.input_layernorm = make_norm(config)
        self.self_attn = attention_class(config, layer_idx)
        self.post_attention_layernorm = make_norm(config)
        self.mlp = ZooMLP(config)
        self.hidden_dropout = config.hidden_dropout
        # the two projections that write into the residual stream: `_init_weights` gives them GPT-2's scaled init
        for projection in (self.self_attn.o_proj, self.mlp.down_proj):
            projection.writes_residual = True

    @takes_past_key_values
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask=None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
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
        return hidden_states + self._dropout(self.mlp(self.post_attention_layernorm(hidden_states)))

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.hidden_dropout, training=True) if self.training and self.hidden_dropout else x


class ZooPreTrainedModel(PreTrainedModel):
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
        if isinstance(module, ZooModule):
            module.init_parameters(self.config)
        # GPT-2: the projections writing into the residual stream start smaller, std / sqrt(2L), so the variance of
        # the stream does not grow with depth. Decided on the projection itself, not on its decoder layer:
        # transformers never calls `_init_weights` on a module without parameters of its own for custom-code models.
        if getattr(module, "writes_residual", False) and self.config.scale_residual_init:
            std = self.config.initializer_range / math.sqrt(2 * self.config.num_hidden_layers)
            init.normal_(module.weight, mean=0.0, std=std)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """`PreTrainedModel.from_pretrained`, with a clearer error for weights whose shape does not fit the config.

        As in transformers, missing and unexpected tensors are reported (a warning, and `output_loading_info=True`)
        and missing ones are initialised by `_init_weights`: a base-model checkpoint loads into the causal LM. A
        tensor whose shape differs from what the config builds is an error naming the tensor and the config fields
        that size it, unless `ignore_mismatched_sizes=True` (then it is initialised afresh, as transformers does).
        """
        accept_mismatch = kwargs.pop("ignore_mismatched_sizes", False)
        return_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(
            pretrained_model_name_or_path,
            *model_args,
            ignore_mismatched_sizes=True,  # loaded to build the message below; refused unless asked for
            output_loading_info=True,
            **kwargs,
        )
        if info["mismatched_keys"] and not accept_mismatch:
            raise CheckpointMismatchError(
                describe_mismatch(pretrained_model_name_or_path, model, info["mismatched_keys"])
            )
        return (model, info) if return_info else model

    card_details: dict | None = None  # training details for the model card (set by a training run)

    def save_pretrained(self, save_directory, *args, training: dict | None = None, **kwargs):
        """`PreTrainedModel.save_pretrained`, plus an `auto_map` naming every class of the variant and the model
        card (README.md, with `training` details, or `card_details`, when given; a card already in the folder is
        kept)."""
        base = type(self) if isinstance(self, ZooModel) else self.base_model_class
        self.config.auto_map = auto_map_for(base)
        result = super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", args[0] if args else True):
            write_card(save_directory, self.config, training if training is not None else self.card_details)
        return result

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
    subclass names its `config_class` and `attention_class`; transformers' backend flags follow from the latter."""

    attention_class: type[ZooAttention]
    causal_lm_class = None  # the variant's ZooForCausalLM subclass, set by `ZooHead.__init_subclass__`
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

    def __init__(self, config: ZooConfig) -> None:
        super().__init__(config)
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
            [ZooDecoderLayer(config, layer_idx, self.attention_class) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = make_norm(config)
        self.gradient_checkpointing = False
        self.attention_class.share_across_layers(self)
        self.post_init()

    def make_cache(self) -> Cache:
        """The cache `forward` (and `generate`) starts when none is given: transformers' key/value layers
        (sliding-window ones when the config has `sliding_window`), or the variant's state layers."""
        if self.attention_class.decodes_from_state():
            return ZooStateCache(self.config.num_hidden_layers, self.attention_class.cache_layer)
        return DynamicCache(config=self.config)

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
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)  # (B, T, d)
        if use_cache and cache is None:
            cache = self.make_cache()
        if cache is not None:
            self._check_cache(cache)
        if PASSES_CACHE_POSITION and kwargs.get("cache_position") is None:  # transformers < 5.3: as Llama there
            past = cache.get_seq_length() if cache is not None else 0
            kwargs["cache_position"] = torch.arange(past, past + inputs_embeds.shape[1], device=inputs_embeds.device)
        if position_ids is None:
            # the cache's length is read only here, as in Llama: continuous batching gives positions with a paged
            # cache that has no single length
            past_length = cache.get_seq_length() if cache is not None else 0
            count_real_tokens = self.attention_class.reads_positions or self.position_embedding_type in (
                "alibi",
                "sinusoidal",
                "learned",
            )
            position_ids = default_position_ids(inputs_embeds, attention_mask, past_length, count_real_tokens)

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

        for decoder_layer in self.layers:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                **{CACHE_KWARG: cache},
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, **{CACHE_KWARG: cache})

    def _check_cache(self, cache: Cache) -> None:
        """Refuse, before any layer runs, a cache built outside the model that cannot hold this variant: key/value
        layers for a variant that decodes from a state, or keys and values of other widths (a static cache
        allocated from the config's head shapes, PEFT's prefix tuning). Exporters tracing with such a cache and PEFT
        users then read why, rather than a shape error from inside a layer."""
        layers = getattr(cache, "layers", None)
        if not layers:
            return
        attention, model_type = self.attention_class, self.config.model_type
        if attention.decodes_from_state():
            if all(isinstance(layer, attention.cache_layer) for layer in layers):
                return
            # what a cache holds is data to a tracer (a static cache counts its filled slots): exporters get the
            # message below, PEFT (eager) this one
            held = 0 if torch.compiler.is_compiling() else int(cache.get_seq_length())
            if held:
                raise TypeError(
                    f"{model_type} decodes from a running state per layer, but was handed a {type(cache).__name__} "
                    f"already holding {held} tokens of keys and values: that is how PEFT's prefix tuning passes its "
                    f"virtual tokens, and a running state has no per-token keys and values to put them before, so "
                    f"prefix tuning cannot apply to this variant; use prompt tuning (PEFT's PromptTuningConfig: "
                    f"virtual token embeddings) or LoRA instead."
                )
            raise TypeError(
                f"{model_type} decodes from a running state per layer, which a {type(cache).__name__} of keys and "
                f"values cannot hold, so it cannot decode from (or be exported with) a static key/value cache. Pass "
                f"cache=model.model.make_cache() or let generate() create it; to export, export the forward without "
                f"a cache (use_cache=False)."
            )
        layer = layers[0]
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not getattr(layer, "is_initialized", False) or keys is None or values is None or keys.dim() != 4:
            return
        heads, key_width, value_width = attention.cached_widths(self.config)
        if (keys.shape[1], keys.shape[-1], values.shape[1], values.shape[-1]) == (
            heads,
            key_width,
            heads,
            value_width,
        ):
            return
        raise TypeError(
            f"{model_type} cannot use the cache handed in: its layer 0 holds keys of {keys.shape[1]} head(s) x "
            f"{keys.shape[-1]} and values of {values.shape[1]} x {values.shape[-1]}, but "
            f"{attention.config_shaped_cache_refusal(self.config)}. A cache sized from the config's head shapes "
            f"(num_key_value_heads x head_dim) cannot hold it: PEFT's prefix tuning, whose virtual tokens are such "
            f"keys and values, cannot apply to this variant (use prompt tuning or LoRA instead), and a static cache "
            f"must size itself from its first write (generate(cache_implementation='static') does) or be left out "
            f"(export the forward with use_cache=False)."
        )

    def _check_learned_positions(self, position_ids: torch.LongTensor) -> None:
        if torch.compiler.is_compiling():
            return
        longest = int(position_ids.max())
        if longest >= self.config.max_position_embeddings:
            raise ValueError(
                f"position {longest} is beyond max_position_embeddings={self.config.max_position_embeddings} of the "
                f"learned position table; shorten the input or build the model with a larger max_position_embeddings."
            )


class ZooHead(ZooPreTrainedModel):
    """A variant's base model (`self.model`) under a head. A variant's head class names its `base_model_class`; that
    makes it the variant's head for `auto_class` (listed in `base_model_class.heads`, so in a checkpoint's
    `auto_map`) and gives it the base model's config class and backend flags."""

    auto_class: ClassVar[str]
    base_model_class: type[ZooModel]
    # what transformers reads off the top-level class: the base model's answers
    FLAGS_OF_THE_BASE = (
        "_supports_sdpa",
        "_supports_flash_attn",
        "_supports_flex_attn",
        "_supports_attention_backend",
        "_can_compile_fullgraph",
    )

    def __init_subclass__(cls, **kwargs) -> None:
        base = cls.__dict__.get("base_model_class")
        if base is not None:
            cls.config_class = base.config_class
            for flag in cls.FLAGS_OF_THE_BASE:
                setattr(cls, flag, getattr(base, flag))
            # decodes from running sums that cannot be rolled back: generate refuses assisted and prompt lookup
            cls._is_stateful = base.attention_class.decodes_from_state()
        super().__init_subclass__(**kwargs)
        if base is not None:
            base.heads[cls.auto_class] = cls

    def _build_base_model(self, config: ZooConfig) -> None:
        """`self.model`, built directly: transformers' generic heads go through `AutoModel.from_config`, which does
        not know the variant when the checkpoint is loaded as remote code."""
        ZooPreTrainedModel.__init__(self, config)
        self.model = self.base_model_class(config)
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

    def __init__(self, config: ZooConfig) -> None:
        self._build_base_model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """`generate` builds a cache of key/value layers; a variant that decodes from a state puts its own in place,
        and refuses cache implementations (static, quantized, offloaded) that presuppose keys and values."""
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        if not self.model.attention_class.decodes_from_state():
            return
        cache = model_kwargs.get(CACHE_KWARG)
        if cache is None or getattr(cache, "_is_user_defined", False):
            return
        if generation_config.cache_implementation not in (None, "dynamic"):
            raise ValueError(
                f"{self.config.model_type} decodes from a state per layer, not from keys and values: "
                f"cache_implementation={generation_config.cache_implementation!r} does not apply; leave it unset."
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
        return build_mask(  # transformers' builder; before 5.3 it also takes generate's `cache_position`
            attention.dense_mask_function,
            config=config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
            cache_position=kwargs.get("cache_position"),
        )

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
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            Targets for the next-token loss; they are shifted inside, and -100 is ignored. With
            `config.fuse_linear_cross_entropy` (off by default) the head and the loss run fused in training mode
            (with gradients) and `logits` is None.
        logits_to_keep (`int` or `torch.Tensor`, *optional*):
            Compute logits for the last `logits_to_keep` positions only (0 keeps all), or for the given indices.
        """
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
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            **{CACHE_KWARG: returned_cache(outputs)},
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


# Classes registered with `register_for_auto_class` count as remote code, for which `generate` runs
# `inspect.signature(self.forward)` at every decoding step (looking for a legacy `cache_position` argument). A
# precomputed signature turns that lookup into an attribute read: 3-4% of batch-1 decoding time on CPU.
ZooForCausalLM.forward.__signature__ = inspect.signature(ZooForCausalLM.forward)
