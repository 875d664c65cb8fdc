"""Attention Free Transformer (Zhai et al. 2021, "An Attention Free Transformer"): AFT-full, AFT-local, AFT-simple.

What differs from MHA: there are no query-key dot products and no heads. Keys plus a learned pairwise position bias
w weight the values channel by channel, and the query gates the result (causal form):

    y_t = sigmoid(q_t) * sum_{t' <= t} exp(k_t' + w[t, t']) * v_t' / sum_{t' <= t} exp(k_t' + w[t, t'])

everything element-wise over the model width d. AFT-full learns w for every pair of positions, factorised as
w = u·vᵀ with u, v of shape (max_position_embeddings, `aft_bias_rank`); AFT-local keeps w only for t - t' < s
(`aft_window`) and sets it to 0 outside, as in the paper (not -inf: far tokens still count, unbiased); AFT-simple has
no w at all.

Numerics: exponentials are shifted by causal running maxima, never by a maximum over the whole sequence, whose
rounding would leak the future into earlier outputs. AFT-local and AFT-simple run a chunked scan: per channel, a
running (max, sum of exp·v, sum of exp) of the keys that have left every window, plus the current window computed
exactly; O(T·(chunk + s)·d) time, linear in T. They decode from that state: AFT-simple from three vectors of width d
per layer, AFT-local also from its last s - 1 keys and values. AFT-full is O(T²·d) by nature: per chunk of queries,
the keys before the chunk go through matrix products (shifted per channel by their running max and per row by the
bias' max), the keys inside it are computed exactly; it decodes from cached keys and values.

Cache per token: AFT-full 2·L·d; AFT-local flat after s tokens (2·L·d·(s - 1) + 3·L·d in all); AFT-simple nothing
(a state of 3·L·d). Positions: w is AFT's own position scheme and reads true positions (`position_ids`); absolute
embeddings (sinusoidal, learned) may be added; RoPE and ALiBi act on dot-product scores and are refused.
`output_attentions` gives None: there are no attention weights. Deviations from the paper: causal only (the paper
also has the bidirectional form); AFT-local uses the same factorised w as AFT-full; `attention_dropout` is unused.
"""

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from .cache_zoo import ZooStateCache, state_layer
from .configuration_zoo import ZooChunkedConfig, check_positive_int
from .modeling_zoo import ZooAttention, ZooForCausalLM, ZooModel, key_positions

NO_KEY_YET = -1e30  # running max before any key: exp(NO_KEY_YET - m) is 0 for any real m, and 1 against itself


class ZooAFTConfig(ZooChunkedConfig):
    """Shared by the three AFT variants: no heads (`num_attention_heads` stays 1), no RoPE or ALiBi."""

    supported_position_types = ("none", "sinusoidal", "learned")
    aft_mode: ClassVar[str] = ""

    num_attention_heads: int = 1
    position_embedding_type: str = "none"
    query_chunk_size: int = 16  # the scans do O(T·chunk·d) exact work: small chunks are fastest (measured on CPU)

    def _check_variant(self) -> None:
        super()._check_variant()
        if self.num_attention_heads != 1 or self.num_key_value_heads != 1:
            raise ValueError(
                f"{self.model_type} mixes tokens channel by channel and has no heads: leave num_attention_heads and "
                f"num_key_value_heads at 1 (got {self.num_attention_heads} and {self.num_key_value_heads})."
            )
        if self.aft_mode in ("full", "local"):
            check_positive_int(self, "aft_bias_rank", "the rank of the factorised position bias w = u·vᵀ")


class ZooAFTFullConfig(ZooAFTConfig):
    """`aft_bias_rank`: rank of the factorised pairwise bias."""

    model_type = "zoo_aft_full"
    description = "AFT-full (Zhai 2021): per-channel weights exp(k + w), w = u·vᵀ, causal"
    cache_per_token = "2·L·d"
    aft_mode = "full"

    aft_bias_rank: int = 64
    query_chunk_size: int = 32


class ZooAFTLocalConfig(ZooAFTConfig):
    """`aft_window` (s): the bias applies to the last s positions, itself included; `aft_bias_rank` as AFT-full."""

    model_type = "zoo_aft_local"
    description = "AFT-local: the bias w within a window of s positions, 0 outside"
    cache_per_token = "0 past s tokens (state: 2·L·d·(s-1) + 3·L·d)"
    aft_mode = "local"

    aft_bias_rank: int = 64
    aft_window: int = 32

    def _check_variant(self) -> None:
        super()._check_variant()
        check_positive_int(
            self, "aft_window", "the positions the bias reaches, itself included", at_most="max_position_embeddings"
        )


