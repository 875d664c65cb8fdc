"""What the attention modules get as `attention_mask`, by the kind their class declares (`ZooAttention.mask_kind`):

- `"dense"`: transformers' causal mask for the backend, from `masking_utils` (the variant names the builder:
  `create_causal_mask`, or the sliding-window one); with ALiBi, an additive float mask carrying the bias.
- `"blockwise"`: a `BlockwiseCausalMask`, materialised a rectangle of (queries, keys) at a time by chunked kernels.
- `"tokens"`: a `TokenMask` (which new tokens are real, which document of a packed row each belongs to), for kernels
  that keep running sums instead of scores.

Every kind keeps the documents of a packed row apart, by transformers' own rule (`packed_documents`).

An encoder's layers get the same kinds in their bidirectional form (`encoder_mask_for`): transformers' bidirectional
mask for the dense kind (a two-sided band of `window(config)` keys where the variant has a window, ALiBi's bias over
the absolute distance), a `BlockwiseCausalMask` with `causal=False`, a `TokenMask` with `causal=False`. Source padding
is a key mask there and in cross-attention (`cross_attention_mask`). This module travels with every checkpoint
(remote code): it imports only torch, transformers and flat siblings.
"""

from dataclasses import dataclass

import torch
from torch.nn import functional as F
from transformers.cache_utils import Cache
from transformers.masking_utils import create_bidirectional_mask, find_packed_sequence_indices

from .compat_zoo import bidirectional_mask, build_mask, cache_mask_sizes
from .configuration_zoo import ZooConfig
from .positions_zoo import alibi_slopes, key_positions


@dataclass
class BlockwiseCausalMask:
    """A causal attention mask (optionally windowed) with key padding, packed documents and ALiBi, materialised one
    rectangle of (query rows, key columns) at a time, so that kernels which walk over query chunks never hold the
    (T, S) matrix.

    Query i (0-based among the T new tokens) is key `past_length + i` of the S visible keys. With `causal=False` (an
    encoder, a cross-attention) a query sees every key but padding, within `sliding_window` on either side, and
    ALiBi's bias falls with the absolute distance.
    """

    key_length: int  # S
    past_length: int  # keys before the first query
    key_padding: torch.Tensor | None = None  # (B, S) bool, True for real tokens; None when nothing is padded
    sliding_window: int | None = None  # keys j with i - window < j <= i only
    alibi_slopes: torch.Tensor | None = None  # (H,)
    query_positions: torch.LongTensor | None = None  # (B, T) true positions, for ALiBi
    key_positions: torch.LongTensor | None = None  # (B, S)
    documents: torch.LongTensor | None = None  # (B, S) document of each key in a packed row; None: one per row
    causal: bool = True

    @property
    def past_for_chunks(self) -> int | None:
        """The `past_length` chunked kernels read (a chunk sees the keys up to its last query), or None when every
        query sees every key (`causal=False`)."""
        return self.past_length if self.causal else None

    def allowed(
        self, q_start: int, q_end: int, k_start: int = 0, k_end: int | None = None, fill_empty_rows: bool = True
    ) -> torch.Tensor:
        """Boolean `(B or 1, 1, q_end - q_start, k_end - k_start)`, True where query may attend to key. A row with no
        allowed key (a padding query) allows all of them unless `fill_empty_rows=False`, so that kernels stay
        finite; its output is never used."""
        k_end = self.key_length if k_end is None else k_end
        device = self.key_padding.device if self.key_padding is not None else None
        queries = torch.arange(q_start, q_end, device=device)[:, None] + self.past_length  # (C, 1) key index of query
        keys = torch.arange(k_start, k_end, device=device)[None, :]  # (1, K)
        if self.causal:
            allowed = keys <= queries
            if self.sliding_window is not None:
                allowed = allowed & (keys > queries - self.sliding_window)
        else:  # every key, within the window on either side
            allowed = torch.ones(queries.shape[0], keys.shape[1], dtype=torch.bool, device=queries.device)
            if self.sliding_window is not None:
                allowed = (keys - queries).abs() < self.sliding_window
        allowed = allowed[None, None]  # (1, 1, C, K)
        if self.key_padding is not None:
            allowed = allowed & self.key_padding[:, None, None, k_start:k_end]
        if self.documents is not None:  # a packed row: each query sees the keys of its own document only
            query_documents = self.documents[:, self.past_length + q_start : self.past_length + q_end]  # (B, C)
            allowed = allowed & (query_documents[:, None, :, None] == self.documents[:, None, None, k_start:k_end])
        return allowed | ~allowed.any(dim=-1, keepdim=True) if fill_empty_rows else allowed

    def additive(
        self, q_start: int, q_end: int, dtype: torch.dtype, k_start: int = 0, k_end: int | None = None
    ) -> torch.Tensor:
        """Float mask to add to scores: 0 (or the ALiBi bias) where allowed, the dtype's minimum elsewhere.
        `(B or 1, H or 1, C, K)`."""
        allowed = self.allowed(q_start, q_end, k_start, k_end)
        bias = torch.zeros((), dtype=dtype, device=allowed.device)
        if self.alibi_slopes is not None:
            k_end = self.key_length if k_end is None else k_end
            distance = self.query_positions[:, q_start:q_end, None] - self.key_positions[:, None, k_start:k_end]
            distance = distance if self.causal else distance.abs()  # (B, C, K)
            bias = (-self.alibi_slopes.view(1, -1, 1, 1) * distance[:, None]).to(dtype)  # (B, H, C, K)
        return torch.where(allowed, bias, torch.finfo(dtype).min)


