"""The layers every zoo model is built of: norms, the MLP, the attention protocol (`ZooAttention`, which every
variant's attention module subclasses) and the decoder layer (pre-norm, or post-norm by `norm_position`:
self-attention, an optional cross-attention, the MLP). `modeling_zoo.py` builds the model classes from them.

This module is copied next to every saved checkpoint (remote code), so it imports only torch, transformers and its
flat siblings.
"""

import math
from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import (
    GradientCheckpointingLayer,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs

from .clients_zoo import attribute_refusal
from .compat_zoo import (
    CACHE_KWARG,
    takes_past_key_values,
)
from .configuration_zoo import ZooConfig
from .cross_attention_zoo import cross_attention_class

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
    """Token embeddings initialised at std 1/sqrt(d) and multiplied by sqrt(d), as Vaswani et al. (2017) do beside
    sinusoidal positions (tensor2tensor's and fairseq's init and scale): a token then enters the residual stream at
    RMS 1, beside sinusoids of RMS 1/sqrt(2), whatever the width. The scale alone, on embeddings initialised at
    `initializer_range` (0.02), gives tokens of RMS 0.02·sqrt(d), 0.23 at d = 128: the positions outweigh them 3 to
    1 and the model trains to twice the perplexity (docs/studies/quality.md measures it). The scale lives in the
    module, so `get_input_embeddings()(input_ids)` passed as `inputs_embeds` equals passing `input_ids`.
    `config.embed_init_std` replaces the init's std (Marian's 0.02: tokens at RMS 0.02·sqrt(d))."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, padding_idx)
        self.embed_scale = math.sqrt(embedding_dim)

    def forward(self, input_ids: torch.LongTensor) -> torch.Tensor:
        return super().forward(input_ids) * self.embed_scale

    def init_parameters(self, config) -> None:
        std = config.embed_init_std if getattr(config, "embed_init_std", None) else self.embedding_dim**-0.5
        init.normal_(self.weight, mean=0.0, std=std)
        if self.padding_idx is not None:
            init.zeros_(self.weight[self.padding_idx])


class ZooLearnedPositions(nn.Embedding):
    """GPT-2's learned absolute positions, a table of `max_position_embeddings` rows, started at zero: an untrained
    model is then the NoPE model, and the table holds only what gradients put there. At GPT-2's std (0.02, as large
    as the token embeddings) each position adds a random vector that the model must first learn to ignore; in the
    quality board's 489 steps the table hardly moves (RMS 0.020 to 0.021) and the model trained to 1.7 times RoPE's
    perplexity, worse than no positions at all (docs/studies/quality.md)."""

    def init_parameters(self, config) -> None:
        init.zeros_(self.weight)


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
    # Where the math exists outside the zoo (`hf-attn-zoo export`): the model_type of the native transformers
    # architecture computing the same function, and llama.cpp's GGUF architecture; None where there is none. A
    # subclass states its own: each variant computes another function than its parent class.
    native_format: ClassVar[str | None] = None
    gguf_architecture: ClassVar[str | None] = None
    # why no GGUF file holds it, where `gguf_architecture` is None (`hf-attn-zoo export --to gguf` says it)
    gguf_absence: ClassVar[str] = "llama.cpp has no architecture that computes its attention"
    # Conversion from an MHA-family parent (`hf_attn_zoo.convert.transfer.convert_attention`): the projections that
    # mean here what they mean in the parent's attention, taken from it where the shapes allow (key/value rows
    # repeated or mean-pooled to this config's key/value heads); every other parameter starts fresh. None: the
    # variant is computed from the parent as a whole by a conversion of its own (MHA family: pooling, MLA: a latent).
    parent_weights: ClassVar[tuple[str, ...] | None] = ()
    # The parent's head fields a converted model keeps (a variant without heads keeps none)
    parent_head_fields: ClassVar[tuple[str, ...]] = ("num_attention_heads", "num_key_value_heads", "head_dim")

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
    def dense_mask_builder(cls, config: ZooConfig, attention_mask: torch.Tensor | None) -> tuple[Callable, dict]:
        """transformers' builder of the dense mask for `config` and its keywords beyond the backbone's (an
        `and_mask_function` cutting the causal mask further), from the 2D padding mask of the whole sequence (None:
        no padding): `dense_mask_function` and none, unless a config field changes the mask."""
        return cls.dense_mask_function, {}

    @classmethod
    def cache_config(cls, config: ZooConfig) -> ZooConfig:
        """The config transformers' `DynamicCache` is built from: `config`, unless the layers must keep other keys
        than its fields say (a window with sink tokens keeps its sinks: an unwindowed copy, which clients read as
        "keeps other keys"; the variant's own cache is `key_value_cache`'s)."""
        return config

    @classmethod
    def key_value_cache(cls, config: ZooConfig) -> Cache:
        """The cache of keys and values the model starts when none is given: transformers' `DynamicCache` built from
        `cache_config(config)`, unless the variant keeps its keys otherwise (a window with sink tokens evicts those
        between the sinks and the window)."""
        return DynamicCache(config=cls.cache_config(config))

    @classmethod
    def mask_refusal(cls, config: ZooConfig) -> str | None:
        """Why a client that builds the causal mask itself (continuous batching, vLLM, a native export) would compute
        another function than this config's (a clause), or None."""
        return None

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
    def share_across_layers(cls, model: nn.Module) -> None:
        """Parameters all layers share (Linformer's layerwise projection): built on `model` before initialisation
        and handed to its layers (`model` is the `ZooModel` being built); none by default."""


class ZooDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: `x + attn(norm(x))`, then `x + mlp(norm(x))` (unless `mlp_type="none"`), each branch with
    residual dropout; with `norm_position="post"` each norm moves after its residual addition, `norm(x + attn(x))`,
    as in Vaswani et al. 2017 (the norms keep their names, so a checkpoint's weights load into either).

    With `cross_attention` (a decoder of an encoder-decoder) a third branch sits between the two, as in Vaswani et
    al. 2017: `x + encoder_attn(encoder_attn_layer_norm(x), encoder outputs)`. `ZooEncoderLayer` is the encoder's."""

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
        # `mlp_type="none"`: no MLP branch and no norm before it (Mamba's blocks)
        has_mlp = config.mlp_type != "none"
        self.post_attention_layernorm = make_norm(config) if has_mlp else None
        self.mlp = ZooMLP(config) if has_mlp else None
        self.hidden_dropout = config.hidden_dropout
        self.post_norm = config.norm_position == "post"
        # the projections that write into the residual stream: `_init_weights` gives them GPT-2's scaled init
        self.self_attn.o_proj.writes_residual = True
        if self.mlp is not None:
            self.mlp.down_proj.writes_residual = True
        if self.encoder_attn is not None:
            self.encoder_attn.o_proj.writes_residual = True

    @takes_past_key_values
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask=None,
        encoder_hidden_states: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: Cache | None = None,
        cross_attention_mask=None,
        cross_cache: EncoderDecoderCache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        """`cache` is the self-attention's (an `EncoderDecoderCache`'s `self_attention_cache`); the cross-attention
        reads and fills `cross_cache`. The tensors that carry gradients come positionally (`hidden_states`,
        `encoder_hidden_states`), as BART's layers take them: gradient checkpointing with `use_reentrant=True` passes
        only positional arguments through its checkpoint, and a keyword tensor would be backpropagated twice."""
        # keywords, as Llama's layer passes them: hooks registered `with_kwargs` (kvpress) find `hidden_states`, and
        # the cache under this transformers release's name for it
        attn_output, _ = self.self_attn(
            hidden_states=self.branch_input(hidden_states, self.input_layernorm),
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
            **{CACHE_KWARG: cache},
            **kwargs,
        )
        hidden_states = self._add(hidden_states, attn_output, self.input_layernorm)
        if self.encoder_attn is not None:
            # its weights are recorded by transformers' output capturing (`_can_record_outputs`), as BART's
            cross_output, _ = self.encoder_attn(
                self.branch_input(hidden_states, self.encoder_attn_layer_norm),
                encoder_hidden_states,
                cross_attention_mask,
                cross_cache,
                output_attentions=bool(kwargs.get("output_attentions")),
            )
            hidden_states = self._add(hidden_states, cross_output, self.encoder_attn_layer_norm)
        if self.mlp is None:
            return hidden_states
        mlp_output = self.mlp(self.branch_input(hidden_states, self.post_attention_layernorm))
        return self._add(hidden_states, mlp_output, self.post_attention_layernorm)

    def branch_input(self, hidden_states: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        # pre-norm: a branch reads the normalised stream; post-norm: the stream itself, already normalised
        return hidden_states if self.post_norm else norm(hidden_states)

    def _add(self, hidden_states: torch.Tensor, branch_output: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        hidden_states = hidden_states + self._dropout(branch_output)
        return norm(hidden_states) if self.post_norm else hidden_states

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.hidden_dropout, training=True) if self.training and self.hidden_dropout else x


class ZooEncoderLayer(ZooDecoderLayer):
    """An encoder layer, as BART's `BartEncoderLayer`: the pre-norm block over the variant's bidirectional
    self-attention (`is_causal=False`, which transformers' sdpa reads when no mask is needed; the mask carries the
    rest), no cross-attention. Parameter names are the decoder layer's (`self_attn`, `mlp`, the two norms)."""

    def __init__(self, config: ZooConfig, layer_idx: int, attention_class: type[ZooAttention]) -> None:
        super().__init__(config, layer_idx, attention_class, cross_attention=False, causal=False)
