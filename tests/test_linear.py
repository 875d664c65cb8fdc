"""Linear attention (Katharopoulos et al. 2020): the chunked kernel against the paper's recurrence, the encoder's
form against its formula, cached decoding of long prompts, the constant decoding state, and fla's naive form where
`fla` (flash-linear-attention) is installed."""

import pytest
import torch
from transformers import DynamicCache

from hf_attn_zoo.models.linear import feature_map, linear_bidirectional_attend, linear_causal_attend

import references
from conftest import ATOL, left_padded_batch, positions_from_mask, returned_cache, tiny_model

EPS = 1e-6


def random_inputs(batch=2, heads=4, kv_heads=2, length=23, width=8, value_width=6, seed=0):
    """φ-mapped queries `(B, H, T, d)` and keys `(B, G, T, d)`, values `(B, G, T, d_v)`: unit-scale projections."""
    generator = torch.Generator().manual_seed(seed)
    query = feature_map(torch.randn(batch, heads, length, width, generator=generator))
    key = feature_map(torch.randn(batch, kv_heads, length, width, generator=generator))
    value = torch.randn(batch, kv_heads, length, value_width, generator=generator)
    return query, key, value


def recurrence(query, key, value, state=None, documents=None):
    """The paper's RNN form (section 3.4), one token at a time in float64: S_t = S_{t-1} + φ(k_t) v_tᵀ, z_t = z_{t-1} +
    φ(k_t), y_t = φ(q_t)ᵀ S_t / (φ(q_t)ᵀ z_t + ε); both sums restart where `documents` changes. `(B, T, H, d_v)`."""
    batch, heads, length, _ = query.shape
    kv_heads, value_width = key.shape[1], value.shape[-1]
    query, key, value = query.double(), key.double(), value.double()
    sums = torch.zeros(batch, kv_heads, key.shape[-1], value_width, dtype=torch.float64)
    normaliser = torch.zeros(batch, kv_heads, key.shape[-1], dtype=torch.float64)
    if state is not None:
        sums, normaliser = state[..., :value_width].double(), state[..., value_width].double()
    out = torch.zeros(batch, length, heads, value_width, dtype=torch.float64)
    for t in range(length):
        if documents is not None and t > 0:
            restart = (documents[:, t] != documents[:, t - 1]).double()[:, None, None]  # (B, 1, 1)
            sums, normaliser = sums * (1 - restart[..., None]), normaliser * (1 - restart)
        sums = sums + key[:, :, t, :, None] * value[:, :, t, None, :]  # (B, G, d, d_v)
        normaliser = normaliser + key[:, :, t]
        for h in range(heads):
            g = h // (heads // kv_heads)
            q = query[:, h, t]  # (B, d)
            numerator = torch.einsum("bd,bdv->bv", q, sums[:, g])
            out[:, t, h] = numerator / ((q * normaliser[:, g]).sum(-1, keepdim=True) + EPS)
    return out.float(), torch.cat((sums, normaliser[..., None]), dim=-1).float()


