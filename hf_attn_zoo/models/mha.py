"""Scaled dot-product attention with shared key/value heads: MHA, GQA, MQA and single-head, one implementation.

Papers: Vaswani et al. 2017, "Attention Is All You Need" (multi-head); Shazeer 2019, "Fast Transformer Decoding: One
Write-Head is All You Need" (multi-query); Ainslie et al. 2023, "GQA: Training Generalized Multi-Query Transformer
Models from Multi-Head Checkpoints" (grouped-query).

The H query heads share G key/value heads in contiguous groups, as transformers' `repeat_kv`: query head h reads KV
head h // (H / G). MHA is G = H, MQA is G = 1, GQA anything between, and single-head is one head of width
`hidden_size`. The four differ only in their config class (defaults and validation), so a checkpoint says what it is
(`zoo_gqa`, `zoo_mqa`).

Cache per token: 2 * L * G * head_dim values (keys and values of every layer); MQA is MHA / H.

The kernel comes from transformers' `ALL_ATTENTION_FUNCTIONS` (`eager`, `sdpa`, `flash_attention_2`,
`flex_attention`); with ALiBi positions only `eager` and `sdpa`, which take an additive bias. Deviation from the
papers: none beyond the backbone's choices (pre-norm, RoPE by default).
"""

from typing import ClassVar

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs

from .clients_zoo import VLLM_ATTENTION, vllm_refusal_line
from .compat_zoo import update_cache
from .configuration_zoo import HEADS, ZooConfig, sized
from .heads_zoo import variant_heads
from .layers_zoo import BACKENDS, ZooAttention
from .modeling_zoo import ZooModel
from .positions_zoo import apply_rotary
from .seq2seq_zoo import seq2seq_classes


