"""Sliding window: the banded kernel, w >= T as plain causal attention, the rolling cache; sink tokens, their mask
and StreamingLLM's evicting cache."""

import pytest
import torch

from conftest import ATOL, CACHE_KWARG, left_padded_batch, positions_from_mask, returned_cache, tiny_model


@pytest.mark.parametrize("position", ["rope", "alibi", "learned"])
def test_banded_kernel_matches_dense_mask_with_padding_and_cache(position):
    # w = 7 does not divide the block or the lengths; 40 and 30 new tokens (> 2w) take the banded kernel, the
    # first chunk from an empty cache, the second after w - 1 cached keys
    model = tiny_model("sliding_window", position, sliding_window=7, max_position_embeddings=128)
    input_ids, attention_mask, rows = left_padded_batch(lengths=(75, 62, 40))
    position_ids = positions_from_mask(attention_mask)
    with torch.no_grad():
        dense = model(input_ids, attention_mask=attention_mask, output_attentions=True).logits  # dense kernel
        banded = model(input_ids, attention_mask=attention_mask).logits
        cache, pieces = None, []
        for start, end in ((0, 40), (40, 70), (70, 71), (71, 75)):
            out = model(
                input_ids[:, start:end],
                attention_mask=attention_mask[:, :end],
                position_ids=position_ids[:, start:end],
                cache=cache,
                use_cache=True,
            )
            cache = returned_cache(out)
            pieces.append(out.logits)
    cached = torch.cat(pieces, dim=1)
    for i, row in enumerate(rows):
        torch.testing.assert_close(banded[i, -len(row) :], dense[i, -len(row) :], atol=ATOL, rtol=0)
        torch.testing.assert_close(cached[i, -len(row) :], dense[i, -len(row) :], atol=ATOL, rtol=0)
    # the rolling cache keeps the last w - 1 keys and values, however long the input
    assert cache.layers[0].keys.shape[2] == 6 and cache.get_seq_length() == 75


def test_window_at_least_the_length_is_gqa():
    # the same attention through another mask (sdpa may take a different kernel for it): equal within ATOL
    gqa = tiny_model("gqa")
    window = tiny_model("sliding_window", sliding_window=64)
    window.load_state_dict(gqa.state_dict())
    input_ids, attention_mask, rows = left_padded_batch()
    with torch.no_grad():
        torch.testing.assert_close(window(input_ids).logits, gqa(input_ids).logits, atol=ATOL, rtol=0)
        a = window(input_ids, attention_mask=attention_mask).logits
        b = gqa(input_ids, attention_mask=attention_mask).logits
    for i, row in enumerate(rows):
        torch.testing.assert_close(a[i, -len(row) :], b[i, -len(row) :], atol=ATOL, rtol=0)
    kwargs = dict(max_new_tokens=10, do_sample=False)
    assert torch.equal(
        window.generate(input_ids, attention_mask=attention_mask, **kwargs),
        gqa.generate(input_ids, attention_mask=attention_mask, **kwargs),
    )


def test_a_narrow_window_changes_the_result():
    gqa = tiny_model("gqa")
    window = tiny_model("sliding_window", sliding_window=3)
    window.load_state_dict(gqa.state_dict())
    input_ids = torch.randint(3, 90, (1, 12))
    with torch.no_grad():
        a, b = window(input_ids).logits, gqa(input_ids).logits
    torch.testing.assert_close(a[:, :3], b[:, :3], atol=ATOL, rtol=0)  # the first w tokens see everything anyway
    assert not torch.allclose(a[:, 3:], b[:, 3:], atol=1e-3)


