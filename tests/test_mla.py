"""Multi-head latent attention beyond the conformance suite: the absorbed decode path against the expanded one, the
frequencies a conversion keeps against the naive reference, and the cache's size measured."""

import pytest
import torch
from torch import nn

from hf_attn_zoo.models import get_variant

import references
from conftest import ATOL, VOCAB_SIZE, assert_loads_without_the_package, left_padded_batch, returned_cache, tiny_config

MLA = get_variant("mla")


def tiny_mla(**overrides):
    torch.manual_seed(0)
    return MLA.causal_lm_class._from_config(tiny_config("mla", **overrides), attn_implementation="eager").eval()


def decode_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits of a prefill of `prefill` tokens, then of one token at a time from the cache: `(B, T, vocab)`."""
    with torch.no_grad():
        out = model(input_ids[:, :prefill], attention_mask=attention_mask[:, :prefill], use_cache=True)
        logits, cache = [out.logits], returned_cache(out)
        for t in range(prefill, input_ids.shape[1]):
            out = model(
                input_ids[:, t : t + 1],
                attention_mask=attention_mask[:, : t + 1],
                cache=cache,
                use_cache=True,
            )
            logits.append(out.logits)
    return torch.cat(logits, dim=1)


def count_calls(model, method: str) -> list[int]:
    """Count calls of `method` on every attention layer of `model` (instance attributes shadow the class's)."""
    calls = [0]
    for layer in model.model.layers:
        attention = layer.self_attn
        original = getattr(attention, method)

        def counted(*args, _original=original, **kwargs):
            calls[0] += 1
            return _original(*args, **kwargs)

        setattr(attention, method, counted)
    return calls


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("position", ["rope", "alibi"])
def test_absorbed_decoding_equals_expanded_decoding_and_the_uncached_forward(backend, position):
    model = tiny_mla(position_embedding_type=position)
    model.set_attn_implementation(backend)
    input_ids, attention_mask, _ = left_padded_batch()
    with torch.no_grad():
        full = model(input_ids, attention_mask=attention_mask, use_cache=False).logits
    absorbed_calls = count_calls(model, "attend_absorbed")
    absorbed = decode_logits(model, input_ids, attention_mask, prefill=4)
    steps = input_ids.shape[1] - 4
    assert absorbed_calls[0] == steps * model.config.num_hidden_layers  # every one-token step took the absorbed path
    for layer in model.model.layers:
        layer.self_attn.absorb_for_decoding = False
    expanded_calls = count_calls(model, "attend_expanded")
    expanded = decode_logits(model, input_ids, attention_mask, prefill=4)
    assert expanded_calls[0] == (steps + 1) * model.config.num_hidden_layers
    real = attention_mask.bool()
    torch.testing.assert_close(absorbed[real], expanded[real], rtol=0, atol=ATOL)
    torch.testing.assert_close(absorbed[real], full[real], rtol=0, atol=ATOL)


def test_absorbed_attention_weights_are_the_expanded_ones():
    model = tiny_mla()
    input_ids, attention_mask, _ = left_padded_batch()
    with torch.no_grad():
        full = model(input_ids, attention_mask=attention_mask, output_attentions=True).attentions
        cache = returned_cache(model(input_ids[:, :-1], attention_mask=attention_mask[:, :-1], use_cache=True))
        step = model(input_ids[:, -1:], attention_mask=attention_mask, cache=cache, output_attentions=True).attentions
    for whole, last in zip(full, step):
        assert last.shape == (input_ids.shape[0], model.config.num_attention_heads, 1, input_ids.shape[1])
        torch.testing.assert_close(last[:, :, 0], whole[:, :, -1], rtol=0, atol=ATOL)


class Wrapped(nn.Module):
    """A projection that is not a plain `nn.Linear` (as a LoRA adapter or a quantised layer)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def test_a_wrapped_up_projection_decodes_through_the_expanded_path():
    """A wrapped `kv_b_proj` has no single weight to fold into the query: decoding stays exact by expanding."""
    model = tiny_mla()
    input_ids, attention_mask, _ = left_padded_batch()
    expected = decode_logits(model, input_ids, attention_mask, prefill=4)
    for layer in model.model.layers:
        layer.self_attn.kv_b_proj = Wrapped(layer.self_attn.kv_b_proj)
    absorbed_calls = count_calls(model, "attend_absorbed")
    actual = decode_logits(model, input_ids, attention_mask, prefill=4)
    assert absorbed_calls[0] == 0
    real = attention_mask.bool()
    torch.testing.assert_close(actual[real], expected[real], rtol=0, atol=ATOL)


@pytest.mark.parametrize(("q_lora_rank", "latent_norm"), [(None, False), (16, True)])
def test_chosen_rope_frequencies_match_the_reference(q_lora_rank, latent_norm):
    """A conversion's RoPE part: per layer, two of head_dim / 2 = 4 frequencies of the parent's ladder (head_dim 8)
    rather than the RoPE part's own; prefill and decoding both equal the naive reference (with and without the
    latent's norm, which a conversion turns off)."""
    model = tiny_mla(
        q_lora_rank=q_lora_rank, qk_rope_head_dim=4, rope_frequencies=[[3, 1], [0, 2]], latent_norm=latent_norm
    )
    assert (model.model.layers[0].self_attn.kv_a_layernorm is None) == (not latent_norm)
    assert model.model.rotary_emb.inv_freq.shape == (model.config.head_dim // 2,)  # the parent's whole ladder
    input_ids, attention_mask, _ = left_padded_batch()
    with torch.no_grad():
        expected = references.causal_lm_logits(model, input_ids, attention_mask, references.latent_attention)
    decoded = decode_logits(model, input_ids, attention_mask, prefill=5)
    real = attention_mask.bool()
    torch.testing.assert_close(decoded[real], expected[real], rtol=0, atol=ATOL)
    # the frequencies matter: the RoPE part's own ladder gives other logits
    model.config.rope_frequencies = None
    other = MLA.causal_lm_class._from_config(model.config, attn_implementation="eager").eval()
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert not torch.allclose(other(input_ids, attention_mask=attention_mask).logits[real], expected[real])


def test_the_cache_holds_one_latent_and_one_rope_key_per_token():
    """Measured on the cache's tensors: L * (kv_lora_rank + qk_rope_head_dim) values per token, whatever the
    number of heads, against 2 * L * H * head_dim for MHA of the same width."""
    input_ids = torch.randint(2, VOCAB_SIZE, (1, 24))
    sizes = {}
    for heads in (2, 4, 8):
        model = tiny_mla(num_attention_heads=heads, hidden_size=32, kv_lora_rank=12, qk_rope_head_dim=4)
        with torch.no_grad():
            cache = returned_cache(model(input_ids, use_cache=True))
        values = sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers)
        sizes[heads] = values / input_ids.shape[1]
    assert sizes == {heads: 2 * (12 + 4) for heads in (2, 4, 8)}


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (dict(rope_frequencies=[[0, 1], [0, 1]], position_embedding_type="alibi"), "position_embedding_type"),
        (dict(rope_frequencies=[[0, 4], [0, 1]]), r"rope_frequencies\[0\]"),  # head_dim 8: indices below 4
        (dict(rope_frequencies=[[1, 1], [0, 1]]), r"rope_frequencies\[0\]"),  # distinct
        (dict(rope_frequencies=[[0], [1]]), r"rope_frequencies\[0\]"),  # qk_rope_head_dim / 2 of them
        (dict(q_lora_rank=0), "q_lora_rank"),
        (dict(v_head_dim=0), "v_head_dim"),
        (dict(latent_norm="yes"), "latent_norm"),
    ],
)
def test_invalid_latent_configs_name_the_field(fields, named):
    with pytest.raises(ValueError, match=named):
        tiny_config("mla", **{"qk_rope_head_dim": 4, **fields})


