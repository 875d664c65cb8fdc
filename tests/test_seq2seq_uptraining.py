"""MHA -> GQA/MQA uptraining of an encoder-decoder through the training path (Ainslie et al. 2023's T5 setting):
`convert.num_key_value_heads` pools a zoo translator's decoder self- and cross-attention, the encoder keeping its
heads; `convert.uptrain_fraction` counts the parent's training tokens in this run's tokens a step; `convert.distill`
trains the converted translator on the parent's distribution over each next target token (the decoder's labels in
place, not shifted: checked against a naive reference); a conversion that cannot work is refused naming the field."""

import json
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F
from transformers import AutoModelForSeq2SeqLM

from hf_attn_zoo.convert.distill import distillation_loss
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


def test_a_decoders_distillation_loss_scores_its_labels_in_place_as_a_naive_reference():
    """shift=False: the logits at t against label t, every labelled position counted: (1 - alpha) T² KL + alpha CE,
    averaged over them, position by position."""
    generator = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(2, 5, 11, generator=generator), torch.randn(2, 5, 11, generator=generator)
    labels = torch.randint(0, 11, (2, 5), generator=generator)
    labels[0, 3:] = -100  # padding of a shorter target
    temperature, alpha = 2.0, 0.3
    terms = []
    for row, position in (labels != -100).nonzero().tolist():
        p_teacher = F.softmax(teacher[row, position] / temperature, dim=-1)
        log_p_student = F.log_softmax(student[row, position] / temperature, dim=-1)
        kl = (p_teacher * (p_teacher.log() - log_p_student)).sum()
        cross_entropy = -F.log_softmax(student[row, position], dim=-1)[labels[row, position]]
        terms.append((1 - alpha) * temperature**2 * kl + alpha * cross_entropy)
    expected = torch.stack(terms).mean()
    loss = distillation_loss(student, teacher, labels, temperature=temperature, alpha=alpha, shift=False)
    assert len(terms) == 8 and torch.allclose(loss, expected, rtol=1e-5, atol=1e-6)
    shifted = distillation_loss(student, teacher, labels, temperature=temperature, alpha=alpha)
    assert not torch.allclose(shifted, expected, rtol=1e-3)  # a language model's shift scores other positions


def test_distilling_into_the_parents_own_copy_learns_nothing_to_learn(parent, tmp_path):
    """The parent's copy (G equal to its key/value heads, no dropout) distilled from the parent: its distribution is
    the teacher's, so the KL of the first step is zero."""
    output = tmp_path / "run"
    overrides = ["--model.init_from", str(parent / "final"), "--convert.num_key_value_heads", "2"]
    overrides += ["--convert.distill", "true", "--training.max_steps", "1", "--training.logging_steps", "1"]
    summary = run_training(*load_recipe(RECIPE, [*STEPS, *overrides, "--training.output_dir", str(output)]))
    assert summary["steps"] == 1 and summary["losses"][0] == pytest.approx(0.0, abs=1e-6)


def test_mqa_conversion_distilled_from_its_parent_trains_toward_it(parent, tmp_path):
    """Mean-pooled to one key/value head, then 10 steps of KL (T = 2) mixed with 10% cross-entropy against the
    parent run alongside: the loss falls and the translator saved is MQA in the decoder."""
    output = tmp_path / "run"
    overrides = ["--model.init_from", str(parent / "final"), "--convert.num_key_value_heads", "1"]
    overrides += ["--convert.distill", "true", "--convert.temperature", "2", "--convert.alpha", "0.1"]
    overrides += ["--training.max_steps", "10", "--training.logging_steps", "1", "--training.learning_rate", "1e-3"]
    summary = run_training(*load_recipe(RECIPE, [*STEPS, *overrides, "--training.output_dir", str(output)]))
    losses = summary["losses"]
    assert summary["steps"] == 10 and len(losses) == 10 and losses[0] > 0
    assert sum(losses[-3:]) / 3 < losses[0]
    config = AutoModelForSeq2SeqLM.from_pretrained(output / "final").config
    assert (config.num_key_value_heads, config.cross_attention_num_key_value_heads) == (1, 1)


def test_precomputed_teacher_columns_are_refused_for_a_translator(parent, tmp_path):
    overrides = ["--model.init_from", str(parent / "final"), "--convert.distill", "true"]
    overrides += ["--convert.teacher_topk", "8", "--training.output_dir", str(tmp_path / "run")]
    with pytest.raises(UserError, match=r"convert\.teacher_topk=8 .*leave convert\.teacher_topk empty"):
        run_training(*load_recipe(RECIPE, [*STEPS, *overrides]))
    assert not (tmp_path / "run").exists()


