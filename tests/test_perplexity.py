"""The perplexity harness: known answers, windows that count every token once, batching that changes nothing."""

import json
import math

import evaluate
import pytest
import torch
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

import hf_attn_zoo.evaluation
from hf_attn_zoo.data import byte_level_tokenizer, tokenizer_fields
from hf_attn_zoo.errors import UserError
from hf_attn_zoo.evaluation.perplexity import plan_windows, score_texts, window_lengths
from hf_attn_zoo.models import VARIANTS
from hf_attn_zoo_cli import main

TEXTS = ["def add(a, b):\n    return a + b\n" * 6, "short one", "x = [i * i for i in range(10)]  # squares\n" * 4]


class UniformConfig(PretrainedConfig):
    model_type = "uniform_test"


class UniformLM(PreTrainedModel, GenerationMixin):
    """Every next token equally likely: its perplexity is the vocabulary size, whatever the text."""

    config_class = UniformConfig

    def __init__(self, config):
        super().__init__(config)
        self.unused = torch.nn.Linear(1, 1)

    def forward(self, input_ids, **kwargs):
        return CausalLMOutput(logits=torch.zeros(*input_ids.shape, self.config.vocab_size))


def byte_model(name="gqa", **overrides):
    tokenizer = byte_level_tokenizer()
    config = VARIANTS[name].config(
        **tokenizer_fields(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        initializer_range=0.1,
        **overrides,
    )
    torch.manual_seed(0)
    return VARIANTS[name].causal_lm_class(config).eval(), tokenizer


def test_uniform_model_scores_the_vocabulary_size():
    tokenizer = byte_level_tokenizer()
    model = UniformLM(UniformConfig(vocab_size=len(tokenizer)))
    result = score_texts(model, tokenizer, TEXTS, max_length=16, stride=8, batch_size=3)
    assert result.perplexity == pytest.approx(len(tokenizer), rel=1e-9)
    assert result.tokens == sum(len(text.encode()) for text in TEXTS)  # every byte predicted once (BOS first)
    assert result.bits_per_byte == pytest.approx(math.log2(len(tokenizer)), rel=1e-9)


def test_single_window_equals_the_models_own_loss():
    model, tokenizer = byte_model()
    text = TEXTS[0][:100]
    ids = torch.tensor([[tokenizer.bos_token_id, *tokenizer(text)["input_ids"]]])
    with torch.no_grad():
        loss = model(ids, labels=ids).loss
    result = score_texts(model, tokenizer, [text], max_length=256)
    assert result.perplexity == pytest.approx(math.exp(loss.item()), rel=1e-5)


def test_windows_count_every_token_exactly_once():
    for length, max_length, stride in [(1, 4, 4), (10, 4, 4), (10, 4, 1), (37, 16, 5), (16, 16, 3)]:
        windows = plan_windows(list(range(length)), max_length, stride)
        scored = [i for begin, end, first in windows for i in range(first, end)]
        assert scored == list(range(1, length))
        assert all(end - begin <= max_length for begin, end, _ in windows)
    with pytest.raises(ValueError, match="stride"):
        plan_windows(list(range(10)), 4, 5)


def test_disjoint_windows_are_the_sum_of_separate_chunks():
    model, tokenizer = byte_model()
    text = TEXTS[0]
    result = score_texts(model, tokenizer, [text], max_length=32, stride=32, add_bos=False)
    ids = tokenizer(text)["input_ids"]
    nll = 0.0
    for start in range(0, len(ids), 32):
        chunk = torch.tensor([ids[start : start + 32]])
        with torch.no_grad():
            nll += model(chunk, labels=chunk).loss.item() * (chunk.shape[1] - 1)
    assert result.nll == pytest.approx(nll, rel=1e-5)
    assert result.tokens == len(ids) - math.ceil(len(ids) / 32)


@pytest.mark.parametrize("position", ["rope", "learned", "sinusoidal", "alibi"])
def test_batching_does_not_change_the_result(position):
    model, tokenizer = byte_model(position_embedding_type=position)
    one = score_texts(model, tokenizer, TEXTS, max_length=48, stride=16, batch_size=1)
    four = score_texts(model, tokenizer, TEXTS, max_length=48, stride=16, batch_size=4)
    assert one.tokens == four.tokens
    assert four.perplexity == pytest.approx(one.perplexity, rel=1e-5)


@pytest.mark.parametrize(
    "variant, positions, table",
    [
        ("linformer", "rope", "Linformer's E and F"),
        ("linformer", "none", "Linformer's E and F"),
        ("aft_local", "none", "AFT's position bias"),
        ("aft_full", "sinusoidal", "AFT's position bias"),
    ],
)
def test_weights_sized_by_positions_refuse_longer_windows_naming_them(variant, positions, table):
    # the limit is the variant's weights, not its position type: "none" extrapolates, these tables do not
    config = VARIANTS[variant].config("tiny", max_position_embeddings=64, position_embedding_type=positions)
    with pytest.raises(UserError, match=f"max_length=128 is longer than the model's 64 positions: {table} has"):
        window_lengths(config, 128, None)
    assert window_lengths(config, 64, 32) == (64, 32)
    model = VARIANTS[variant].causal_lm_class(config).eval()  # the model refuses the same, naming the same table
    with pytest.raises(ValueError, match=f"position 64 is beyond max_position_embeddings=64, the size of {table}"):
        model(torch.ones(1, 65, dtype=torch.long))


def test_positions_that_extrapolate_are_scored_past_the_table():
    config = VARIANTS["aft_simple"].config("tiny", max_position_embeddings=64)  # no table, no positions
    assert window_lengths(config, 128, None, notice=False) == (128, 128)
    gqa = VARIANTS["gqa"].config("tiny", max_position_embeddings=64, position_embedding_type="rope")
    with pytest.raises(UserError, match="its positions are rope"):
        window_lengths(gqa, 128, None)


def test_evaluate_module_loads_by_path_and_takes_checkpoints(tmp_path):
    model, tokenizer = byte_model()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    metric = evaluate.load(hf_attn_zoo.evaluation.PERPLEXITY)
    by_object = metric.compute(predictions=TEXTS, model=model, tokenizer=tokenizer, max_length=64, stride=32)
    by_path = metric.compute(predictions=TEXTS, model=str(tmp_path), max_length=64, stride=32, batch_size=2)
    assert by_path["perplexity"] == pytest.approx(by_object["perplexity"], rel=1e-5)
    assert set(by_object) >= {"perplexity", "bits_per_byte", "word_perplexity", "tokens", "bytes"}
    words = sum(len(text.split()) + (text[-1:].isspace()) for text in TEXTS)  # re.split(r"\s+") keeps a tail
    assert by_object["word_perplexity"] == pytest.approx(math.exp(by_object["nll"] / words), rel=1e-9)


def test_eval_command_prints_json(tmp_path, capsys):
    model, tokenizer = byte_model()
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    (tmp_path / "text.txt").write_text(TEXTS[0])
    args = ["eval", str(tmp_path / "model"), "--data", str(tmp_path / "text.txt"), "--max-length", "64"]
    assert main([*args, "--stride", "32", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result) == {"perplexity", "bits_per_byte", "word_perplexity", "tokens", "bytes", "max_length", "stride"}
    assert result["max_length"] == 64 and result["stride"] == 32 and result["tokens"] == len(TEXTS[0].encode())
