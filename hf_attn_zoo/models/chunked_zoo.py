"""The softmax tail of kernels that score queries in chunks (top-k, additive): softmax, dropout, and the values.

Top-k and additive attention compute their scores their own way (a dot product pruned to each query's k best, a
one-hidden-layer network), so they cannot go through transformers' attention functions; what follows the scores is
the same for both and is written here once: queries go through in chunks, so that only a chunk's `(C, K)` scores
exist at a time, each chunk against the keys its last query can see; the weights are kept only when
`output_attentions` asks for them, and then the output is computed from them, as eager attention's is.

Like its siblings it travels next to every saved checkpoint that needs it (remote code), so it imports only torch.
"""

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["chunked_softmax_attention", "weighted_values"]


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