def test_a_recipe_config_the_checkpoint_does_not_take_is_named(parent, tmp_path):
    """With model.init_from the checkpoint's config is kept: the recipe's own fields (those the parent was built
    with) pass in silence, a field that differs is named in a warning with both values."""
    from transformers.testing_utils import CaptureLogger

    from hf_attn_zoo.train import build

    config = AutoModelForSeq2SeqLM.from_pretrained(parent / "final").config
    init = ["--model.init_from", str(parent / "final"), "--training.output_dir", str(tmp_path)]
    model_args, _, _ = load_recipe(RECIPE, init)
    with CaptureLogger(build.logger) as captured:
        assert build.warn_unapplied_config(model_args, config) == []
    assert captured.out == ""
    model_args, _, _ = load_recipe(RECIPE, [*init, "--model.config", '{"hidden_dropout": 0.3}'])
    with CaptureLogger(build.logger) as captured:
        assert build.warn_unapplied_config(model_args, config) == ["hidden_dropout"]
    assert f"hidden_dropout=0.3 (the checkpoint: {config.hidden_dropout!r})" in captured.out
    assert "model.config is not applied to model.init_from" in captured.out


def test_averaging_more_checkpoints_than_the_uptraining_writes_is_refused_before_training(parent, tmp_path):
    """Half the parent's 20 steps with a checkpoint every 20 steps writes one checkpoint: averaging two is refused
    once the fraction's steps are known (the recipe's 40 steps would have written two), before the first step."""
    args = ["--convert.uptrain_fraction", "0.5", "--training.average_checkpoints", "2", "--training.max_steps", "40"]
    with pytest.raises(UserError, match=r"average_checkpoints=2, but the run writes 1 .*save_steps=20 of 10 steps"):
        convert(parent, tmp_path / "run", *args)
    assert not list((tmp_path / "run").glob("checkpoint-*")) and not (tmp_path / "run" / "final").exists()


def test_attention_transfer_brings_the_converted_decoder_toward_the_parent(parent, tmp_path):
    """`convert.transfer_tokens`: before training, the MQA conversion's decoder self- and cross-attention learn the
    parent's outputs on the first training pairs: every module's relative error falls (two a layer), and the
    converted model scores a lower validation perplexity than the conversion alone (neither trains after it)."""
    alone = convert(
        parent, tmp_path / "alone", "--convert.num_key_value_heads", "1", "--convert.uptrain_fraction", "0"
    )
    transfer = ["--convert.transfer_tokens", "2000", "--convert.transfer_epochs", "4"]
    summary = convert(
        parent,
        tmp_path / "transfer",
        "--convert.num_key_value_heads",
        "1",
        "--convert.uptrain_fraction",
        "0",
        *transfer,
    )
    report = summary["attention_transfer"]
    layers = AutoModelForSeq2SeqLM.from_pretrained(parent / "final").config.decoder_layers
    assert [(m["layer"], m["module"]) for m in report["modules"]] == [
        (layer, module) for layer in range(layers) for module in ("self_attn", "encoder_attn")
    ]
    assert all(m["after"] < m["before"] for m in report["modules"]) and 2000 <= report["tokens"] < 2200
    assert summary["steps"] == 0 and summary["validation_perplexity"] < alone["validation_perplexity"]


def test_attention_transfer_to_the_parents_own_heads_has_nothing_to_learn(parent, tmp_path):
    """Pooled to the parent's own key/value heads the decoder is the parent's: every module starts at error 0."""
    heads = str(AutoModelForSeq2SeqLM.from_pretrained(parent / "final").config.num_key_value_heads)
    args = [
        "--convert.num_key_value_heads",
        heads,
        "--convert.uptrain_fraction",
        "0",
        "--convert.transfer_tokens",
        "500",
    ]
    summary = convert(parent, tmp_path / "own", *args)
    assert all(m["before"] == 0.0 and m["after"] == 0.0 for m in summary["attention_transfer"]["modules"])


def test_attention_transfer_without_a_conversion_is_refused(parent, tmp_path):
    init = ["--model.init_from", str(parent / "final"), "--training.output_dir", str(tmp_path / "run")]
    with pytest.raises(UserError, match=r"convert\.transfer_tokens trains a converted attention.*num_key_value_heads"):
        load_recipe(RECIPE, [*init, "--convert.transfer_tokens", "100"])
    with pytest.raises(UserError, match=r"convert\.transfer_epochs sets attention transfer up"):
        load_recipe(RECIPE, [*init, "--convert.num_key_value_heads", "1", "--convert.transfer_epochs", "2"])
    with pytest.raises(UserError, match=r"convert\.transfer_tokens=0 must be a positive number"):
        load_recipe(RECIPE, [*init, "--convert.num_key_value_heads", "1", "--convert.transfer_tokens", "0"])
    assert not (tmp_path / "run").exists()
