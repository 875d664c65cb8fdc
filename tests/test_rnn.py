"""The RNN translator (`zoo_rnn`): exact against a naive reference; cached decoding, padding, generate, checkpoints."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers
from packaging.version import Version
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM

from hf_attn_zoo.models import SEQ2SEQ, VARIANTS
from hf_attn_zoo.models.rnn import ZooRNNCache, ZooRNNConfig, ZooRNNForConditionalGeneration, shift_tokens_right

from conftest import ATOL, CACHE_KWARG, returned_cache

VOCAB = 31
KINDS = [(attention, cell) for attention in ("bahdanau", "luong", "none") for cell in ("gru", "lstm")]
KIND_IDS = [f"{attention}-{cell}" for attention, cell in KINDS]


def tiny(attention: str = "bahdanau", cell: str = "gru", seed: int = 0, **fields) -> ZooRNNForConditionalGeneration:
    config = ZooRNNConfig(
        **{
            "vocab_size": VOCAB,
            "hidden_size": 8,
            "rnn_hidden_size": 6,
            "attention_hidden_size": 5,
            "num_layers": 2,
            "attention": attention,
            "cell": cell,
            "dropout": 0.0,
            **fields,
        }
    )
    torch.manual_seed(seed)
    model = ZooRNNForConditionalGeneration(config).eval()
    with torch.no_grad():  # initialised at std 0.02 the logits are all alike; larger weights make the tests bite
        for name, parameter in model.named_parameters():
            if "rnn" not in name:
                parameter.normal_(0, 0.5)
    return model


def source_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Three sources of lengths 7, 4 and 5, right padded (token 0 is the pad)."""
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (3, 7), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    mask[2, 5:] = 0
    return ids.masked_fill(mask == 0, 0), mask


def target_batch(length: int = 6) -> torch.Tensor:
    return torch.randint(3, VOCAB, (3, length), generator=torch.Generator().manual_seed(4))


# --- the naive reference: cells stepped by hand, one row and one position at a time -------------------------------


def cell_of(rnn: nn.RNNBase, layer: int, reverse: bool = False) -> nn.RNNCellBase:
    """The `torch.nn.GRUCell`/`LSTMCell` holding one layer (and direction) of `rnn`'s weights."""
    suffix = f"_l{layer}" + ("_reverse" if reverse else "")
    input_size = rnn.input_size if layer == 0 else rnn.hidden_size * (2 if rnn.bidirectional else 1)
    cell = (nn.LSTMCell if isinstance(rnn, nn.LSTM) else nn.GRUCell)(input_size, rnn.hidden_size)
    for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
        getattr(cell, name).data.copy_(getattr(rnn, name + suffix))
    return cell


def step(cell: nn.RNNCellBase, x: torch.Tensor, state):
    """One cell step on one row; the state is h (GRU) or (h, c) (LSTM)."""
    if isinstance(cell, nn.LSTMCell):
        h, c = cell(x[None], (state[0][None], state[1][None]))
        return h[0], (h[0], c[0])
    h = cell(x[None], state[None])[0]
    return h, h


def naive_encoder(model: ZooRNNForConditionalGeneration, tokens: list[int]) -> torch.Tensor:
    """The encoder outputs (n, E) of one source without padding."""
    config, rnn = model.config, model.model.encoder.rnn
    zeros = torch.zeros(config.rnn_hidden_size)
    layer_inputs = [model.model.shared.weight[token] for token in tokens]
    for layer in range(config.num_layers):
        directions = []
        for reverse in (False, True)[: 1 + config.bidirectional_encoder]:
            cell = cell_of(rnn, layer, reverse)
            state = (zeros, zeros) if config.cell == "lstm" else zeros
            outputs = []
            for x in reversed(layer_inputs) if reverse else layer_inputs:
                h, state = step(cell, x, state)
                outputs.append(h)
            directions.append(outputs[::-1] if reverse else outputs)
        layer_inputs = [torch.cat(states) for states in zip(*directions)]
    return torch.stack(layer_inputs)


