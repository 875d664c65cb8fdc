"""Sliding-window attention: each token attends to the last `sliding_window` tokens, itself included.

Papers: Beltagy et al. 2020, "Longformer" (local windowed attention); Jiang et al. 2023, "Mistral 7B" (causal sliding
window with a rolling cache), which this follows. What differs from MHA: the causal mask is cut to a band of w keys,
and the cache keeps only the last w - 1 keys and values (transformers' `DynamicSlidingWindowLayer`), so decoding
memory stops growing after w tokens. Query heads share `num_key_value_heads` key/value heads as in GQA.

Cache per token: 2·L·G·d_h until w tokens, then flat: 2·L·G·d_h·(w - 1) in all, whatever the length (with s sink
tokens, 2·L·G·d_h·(s + p + w - 1), p the longest left padding).

Two kernels. Short inputs go through the backend with transformers' sliding-window mask (eager, sdpa, flash
attention 2 with its native window, flex). Long inputs (more than 2w new tokens, on eager or sdpa) take a banded
path that walks over blocks of queries, each attending only to the keys of its band: O(T·w) time and memory
instead of O(T²). With w >= T both are plain causal attention, the `gqa` variant. Deviation from the papers: none.

Sink tokens (`num_sink_tokens` = s > 0; Xiao et al. 2023, "Efficient Streaming Language Models with Attention
Sinks"): every query also sees the first s tokens of its row (after any left padding), however far back. A model
trained with full attention puts much of its attention on the first token whatever it says; a window that cuts it
off changes every later layer's input (SmolLM2-135M converted, held-out perplexity 20.8: a window of 256 keys 29.3,
with four sinks 20.9). With sinks the dense path runs (transformers' causal mask and-ed with window-or-sink; eager,
sdpa or flex), and the model's cache (`SinkWindowCache`, StreamingLLM's) keeps the sinks and the last w - 1 keys and
evicts those between, which no later query sees: 2·L·G·d_h·(s + p + w - 1) at most, p the batch's longest left
padding. Keys keep the positions they were computed at, so decoding from it computes the scores the uncached forward
does. Under flex attention, or with ALiBi, the cache keeps every key instead (a block mask, or a bias by distance,
cannot be cut to the kept keys' columns). Clients that build the window mask themselves (Mistral's export,
llama.cpp, vLLM, continuous batching) are refused.
"""

import copy
from collections.abc import Callable

import torch
from torch.nn import functional as F
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from .configuration_zoo import HEADS, ZooConfig, sized
from .heads_zoo import variant_heads
from .masks_zoo import BlockwiseCausalMask
from .mha import ZooMultiHeadAttention
from .modeling_zoo import ZooModel
from .seq2seq_zoo import seq2seq_classes


class ZooSlidingWindowConfig(ZooConfig):
    """`sliding_window` (w): how many keys each token sees, itself included; `num_sink_tokens` (s): the first s
    tokens every token sees besides (0: none)."""

    model_type = "zoo_sliding_window"
    paper = 'Jiang et al. 2023, "Mistral 7B"; Beltagy et al. 2020, "Longformer"'
    arxiv = ("2310.06825", "2004.05150")
    presets = sized(num_attention_heads=HEADS, num_key_value_heads=(2, 2, 4), sliding_window=(32, 256, 1024))
    description = "causal window of w keys (Mistral), optional sink tokens; banded O(T·w) kernel for long inputs"
    cache_per_token = "2·L·G·d_h, flat past w tokens"

    sliding_window: int = 512
    num_sink_tokens: int = 0

    def _check_variant(self) -> None:
        sinks = self.num_sink_tokens
        if not isinstance(sinks, int) or isinstance(sinks, bool) or sinks < 0:
            raise ValueError(
                f"num_sink_tokens={sinks!r} must be an integer >= 0: how many of the first tokens every token sees "
                f"besides its window (0 for a plain window)."
            )
        if sinks and (self.is_encoder_decoder or not self.is_decoder):
            raise ValueError(
                f"num_sink_tokens={sinks}: sink tokens belong to a causal decoder; an encoder-decoder or the "
                f"bidirectional form (is_decoder=False) takes the plain window, num_sink_tokens=0."
            )
        if (
            not isinstance(self.sliding_window, int)
            or isinstance(self.sliding_window, bool)
            or self.sliding_window < 1
        ):
            raise ValueError(
                f"sliding_window={self.sliding_window!r} must be a positive integer: the number of keys each token "
                f"attends to, itself included (use a value >= max_position_embeddings for full causal attention)."
            )


