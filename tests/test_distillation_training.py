"""Distillation through the one training path (`convert.distill`, `train.tasks.DistillationTask`): a model
distilled from itself has nothing to learn (the KL is zero at the first step, with the teacher run alongside and with
its top-k precomputed over the whole vocabulary); a converted model learns from its parent and its validation
perplexity is the labels' (as every run reports it); settings that cannot work are refused before any work."""

from pathlib import Path

import pytest

from hf_attn_zoo.errors import UserError
from hf_attn_zoo.train import load_recipe, run_training

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "train" / "tiny_gqa.yaml"


def run(output: Path, *overrides: str) -> dict:
    args = ["--training.output_dir", str(output), "--training.report_to", "none", *overrides]
    return run_training(*load_recipe(TINY, args))


@pytest.fixture(scope="module")
def parent(tmp_path_factory) -> Path:
    """A tiny GQA language model trained 20 steps (2 key/value heads over 4 query heads)."""
    output = tmp_path_factory.mktemp("parent")
    run(output, "--training.max_steps", "20", "--training.save_steps", "20")
    return output / "final"


STEPS = ["--training.max_steps", "3", "--training.logging_steps", "1", "--training.save_steps", "3"]


@pytest.mark.parametrize("topk", [None, 512])
def test_a_model_distilled_from_itself_has_nothing_to_learn(parent, tmp_path, topk):
    """Teacher = student: KL(p || p) = 0 at the first step, whether the teacher runs alongside or its top-k over
    the whole vocabulary (512 tokens) was precomputed (exact there: the tail is empty)."""
    precompute = ["--convert.teacher_topk", str(topk)] if topk else []
    summary = run(tmp_path, "--model.init_from", str(parent), "--convert.distill", "true", *precompute, *STEPS)
    assert summary["losses"][0] == pytest.approx(0.0, abs=1e-5)
    assert 1 < summary["validation_perplexity"] < 512  # the labels' perplexity, not exp(KL) = 1


def test_a_converted_model_learns_from_its_parent(parent, tmp_path):
    """MQA pooled from the GQA parent: the KL to the parent is positive at first and falls as it trains."""
    overrides = ["--model.init_from", str(parent), "--convert.num_key_value_heads", "1", "--convert.distill", "true"]
    settings = ["--convert.temperature", "2", "--convert.alpha", "0.1", *STEPS, "--training.max_steps", "8"]
    summary = run(tmp_path, *overrides, *settings)
    losses = summary["losses"]
    assert losses[0] > 0.01 and min(losses[-3:]) < losses[0]
    assert "distillation" in (Path(summary["final_model"]) / "README.md").read_text()