def test_banded_kernel_gives_padding_queries_what_the_dense_path_gives():
    """Right padding (transformers' testers use it) where a padding query's window holds only padding: sdpa on the
    dense path gives such a row 0, and so must the banded kernel (> 2w tokens), or the hidden states of padding
    positions differ between the two paths."""
    model = tiny_model("sliding_window", sliding_window=4)  # sdpa
    input_ids = torch.randint(3, 90, (3, 13))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, 3:] = 0  # 10 padding tokens at the end: the last 6 see only padding
    attention_mask[1, 9:] = 0
    with torch.no_grad():
        banded = model(input_ids, attention_mask=attention_mask, use_cache=False).logits
        dense = model(input_ids, attention_mask=attention_mask, use_cache=False, output_attentions=True).logits
    torch.testing.assert_close(banded, dense, atol=ATOL, rtol=0)


def sink_reference_mask(length: int, window: int, sinks: int) -> torch.Tensor:
    """(T, T) True where query i sees key j: causal, and within the window or one of the first `sinks` keys."""
    queries, keys = torch.arange(length)[:, None], torch.arange(length)[None]
    return (keys <= queries) & ((queries - keys < window) | (keys < sinks))


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_sink_tokens_are_the_window_or_the_first_tokens(implementation):
    """StreamingLLM's mask: against the same weights under a full window given that mask from outside; more new
    tokens than 2w (where the plain window takes its banded kernel) stay on the dense path."""
    model = tiny_model("sliding_window", sliding_window=4, num_sink_tokens=2, attn_implementation=implementation)
    full = tiny_model("sliding_window", sliding_window=64, attn_implementation=implementation)
    full.load_state_dict(model.state_dict())
    input_ids = torch.randint(3, 90, (2, 20))
    allowed = sink_reference_mask(20, window=4, sinks=2)[None, None].expand(2, 1, 20, 20)
    allowed = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)  # additive, as eager's
    with torch.no_grad():
        sunk = model(input_ids).logits
        torch.testing.assert_close(sunk, full(input_ids, attention_mask=allowed).logits, atol=ATOL, rtol=0)
        plain = tiny_model("sliding_window", sliding_window=4, attn_implementation=implementation)
        plain.load_state_dict(model.state_dict())
        assert not torch.allclose(sunk[:, 6:], plain(input_ids).logits[:, 6:], atol=1e-3)  # the sinks matter
    assert model.model.attention_class.mask_kind(model.config, 20, False) == "dense"


def test_sink_tokens_decode_as_the_uncached_forward_with_left_padding():
    """Cached greedy decoding (the cache evicting the keys between the sinks and the window as it goes) equals the
    uncached forward token by token, and a left-padded row's sinks are its own first tokens: it decodes as it does
    alone."""
    model = tiny_model("sliding_window", sliding_window=3, num_sink_tokens=2)
    input_ids, attention_mask, rows = left_padded_batch(lengths=(9, 6, 4))
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        batch = model.generate(input_ids, attention_mask=attention_mask, **kwargs)
        for i, row in enumerate(rows):
            alone = model.generate(row[None], **kwargs)
            assert torch.equal(batch[i, input_ids.shape[1] :], alone[0, len(row) :]), i
            sequence = row[None]
            for _ in range(12):  # no cache: every step reads the whole sequence again
                sequence = torch.cat([sequence, model(sequence).logits[:, -1:].argmax(-1)], dim=1)
            assert torch.equal(alone, sequence), i
        out = model(input_ids, attention_mask=attention_mask, use_cache=True)
    # the longest padding (5) and 2 sinks, then the last w - 1 = 2 keys: positions 0-6 and 7-8, nothing evicted yet
    layer = returned_cache(out).layers[0]
    assert (layer.head, layer.tail) == (7, 7) and layer.keys.shape[2] == 9


