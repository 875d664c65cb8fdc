"""Linear attention: the softmax replaced by a positive feature map, so attention becomes a running sum.

Paper: Katharopoulos et al. 2020, "Transformers are RNNs: Fast Autoregressive Transformers with Linear Attention".
What differs from MHA: the similarity of a query and a key is φ(q)·φ(k) with φ(x) = elu(x) + 1 (positive, so the
weights stay positive), not exp(q·k/√d). The associativity of the products then lets every query read two sums
instead of every key (the paper's section 3, causal form, per head):

    y_t = φ(q_t)ᵀ S_t / (φ(q_t)ᵀ z_t + ε),    S_t = Σ_{s≤t} φ(k_s) v_sᵀ  (d x d_v),    z_t = Σ_{s≤t} φ(k_s)  (d)

O(T·d·d_v) time instead of O(T²·d). There is no 1/√d scale (the paper has none: φ is not homogeneous, so a scale
would change the function, not only the temperature). ε = `linear_attention_eps` (1e-6, the paper's released code's)
keeps a query whose sums are still empty (a padding token) at 0 rather than 0/0. Query heads share
`num_key_value_heads` key/value heads as in GQA (query head h reads the sums of key/value head h // (H / G)).

Causal form (training, scoring, a prompt): chunk by chunk, `query_chunk_size` tokens at a time, a query reads the
running (S, z) of the earlier chunks plus the exact masked products φ(Q)φ(K)ᵀ inside its chunk; then the chunk's
φ(K)ᵀV and Σφ(K) are added to the running sums. O(T·(d + c)·d_v) time, O(c²) memory beyond the sums. The
normaliser rides along as one more value channel of ones, so S and z are one `(d, d_v + 1)` matrix per key/value head.

Cache: decoding keeps only that matrix, a state of L·G·d_h·(d_h + 1) values per sequence whatever its length, with
nothing added per token (`ZooStateLayer`); beam search reorders it, and it cannot be cropped (assisted decoding is
refused by the state layer).

Bidirectional form (an encoder's, the paper's non-causal one): S and z summed over every real token of the row, read
by every query.

Positions: the kernel has none of its own, and the causal sums already see the order. Absolute embeddings
(sinusoidal, learned) may be added to the input; an encoder needs one of them, since its sums are order-free. RoPE
and ALiBi act on the dot product inside a softmax and are refused: rotating q and k before φ would make the model
depend on absolute positions (RoFormer's linear form rotates the numerator only, another formula) and ALiBi needs a
score matrix, which this kernel never forms. `output_attentions` gives None for the same reason.

Feature maps (`feature_map`): `"elu"`, the paper's φ(x) = elu(x) + 1 (nothing learned); `"hedgehog"`, Zhang et al.
2024's learned map ("The Hedgehog & the Porcupine"; LoLCATs' feature map): per head a d x d matrix W, φ(x) =
[softmax(xW), softmax(-xW)] over the 2d features, W started at the identity. Trained to reproduce softmax attention's
output (attention transfer), it is what lets a converted model's linear layers come close to the softmax they
replace; the state holds 2d features per key/value head, 2·L·G·d_h·(d_h + 1) values.

Packed rows (several documents in one row, `position_ids` restarting at 0, as in padding-free training): the running
sums restart at each document's first token, and inside a chunk a query reads the keys of its own document only.
Padding tokens contribute nothing (their φ(k) is zeroed). Deviation from the paper: none beyond the backbone's
choices (pre-norm, GQA grouping); `attention_dropout` is unused (there are no attention weights to drop).
"""

from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F
from transformers import initialization as init

from .cache_zoo import ZooStateLayer, state_layer
from .configuration_zoo import HEADS, ZooChunkedConfig, sized
from .heads_zoo import variant_heads
from .masks_zoo import TokenMask
from .mha import ZooMultiHeadAttention
from .modeling_zoo import ZooModel
from .seq2seq_zoo import seq2seq_classes


