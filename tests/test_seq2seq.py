"""The Transformer encoder-decoders: every variant on both sides (dot-product cross-attention) and each kind of
cross-attention (MHA, GQA, MQA, additive) once, through one suite: cached decoding, padding, beam search, the
encoder's independence of the decoder, causality, checkpoints (remote code included), bad input, the naive
references; then `AutoModel`, `generate()`'s options and the composition with transformers' `EncoderDecoderModel`."""

import json
import os
import subprocess
import sys

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import AutoModel, AutoModelForSeq2SeqLM, BertConfig, BertModel, EncoderDecoderModel

from hf_attn_zoo.models import SEQ2SEQ, VARIANTS, aft
from hf_attn_zoo.models.checkpoint_zoo import CheckpointMismatchError
from hf_attn_zoo.models.layers_zoo import ZooAttention

import references
from conftest import ATOL, CONFORMANCE, VOCAB_SIZE, tiny_config

START = 1  # decoder_start_token_id
# every variant with MHA cross-attention, then the other cross-attention kinds over the MHA family
CASES = {name: {} for name in VARIANTS} | {
    "gqa-cross_gqa": {"cross_attention_num_key_value_heads": 2},
    "mha-cross_mqa": {"cross_attention_num_key_value_heads": 1},
    "mha-cross_additive": {"cross_attention": "additive", "cross_attention_additive_dim": 6},
}
# the naive self-attention of every variant (its conformance reference, run causal in the decoder and bidirectional,
# `causal=False`, in the encoder), and the other cross-attention kinds over the MHA family
REFERENCES = {name: CONFORMANCE[name]["reference"] for name in VARIANTS} | {
    "gqa-cross_gqa": references.softmax_attention,
    "mha-cross_mqa": references.softmax_attention,
    "mha-cross_additive": references.softmax_attention,
}


