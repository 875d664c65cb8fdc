"""Additive attention: score(q, k) = vᵀ tanh(W_q x_q + W_k x_k), per head, causal.

Paper: Bahdanau, Cho & Bengio 2015, "Neural Machine Translation by Jointly Learning to Align and Translate". What
differs from MHA: the score of a query and a key is a one-hidden-layer network instead of a dot product: both are
projected to `additive_dim` per head, added, passed through tanh and read out by a learned vector v per head (no
scaling). That costs O(T·S·additive_dim) elementwise work per head where a dot product is one matmul, so queries go
through in chunks of `query_chunk_size`: peak memory O(chunk·S·additive_dim) instead of O(T·S·additive_dim).

Cache per token: L·G·(additive_dim + d_h): keys are cached already projected (W_k x) with the values. Positions:
ALiBi (the default), sinusoidal, learned or none; RoPE rotates dot products and has no meaning here. Deviation from
the paper: there a decoder state attends to the states of a recurrent encoder; here the same score drives causal
multi-head self-attention in a transformer block.
"""

from typing import ClassVar

import torch
from torch import nn
from transformers import initialization as init

from .chunked_zoo import additive_attention
from .configuration_zoo import HEADS, ZooChunkedConfig, check_positive_int, sized
from .heads_zoo import variant_heads
from .masks_zoo import BlockwiseCausalMask
from .mha import ZooMultiHeadAttention
from .modeling_zoo import ZooModel
from .seq2seq_zoo import seq2seq_classes


class ZooAdditiveConfig(ZooChunkedConfig):
    """`additive_dim`: width of the tanh layer of each head's score network."""

    model_type = "zoo_additive"
    paper = 'Bahdanau, Cho & Bengio 2015, "Neural Machine Translation by Jointly Learning to Align and Translate"'
    arxiv = ("1409.0473",)
    presets = sized(num_attention_heads=HEADS, additive_dim=(16, 32, 64))
    description = "Bahdanau scores vᵀtanh(W_q q + W_k k) per head, chunked over queries"
    cache_per_token = "L·G·(a + d_h)"
    supported_position_types = ("alibi", "sinusoidal", "learned", "none")

    position_embedding_type: str = "alibi"
    additive_dim: int = 32
    query_chunk_size: int = 4  # the (chunk, S, additive_dim) tanh block stays in cache: fastest on CPU (measured)

    def _check_variant(self) -> None:
        super()._check_variant()
        check_positive_int(self, "additive_dim", "the width of each head's tanh layer")


class ZooAdditiveAttention(ZooMultiHeadAttention):
    """Queries and keys projected to `additive_dim` per head; `score_vector` (H, additive_dim) reads the tanh out."""

    family = "additive"
    # values and output as the parent's; q_proj and k_proj feed a tanh layer of additive_dim, not a dot product: fresh
    parent_weights = ("v_proj", "o_proj")
    native_format = None  # no transformers architecture computes it
    gguf_architecture = None
    backends = ("eager",)  # its own kernel
    compiles_fullgraph = False
    mask_type = "blockwise"
    scores = "v·tanh(q + k)"
    sized_by: ClassVar[dict[str, str]] = {
        **ZooMultiHeadAttention.sized_by,
        "q_proj": "num_attention_heads, additive_dim, hidden_size",
        "k_proj": "num_key_value_heads, additive_dim, hidden_size",
        "score_vector": "num_attention_heads, additive_dim",
    }

    def __init__(self, config: ZooAdditiveConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.score_vector = nn.Parameter(torch.empty(self.num_heads, config.additive_dim))

    @classmethod
    def query_key_width(cls, config: ZooAdditiveConfig) -> int:
        return config.additive_dim  # queries and keys live in the tanh layer's width

    @classmethod
    def mixing_flops_per_token(cls, config: ZooAdditiveConfig, seq_len: int) -> float:
        # per head and key: q + k and tanh over a channels (2a elementwise, as many as the scores' matmuls, so counted
        # here unlike softmax), v·tanh (2a), then a weighted value (2·d_v)
        return config.num_attention_heads * seq_len * (4 * config.additive_dim + 2 * cls.value_width(config))

    def init_parameters(self, config: ZooAdditiveConfig) -> None:
        init.normal_(self.score_vector, mean=0.0, std=config.initializer_range)

    def attend(self, query, key, value, attention_mask: BlockwiseCausalMask, **kwargs):
        # query (B, H, T, a); key (B, G, S, a) and value (B, G, S, d): the kernel the additive cross-attention shares.
        # While exporting, one chunk (a graph cannot loop over a dynamic length)
        chunk = None if torch.compiler.is_exporting() else self.config.query_chunk_size
        return additive_attention(
            self, query, key, value, attention_mask, self.score_vector, chunk, kwargs.get("output_attentions")
        )


class ZooAdditiveModel(ZooModel):
    config_class = ZooAdditiveConfig
    attention_class = ZooAdditiveAttention


(
    ZooAdditiveForCausalLM,
    ZooAdditiveForSequenceClassification,
    ZooAdditiveForTokenClassification,
    ZooAdditiveForQuestionAnswering,
) = variant_heads(ZooAdditiveModel)
ZooAdditiveEncoder, ZooAdditiveDecoder, ZooAdditiveSeq2SeqModel, ZooAdditiveForConditionalGeneration = seq2seq_classes(
    ZooAdditiveModel
)
