"""Linformer: sharing modes, the paper's bidirectional form, the constant decoding state and its errors."""

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

import references
from conftest import ATOL, left_padded_batch, returned_cache, tiny_model


def reference_check(model, lengths=(11, 7, 4)):
    input_ids, attention_mask, rows = left_padded_batch(lengths=lengths)
    with torch.no_grad():
        expected = references.causal_lm_logits(model, input_ids, attention_mask, references.linformer_attention)
        actual = model(input_ids, attention_mask=attention_mask).logits
    for i, row in enumerate(rows):
        torch.testing.assert_close(actual[i, -len(row) :], expected[i, -len(row) :], atol=ATOL, rtol=0)


@pytest.mark.parametrize("sharing", ["none", "headwise", "key_value", "layerwise"])
@pytest.mark.parametrize("is_causal", [True, False])
def test_sharing_modes_and_both_forms_match_the_reference(sharing, is_causal):
    reference_check(tiny_model("linformer", linformer_sharing=sharing, is_causal=is_causal))


def test_sharing_decides_the_parameters(tmp_path):
    counts = {}
    for sharing in ("none", "headwise", "key_value", "layerwise"):
        model = tiny_model("linformer", linformer_sharing=sharing)
        names = [name for name in model.state_dict() if "projection" in name]
        counts[sharing] = sum(model.state_dict()[name].numel() for name in names)
    e = 5 * 64  # k x n
    # 2 layers; "none": E and F per key/value head (2 heads)
    assert counts == {"none": 2 * 2 * 2 * e, "headwise": 2 * 2 * e, "key_value": 2 * e, "layerwise": e}
    shared = tiny_model("linformer", linformer_sharing="layerwise")
    shared.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    projections = {id(layer.self_attn.linformer_projection) for layer in reloaded.model.layers}
    assert len(projections) == 1  # still one projection, borrowed by every layer
    input_ids = torch.randint(3, 90, (1, 9))
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids).logits, shared(input_ids).logits)


def test_bidirectional_form_sees_the_future_and_cannot_generate():
    model = tiny_model("linformer", is_causal=False)
    input_ids = torch.randint(3, 90, (1, 10))
    changed = input_ids.clone()
    changed[0, 8] += 1
    with torch.no_grad():
        assert not torch.allclose(model(input_ids).logits[:, :8], model(changed).logits[:, :8])
        attentions = model(input_ids, output_attentions=True).attentions
    assert attentions[0].shape == (1, 4, 10, 5)  # (B, H, T, k): weights over the slots
    with pytest.raises(ValueError, match="is_causal"):
        model.generate(input_ids, max_new_tokens=2)


def test_longer_than_the_projection_is_an_error():
    model = tiny_model("linformer", max_position_embeddings=16)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.randint(3, 90, (1, 17)))


def test_decoding_state_does_not_grow():
    model = tiny_model("linformer", max_position_embeddings=64)
    input_ids = torch.randint(3, 90, (2, 5))
    out = model.generate(input_ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    small = sum(layer.nbytes() for layer in returned_cache(out).layers)
    out = model.generate(input_ids, max_new_tokens=40, do_sample=False, return_dict_in_generate=True)
    assert sum(layer.nbytes() for layer in returned_cache(out).layers) == small
    assert returned_cache(out).get_seq_length() == 5 + 40 - 1


def test_decoding_strategies_the_state_cannot_serve_fail_clearly():
    model = tiny_model("linformer")
    input_ids = torch.randint(3, 90, (1, 6))
    with pytest.raises(ValueError, match="state per layer"):
        model.generate(input_ids, max_new_tokens=2, cache_implementation="static")
    cache = returned_cache(model(input_ids, use_cache=True))
    with pytest.raises(ValueError, match="cannot be removed"):
        cache.crop(-1)
    with pytest.raises(TypeError, match="make_cache"):
        model(input_ids, cache=DynamicCache(), use_cache=True)