@dataclass
class TokenMask:
    """What a kernel that keeps running sums instead of scores (Linformer, AFT) needs to know about the T new tokens:
    which are real, and where the documents of a packed row start (its sums restart there)."""

    padding: torch.Tensor | None = None  # (B, T) bool, True for real tokens; None when nothing is padded
    documents: torch.LongTensor | None = None  # (B, T) document of each token in a packed row; None: one per row
    causal: bool = True  # False: each token reads every real token of the row (an encoder)


def has_padding(attention_mask: torch.Tensor | None) -> bool:
    """Whether a 2D padding mask marks any token as padding. While exporting or compiling, the mask is data the graph
    cannot branch on without breaking: it is then always applied (a mask of ones allows what no mask allows)."""
    if attention_mask is None:
        return False
    return torch.compiler.is_compiling() or not bool(attention_mask.all())


def packed_documents(
    position_ids: torch.LongTensor, attention_mask: torch.Tensor | None, cache: Cache | None, batch: int
) -> torch.LongTensor | None:
    """The document index of each token of a packed row `(B, T)`, or None when each row holds one sequence.

    transformers' rule (`masking_utils`): with no 2D attention mask and no cache (padding-free training, e.g.
    `DataCollatorWithFlattening`), a row whose `position_ids` restart at 0 holds several documents, which must not
    see each other. Dense masks get this from `create_causal_mask`; the blockwise and token masks get it here.
    """
    if attention_mask is not None or cache is not None:
        return None
    return find_packed_sequence_indices(position_ids.expand(batch, -1))


def attention_mask_for(
    attention_class,
    config: ZooConfig,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache: Cache | None,
    position_ids: torch.LongTensor,
    output_attentions: bool = False,
) -> torch.Tensor | BlockwiseCausalMask | TokenMask | None:
    """The `attention_mask` every layer of a model built around `attention_class` receives (module docstring)."""
    kind = attention_class.mask_kind(config, inputs_embeds.shape[1], output_attentions)
    if attention_mask is not None and attention_mask.ndim == 4 and attention_class.mask_type == "dense":
        # a mask built outside the model (continuous batching packs requests and builds it from its paged cache) is
        # used as it is: a variant whose own kind is dense stays on that path rather than switching to its banded one
        kind = "dense"
    if kind == "dense":
        return dense_mask(attention_class, config, inputs_embeds, attention_mask, cache, position_ids)
    if attention_mask is not None and attention_mask.ndim != 2:
        raise ValueError(
            f"{config.model_type} builds its own causal mask and takes a 2D padding mask (batch, length), got a "
            f"{attention_mask.ndim}D attention_mask; pass the padding mask instead."
        )
    documents = packed_documents(position_ids, attention_mask, cache, inputs_embeds.shape[0])
    if kind == "blockwise":
        return blockwise_mask(attention_class, config, inputs_embeds, attention_mask, cache, position_ids, documents)
    padding = None
    if has_padding(attention_mask):
        padding = attention_mask[:, -inputs_embeds.shape[1] :].bool()  # (B, T): the new tokens
    return TokenMask(padding=padding, documents=documents)


