"""The translator contract, stated once over both families, as transformers' `ModelTesterMixin` states its own: the
Transformer encoder-decoders (every variant on both sides with dot-product cross-attention, and each other kind of
cross-attention once) and the RNN translator (each attention kind and cell). Every translator: logits equal a naive
reference; cached decoding (a prefill, then steps from the cache alone) equals the uncached forward; padded rows
equal the rows alone; greedy decoding equals an argmax loop; beam search and sampling give the same with and without
the cache; the decoder is exactly causal; labels, loss and gradients; checkpoints (reloaded, by remote code in a
process without the package, and as older releases and other writers laid them out); refusals. Then the defects
transformers' own encoder-decoder tests found (embeddings, gradient checkpointing, the cross-attention cache,
stateful decoding). What only one family has stays in `test_seq2seq.py` and `test_rnn.py`."""

import json
import os
import subprocess
import sys

import pytest
import torch
import transformers
from packaging.version import Version
from safetensors.torch import load_file, save_file, save_model
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoModelForTextEncoding

from hf_attn_zoo.models import SEQ2SEQ, VARIANTS
from hf_attn_zoo.models.rnn import ZooRNNCache, ZooRNNConfig, ZooRNNForConditionalGeneration

import references
from conftest import ATOL, CACHE_KWARG, CONFORMANCE, VOCAB_SIZE, returned_cache, tiny_config

START = 1  # decoder_start_token_id
# every variant with a bidirectional form (an encoder) with MHA cross-attention, then the other cross-attention kinds
# over the MHA family; a variant without one (Mamba) refuses the encoder-decoder (test_seq2seq)
ENCODER_VARIANTS = [
    name
    for name, variant in VARIANTS.items()
    if variant.attention_class.bidirectional_refusal(variant.config()) is None
]
TRANSFORMERS = {name: {} for name in ENCODER_VARIANTS} | {
    "gqa-cross_gqa": {"cross_attention_num_key_value_heads": 2},
    "mha-cross_mqa": {"cross_attention_num_key_value_heads": 1},
    "mha-cross_additive": {"cross_attention": "additive", "cross_attention_additive_dim": 6},
    "mha-post_norm": {"norm_position": "post"},  # Vaswani et al.'s and Marian's place of the norms
}
# each attention kind of the RNN translator with each cell
RNN_KINDS = [(attention, cell) for attention in ("bahdanau", "luong", "none") for cell in ("gru", "lstm")]
RNNS = {f"rnn-{attention}-{cell}": {"attention": attention, "cell": cell} for attention, cell in RNN_KINDS}
TRANSLATORS = list(TRANSFORMERS) + list(RNNS)
# the naive self-attention of every variant (its conformance reference, run causal in the decoder and bidirectional
# in the encoder), and the other cross-attention kinds over the MHA family
SELF_ATTENTION = {name: CONFORMANCE[name]["reference"] for name in VARIANTS}


def tiny_translator(case: str, seed: int = 0, **overrides):
    """A tiny translator of either family, in eval mode."""
    torch.manual_seed(seed)
    if case in RNNS:
        fields = {"hidden_size": 8, "rnn_hidden_size": 6, "attention_hidden_size": 5, "num_layers": 2, "dropout": 0.0}
        fields |= {"vocab_size": VOCAB_SIZE, "decoder_start_token_id": START} | RNNS[case] | overrides
        config = ZooRNNConfig(**fields)
        model = ZooRNNForConditionalGeneration(config).eval()
        with torch.no_grad():  # initialised at std 0.1 the logits are all alike; larger weights make the tests bite
            for name, parameter in model.named_parameters():
                if "rnn" not in name:
                    parameter.normal_(0, 0.5)
        return model
    name = case.split("-")[0]
    fields = {"decoder_start_token_id": START, "encoder_layers": 2, "decoder_layers": 1, **TRANSFORMERS[case]}
    config = tiny_config(name, is_encoder_decoder=True, **fields | overrides)
    return SEQ2SEQ[name].generation_class(config).eval()


