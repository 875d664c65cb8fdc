"""BigBird (Zaheer et al. 2020): the gathered block-sparse kernel against dense attention under the explicit block mask
(causal and bidirectional, block sizes that do and do not divide the length, padding, packed documents), the random
blocks as a fixed function of the seed, cached decoding of long prompts, the cost per query, and the parity anchor:
the bidirectional form equals transformers' `BigBirdBlockSparseAttention` given the same projections and random
blocks."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from hf_attn_zoo.models import SEQ2SEQ, VARIANTS
from hf_attn_zoo.models.bigbird import (
    ZooBigBirdAttention,
    bidirectional_pattern,
    block_sparse_attention,
    dense_block_sparse_attention,
    random_block_order,
)
from hf_attn_zoo.models.masks_zoo import BlockwiseCausalMask

import references
from conftest import ATOL, CACHE_KWARG, VOCAB_SIZE, left_padded_batch, positions_from_mask, returned_cache, tiny_model

# 4 heads on 2 key/value heads, blocks of 3 positions: over 40 tokens (14 blocks, the last one partial) every later
# block skips most earlier ones
PATTERNS = {
    "w3-g2-r2": dict(attention_block_size=3, num_window_blocks=3, num_global_blocks=2, num_random_blocks=2),
    "w1-g0-r3": dict(attention_block_size=3, num_window_blocks=1, num_global_blocks=0, num_random_blocks=3),
    "w2-g1-r0": dict(attention_block_size=4, num_window_blocks=2, num_global_blocks=1, num_random_blocks=0),
    "w5-g3-r1": dict(attention_block_size=2, num_window_blocks=5, num_global_blocks=3, num_random_blocks=1),
}


def bigbird(pattern: str = "w3-g2-r2", position: str = "rope", **overrides):
    return tiny_model("bigbird", position, **PATTERNS[pattern] | overrides)


def token_rows(lengths, seed=1):
    """Left-padded random rows: `(input_ids, attention_mask, rows)`."""
    return left_padded_batch(lengths=lengths, seed=seed)


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("position", ["rope", "learned"])
def test_causal_kernel_equals_dense_attention_under_the_block_mask(pattern, position):
    model = bigbird(pattern, position)
    input_ids, attention_mask, rows = token_rows((40, 29, 7))
    with torch.no_grad():
        actual = model(input_ids, attention_mask=attention_mask).logits
        expected = references.causal_lm_logits(model, input_ids, attention_mask, references.bigbird_attention)
    for i, row in enumerate(rows):
        torch.testing.assert_close(actual[i, -len(row) :], expected[i, -len(row) :], atol=ATOL, rtol=0)


def test_the_pattern_bites():
    """Over 40 tokens the sparse model is not full causal attention with the same weights; with the window as long
    as the sequence it is (the gqa variant)."""
    input_ids = torch.randint(3, VOCAB_SIZE, (2, 40), generator=torch.Generator().manual_seed(0))
    model = bigbird()
    full = tiny_model("gqa", "rope")  # the same shapes: 4 heads on 2 key/value heads
    full.load_state_dict(model.state_dict())
    wide = bigbird(num_window_blocks=14)
    wide.load_state_dict(model.state_dict())
    with torch.no_grad():
        sparse, dense, windowed = model(input_ids).logits, full(input_ids).logits, wide(input_ids).logits
    assert (sparse - dense).abs().max() > 1e-2
    torch.testing.assert_close(windowed, dense, atol=ATOL, rtol=0)


def test_output_attentions_are_the_block_mask():
    """The weights returned are zero outside the reference's block pattern and sum to one inside it."""
    model = bigbird()
    input_ids = torch.randint(3, VOCAB_SIZE, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        weights = model(input_ids, output_attentions=True).attentions
    config = model.config
    size = config.attention_block_size
    for layer, layer_weights in enumerate(weights):
        for h in range(config.num_attention_heads):
            for i in range(40):
                pattern = references.bigbird_blocks(config, layer, h, i // size, None, causal=True)
                allowed = torch.tensor([j // size in pattern and j <= i for j in range(40)])
                assert torch.all(layer_weights[0, h, i][~allowed] == 0)
                torch.testing.assert_close(layer_weights[0, h, i].sum(), torch.tensor(1.0))


def test_random_blocks_are_the_seeds_hash_on_every_call():
    """The kernel's vectorised hash is the reference's Python-integer hash, whatever the batch or length; another
    seed draws other blocks (and another function), and the seed travels in config.json."""
    query_blocks = torch.tensor([0, 5, 17, 300])
    order = random_block_order(seed=1234, layer=3, heads=4, query_blocks=query_blocks, key_blocks=320)
    for h in range(4):
        for q, query_block in enumerate(query_blocks.tolist()):
            for key_block in (0, 1, 7, 299, 319):
                assert int(order[h, q, key_block]) >> 24 == references.bigbird_hash(1234, 3, h, query_block, key_block)
    assert not torch.equal(order, random_block_order(1235, 3, 4, query_blocks, 320))
    input_ids = torch.randint(3, VOCAB_SIZE, (2, 40), generator=torch.Generator().manual_seed(0))
    model, reseeded = bigbird(), bigbird(random_blocks_seed=7)
    reseeded.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (model(input_ids).logits - reseeded(input_ids).logits).abs().max() > 1e-3
    assert reseeded.config.to_dict()["random_blocks_seed"] == 7


def test_saved_and_reloaded_computes_the_same_function(tmp_path):
    model = bigbird(random_blocks_seed=99)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.random_blocks_seed == 99
    input_ids = torch.randint(3, VOCAB_SIZE, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(input_ids).logits, reloaded(input_ids).logits)


@pytest.mark.parametrize("pattern", ["w3-g2-r2", "w5-g3-r1"])
def test_long_prompt_prefilled_in_pieces_then_decoded_equals_the_forward(pattern):
    """A left-padded batch: a prefill of 10 tokens, one of 7, then token by token to 40; every step's logits equal
    the uncached forward's, and greedy generation with the cache equals it without."""
    model = bigbird(pattern)
    input_ids, attention_mask, rows = token_rows((40, 31, 12))
    position_ids = positions_from_mask(attention_mask)
    with torch.no_grad():
        full = model(input_ids, attention_mask=attention_mask).logits
        cache, pieces = DynamicCache(), []
        bounds = [0, 10, 17, *range(18, 41)]
        for start, end in zip(bounds, bounds[1:]):
            out = model(
                input_ids[:, start:end],
                attention_mask=attention_mask[:, :end],
                position_ids=position_ids[:, start:end],
                **{CACHE_KWARG: cache},
                use_cache=True,
            )
            cache = returned_cache(out)
            pieces.append(out.logits)
    stepped = torch.cat(pieces, dim=1)
    for i, row in enumerate(rows):
        torch.testing.assert_close(stepped[i, -len(row) :], full[i, -len(row) :], atol=ATOL, rtol=0)
    prompt, prompt_mask, _ = token_rows((20, 13, 6), seed=5)
    with torch.no_grad():
        cached = model.generate(prompt, attention_mask=prompt_mask, max_new_tokens=20, do_sample=False)
        uncached = model.generate(
            prompt, attention_mask=prompt_mask, max_new_tokens=20, do_sample=False, use_cache=False
        )
    assert torch.equal(cached, uncached)


def test_packed_documents_equal_each_document_alone():
    """Documents of 11, 17 and 9 tokens in one row, positions restarting at 0 and no mask (padding-free training):
    each gets the logits it gets alone, blocks counted from its own start."""
    model = bigbird()
    generator = torch.Generator().manual_seed(3)
    documents = [torch.randint(3, VOCAB_SIZE, (n,), generator=generator) for n in (11, 17, 9)]
    packed = torch.cat(documents)[None]
    position_ids = torch.cat([torch.arange(len(d)) for d in documents])[None]
    with torch.no_grad():
        logits = model(packed, position_ids=position_ids).logits[0]
        start = 0
        for document in documents:
            alone = model(document[None]).logits[0]
            torch.testing.assert_close(logits[start : start + len(document)], alone, atol=ATOL, rtol=0)
            start += len(document)


def test_each_query_scores_a_bounded_number_of_keys(monkeypatch):
    """O(T·(w + g + r)·b): the gathered keys per block of queries do not grow with the length, and the FLOPs per
    token stay flat past (w + g + r)·b."""
    model = bigbird()
    attention = model.model.layers[0].self_attn
    sizes = []
    real_matmul = torch.matmul

    def counting(a, b):
        sizes.append(tuple(b.shape))
        return real_matmul(a, b)

    for length in (60, 120):
        sizes.clear()
        input_ids = torch.randint(3, VOCAB_SIZE, (1, length), generator=torch.Generator().manual_seed(length))
        with monkeypatch.context() as patched, torch.no_grad():
            patched.setattr(torch, "matmul", counting)  # the kernel's products, observed by their shapes
            model(input_ids)
        scored = [shape[-1] for shape in sizes if len(shape) == 5]  # (B, H, N, d, K·b): the keys of a query block
        assert scored and max(scored) == ZooBigBirdAttention.keys_per_query(model.config)
    config = model.config
    flops = [ZooBigBirdAttention.mixing_flops_per_token(config, n) for n in (512, 4096, 65536)]
    assert flops[0] == flops[1] == flops[2]
    assert attention.keys_per_query(config) == 7 * 3


# --- the bidirectional form (an encoder's) ---------------------------------------------------------------------


def source_rows(lengths=(37, 30, 23), seed=4):
    """Sources of the given lengths: the second right-padded, the third left-padded."""
    width = max(lengths)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB_SIZE, (len(lengths), width), generator=generator)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        if i == 2:
            mask[i, width - n :] = 1
        else:
            mask[i, :n] = 1
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("pattern", ["w3-g2-r2", "w1-g0-r3", "w5-g3-r1"])
def test_encoder_decoder_equals_dense_attention_under_the_block_masks(pattern):
    """The encoder's bidirectional form (global blocks first and last, their queries reading every key) and the
    decoder's causal form against the reference, over padded sources of 23-37 tokens."""
    torch.manual_seed(0)
    config = VARIANTS["bigbird"].config(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        max_position_embeddings=64,
        initializer_range=0.2,
        num_attention_heads=4,
        num_key_value_heads=2,
        is_encoder_decoder=True,
        decoder_start_token_id=1,
        pad_token_id=0,
        **PATTERNS[pattern],
    )
    model = SEQ2SEQ["bigbird"].generation_class(config).eval()
    ids, mask = source_rows()
    target = torch.randint(3, VOCAB_SIZE, (3, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
        expected = references.seq2seq_logits(model, ids, mask, target, references.bigbird_attention)
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
        # rows alone: padding changes nothing
        for row in range(3):
            real = mask[row].bool()
            alone = model(input_ids=ids[row : row + 1, real], decoder_input_ids=target[row : row + 1]).logits
            torch.testing.assert_close(logits[row : row + 1], alone, atol=ATOL, rtol=0)
        cached = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
        uncached = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)


# --- the parity anchor: transformers' BigBirdBlockSparseAttention ------------------------------------------------


@pytest.mark.parametrize(
    "heads, width, block, random_count, blocks",
    [(2, 16, 4, 2, 12), (4, 8, 8, 3, 13), (3, 8, 2, 1, 9)],
    ids=["b4-r2", "b8-r3", "b2-r1"],
)
def test_bidirectional_form_equals_transformers_block_sparse_attention(
    heads, width, block, random_count, blocks, monkeypatch
):
    """transformers' `BigBirdBlockSparseAttention` (ITC: a window of 3 blocks, the first and last blocks global, r
    random blocks) and the zoo's bidirectional attention with w=3, g=2, given the same query, key and value
    projections and the same random blocks, agree to 1e-5 on tiny configs built here (9 to 13 blocks of 2 to 8
    positions, 1 to 3 random blocks).

    transformers draws its random blocks with numpy inside `_bigbird_block_rand_mask_with_head` (and, in eval mode,
    returns all zeros there: every query block's random blocks are then block 0, already global). The zoo's blocks
    are fed to it by replacing that method on the instance with one returning the zoo's draw for query blocks 1 ..
    n - 2 (the ones transformers draws for), so both compute the same pattern; the rest of its computation (the
    five parts, the masks, the softmax) is transformers' own."""
    from transformers import BigBirdConfig
    from transformers.models.big_bird.modeling_big_bird import BigBirdBlockSparseAttention, BigBirdModel

    length, batch = blocks * block, 2
    theirs_config = BigBirdConfig(
        hidden_size=heads * width,
        num_attention_heads=heads,
        block_size=block,
        num_random_blocks=random_count,
        attention_type="block_sparse",
        use_bias=True,
        max_position_embeddings=64,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    theirs = BigBirdBlockSparseAttention(theirs_config, seed=0).eval()
    ours_config = VARIANTS["bigbird"].config(
        hidden_size=heads * width,
        num_attention_heads=heads,
        num_hidden_layers=1,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=64,
        position_embedding_type="none",
        attention_bias=True,
        attention_block_size=block,
        num_window_blocks=3,
        num_global_blocks=2,
        num_random_blocks=random_count,
        random_blocks_seed=11,
        is_decoder=False,
    )
    ours = ZooBigBirdAttention(ours_config, layer_idx=0).eval()
    ours.is_causal = False
    with torch.no_grad():
        for mine, its in ((ours.q_proj, theirs.query), (ours.k_proj, theirs.key), (ours.v_proj, theirs.value)):
            mine.weight.copy_(its.weight)
            mine.bias.copy_(its.bias)
        ours.o_proj.weight.copy_(torch.eye(heads * width))  # compare the heads' outputs, before any projection
        ours.o_proj.bias.zero_()

    # the zoo's random blocks of every query block, per head: the last r columns of its pattern
    pattern, exists = bidirectional_pattern(
        ours, torch.arange(blocks)[None], torch.ones(1, blocks, dtype=torch.bool), torch.tensor([blocks])
    )  # (1, H, N, w + g + r)
    drawn = pattern[0, :, 1 : blocks - 1, -random_count:]  # (H, N - 2, r): query blocks 1 .. N - 2
    assert exists[0, :, 1 : blocks - 1, -random_count:].all()
    drawn_numpy = [drawn[h].numpy().astype(np.int32) for h in range(heads)]
    monkeypatch.setattr(theirs, "_bigbird_block_rand_mask_with_head", lambda **_: drawn_numpy)

    hidden = torch.randn(batch, length, heads * width, generator=torch.Generator().manual_seed(1))
    blocked, band, from_mask, to_mask = BigBirdModel.create_masks_for_block_sparse_attn(
        torch.ones(batch, length), block
    )
    mask = BlockwiseCausalMask(key_length=length, past_length=0, causal=False)
    with torch.no_grad():
        expected, _ = theirs(hidden, band, from_mask, to_mask, blocked, blocked)
        actual, _ = ours(hidden, mask, position_ids=torch.arange(length)[None])
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)
    # the random blocks matter: another draw gives transformers another output
    others = [np.roll(d, 1, axis=0) for d in drawn_numpy]
    monkeypatch.setattr(theirs, "_bigbird_block_rand_mask_with_head", lambda **_: others)
    with torch.no_grad():
        assert (theirs(hidden, band, from_mask, to_mask, blocked, blocked)[0] - actual).abs().max() > 1e-3


# --- the dense form a graph being exported runs --------------------------------------------------------------------


@pytest.mark.parametrize("pattern", ["w3-g2-r2", "w1-g0-r3", "w5-g3-r1"])
def test_the_dense_form_of_exported_graphs_equals_the_gathered_kernel(pattern, monkeypatch):
    """While exporting, the pattern is a dense (T, S) mask: the same logits as the gathered kernel for left-padded
    rows, a cached decoding step and an encoder-decoder over padded sources; and the same outputs and weights for
    packed documents (transformers does not look for packed rows while exporting, so they are compared at the
    kernel)."""
    model = bigbird(pattern)
    input_ids, attention_mask, _ = token_rows((40, 29, 7))
    position_ids = positions_from_mask(attention_mask)
    ids, mask = source_rows()
    fields = model.config.to_diff_dict() | dict(is_encoder_decoder=True, decoder_start_token_id=1)
    translator = SEQ2SEQ["bigbird"].generation_class(VARIANTS["bigbird"].config(**fields)).eval()
    target = torch.randint(3, VOCAB_SIZE, (3, 20), generator=torch.Generator().manual_seed(5))

    def outputs():
        with torch.no_grad():
            cache = DynamicCache()
            model(input_ids[:, :30], attention_mask=attention_mask[:, :30], position_ids=position_ids[:, :30],
                  **{CACHE_KWARG: cache})  # fmt: skip
            step = model(input_ids[:, 30:], attention_mask=attention_mask, position_ids=position_ids[:, 30:],
                         **{CACHE_KWARG: cache}).logits  # fmt: skip
            return (
                model(input_ids, attention_mask=attention_mask).logits[attention_mask.bool()],
                step[attention_mask[:, 30:].bool()],
                translator(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits,
            )

    gathered = outputs()
    with monkeypatch.context() as exporting:
        exporting.setattr(torch.compiler, "is_exporting", lambda: True)
        dense = outputs()
    for actual, expected in zip(dense, gathered, strict=True):
        torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)

    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, heads, 37, 8, generator=generator) for heads in (4, 2, 2))
    positions = torch.cat([torch.arange(n) for n in (11, 17, 9)])[None]
    documents = torch.cat([torch.full((n,), i) for i, n in enumerate((11, 17, 9))])[None]
    packed = BlockwiseCausalMask(key_length=37, past_length=0, documents=documents)
    attention = model.model.layers[1].self_attn
    expected = block_sparse_attention(attention, query, key, value, packed, positions, True)
    actual = dense_block_sparse_attention(attention, query, key, value, packed, positions, True)
    for dense_result, gathered_result in zip(actual, expected, strict=True):
        torch.testing.assert_close(dense_result, gathered_result, atol=ATOL, rtol=0)


def test_clients_that_cannot_run_it_are_refused_up_front_naming_why():
    """kvpress's presses (evicting tokens would move cached keys into other blocks), continuous batching and vLLM's
    transformers backend (their attention functions score every key), the native and GGUF exports (no architecture
    computes it)."""
    from hf_attn_zoo.models.clients_zoo import continuous_batching_refusal, kv_compression_refusal, vllm_refusal_line

    model = bigbird()
    attention_class, config = model.model.attention_class, model.config
    with pytest.raises(AttributeError, match="kvpress.*position from its slot"):
        model.model.layers[0].self_attn.rotary_emb = model.model.rotary_emb
    assert "slot" in kv_compression_refusal(attention_class, config)
    assert "window, global and random blocks" in continuous_batching_refusal(attention_class, config)
    assert "window, global and random blocks" in vllm_refusal_line(attention_class, config)
    assert attention_class.native_format is None and attention_class.gguf_architecture is None


@pytest.mark.parametrize("dense", [False, True])
def test_padding_after_cached_tokens_is_skipped(dense, monkeypatch):
    """A cache already holding tokens, then a chunk that starts with padding (PEFT's prefix tuning puts its virtual
    tokens before a left-padded prompt so): the real tokens get what they get without the padding, blocks counted over
    the real tokens, in the gathered kernel and in the exported graphs' dense form."""
    if dense:
        monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)
    model = bigbird()
    generator = torch.Generator().manual_seed(6)
    first, second = torch.randint(3, VOCAB_SIZE, (1, 8), generator=generator), torch.randint(3, VOCAB_SIZE, (1, 20))
    with torch.no_grad():
        expected = model(torch.cat((first, second), dim=1)).logits[:, 8:]
        cache = DynamicCache()
        model(first, **{CACHE_KWARG: cache})
        padded = torch.cat((torch.zeros(1, 5, dtype=torch.long), second), dim=1)
        mask = torch.cat((torch.ones(1, 8), torch.zeros(1, 5), torch.ones(1, 20)), dim=1).long()
        actual = model(padded, attention_mask=mask, **{CACHE_KWARG: cache}).logits[:, 5:]
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)