def test_a_chunked_prefill_of_a_padded_batch_keeps_every_rows_sinks():
    """Prefilled 4 tokens at a time, a row that is all padding in the first chunks has not shown where its sinks lie:
    nothing is evicted until it has, and the batch decodes as it does prefilled at once."""
    model = tiny_model("sliding_window", sliding_window=3, num_sink_tokens=2)
    input_ids, attention_mask, _ = left_padded_batch(lengths=(16, 5))
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        at_once = model.generate(input_ids, attention_mask=attention_mask, **kwargs)
        chunked = model.generate(input_ids, attention_mask=attention_mask, prefill_chunk_size=4, **kwargs)
        assert torch.equal(chunked, at_once)
        cache = model.model.make_cache()
        for end in (4, 8, 12, 16):  # the second row's first real token is at 11
            window = attention_mask[:, :end]
            model(
                input_ids[:, end - 4 : end],
                attention_mask=window,
                position_ids=positions_from_mask(window)[:, -4:],
                **{CACHE_KWARG: cache},
                use_cache=True,
            )
            layer = cache.layers[0]
            assert layer.sink_span == (None if end < 12 else 11 + 2), end
        assert (layer.head, layer.tail) == (13, 14) and layer.keys.shape[2] == 13 + 2


def test_the_cache_keeps_the_sinks_and_the_window_only():
    """StreamingLLM's cache: after a prompt of 20 tokens a layer holds the 2 sinks and the last w - 1 = 3 keys, and
    prefilling in chunks, then decoding, through it gives the uncached forward's logits at every position."""
    model = tiny_model("sliding_window", sliding_window=4, num_sink_tokens=2)
    input_ids = torch.randint(3, 90, (2, 26), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        reference = model(input_ids).logits
        cache = model.model.make_cache()
        out = model(input_ids[:, :20], **{CACHE_KWARG: cache}, use_cache=True)
        layer = returned_cache(out).layers[1]
        assert (layer.head, layer.tail) == (2, 17) and layer.keys.shape[2] == 5  # positions 0-1 and 17-19
        assert returned_cache(out).get_seq_length() == 20  # the tokens seen, evicted ones included
        torch.testing.assert_close(out.logits, reference[:, :20], atol=ATOL, rtol=0)
        cache, logits = model.model.make_cache(), []
        for start, end in ((0, 7), (7, 13), (13, 14), (14, 22), *((t, t + 1) for t in range(22, 26))):
            logits.append(model(input_ids[:, start:end], **{CACHE_KWARG: cache}, use_cache=True).logits)
            assert cache.layers[0].keys.shape[2] <= 2 + 3  # bounded, however long the text
    torch.testing.assert_close(torch.cat(logits, dim=1), reference, atol=ATOL, rtol=0)


def test_beam_search_through_the_evicting_cache_is_the_full_caches():
    """Beam search reorders the evicting cache's rows as any cache's: the same beams as with a cache keeping every
    key. Cropping it back (assisted decoding) is refused, since what it evicted is gone."""
    from transformers import DynamicCache

    model = tiny_model("sliding_window", sliding_window=3, num_sink_tokens=2)
    input_ids = torch.randint(3, 90, (2, 8), generator=torch.Generator().manual_seed(2))
    kwargs = dict(max_new_tokens=10, num_beams=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        evicting = model.generate(input_ids, **kwargs)
        keeping = model.generate(input_ids, **{CACHE_KWARG: DynamicCache()}, **kwargs)
    assert torch.equal(evicting, keeping)
    cache = model.model.make_cache()
    model(input_ids, **{CACHE_KWARG: cache}, use_cache=True)
    with pytest.raises(ValueError, match="cannot be cropped back"):
        cache.crop(4)


@pytest.mark.parametrize(
    ("fields", "evicts"),
    [({}, True), ({"position_embedding_type": "alibi"}, False), ({"attn_implementation": "flex_attention"}, False)],
)
def test_the_cache_evicts_where_the_mask_can_be_cut_to_the_kept_keys(fields, evicts):
    """ALiBi's bias and flex attention's block mask cannot be cut to the kept keys' columns: there the model's cache
    keeps every key (and decodes as the uncached forward); an evicting cache handed in is refused by name."""
    from hf_attn_zoo.models.sliding_window import SinkWindowCache

    model = tiny_model("sliding_window", sliding_window=3, num_sink_tokens=2, **fields)
    cache = model.model.make_cache()
    assert isinstance(cache, SinkWindowCache) == evicts
    input_ids = torch.randint(3, 90, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        cached = model(input_ids[:, :9], **{CACHE_KWARG: cache}, use_cache=True).logits
        step = model(input_ids[:, 9:], **{CACHE_KWARG: cache}, use_cache=True).logits
        torch.testing.assert_close(torch.cat([cached, step], 1), model(input_ids).logits, atol=ATOL, rtol=0)
        if not evicts:
            with pytest.raises(ValueError, match="cannot be cut to the keys it kept"):
                model(input_ids, **{CACHE_KWARG: SinkWindowCache(4, 3, 2)}, use_cache=True)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"num_sink_tokens": -1}, "num_sink_tokens=-1 must be an integer >= 0"),
        ({"num_sink_tokens": 1.5}, "num_sink_tokens=1.5 must be an integer >= 0"),
        ({"num_sink_tokens": 2, "is_encoder_decoder": True}, "an encoder-decoder or the bidirectional form"),
        ({"num_sink_tokens": 2, "is_decoder": False}, "an encoder-decoder or the bidirectional form"),
    ],
)
def test_sink_tokens_that_cannot_work_are_refused(fields, named):
    with pytest.raises(ValueError, match=named):
        tiny_model("sliding_window", sliding_window=4, **fields)