class SinkWindowLayer(DynamicLayer):
    """One layer's keys and values for a window of `window` keys with `sinks` sink tokens (StreamingLLM's cache, Xiao
    et al. 2023): the positions up to the last sink of every row, and the last `window - 1`; those between, which no
    later query sees, are evicted after each update. Keys keep the positions (RoPE) they were computed at, so the
    scores are the uncached forward's.

    What it holds is always two runs of positions, [0, head) and [tail, seen): `kept_blocks` tells the mask which
    positions the next update returns (the dense mask over every position, cut to those columns, by slicing), and
    `start` sets how far the sinks reach from the padding mask: past the longest left padding of the batch's rows.
    Until every row has a real token (a chunked prefill of a padded batch), nothing is evicted."""

    is_croppable = False  # the evicted keys cannot come back

    def __init__(self, window: int, sinks: int) -> None:
        super().__init__()
        self.window, self.sinks = window, sinks
        self.clear()

    def clear(self) -> None:
        self.sink_span: int | None = None  # positions below it are sinks; None until every row has a real token
        self.cumulative_length = 0  # every token seen, evicted ones included
        self.head = self.tail = 0  # held: positions [0, head) and [tail, cumulative_length)

    def start(self, attention_mask: torch.Tensor | None) -> None:
        """Fix how far the sinks reach, once the 2D padding mask (of every token so far and the new ones) shows each
        row's first real token; without a padding mask every row starts at 0."""
        if self.sink_span is not None:
            return
        if attention_mask is None or attention_mask.ndim != 2:
            self.sink_span = self.sinks
        elif bool(attention_mask.bool().any(-1).all()):
            self.sink_span = int(attention_mask.long().argmax(-1).max()) + self.sinks  # the latest first real token

    def kept_blocks(self, query_length: int) -> tuple[int, int]:
        """(head, tail): the next `update` of `query_length` new tokens returns the keys of positions [0, head) and
        [tail, seen + query_length), in that order."""
        return self.head, self.tail

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys = torch.cat([self.keys, key_states], dim=-2)  # (B, G, K + T, d): [0, head), then [tail, seen)
        values = torch.cat([self.values, value_states], dim=-2)
        self.cumulative_length += key_states.shape[-2]
        seen = self.cumulative_length
        if self.sink_span is None:  # a row has no real token yet: where its sinks lie is unknown, keep every key
            head = tail = seen
        else:  # the next query (position `seen`) sees the sinks and the keys less than a window behind it
            head = min(self.sink_span, seen)
            tail = max(seen - self.window + 1, head)
        # [0, head) lies within what is held ([0, self.head) is, and so is everything when head > self.head, since
        # nothing was evicted before the sinks were known); [tail, seen) is the last seen - tail keys
        self.keys = torch.cat([keys[:, :, :head], keys[:, :, keys.shape[2] - (seen - tail) :]], dim=-2)
        self.values = torch.cat([values[:, :, :head], values[:, :, values.shape[2] - (seen - tail) :]], dim=-2)
        self.head, self.tail = head, tail
        return keys, values

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        """Every position so far: the mask is built over them and then cut to `kept_blocks`' columns. (Before
        transformers 5.3 the new tokens' `cache_position` comes instead of their count.)"""
        length = query_length if isinstance(query_length, int) else len(query_length)
        return self.cumulative_length + length, 0

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def reset(self) -> None:
        self.keys = self.values = None  # dropped, as `update` grows them by concatenation
        self.is_initialized = False
        self.clear()

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError(
            "a window with sink tokens evicts the keys between the sinks and the window, so its cache cannot be "
            "cropped back (assisted or prompt-lookup decoding); generate without an assistant."
        )