def naive_logits(model: ZooRNNForConditionalGeneration, source: list[int], target: list[int]) -> torch.Tensor:
    """Logits (T, V) of one source/target pair, every formula written out."""
    config, decoder = model.config, model.model.decoder
    size, layers = config.rnn_hidden_size, config.num_layers
    memory = naive_encoder(model, source)  # (n, E)
    summary = memory[-1, :size]
    if config.bidirectional_encoder:  # the forward direction's last state, the backward direction's first
        summary = torch.cat([summary, memory[0, size:]])
    hidden = torch.tanh(decoder.bridge.weight @ summary + decoder.bridge.bias).view(layers, size)
    states = list(hidden)
    if config.cell == "lstm":
        cells = (decoder.bridge_cell.weight @ summary + decoder.bridge_cell.bias).view(layers, size)
        states = list(zip(hidden, cells))
    layer_cells = [cell_of(decoder.rnn, layer) for layer in range(layers)]

    def attend(scores: list[torch.Tensor]) -> torch.Tensor:
        weights = torch.softmax(torch.stack(scores), dim=0)
        return sum(weight * h_j for weight, h_j in zip(weights, memory))

    logits = []
    for token in target:
        x = model.model.shared.weight[token]
        top = states[-1][0] if config.cell == "lstm" else states[-1]
        if config.attention == "bahdanau":  # e_tj = v^T tanh(W s_{t-1} + U h_j), the context into the RNN
            attention = decoder.encoder_attn
            scores = [
                attention.v.weight[0] @ torch.tanh(attention.query_proj.weight @ top + attention.key_proj.weight @ h_j)
                for h_j in memory
            ]
            context = attend(scores)
            x = torch.cat([x, context])
        for layer in range(layers):
            x, states[layer] = step(layer_cells[layer], x, states[layer])
        s = x
        if config.attention == "luong":  # e_tj = s_t^T W_a h_j, after the step
            context = attend([s @ (decoder.encoder_attn.key_proj.weight @ h_j) for h_j in memory])
        features = s if config.attention == "none" else torch.cat([context, s])
        attentional = torch.tanh(decoder.output_proj.weight @ features + decoder.output_proj.bias)
        logits.append(model.lm_head.weight @ attentional)
    return torch.stack(logits)


@pytest.mark.parametrize("attention, cell", KINDS, ids=KIND_IDS)
def test_logits_equal_the_naive_reference(attention, cell):
    model = tiny(attention, cell)
    ids, mask = source_batch()
    targets = target_batch()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=targets).logits
        for row in range(len(ids)):
            source = ids[row][mask[row].bool()].tolist()
            expected = naive_logits(model, source, targets[row].tolist())
            torch.testing.assert_close(logits[row], expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("attention", ["bahdanau", "luong"])
def test_unidirectional_single_layer_equals_the_naive_reference(attention):
    model = tiny(attention, "lstm", bidirectional_encoder=False, num_layers=1)
    ids, mask = source_batch()
    targets = target_batch()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=targets).logits
        for row in range(len(ids)):
            expected = naive_logits(model, ids[row][mask[row].bool()].tolist(), targets[row].tolist())
            torch.testing.assert_close(logits[row], expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("attention, cell", KINDS, ids=KIND_IDS)
def test_cached_steps_equal_the_uncached_forward(attention, cell):
    model = tiny(attention, cell)
    ids, mask = source_batch()
    targets = target_batch()
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, decoder_input_ids=targets, use_cache=False).logits
        encoder_outputs = model.get_encoder()(input_ids=ids, attention_mask=mask)
        cache = model.make_cache()
        pieces = [  # a chunk of two tokens first, then one token at a time from the cache alone
            model(
                encoder_outputs=encoder_outputs, attention_mask=mask, decoder_input_ids=targets[:, :2], cache=cache
            ).logits
        ]
        for t in range(2, targets.shape[1]):
            output = model(attention_mask=mask, decoder_input_ids=targets[:, t : t + 1], cache=cache)
            assert returned_cache(output) is cache and cache.get_seq_length() == t + 1
            pieces.append(output.logits)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=ATOL)