def evicting_layers(cache: Cache | None) -> list:
    """The layers of `cache` that evict keys from the middle of the sequence (a window with sink tokens:
    `SinkWindowLayer`), which say what they hold (`kept_blocks`); empty for any other cache."""
    layers = getattr(cache, "layers", None) or []
    return [layer for layer in layers if hasattr(layer, "kept_blocks")]


def kept_columns(mask: torch.Tensor | None, blocks: tuple[int, int], config: ZooConfig) -> torch.Tensor:
    """The dense mask over every position `(B, 1, T, P)`, cut to the columns of the keys an evicting cache returns:
    positions [0, head) and [tail, P), `(B, 1, T, K)`."""
    if not isinstance(mask, torch.Tensor) or config.position_embedding_type == "alibi":
        what = (
            "ALiBi's bias" if isinstance(mask, torch.Tensor) else f"the {config._attn_implementation!r} backend's mask"
        )
        raise ValueError(
            f"the cache evicts keys between the sinks and the window, and {what} cannot be cut to the keys it kept; "
            f"pass cache=model.model.make_cache(), which keeps every key there (or use attn_implementation='sdpa')."
        )
    head, tail = blocks
    return torch.cat([mask[..., :head], mask[..., tail:]], dim=-1)


def dense_mask(
    attention_class,
    config: ZooConfig,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache: Cache | None,
    position_ids: torch.LongTensor,
) -> torch.Tensor | None:
    """The causal and padding mask for the chosen backend; with ALiBi, an additive float mask with the bias."""
    alibi = config.position_embedding_type == "alibi"
    if alibi and config._attn_implementation not in ("eager", "sdpa"):
        raise ValueError(
            f"position_embedding_type='alibi' adds a bias to every attention score, which the "
            f"{config._attn_implementation!r} backend cannot take; load the model with attn_implementation='sdpa' or "
            f"'eager', or use position_embedding_type='rope'."
        )
    padding = attention_mask if attention_mask is not None and attention_mask.ndim == 2 else None
    evicting = evicting_layers(cache)
    for layer in evicting:
        layer.start(padding)
    builder, extra = attention_class.dense_mask_builder(config, padding)
    mask = build_mask(  # transformers' builder, through the fallback for older releases (compat_zoo)
        builder,
        config=config,
        inputs_embeds=inputs_embeds,
        attention_mask=attention_mask,
        cache=cache,
        position_ids=position_ids,
        allow_is_causal_skip=not alibi and not evicting,  # ALiBi's bias, or the kept keys' columns, need it formed
        **extra,
    )
    if evicting:
        mask = kept_columns(mask, evicting[0].kept_blocks(inputs_embeds.shape[1]), config)
    if not alibi:
        return mask
    batch_size, key_length = mask.shape[0], mask.shape[-1]
    query_positions = position_ids.expand(batch_size, -1)  # (B, T)
    keys = key_positions(query_positions, key_length - query_positions.shape[1])  # (B, S)
    distance = query_positions[:, None, :, None] - keys[:, None, None, :]  # (B, 1, T, S)
    slopes = torch.tensor(alibi_slopes(config.num_attention_heads), device=mask.device, dtype=torch.float32)
    bias = -slopes.view(1, -1, 1, 1) * distance  # (B, H, T, S)
    allowed = mask if mask.dtype == torch.bool else mask == 0
    return torch.where(allowed, bias, torch.finfo(inputs_embeds.dtype).min).to(inputs_embeds.dtype)


def blockwise_mask(
    attention_class,
    config: ZooConfig,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache: Cache | None,
    position_ids: torch.LongTensor,
    documents: torch.LongTensor | None = None,
) -> BlockwiseCausalMask:
    batch_size, query_length = inputs_embeds.shape[:2]
    key_length, past_length = query_length, 0
    if cache is not None:
        key_length, _ = cache_mask_sizes(cache, query_length, 0)
        # The queries follow the cached tokens. A rolling (sliding) cache holds only the last of them; a static cache
        # is longer than what it holds, and its slots after the queries are empty (causality hides them).
        past_length = min(int(cache.get_seq_length()), key_length - query_length)
    key_padding = None
    if has_padding(attention_mask):
        seen = attention_mask.shape[1] - query_length  # tokens before the queries, cached or not
        key_padding = attention_mask[:, seen - past_length :].bool()  # (B, past_length + T): the keys held
        key_padding = F.pad(key_padding, (0, key_length - key_padding.shape[1]), value=False)  # (B, S)
    mask = BlockwiseCausalMask(
        key_length=key_length,
        past_length=past_length,
        key_padding=key_padding,
        sliding_window=attention_class.window(config),
        documents=documents,  # packed rows have no cache: the keys are the queries
    )
    if config.position_embedding_type == "alibi":
        mask.alibi_slopes = torch.tensor(
            alibi_slopes(config.num_attention_heads), device=inputs_embeds.device, dtype=torch.float32
        )
        mask.query_positions = position_ids.expand(batch_size, -1)
        # without a cache the keys are the queries (an empty past broadcast against a dynamic length trips exporters)
        no_past = cache is None
        mask.key_positions = mask.query_positions if no_past else key_positions(mask.query_positions, mask.past_length)
    return mask


