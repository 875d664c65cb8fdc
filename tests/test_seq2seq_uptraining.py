"""MHA -> GQA/MQA uptraining of an encoder-decoder through the training path (Ainslie et al. 2023's T5 setting):
`convert.num_key_value_heads` pools a zoo translator's decoder self- and cross-attention, the encoder keeping its
heads; `convert.uptrain_fraction` counts the parent's training tokens in this run's tokens a step; a conversion that
cannot work is refused naming the field."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM

from hf_attn_zoo.errors import UserError
from hf_attn_zoo.train import load_recipe, run_training
from hf_attn_zoo.train.build import first_pairs

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "train" / "tiny_translation_transformer.yaml"
RNN_RECIPE = ROOT / "configs" / "train" / "tiny_translation.yaml"
STEPS = ["--training.max_steps", "20", "--training.eval_steps", "20", "--training.save_steps", "20"]


@pytest.fixture(scope="module")
def parent(tmp_path_factory) -> Path:
    """The tiny Transformer recipe's GQA translator (4 query heads, 2 key/value heads in the decoder's self- and
    cross-attention), 20 steps: the parent every conversion below reads."""
    output = tmp_path_factory.mktemp("seq2seq_parent") / "run"
    run_training(*load_recipe(RECIPE, [*STEPS, "--training.output_dir", str(output)]))
    return output


def convert(parent: Path, output: Path, *convert_args: str) -> dict:
    overrides = ["--model.init_from", str(parent / "final"), *convert_args, "--training.output_dir", str(output)]
    return run_training(*load_recipe(RECIPE, [*STEPS, *overrides]))


def test_pooling_to_the_parents_own_heads_scores_as_the_parent(parent, tmp_path):
    """G equal to the parent's key/value heads pools nothing: untrained (fraction 0) the converted translator is
    the parent, so it scores the parent's validation perplexity (same weights, pairs and tokenizer)."""
    summary = convert(
        parent, tmp_path / "run", "--convert.num_key_value_heads", "2", "--convert.uptrain_fraction", "0"
    )
    parent_summary = json.loads((parent / "training_summary.json").read_text())
    assert summary["steps"] == 0
    assert summary["validation_perplexity"] == pytest.approx(parent_summary["validation_perplexity"], rel=1e-5)
    original = AutoModelForSeq2SeqLM.from_pretrained(parent / "final").state_dict()
    converted = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "run" / "final").state_dict()
    assert converted.keys() == original.keys()
    assert all(torch.equal(converted[name], original[name]) for name in original)


def test_mqa_uptraining_pools_the_decoder_and_trains_the_fraction_of_the_parents_tokens(parent, tmp_path):
    """To one key/value head by the calibrated `aligned` method, then half the parent's tokens: the decoder's self-
    and cross-attention have one key/value head, the encoder keeps the parent's two, and the run trains half the
    parent's steps (the same pairs and batch, so the same tokens a step)."""
    summary = convert(
        parent,
        tmp_path / "run",
        *("--convert.num_key_value_heads", "1", "--convert.method", "aligned"),
        *("--convert.calibration_tokens", "256", "--convert.uptrain_fraction", "0.5"),
    )
    parent_summary = json.loads((parent / "training_summary.json").read_text())
    assert parent_summary["steps"] == 20 and summary["steps"] == 10
    assert summary["train_tokens"] == pytest.approx(parent_summary["train_tokens"] / 2, rel=0.01)
    config = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "run" / "final").config
    assert (config.num_key_value_heads, config.cross_attention_num_key_value_heads) == (1, 1)
    assert config.encoder_num_key_value_heads == 2


def test_the_first_pairs_hold_the_calibration_tokens():
    pairs = {"input_ids": [[5, 6, 2], [7, 2], [8, 9, 10, 2]], "labels": [[11, 2], [12, 13, 2], [14, 2]]}
    chosen = [(source.tolist(), target.tolist()) for source, target in first_pairs(pairs, 6)]  # 3 + 2, then 2 + 3
    assert chosen == [([[5, 6, 2]], [[11, 2]]), ([[7, 2]], [[12, 13, 2]])]
    assert len(first_pairs(pairs, 1)) == 1 and len(first_pairs(pairs, 10**6)) == 3


def test_a_conversion_that_cannot_work_is_refused_naming_the_field(parent, tmp_path):
    with pytest.raises(UserError, match=r"convert\.num_key_value_heads=3: .*choose one of \[1, 2\]"):
        convert(parent, tmp_path / "heads", "--convert.num_key_value_heads", "3")
    assert not (tmp_path / "heads" / "final").exists()
    rnn = tmp_path / "rnn"
    run_training(*load_recipe(RNN_RECIPE, ["--training.max_steps", "2", "--training.output_dir", str(rnn)]))
    overrides = ["--model.init_from", str(rnn / "final"), "--convert.num_key_value_heads", "1"]
    with pytest.raises(UserError, match=r"convert\.num_key_value_heads=1: zoo_rnn is not an encoder-decoder of the"):
        run_training(*load_recipe(RNN_RECIPE, [*overrides, "--training.output_dir", str(tmp_path / "from_rnn")]))
    assert not (tmp_path / "from_rnn" / "final").exists()