@pytest.mark.parametrize("attention, cell", KINDS, ids=KIND_IDS)
def test_padded_rows_equal_the_rows_alone(attention, cell):
    model = tiny(attention, cell)
    ids, mask = source_batch()
    targets = target_batch()
    left_ids, left_mask = torch.zeros_like(ids), torch.zeros_like(mask)  # the same sources, left padded
    for row in range(len(ids)):
        n = int(mask[row].sum())
        left_ids[row, ids.shape[1] - n :], left_mask[row, ids.shape[1] - n :] = ids[row, :n], 1
    with torch.no_grad():
        right = model(input_ids=ids, attention_mask=mask, decoder_input_ids=targets).logits
        left = model(input_ids=left_ids, attention_mask=left_mask, decoder_input_ids=targets).logits
        for row in range(len(ids)):
            n = int(mask[row].sum())
            alone = model(input_ids=ids[row : row + 1, :n], decoder_input_ids=targets[row : row + 1]).logits[0]
            torch.testing.assert_close(right[row], alone, rtol=0, atol=ATOL)
            torch.testing.assert_close(left[row], alone, rtol=0, atol=ATOL)


def test_cross_attentions_are_one_head_over_the_real_source():
    model = tiny("luong")
    ids, mask = source_batch()
    with torch.no_grad():
        output = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target_batch(), output_attentions=True)
    (weights,) = output.cross_attentions
    assert weights.shape == (3, 1, 6, 7)
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, 1, 6))
    assert torch.all(weights.masked_select(mask[:, None, None, :] == 0) == 0)
    assert (
        tiny("none")(input_ids=ids, decoder_input_ids=target_batch(), output_attentions=True).cross_attentions is None
    )


def test_encoder_outputs_do_not_depend_on_the_decoder_and_are_reusable():
    model = tiny("bahdanau", "lstm")
    ids, mask = source_batch()
    with torch.no_grad():
        first = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target_batch(6))
        second = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target_batch(3).flip(0))
        assert torch.equal(first.encoder_last_hidden_state, second.encoder_last_hidden_state)
        assert torch.all(first.encoder_last_hidden_state[1, 4:] == 0)  # padding gives no encoder output
        encoder_outputs = model.get_encoder()(input_ids=ids, attention_mask=mask)
        for reused in (encoder_outputs, encoder_outputs.to_tuple()):
            again = model(encoder_outputs=reused, attention_mask=mask, decoder_input_ids=target_batch(6)).logits
            assert torch.equal(again, first.logits)


def test_labels_are_shifted_behind_the_start_token_and_minus_100_is_ignored():
    model = tiny("luong", "gru")
    ids, mask = source_batch()
    labels = target_batch()
    labels[1, 4:] = -100
    decoder_input_ids = shift_tokens_right(labels, model.config.pad_token_id, model.config.decoder_start_token_id)
    assert decoder_input_ids[:, 0].eq(model.config.decoder_start_token_id).all()
    assert torch.equal(decoder_input_ids[:, 1:].masked_fill(decoder_input_ids[:, 1:] == 0, -100), labels[:, :-1])
    assert torch.equal(model.prepare_decoder_input_ids_from_labels(labels), decoder_input_ids)
    output = model(input_ids=ids, attention_mask=mask, labels=labels)
    logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_input_ids).logits
    kept = labels != -100
    expected = torch.nn.functional.cross_entropy(logits[kept], labels[kept])
    torch.testing.assert_close(output.loss, expected)
    summed = model(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=torch.tensor(7)).loss
    torch.testing.assert_close(summed, expected * int(kept.sum()) / 7)
    output.loss.backward()
    missing = [name for name, parameter in model.named_parameters() if parameter.grad is None]
    assert not missing, missing


def test_tuples_when_return_dict_is_false():
    model = tiny()
    ids, mask = source_batch()
    with torch.no_grad():
        output = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target_batch(), return_dict=False)
        expected = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target_batch())
    assert isinstance(output, tuple) and torch.equal(output[0], expected.logits)
    base = model.model(input_ids=ids, attention_mask=mask, decoder_input_ids=target_batch(), return_dict=False)
    assert isinstance(base, tuple) and torch.equal(model.lm_head(base[0]), expected.logits)


