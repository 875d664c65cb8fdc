"""AFT: numerical stability, the window's effect, the O(d) decoding state, and padding that cannot poison gradients."""

import pytest
import torch

from hf_attn_zoo.models.aft import (
    aft_attend,
    aft_band_fits,
    aft_banded_attend,
    aft_dense_attend,
    aft_simple_attend,
    aft_state_after,
)

from conftest import ATOL, left_padded_batch, returned_cache, tiny_model


@pytest.mark.parametrize("scale", [400.0, 40_000.0])
@pytest.mark.parametrize("name", ["aft_full", "aft_local", "aft_simple"])
def test_large_keys_stay_finite_and_causal(name, scale):
    """Keys of magnitude 200 overflow a naive exp; shifts by causal maxima keep every output finite and exactly
    causal. Keys of magnitude 20,000 also overflow AFT-full's and AFT-local's whole-sequence float64 path, which then
    falls back to the chunked scan."""
    model = tiny_model(name)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(scale)
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


@pytest.mark.parametrize("chunk", [1, 3, 4, 16])
def test_simple_kernel_matches_the_chunked_scan(chunk):
    """`aft_simple_attend` (all chunks at once) against `aft_attend` in float64, with left padding, packed documents,
    and a state carried from one call into the next."""
    torch.manual_seed(0)
    batch, length, width = 3, 11, 8
    keys, values = torch.randn(batch, length, width) * 3, torch.randn(batch, length, width)
    valid = torch.ones(batch, length, dtype=torch.bool)
    valid[1, :4] = False
    positions = torch.arange(length).expand(batch, -1)
    expected, expected_state = aft_attend(keys.double(), values.double(), valid, positions, None, 0, None, 5)
    got, state = aft_simple_attend(keys, values, valid, None, chunk)
    torch.testing.assert_close(got.double(), expected, atol=ATOL, rtol=0)
    assert torch.equal(got[1, :4], torch.zeros(4, width))
    for name in ("max", "numerator", "denominator"):
        scale = torch.exp(state["max"].double() - expected_state["max"])  # the same sums at the state's shift
        torch.testing.assert_close(state[name].double() * (scale if name != "max" else 1), expected_state[name])
    first, state = aft_simple_attend(keys[:, :6], values[:, :6], valid[:, :6], None, chunk)
    rest, _ = aft_simple_attend(keys[:, 6:], values[:, 6:], valid[:, 6:], state, chunk)
    torch.testing.assert_close(torch.cat((first, rest), 1).double(), expected, atol=ATOL, rtol=0)

    documents = torch.tensor([[0] * 5 + [1] * 6, [0] * 2 + [1] * 7 + [2] * 2, [0] * length])
    packed, _ = aft_simple_attend(keys, values, None, None, chunk, documents)
    for row, starts in enumerate(([0, 5, 11], [0, 2, 9, 11], [0, 11])):
        for start, end in zip(starts, starts[1:]):
            alone, _ = aft_attend(
                keys[row : row + 1, start:end].double(),
                values[row : row + 1, start:end].double(),
                None,
                positions[:1, : end - start],
                None,
                0,
                None,
                5,
            )
            torch.testing.assert_close(packed[row : row + 1, start:end].double(), alone, atol=ATOL, rtol=0)


def test_simple_kernel_refuses_documents_with_a_state():
    keys = torch.randn(1, 4, 2)
    _, state = aft_simple_attend(keys, keys, None, None, 4)
    with pytest.raises(ValueError, match="cache=None"):
        aft_simple_attend(keys, keys, None, state, 4, torch.zeros(1, 4, dtype=torch.long))


def kernel_inputs(batch: int, length: int, width: int, rank: int = 2):
    """Keys (of a wide range), values and a rank-`rank` pairwise bias u[t]·v[t'] over `length` positions."""
    torch.manual_seed(0)
    keys, values = torch.randn(batch, length, width) * 3, torch.randn(batch, length, width)
    u, v = torch.randn(length, rank), torch.randn(length, rank)

    def bias(query_positions, key_positions):
        return u[query_positions] @ v[key_positions].transpose(1, 2)

    return keys, values, bias