class ZooMultiHeadAttention(ZooAttention):
    """Attention over `num_attention_heads` query heads and `num_key_value_heads` shared key/value heads.

    `forward` projects, applies RoPE, writes the cache and calls `attend`, the kernel: here softmax attention through
    transformers' `ALL_ATTENTION_FUNCTIONS`. Variants with other kernels (sliding window, top-k, additive) subclass
    this and override `attend` (and the protocol answers that change); queries and keys are
    `query_key_width(config)` wide, values `value_width(config)` (both `head_dim` here).
    """

    family = "mha"
    # pooled from the parent by `mha_to_gqa` (Ainslie et al. 2023); subclasses with the same projections copy them
    parent_weights: ClassVar[tuple[str, ...] | None] = None
    native_format = "llama"  # Qwen2 too where the output projection has no bias
    gguf_architecture = "llama"
    backends = BACKENDS
    compiles_fullgraph = True  # key/value caches written in place and masks of fixed shape
    sized_by: ClassVar[dict[str, str]] = {
        "q_proj": "num_attention_heads, head_dim, hidden_size",
        "k_proj": "num_key_value_heads, head_dim, hidden_size",
        "v_proj": "num_key_value_heads, head_dim, hidden_size",
        "o_proj": "num_attention_heads, head_dim, hidden_size",
    }

    def __init__(self, config: ZooConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.head_dim = config.head_dim
        self.query_key_dim = self.query_key_width(config)
        self.value_dim = self.value_width(config)
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads  # read by the attention kernels
        self.scaling = self.query_key_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.query_key_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_key_value_heads * self.query_key_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_key_value_heads * self.value_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.value_dim, hidden, bias=bias)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]  # (B, T)
        query_states, key_states, value_states = self.project(hidden_states, position_embeddings)

        implementation = self.config._attn_implementation
        if implementation in VLLM_ATTENTION:
            # vLLM's transformers backend finds this call in the source of `forward` and serves it with its own
            # attention layer, which keeps the keys and values in its paged cache (the backbone passes no cache and
            # no mask). Variants whose `attend` is not plain softmax attention were refused when the model was built
            # (`ZooModel.__init__`); this is the check for a model whose config was switched afterwards.
            if (refusal := vllm_refusal_line(type(self), self.config)) is not None:
                raise ValueError(refusal)
            attention_interface = ALL_ATTENTION_FUNCTIONS[implementation]
            # (T, H * d_h): vLLM packs every request into the one row of the batch
            attn_output, attn_weights = attention_interface(
                self, query_states, key_states, value_states, attention_mask, scaling=self.scaling, **kwargs
            )
        else:
            if cache is not None:
                # (B, G, S, d_h): everything cached so far, this step included
                key_states, value_states = update_cache(cache, key_states, value_states, self.layer_idx, kwargs)
            attn_output, attn_weights = self.attend(query_states, key_states, value_states, attention_mask, **kwargs)
        # (B, T, H, d_h), or vLLM's (T, H * d_h) with B = 1, -> (B, T, H * d_h)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights

    def project(
        self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries `(B, H, T, d_qk)`, keys `(B, G, T, d_qk)` and values `(B, G, T, d_h)`, RoPE applied."""
        input_shape = hidden_states.shape[:-1]  # (B, T)
        # (B, T, heads * width) -> (B, T, heads, width) -> (B, heads, T, width)
        query = self.q_proj(hidden_states).view(*input_shape, -1, self.query_key_dim).transpose(1, 2)
        key = self.k_proj(hidden_states).view(*input_shape, -1, self.query_key_dim).transpose(1, 2)
        value = self.v_proj(hidden_states).view(*input_shape, -1, self.value_dim).transpose(1, 2)
        if position_embeddings is not None:
            query, key = apply_rotary(query, key, *position_embeddings)
        return query, key, value

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The kernel: `(B, H, T, d_qk)`, `(B, G, S, d_qk)`, `(B, G, S, d_h)` -> `((B, T, H, d_h), weights)`."""
        return backend_attention(self, query, key, value, attention_mask, **kwargs)


def backend_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    **kwargs: Unpack[TransformersKwargs],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`module.config`'s attention function from transformers' `ALL_ATTENTION_FUNCTIONS`, at the module's scale and
    dropout: `(B, H, T, d_qk)`, `(B, G, S, d_qk)`, `(B, G, S, d_v)` -> `((B, T, H, d_v), weights)`.

    The fused kernels take one head width for queries, keys and values: PyTorch's flash attention on CPU refuses others
    and SDPA then runs its math kernel, which builds every (T, S) score matrix (differential attention, whose values
    are twice as wide as its keys, trained 1.5x slower so at 2,048 tokens than padded), and transformers' flash path
    pads or crops values to the query width. So for every backend but eager the narrower side gets zero channels: zero
    query and key channels add nothing to any dot product (the scale is passed, not derived from the width), and the
    outputs of zero value channels are dropped."""
    implementation = module.config._attn_implementation
    if implementation in VLLM_ATTENTION:
        # vLLM's attention keeps one paged cache per layer and reads none of the padding below: only the MHA family's
        # `forward` hands it its queries, keys and values; any other kernel reaching it would give other text
        raise ValueError(
            vllm_refusal_line(type(module), module.config)
            or f"{module.config.model_type}: {type(module).__name__} cannot run on vLLM's attention function."
        )
    width, value_width = query.shape[-1], value.shape[-1]
    if implementation != "eager" and width != value_width:
        if value_width < width:
            value = nn.functional.pad(value, (0, width - value_width))
        else:
            query = nn.functional.pad(query, (0, value_width - width))
            key = nn.functional.pad(key, (0, value_width - width))
    output, weights = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=module.attention_dropout if module.training else 0.0,
        scaling=module.scaling,
        **kwargs,
    )
    return output[..., :value_width], weights


class ZooMHAConfig(ZooConfig):
    """Multi-head attention: one key/value head per query head (`num_key_value_heads == num_attention_heads`)."""

    model_type = "zoo_mha"
    paper = 'Vaswani et al. 2017, "Attention Is All You Need"'
    arxiv = ("1706.03762",)
    presets = sized(num_attention_heads=HEADS)
    description = "scaled dot-product, one KV head per query head"
    cache_per_token = "2·L·H·d_h"

    def _check_variant(self) -> None:
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(
                f"{self.model_type} needs num_key_value_heads == num_attention_heads, got num_key_value_heads="
                f"{self.num_key_value_heads} and num_attention_heads={self.num_attention_heads}; leave "
                f"num_key_value_heads unset, or use zoo_gqa / zoo_mqa for shared key/value heads."
            )


class ZooGQAConfig(ZooConfig):
    """Grouped-query attention: `num_key_value_heads` (G) key/value heads, each shared by H / G query heads."""

    model_type = "zoo_gqa"
    paper = (
        'Ainslie et al. 2023, "GQA: Training Generalized Multi-Query Transformer Models from Multi-Head Checkpoints"'
    )
    arxiv = ("2305.13245",)
    presets = sized(num_attention_heads=HEADS, num_key_value_heads=(2, 2, 4))
    description = "scaled dot-product, G KV heads shared by contiguous groups of H/G query heads"
    cache_per_token = "2·L·G·d_h"

    num_key_value_heads: int | None = 2


class ZooMQAConfig(ZooConfig):
    """Multi-query attention: a single key/value head shared by every query head."""

    model_type = "zoo_mqa"
    paper = 'Shazeer 2019, "Fast Transformer Decoding: One Write-Head is All You Need"'
    arxiv = ("1911.02150",)
    presets = sized(num_attention_heads=HEADS)
    description = "scaled dot-product, one KV head shared by all query heads"
    cache_per_token = "2·L·d_h"

    num_key_value_heads: int | None = 1

    def _check_variant(self) -> None:
        if self.num_key_value_heads != 1:
            raise ValueError(
                f"{self.model_type} has exactly one key/value head, got num_key_value_heads="
                f"{self.num_key_value_heads}; leave it unset (or 1), or use zoo_gqa for several key/value heads."
            )


class ZooSingleHeadConfig(ZooConfig):
    """A single attention head as wide as the model (`num_attention_heads == num_key_value_heads == 1`)."""

    model_type = "zoo_single_head"
    paper = 'Vaswani et al. 2017, "Attention Is All You Need" (a single head)'
    arxiv = ("1706.03762",)
    description = "scaled dot-product, one head of width hidden_size"
    cache_per_token = "2·L·d"

    num_attention_heads: int = 1

    def _check_variant(self) -> None:
        if self.num_attention_heads != 1 or self.num_key_value_heads != 1:
            raise ValueError(
                f"{self.model_type} has one query and one key/value head, got num_attention_heads="
                f"{self.num_attention_heads} and num_key_value_heads={self.num_key_value_heads}; leave both unset, "
                f"or use zoo_mha / zoo_gqa / zoo_mqa for several heads."
            )


class ZooMHAFamilyModel(ZooModel):
    attention_class = ZooMultiHeadAttention


class ZooMHAModel(ZooMHAFamilyModel):
    config_class = ZooMHAConfig


ZooMHAForCausalLM, ZooMHAForSequenceClassification, ZooMHAForTokenClassification, ZooMHAForQuestionAnswering = (
    variant_heads(ZooMHAModel)
)
ZooMHAEncoder, ZooMHADecoder, ZooMHASeq2SeqModel, ZooMHAForConditionalGeneration = seq2seq_classes(ZooMHAModel)


class ZooGQAModel(ZooMHAFamilyModel):
    config_class = ZooGQAConfig


ZooGQAForCausalLM, ZooGQAForSequenceClassification, ZooGQAForTokenClassification, ZooGQAForQuestionAnswering = (
    variant_heads(ZooGQAModel)
)
ZooGQAEncoder, ZooGQADecoder, ZooGQASeq2SeqModel, ZooGQAForConditionalGeneration = seq2seq_classes(ZooGQAModel)


class ZooMQAModel(ZooMHAFamilyModel):
    config_class = ZooMQAConfig


ZooMQAForCausalLM, ZooMQAForSequenceClassification, ZooMQAForTokenClassification, ZooMQAForQuestionAnswering = (
    variant_heads(ZooMQAModel)
)
ZooMQAEncoder, ZooMQADecoder, ZooMQASeq2SeqModel, ZooMQAForConditionalGeneration = seq2seq_classes(ZooMQAModel)


class ZooSingleHeadModel(ZooMHAFamilyModel):
    config_class = ZooSingleHeadConfig


(
    ZooSingleHeadForCausalLM,
    ZooSingleHeadForSequenceClassification,
    ZooSingleHeadForTokenClassification,
    ZooSingleHeadForQuestionAnswering,
) = variant_heads(ZooSingleHeadModel)
ZooSingleHeadEncoder, ZooSingleHeadDecoder, ZooSingleHeadSeq2SeqModel, ZooSingleHeadForConditionalGeneration = (
    seq2seq_classes(ZooSingleHeadModel)
)