def source_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Three sources: 9 tokens, 6 right-padded, 5 left-padded (token 0 is the pad)."""
    ids = torch.randint(3, VOCAB_SIZE, (3, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    mask[2, :4] = 0
    return ids.masked_fill(mask == 0, 0), mask


def target_batch(length: int = 6) -> torch.Tensor:
    return torch.randint(3, VOCAB_SIZE, (3, length), generator=torch.Generator().manual_seed(4))


@pytest.fixture(params=TRANSLATORS)
def case(request):
    return request.param


# --- the contract -------------------------------------------------------------------------------------------------


@torch.no_grad()
def test_logits_equal_the_naive_reference(case):
    model = tiny_translator(case)
    ids, mask = source_batch()
    target = target_batch()
    logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
    if case in RNNS:
        for row in range(len(ids)):
            expected = references.rnn_logits(model, ids[row][mask[row].bool()].tolist(), target[row].tolist())
            torch.testing.assert_close(logits[row], expected, rtol=0, atol=ATOL)
        return
    attention = SELF_ATTENTION.get(case, references.softmax_attention)
    expected = references.seq2seq_logits(model, ids, mask, target, attention)
    torch.testing.assert_close(logits, expected, rtol=0, atol=ATOL)


@torch.no_grad()
def test_cached_decoding_equals_forward(case):
    """A prefill of two target tokens from the encoder's outputs, then one token at a time from the cache alone."""
    model = tiny_translator(case)
    ids, mask = source_batch()
    target = target_batch()
    full = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target, use_cache=False).logits
    encoder_outputs = model.get_encoder()(input_ids=ids, attention_mask=mask)
    cache = model.make_cache()
    steps = [model(encoder_outputs=encoder_outputs, attention_mask=mask, decoder_input_ids=target[:, :2], cache=cache)]
    for t in range(2, target.shape[1]):
        steps.append(model(attention_mask=mask, decoder_input_ids=target[:, t : t + 1], cache=cache))
        assert returned_cache(steps[-1]) is cache and cache.get_seq_length() == t + 1
    torch.testing.assert_close(torch.cat([step.logits for step in steps], dim=1), full, rtol=0, atol=ATOL)


@torch.no_grad()
def test_padded_source_rows_equal_rows_alone(case):
    model = tiny_translator(case)
    ids, mask = source_batch()
    target = target_batch()
    batch = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
    for row in (1, 2):  # right and left padded
        alone = ids[row][mask[row].bool()][None]
        logits = model(input_ids=alone, decoder_input_ids=target[row : row + 1]).logits
        torch.testing.assert_close(batch[row : row + 1], logits, rtol=0, atol=ATOL)


