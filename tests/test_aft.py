"""AFT: numerical stability, the window's effect, the O(d) decoding state, and padding that cannot poison gradients."""

import pytest
import torch

from conftest import ATOL, left_padded_batch, returned_cache, tiny_model


@pytest.mark.parametrize("name", ["aft_full", "aft_local", "aft_simple"])
def test_large_keys_stay_finite_and_causal(name):
    """Keys of magnitude 200 overflow a naive exp; running maxima keep every output finite and exactly causal."""
    model = tiny_model(name)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(400.0)
    input_ids = torch.randint(3, 90, (2, 12))
    changed = input_ids.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 97
    with torch.no_grad():
        before, after = model(input_ids).logits, model(changed).logits
    assert torch.isfinite(before).all()
    assert torch.equal(before[:, :7], after[:, :7])


@pytest.mark.parametrize("name", ["aft_full", "aft_local", "aft_simple"])
def test_large_padding_keys_leave_gradients_finite(name):
    """Left padding comes before any real key: a large padding key must not overflow into a NaN gradient."""
    model = tiny_model(name).train()
    input_ids, attention_mask, _ = left_padded_batch()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(400.0)
    loss = model(
        input_ids, attention_mask=attention_mask, labels=input_ids.masked_fill(attention_mask == 0, -100)
    ).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_local_window_covering_everything_is_aft_full():
    full = tiny_model("aft_full")
    local = tiny_model("aft_local", aft_window=64)
    local.load_state_dict(full.state_dict())
    input_ids = torch.randint(3, 90, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(local(input_ids).logits, full(input_ids).logits, atol=ATOL, rtol=0)
    narrow = tiny_model("aft_local", aft_window=2)
    narrow.load_state_dict(full.state_dict())
    with torch.no_grad():
        assert not torch.allclose(narrow(input_ids).logits[:, 2:], full(input_ids).logits[:, 2:], atol=1e-4)


def test_simple_decodes_from_a_state_of_width_d():
    model = tiny_model("aft_simple")
    input_ids = torch.randint(3, 90, (2, 5))
    for new_tokens in (3, 30):
        cache = model.generate(input_ids, max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True)
        cache = returned_cache(cache)
        for layer in cache.layers:
            assert {name: tuple(t.shape) for name, t in layer.state.items() if t.numel()} == {
                "max": (2, 32),
                "numerator": (2, 32),
                "denominator": (2, 32),
            }


def test_local_state_holds_the_window_only():
    model = tiny_model("aft_local", aft_window=4)
    out = model.generate(
        torch.randint(3, 90, (1, 20)), max_new_tokens=9, do_sample=False, return_dict_in_generate=True
    )
    cache = returned_cache(out)
    assert cache.layers[0].state["keys"].shape == (1, 3, 32)  # the last s - 1 keys
