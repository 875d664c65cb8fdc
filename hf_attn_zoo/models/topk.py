"""Top-k attention: each query keeps only its `topk` largest causal scores and takes the softmax over those.

Paper: Gupta et al. 2021, "Memory-efficient Transformers via Top-k Attention". What differs from MHA: after the
scaled dot products, every score outside a query's k largest visible ones is dropped before the softmax, so each
token mixes at most k values. Queries go through in chunks of `query_chunk_size`, each chunk against all keys:
peak memory O(chunk·S), not O(T·S). With k at least the number of visible keys it is plain causal attention (the
`gqa` variant), and the selection is skipped.

Cache per token: 2·L·G·d_h, keys and values as GQA. Deviation from the paper: the paper applies top-k to a
pretrained model at inference; here the same selection also runs in training, gradients flowing through the kept
scores only. Ties at the k-th score are broken by `torch.topk`.
"""

import torch
from torch.nn import functional as F
from transformers.models.llama.modeling_llama import repeat_kv

from .chunked_zoo import chunked_softmax_attention
from .configuration_zoo import HEADS, ZooChunkedConfig, check_positive_int, sized
from .heads_zoo import variant_heads
from .masks_zoo import BlockwiseCausalMask
from .mha import ZooMultiHeadAttention
from .modeling_zoo import ZooModel
from .seq2seq_zoo import seq2seq_classes


class ZooTopKConfig(ZooChunkedConfig):
    """`topk`: how many scores each query keeps."""

    model_type = "zoo_topk"
    paper = 'Gupta et al. 2021, "Memory-efficient Transformers via Top-k Attention"'
    arxiv = ("2106.06899",)
    presets = sized(num_attention_heads=HEADS, num_key_value_heads=(2, 2, 4), topk=(8, 32, 64))
    description = "each query keeps its top-k causal scores (Gupta 2021), chunked over queries"
    cache_per_token = "2·L·G·d_h"

    topk: int = 32

    def _check_variant(self) -> None:
        super()._check_variant()
        check_positive_int(self, "topk", "the number of scores each query keeps", at_most="max_position_embeddings")


class ZooTopKAttention(ZooMultiHeadAttention):
    """GQA projections and cache; the kernel keeps the `topk` best scores of each query."""

    family = "topk"
    parent_weights = ("q_proj", "k_proj", "v_proj", "o_proj")  # the parent's scores, the k largest kept
    native_format = None  # no transformers architecture computes it
    gguf_architecture = None
    backends = ("eager",)  # its own kernel
    compiles_fullgraph = False
    mask_type = "blockwise"
    keeps_scores = "each query's top-k scores"

    def attend(self, query, key, value, attention_mask: BlockwiseCausalMask, **kwargs):
        # (B, G, S, d) -> (B, H, S, d): each query head reads its group's key/value head
        key, value = repeat_kv(key, self.num_key_value_groups), repeat_kv(value, self.num_key_value_groups)
        keep, chunk = self.config.topk, self.config.query_chunk_size
        seen_by_last = attention_mask.past_length + query.shape[2]  # a static cache holds empty slots past that
        output_attentions = kwargs.get("output_attentions")
        if torch.compiler.is_exporting():  # a graph cannot branch on the length or loop over it
            return self._thresholded(query, key, value, attention_mask, output_attentions)
        if keep >= seen_by_last:  # every visible key is kept: plain softmax attention, in eager's order of operations
            return self._dense(query, key, value, attention_mask, output_attentions)

        def scores_of(start: int, end: int, visible: int) -> torch.Tensor:
            scores = torch.matmul(query[:, :, start:end] * self.scaling, key[:, :, :visible].transpose(2, 3))
            scores += attention_mask.additive(start, end, scores.dtype, k_end=visible)  # (B, H, C, K)
            # the k kept scores marked in place and one dense matmul over the chunk's keys: cheaper than gathering
            # the kept values, and the same sum (a dropped score weighs exp(-inf) = 0)
            index = scores.topk(min(keep, visible), dim=-1).indices  # (B, H, C, k)
            kept = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, index, True)  # (B, H, C, K)
            return scores.masked_fill(~kept, float("-inf"))

        # causal: keys after a chunk's last query are never seen, and skipped
        return chunked_softmax_attention(
            self, scores_of, value, query.shape[2], chunk, attention_mask.past_for_chunks, output_attentions
        )

    def _thresholded(self, query, key, value, attention_mask: BlockwiseCausalMask, output_attentions: bool | None):
        """The export-friendly form, free of branches and loops over the length: every query against every key at
        once, scores below the query's k-th largest dropped. k columns of -inf appended to the scores make the k-th
        largest exist whatever the number of keys; a query with fewer than k visible keys then has the mask's
        minimum as its k-th score, keeps every key, and its masked ones weigh 0 after the softmax. Equal to the
        chunked kernel up to rounding and to ties at the k-th score (here all of them are kept)."""
        keep, key_length = self.config.topk, key.shape[2]
        visible = attention_mask.past_length + query.shape[2]  # a static cache's empty slots are never seen
        scores = torch.matmul(query * self.scaling, key[:, :, :visible].transpose(2, 3))  # (B, H, T, K)
        scores = scores + attention_mask.additive(0, query.shape[2], scores.dtype, k_end=visible)
        padded = F.pad(scores, (0, keep), value=float("-inf"))  # (B, H, T, K + k)
        kth = padded.topk(keep, dim=-1).values[..., -1:]  # (B, H, T, 1)
        scores = scores.masked_fill(scores < kth, float("-inf"))
        probabilities = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        probabilities = F.dropout(probabilities, self.attention_dropout, training=self.training)
        output = torch.matmul(probabilities, value[:, :, :visible]).transpose(1, 2)  # (B, H, T, d) -> (B, T, H, d)
        return output, F.pad(probabilities, (0, key_length - visible)) if output_attentions else None

    def _dense(self, query, key, value, attention_mask: BlockwiseCausalMask, output_attentions: bool | None):
        def scores_of(start: int, end: int, visible: int) -> torch.Tensor:
            scores = torch.matmul(query[:, :, start:end], key.transpose(2, 3)) * self.scaling  # (B, H, C, S)
            return scores + attention_mask.additive(start, end, scores.dtype)

        # every chunk against every key (past_length None), as eager's one (T, S) matrix
        chunk = self.config.query_chunk_size
        return chunked_softmax_attention(self, scores_of, value, query.shape[2], chunk, None, output_attentions)


class ZooTopKModel(ZooModel):
    config_class = ZooTopKConfig
    attention_class = ZooTopKAttention


ZooTopKForCausalLM, ZooTopKForSequenceClassification, ZooTopKForTokenClassification, ZooTopKForQuestionAnswering = (
    variant_heads(ZooTopKModel)
)
ZooTopKEncoder, ZooTopKDecoder, ZooTopKSeq2SeqModel, ZooTopKForConditionalGeneration = seq2seq_classes(ZooTopKModel)