def test_clients_that_build_the_window_themselves_refuse_sink_tokens():
    from hf_attn_zoo.convert.gguf_writer import gguf_refusal
    from hf_attn_zoo.convert.llama import native_refusal
    from hf_attn_zoo.models.clients_zoo import continuous_batching_refusal, vllm_refusal

    model = tiny_model("sliding_window", sliding_window=4, num_sink_tokens=2)
    attention, config = model.model.attention_class, model.config
    for reason in (
        native_refusal(config, "mistral"),
        gguf_refusal(config),
        vllm_refusal(attention, config),
        continuous_batching_refusal(attention, config),
    ):
        assert reason is not None and "num_sink_tokens=2" in reason
    plain = tiny_model("sliding_window", sliding_window=4).config
    assert native_refusal(plain, "mistral") is None and vllm_refusal(attention, plain) is None
    with pytest.raises(ValueError, match="cache_implementation='static' does not apply"):
        model.generate(torch.randint(3, 90, (1, 5)), max_new_tokens=2, cache_implementation="static")


def test_a_cache_that_drops_keys_past_the_window_is_refused_with_sinks():
    """transformers' caches built from the config evict keys past the window, the sinks with them: refused before
    any layer runs; the model's own cache keeps every key."""
    from transformers import DynamicCache, StaticCache

    model = tiny_model("sliding_window", sliding_window=3, num_sink_tokens=2)
    input_ids = torch.randint(3, 90, (1, 6))
    for cache in (DynamicCache(config=model.config), StaticCache(config=model.config, max_cache_len=16)):
        with pytest.raises(TypeError, match="drops keys past the window, and every token also sees the first"):
            model(input_ids, cache=cache, use_cache=True)
    out = model(input_ids, cache=model.model.make_cache(), use_cache=True)
    assert returned_cache(out).get_seq_length() == 6


def test_packed_documents_each_have_their_own_sinks():
    """Documents packed in one row, positions restarting and no mask or cache (padding-free training): transformers'
    mask builder counts each document's keys from its own start, so each sees its own first tokens, as alone."""
    model = tiny_model("sliding_window", sliding_window=3, num_sink_tokens=2)
    generator = torch.Generator().manual_seed(3)
    documents = [torch.randint(3, 90, (n,), generator=generator) for n in (7, 9, 5)]
    position_ids = torch.cat([torch.arange(len(d)) for d in documents])[None]
    with torch.no_grad():
        packed = model(torch.cat(documents)[None], position_ids=position_ids, use_cache=False).logits[0]
        start = 0
        for document in documents:
            alone = model(document[None]).logits[0]
            torch.testing.assert_close(packed[start : start + len(document)], alone, atol=ATOL, rtol=0)
            start += len(document)
