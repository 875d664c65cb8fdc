"""What only the Transformer encoder-decoders have (the contract they share with the RNN translator is
`test_translators.py`): their config refusals and shape checks, `AutoModel` routing, `generate()`'s options and the
composition of zoo encoders and decoders with transformers' `EncoderDecoderModel`."""

import pytest
import torch
from test_translators import ENCODER_VARIANTS, START, TRANSFORMERS, source_batch, target_batch, tiny_translator
from transformers import AutoModel, AutoModelForSeq2SeqLM, BertConfig, BertModel, EncoderDecoderModel

from hf_attn_zoo.models import SEQ2SEQ, VARIANTS, aft
from hf_attn_zoo.models.checkpoint_zoo import CheckpointMismatchError
from hf_attn_zoo.models.layers_zoo import ZooAttention

from conftest import CONFORMANCE, VOCAB_SIZE, tiny_config

# --- bad input ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, named",
    [
        (dict(cross_attention="bilinear"), "cross_attention"),
        (dict(cross_attention_num_key_value_heads=3), "cross_attention_num_key_value_heads"),
        (dict(cross_attention_additive_dim=0), "cross_attention_additive_dim"),
        (dict(encoder_layers=0), "encoder_layers"),
        (dict(decoder_layers=1.5), "decoder_layers"),
        (dict(decoder_start_token_id=-1), "decoder_start_token_id"),
        (dict(decoder_start_token_id=VOCAB_SIZE), "decoder_start_token_id"),
    ],
)
def test_invalid_configs_name_the_field(fields, named):
    with pytest.raises(ValueError, match=named):
        tiny_config("mha", is_encoder_decoder=True, **fields)


def test_linformer_decoder_must_be_causal():
    with pytest.raises(ValueError, match="is_causal"):
        tiny_config("linformer", is_encoder_decoder=True, is_causal=False)


def test_wrong_shapes_and_shapes_of_model_refused():
    model = tiny_translator("mha")
    ids, mask = source_batch()
    with pytest.raises(ValueError, match="decoder_start_token_id"):
        tiny_translator("mha", decoder_start_token_id=None)(input_ids=ids, labels=target_batch())
    with pytest.raises(ValueError, match="attention_mask has shape"):
        model(input_ids=ids, attention_mask=mask[:, :5], decoder_input_ids=target_batch())
    encoder_outputs = model.get_encoder()(input_ids=ids, attention_mask=mask)
    with pytest.raises(ValueError, match="encoder_attention_mask covers 5 source tokens"):
        model(encoder_outputs=encoder_outputs, attention_mask=mask[:, :5], decoder_input_ids=target_batch())
    with pytest.raises(ValueError, match="3 sources for 2 target rows"):
        model(encoder_outputs=encoder_outputs, attention_mask=mask, decoder_input_ids=target_batch()[:2])
    with pytest.raises(ValueError, match="is_encoder_decoder"):
        SEQ2SEQ["mha"].generation_class(tiny_config("mha"))  # a decoder-only config
    with pytest.raises(ValueError, match="ZooMHAForConditionalGeneration"):
        VARIANTS["mha"].causal_lm_class(model.config)  # an encoder-decoder config into the causal LM
    with pytest.raises(ValueError, match="is_decoder=False"):
        VARIANTS["mha"].causal_lm_class(tiny_config("mha", is_decoder=False))


def test_checkpoint_of_the_wrong_shape_names_the_field(tmp_path):
    tiny_translator("mha").save_pretrained(tmp_path)
    config = tiny_config(
        "mha", is_encoder_decoder=True, decoder_start_token_id=START, cross_attention_num_key_value_heads=2
    )
    with pytest.raises(CheckpointMismatchError, match="cross_attention_num_key_value_heads"):
        AutoModelForSeq2SeqLM.from_pretrained(tmp_path, config=config)


def test_a_variant_without_a_bidirectional_form_is_refused_for_the_encoder(monkeypatch):
    # the protocol's default for a kernel of running sums: AFT before it declared its non-causal form
    monkeypatch.setattr(aft.ZooAFTAttention, "bidirectional_refusal", ZooAttention.__dict__["bidirectional_refusal"])
    with pytest.raises(ValueError, match="zoo_aft_simple has no bidirectional form"):
        tiny_translator("aft_simple")


# --- transformers' interfaces -------------------------------------------------------------------------------------


def test_registry_and_auto_model_routing():
    assert set(ENCODER_VARIANTS) | {"rnn"} == set(SEQ2SEQ)
    config = tiny_config("gqa", is_encoder_decoder=True, decoder_start_token_id=START)
    assert type(AutoModel.from_config(config)).__name__ == "ZooGQASeq2SeqModel"
    assert type(AutoModelForSeq2SeqLM.from_config(config)).__name__ == "ZooGQAForConditionalGeneration"
    with pytest.raises(ValueError, match="ZooGQASeq2SeqModel"):
        VARIANTS["gqa"].model_class(config)
    assert SEQ2SEQ["gqa"].config(vocab_size=VOCAB_SIZE).is_encoder_decoder