def test_alpha_one_is_cross_entropy_uptraining_and_reads_no_teacher(parent, tmp_path):
    """convert.alpha 1 weighs the KL by 0: the run is plain cross-entropy uptraining, step for step the losses of the
    same run without distillation, and the teacher (here a folder that does not exist) is never loaded."""
    overrides = ["--model.init_from", str(parent), "--convert.num_key_value_heads", "1", *STEPS]
    plain = run(tmp_path / "plain", *overrides)
    teacher = ["--convert.teacher", str(tmp_path / "no-such-teacher")]
    distilled = run(tmp_path / "alpha1", *overrides, "--convert.distill", "true", "--convert.alpha", "1", *teacher)
    assert distilled["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    assert "alpha=1: the labels' cross-entropy alone" in (Path(distilled["final_model"]) / "README.md").read_text()


def test_distillation_settings_that_cannot_work_are_refused(parent, tmp_path):
    output = ["--training.output_dir", str(tmp_path)]
    with pytest.raises(UserError, match=r"convert\.temperature sets distillation up: set convert\.distill true"):
        load_recipe(TINY, [*output, "--convert.temperature", "2"])
    with pytest.raises(UserError, match=r"convert\.distill needs a teacher"):
        load_recipe(TINY, [*output, "--convert.distill", "true"])
    with pytest.raises(UserError, match=r"convert\.alpha=2\.0 in \[0, 1\]"):
        load_recipe(TINY, [*output, "--convert.distill", "true", "--convert.alpha", "2"])
    # a teacher over another vocabulary: refused naming both sizes, before training
    other = tmp_path / "other"
    run(other, "--data.vocab_size", "300", "--training.max_steps", "1", "--training.save_steps", "1")
    overrides = [
        "--model.init_from",
        str(parent),
        "--convert.distill",
        "true",
        "--convert.teacher",
        str(other / "final"),
    ]
    with pytest.raises(UserError, match=r"teacher predicts 300 tokens, the student 512"):
        run(tmp_path / "mismatch", *overrides, *STEPS)


def test_lora_on_the_mlps_changes_them_by_a_low_rank_update_and_trains_the_attention_in_full(parent, tmp_path):
    """`convert.lora_rank` 2: the MQA conversion distils with each MLP projection trained through a rank-2 update,
    merged into the saved model (a plain checkpoint, every weight under its own name); the final MLP weights differ
    from the parent's by a matrix of rank at most 2, the embeddings are the parent's, the attention moved freely."""
    import torch
    from safetensors.torch import load_file

    overrides = ["--model.init_from", str(parent), "--convert.num_key_value_heads", "1", "--convert.distill", "true"]
    summary = run(tmp_path, *overrides, "--convert.lora_rank", "2", *STEPS, "--training.learning_rate", "1e-2")
    assert summary["lora_rank"] == 2 and summary["trainable_parameters"] < summary["parameters"]
    before = load_file(str(parent / "model.safetensors"))
    after = load_file(str(Path(summary["final_model"]) / "model.safetensors"))
    assert not any("lora" in name or "parametrizations" in name for name in after)
    name = "model.layers.0.mlp.up_proj.weight"
    delta = (after[name] - before[name]).double()
    singular = torch.linalg.svdvals(delta)
    assert singular[0] > 1e-4 and singular[2] < 1e-6 * singular[0]  # moved, by rank 2
    assert torch.equal(after["model.embed_tokens.weight"], before["model.embed_tokens.weight"])
    # the key projection, mean-pooled from the parent's 2 heads to 1, trained in full: its change is of full rank
    key = "model.layers.0.self_attn.k_proj.weight"
    pooled = before[key].view(2, -1, before[key].shape[-1]).mean(0)  # (G*hd, d) -> (G, hd, d) -> (hd, d)
    change = torch.linalg.svdvals((after[key] - pooled).double())
    assert change[0] > 1e-4 and change[4] > 1e-6 * change[0]
    with pytest.raises(UserError, match=r"convert\.lora_rank=0 must be a positive rank"):
        load_recipe(TINY, ["--training.output_dir", str(tmp_path / "bad"), "--convert.lora_rank", "0"])
    with pytest.raises(UserError, match=r"convert\.lora_rank converts a checkpoint: set model\.init_from"):
        load_recipe(TINY, ["--training.output_dir", str(tmp_path / "bad"), "--convert.lora_rank", "4"])


def test_attention_transfer_then_distillation_in_one_run(parent, tmp_path):
    """`convert.transfer_tokens` with `convert.distill`, the paper's two stages in one run: the MQA conversion's
    layers first learn the parent's attention outputs on the first training blocks (each layer's error falls), then
    the model distils from the parent, starting closer to it than the same distillation without the transfer."""
    overrides = ["--model.init_from", str(parent), "--convert.num_key_value_heads", "1", "--convert.distill", "true"]
    plain = run(tmp_path / "plain", *overrides, *STEPS)
    transfer = ["--convert.transfer_tokens", "4096", "--convert.transfer_epochs", "3"]
    transferred = run(tmp_path / "transfer", *overrides, *STEPS, *transfer)
    report = transferred["attention_transfer"]
    assert report["tokens"] >= 4096 and [m["layer"] for m in report["modules"]] == list(range(len(report["modules"])))
    assert all(m["module"] == "self_attn" and m["after"] < m["before"] for m in report["modules"])
    assert transferred["losses"][0] < plain["losses"][0]
    assert "attention_transfer" not in plain