@pytest.mark.parametrize("window", [None, 1, 3])
def test_dense_kernel_matches_the_chunked_scan(window):
    """`aft_dense_attend` (the whole sequence as two matrix products) against `aft_attend` in float64, with left
    padding and packed documents, for AFT-full (no window) and AFT-local."""
    batch, length, width = 3, 11, 8
    keys, values, bias = kernel_inputs(batch, length, width)

    def reference(keys, values, valid, positions, with_state=False):
        double_bias = lambda *positions: bias(*positions).double()  # noqa: E731
        out = aft_attend(keys.double(), values.double(), valid, positions, None, window, double_bias, 4)
        return out if with_state else out[0]

    valid = torch.ones(batch, length, dtype=torch.bool)
    valid[1, :4] = False
    positions = (valid.cumsum(1) - 1).clamp(min=0)
    got = aft_dense_attend(keys, values, valid, positions, window, bias)
    expected, expected_state = reference(keys, values, valid, positions, with_state=True)
    torch.testing.assert_close(got.double(), expected, atol=ATOL, rtol=0)
    assert torch.equal(got[1, :4], torch.zeros(4, width))  # padding reaches no key
    # the state a cache keeps after the call is the chunked scan's: the same sums at the same shift, the same keys
    state = aft_state_after(keys, values, valid, positions, window)
    assert state.keys() == expected_state.keys()
    for name, tensor in state.items():
        scale = torch.exp(state["max"].double() - expected_state["max"]) if name in ("numerator", "denominator") else 1
        torch.testing.assert_close(tensor.double() * scale, expected_state[name].double(), atol=ATOL, rtol=1e-6)

    documents = torch.tensor([[0] * 5 + [1] * 6, [0] * 2 + [1] * 7 + [2] * 2, [0] * length])
    starts = [[0, 5, 11], [0, 2, 9, 11], [0, 11]]
    positions = torch.stack(
        [torch.cat([torch.arange(end - start) for start, end in zip(row, row[1:])]) for row in starts]
    )
    packed = aft_dense_attend(keys, values, None, positions, window, bias, documents)
    for row, row_starts in enumerate(starts):
        for start, end in zip(row_starts, row_starts[1:]):
            alone = reference(
                keys[row : row + 1, start:end],
                values[row : row + 1, start:end],
                None,
                positions[row : row + 1, start:end],
            )
            torch.testing.assert_close(packed[row : row + 1, start:end].double(), alone, atol=ATOL, rtol=0)

    # a key 1,000 nats above its document's first overflows float64: the result says so, and the model falls back
    keys[0, 6] += 1000.0
    assert not torch.isfinite(
        aft_dense_attend(keys, values, None, torch.arange(length).expand(batch, -1), window, bias)
    ).all()


@pytest.mark.parametrize("window", [1, 3, 4, 11, 20])
def test_banded_kernel_matches_the_chunked_scan(window):
    """`aft_banded_attend` (a running sum beyond the window, a band of matrix products within it) against
    `aft_attend` in float64, with left padding, a length that is not a multiple of the window, and a window as long
    as the sequence or longer; positions that do not advance by one per token are left to the dense path."""
    batch, length, width = 3, 11, 8
    keys, values, bias = kernel_inputs(batch, length, width)

    valid = torch.ones(batch, length, dtype=torch.bool)
    valid[1, :4] = False
    valid[2, :] = False  # a row of padding only
    positions = (valid.cumsum(1) - 1).clamp(min=0)
    double_bias = lambda *positions: bias(*positions).double()  # noqa: E731
    expected, _ = aft_attend(keys.double(), values.double(), valid, positions, None, window, double_bias, 4)
    got = aft_banded_attend(keys, values, valid, positions, window, bias)
    torch.testing.assert_close(got.double(), expected, atol=ATOL, rtol=0)
    assert torch.equal(got[1, :4], torch.zeros(4, width)) and torch.equal(got[2], torch.zeros(length, width))

    changed = keys.clone()
    changed[:, 7:] += torch.randn(batch, length - 7, width) * 5
    later = aft_banded_attend(changed, values, valid, positions, window, bias)
    assert torch.equal(later[:, :7], got[:, :7])  # exactly causal

    assert aft_band_fits(valid, positions) and aft_band_fits(None, torch.arange(length).expand(batch, -1) + 3)
    skipping = positions.clone()
    skipping[0, 5:] += 1  # a gap in row 0: the window is no longer a band of indices
    assert not aft_band_fits(valid, skipping) and not aft_band_fits(None, skipping)