class ZooAFTSimpleConfig(ZooAFTConfig):
    model_type = "zoo_aft_simple"
    description = "AFT-simple: no bias, a running softmax of the keys over the past"
    cache_per_token = "0 (state: 3·L·d)"
    aft_mode = "simple"


Bias = Callable[[torch.LongTensor, torch.LongTensor], torch.Tensor]


def aft_full(
    keys: torch.Tensor,
    values: torch.Tensor,
    key_valid: torch.Tensor | None,
    bias: Bias,
    query_positions: torch.LongTensor,
    key_positions: torch.LongTensor,
    chunk: int,
) -> torch.Tensor:
    """Causal AFT-full, a chunk of queries at a time. keys, values `(B, S, d)`; the T queries are the last T keys.

    The keys before the chunk (its history) go through matrix products: each channel shifted by its running max over
    the history, each row of the bias by its max, so every factor is <= 1. The keys inside the chunk are computed
    exactly, every (row, channel) shifted by its own max. The two parts then meet at a common max per (row, channel).
    Returns the weighted averages `(B, T, d)`.
    """
    batch, key_length, width = keys.shape
    length = query_positions.shape[1]
    past = key_length - length
    if key_valid is None:
        key_valid = torch.ones(batch, key_length, dtype=torch.bool, device=keys.device)
    masked_keys = keys.masked_fill(~key_valid[..., None], float("-inf"))  # padding never counts
    outputs = []
    for start in range(0, length, chunk):
        end = min(length, start + chunk)
        history, inside = slice(0, past + start), slice(past + start, past + end)
        w = bias(query_positions[:, start:end], key_positions)  # (B, C, S)
        # history: sum over s of exp(w_ts - a_t) * exp(k_sc - M_c) * v_sc, scaled by exp(a_t + M_c)
        channel_max = masked_keys[:, history].amax(dim=1, keepdim=True).detach() if past + start else None
        if channel_max is not None:
            channel_max = torch.where(torch.isfinite(channel_max), channel_max, 0.0)  # (B, 1, d)
            w_history = w[:, :, history].masked_fill(~key_valid[:, None, history], float("-inf"))
            row_max = w_history.amax(dim=-1, keepdim=True).detach()  # (B, C, 1)
            row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
            weights = torch.exp(w_history - row_max)  # (B, C, H), <= 1
            exps = torch.exp(masked_keys[:, history] - channel_max)  # (B, H, d), <= 1
            history_numerator = weights @ (exps * values[:, history])  # (B, C, d)
            history_denominator = weights @ exps
            history_log_scale = row_max + channel_max  # (B, C, d)
            history_log_scale = history_log_scale.masked_fill(history_denominator == 0, float("-inf"))
        # inside the chunk: exponent w_ts + k_sc for the keys s <= t, exactly
        causal = torch.ones(end - start, end - start, dtype=torch.bool, device=keys.device).tril()
        allowed = causal[None] & key_valid[:, None, inside]  # (B, C, C)
        exponent = w[:, :, inside, None] + masked_keys[:, None, inside]  # (B, C, C, d)
        exponent = exponent.masked_fill(~allowed[..., None], float("-inf"))
        row_channel_max = exponent.amax(dim=2)  # (B, C, d)
        if channel_max is not None:
            row_channel_max = torch.maximum(row_channel_max, history_log_scale)
        row_channel_max = torch.where(torch.isfinite(row_channel_max), row_channel_max, 0.0).detach()
        exps = torch.exp(exponent - row_channel_max[:, :, None])  # (B, C, C, d)
        numerator = (exps * values[:, None, inside]).sum(dim=2)
        denominator = exps.sum(dim=2)
        if channel_max is not None:
            scale = torch.exp(history_log_scale - row_channel_max)  # (B, C, d), <= 1
            numerator = numerator + history_numerator * scale
            denominator = denominator + history_denominator * scale
        outputs.append(numerator / torch.where(denominator > 0, denominator, 1.0))
    return torch.cat(outputs, dim=1)


