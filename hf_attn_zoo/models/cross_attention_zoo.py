"""Cross-attention: a decoder layer's queries against the encoder's outputs, as the config declares it.

Vaswani et al. 2017 (arXiv 1706.03762) put a cross-attention ("encoder-decoder attention") between a decoder layer's
self-attention and its MLP; its queries come from the decoder, its keys and values from the encoder's last layer. Two
kinds, by `config.cross_attention`:

- `"dot"` (`ZooCrossAttention`): scaled dot product with `num_attention_heads` query heads (H) and
  `cross_attention_num_key_value_heads` key/value heads (G) shared by contiguous groups, as in the self-attention of
  the MHA family: G = H is MHA, G = 1 MQA, anything between GQA (Ainslie et al. 2023 uptrain T5's cross-attention to
  GQA). It runs through transformers' `ALL_ATTENTION_FUNCTIONS` (eager, sdpa, flash, flex).
- `"additive"` (`ZooAdditiveCrossAttention`): Bahdanau, Cho & Bengio 2015 (arXiv 1409.0473), the score of a decoder
  query and an encoder output `v_h·tanh(W_q x + W_k h)` per head, `cross_attention_additive_dim` wide, on the additive
  variant's kernel (`chunked_zoo.additive_attention`). Where this differs from the paper: there the query is the RNN
  decoder's previous state; here it is a transformer decoder layer's normalised input, with H heads.

Neither reads positions: an encoder output carries its own. Source padding is a key mask (`masks_zoo.
cross_attention_mask`). The keys and values are computed once per source: with transformers' `EncoderDecoderCache`
they are written into its `cross_attention_cache` at the first step (`is_updated`) and read at every later one, so
beam search reorders them with the self-attention cache.

This module travels next to every saved checkpoint (remote code): it imports only torch, transformers and its flat
siblings.
"""

from typing import ClassVar

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import EncoderDecoderCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

from .chunked_zoo import additive_attention
from .configuration_zoo import ZooConfig

__all__ = ["ZooAdditiveCrossAttention", "ZooCrossAttention", "cross_attention_class"]

# Queries per chunk of the additive kernel: its (chunk, S, a) tanh block stays in cache (the additive variant
# measured 4 fastest on CPU); decoding steps have one query anyway.
ADDITIVE_QUERY_CHUNK = 4


class ZooCrossAttention(nn.Module):
    """Scaled dot-product cross-attention, H query heads over G key/value heads of the encoder's outputs.

    `forward(hidden_states (B, T, d), encoder_hidden_states (B, S, d) or None, attention_mask, cache)` returns
    `(output (B, T, d), weights (B, H, T, S) or None)`; `encoder_hidden_states` may be None only when `cache` already
    holds this layer's keys and values."""

    mask_kind: ClassVar[str] = "dense"  # what `masks_zoo.cross_attention_mask` builds for it
    sized_by: ClassVar[dict[str, str]] = {
        "q_proj": "num_attention_heads, head_dim, hidden_size",
        "k_proj": "cross_attention_num_key_value_heads, head_dim, hidden_size",
        "v_proj": "cross_attention_num_key_value_heads, head_dim, hidden_size",
        "o_proj": "num_attention_heads, head_dim, hidden_size",
    }

    def __init__(self, config: ZooConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.cross_attention_num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads  # read by the attention kernels
        self.head_dim = config.head_dim
        self.query_key_dim = self.query_key_width(config)
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = False  # sdpa reads it when no mask is given: every query sees every source token
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.query_key_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_key_value_heads * self.query_key_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)

    @classmethod
    def query_key_width(cls, config: ZooConfig) -> int:
        return config.head_dim

    def init_parameters(self, config: ZooConfig) -> None:
        """Nothing beyond the Linear layers transformers initialises."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None,
        attention_mask=None,
        cache: EncoderDecoderCache | None = None,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch, length = hidden_states.shape[:2]
        # (B, T, H * a) -> (B, T, H, a) -> (B, H, T, a)
        query = self.q_proj(hidden_states).view(batch, length, -1, self.query_key_dim).transpose(1, 2)
        if cache is not None and cache.is_updated.get(self.layer_idx):
            layer = cache.cross_attention_cache.layers[self.layer_idx]
            key, value = layer.keys, layer.values  # (B, G, S, a), (B, G, S, d): computed at the first step
        else:
            if encoder_hidden_states is None:
                raise ValueError(
                    "cross-attention needs encoder_hidden_states (the encoder's outputs) or a cache that already "
                    "holds their keys and values; pass encoder_outputs with the decoder inputs."
                )
            source_length = encoder_hidden_states.shape[1]
            # (B, S, G * width) -> (B, S, G, width) -> (B, G, S, width)
            key = self.k_proj(encoder_hidden_states).view(batch, source_length, -1, self.query_key_dim).transpose(1, 2)
            value = self.v_proj(encoder_hidden_states).view(batch, source_length, -1, self.head_dim).transpose(1, 2)
            if cache is not None:
                key, value = cache.cross_attention_cache.update(key, value, self.layer_idx)
                cache.is_updated[self.layer_idx] = True
        output, weights = self.attend(query, key, value, attention_mask, output_attentions)
        output = output.reshape(batch, length, -1).contiguous()  # (B, T, H, d) -> (B, T, H * d)
        return self.o_proj(output), weights

    def attend(self, query, key, value, attention_mask, output_attentions: bool):
        """`(B, H, T, a)`, `(B, G, S, a)`, `(B, G, S, d)` -> `((B, T, H, d), weights)` through the config's backend.
        Only the mask goes down: no positions (flash attention would read `position_ids` as packed sequences)."""
        implementation = self.config._attn_implementation
        return ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            is_causal=False,
        )


class ZooAdditiveCrossAttention(ZooCrossAttention):
    """Bahdanau's additive cross-attention: queries and keys projected to `cross_attention_additive_dim` per head,
    `score_vector` (H, a) reads the tanh out."""

    mask_kind: ClassVar[str] = "blockwise"
    sized_by: ClassVar[dict[str, str]] = {
        **ZooCrossAttention.sized_by,
        "q_proj": "num_attention_heads, cross_attention_additive_dim, hidden_size",
        "k_proj": "cross_attention_num_key_value_heads, cross_attention_additive_dim, hidden_size",
        "score_vector": "num_attention_heads, cross_attention_additive_dim",
    }

    def __init__(self, config: ZooConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.score_vector = nn.Parameter(torch.empty(self.num_heads, config.cross_attention_additive_dim))

    @classmethod
    def query_key_width(cls, config: ZooConfig) -> int:
        return config.cross_attention_additive_dim  # queries and keys live in the tanh layer's width

    def init_parameters(self, config: ZooConfig) -> None:
        init.normal_(self.score_vector, mean=0.0, std=config.initializer_range)

    def attend(self, query, key, value, attention_mask, output_attentions: bool):
        chunk = None if torch.compiler.is_exporting() else ADDITIVE_QUERY_CHUNK
        return additive_attention(self, query, key, value, attention_mask, self.score_vector, chunk, output_attentions)


def cross_attention_class(config: ZooConfig) -> type[ZooCrossAttention]:
    """The cross-attention module `config.cross_attention` names."""
    return ZooAdditiveCrossAttention if config.cross_attention == "additive" else ZooCrossAttention