def argmax_loop(model, ids: torch.Tensor, mask: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy decoding by hand: the whole prefix through the uncached forward at every step."""
    tokens = torch.full((len(ids), 1), model.config.decoder_start_token_id)
    finished = torch.zeros(len(ids), dtype=torch.bool)
    for _ in range(steps):
        logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=tokens, use_cache=False).logits
        next_token = logits[:, -1].argmax(-1).masked_fill(finished, model.config.pad_token_id)
        tokens = torch.cat([tokens, next_token[:, None]], dim=1)
        if model.config.eos_token_id is not None:
            finished |= next_token == model.config.eos_token_id
    return tokens


@torch.no_grad()
def test_greedy_generate_equals_an_argmax_loop(case):
    model = tiny_translator(case)
    ids, mask = source_batch()
    generated = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(generated, argmax_loop(model, ids, mask, 8)[:, : generated.shape[1]])


@torch.no_grad()
def test_beam_search_with_cache_equals_without(case):
    model = tiny_translator(case)
    ids, mask = source_batch()
    options = dict(max_new_tokens=5, num_beams=3, num_return_sequences=2, length_penalty=0.7, do_sample=False)
    cached = model.generate(ids, attention_mask=mask, **options)
    uncached = model.generate(ids, attention_mask=mask, use_cache=False, **options)
    assert torch.equal(cached, uncached)
    assert cached.shape[0] == 6 and (cached[:, 0] == START).all()


@torch.no_grad()
def test_sampling_with_cache_equals_without(case):
    model = tiny_translator(case)
    ids, mask = source_batch()
    runs = []
    for use_cache in (True, False):
        torch.manual_seed(7)
        runs.append(model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=True, use_cache=use_cache))
    assert torch.equal(*runs)


@torch.no_grad()
def test_encoder_outputs_do_not_depend_on_the_decoder_and_are_reusable(case):
    model = tiny_translator(case)
    ids, mask = source_batch()
    first = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target_batch(6))
    second = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target_batch(3) + 1)
    assert torch.equal(first.encoder_last_hidden_state, second.encoder_last_hidden_state)
    encoder_outputs = model.get_encoder()(input_ids=ids, attention_mask=mask)
    for reused in (encoder_outputs, encoder_outputs.to_tuple()):
        again = model(encoder_outputs=reused, attention_mask=mask, decoder_input_ids=target_batch(6)).logits
        assert torch.equal(again, first.logits)
    reused = model.generate(encoder_outputs=encoder_outputs, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(reused, model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False))


@torch.no_grad()
def test_decoder_is_exactly_causal(case):
    model = tiny_translator(case)
    ids, mask = source_batch()
    target = target_batch()
    changed = target.clone()
    changed[:, 4] = (changed[:, 4] + 1) % VOCAB_SIZE
    before = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
    after = model(input_ids=ids, attention_mask=mask, decoder_input_ids=changed).logits
    assert torch.equal(before[:, :4], after[:, :4])
    assert not torch.equal(before[:, 4:], after[:, 4:])


def test_labels_are_shifted_the_loss_ignores_minus_100_and_reaches_every_parameter(case):
    model = tiny_translator(case).train()
    ids, mask = source_batch()
    labels = target_batch()
    labels[1, 4:] = -100
    decoder_input_ids = model.prepare_decoder_input_ids_from_labels(labels)
    assert decoder_input_ids[:, 0].eq(START).all()
    assert torch.equal(decoder_input_ids[:, 1:].masked_fill(decoder_input_ids[:, 1:] == 0, -100), labels[:, :-1])
    output = model(input_ids=ids, attention_mask=mask, labels=labels)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_input_ids).logits
        summed = model(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=torch.tensor(7)).loss
    kept = labels != -100
    expected = torch.nn.functional.cross_entropy(logits[kept], labels[kept])
    torch.testing.assert_close(output.loss, expected)
    torch.testing.assert_close(summed, expected * int(kept.sum()) / 7)
    output.loss.backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, missing


@torch.no_grad()
def test_tuples_when_return_dict_is_false(case):
    model = tiny_translator(case)
    ids, mask = source_batch()
    expected = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target_batch())
    output = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target_batch(), return_dict=False)
    assert isinstance(output, tuple) and torch.equal(output[0], expected.logits)
    base = model.model(input_ids=ids, attention_mask=mask, decoder_input_ids=target_batch(), return_dict=False)
    assert isinstance(base, tuple) and torch.equal(model.lm_head(base[0]), expected.logits)


@torch.no_grad()
def test_cross_attentions_are_weights_over_the_real_source(case):
    """`output_attentions=True` gives, per decoder layer, weights (B, H, T, S) that sum to one over the real source
    tokens and are zero on padding (one "head" for the RNN; none for the RNN without attention); `generate` returns
    them per step."""
    model = tiny_translator(case)
    if case in TRANSFORMERS:
        model.set_attn_implementation("eager")  # sdpa computes no weights
    ids, mask = source_batch()
    output = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target_batch(), output_attentions=True)
    generated = model.generate(
        ids, attention_mask=mask, max_new_tokens=3, output_attentions=True, return_dict_in_generate=True
    )
    if case in ("rnn-none-gru", "rnn-none-lstm"):
        assert output.cross_attentions is None and all(step is None for step in generated.cross_attentions)
        return
    heads = 1 if case in RNNS else model.config.num_attention_heads
    layers = 1 if case in RNNS else model.config.decoder_layers
    assert len(output.cross_attentions) == layers
    for weights in output.cross_attentions:
        assert weights.shape == (3, heads, 6, 9)
        torch.testing.assert_close(weights.sum(-1), torch.ones(3, heads, 6), rtol=0, atol=ATOL)
        assert torch.all(weights.masked_select(mask[:, None, None, :] == 0) == 0)
    assert generated.cross_attentions[0][0].shape == (3, heads, 1, 9)  # the first step's first layer


def auto_map_of(model) -> dict[str, str]:
    module = type(model).__module__.rsplit(".", 1)[-1]
    if isinstance(model, ZooRNNForConditionalGeneration):
        names = {"AutoModel": "ZooRNNModel", "AutoModelForSeq2SeqLM": "ZooRNNForConditionalGeneration"}
        return {"AutoConfig": f"{module}.ZooRNNConfig"} | {auto: f"{module}.{name}" for auto, name in names.items()}
    prefix = type(model).__name__.removesuffix("ForConditionalGeneration")
    return {
        "AutoConfig": f"{module}.{type(model.config).__name__}",
        "AutoModel": f"{module}.{prefix}Seq2SeqModel",
        "AutoModelForSeq2SeqLM": f"{module}.{prefix}ForConditionalGeneration",
        "AutoModelForTextEncoding": f"{module}.{prefix}Encoder",
    }


def assert_equal_logits(case: str, logits: torch.Tensor, expected: torch.Tensor) -> None:
    """The same weights give the same logits: bit for bit for the Transformers; the RNN's weights, reloaded out of
    the flat buffer torch's RNNs keep them in, are read at other alignments and round differently (measured up to
    3e-7), so within ATOL."""
    if case in RNNS:
        torch.testing.assert_close(logits, expected, rtol=0, atol=ATOL)
    else:
        assert torch.equal(logits, expected)


@torch.no_grad()
def test_save_reload_and_auto_classes(case, tmp_path):
    model = tiny_translator(case)
    ids, mask = source_batch()
    target = target_batch()
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["auto_map"] == auto_map_of(model)
    reloaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is type(model)
    expected = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
    assert_equal_logits(case, reloaded(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits, expected)
    bare = AutoModel.from_pretrained(tmp_path).eval()  # the bare encoder-decoder, as AutoModel gives BART's
    assert type(bare) is type(model.model)
    hidden = bare(input_ids=ids, attention_mask=mask, decoder_input_ids=target).last_hidden_state
    assert_equal_logits(case, model.lm_head(hidden), expected)


def test_generate_refuses_caches_the_decoder_cannot_use(case):
    """A cache implementation of keys and values for a model that decodes from a state, and a cache of the wrong kind
    given to the forward, are refused saying what to do; a cache given to `generate` is the one it returns."""
    model = tiny_translator(case)
    ids, mask = source_batch()
    if model._is_stateful:
        with pytest.raises(ValueError, match="cache_implementation"):
            model.generate(ids, attention_mask=mask, max_new_tokens=2, cache_implementation="static")
    if case in RNNS:
        with pytest.raises(TypeError, match="make_cache"):
            model(input_ids=ids, decoder_input_ids=target_batch(), **{CACHE_KWARG: transformers.DynamicCache()})
    cache = model.make_cache()
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=3, return_dict_in_generate=True, **{CACHE_KWARG: cache}
    )
    assert returned_cache(out) is cache
    assert not case.startswith("rnn") or isinstance(cache, ZooRNNCache)


# --- checkpoints by their own code, in a process without the package ---------------------------------------------

REMOTE = """
import json, sys
sys.modules["hf_attn_zoo"] = None  # any attempt to import the package now fails
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
def test_every_translator_loads_by_remote_code_without_the_package(tmp_path):
    ids, mask = source_batch()
    target = target_batch()
    folders, expected = [], {}
    for case in TRANSLATORS:
        model = tiny_translator(case)
        folder = str(tmp_path / case)
        model.save_pretrained(folder)
        folders.append(folder)
        logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
        expected[folder] = (logits, model.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=2))
    torch.save((ids, mask, target), tmp_path / "inputs.pt")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    command = [sys.executable, "-c", REMOTE, json.dumps(folders), str(tmp_path / "inputs.pt"), str(tmp_path / "o.pt")]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    remote = torch.load(tmp_path / "o.pt")
    for folder in folders:
        torch.testing.assert_close(remote[folder][0], expected[folder][0], rtol=0, atol=ATOL)
        assert torch.equal(remote[folder][1], expected[folder][1]), folder