@pytest.mark.parametrize("chunk", [1, 3, 4, 23, 64])
def test_chunked_kernel_equals_the_recurrence(chunk):
    """Chunks of 1 (the RNN itself), of sizes that do and do not divide T, and one chunk longer than T."""
    query, key, value = random_inputs()
    output, state = linear_causal_attend(query, key, value, None, chunk, EPS)
    expected, expected_state = recurrence(query, key, value)
    torch.testing.assert_close(output, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(state, expected_state, atol=1e-4, rtol=1e-6)  # sums of 23 terms of order 1


def test_chunked_kernel_continues_from_a_state():
    """A prompt in two calls (the second reading the first's state) is one call over the whole prompt."""
    query, key, value = random_inputs()
    whole, _ = linear_causal_attend(query, key, value, None, 4, EPS)
    first, state = linear_causal_attend(query[:, :, :9], key[:, :, :9], value[:, :, :9], None, 4, EPS)
    second, _ = linear_causal_attend(query[:, :, 9:], key[:, :, 9:], value[:, :, 9:], state, 4, EPS)
    torch.testing.assert_close(torch.cat((first, second), dim=1), whole, atol=ATOL, rtol=0)


@pytest.mark.parametrize("chunk", [1, 4, 5, 64])
def test_packed_documents_restart_the_sums(chunk):
    """Documents of 5, 8, 3 and 7 tokens in one row (boundaries inside chunks and on them): the recurrence that
    restarts its sums at each document."""
    query, key, value = random_inputs()
    documents = torch.tensor([0] * 5 + [1] * 8 + [2] * 3 + [3] * 7).expand(2, -1)  # (B, T)
    output, _ = linear_causal_attend(query, key, value, None, chunk, EPS, documents)
    expected, _ = recurrence(query, key, value, documents=documents)
    torch.testing.assert_close(output, expected, atol=ATOL, rtol=0)


def test_bidirectional_kernel_is_the_papers_non_causal_formula():
    """Every query reads Σφ(k)vᵀ / φ(q)·Σφ(k) over every real token; padded keys add nothing."""
    query, key, value = random_inputs()
    padding = torch.ones(2, 23, dtype=torch.bool)
    padding[1, :6] = False  # row 1 left-padded by 6
    key = key * padding[:, None, :, None]
    output = linear_bidirectional_attend(query, key, value, EPS)
    q, k, v = query.double(), key.double(), value.double()
    expected = torch.zeros(2, 23, 4, 6, dtype=torch.float64)
    for b in range(2):
        for h in range(4):
            g = h // 2
            weights = q[b, h] @ k[b, g].T  # (T, S): φ(q_t)·φ(k_s), zero for padded keys
            expected[b, :, h] = weights @ v[b, g] / (weights.sum(-1, keepdim=True) + EPS)
    torch.testing.assert_close(output, expected.float(), atol=ATOL, rtol=0)


def linear_model(feature_map: str, position: str = "none"):
    """A tiny linear-attention model; a hedgehog one with random maps, so that they are not the identity."""
    model = tiny_model("linear", position, feature_map=feature_map)
    generator = torch.Generator().manual_seed(7)
    for layer in model.model.layers:
        for weight in (layer.self_attn.query_feature_map, layer.self_attn.key_feature_map):
            if weight is not None:
                weight.data = torch.randn(weight.shape, generator=generator)
    return model


@pytest.mark.parametrize("feature_map", ["elu", "hedgehog"])
def test_long_left_padded_prompts_prefilled_in_pieces_then_decoded_equal_the_uncached_forward(feature_map):
    """Prompts of 30, 21 and 9 tokens (several chunks of 4), prefilled in pieces of 7 and 10 that cut through chunks,
    then decoded a token at a time: the logits of a forward over each whole row alone, without cache (1e-5); the
    uncached forward is the paper's formula with the feature map written out."""
    model = linear_model(feature_map, "sinusoidal")
    input_ids, attention_mask, rows = left_padded_batch(lengths=(30, 21, 9))
    position_ids = positions_from_mask(attention_mask)
    bounds = [0, 7, 17, *range(18, input_ids.shape[1] + 1)]
    cache, pieces = None, []
    with torch.no_grad():
        for start, end in zip(bounds[:-1], bounds[1:]):
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
            alone = model(row[None], use_cache=False).logits[0]
            torch.testing.assert_close(cached[i, -len(row) :], alone, atol=ATOL, rtol=0)
        # and the uncached padded batch is the naive formula of the paper
        expected = references.causal_lm_logits(model, input_ids, attention_mask, references.linear_attention)
        actual = model(input_ids, attention_mask=attention_mask).logits
    for i, row in enumerate(rows):
        torch.testing.assert_close(actual[i, -len(row) :], expected[i, -len(row) :], atol=ATOL, rtol=0)


@pytest.mark.parametrize(("feature_map", "features"), [("elu", 1), ("hedgehog", 2)])
def test_decoding_state_is_constant_in_the_length(feature_map, features):
    """L·G·φ·(d_h + 1) float32 values per row (φ = d_h features, 2·d_h for the hedgehog map), after 3 new tokens as
    after 40."""
    model = tiny_model("linear", feature_map=feature_map)
    config = model.config
    input_ids = torch.randint(3, 90, (2, 5))
    sizes = []
    for new_tokens in (3, 40):
        out = model.generate(input_ids, max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True)
        sizes.append(sum(layer.nbytes() for layer in returned_cache(out).layers))
    features *= config.head_dim
    per_row = config.num_hidden_layers * config.num_key_value_heads * features * (config.head_dim + 1) * 4
    assert sizes == [2 * per_row, 2 * per_row]


def test_decoding_strategies_the_state_cannot_serve_fail_clearly():
    model = tiny_model("linear")
    input_ids = torch.randint(3, 90, (1, 6))
    with pytest.raises(ValueError, match="state per layer"):
        model.generate(input_ids, max_new_tokens=2, cache_implementation="static")
    cache = returned_cache(model(input_ids, use_cache=True))
    with pytest.raises(ValueError, match="cannot be removed"):
        cache.crop(-1)
    with pytest.raises(TypeError, match="make_cache"):
        model(input_ids, cache=DynamicCache(), use_cache=True)


def test_rope_and_alibi_are_refused_naming_why():
    for position in ("rope", "alibi"):
        with pytest.raises(ValueError, match="position_embedding_type"):
            tiny_model("linear", position)
    with pytest.raises(ValueError, match="feature_map='relu' is not one of elu, hedgehog"):
        tiny_model("linear", feature_map="relu")


def test_the_hedgehog_map_starts_at_the_identity_and_survives_a_checkpoint(tmp_path):
    """A fresh hedgehog map is the identity (φ(x) = [softmax(x), softmax(-x)]); trained maps load back as saved."""
    from transformers import AutoModelForCausalLM

    fresh = tiny_model("linear", feature_map="hedgehog").model.layers[0].self_attn
    eye = torch.eye(fresh.head_dim)
    assert torch.equal(fresh.query_feature_map, eye.expand_as(fresh.query_feature_map))
    assert torch.equal(fresh.key_feature_map, eye.expand_as(fresh.key_feature_map))
    model = linear_model("hedgehog")
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    input_ids = torch.randint(3, 90, (2, 9))
    assert torch.equal(loaded(input_ids).logits, model(input_ids).logits)


def test_bfloat16_model_keeps_its_sums_in_float32():
    """A bfloat16 model's outputs stay close to the float32 model's: the sums are float32 whatever the dtype."""
    model = tiny_model("linear")
    input_ids = torch.randint(3, 90, (1, 40))
    with torch.no_grad():
        expected = model(input_ids).logits
        actual = model.to(torch.bfloat16)(input_ids).logits.float()
    assert (actual - expected).abs().max() < 0.1 * expected.abs().max()


def test_fla_naive_linear_attention_gives_the_same_outputs_and_state():
    """fla's own naive linear attention (flash-linear-attention, `fla.ops.linear_attn.naive`, with its normalisation
    and no scale), chunked and recurrent, on the same φ-mapped queries and keys (φ is applied outside fla's kernels,
    by its layer): the zoo kernel's outputs (1e-5), and the recurrent form's final state is the zoo's [S, z]. fla has
    no GQA in these kernels: one key/value head per query head here. Its ε is 1e-10 against the zoo's 1e-6, far
    below the tolerance at these normalisers (sums of 128 positive terms)."""
    naive = pytest.importorskip("fla.ops.linear_attn.naive", reason="flash-linear-attention is not installed")
    query, key, value = random_inputs(kv_heads=4, length=128, value_width=8)
    output, state = linear_causal_attend(query, key, value, None, 16, EPS)
    # fla's layout is (B, T, H, d)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    chunked = naive.naive_chunk_linear_attn(q, k, v, scale=1.0, normalize=True)
    torch.testing.assert_close(output, chunked, atol=ATOL, rtol=0)
    recurrent, (sums, normaliser) = naive.naive_recurrent_linear_attn(
        q, k, v, scale=1.0, output_final_state=True, normalize=True
    )
    torch.testing.assert_close(output, recurrent, atol=ATOL, rtol=0)
    # (B, H, d, d_v) and (B, 1, H, d) -> the zoo's (B, G, d, d_v + 1), G = H here
    theirs = torch.cat((sums, normaliser[:, 0, :, :, None]), dim=-1)
    torch.testing.assert_close(state, theirs, atol=1e-4, rtol=1e-6)
