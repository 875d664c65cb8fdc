"""Positions, a backbone choice (`config.position_embedding_type`) shared by every variant.

- `rope`: rotary embeddings (Su et al. 2021), computed once per forward from `position_ids` by `ZooRotaryEmbedding`
  at the variant's rotary width and applied by the attention to queries and keys (`apply_rotary`).
- `alibi`: a per-head linear bias on the attention scores (Press et al. 2022), `alibi_slopes`, folded into the mask.
- `sinusoidal` / `learned`: absolute embeddings of `position_ids` added to the token embeddings.
- `none`: nothing; the causal mask alone carries order.

This module travels with every checkpoint (remote code): it imports only torch, transformers and flat siblings.
"""

import copy
import math

import torch
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from .configuration_zoo import ZooConfig


class ZooRotaryEmbedding(LlamaRotaryEmbedding):
    """Llama's rotary embedding (so every transformers `rope_type` works) at width `dim`, returning exactly what
    Llama's returns, `(cos, sin)` of shape `(B, T, dim)`: clients that rebuild rotated queries with transformers'
    `apply_rotary_pos_emb` (kvpress's presses) read it. `dim` is the variant's rotary width
    (`ZooAttention.rotary_dim`), `config.head_dim` unless the variant's queries and keys are narrower or wider than
    its values."""

    def __init__(self, config: ZooConfig, dim: int | None = None) -> None:
        if dim is not None and dim != config.head_dim:
            config = copy.copy(config)  # transformers' RoPE initialisers read the width from `head_dim`
            config.head_dim = dim
        super().__init__(config=config)


def apply_rotary(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE with transformers' pairing (channel i rotates with channel i + d/2) on `(B, heads, T, d)`:
    `x * cos + rotate_half(x) * sin`, computed as `x * cos + roll(x, d/2) * signed_sin` where `signed_sin` carries
    `rotate_half`'s sign (-sin on the first half of the channels, +sin on the second). The sign is folded once per
    layer on `(B, T, d)`; each of query and key then costs three ops instead of `apply_rotary_pos_emb`'s five."""
    half = query.shape[-1] // 2
    signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(1)  # (B, 1, T, d)
    cos = cos.unsqueeze(1)  # broadcast over heads
    query = torch.addcmul(query * cos, query.roll(half, dims=-1), signed_sin)
    key = torch.addcmul(key * cos, key.roll(half, dims=-1), signed_sin)
    return query, key


def alibi_slopes(num_heads: int) -> list[float]:
    """ALiBi head slopes (Press et al. 2022): the geometric sequence 2^(-8/n), 2^(-16/n), ... for n heads.

    For a head count that is not a power of two, the paper takes the slopes of the closest smaller power of two and
    fills the remaining heads with every other slope of the next power of two.
    """

    def power_of_two_slopes(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(num_heads).is_integer():
        return power_of_two_slopes(num_heads)
    closest = 2 ** math.floor(math.log2(num_heads))
    return power_of_two_slopes(closest) + power_of_two_slopes(2 * closest)[0::2][: num_heads - closest]


def sinusoidal_embedding(position_ids: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Vaswani et al. (2017) positions: sin on even channels, cos on odd ones. `(B, T)` -> `(B, T, dim)`."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, device=position_ids.device, dtype=torch.float32) / dim))
    angles = position_ids[..., None].float() * inv_freq  # (B, T, dim/2)
    # stack -> (B, T, dim/2, 2) -> flatten: channel 2i is sin, 2i+1 is cos of the same frequency
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2).to(dtype)


def key_positions(query_positions: torch.LongTensor, past_length: int) -> torch.LongTensor:
    """True positions of all visible keys: the `past_length` cached keys continue contiguously before the first
    query, the new keys are the queries themselves. `(B, T)` -> `(B, past_length + T)`."""
    past = query_positions[:, :1] + torch.arange(-past_length, 0, device=query_positions.device)  # (B, P)
    return torch.cat((past, query_positions), dim=-1)


def default_position_ids(
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    past_length: int | torch.Tensor,
    count_real_tokens: bool,
) -> torch.LongTensor:
    """Positions when none are given. With `count_real_tokens` (absolute positions, ALiBi, kernels that index
    parameters by position) and a 2D mask, positions count real tokens only, so a left-padded row sees what it sees
    alone (pads sit at 0); otherwise Llama's `arange` after the cached tokens (RoPE alone is relative)."""
    seq_length = inputs_embeds.shape[1]
    if count_real_tokens and attention_mask is not None and attention_mask.ndim == 2:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, past + T)
        return position_ids[:, -seq_length:]
    # `arange(T) + past` rather than `arange(past, past + T)`: a static cache's length is a tensor, which export
    # traces as data, not as a bound of the range
    return (torch.arange(seq_length, device=inputs_embeds.device) + past_length).unsqueeze(0)
