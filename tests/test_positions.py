"""Position types: the formulas against the papers, and true positions under padding."""

import pytest
import torch

from hf_attn_zoo.models.positions_zoo import alibi_slopes, sinusoidal_embedding

import references
from conftest import ATOL, left_padded_batch, tiny_model


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
    [("sinusoidal", None, True), ("sinusoidal", False, False), ("rope", None, False), ("learned", True, True)],
)
def test_token_embeddings_are_scaled_under_sinusoidal_positions(position, scale_embedding, scaled):
    """Vaswani et al. scale token embeddings by sqrt(d) beside sinusoids of amplitude 1; `scale_embedding` says
    otherwise. The scale is in the embedding module, so `inputs_embeds` from it equals passing `input_ids`."""
    model = tiny_model("gqa", position, scale_embedding=scale_embedding)
    input_ids = torch.randint(3, 90, (2, 8))
    embeds = model.get_input_embeddings()(input_ids)
    weight = model.model.embed_tokens.weight[input_ids]
    torch.testing.assert_close(embeds, weight * model.config.hidden_size**0.5 if scaled else weight)
    with torch.no_grad():
        assert torch.equal(model(inputs_embeds=embeds).logits, model(input_ids).logits)


def test_learned_positions_beyond_the_table_raise():
    model = tiny_model("gqa", "learned", max_position_embeddings=16)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.randint(3, 90, (1, 17)))


def test_alibi_refuses_kernels_without_an_additive_bias():
    model = tiny_model("gqa", "alibi")
    model.set_attn_implementation("flex_attention")
    with pytest.raises(ValueError, match="attn_implementation='sdpa' or 'eager'"):
        model(torch.randint(3, 90, (1, 8)))
