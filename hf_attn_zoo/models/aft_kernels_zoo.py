"""The Attention Free Transformer's kernels (`aft.py` holds the variants, their configs and their attention module).

Causal AFT sums with running maxima, chunked scans, the dense and banded paths from no state, and the decoding state
the scan leaves: the "Numerics" and "Packed rows" notes of `aft.py`'s docstring describe them. They are a sibling
module because they are most of the family's code and the variants read them only through `ZooAFTAttention.forward`.
Like every file of this folder it travels next to a saved AFT checkpoint (remote code), so it imports only torch.
"""

from collections.abc import Callable

import torch
from torch import nn

Bias = Callable[[torch.LongTensor, torch.LongTensor], torch.Tensor]
NO_KEY_YET = -1e30  # running max before any key: exp(NO_KEY_YET - m) is 0 for any real m, and 1 against itself


def _log_sum(exponent: torch.Tensor, values: torch.Tensor, dim: int):
    """(numerator, denominator, log scale) of sum exp(exponent)·values and sum exp(exponent) over `dim`, shifted by
    the max along `dim`. A row with nothing (all exponents -inf) gets sums 0 and scale -inf, so that it never sets
    the common scale of the parts it is combined with."""
    scale = exponent.amax(dim=dim).detach()
    empty = ~torch.isfinite(scale)
    weights = torch.exp(exponent - scale.masked_fill(empty, 0.0).unsqueeze(dim))
    return (weights * values).sum(dim=dim), weights.sum(dim=dim), scale.masked_fill(empty, float("-inf"))


