"""What only the RNN translator (`zoo_rnn`) has (the contract it shares with the Transformer encoder-decoders is
`test_translators.py`): the unidirectional single-layer form against the naive reference, beam search against a brute
force search, its config refusals, its registration and shape-checked loading."""

import pytest
import torch
from test_translators import source_batch, target_batch, tiny_translator
from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM

from hf_attn_zoo.models import SEQ2SEQ, VARIANTS
from hf_attn_zoo.models.rnn import ZooRNNConfig, ZooRNNForConditionalGeneration, tied_embedding

import references
from conftest import ATOL

VOCAB = 31  # small enough to score every two-token continuation


def tiny(attention: str = "bahdanau", cell: str = "gru", **fields) -> ZooRNNForConditionalGeneration:
    return tiny_translator(f"rnn-{attention}-{cell}", vocab_size=VOCAB, **fields)


@pytest.mark.parametrize("attention", ["bahdanau", "luong"])
def test_unidirectional_single_layer_equals_the_naive_reference(attention):
    model = tiny_translator(f"rnn-{attention}-lstm", bidirectional_encoder=False, num_layers=1)
    ids, mask = source_batch()
    targets = target_batch()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=targets).logits
        for row in range(len(ids)):
            expected = references.rnn_logits(model, ids[row][mask[row].bool()].tolist(), targets[row].tolist())
            torch.testing.assert_close(logits[row], expected, rtol=0, atol=ATOL)


@torch.no_grad()
def test_padding_gives_no_encoder_output():
    ids, mask = source_batch()
    encoded = tiny_translator("rnn-bahdanau-lstm").get_encoder()(input_ids=ids, attention_mask=mask)
    assert torch.all(encoded.last_hidden_state.masked_select(mask[..., None] == 0) == 0)


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
    ids = 3 + source_batch()[0][:1] % (VOCAB - 3)  # the first (unpadded) source, in the small vocabulary
    best, _ = brute_force_best(model, ids, 2)
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=2, min_new_tokens=2, num_beams=VOCAB, length_penalty=0.0)
    assert generated[0, 1:].tolist() == best


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


def test_a_checkpoint_of_the_wrong_shape_is_refused(tmp_path):
    tiny("bahdanau", rnn_hidden_size=6).save_pretrained(tmp_path)
    config = ZooRNNConfig.from_pretrained(tmp_path)
    config.rnn_hidden_size = 10
    with pytest.raises(ValueError, match="rnn_hidden_size"):
        ZooRNNForConditionalGeneration.from_pretrained(tmp_path, config=config)


def test_the_tied_embeddings_draw_no_random_numbers():
    """`encoder.embed_tokens` and `decoder.embed_tokens` take `shared`'s weight: building and initialising them draws
    nothing, so a seed gives the weights it gave when both sides read `shared` itself (the RNNs after them
    included)."""
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    model = tiny_translator("rnn-luong-gru")
    embedding = tied_embedding(model.config)
    model._init_weights(embedding)
    assert not torch.equal(torch.rand(3), expected)  # the model itself draws (control)
    torch.manual_seed(0)
    embedding = tied_embedding(model.config)
    model._init_weights(embedding)
    assert torch.equal(torch.rand(3), expected)