def argmax_loop(model, ids, mask, steps: int) -> torch.Tensor:
    """Greedy decoding by hand: the whole prefix through the uncached forward at every step."""
    tokens = torch.full((len(ids), 1), model.config.decoder_start_token_id)
    finished = torch.zeros(len(ids), dtype=torch.bool)
    for _ in range(steps):
        logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=tokens, use_cache=False).logits
        next_token = logits[:, -1].argmax(-1).masked_fill(finished, model.config.pad_token_id)
        tokens = torch.cat([tokens, next_token[:, None]], dim=1)
        finished |= next_token == model.config.eos_token_id
    return tokens


@pytest.mark.parametrize("attention, cell", KINDS, ids=KIND_IDS)
def test_greedy_generate_equals_an_argmax_loop(attention, cell):
    model = tiny(attention, cell)
    ids, mask = source_batch()
    with torch.no_grad():
        generated = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        expected = argmax_loop(model, ids, mask, 8)
    assert torch.equal(generated, expected[:, : generated.shape[1]])


@pytest.mark.parametrize("attention, cell", KINDS, ids=KIND_IDS)
def test_beam_search_with_cache_equals_without(attention, cell):
    model = tiny(attention, cell)
    ids, mask = source_batch()
    settings = {"max_new_tokens": 7, "num_beams": 3, "num_return_sequences": 2, "length_penalty": 0.6}
    with torch.no_grad():
        cached = model.generate(ids, attention_mask=mask, use_cache=True, **settings)
        uncached = model.generate(ids, attention_mask=mask, use_cache=False, **settings)
    assert cached.shape[0] == 6
    assert torch.equal(cached, uncached)


def brute_force_best(model, ids: torch.Tensor, length: int) -> tuple[list[int], float]:
    """The highest-scoring continuation of `length` tokens for one source (no end-of-sequence token in the vocabulary
    it searches), by scoring every sequence."""
    candidates = torch.cartesian_prod(*[torch.arange(VOCAB)] * length)  # (V^length, length)
    starts = torch.full((len(candidates), 1), model.config.decoder_start_token_id)
    decoder_input_ids = torch.cat([starts, candidates[:, :-1]], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids.expand(len(candidates), -1), decoder_input_ids=decoder_input_ids).logits
    scores = logits.log_softmax(-1).gather(-1, candidates[..., None]).squeeze(-1).sum(-1)
    best = int(scores.argmax())
    return candidates[best].tolist(), float(scores[best])


def test_beam_search_wide_enough_finds_the_brute_force_best():
    """With as many beams as the vocabulary has tokens, two steps of beam search are exhaustive."""
    model = tiny("bahdanau", "gru", eos_token_id=None)
    ids = source_batch()[0][:1]
    best, _ = brute_force_best(model, ids, 2)
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=2, min_new_tokens=2, num_beams=VOCAB, length_penalty=0.0)
    assert generated[0, 1:].tolist() == best


def test_sampling_with_cache_equals_without():
    model = tiny("bahdanau", "lstm")
    ids, mask = source_batch()
    runs = []
    for use_cache in (True, False):
        torch.manual_seed(11)
        with torch.no_grad():
            runs.append(
                model.generate(
                    ids, attention_mask=mask, do_sample=True, top_k=8, max_new_tokens=8, use_cache=use_cache
                )
            )
    assert torch.equal(*runs)


def test_generate_refuses_key_value_caches():
    model = tiny()
    ids, mask = source_batch()
    with pytest.raises(ValueError, match="cache_implementation"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, cache_implementation="static")
    with pytest.raises(TypeError, match="make_cache"):
        model(input_ids=ids, decoder_input_ids=target_batch(), **{CACHE_KWARG: transformers.DynamicCache()})
    cache = model.make_cache()
    kwargs = {CACHE_KWARG: cache, "return_dict_in_generate": True}
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3, **kwargs)
    assert isinstance(returned_cache(out), ZooRNNCache)


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"cell": "rnn"}, "cell"),
        ({"attention": "dot"}, "attention"),
        ({"num_layers": 0}, "num_layers"),
        ({"hidden_size": -1}, "hidden_size"),
        ({"rnn_hidden_size": 2.5}, "rnn_hidden_size"),
        ({"attention_hidden_size": 0}, "attention_hidden_size"),
        ({"dropout": 1.0}, "dropout"),
        ({"bidirectional_encoder": "yes"}, "bidirectional_encoder"),
        ({"pad_token_id": None}, "pad_token_id"),
        ({"decoder_start_token_id": None}, "decoder_start_token_id"),
        ({"eos_token_id": 99}, "eos_token_id"),
        ({"decoder_start_token_id": -1}, "decoder_start_token_id"),
    ],
)
def test_bad_config_values_are_refused_naming_the_field(fields, field):
    with pytest.raises(ValueError, match=field):
        ZooRNNConfig(vocab_size=VOCAB, **fields)