class SinkWindowCache(Cache):
    """The cache of a model whose window has sink tokens: a `SinkWindowLayer` per decoder layer."""

    def __init__(self, num_layers: int, window: int, sinks: int) -> None:
        super().__init__(layers=[SinkWindowLayer(window, sinks) for _ in range(num_layers)])


class ZooSlidingWindowAttention(ZooMultiHeadAttention):
    """GQA projections and cache; the mask (or the banded kernel) limits each query to the last w keys."""

    family = "sliding_window"
    parent_weights = ("q_proj", "k_proj", "v_proj", "o_proj")  # the parent's attention, seen through a window
    native_format = "mistral"  # the same mask builder over the same `sliding_window`
    gguf_architecture = "granite_swa"  # Llama's layout with a window; llama.cpp's `llama` ignores the window
    dense_mask_function = staticmethod(create_sliding_window_causal_mask)  # with sinks: create_causal_mask, cut

    @property
    def sinks(self) -> int:
        return self.config.num_sink_tokens

    @classmethod
    def mask_kind(cls, config: ZooSlidingWindowConfig, query_length: int, output_attentions: bool) -> str:
        """The banded kernel (a blockwise mask) for more than 2w new tokens on eager/sdpa, unless the weights are
        asked for (it never forms the full matrix) or there are sink tokens; transformers' sliding-window mask
        otherwise. While exporting, always the latter: a graph with a dynamic length cannot branch on it, and the
        dense path computes the same."""
        banded = (
            not config.num_sink_tokens
            and not torch.compiler.is_exporting()
            and query_length > 2 * config.sliding_window
            and config._attn_implementation in ("eager", "sdpa")
            and not output_attentions
        )
        return "blockwise" if banded else "dense"

    @classmethod
    def window(cls, config: ZooSlidingWindowConfig) -> int:
        return config.sliding_window

    @classmethod
    def dense_mask_builder(
        cls, config: ZooSlidingWindowConfig, attention_mask: torch.Tensor | None
    ) -> tuple[Callable, dict]:
        """With sink tokens the causal mask (`create_causal_mask`) and-ed with "within the window, or one of the
        first s real tokens of the row": keys are numbered from the row's start (the cache keeps every key), and a
        left-padded row's sinks start at its first real token."""
        sinks, window = config.num_sink_tokens, config.sliding_window
        if not sinks:
            return cls.dense_mask_function, {}
        if attention_mask is None:  # every row starts at index 0

            def window_or_sink(batch_idx, head_idx, q_idx, kv_idx):
                return (q_idx - kv_idx < window) | (kv_idx < sinks)

        else:
            first = attention_mask.long().argmax(-1)  # (B,), on the mask's device: each row's first real token

            def window_or_sink(batch_idx, head_idx, q_idx, kv_idx):
                return (q_idx - kv_idx < window) | (kv_idx < first[batch_idx] + sinks)

        return create_causal_mask, {"and_mask_function": window_or_sink}

    @classmethod
    def cache_config(cls, config: ZooSlidingWindowConfig) -> ZooSlidingWindowConfig:
        if not config.num_sink_tokens:
            return config
        unwindowed = copy.copy(config)  # transformers' cache would drop the sinks with the keys past the window
        unwindowed.sliding_window = None
        return unwindowed

    @classmethod
    def key_value_cache(cls, config: ZooSlidingWindowConfig) -> Cache:
        """With sink tokens StreamingLLM's cache (sinks and window kept, the keys between evicted) on eager and sdpa
        without ALiBi; a block mask (flex) or a bias by distance (ALiBi) cannot be cut to the kept keys: there every
        key is kept."""
        evicts = config._attn_implementation in ("eager", "sdpa") and config.position_embedding_type != "alibi"
        if config.num_sink_tokens and evicts:
            return SinkWindowCache(config.num_hidden_layers, config.sliding_window, config.num_sink_tokens)
        return DynamicCache(config=cls.cache_config(config))

    @classmethod
    def mask_refusal(cls, config: ZooSlidingWindowConfig) -> str | None:
        if config.num_sink_tokens:
            return f"every token also sees the first num_sink_tokens={config.num_sink_tokens} tokens (sinks)"
        return None

    @classmethod
    def mixing_flops_per_token(cls, config: ZooSlidingWindowConfig, seq_len: int) -> float:
        # dot-product attention over the last w keys (and the sinks) only: the banded kernel computes no more; with
        # sinks the dense path computes the masked scores too, which count here as nothing
        seen = min(seq_len, config.sliding_window + config.num_sink_tokens)
        return super().mixing_flops_per_token(config, seen)

    def attend(self, query, key, value, attention_mask, **kwargs):
        if isinstance(attention_mask, BlockwiseCausalMask):
            return self._banded(query, key, value, attention_mask), None
        if self.sinks and self.config._attn_implementation.startswith("flash"):
            raise ValueError(
                f"num_sink_tokens={self.sinks}: flash attention takes a window but no sink keys; load the model with "
                f"attn_implementation='sdpa' (or 'eager', 'flex_attention'), or set num_sink_tokens=0."
            )
        # flash attention 2 reads the window from `sliding_window`; the other backends from the mask
        return super().attend(query, key, value, attention_mask, sliding_window=self.config.sliding_window, **kwargs)

    def _banded(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: BlockwiseCausalMask
    ) -> torch.Tensor:
        """Blocks of queries, each against the keys of its band only. `(B, H, T, d)` -> `(B, T, H, d)`. A query
        whose window holds no real key (a padding token) gets 0, as sdpa gives it on the dense path."""
        window = self.config.sliding_window
        block = max(window, 64)  # per block: block x (block + window) scores
        dropout = self.attention_dropout if self.training else 0.0
        outputs = []
        for q_start in range(0, query.shape[2], block):
            q_end = min(query.shape[2], q_start + block)
            k_start = max(0, mask.past_length + q_start - window + 1)  # first key the first query of the block sees
            k_end = mask.past_length + q_end
            allowed = mask.allowed(q_start, q_end, k_start, k_end, fill_empty_rows=False)  # (B or 1, 1, C, K)
            empty = ~allowed.any(-1, keepdim=True)  # padding queries with no key in their window
            if mask.alibi_slopes is not None:
                block_mask = mask.additive(q_start, q_end, query.dtype, k_start, k_end)  # (B, H, C, K)
            else:
                block_mask = allowed | empty  # finite for sdpa; those rows are zeroed below
            output = F.scaled_dot_product_attention(
                query[:, :, q_start:q_end],
                key[:, :, k_start:k_end],
                value[:, :, k_start:k_end],
                attn_mask=block_mask,
                dropout_p=dropout,
                scale=self.scaling,
                enable_gqa=self.num_key_value_groups > 1,
            )  # (B, H, C, d)
            outputs.append(output.masked_fill(empty, 0.0))
        return torch.cat(outputs, dim=2).transpose(1, 2)  # (B, H, T, d) -> (B, T, H, d)


class ZooSlidingWindowModel(ZooModel):
    config_class = ZooSlidingWindowConfig
    attention_class = ZooSlidingWindowAttention


(
    ZooSlidingWindowForCausalLM,
    ZooSlidingWindowForSequenceClassification,
    ZooSlidingWindowForTokenClassification,
    ZooSlidingWindowForQuestionAnswering,
) = variant_heads(ZooSlidingWindowModel)
(
    ZooSlidingWindowEncoder,
    ZooSlidingWindowDecoder,
    ZooSlidingWindowSeq2SeqModel,
    ZooSlidingWindowForConditionalGeneration,
) = seq2seq_classes(ZooSlidingWindowModel)