# --- D1: the embedding, one tensor under three modules, as BART's ---------------------------------------------------

EMBEDDINGS = ("model.shared.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight")
CHECKPOINT_CASES = ["mha", "sliding_window", "mla", "rnn-luong-lstm", "rnn-bahdanau-gru"]


def older_layout(model) -> dict[str, torch.Tensor]:
    """The state dict as releases before the three tied modules wrote it: every tensor once, the embedding as
    `model.shared.weight` only, `lm_head.weight` only where it is not tied to it."""
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    for name in EMBEDDINGS[1:] + (("lm_head.weight",) if model.config.tie_word_embeddings else ()):
        del state[name]
    return state


@pytest.mark.parametrize("case", CHECKPOINT_CASES)
@pytest.mark.parametrize("tie", [True, False])
@torch.no_grad()
def test_checkpoints_in_the_older_layout_load_with_identical_logits(case, tie, tmp_path):
    model = tiny_translator(case, tie_word_embeddings=tie)
    ids, mask = source_batch()
    target = target_batch()
    model.save_pretrained(tmp_path)
    assert set(load_file(tmp_path / "model.safetensors")) == set(older_layout(model))  # still written that way
    save_file(older_layout(model), tmp_path / "model.safetensors", metadata={"format": "pt"})
    reloaded, info = AutoModelForSeq2SeqLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    expected = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
    logits = reloaded.eval()(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
    assert_equal_logits(case, logits, expected)
    shared = reloaded.model.shared.weight
    assert reloaded.model.encoder.embed_tokens.weight is shared
    assert reloaded.model.decoder.embed_tokens.weight is shared
    assert (reloaded.lm_head.weight is shared) == tie


@pytest.mark.parametrize("case", CHECKPOINT_CASES)
@torch.no_grad()
def test_a_checkpoint_written_by_safetensors_save_model_loads(case, tmp_path):
    """`save_model` keeps one name per tensor (whichever of the tied names it picks); transformers ties the rest."""
    model = tiny_translator(case)
    ids, mask = source_batch()
    target = target_batch()
    model.save_pretrained(tmp_path)
    save_model(model, str(tmp_path / "model.safetensors"))
    reloaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    expected = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
    assert_equal_logits(case, reloaded(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits, expected)


@pytest.mark.parametrize("case", CHECKPOINT_CASES)
@pytest.mark.parametrize("tie", [True, False])
def test_a_checkpoint_without_the_embedding_reports_it_missing(case, tie, tmp_path):
    model = tiny_translator(case, tie_word_embeddings=tie)
    model.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    kept = {name: tensor for name, tensor in state.items() if name not in EMBEDDINGS}
    save_file(kept, tmp_path / "model.safetensors", metadata={"format": "pt"})
    reloaded, info = AutoModelForSeq2SeqLM.from_pretrained(tmp_path, output_loading_info=True)
    assert "model.shared.weight" in info["missing_keys"]
    assert reloaded.model.shared.weight.device.type != "meta"  # initialised, so the model runs
    ids, mask = source_batch()
    with torch.no_grad():
        assert reloaded(input_ids=ids, attention_mask=mask, decoder_input_ids=target_batch()).logits.isfinite().all()


# --- D2: gradient checkpointing with use_reentrant=True -----------------------------------------------------------


@pytest.mark.parametrize("case", list(TRANSFORMERS))
def test_reentrant_gradient_checkpointing_gives_the_gradients_of_the_plain_backward(case):
    """Two decoder layers under `torch.utils.checkpoint(use_reentrant=True)`: backward runs (the encoder's outputs
    reach each layer positionally, as BART passes them) and gives the gradients of the model without checkpoints."""
    ids, mask = source_batch()
    labels = target_batch()
    gradients = []
    for checkpointing in (False, True):
        model = tiny_translator(case, decoder_layers=2).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        gradients.append({name: p.grad for name, p in model.named_parameters()})
    for name, gradient in gradients[0].items():
        torch.testing.assert_close(gradients[1][name], gradient, rtol=0, atol=ATOL, msg=name)


# --- D3: the cross-attention cache is never a sliding window ------------------------------------------------------


@pytest.mark.parametrize(
    "implementation",
    ["static", pytest.param("offloaded", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))],
)
@torch.no_grad()
def test_cross_attention_cache_keeps_the_whole_source_whatever_the_self_attention_cache(implementation):
    """A sliding-window decoder (window 4) over a 9-token source: transformers builds the caches of
    `cache_implementation` from the decoder's config, whose window must not reach the cross-attention cache. The
    scores equal the default (dynamic) cache's."""
    model = tiny_translator("sliding_window")
    ids, mask = source_batch()
    assert model.config.sliding_window < ids.shape[1]
    options = dict(max_new_tokens=5, do_sample=False, output_scores=True, return_dict_in_generate=True)
    dynamic = model.generate(ids, attention_mask=mask, **options)
    other = model.generate(ids, attention_mask=mask, cache_implementation=implementation, **options)
    cross = returned_cache(other).cross_attention_cache
    assert not any(getattr(layer, "is_sliding", False) for layer in cross.layers)
    assert torch.equal(other.sequences, dynamic.sequences)
    for step, scores in zip(other.scores, dynamic.scores):
        torch.testing.assert_close(step, scores, rtol=0, atol=ATOL)


# --- D4: the RNN decodes from a state ---------------------------------------------------------------------------


@torch.no_grad()
def test_stateful_translators_refuse_assisted_and_prompt_lookup_decoding_up_front():
    model = tiny_translator("rnn-bahdanau-lstm")
    assert model._is_stateful
    ids, mask = source_batch()
    with pytest.raises(ValueError, match="stateful"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, prompt_lookup_num_tokens=2)
    with pytest.raises(ValueError, match="stateful"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, assistant_model=tiny_translator("rnn-luong-gru"))


# --- the encoder alone ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["mha", "gqa-cross_gqa", "mla", "aft_full"])
@torch.no_grad()
def test_the_encoder_alone_loads_from_a_translator_checkpoint(case, tmp_path):
    """As `T5EncoderModel` out of a T5 checkpoint: `AutoModelForTextEncoding` gives the variant's encoder class, with
    the translator's encoder weights and embedding, computing the translator's encoder outputs."""
    model = tiny_translator(case)
    ids, mask = source_batch()
    model.save_pretrained(tmp_path)
    encoder, info = AutoModelForTextEncoding.from_pretrained(tmp_path, output_loading_info=True)
    assert type(encoder) is type(model.model.encoder) and type(encoder).__name__.endswith("Encoder")
    assert not info["missing_keys"]
    expected = model.get_encoder()(input_ids=ids, attention_mask=mask).last_hidden_state
    assert torch.equal(encoder.eval()(input_ids=ids, attention_mask=mask).last_hidden_state, expected)
    layer = type(encoder.layers[0])
    assert layer.__name__ == "ZooEncoderLayer" and not encoder.layers[0].self_attn.is_causal


@pytest.mark.parametrize("case", ["mha", "gqa-cross_gqa", "mha-cross_additive", "linformer", "aft_simple"])
@torch.no_grad()
def test_the_decoder_alone_loads_from_a_translator_checkpoint_as_the_causal_lm(case, tmp_path):
    """As `BartForCausalLM` out of a BART checkpoint: `AutoModelForCausalLM` gives the variant's causal LM with the
    translator's decoder layers (cross-attention included), embedding and head; over the translator's encoder outputs
    it computes the translator's logits."""
    model = tiny_translator(case, decoder_layers=2)
    ids, mask = source_batch()
    target = target_batch()
    model.save_pretrained(tmp_path)
    decoder, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert type(decoder) is VARIANTS[case.split("-")[0]].causal_lm_class and not info["missing_keys"]
    assert len(decoder.model.layers) == 2 and decoder.config.add_cross_attention
    encoder_outputs = model.get_encoder()(input_ids=ids, attention_mask=mask).last_hidden_state
    logits = decoder.eval()(
        input_ids=target, encoder_hidden_states=encoder_outputs, encoder_attention_mask=mask
    ).logits
    expected = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
    assert torch.equal(logits, expected)