@pytest.mark.parametrize("window", [2, 5])
def test_banded_kernel_trains_as_the_dense_path(window):
    """Training runs through `aft_banded_attend`: its gradients for keys, values and the bias factors are the dense
    path's (1e-5), padding included, where neither may leak a gradient."""
    torch.manual_seed(0)
    batch, length, width, rank = 2, 13, 6, 2
    valid = torch.ones(batch, length, dtype=torch.bool)
    valid[1, :3] = False
    positions = (valid.cumsum(1) - 1).clamp(min=0)
    weights = torch.randn(length, width)

    def gradients(attend):
        torch.manual_seed(1)
        keys = (torch.randn(batch, length, width) * 2).requires_grad_()
        values = torch.randn(batch, length, width).requires_grad_()
        u, v = torch.randn(length, rank).requires_grad_(), torch.randn(length, rank).requires_grad_()

        def bias(query_positions, key_positions):
            return u[query_positions] @ v[key_positions].transpose(1, 2)

        out = attend(keys, values, valid, positions, window, bias)
        (out * weights).sum().backward()
        return out, keys.grad, values.grad, u.grad, v.grad

    banded, dense = gradients(aft_banded_attend), gradients(aft_dense_attend)
    for got, expected in zip(banded, dense):
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=1e-5)
    assert torch.equal(banded[1][1, :3], torch.zeros(3, width))  # no gradient reaches padding keys


def test_the_model_takes_the_band_past_two_windows_and_matches_the_dense_path(monkeypatch):
    """AFT-local's forward routes a left-padded batch longer than 2s through the band, and its logits are those of the
    dense path; a packed row (documents) and a batch of at most 2s tokens go dense."""
    import hf_attn_zoo.models.aft as aft

    model, calls = tiny_model("aft_local", aft_window=3), []
    input_ids, attention_mask, _ = left_padded_batch(lengths=(11, 7, 4))

    def spy(*args):
        calls.append(args)
        return aft_banded_attend(*args)

    monkeypatch.setattr(aft, "aft_banded_attend", spy)
    with torch.no_grad():
        banded = model(input_ids, attention_mask=attention_mask).logits
        layers = model.config.num_hidden_layers
        assert len(calls) == layers
        model(input_ids[:, -6:], attention_mask=attention_mask[:, -6:])  # 6 = 2s tokens: dense, not called
        packed = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4]])  # two documents in one row: dense
        model(input_ids[:1], position_ids=packed)
        model(input_ids[:1], position_ids=torch.arange(11)[None] * 2)  # positions two apart: not a band, dense
        assert len(calls) == layers
        monkeypatch.setattr(aft, "aft_band_fits", lambda *args: torch.tensor(False))  # as if it were not a band
        dense = model(input_ids, attention_mask=attention_mask).logits
    valid = attention_mask.bool()
    torch.testing.assert_close(banded[valid], dense[valid], atol=ATOL, rtol=1e-5)


def test_compiled_aft_local_past_two_windows_trains_as_eager_and_leaves_output_capture_working():
    """Compiled, AFT-local past two windows takes the dense path (whether the band fits is data) in one graph, with
    eager's logits and gradients. No `torch.cond`: with one, dynamo dropped the state transformers' output collector
    sets after it, and the next eager call returned no hidden states."""
    torch._dynamo.reset()
    model = tiny_model("aft_local", aft_window=3).train()
    compiled = torch.compile(model, fullgraph=True)
    input_ids, attention_mask, _ = left_padded_batch(lengths=(11, 7, 4))
    valid = attention_mask.bool()
    results = []
    for run in (model, compiled):
        model.zero_grad()
        logits = run(input_ids, attention_mask=attention_mask).logits
        logits[valid].square().mean().backward()
        results.append((logits[valid], model.model.layers[0].self_attn.position_bias_u.weight.grad))
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=1e-5)
    with torch.no_grad():
        hidden_states = model(input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states
    assert hidden_states is not None and len(hidden_states) == model.config.num_hidden_layers + 1
