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
per layer, AFT-local also from its last s - 1 keys and values. AFT-simple's scan (`aft_simple_attend`) computes every
chunk at once and keeps only a small per-chunk step sequential, since without a bias nothing else differs per chunk.
AFT-full is O(T²·d) by nature: per chunk of queries, the keys before the chunk go through matrix products (shifted
per channel by their running max and per row by the bias' max), the keys inside it are computed exactly; it decodes
from cached keys and values. From no state (training, scoring, a prompt) AFT-full and AFT-local skip the chunks:
`aft_dense_attend` shares one (T, T) weight matrix among all channels and sums with two float64 matrix products;
AFT-local on unpacked rows longer than 2s takes `aft_banded_attend` instead, a running sum for the keys beyond the
window and a band of matrix products within it, O(T·s·d). `aft_state_after` builds the state the chunked scan would
have left.

Cache per token: AFT-full 2·L·d; AFT-local flat after s tokens (2·L·d·(s - 1) + 3·L·d in all); AFT-simple nothing
(a state of 3·L·d). Positions: w is AFT's own position scheme and reads true positions (`position_ids`); absolute
embeddings (sinusoidal, learned) may be added; RoPE and ALiBi act on dot-product scores and are refused.
`output_attentions` gives None: there are no attention weights. Deviations from the paper: AFT-local uses the same
factorised w as AFT-full; `attention_dropout` is unused.

Bidirectional form (an encoder's, the paper's own, `aft_bidirectional_attend`): every real token of the row is
summed, y_t = sigmoid(q_t) * sum_{t'} exp(k_t' + w[t, t']) * v_t' / sum_{t'} exp(k_t' + w[t, t']); AFT-local's
window reaches s - 1 positions on either side (|t - t'| < s).

Packed rows (several documents in one row, `position_ids` restarting at 0, as in padding-free training): a token
weighs the keys of its own document only; the running sums restart at each document, and every max used for
shifting is taken over keys of the query's document, so no document changes another's rounding.
"""

from typing import ClassVar

import torch
from torch import nn

from .aft_kernels_zoo import (
    aft_attend,
    aft_band_fits,
    aft_banded_attend,
    aft_bidirectional_attend,
    aft_dense_attend,
    aft_simple_attend,
    aft_state_after,
)
from .cache_zoo import ZooStateLayer, state_layer
from .configuration_zoo import ZooChunkedConfig, check_positive_int, sized
from .heads_zoo import variant_heads
from .layers_zoo import ZooAttention
from .masks_zoo import TokenMask
from .modeling_zoo import ZooModel
from .seq2seq_zoo import seq2seq_classes


class ZooAFTConfig(ZooChunkedConfig):
    """Shared by the three AFT variants: no heads (`num_attention_heads` stays 1), no RoPE or ALiBi."""

    supported_position_types = ("none", "sinusoidal", "learned")
    paper = 'Zhai et al. 2021, "An Attention Free Transformer"'
    arxiv = ("2105.14103",)
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
    position_table = "AFT's position bias"
    presets = sized(aft_bias_rank=(8, 64, 64))

    aft_bias_rank: int = 64
    query_chunk_size: int = 32


class ZooAFTLocalConfig(ZooAFTConfig):
    """`aft_window` (s): the bias applies to the last s positions, itself included; `aft_bias_rank` as AFT-full."""

    model_type = "zoo_aft_local"
    description = "AFT-local: the bias w within a window of s positions, 0 outside"
    cache_per_token = "0 past s tokens (state: 2·L·d·(s-1) + 3·L·d)"
    aft_mode = "local"
    position_table = "AFT's position bias"
    presets = sized(aft_bias_rank=(8, 64, 64), aft_window=(16, 64, 128))

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

    query_chunk_size: int = 4  # aft_simple_attend's chunk: fastest of 1, 2, 4 and 8 in training on CPU (measured)


class ZooAFTAttention(ZooAttention):
    """Projections q, k, v (d -> d), the AFT weighting of `config.aft_mode`, the gate sigmoid(q), and `o_proj`."""

    sized_by: ClassVar[dict[str, str]] = {
        **{name: "hidden_size" for name in ("q_proj", "k_proj", "v_proj", "o_proj")},
        "position_bias_u": "max_position_embeddings, aft_bias_rank",
        "position_bias_v": "max_position_embeddings, aft_bias_rank",
    }

    family = "aft"
    # values (the parent's key/value heads repeated to every query head's channels) and output; q_proj is a gate
    # and k_proj per-channel weights, not dot-product queries and keys: fresh
    parent_weights = ("v_proj", "o_proj")
    parent_head_fields = ()  # no heads: channel by channel
    cache_layer = ZooStateLayer  # running sums (and, for AFT-local/full, the keys still within reach)
    mask_type = "tokens"
    reads_positions = True  # the pairwise bias w is indexed by true positions
    lora_targets = ("q_proj", "k_proj", "v_proj", "o_proj")  # q_proj is the gate sigmoid(q), k_proj AFT's keys

    @classmethod
    def mixing_flops_per_token(cls, config: ZooAFTConfig, seq_len: int) -> float:
        # full: a weighted sum of exp(k)·v and exp(k) over every key, channel by channel (2·2d per key), and the bias
        # u·vᵀ (2r per key); local: the same over the last s keys, those beyond entering through running sums; simple:
        # only running sums, elementwise (exp, exp·v, two sums, one division: 5 per channel)
        if config.aft_mode == "simple":
            return 5 * config.hidden_size
        keys = seq_len if config.aft_mode == "full" else min(seq_len, config.aft_window)
        return keys * (4 * config.hidden_size + 2 * config.aft_bias_rank)

    @classmethod
    def bidirectional_refusal(cls, config: ZooAFTConfig) -> str | None:
        return None  # the paper's non-causal form (`aft_bidirectional_attend`), on `TokenMask.causal=False`

    @classmethod
    def attention_weights_absence(cls, config: ZooAFTConfig) -> str:
        return "AFT has no query-key scores: each channel of the output is its own weighted average of the values"

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

    def forward(self, hidden_states, attention_mask: TokenMask, position_embeddings=None, cache=None, **kwargs):
        batch, length, _ = hidden_states.shape
        gate = torch.sigmoid(self.q_proj(hidden_states))
        # the exponentials run in float32 whatever the model's dtype
        keys, values = self.k_proj(hidden_states).float(), self.v_proj(hidden_states).float()  # (B, T, d)
        positions = kwargs["position_ids"].expand(batch, -1)  # (B, T) true positions
        if self.mode != "simple" and not torch.compiler.is_compiling():
            self.config.check_position_table(int(positions.max()))
        layer = state_layer(cache, self.layer_idx, self.config.model_type)
        chunk, documents, state = self.config.query_chunk_size, attention_mask.documents, layer and layer.read()
        exporting = torch.compiler.is_exporting()
        window = {"full": None, "simple": 0}.get(self.mode, getattr(self.config, "aft_window", None))
        averages = None
        if not attention_mask.causal:  # an encoder: every token of the row, no decoding state
            bias = None if self.mode == "simple" else self.pairwise_bias
            averages = aft_bidirectional_attend(keys, values, attention_mask.padding, positions, window, bias)
            return self.o_proj(gate * averages.to(gate.dtype)), None
        if self.mode == "simple" and not exporting:  # exporting: aft_attend's one-chunk graph
            averages, state = aft_simple_attend(keys, values, attention_mask.padding, state, chunk, documents)
        elif state is None and not exporting:  # from the first token (training, scoring, a prompt): all at once
            padding, bias = attention_mask.padding, self.pairwise_bias
            # the band costs T·2s weights against the dense path's T²: worth it past two windows. Whether it fits is
            # data, so compiled code takes the dense path: torch.cond would keep both in one graph, but dynamo (torch
            # 2.13) then drops the Python state the graph sets after it, such as transformers' output collector (the
            # next eager call returned no hidden states)
            banded = window is not None and length > 2 * window and documents is None
            if banded and not torch.compiler.is_compiling() and aft_band_fits(padding, positions):
                averages = aft_banded_attend(keys, values, padding, positions, window, bias)
            else:
                averages = aft_dense_attend(keys, values, padding, positions, window, bias, documents)
            if not torch.compiler.is_compiling() and not torch.isfinite(averages).all():
                averages = None  # keys beyond float64's range around their document's first key: the exact scan
            elif layer is not None:
                state = aft_state_after(keys, values, attention_mask.padding, positions, window, documents)
        if averages is None:
            bias = None if self.mode == "simple" else self.pairwise_bias
            averages, state = aft_attend(
                keys, values, attention_mask.padding, positions, state, window, bias, chunk, documents
            )
        if layer is not None:
            layer.write(state, length)
        return self.o_proj(gate * averages.to(gate.dtype)), None


class ZooAFTFullModel(ZooModel):
    config_class = ZooAFTFullConfig
    attention_class = ZooAFTAttention


(
    ZooAFTFullForCausalLM,
    ZooAFTFullForSequenceClassification,
    ZooAFTFullForTokenClassification,
    ZooAFTFullForQuestionAnswering,
) = variant_heads(ZooAFTFullModel)
ZooAFTFullEncoder, ZooAFTFullDecoder, ZooAFTFullSeq2SeqModel, ZooAFTFullForConditionalGeneration = seq2seq_classes(
    ZooAFTFullModel
)


class ZooAFTLocalModel(ZooModel):
    config_class = ZooAFTLocalConfig
    attention_class = ZooAFTAttention


(
    ZooAFTLocalForCausalLM,
    ZooAFTLocalForSequenceClassification,
    ZooAFTLocalForTokenClassification,
    ZooAFTLocalForQuestionAnswering,
) = variant_heads(ZooAFTLocalModel)
ZooAFTLocalEncoder, ZooAFTLocalDecoder, ZooAFTLocalSeq2SeqModel, ZooAFTLocalForConditionalGeneration = seq2seq_classes(
    ZooAFTLocalModel
)


class ZooAFTSimpleModel(ZooModel):
    config_class = ZooAFTSimpleConfig
    attention_class = ZooAFTAttention


(
    ZooAFTSimpleForCausalLM,
    ZooAFTSimpleForSequenceClassification,
    ZooAFTSimpleForTokenClassification,
    ZooAFTSimpleForQuestionAnswering,
) = variant_heads(ZooAFTSimpleModel)
ZooAFTSimpleEncoder, ZooAFTSimpleDecoder, ZooAFTSimpleSeq2SeqModel, ZooAFTSimpleForConditionalGeneration = (
    seq2seq_classes(ZooAFTSimpleModel)
)