def aft_scan(
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor | None,
    positions: torch.LongTensor,
    state: dict[str, torch.Tensor] | None,
    window: int,
    bias: Bias | None,
    chunk: int,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Causal AFT-local (window s >= 1, `bias` inside it) or AFT-simple (window 0, no bias) as a chunked scan.

    The state holds, per channel, the running max m and the sums n = sum exp(k - m)·v and z = sum exp(k - m) over the
    keys that have left every window, plus the keys, values, positions and validity still inside the window. Each
    chunk of queries combines the state with its window computed exactly, every row shifted by its own running max.
    keys, values `(B, T, d)`; returns the weighted averages `(B, T, d)` and the state after the last token.
    """
    batch, length, width = keys.shape
    if valid is None:
        valid = torch.ones(batch, length, dtype=torch.bool, device=keys.device)
    if state is None:
        empty = keys.new_zeros(batch, 0, width)
        state = {
            "max": keys.new_full((batch, width), NO_KEY_YET),
            "numerator": keys.new_zeros(batch, width),
            "denominator": keys.new_zeros(batch, width),
            "window_keys": empty,
            "window_values": empty,
            "window_positions": positions.new_zeros(batch, 0),
            "window_valid": valid.new_zeros(batch, 0),
        }
    running_max, numerator, denominator = state["max"], state["numerator"], state["denominator"]
    # the window left by earlier calls, then this call's tokens; query i is entry `carried + i`
    all_keys = torch.cat((state["window_keys"], keys), dim=1)
    all_values = torch.cat((state["window_values"], values), dim=1)
    all_positions = torch.cat((state["window_positions"], positions), dim=1)
    all_valid = torch.cat((state["window_valid"], valid), dim=1)
    carried = state["window_keys"].shape[1]
    folded = 0  # entries before this one are in (running_max, numerator, denominator)
    outputs = []
    for start in range(0, length, chunk):
        query_start, query_end = carried + start, carried + min(length, start + chunk)
        span = slice(folded, query_end)  # the keys not yet folded, up to the last query of the chunk
        exponent = all_keys[:, None, span]  # (B, 1, W, d)
        if bias is not None:
            query_positions = all_positions[:, query_start:query_end]  # (B, C)
            distance = query_positions[:, :, None] - all_positions[:, None, span]  # (B, C, W)
            in_window = bias(query_positions, all_positions[:, span]).masked_fill(distance >= window, 0.0)
            exponent = exponent + in_window[..., None]  # (B, C, W, d)
        key_index = torch.arange(folded, query_end, device=keys.device)
        allowed = key_index[None, :] <= torch.arange(query_start, query_end, device=keys.device)[:, None]  # (C, W)
        allowed = allowed[None] & all_valid[:, None, span]  # (B, C, W)
        exponent = torch.where(allowed[..., None], exponent, float("-inf"))
        row_max = torch.maximum(running_max[:, None], exponent.amax(dim=2)).detach()  # (B, C, d)
        exps = torch.exp(exponent - row_max[:, :, None])  # (B, C, W, d)
        decay = torch.exp(running_max[:, None] - row_max)  # (B, C, d): rescale the folded sums to this row's max
        row_numerator = numerator[:, None] * decay + (exps * all_values[:, None, span]).sum(dim=2)
        row_denominator = denominator[:, None] * decay + exps.sum(dim=2)
        outputs.append(row_numerator / torch.where(row_denominator > 0, row_denominator, 1.0))
        # fold the keys that no later query sees in its window (all of them for AFT-simple) into the sums
        fold_to = max(folded, query_end - max(window - 1, 0))
        if fold_to > folded:
            leaving = torch.where(all_valid[:, folded:fold_to, None], all_keys[:, folded:fold_to], float("-inf"))
            new_max = torch.maximum(running_max, leaving.amax(dim=1)).detach()  # (B, d)
            exps = torch.exp(leaving - new_max[:, None])
            decay = torch.exp(running_max - new_max)
            numerator = numerator * decay + (exps * all_values[:, folded:fold_to]).sum(dim=1)
            denominator = denominator * decay + exps.sum(dim=1)
            running_max, folded = new_max, fold_to
    new_state = {
        "max": running_max,
        "numerator": numerator,
        "denominator": denominator,
        "window_keys": all_keys[:, folded:],
        "window_values": all_values[:, folded:],
        "window_positions": all_positions[:, folded:],
        "window_valid": all_valid[:, folded:],
    }
    return torch.cat(outputs, dim=1), new_state


class ZooAFTAttention(ZooAttention):
    """Projections q, k, v (d -> d), the AFT weighting of `config.aft_mode`, the gate sigmoid(q), and `o_proj`."""

    mask_type = "padding"
    reads_positions = True

    def __init__(self, config: ZooAFTConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        width, bias = config.hidden_size, config.attention_bias
        self.mode = config.aft_mode
        self.q_proj = nn.Linear(width, width, bias=bias)
        self.k_proj = nn.Linear(width, width, bias=bias)
        self.v_proj = nn.Linear(width, width, bias=bias)
        self.o_proj = nn.Linear(width, width, bias=bias)
        if self.mode in ("full", "local"):  # w[t, t'] = u[t]·v[t'], near 0 at initialisation
            self.position_bias_u = nn.Embedding(config.max_position_embeddings, config.aft_bias_rank)
            self.position_bias_v = nn.Embedding(config.max_position_embeddings, config.aft_bias_rank)

    def pairwise_bias(self, query_positions: torch.LongTensor, key_positions: torch.LongTensor) -> torch.Tensor:
        """w for every (query, key) pair: `(B, C)`, `(B, S)` -> `(B, C, S)`. Padding positions are clamped to 0."""
        u = self.position_bias_u(query_positions.clamp(min=0)).float()  # (B, C, r)
        v = self.position_bias_v(key_positions.clamp(min=0)).float()  # (B, S, r)
        return u @ v.transpose(1, 2)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, past_key_values=None, **kwargs):
        batch, length, _ = hidden_states.shape
        gate = torch.sigmoid(self.q_proj(hidden_states))
        # the exponentials run in float32 whatever the model's dtype
        keys, values = self.k_proj(hidden_states).float(), self.v_proj(hidden_states).float()  # (B, T, d)
        positions = kwargs["position_ids"].expand(batch, -1)  # (B, T) true positions
        if self.mode != "simple" and not torch.compiler.is_compiling():
            if int(positions.max()) >= self.config.max_position_embeddings:
                raise ValueError(
                    f"position {int(positions.max())} is beyond max_position_embeddings="
                    f"{self.config.max_position_embeddings}, the size of AFT's position bias; shorten the input or "
                    f"build the model with a larger max_position_embeddings."
                )
        valid = attention_mask[:, -length:].bool() if attention_mask is not None else None  # (B, T)
        chunk = self.config.query_chunk_size
        if self.mode == "full":
            if past_key_values is not None:  # keys and values of every position, (B, 1, S, d) in the cache
                cached = past_key_values.update(keys[:, None], values[:, None], self.layer_idx)
                keys, values = cached[0][:, 0], cached[1][:, 0]
            key_valid = attention_mask[:, -keys.shape[1] :].bool() if attention_mask is not None else None
            all_positions = key_positions(positions, keys.shape[1] - length)
            averages = aft_full(keys, values, key_valid, self.pairwise_bias, positions, all_positions, chunk)
        else:
            layer = state_layer(past_key_values, self.layer_idx, self.config.model_type)
            window = self.config.aft_window if self.mode == "local" else 0
            bias = self.pairwise_bias if self.mode == "local" else None
            averages, state = aft_scan(keys, values, valid, positions, layer and layer.read(), window, bias, chunk)
            if layer is not None:
                layer.write(state, length)
        return self.o_proj(gate * averages.to(gate.dtype)), None


class ZooAFTModel(ZooModel):
    attention_class = ZooAFTAttention


class ZooAFTStateModel(ZooAFTModel):
    def make_cache(self) -> ZooStateCache:
        return ZooStateCache(self.config.num_hidden_layers)


class ZooAFTFullModel(ZooAFTModel):
    config_class = ZooAFTFullConfig


class ZooAFTLocalModel(ZooAFTStateModel):
    config_class = ZooAFTLocalConfig


class ZooAFTSimpleModel(ZooAFTStateModel):
    config_class = ZooAFTSimpleConfig


class ZooAFTFullForCausalLM(ZooForCausalLM):
    config_class = ZooAFTFullConfig
    base_model_class = ZooAFTFullModel


class ZooAFTLocalForCausalLM(ZooForCausalLM):
    config_class = ZooAFTLocalConfig
    base_model_class = ZooAFTLocalModel


class ZooAFTSimpleForCausalLM(ZooForCausalLM):
    config_class = ZooAFTSimpleConfig
    base_model_class = ZooAFTSimpleModel


for _config_class in (ZooAFTFullConfig, ZooAFTLocalConfig, ZooAFTSimpleConfig):
    _config_class.register_for_auto_class()
for _model_class in (ZooAFTFullModel, ZooAFTLocalModel, ZooAFTSimpleModel):
    _model_class.register_for_auto_class("AutoModel")
for _model_class in (ZooAFTFullForCausalLM, ZooAFTLocalForCausalLM, ZooAFTSimpleForCausalLM):
    _model_class.register_for_auto_class("AutoModelForCausalLM")
