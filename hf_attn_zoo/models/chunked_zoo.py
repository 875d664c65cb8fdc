"""The softmax tail of kernels that score queries in chunks (top-k, additive): softmax, dropout, and the values.

Top-k and additive attention compute their scores their own way (a dot product pruned to each query's k best, a
one-hidden-layer network), so they cannot go through transformers' attention functions; what follows the scores is
the same for both and is written here once: queries go through in chunks, so that only a chunk's `(C, K)` scores
exist at a time, each chunk against the keys its last query can see; the weights are kept only when
`output_attentions` asks for them, and then the output is computed from them, as eager attention's is.

Bahdanau's additive scores themselves are written here too (`additive_attention`): the additive variant's
self-attention and the encoder-decoder's additive cross-attention share them.

Like its siblings it travels next to every saved checkpoint that needs it (remote code), so it imports only torch
and transformers.
"""

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F
from transformers.models.llama.modeling_llama import repeat_kv

__all__ = ["additive_attention", "chunked_softmax_attention", "weighted_values"]


def chunked_softmax_attention(
    module: nn.Module,
    scores_of: Callable[[int, int, int], torch.Tensor],
    value: torch.Tensor,
    query_length: int,
    chunk: int | None,
    past_length: int | None,
    output_attentions: bool | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention over `value` `(B, H, S, d)` from scores computed one chunk of queries at a time: `(B, T, H, d)` and
    the weights `(B, H, T, S)` or None.

    `scores_of(start, end, visible)` gives the masked scores `(B, H, end - start, visible)` of queries `start:end`
    against the first `visible` keys. With `past_length` (the keys before the first query) a chunk sees the keys up
    to its last query, `past_length + end`, and later ones are skipped; with None every chunk sees all S. `chunk` is
    the number of queries per chunk; None is one chunk of every query, for a graph being exported, which cannot loop
    over a dynamic length (`range()` would fix it). Softmax in float32, dropout at `module.attention_dropout`."""
    key_length = value.shape[2]
    starts = (0,) if chunk is None else range(0, query_length, chunk)
    outputs, weights = [], []
    for start in starts:
        end = query_length if chunk is None else min(query_length, start + chunk)
        visible = key_length if past_length is None else past_length + end
        scores = scores_of(start, end, visible)  # (B, H, C, K)
        probabilities = F.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
        probabilities = F.dropout(probabilities, module.attention_dropout, training=module.training)
        if output_attentions:  # the full (C, S) rows, only when asked for
            weights.append(F.pad(probabilities, (0, key_length - visible)))
        else:
            outputs.append(torch.matmul(probabilities, value[:, :, :visible]))  # (B, H, C, d)
    return weighted_values(outputs, weights, value)


def weighted_values(
    outputs: list[torch.Tensor], weights: list[torch.Tensor], value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The result of a chunked kernel: `(B, T, H, d)` and the attention weights `(B, H, T, S)` or None.

    Without weights the chunks' outputs `(B, H, C, d)` are joined. With weights (`output_attentions`) the chunks
    gave their weight rows instead, and the output is computed from the joined matrix, so the weights returned are
    the ones the output depends on (their gradients exist, as for transformers' eager attention)."""
    if weights:
        weights = torch.cat(weights, dim=2)  # (B, H, T, S)
        return torch.matmul(weights, value).transpose(1, 2), weights
    return torch.cat(outputs, dim=2).transpose(1, 2), None  # (B, H, T, d) -> (B, T, H, d)


def additive_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    score_vector: torch.Tensor,
    chunk: int | None,
    output_attentions: bool | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Bahdanau's scores `v_h·tanh(q + k)` per head, then the softmax tail above: query `(B, H, T, a)` (already
    projected, W_q x), key `(B, G, S, a)` (W_k x) and value `(B, G, S, d)` with `G` dividing `H` (query head h reads
    key/value head h // (H / G)), `score_vector` `(H, a)`, `attention_mask` a `BlockwiseCausalMask` (causal or not).
    Returns `(B, T, H, d)` and the weights `(B, H, T, S)` or None. No scaling: the score is a network, not a dot
    product. `chunk` queries at a time (None: all at once)."""
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)  # one key/value head per query head

    def scores_of(start: int, end: int, visible: int) -> torch.Tensor:
        # (B, H, C, 1, a) + (B, H, 1, K, a) -> (B, H, C, K, a); tanh in place: its backward needs only its output
        hidden = (query[:, :, start:end, None, :] + key[:, :, None, :visible, :]).tanh_()
        # (B, H, C·K, a) @ (H, a, 1) -> (B, H, C, K): one batched matmul over the block as it lies in memory
        # (an einsum over the same axes measured 7% slower per training step)
        scores = torch.matmul(hidden.flatten(2, 3), score_vector[:, :, None]).view(hidden.shape[:4])
        scores += attention_mask.additive(start, end, scores.dtype, k_end=visible)
        return scores

    # causal: keys after a chunk's last query are never seen (past_length given) and are skipped
    return chunked_softmax_attention(
        module, scores_of, value, query.shape[2], chunk, attention_mask.past_for_chunks, output_attentions
    )