@torch.no_grad()
def test_generate_options():
    model = tiny_translator("mha-cross_additive")
    ids, mask = source_batch()
    greedy = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    encoder_outputs = model.get_encoder()(input_ids=ids, attention_mask=mask)
    reused = model.generate(encoder_outputs=encoder_outputs, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(greedy, reused)  # encoder outputs reused across calls
    forced = model.generate(ids, attention_mask=mask, max_new_tokens=5, forced_bos_token_id=7)
    assert (forced[:, 0] == START).all() and (forced[:, 1] == 7).all()
    started = model.generate(ids, attention_mask=mask, max_new_tokens=3, decoder_start_token_id=5)
    assert (started[:, 0] == 5).all()
    sampled = []
    for use_cache in (True, False):
        torch.manual_seed(7)
        sampled.append(model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=True, use_cache=use_cache))
    assert torch.equal(*sampled)
    output = model.generate(
        ids, attention_mask=mask, max_new_tokens=3, output_attentions=True, return_dict_in_generate=True
    )
    assert output.cross_attentions[0][0].shape == (3, 4, 1, 9)  # (B, H, T, S) of the first step's first layer


def test_zoo_encoder_and_decoder_compose_in_encoder_decoder_model(tmp_path):
    variant = VARIANTS["gqa"]
    for side in ("encoder", "decoder"):
        torch.manual_seed(0)
        variant.causal_lm_class(tiny_config("gqa")).save_pretrained(tmp_path / side)
    model = EncoderDecoderModel.from_encoder_decoder_pretrained(tmp_path / "encoder", tmp_path / "decoder")
    bert = BertModel(BertConfig(vocab_size=VOCAB_SIZE, hidden_size=24, num_hidden_layers=1, num_attention_heads=2))
    under_bert = EncoderDecoderModel(
        encoder=bert, decoder=variant.causal_lm_class(tiny_config("gqa", add_cross_attention=True))
    )
    assert model.encoder.is_encoder and not model.encoder.layers[0].self_attn.is_causal
    ids, mask = source_batch()
    for composed in (model, under_bert):
        composed.config.decoder_start_token_id = composed.generation_config.decoder_start_token_id = START
        composed.config.pad_token_id = composed.generation_config.pad_token_id = 0
        composed.train()
        composed(input_ids=ids, attention_mask=mask, labels=target_batch()).loss.backward()
        assert all(p.grad is not None for p in composed.decoder.parameters())
        composed.eval()
        with torch.no_grad():
            cached = composed.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=2)
            uncached = composed.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=2, use_cache=False)
        assert torch.equal(cached, uncached)


def test_every_case_is_covered():
    assert set(CONFORMANCE) >= set(VARIANTS)
    assert {name for name in TRANSFORMERS if "-" not in name} == set(ENCODER_VARIANTS)
    # a variant left out has no encoder form, and says so before any layer is built
    assert set(SEQ2SEQ) == set(ENCODER_VARIANTS) | {"rnn"}
    for name in set(VARIANTS) - set(ENCODER_VARIANTS):
        with pytest.raises(ValueError, match="no bidirectional form.*is_encoder_decoder=True"):
            tiny_config(name, is_encoder_decoder=True, decoder_start_token_id=START)


def test_the_zoo_with_marians_choices_computes_marians_function():
    """The parity anchor of the encoder-decoder: transformers' `MarianMTModel` and the zoo's MHA encoder-decoder with
    Marian's layer (post-norm LayerNorm, biases, a SiLU MLP, scaled tokens, sinusoids) and Marian's weights
    (`experiments/translation/native.py`'s `zoo_twin`) give the same logits and the same greedy translations, once
    Marian's position tables hold the zoo's sinusoids (the two lay out sines and cosines differently)."""
    from transformers import MarianConfig, MarianMTModel

    from experiments.translation.native import zoo_twin
    from hf_attn_zoo.models.positions_zoo import sinusoidal_embedding

    torch.manual_seed(0)
    config = MarianConfig(
        vocab_size=VOCAB_SIZE, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=96, decoder_ffn_dim=96, max_position_embeddings=32, dropout=0.0,
        attention_dropout=0.0, activation_function="swish", scale_embedding=True, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=1, forced_eos_token_id=None,
    )  # fmt: skip
    marian = MarianMTModel(config).eval()
    with torch.no_grad():
        for stack in (marian.model.encoder, marian.model.decoder):
            table = sinusoidal_embedding(torch.arange(32)[None], 64, torch.float32)[0]  # (positions, d)
            stack.embed_positions.weight.copy_(table)
    zoo = zoo_twin(marian).eval()
    source = torch.randint(3, VOCAB_SIZE, (3, 9))
    labels = torch.randint(3, VOCAB_SIZE, (3, 7))
    with torch.no_grad():
        theirs, ours = marian(input_ids=source, labels=labels), zoo(input_ids=source, labels=labels)
    torch.testing.assert_close(ours.logits, theirs.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-5, atol=1e-5)
    options = dict(max_new_tokens=8, do_sample=False, num_beams=1, min_length=0)
    assert torch.equal(zoo.generate(source, **options), marian.generate(source, **options))
