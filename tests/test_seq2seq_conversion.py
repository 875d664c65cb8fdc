"""MHA -> GQA/MQA conversion of an encoder-decoder, as Ainslie et al. 2023 uptrain T5: the decoder's self- and
cross-attention pooled, the encoder kept multi-head."""

import pytest
import torch

from hf_attn_zoo.convert.calibrated import CALIBRATION_METHODS
from hf_attn_zoo.convert.pooling import pool_heads, seq2seq_mha_to_gqa
from hf_attn_zoo.models import SEQ2SEQ

HEADS = 4


def parent(**fields) -> torch.nn.Module:
    torch.manual_seed(0)
    return (
        SEQ2SEQ["mha"]
        .build(
            None,
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            num_attention_heads=HEADS,
            num_hidden_layers=2,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=1,
            **fields,
        )
        .eval()
    )


def pairs(count: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randint(3, 64, (1, 11), generator=generator), torch.randint(3, 64, (1, 9), generator=generator))
        for _ in range(count)
    ]


def logits(model, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=source, labels=target).logits


@pytest.mark.parametrize("groups", [2, 1])
def test_mean_pooling_gives_exactly_the_pooled_weights(groups: int) -> None:
    model = parent()
    converted = seq2seq_mha_to_gqa(model, groups)
    assert converted.config.model_type == "zoo_gqa"
    assert converted.config.num_key_value_heads == converted.config.cross_attention_num_key_value_heads == groups
    assert converted.config.encoder_num_key_value_heads == HEADS
    old, new = model.state_dict(), converted.state_dict()
    assert old.keys() == new.keys()
    for name, tensor in old.items():
        pooled = ".decoder." in name and ("self_attn.k_proj" in name or "self_attn.v_proj" in name)
        pooled |= ".decoder." in name and ("encoder_attn.k_proj" in name or "encoder_attn.v_proj" in name)
        expected = pool_heads(tensor, HEADS, groups, "mean") if pooled else tensor
        assert torch.equal(new[name], expected), name
    # the encoder keeps every head: its keys are the parent's, one projection row block per query head
    assert converted.model.encoder.layers[0].self_attn.k_proj.weight.shape == (32, 32)
    assert converted.model.decoder.layers[0].encoder_attn.k_proj.weight.shape == (32 // HEADS * groups, 32)
    source, target = pairs(1)[0]
    assert converted.generate(source, max_new_tokens=3).shape[0] == 1


@pytest.mark.parametrize("method", ["mean", *CALIBRATION_METHODS])
def test_keeping_every_head_leaves_the_logits_unchanged(method: str) -> None:
    model = parent()
    calibration = pairs() if method in CALIBRATION_METHODS else None
    converted = seq2seq_mha_to_gqa(model, HEADS, method, calibration=calibration)
    assert converted.config.model_type == "zoo_mha"
    for source, target in pairs(3):
        assert torch.allclose(logits(converted, source, target), logits(model, source, target), atol=1e-5)


@pytest.mark.parametrize("method", CALIBRATION_METHODS)
def test_calibrated_methods_convert_to_the_same_shapes_as_mean(method: str) -> None:
    model = parent()
    converted = seq2seq_mha_to_gqa(model, 2, method, calibration=pairs())
    mean = seq2seq_mha_to_gqa(model, 2)
    assert {k: v.shape for k, v in converted.state_dict().items()} == {
        k: v.shape for k, v in mean.state_dict().items()
    }
    # the encoder is untouched by every method
    for name, tensor in model.state_dict().items():
        if ".encoder." in name:
            assert torch.equal(converted.state_dict()[name], tensor), name
    source, target = pairs(1)[0]
    assert torch.isfinite(logits(converted, source, target)).all()


def test_refusals_name_the_fix() -> None:
    model = parent()
    with pytest.raises(ValueError, match="must divide"):
        seq2seq_mha_to_gqa(model, 3)
    with pytest.raises(ValueError, match="calibration"):
        seq2seq_mha_to_gqa(model, 2, "aligned")
    with pytest.raises(ValueError, match="no key/value heads to pool"):
        seq2seq_mha_to_gqa(parent(cross_attention="additive"), 2)


def test_an_encoder_of_more_key_value_heads_than_the_decoder_round_trips(tmp_path) -> None:
    from transformers import AutoModelForSeq2SeqLM

    converted = seq2seq_mha_to_gqa(parent(), 1)
    converted.save_pretrained(tmp_path)
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path, trust_remote_code=True).eval()
    source, target = pairs(1)[0]
    assert torch.equal(logits(loaded, source, target), logits(converted, source, target))
    with pytest.raises(ValueError, match="encoder_num_key_value_heads"):
        SEQ2SEQ["gqa"].config(None, num_attention_heads=4, encoder_num_key_value_heads=3, is_encoder_decoder=True)
