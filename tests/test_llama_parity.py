"""Parity with transformers' own `LlamaForCausalLM` (litgpt's `test_against_hf_llama` pattern)."""

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from hf_attn_zoo.convert import from_llama, to_llama, zoo_config_from_llama
from hf_attn_zoo.models import VARIANTS

from conftest import ATOL, left_padded_batch, positions_from_mask, tiny_model


def tiny_llama(num_key_value_heads=2, tie_word_embeddings=False, attn_implementation="sdpa", **overrides):
    overrides.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 500000.0})
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=128,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,
        **overrides,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    # Llama's init leaves norms at 1; perturb them so the test also checks where each norm weight goes.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.set_attn_implementation(attn_implementation)
    return model.eval()


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize(
    "num_key_value_heads, tie, extra",
    [
        (2, False, {}),
        (4, True, {}),
        (1, False, {"attention_bias": True, "mlp_bias": True}),
        (2, False, {"head_dim": 24}),
    ],
    ids=["gqa", "mha-tied", "mqa-bias", "gqa-head_dim"],
)
def test_logits_match_llama(attn_implementation, num_key_value_heads, tie, extra):
    llama = tiny_llama(num_key_value_heads, tie, attn_implementation, **extra)
    zoo = from_llama(llama)
    assert zoo.config._attn_implementation == attn_implementation
    input_ids, attention_mask, rows = left_padded_batch(lengths=(12, 12, 12))
    with torch.no_grad():
        torch.testing.assert_close(zoo(input_ids).logits, llama(input_ids).logits, atol=ATOL, rtol=0)
    input_ids, attention_mask, rows = left_padded_batch(lengths=(12, 8, 3))
    position_ids = positions_from_mask(attention_mask)
    for kwargs in (
        {"attention_mask": attention_mask},
        {"attention_mask": attention_mask, "position_ids": position_ids},
    ):
        with torch.no_grad():
            ours, theirs = zoo(input_ids, **kwargs).logits, llama(input_ids, **kwargs).logits
        for i, row in enumerate(rows):  # pad positions are garbage on both sides; compare real tokens
            torch.testing.assert_close(ours[i, -len(row) :], theirs[i, -len(row) :], atol=ATOL, rtol=0)


def test_variant_follows_head_counts():
    assert from_llama(tiny_llama(4)).config.model_type == "zoo_mha"
    assert from_llama(tiny_llama(2)).config.model_type == "zoo_gqa"
    assert from_llama(tiny_llama(1)).config.model_type == "zoo_mqa"
    assert from_llama(tiny_llama(4), variant="gqa").config.model_type == "zoo_gqa"


def test_gqa_config_loads_llama_state_dict_unchanged():
    llama = tiny_llama(2)
    config = VARIANTS["gqa"].config(**{k: v for k, v in zoo_config_from_llama(llama.config).to_dict().items()})
    zoo = VARIANTS["gqa"].causal_lm_class(config)
    result = zoo.load_state_dict(llama.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert set(zoo.state_dict()) == set(llama.state_dict())


def test_generate_matches_llama():
    llama = tiny_llama(2)
    zoo = from_llama(llama)
    input_ids, attention_mask, _ = left_padded_batch()
    greedy = GenerationConfig(max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)
    expected = llama.generate(input_ids, attention_mask=attention_mask, generation_config=greedy)
    assert torch.equal(zoo.generate(input_ids, attention_mask=attention_mask, generation_config=greedy), expected)


def test_round_trip_through_llama():
    zoo = tiny_model("gqa", "rope")
    llama = to_llama(zoo)
    input_ids, _, _ = left_padded_batch()
    with torch.no_grad():
        torch.testing.assert_close(llama(input_ids).logits, zoo(input_ids).logits, atol=ATOL, rtol=0)
        back = from_llama(llama, variant="gqa")
        assert torch.equal(back(input_ids).logits, zoo(input_ids).logits)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(position_embedding_type="alibi"), "position_embedding_type"),
        (dict(norm_type="layernorm"), "norm_type"),
        (dict(norm_position="post"), "norm_position"),
    ],
)
def test_to_llama_refuses_what_llama_cannot_express(overrides, field):
    with pytest.raises(ValueError, match=field):
        to_llama(tiny_model("gqa", **overrides))


def test_llama_checkpoint_path(tmp_path):
    llama = tiny_llama(2)
    llama.save_pretrained(tmp_path)
    zoo = from_llama(tmp_path)
    input_ids, _, _ = left_padded_batch()
    with torch.no_grad():
        torch.testing.assert_close(zoo(input_ids).logits, llama(input_ids).logits, atol=ATOL, rtol=0)
    assert zoo.config.model_type == "zoo_gqa"


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "rope_theta": 500000.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ],
    ids=["linear", "llama3"],
)
def test_scaled_rope_matches_llama(rope_parameters):
    llama = tiny_llama(2, rope_parameters=rope_parameters)
    zoo = from_llama(llama)
    input_ids = torch.randint(3, 97, (2, 100))
    with torch.no_grad():
        torch.testing.assert_close(zoo(input_ids).logits, llama(input_ids).logits, atol=ATOL, rtol=0)