def encoder_mask_for(
    attention_class,
    config: ZooConfig,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.LongTensor,
) -> torch.Tensor | BlockwiseCausalMask | TokenMask | None:
    """What every encoder layer of a model built around `attention_class` receives: the bidirectional form of the
    variant's mask kind (`mask_type`; the encoder never switches kernels by length), source padding as a key mask.
    Packed rows are not read in an encoder: a source is one sequence."""
    if attention_mask is not None and attention_mask.ndim != 2:
        raise ValueError(
            f"the encoder of {config.model_type} takes a 2D padding mask (batch, source length), got a "
            f"{attention_mask.ndim}D attention_mask."
        )
    window = attention_class.window(config)
    alibi = config.position_embedding_type == "alibi"
    if attention_class.mask_type == "dense":
        band = None
        if window is not None:

            def band(batch_idx, head_idx, q_idx, kv_idx):  # a two-sided band: |i - j| < w, itself included
                return (q_idx - kv_idx).abs() < window

        mask = bidirectional_mask(
            config=config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            and_mask_function=band,
            allow_is_bidirectional_skip=not alibi,  # ALiBi needs the mask materialised to carry its bias
        )
        if not alibi:
            return mask
        positions = position_ids.expand(inputs_embeds.shape[0], -1)  # (B, T)
        distance = (positions[:, None, :, None] - positions[:, None, None, :]).abs()  # (B, 1, T, T)
        slopes = torch.tensor(alibi_slopes(config.num_attention_heads), device=mask.device, dtype=torch.float32)
        bias = -slopes.view(1, -1, 1, 1) * distance  # (B, H, T, T)
        allowed = mask if mask.dtype == torch.bool else mask == 0
        return torch.where(allowed, bias, torch.finfo(inputs_embeds.dtype).min).to(inputs_embeds.dtype)
    padding = attention_mask.bool() if has_padding(attention_mask) else None  # (B, T)
    if attention_class.mask_type == "tokens":
        return TokenMask(padding=padding, causal=False)
    length = inputs_embeds.shape[1]
    mask = BlockwiseCausalMask(
        key_length=length, past_length=0, key_padding=padding, sliding_window=window, causal=False
    )
    if alibi:
        mask.alibi_slopes = torch.tensor(
            alibi_slopes(config.num_attention_heads), device=inputs_embeds.device, dtype=torch.float32
        )
        mask.query_positions = mask.key_positions = position_ids.expand(inputs_embeds.shape[0], -1)
    return mask


def cross_attention_mask(
    mask_kind: str,
    config: ZooConfig,
    inputs_embeds: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    encoder_attention_mask: torch.Tensor | None,
) -> torch.Tensor | BlockwiseCausalMask | None:
    """The mask of a cross-attention from the decoder's `inputs_embeds` `(B, T, d)` to `encoder_hidden_states`
    `(B, S, d)`: every query sees every real source token. `"dense"`: transformers' bidirectional mask for the
    backend (None when nothing is padded); `"blockwise"`: a `BlockwiseCausalMask` with `causal=False`."""
    if encoder_attention_mask is not None and encoder_attention_mask.ndim != 2:
        raise ValueError(
            f"encoder_attention_mask must be the 2D padding mask of the source (batch, source length), got a "
            f"{encoder_attention_mask.ndim}D tensor."
        )
    if mask_kind == "dense":
        return create_bidirectional_mask(
            config=config,
            inputs_embeds=inputs_embeds,
            attention_mask=encoder_attention_mask,
            encoder_hidden_states=encoder_hidden_states,
        )
    padding = encoder_attention_mask.bool() if has_padding(encoder_attention_mask) else None  # (B, S)
    return BlockwiseCausalMask(
        key_length=encoder_hidden_states.shape[1], past_length=0, key_padding=padding, causal=False
    )
