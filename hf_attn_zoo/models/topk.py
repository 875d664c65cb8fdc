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

from .configuration_zoo import ZooChunkedConfig, check_positive_int
from .mha import ZooMultiHeadAttention
from .modeling_zoo import BlockwiseCausalMask, ZooForCausalLM, ZooModel


class ZooTopKConfig(ZooChunkedConfig):
    """`topk`: how many scores each query keeps."""

    model_type = "zoo_topk"
    description = "each query keeps its top-k causal scores (Gupta 2021), chunked over queries"
    cache_per_token = "2·L·G·d_h"

    topk: int = 32

    def _check_variant(self) -> None:
        super()._check_variant()
        check_positive_int(self, "topk", "the number of scores each query keeps", at_most="max_position_embeddings")


class ZooTopKAttention(ZooMultiHeadAttention):
    """GQA projections and cache; the kernel keeps the `topk` best scores of each query."""

    mask_type = "blockwise"

    def attend(self, query, key, value, attention_mask: BlockwiseCausalMask, **kwargs):
        # (B, G, S, d) -> (B, H, S, d): each query head reads its group's key/value head
        key, value = repeat_kv(key, self.num_key_value_groups), repeat_kv(value, self.num_key_value_groups)
        keep, chunk = self.config.topk, self.config.query_chunk_size
        outputs, weights = [], []
        for start in range(0, query.shape[2], chunk):
            end = min(query.shape[2], start + chunk)
            scores = torch.matmul(query[:, :, start:end], key.transpose(2, 3)) * self.scaling  # (B, H, C, S)
            scores = scores + attention_mask.additive(start, end, scores.dtype)
            if keep < scores.shape[-1]:
                kept, index = scores.topk(keep, dim=-1)  # (B, H, C, k)
                kept = F.softmax(kept, dim=-1, dtype=torch.float32).to(query.dtype)
                probabilities = torch.zeros_like(scores).scatter_(-1, index, kept)  # zeros outside the top k
            else:
                probabilities = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
            probabilities = F.dropout(probabilities, self.attention_dropout, training=self.training)
            outputs.append(torch.matmul(probabilities, value))  # (B, H, C, d)
            if kwargs.get("output_attentions"):
                weights.append(probabilities)
        attn_output = torch.cat(outputs, dim=2).transpose(1, 2)  # (B, H, T, d) -> (B, T, H, d)
        return attn_output, torch.cat(weights, dim=2) if weights else None


class ZooTopKModel(ZooModel):
    config_class = ZooTopKConfig
    attention_class = ZooTopKAttention


class ZooTopKForCausalLM(ZooForCausalLM):
    config_class = ZooTopKConfig
    base_model_class = ZooTopKModel


ZooTopKConfig.register_for_auto_class()
ZooTopKModel.register_for_auto_class("AutoModel")
ZooTopKForCausalLM.register_for_auto_class("AutoModelForCausalLM")
