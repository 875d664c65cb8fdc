"""Position types: the formulas against the papers, and true positions under padding."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_attn_zoo.models import VARIANTS
from hf_attn_zoo.models.positions_zoo import alibi_slopes, sinusoidal_embedding

import references
from conftest import ATOL, left_padded_batch, tiny_config, tiny_model


def test_alibi_slopes_are_the_papers():
    # Press et al. 2022, section 3: for 8 heads the slopes are 1/2, 1/4, ..., 1/256.
    assert alibi_slopes(8) == [2.0**-i for i in range(1, 9)]
    # 6 heads: the 4-head slopes (1/4, 1/16, 1/64, 1/256), then every other 8-head slope (1/2, 1/8).
    assert alibi_slopes(6) == [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]
    for heads in (1, 3, 5, 6, 12, 16, 20):
        assert alibi_slopes(heads) == pytest.approx(references.paper_alibi_slopes(heads), rel=1e-12)


def test_sinusoidal_embedding_is_vaswani():
    positions = torch.tensor([[0, 1, 2, 7, 30]])
    torch.testing.assert_close(sinusoidal_embedding(positions, 16, torch.float32), references.sinusoid(positions, 16))


@pytest.mark.parametrize("heads", [6, 3])
def test_alibi_with_non_power_of_two_heads_matches_reference(heads):
    model = tiny_model("mha", "alibi", num_attention_heads=heads, hidden_size=8 * heads)
    input_ids, attention_mask, rows = left_padded_batch()
    with torch.no_grad():
        expected = references.causal_lm_logits(model, input_ids, attention_mask)
        actual = model(input_ids, attention_mask=attention_mask).logits
    for i, row in enumerate(rows):
        torch.testing.assert_close(actual[i, -len(row) :], expected[i, -len(row) :], atol=ATOL, rtol=0)


@pytest.mark.parametrize("position", ["learned", "sinusoidal", "alibi"])
def test_absolute_positions_follow_position_ids(position):
    """Explicit position_ids win over the padded index: shifting them changes absolute-position models."""
    model = tiny_model("gqa", position)
    input_ids = torch.randint(3, 90, (1, 8))
    with torch.no_grad():
        base = model(input_ids, position_ids=torch.arange(8)[None]).logits
        shifted = model(input_ids, position_ids=torch.arange(8)[None] + 5).logits
    if position == "alibi":  # relative: a constant shift changes nothing
        torch.testing.assert_close(base, shifted, atol=ATOL, rtol=0)
    else:
        assert not torch.allclose(base, shifted, atol=1e-3)


@pytest.mark.parametrize(
    "position, scale_embedding, scaled",
    [("sinusoidal", None, False), ("sinusoidal", True, True), ("rope", None, False), ("learned", True, True)],
)
def test_token_embeddings_are_scaled_only_when_asked(position, scale_embedding, scaled):
    """Vaswani et al.'s sqrt(d) scale is opt-in (`scale_embedding=True`), with every position type. The scale is in
    the embedding module, so `inputs_embeds` from it equals passing `input_ids`."""
    model = tiny_model("gqa", position, scale_embedding=scale_embedding)
    input_ids = torch.randint(3, 90, (2, 8))
    embeds = model.get_input_embeddings()(input_ids)
    weight = model.model.embed_tokens.weight[input_ids]
    torch.testing.assert_close(embeds, weight * model.config.hidden_size**0.5 if scaled else weight)
    with torch.no_grad():
        assert torch.equal(model(inputs_embeds=embeds).logits, model(input_ids).logits)


@pytest.mark.parametrize("hidden_size", [64, 256])
def test_scaled_token_embeddings_start_at_unit_rms_as_fairseq_and_tensor2tensor(hidden_size):
    """Under the sqrt(d) scale the token table starts at std 1/sqrt(d) (fairseq's `Embedding`, tensor2tensor's
    modality), so a token enters the residual stream at RMS 1 beside sinusoids of RMS 1/sqrt(2), at any width; at std
    `initializer_range` the sinusoids outweighed tokens 3 to 1 at width 128 and the model trained to twice the
    perplexity. Unscaled tables keep `initializer_range`; the padding row starts at zero."""
    heads = hidden_size // 16
    shape = dict(hidden_size=hidden_size, num_attention_heads=heads, num_key_value_heads=heads // 2, vocab_size=4096)
    scaled = tiny_model("gqa", "sinusoidal", scale_embedding=True, **shape)
    unscaled = tiny_model("gqa", "sinusoidal", **shape)
    for model, std in ((scaled, hidden_size**-0.5), (unscaled, unscaled.config.initializer_range)):
        table = model.model.embed_tokens.weight.detach()
        assert table[1:].std().item() == pytest.approx(std, rel=0.05)  # 4,095 rows: the sample std is within 5%
        assert torch.equal(table[0], torch.zeros(hidden_size))  # pad_token_id = 0
    tokens = scaled.get_input_embeddings()(torch.arange(1, 4096))
    assert tokens.pow(2).mean().sqrt().item() == pytest.approx(1.0, rel=0.05)
    positions = references.sinusoid(torch.arange(256)[None], hidden_size)
    assert positions.pow(2).mean().sqrt().item() == pytest.approx(2**-0.5, rel=1e-6)


@pytest.mark.parametrize("scale_embedding, amplitude", [(None, 0.2 * 2**0.5 / 4), (True, 1.0)])
def test_sinusoids_enter_below_the_token_embeddings_rms(scale_embedding, amplitude):
    """Beside unscaled tokens (std `initializer_range`, 0.2 here) the sinusoids have amplitude initializer_range *
    sqrt(2) / 4, RMS a quarter of the tokens': at amplitude 1 they outweighed tokens 35 to 1 at std 0.02. Beside
    scaled tokens (RMS 1) Vaswani's amplitude 1. The first layer sees exactly tokens + amplitude * PE."""
    model = tiny_model("gqa", "sinusoidal", scale_embedding=scale_embedding)
    assert model.config.sinusoid_amplitude == pytest.approx(amplitude, rel=1e-12)
    input_ids = torch.randint(3, 90, (2, 9))
    seen = []
    model.model.layers[0].register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    with torch.no_grad():
        model(input_ids)
    positions = references.sinusoid(torch.arange(9)[None], model.config.hidden_size)
    expected = model.get_input_embeddings()(input_ids) + amplitude * positions
    torch.testing.assert_close(seen[0], expected, atol=ATOL, rtol=0)