def tiny_seq2seq(case: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    name = case.split("-")[0]
    fields = {"decoder_start_token_id": START, "encoder_layers": 2, "decoder_layers": 1, **CASES[case], **overrides}
    config = tiny_config(name, is_encoder_decoder=True, **fields)
    return SEQ2SEQ[name].generation_class(config).eval()


def source_batch():
    """Three sources: 9 tokens, 6 right-padded, 5 left-padded (token 0 is the pad)."""
    ids = torch.randint(3, VOCAB_SIZE, (3, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    mask[2, :4] = 0
    return ids.masked_fill(mask == 0, 0), mask


def target_batch(length: int = 6):
    return torch.randint(3, VOCAB_SIZE, (3, length), generator=torch.Generator().manual_seed(4))


@pytest.fixture(params=list(CASES))
def case(request):
    return request.param


@torch.no_grad()
def test_cached_decoding_equals_forward(case):
    model = tiny_seq2seq(case)
    ids, mask = source_batch()
    target = target_batch()
    full = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
    encoder_outputs = model.get_encoder()(input_ids=ids, attention_mask=mask)
    cache, steps = model.make_cache(), []
    for t in (slice(0, 2), *(slice(i, i + 1) for i in range(2, target.shape[1]))):  # a prefill of 2, then steps
        step = model(encoder_outputs=encoder_outputs, attention_mask=mask, decoder_input_ids=target[:, t], cache=cache)
        steps.append(step.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=ATOL)


@torch.no_grad()
def test_padded_source_rows_equal_rows_alone(case):
    model = tiny_seq2seq(case)
    ids, mask = source_batch()
    target = target_batch()
    batch = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
    for row in (1, 2):
        alone = ids[row][mask[row].bool()][None]
        logits = model(input_ids=alone, decoder_input_ids=target[row : row + 1]).logits
        torch.testing.assert_close(batch[row : row + 1], logits, rtol=0, atol=ATOL)


@torch.no_grad()
def test_beam_search_with_cache_equals_without(case):
    model = tiny_seq2seq(case)
    ids, mask = source_batch()
    options = dict(max_new_tokens=5, num_beams=3, num_return_sequences=2, length_penalty=0.7, do_sample=False)
    cached = model.generate(ids, attention_mask=mask, **options)
    uncached = model.generate(ids, attention_mask=mask, use_cache=False, **options)
    assert torch.equal(cached, uncached)
    assert cached.shape == (6, 6) and (cached[:, 0] == START).all()


@torch.no_grad()
def test_encoder_outputs_do_not_depend_on_the_decoder(case):
    model = tiny_seq2seq(case)
    ids, mask = source_batch()
    first = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target_batch(6))
    second = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target_batch(3) + 1)
    assert torch.equal(first.encoder_last_hidden_state, second.encoder_last_hidden_state)


@torch.no_grad()
def test_decoder_is_exactly_causal(case):
    model = tiny_seq2seq(case)
    ids, mask = source_batch()
    target = target_batch()
    changed = target.clone()
    changed[:, 4] = (changed[:, 4] + 1) % VOCAB_SIZE
    before = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
    after = model(input_ids=ids, attention_mask=mask, decoder_input_ids=changed).logits
    assert torch.equal(before[:, :4], after[:, :4])
    assert not torch.equal(before[:, 4:], after[:, 4:])


@torch.no_grad()
def test_save_reload_and_auto_classes(case, tmp_path):
    model = tiny_seq2seq(case)
    ids, mask = source_batch()
    target = target_batch()
    model.save_pretrained(tmp_path)
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModelForSeq2SeqLM"].endswith("ForConditionalGeneration")
    assert auto_map["AutoModel"].endswith("Seq2SeqModel")
    reloaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is type(model)
    expected = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
    assert torch.equal(reloaded(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits, expected)
    bare = AutoModel.from_pretrained(tmp_path).eval()  # the bare encoder-decoder, as AutoModel gives BART's
    assert type(bare) is type(model.model)
    hidden = bare(input_ids=ids, attention_mask=mask, decoder_input_ids=target).last_hidden_state
    torch.testing.assert_close(model.lm_head(hidden), expected, rtol=0, atol=0)


@pytest.mark.parametrize("case", list(REFERENCES))
@torch.no_grad()
def test_logits_equal_the_naive_reference(case):
    model = tiny_seq2seq(case)
    ids, mask = source_batch()
    target = target_batch()
    expected = references.seq2seq_logits(model, ids, mask, target, REFERENCES[case])
    logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=ATOL)


# --- checkpoints by their own code, in a process without the package ---------------------------------------------

REMOTE = """
import json, sys
sys.modules["hf_attn_zoo"] = None
import torch
from transformers import AutoModelForSeq2SeqLM
ids, mask, target = torch.load(sys.argv[2])
results = {}
for folder in json.loads(sys.argv[1]):
    model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
        tokens = model.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=2)
    results[folder] = (logits, tokens)
torch.save(results, sys.argv[3])
"""


@pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.3"),
    reason="transformers < 5.3 cannot load remote code importing siblings (see test_checkpoints.py)",
)
@torch.no_grad()
def test_every_combination_loads_by_remote_code_without_the_package(tmp_path):
    ids, mask = source_batch()
    target = target_batch()
    folders, expected = [], {}
    for case in CASES:
        model = tiny_seq2seq(case)
        folder = str(tmp_path / case)
        model.save_pretrained(folder)
        folders.append(folder)
        logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
        expected[folder] = (logits, model.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=2))
    torch.save((ids, mask, target), tmp_path / "inputs.pt")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    command = [
        sys.executable,
        "-c",
        REMOTE,
        json.dumps(folders),
        str(tmp_path / "inputs.pt"),
        str(tmp_path / "out.pt"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    remote = torch.load(tmp_path / "out.pt")
    for folder in folders:
        torch.testing.assert_close(remote[folder][0], expected[folder][0], rtol=0, atol=ATOL)
        assert torch.equal(remote[folder][1], expected[folder][1]), folder


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
    model = tiny_seq2seq("mha")
    ids, mask = source_batch()
    with pytest.raises(ValueError, match="decoder_start_token_id"):
        tiny_seq2seq("mha", decoder_start_token_id=None)(input_ids=ids, labels=target_batch())
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
    tiny_seq2seq("mha").save_pretrained(tmp_path)
    config = tiny_config(
        "mha", is_encoder_decoder=True, decoder_start_token_id=START, cross_attention_num_key_value_heads=2
    )
    with pytest.raises(CheckpointMismatchError, match="cross_attention_num_key_value_heads"):
        AutoModelForSeq2SeqLM.from_pretrained(tmp_path, config=config)


def test_a_variant_without_a_bidirectional_form_is_refused_for_the_encoder(monkeypatch):
    # the protocol's default for a kernel of running sums: AFT before it declared its non-causal form
    monkeypatch.setattr(aft.ZooAFTAttention, "bidirectional_refusal", ZooAttention.__dict__["bidirectional_refusal"])
    with pytest.raises(ValueError, match="zoo_aft_simple has no bidirectional form"):
        tiny_seq2seq("aft_simple")


# --- transformers' interfaces -------------------------------------------------------------------------------------


def test_registry_and_auto_model_routing():
    assert set(VARIANTS) | {"rnn"} == set(SEQ2SEQ)
    config = tiny_config("gqa", is_encoder_decoder=True, decoder_start_token_id=START)
    assert type(AutoModel.from_config(config)).__name__ == "ZooGQASeq2SeqModel"
    assert type(AutoModelForSeq2SeqLM.from_config(config)).__name__ == "ZooGQAForConditionalGeneration"
    with pytest.raises(ValueError, match="ZooGQASeq2SeqModel"):
        VARIANTS["gqa"].model_class(config)
    assert SEQ2SEQ["gqa"].config(vocab_size=VOCAB_SIZE).is_encoder_decoder


@torch.no_grad()
def test_generate_options():
    model = tiny_seq2seq("mha-cross_additive")
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


def test_training_step_reaches_every_parameter():
    model = tiny_seq2seq("mha-cross_additive").train()
    ids, mask = source_batch()
    labels = target_batch()
    labels[0, 4:] = -100
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


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
    assert {name for name in CASES if "-" not in name} == set(VARIANTS)