def test_a_nope_free_model_has_every_key_channel_in_the_shared_rope_key():
    """qk_nope_head_dim = 0 is allowed: queries and the one shared key are RoPE channels only (what an exact
    conversion of identical key heads gives), and decoding stays exact."""
    model = tiny_mla(qk_nope_head_dim=0, qk_rope_head_dim=8)
    input_ids, attention_mask, _ = left_padded_batch()
    with torch.no_grad():
        expected = references.causal_lm_logits(model, input_ids, attention_mask, references.latent_attention)
    decoded = decode_logits(model, input_ids, attention_mask, prefill=4)
    real = attention_mask.bool()
    torch.testing.assert_close(decoded[real], expected[real], rtol=0, atol=ATOL)


def test_chosen_frequencies_survive_saving_and_remote_code_loading(tmp_path):
    """The per-layer frequency channels are rebuilt from the config on loading (also onto the meta device that
    `from_pretrained` builds on), by the package and by the checkpoint's own code."""
    from transformers import AutoModelForCausalLM

    model = tiny_mla(qk_rope_head_dim=4, rope_frequencies=[[3, 1], [0, 2]])
    model.save_pretrained(tmp_path / "mla")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "mla", attn_implementation="eager").eval()
    assert [layer.self_attn.rope_channels.tolist() for layer in reloaded.model.layers] == [[3, 1, 7, 5], [0, 2, 4, 6]]
    input_ids, attention_mask, _ = left_padded_batch()
    with torch.no_grad():
        expected = model(input_ids, attention_mask=attention_mask).logits
        torch.testing.assert_close(reloaded(input_ids, attention_mask=attention_mask).logits, expected, rtol=0, atol=0)
    assert_loads_without_the_package(tmp_path / "mla", tmp_path)