def test_a_sinusoidal_checkpoint_saved_before_the_amplitude_existed_loads_as_it_was_trained(tmp_path):
    """A config saved with `scale_embedding` null and no `sinusoid_amplitude` is the earlier default: tokens scaled
    by sqrt(d) beside sinusoids of amplitude 1; configs saved now carry both fields explicitly."""
    model = tiny_model("gqa", "sinusoidal", scale_embedding=True)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["scale_embedding"] is True and saved["sinusoid_amplitude"] == 1.0
    del saved["sinusoid_amplitude"]
    saved["scale_embedding"] = None
    (tmp_path / "config.json").write_text(json.dumps(saved))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.scale_embedding is True and loaded.config.sinusoid_amplitude == 1.0
    input_ids = torch.randint(3, 90, (1, 9))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids).logits, model(input_ids).logits)


def test_learned_positions_start_at_zero_so_an_untrained_model_is_nope():
    """The table starts at zero (at GPT-2's std 0.02 its random rows are noise as large as the token embeddings, which
    the board's short runs never unlearned): an untrained learned-positions model computes exactly the NoPE model."""
    learned = VARIANTS["gqa"].causal_lm_class(tiny_config("gqa", "learned")).eval()  # tiny_model randomises it
    assert torch.equal(learned.model.embed_positions.weight, torch.zeros_like(learned.model.embed_positions.weight))
    nope = tiny_model("gqa", "none")
    nope.load_state_dict({k: v for k, v in learned.state_dict().items() if "embed_positions" not in k})
    input_ids = torch.randint(3, 90, (2, 12))
    with torch.no_grad():
        assert torch.equal(learned(input_ids).logits, nope(input_ids).logits)  # + 0.0: bit-identical


def test_learned_positions_beyond_the_table_raise():
    model = tiny_model("gqa", "learned", max_position_embeddings=16)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.randint(3, 90, (1, 17)))


def test_alibi_refuses_kernels_without_an_additive_bias():
    model = tiny_model("gqa", "alibi")
    model.set_attn_implementation("flex_attention")
    with pytest.raises(ValueError, match="attn_implementation='sdpa' or 'eager'"):
        model(torch.randint(3, 90, (1, 8)))