class Pieces:
    """A `(B, N, ...)` tensor cut once along dim 1 into `carried` entries and then pieces of `size`, read back by
    ranges. Slicing the whole tensor once per chunk would give each slice's backward a gradient as large as the
    whole tensor (O(T²/C) work over a sequence); a range read from pieces costs the pieces it touches."""

    def __init__(self, tensor: torch.Tensor, carried: int, size: int | None) -> None:
        if size is None:  # one piece: while exporting, the length is symbolic and there is one chunk
            self.pieces, self.starts = (tensor,), [0]
            return
        sizes = ([carried] if carried else []) + [size] * ((tensor.shape[1] - carried) // size)
        if sum(sizes) < tensor.shape[1]:
            sizes.append(tensor.shape[1] - sum(sizes))
        self.pieces = tensor.split(sizes, dim=1)
        self.starts = [sum(sizes[:i]) for i in range(len(sizes))]

    def __getitem__(self, span: slice) -> torch.Tensor:
        if len(self.pieces) == 1:
            return self.pieces[0][:, span]
        parts = [
            piece[:, max(span.start - start, 0) : span.stop - start]
            for start, piece in zip(self.starts, self.pieces)
            if start < span.stop and span.start < start + piece.shape[1]
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _state(
    running_max: torch.Tensor,
    numerator: torch.Tensor,
    denominator: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.LongTensor,
    valid: torch.Tensor,
    folded: int,
) -> dict[str, torch.Tensor]:
    """What a cache keeps: the running sums of the first `folded` entries, and the entries after them with padding
    keys zeroed (they count for nothing; `valid` says which they are)."""
    return {
        "max": running_max,
        "numerator": numerator,
        "denominator": denominator,
        "keys": keys[:, folded:].masked_fill(~valid[:, folded:, None], 0.0),
        "values": values[:, folded:],
        "positions": positions[:, folded:],
        "valid": valid[:, folded:],
    }


def aft_attend(
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor | None,
    positions: torch.LongTensor,
    state: dict[str, torch.Tensor] | None,
    window: int | None,
    bias: Bias | None,
    chunk: int,
    documents: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Causal AFT over T new tokens, a chunk of queries at a time. keys, values `(B, T, d)` in float32.

    `window` is s for AFT-local (the bias reaches t - t' < s), None for AFT-full (it reaches everything) and 0 for
    AFT-simple (no bias). For a chunk of queries the keys fall in three groups:
    - folded: keys that left every window, kept as per-channel running (max m, sum exp(k - m)·v, sum exp(k - m));
    - history: earlier keys still within some window, through matrix products: shifted per channel by their max
      and per row by the bias' max over them, so every factor is <= 1;
    - inside the chunk: exact, every (row, channel) shifted by its own max.
    The parts meet at a common max per (row, channel). Nothing depends on a later token, so earlier outputs are
    bit-identical when later tokens change. The state carries the running sums and the unfolded keys (for AFT-full,
    all of them: its key/value cache). Returns the weighted averages `(B, T, d)` and the new state.

    `documents` `(B, T)` marks the documents of a packed row (no state then). Documents are contiguous, so the only
    earlier keys a chunk's queries may reach are those of the document of its first query: history keys of other
    documents are dropped before their max is taken, the folded sums are read only by queries of their own document
    and restart when a later document is folded.
    """
    batch, length, width = keys.shape
    if valid is None:
        valid = torch.ones(batch, length, dtype=torch.bool, device=keys.device)
    if documents is not None and state is not None:
        raise ValueError("packed documents are read without a cache: pass cache=None, use_cache=False")
    if state is None:
        empty = keys.new_zeros(batch, 0, width)
        state = {
            "max": keys.new_full((batch, width), NO_KEY_YET),
            "numerator": keys.new_zeros(batch, width),
            "denominator": keys.new_zeros(batch, width),
            "keys": empty,
            "values": empty,
            "positions": positions.new_zeros(batch, 0),
            "valid": valid.new_zeros(batch, 0),
        }
    running_max, numerator, denominator = state["max"], state["numerator"], state["denominator"]
    # the keys carried over from earlier calls, then this call's; query i is entry `carried + i`
    all_keys = torch.cat((state["keys"], keys), dim=1).masked_fill(
        ~torch.cat((state["valid"], valid), 1)[..., None], float("-inf")
    )  # padding never counts
    all_values = torch.cat((state["values"], values), dim=1)
    all_positions = torch.cat((state["positions"], positions), dim=1)
    all_valid = torch.cat((state["valid"], valid), dim=1)
    carried = state["keys"].shape[1]
    exporting = torch.compiler.is_exporting()
    key_pieces, value_pieces = (Pieces(x, carried, None if exporting else chunk) for x in (all_keys, all_values))
    folded = 0  # entries before this one are in (running_max, numerator, denominator)
    folded_document = None if documents is None else documents[:, 0]  # (B,): the document the folded sums hold

    def in_reach(queries: slice, keys_: slice) -> torch.Tensor:
        """The bias of these queries for these keys: w where the window reaches, 0 elsewhere. `(B, C, K)`."""
        if bias is None:
            return all_keys.new_zeros(batch, queries.stop - queries.start, keys_.stop - keys_.start)
        query_positions, key_positions = all_positions[:, queries], all_positions[:, keys_]
        w = bias(query_positions, key_positions)
        if window is not None:
            w = w.masked_fill(query_positions[:, :, None] - key_positions[:, None, :] >= window, 0.0)
        return w

    # A graph cannot loop or branch over a dynamic length: while exporting, one chunk of every query, exact (O(T²·d)
    # memory), and no folding (the state keeps every key, which later calls read as history).
    chunk = length if exporting else chunk
    outputs = []
    for start in (0,) if exporting else range(0, length, chunk):
        first, last = carried + start, carried + min(length, start + chunk)  # the chunk's queries: [first, last)
        queries = slice(first, last)
        folded_scale = running_max[:, None]  # (B, 1, d)
        if documents is not None:
            query_documents = documents[:, queries]  # (B, C)
            reads_folded = query_documents == folded_document[:, None]  # (B, C)
            folded_scale = torch.where(reads_folded[..., None], folded_scale, NO_KEY_YET)  # (B, C, d)
        parts = [(numerator[:, None], denominator[:, None], folded_scale)]  # folded keys
        if first > folded:  # history: [folded, first), all before every query of the chunk
            history = slice(folded, first)
            history_keys, reachable = key_pieces[history], all_valid[:, history]  # (B, H, d), (B, H)
            w = in_reach(queries, history)  # (B, C, H)
            if documents is not None:  # only the first query's document reaches back past the chunk
                first_document = query_documents[:, :1]  # (B, 1)
                reachable = reachable & (documents[:, history] == first_document)
                history_keys = history_keys.masked_fill(~reachable[..., None], float("-inf"))
                w = w.masked_fill((query_documents != first_document)[..., None], float("-inf"))
            w = w.masked_fill(~reachable[:, None, :], float("-inf"))
            channel_max = history_keys.amax(dim=1, keepdim=True).detach()  # (B, 1, d)
            channel_max = torch.where(torch.isfinite(channel_max), channel_max, 0.0)
            row_max = w.amax(dim=-1, keepdim=True).detach()  # (B, C, 1)
            row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
            weights = torch.exp(w - row_max)  # (B, C, H), <= 1
            exps = torch.exp(history_keys - channel_max)  # (B, H, d), <= 1
            history_numerator, history_denominator = weights @ (exps * value_pieces[history]), weights @ exps
            scale = (row_max + channel_max).masked_fill(history_denominator == 0, float("-inf"))
            parts.append((history_numerator, history_denominator, scale))
        causal = torch.ones(last - first, last - first, dtype=torch.bool, device=keys.device).tril()[None]  # (1, C, C)
        if documents is not None:
            causal = causal & (query_documents[:, :, None] == query_documents[:, None, :])  # (B, C, C)
        exponent = in_reach(queries, queries)[..., None] + key_pieces[queries][:, None]  # (B, C, C, d)
        exponent = exponent.masked_fill(~causal[..., None], float("-inf"))
        parts.append(_log_sum(exponent, value_pieces[queries][:, None], dim=2))
        # every part at the largest scale of its (row, channel)
        top = torch.stack([torch.broadcast_to(scale, parts[-1][2].shape) for _, _, scale in parts]).amax(0)
        row_numerator = sum(n * torch.exp(scale - top) for n, _, scale in parts)
        row_denominator = sum(z * torch.exp(scale - top) for _, z, scale in parts)
        outputs.append(row_numerator / torch.where(row_denominator > 0, row_denominator, 1.0))
        # fold the keys no later query reaches with its window (AFT-simple: all of them; AFT-full: none)
        if window is not None and not exporting:
            fold_to = max(folded, last - max(window - 1, 0))
            if fold_to > folded:
                leaving = slice(folded, fold_to)
                leaving_keys = key_pieces[leaving]  # (B, F, d)
                if documents is not None:  # the sums go on with the document of the last key folded
                    last_document = documents[:, fold_to - 1]  # (B,)
                    same = folded_document == last_document  # (B,)
                    numerator = numerator * same[:, None]
                    denominator = denominator * same[:, None]
                    running_max = torch.where(same[:, None], running_max, NO_KEY_YET)
                    outside = documents[:, leaving] != last_document[:, None]  # (B, F)
                    leaving_keys = leaving_keys.masked_fill(outside[..., None], float("-inf"))
                    folded_document = last_document
                part = _log_sum(leaving_keys, value_pieces[leaving], dim=1)
                new_max = torch.maximum(running_max, part[2]).detach()
                numerator = numerator * torch.exp(running_max - new_max) + part[0] * torch.exp(part[2] - new_max)
                denominator = denominator * torch.exp(running_max - new_max) + part[1] * torch.exp(part[2] - new_max)
                running_max, folded = new_max, fold_to
    new_state = _state(running_max, numerator, denominator, all_keys, all_values, all_positions, all_valid, folded)
    return torch.cat(outputs, dim=1), new_state


def aft_dense_attend(
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor | None,
    positions: torch.LongTensor,
    window: int | None,
    bias: Bias,
    documents: torch.LongTensor | None = None,
) -> torch.Tensor:
    """AFT-full (`window` None) or AFT-local (`window` s) over a whole sequence at once, from no state: training,
    scoring and prompts. keys, values `(B, T, d)` in float32; returns the weighted averages `(B, T, d)`.

    exp(w[t, t'] + k[t']) factorises as exp(w[t, t'] - r[t]) · exp(k[t'] - c) · exp(r[t] + c), and the last factor
    cancels between numerator and denominator. So every channel shares one (T, T) matrix of weights and the whole
    sum is two matrix products, with no (T, T, d) tensor:
    - r[t] is the max of row t's reachable biases (the keys at or before t), so exp(w - r) <= 1 and is exactly 0
      past t;
    - c is, per channel, the key of the first valid token of t's document: a key every query of the document
      reads, so no shift depends on a later token. Keys may span hundreds of nats around c, so exp(k - c) and the
      products run in float64 (finite within 709 nats of c; beyond, the caller falls back to `aft_attend`).
    A later key meets an earlier row only through a weight of exactly 0 (a finite product of 0), so earlier outputs
    are bit-identical when later tokens change. O(T²·d) multiply-adds as matrix products and O(T²) elementwise work
    (the chunked scan does O(T·chunk·d) elementwise work, which bounds it on CPU).
    """
    batch, length, width = keys.shape
    index = torch.arange(length, device=keys.device)
    reach = (index[:, None] >= index[None, :]).expand(batch, length, length)  # (B, T, T): causal
    if valid is not None:
        reach = reach & valid[:, None, :]
    if documents is not None:
        reach = reach & (documents[:, :, None] == documents[:, None, :])
    w = bias(positions, positions)  # (B, T, T)
    if window is not None:  # AFT-local: w within the window, 0 (not -inf) beyond it
        w = w.masked_fill(positions[:, :, None] - positions[:, None, :] >= window, 0.0)
    w = w.masked_fill(~reach, float("-inf"))
    row_max = w.amax(dim=-1, keepdim=True).detach()  # (B, T, 1)
    weights = torch.exp(w - torch.where(torch.isfinite(row_max), row_max, 0.0)).double()  # (B, T, T), <= 1
    # per token, the first valid token of its document (its key is read by every query of the document that reads
    # any key): the first valid index at or after the document's first token, (B, T)
    document_start = torch.zeros(batch, length, dtype=torch.long, device=keys.device)
    if documents is not None:
        new_document = torch.ones_like(documents, dtype=torch.bool)
        new_document[:, 1:] = documents[:, 1:] != documents[:, :-1]
        document_start = torch.where(new_document, index, 0).cummax(dim=1).values
    next_valid = index.expand(batch, length) if valid is None else torch.where(valid, index, length - 1)
    next_valid = next_valid.flip(1).cummin(dim=1).values.flip(1)  # (B, T): the first valid index at or after t
    starts = next_valid.gather(1, document_start)
    shift = keys.gather(1, starts[..., None].expand(-1, -1, width)).detach()  # (B, T, d)
    exponent = (keys - shift).double()  # (B, T, d)
    if valid is not None:  # padding keys count for nothing, and a large one must not overflow into a NaN
        exponent = exponent.masked_fill(~valid[..., None], float("-inf"))
    exps = torch.exp(exponent)
    sums = weights @ torch.cat((exps * values.double(), exps), dim=-1)  # (B, T, 2d): numerator | denominator
    numerator, denominator = sums.split(width, dim=-1)
    return (numerator / torch.where(denominator > 0, denominator, 1.0)).float()


def aft_bidirectional_attend(
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor | None,
    positions: torch.LongTensor,
    window: int | None,
    bias: Bias | None,
) -> torch.Tensor:
    """The paper's non-causal AFT over a whole row (an encoder): every valid token weighs every valid token, AFT-full
    (`window` None), AFT-local (`window` s: w for |t - t'| < s, 0 beyond) or AFT-simple (`bias` None: no w). keys,
    values `(B, T, d)` in float32; returns the weighted averages `(B, T, d)`.

    As in `aft_dense_attend`, exp(w[t, t'] + k[t']) = exp(w[t, t'] - r[t]) · exp(k[t'] - c) · exp(r[t] + c) and the
    last factor cancels: one (T, T) weight matrix shared by every channel and two float64 matrix products. Nothing is
    causal here, so the shifts are plain maxima: r[t] over row t's valid biases, c per channel over the row's valid
    keys; every factor is then at most 1 and the largest key's is exactly 1."""
    batch, length, width = keys.shape
    if bias is None:
        w = keys.new_zeros(batch, length, length)  # (B, T, T)
    else:
        w = bias(positions, positions)  # (B, T, T)
        if window is not None:
            w = w.masked_fill((positions[:, :, None] - positions[:, None, :]).abs() >= window, 0.0)
    exponent = keys
    if valid is not None:  # padding keys count for nothing
        w = w.masked_fill(~valid[:, None, :], float("-inf"))
        exponent = keys.masked_fill(~valid[..., None], float("-inf"))
    row_max = w.amax(dim=-1, keepdim=True).detach()  # (B, T, 1)
    weights = torch.exp(w - torch.where(torch.isfinite(row_max), row_max, 0.0)).double()  # (B, T, T), <= 1
    key_max = exponent.amax(dim=1, keepdim=True).detach()  # (B, 1, d)
    exps = torch.exp((exponent - torch.where(torch.isfinite(key_max), key_max, 0.0)).double())  # (B, T, d)
    sums = weights @ torch.cat((exps * values.double(), exps), dim=-1)  # (B, T, 2d): numerator | denominator
    numerator, denominator = sums.split(width, dim=-1)
    return (numerator / torch.where(denominator > 0, denominator, 1.0)).float()


def aft_band_fits(valid: torch.Tensor | None, positions: torch.LongTensor) -> torch.Tensor:
    """Whether AFT-local's window is a band of indices, so that `aft_banded_attend` applies: the positions of every
    row's valid tokens advance by one per token. valid `(B, T)` or None, positions `(B, T)`; a 0-dim bool tensor."""
    index = torch.arange(positions.shape[1], device=positions.device)
    offset = positions - index  # (B, T): constant over a row's valid tokens when they advance by one
    if valid is None:
        return (offset == offset[:, :1]).all()
    first = valid.int().argmax(dim=1, keepdim=True)  # (B, 1): the first valid token (0 in an empty row)
    return (offset == offset.gather(1, first)).logical_or(~valid).all()


def aft_banded_attend(
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor | None,
    positions: torch.LongTensor,
    window: int,
    bias: Bias,
) -> torch.Tensor:
    """AFT-local over whole unpacked rows from no state in O(T·s·d), where `aft_dense_attend` is O(T²·d). keys,
    values `(B, T, d)` in float32; returns the weighted averages `(B, T, d)`. Only where `aft_band_fits`: when the
    positions of a row's valid tokens do not advance by one per token, the window is not a band of indices.

    Beyond the window w is 0, so a key s or more tokens back weighs exp(0 - r[t]) for every row t: those keys enter
    as one running sum. With the shifts of `aft_dense_attend` (r[t] the row's largest reachable bias, c the row's
    first valid key, float64), row t reads
        exp(-r[t]) · sum_{t' <= t - s} exp(k[t'] - c) v[t']
        + sum_{t - s < t' <= t} exp(w[t, t'] - r[t]) · exp(k[t'] - c) v[t'],
    the first a cumulative sum read s rows later, the second a band: queries in blocks of s against the 2s keys of
    their block and the one before, as one batched matrix product. Every weight is positive (the denominator sums
    without cancellation), and row t reads keys up to t only: later keys of its block meet it through a weight of
    exactly 0. The caller takes it when T > 2s, where the band is smaller than the dense (T, T) weights.
    """
    batch, length, width = keys.shape
    if valid is None:
        valid = torch.ones(batch, length, dtype=torch.bool, device=keys.device)
    first = valid.int().argmax(dim=1, keepdim=True)  # (B, 1): the first valid token (0 in an empty row)
    shift = keys.gather(1, first[..., None].expand(-1, -1, width)).detach()  # (B, 1, d): c
    exps = torch.exp((keys - shift).double().masked_fill(~valid[..., None], float("-inf")))  # (B, T, d)
    weighted = torch.cat((exps * values.double(), exps), dim=-1)  # (B, T, 2d): numerator | denominator terms
    # row t: the keys up to t - s (0 rows before s), and whether it has any
    beyond = nn.functional.pad(weighted.cumsum(dim=1), (0, 0, window, 0))[:, :length]  # (B, T, 2d)
    any_beyond = nn.functional.pad(valid.cumsum(dim=1), (window, 0))[:, :length] > 0  # (B, T)

    blocks = (length + window - 1) // window
    pad = blocks * window - length  # the last block filled with nothing, and one empty block before the first
    weighted = nn.functional.pad(weighted, (0, 0, window, pad)).view(batch, blocks + 1, window, 2 * width)
    band_terms = torch.cat((weighted[:, :-1], weighted[:, 1:]), dim=2)  # (B, N, 2s, 2d): block i - 1, then i
    key_valid = nn.functional.pad(valid, (window, pad)).view(batch, blocks + 1, window)
    key_valid = torch.cat((key_valid[:, :-1], key_valid[:, 1:]), dim=2)  # (B, N, 2s)
    key_positions = nn.functional.pad(positions, (window, pad)).view(batch, blocks + 1, window)
    key_positions = torch.cat((key_positions[:, :-1], key_positions[:, 1:]), dim=2)  # (B, N, 2s)
    query_positions = nn.functional.pad(positions, (0, pad)).view(batch, blocks, window)  # (B, N, s)
    w = bias(query_positions.flatten(0, 1), key_positions.flatten(0, 1)).view(batch, blocks, window, 2 * window)
    # query i of a block (index i + s among its 2s keys) reads keys i + 1 .. i + s: the s tokens up to itself
    offsets = torch.arange(2 * window, device=keys.device) - torch.arange(window, device=keys.device)[:, None]
    in_band = (offsets > 0) & (offsets <= window)  # (s, 2s)
    w = w.masked_fill(~(in_band & key_valid[:, :, None, :]), float("-inf"))  # (B, N, s, 2s)
    row_max = w.amax(dim=-1).flatten(1)[:, :length]  # (B, T)
    row_max = torch.maximum(row_max, torch.where(any_beyond, 0.0, float("-inf"))).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    band_weights = torch.exp(w - nn.functional.pad(row_max, (0, pad)).view(batch, blocks, window, 1)).double()
    sums = (band_weights @ band_terms).flatten(1, 2)[:, :length]  # (B, T, 2d)
    # a row with no key beyond the window may have a very negative max: its exp(-max) must not meet 0 as inf · 0
    sums = sums + torch.where(any_beyond, torch.exp(-row_max.double()), 0.0)[..., None] * beyond
    numerator, denominator = sums.split(width, dim=-1)
    return (numerator / torch.where(denominator > 0, denominator, 1.0)).float()


def aft_state_after(
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor | None,
    positions: torch.LongTensor,
    window: int | None,
    documents: torch.LongTensor | None = None,
) -> dict[str, torch.Tensor]:
    """The state `aft_attend` leaves after these tokens from an empty state, for a call that `aft_dense_attend`
    served: AFT-local folds every key but the last s - 1 into running (max, sum exp·v, sum exp) per channel, of the
    document of the last folded key only (a later key never reads another document); AFT-full keeps every key."""
    batch, length, width = keys.shape
    if valid is None:
        valid = torch.ones(batch, length, dtype=torch.bool, device=keys.device)
    fold_to = 0 if window is None else max(length - max(window - 1, 0), 0)
    if fold_to:
        leaving = keys[:, :fold_to].masked_fill(~valid[:, :fold_to, None], float("-inf"))  # (B, F, d)
        if documents is not None:
            other = documents[:, :fold_to] != documents[:, fold_to - 1 : fold_to]  # (B, F)
            leaving = leaving.masked_fill(other[..., None], float("-inf"))
        numerator, denominator, running_max = _log_sum(leaving, values[:, :fold_to], dim=1)
        running_max = torch.where(torch.isfinite(running_max), running_max, NO_KEY_YET)
    else:
        running_max = keys.new_full((batch, width), NO_KEY_YET)
        numerator, denominator = keys.new_zeros(batch, width), keys.new_zeros(batch, width)
    return _state(running_max, numerator, denominator, keys, values, positions, valid, fold_to)


def _running_totals(
    maxima: torch.Tensor, numerators: torch.Tensor, denominators: torch.Tensor, restarts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inclusive running (max, sum exp·v, sum exp) over dim 1 of per-chunk totals `(B, N, d)`, each shifted by its
    own max, starting afresh at every element where `restarts` `(B, N)` is True (a new document).

    A segmented Hillis-Steele scan: after the round with stride s each element holds the combination of itself and
    up to 2s - 1 elements before it, so log2(N) rounds of whole-tensor operations replace N small steps.
    Element i only ever combines elements before it: nothing depends on a later chunk. Combining a (max m, sums n)
    with a later one at m' takes the larger max M and rescales both by exp(m - M) <= 1; a later element that
    restarts drops the earlier one."""
    stride = 1
    while stride < maxima.shape[1]:
        kept = ~restarts[:, stride:, None]  # (B, N - s, 1): the later element does not restart
        earlier_max = torch.where(kept, maxima[:, :-stride], NO_KEY_YET)
        top = torch.maximum(earlier_max, maxima[:, stride:])
        earlier, later = torch.exp(earlier_max - top) * kept, torch.exp(maxima[:, stride:] - top)
        maxima = torch.cat((maxima[:, :stride], top), dim=1)
        numerators = torch.cat(
            (numerators[:, :stride], numerators[:, :-stride] * earlier + numerators[:, stride:] * later), 1
        )
        denominators = torch.cat(
            (denominators[:, :stride], denominators[:, :-stride] * earlier + denominators[:, stride:] * later), 1
        )
        restarts = torch.cat((restarts[:, :stride], restarts[:, stride:] | restarts[:, :-stride]), dim=1)
        stride *= 2
    return maxima, numerators, denominators


def aft_simple_attend(
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor | None,
    state: dict[str, torch.Tensor] | None,
    chunk: int,
    documents: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Causal AFT-simple over T new tokens, all chunks of C tokens at once. keys, values `(B, T, d)` in float32.

    y_t = sum_{t' <= t} exp(k_t') v_t' / sum_{t' <= t} exp(k_t'), per channel, in two levels:
    - inside a chunk, every (query, key) pair at once: `(B, N, C, C, d)` weights exp(k_t' - m_t), where m_t is the max
      over the keys query t reaches (its own and earlier ones of its document in the chunk), so each weight is <= 1
      and a masked pair is exp(-inf) = 0 exactly;
    - across chunks, a running (max, sum exp·v, sum exp) per channel over whole chunks, by a scan in log2(N) rounds
      (`_running_totals`). A chunk's totals are its last query's sums (that query reaches every key of its chunk and
      document), shifted by that query's max. Query t reads the totals of earlier chunks only.
    The two meet at the larger of their maxima. Nothing a query reads depends on a later token, not even in rounding:
    its in-chunk sum adds exact zeros for later keys, and the running totals stop before its chunk. O(T·C·d) work in a
    few large operations, plus O((T/C)·d·log(T/C)) in the scan; C = 4 was fastest in training on CPU (measured
    against 1, 2 and 8).

    Padding keys are set to NO_KEY_YET (finite, so no gradient meets inf - inf) and weigh nothing against any real
    key; padded outputs are 0. `documents` `(B, T)` (packed rows, no state) restricts each query to its document:
    the in-chunk pairs by mask, the running totals by restarting when a chunk ends in a new document and by being
    read only by queries of the document they hold. `state` carries the running totals between calls (decoding).
    """
    batch, length, width = keys.shape
    if documents is not None and state is not None:
        raise ValueError("packed documents are read without a cache: pass cache=None, use_cache=False")
    if valid is None:
        valid = torch.ones(batch, length, dtype=torch.bool, device=keys.device)
    size = min(chunk, length)
    padding = (length + size - 1) // size * size - length
    keys = keys.masked_fill(~valid[..., None], NO_KEY_YET)
    if documents is None:
        documents = torch.zeros(batch, length, dtype=torch.long, device=keys.device)
    if padding:  # the last chunk filled with keys that weigh nothing, in the last token's document
        keys = nn.functional.pad(keys, (0, 0, 0, padding), value=NO_KEY_YET)
        values = nn.functional.pad(values, (0, 0, 0, padding))
        documents = torch.cat((documents, documents[:, -1:].expand(-1, padding)), dim=1)
    chunks = keys.shape[1] // size
    keys = keys.view(batch, chunks, size, width)  # (B, N, C, d)
    values = values.view(batch, chunks, size, width)  # (B, N, C, d)
    documents = documents.view(batch, chunks, size)  # (B, N, C)

    # inside each chunk: query i (dim 2) against key j (dim 3), j <= i in the same document
    causal = torch.ones(size, size, dtype=torch.bool, device=keys.device).tril()  # (C, C)
    reach = causal & (documents[..., :, None] == documents[..., None, :])  # (B, N, C, C)
    exponent = keys[:, :, None].masked_fill(~reach[..., None], float("-inf"))  # (B, N, C, C, d)
    row_max = exponent.amax(dim=3).detach()  # (B, N, C, d), finite: a query reaches its own key
    weights = torch.exp(exponent - row_max[:, :, :, None])  # (B, N, C, C, d), <= 1
    numerator = (weights * values[:, :, None]).sum(dim=3)  # (B, N, C, d)
    denominator = weights.sum(dim=3)  # (B, N, C, d)

    # across chunks: element 0 is the state carried in, element i + 1 chunk i's totals (its last query's sums)
    if state is None:  # nothing yet: max NO_KEY_YET, sums 0
        carried = (
            keys.new_full((batch, 1, width), NO_KEY_YET),
            keys.new_zeros(batch, 1, width),
            keys.new_zeros(batch, 1, width),
        )
    else:
        carried = tuple(state[name][:, None] for name in ("max", "numerator", "denominator"))
    ends_in = torch.cat((documents[:, :1, 0], documents[:, :, -1]), dim=1)  # (B, N + 1): the document each holds
    restarts = torch.cat((torch.zeros_like(ends_in[:, :1]), ends_in[:, 1:] != ends_in[:, :-1]), dim=1).bool()
    elements = [
        torch.cat((first, part[:, :, -1]), 1) for first, part in zip(carried, (row_max, numerator, denominator))
    ]
    running_max, running_numerator, running_denominator = _running_totals(*elements, restarts)  # (B, N + 1, d)
    # chunk j reads the totals up to element j, if its query is in the document they hold
    reads = (documents == ends_in[:, :-1, None])[..., None]  # (B, N, C, 1)
    before_max = torch.where(reads, running_max[:, :-1, None], NO_KEY_YET)  # (B, N, C, d)
    before_numerator, before_denominator = running_numerator[:, :-1, None], running_denominator[:, :-1, None]

    top = torch.maximum(before_max, row_max)  # (B, N, C, d)
    earlier, inside = torch.exp(before_max - top), torch.exp(row_max - top)
    averages = (before_numerator * earlier + numerator * inside) / (
        before_denominator * earlier + denominator * inside
    )
    averages = averages.reshape(batch, chunks * size, width)[:, :length].masked_fill(~valid[..., None], 0.0)
    empty = keys.new_zeros(batch, 0, width)
    new_state = {
        "max": running_max[:, -1],
        "numerator": running_numerator[:, -1],
        "denominator": running_denominator[:, -1],
        "keys": empty,
        "values": empty,
        "positions": documents.new_zeros(batch, 0),
        "valid": valid.new_zeros(batch, 0),
    }
    return averages, new_state