def test_a_config_mutated_into_nonsense_is_refused_at_model_construction():
    config = ZooRNNConfig(vocab_size=VOCAB)
    config.attention = "cosine"
    with pytest.raises(ValueError, match="attention"):
        ZooRNNForConditionalGeneration(config)


def test_registered_as_seq2seq_only():
    assert "rnn" in SEQ2SEQ and "rnn" not in VARIANTS
    entry = SEQ2SEQ["rnn"]
    assert entry.model_type == "zoo_rnn" and entry.presets["tiny"]["hidden_size"] == 32
    config = AutoConfig.for_model("zoo_rnn", vocab_size=VOCAB, hidden_size=8)
    assert type(config) is ZooRNNConfig and config.is_encoder_decoder
    assert type(AutoModelForSeq2SeqLM.from_config(config)) is ZooRNNForConditionalGeneration
    assert type(AutoModel.from_config(config)).__name__ == "ZooRNNModel"
    assert type(entry.build("tiny", vocab_size=VOCAB)) is ZooRNNForConditionalGeneration


@pytest.mark.parametrize("tie", [True, False])
def test_save_and_reload_give_equal_logits(tmp_path, tie):
    model = tiny("luong", "lstm", tie_word_embeddings=tie)
    ids, mask = source_batch()
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "rnn.ZooRNNConfig",
        "AutoModel": "rnn.ZooRNNModel",
        "AutoModelForSeq2SeqLM": "rnn.ZooRNNForConditionalGeneration",
    }
    assert (tmp_path / "rnn.py").exists() and (tmp_path / "model.safetensors").exists()
    reloaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    shared = reloaded.model.shared.weight  # one tensor under three modules, as BART's, with or without a tied head
    assert reloaded.model.encoder.embed_tokens.weight is shared and reloaded.model.decoder.embed_tokens.weight is shared
    assert (reloaded.lm_head.weight is reloaded.model.shared.weight) == tie
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target_batch()).logits
        logits = reloaded(input_ids=ids, attention_mask=mask, decoder_input_ids=target_batch()).logits
    assert torch.equal(logits, expected)


def test_a_checkpoint_of_the_wrong_shape_is_refused(tmp_path):
    tiny("bahdanau", rnn_hidden_size=6).save_pretrained(tmp_path)
    config = ZooRNNConfig.from_pretrained(tmp_path)
    config.rnn_hidden_size = 10
    with pytest.raises(ValueError, match="rnn_hidden_size"):
        ZooRNNForConditionalGeneration.from_pretrained(tmp_path, config=config)


REMOTE_GENERATE = textwrap.dedent(
    """
    import sys
    sys.modules["hf_attn_zoo"] = None  # any attempt to import the package now fails
    import torch
    from transformers import AutoModelForSeq2SeqLM

    model = AutoModelForSeq2SeqLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
    inputs = torch.load(sys.argv[2])
    with torch.no_grad():
        torch.save(model.generate(**inputs, max_new_tokens=8, num_beams=3), sys.argv[3])
    """
)


@pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.3"),
    reason="transformers < 5.3 cannot load remote code importing siblings (see test_checkpoints.py)",
)
def test_trust_remote_code_in_a_process_without_the_package_generates_the_same(tmp_path):
    model = tiny("bahdanau", "lstm")
    ids, mask = source_batch()
    model.save_pretrained(tmp_path / "model")
    torch.save({"input_ids": ids, "attention_mask": mask}, tmp_path / "inputs.pt")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    command = [sys.executable, "-c", REMOTE_GENERATE, str(tmp_path / "model"), str(tmp_path / "inputs.pt")]
    result = subprocess.run(
        [*command, str(tmp_path / "out.pt")], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=8, num_beams=3)
    assert torch.equal(torch.load(tmp_path / "out.pt"), expected)