class ZooLinearConfig(ZooChunkedConfig):
    """`linear_attention_eps` (ε): added to the normaliser φ(q)·z; `query_chunk_size`: tokens per chunk of the causal
    kernel (exact products inside a chunk, running sums across chunks)."""

    model_type = "zoo_linear"
    paper = (
        'Katharopoulos et al. 2020, "Transformers are RNNs: Fast Autoregressive Transformers with Linear Attention"'
    )
    arxiv = ("2006.16236",)
    presets = sized(num_attention_heads=HEADS)
    description = (
        "φ(q)·Σφ(k)vᵀ / φ(q)·Σφ(k), φ = elu + 1 (Katharopoulos 2020) or a learned hedgehog map (LoLCATs), causal by "
        "running sums"
    )
    cache_per_token = "0 (state: L·G·d_h·(d_h + 1), twice with hedgehog)"
    supported_position_types = ("none", "sinusoidal", "learned")

    position_embedding_type: str = "none"
    linear_attention_eps: float = 1e-6
    feature_map: str = "elu"

    def _check_variant(self) -> None:
        super()._check_variant()
        if self.feature_map not in FEATURE_MAPS:
            raise ValueError(
                f"feature_map={self.feature_map!r} is not one of {', '.join(FEATURE_MAPS)}: elu (elu + 1, the "
                f"paper's) or hedgehog (a learned map per head, for models converted from softmax attention)."
            )
        eps = self.linear_attention_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
            raise ValueError(
                f"linear_attention_eps={eps!r} must be a small positive number (the paper's code uses 1e-6): it "
                f"keeps the normaliser φ(q)·Σφ(k) of a query with no keys yet away from zero."
            )


FEATURE_MAPS = ("elu", "hedgehog")


def feature_map(x: torch.Tensor) -> torch.Tensor:
    """φ(x) = elu(x) + 1, the paper's feature map: positive everywhere, linear for x > 0."""
    return F.elu(x) + 1


def hedgehog_feature_map(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """φ(x) = [softmax(xW), softmax(-xW)], a head's own W: `x` `(B, heads, T, d)`, `weight` `(heads, d, d)` ->
    `(B, heads, T, 2d)`. Positive, and it can learn the spikiness of softmax attention that elu + 1 lacks (Zhang et al.
    2024, section 4)."""
    projected = x @ weight  # (B, heads, T, d) @ (heads, d, d)
    return torch.cat((projected.softmax(-1), (-projected).softmax(-1)), dim=-1)


def linear_causal_attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    state: torch.Tensor | None,
    chunk: int,
    eps: float,
    documents: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal form, chunk by chunk. `query` `(B, H, T, d)` and `key` `(B, G, T, d)` already mapped by φ (keys
    zero at padding), `value` `(B, G, T, d_v)`, `state` the running Σφ(k)[v, 1]ᵀ `(B, G, d, d_v + 1)` of the tokens
    before (None: none). Returns the outputs `(B, T, H, d_v)` and the state after the last token. With `documents`
    `(B, T)` (a packed row, no state), a query reads the running sums only when they belong to its document, products
    inside a chunk stay within a document, and the sums restart when a document ends."""
    batch, heads, length, width = query.shape
    kv_heads, value_width = key.shape[1], value.shape[-1]
    groups = heads // kv_heads
    # the normaliser as one more value channel: [v, 1], so Σφ(k)[v, 1]ᵀ holds S and z side by side
    values = torch.cat((value, value.new_ones(*value.shape[:-1], 1)), dim=-1)  # (B, G, T, d_v + 1)
    if state is None:
        state = query.new_zeros(batch, kv_heads, width, value_width + 1)
    # a graph cannot loop over a dynamic length (range() would fix it): while exporting, one chunk of every token,
    # O(T²) memory, the same sums
    exporting = torch.compiler.is_exporting()
    chunk = length if exporting else chunk
    starts = (0,) if exporting else range(0, length, chunk)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=query.device).tril()
    state_document = None if documents is None else documents[:, 0]  # (B,): the document the sums belong to
    # group query heads by their key/value head: (B, H, T, d) -> (B, G, H/G, T, d)
    grouped = query.reshape(batch, kv_heads, groups, length, width)
    outputs = []
    for start in starts:
        end = min(length, start + chunk)
        size = end - start
        within = causal[:size, :size]  # key s <= query t inside the chunk
        reads_state = None
        if documents is not None:
            chunk_documents = documents[:, start:end]  # (B, c)
            same = chunk_documents[:, :, None] == chunk_documents[:, None, :]  # (B, c, c)
            within = (within & same)[:, None, None]  # (B, 1, 1, c, c)
            reads_state = (chunk_documents == state_document[:, None])[:, None, None, :, None]  # (B, 1, 1, c, 1)
        q = grouped[:, :, :, start:end]  # (B, G, H/G, c, d)
        k, v = key[:, :, None, start:end], values[:, :, None, start:end]  # (B, G, 1, c, d), (B, G, 1, c, d_v + 1)
        # earlier chunks through the running sums, this one through its masked products φ(q)·φ(k)
        carried = q @ state[:, :, None]  # (B, G, H/G, c, d_v + 1)
        if reads_state is not None:
            carried = carried.masked_fill(~reads_state, 0.0)
        sums = carried + (q @ k.transpose(-1, -2)).masked_fill(~within, 0.0) @ v  # (B, G, H/G, c, d_v + 1)
        out = sums[..., :value_width] / (sums[..., value_width:] + eps)
        outputs.append(out.reshape(batch, heads, size, value_width))
        k_new = k[:, :, 0]  # (B, G, c, d)
        if documents is not None:
            # the sums carried on hold the document of the chunk's last token: earlier ones end here
            last_document = chunk_documents[:, -1]  # (B,)
            keep = (state_document == last_document)[:, None, None, None]  # (B, 1, 1, 1)
            state = state * keep
            k_new = k_new * (chunk_documents == last_document[:, None])[:, None, :, None]  # (B, G, c, d)
            state_document = last_document
        state = state + k_new.transpose(-1, -2) @ v[:, :, 0]  # (B, G, d, c) @ (B, G, c, d_v + 1)
    output = torch.cat(outputs, dim=2).transpose(1, 2)  # (B, H, T, d_v) -> (B, T, H, d_v)
    return output, state


def linear_bidirectional_attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, eps: float
) -> torch.Tensor:
    """The paper's non-causal form: every query reads Σφ(k)[v, 1]ᵀ over the whole row. `query` `(B, H, T, d)` and
    `key` `(B, G, T, d)` mapped by φ (keys zero at padding), `value` `(B, G, T, d_v)` -> `(B, T, H, d_v)`."""
    batch, heads, length, width = query.shape
    kv_heads, value_width = key.shape[1], value.shape[-1]
    values = torch.cat((value, value.new_ones(*value.shape[:-1], 1)), dim=-1)  # (B, G, T, d_v + 1)
    sums = key.transpose(-1, -2) @ values  # (B, G, d, d_v + 1)
    q = query.reshape(batch, kv_heads, heads // kv_heads, length, width)  # (B, G, H/G, T, d)
    read = q @ sums[:, :, None]  # (B, G, H/G, T, d_v + 1)
    out = read[..., :value_width] / (read[..., value_width:] + eps)
    return out.reshape(batch, heads, length, value_width).transpose(1, 2)  # (B, H, T, d_v) -> (B, T, H, d_v)


class ZooLinearAttention(ZooMultiHeadAttention):
    """GQA projections, φ (elu + 1, or a learned hedgehog map) on queries and keys, and the running sums of
    `linear_causal_attend` (or the whole row's, in an encoder)."""

    family = "linear"
    native_format = None  # no transformers architecture computes it
    gguf_architecture = None
    backends = ("eager",)  # its own kernel
    compiles_fullgraph = False
    cache_layer = ZooStateLayer  # Σφ(k)[v, 1]ᵀ per key/value head: nothing grows with the length
    mask_type = "tokens"
    # converted from softmax attention (LoLCATs' start, Zhang et al. 2024): the parent's projections, φ in place of
    # the softmax (a hedgehog map starts at the identity); attention transfer then trains q, k and the maps
    parent_weights = ("q_proj", "k_proj", "v_proj", "o_proj")
    sized_by: ClassVar[dict[str, str]] = {
        **ZooMultiHeadAttention.sized_by,
        "query_feature_map": "num_attention_heads, head_dim (feature_map: hedgehog)",
        "key_feature_map": "num_key_value_heads, head_dim (feature_map: hedgehog)",
    }

    def __init__(self, config: ZooLinearConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.query_feature_map = self.key_feature_map = None
        if config.feature_map == "hedgehog":  # a d x d map per query head and per key/value head
            self.query_feature_map = nn.Parameter(torch.empty(self.num_heads, self.head_dim, self.head_dim))
            self.key_feature_map = nn.Parameter(torch.empty(self.num_key_value_heads, self.head_dim, self.head_dim))

    def init_parameters(self, config: ZooLinearConfig) -> None:
        for weight in (self.query_feature_map, self.key_feature_map):
            if weight is not None:  # the identity: φ(x) = [softmax(x), softmax(-x)] to start from
                init.copy_(weight, torch.eye(self.head_dim).expand_as(weight))

    @classmethod
    def feature_width(cls, config: ZooLinearConfig) -> int:
        """Features per query or key head after φ: d, or 2d for the hedgehog map."""
        return 2 * config.head_dim if config.feature_map == "hedgehog" else config.head_dim

    def features(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """φ of the queries `(B, H, T, d)` and keys `(B, G, T, d)`, in float32."""
        if self.query_feature_map is None:
            return feature_map(query.float()), feature_map(key.float())
        return (
            hedgehog_feature_map(query.float(), self.query_feature_map.float()),
            hedgehog_feature_map(key.float(), self.key_feature_map.float()),
        )

    @classmethod
    def mixing_flops_per_token(cls, config: ZooLinearConfig, seq_len: int) -> float:
        # per query head: reading the running sums, φ(q)·[S, z] (2·d·(d_v + 1)), and the chunk's exact products,
        # φ(q)·φ(k) and their weighted [v, 1] over c keys (2·c·(d + d_v + 1)); per key/value head, folding a token
        # into the sums (2·d·(d_v + 1)). φ and the division are elementwise, left out as PaLM leaves softmax out
        # a hedgehog map adds its d x d product per query and key head (2·d² each) and doubles the features
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        width, value_width = cls.feature_width(config), cls.value_width(config)
        chunk = min(config.query_chunk_size, seq_len)
        read_and_fold = 2 * width * (value_width + 1) * (heads + kv_heads)
        maps = 2 * config.head_dim**2 * (heads + kv_heads) if config.feature_map == "hedgehog" else 0
        return read_and_fold + 2 * heads * chunk * (width + value_width + 1) + maps

    @classmethod
    def attention_weights_absence(cls, config: ZooLinearConfig) -> str:
        return (
            "its weights φ(q_t)·φ(k_s) / Σ_s φ(q_t)·φ(k_s) are never formed: each query reads the running sums "
            "Σφ(k)vᵀ and Σφ(k) instead"
        )

    @classmethod
    def bidirectional_refusal(cls, config: ZooLinearConfig) -> str | None:
        return None  # the paper's non-causal form (`linear_bidirectional_attend`), on `TokenMask.causal=False`

    def forward(self, hidden_states, attention_mask: TokenMask, position_embeddings=None, cache=None, **kwargs):
        batch, length = hidden_states.shape[:2]
        dtype = hidden_states.dtype
        query, key, value = self.project(hidden_states, None)  # (B, H, T, d), (B, G, T, d) x 2
        # the sums run in float32 whatever the model's dtype: bfloat16 running sums over thousands of tokens drift
        (query, key), value = self.features(query, key), value.float()  # (B, H, T, φ), (B, G, T, φ)
        if attention_mask.padding is not None:  # padding adds nothing to the sums
            key = key * attention_mask.padding[:, None, :, None].to(key.dtype)  # (B, 1, T, 1)
        eps = self.config.linear_attention_eps
        layer = state_layer(cache, self.layer_idx, self.config.model_type)
        if not attention_mask.causal:  # an encoder: every real token of the row, no decoding state
            output = linear_bidirectional_attend(query, key, value, eps)
        else:
            held = layer and layer.read()
            state = held["sums"] if held else None  # (B, G, d, d_v + 1) after the tokens seen so far
            chunk = self.config.query_chunk_size
            output, state = linear_causal_attend(query, key, value, state, chunk, eps, attention_mask.documents)
            if layer is not None:
                layer.write({"sums": state}, length)
        return self.o_proj(output.reshape(batch, length, -1).to(dtype)), None  # (B, T, H, d_v) -> (B, T, H·d_v)


class ZooLinearModel(ZooModel):
    config_class = ZooLinearConfig
    attention_class = ZooLinearAttention


(
    ZooLinearForCausalLM,
    ZooLinearForSequenceClassification,
    ZooLinearForTokenClassification,
    ZooLinearForQuestionAnswering,
) = variant_heads(ZooLinearModel)
(
    ZooLinearEncoder,
    ZooLinearDecoder,
    ZooLinearSeq2SeqModel,
    ZooLinearForConditionalGeneration,
) = seq2seq_classes(ZooLinearModel)
