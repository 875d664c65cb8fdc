"""The small-data fields of the one training path, each doing what it says: batches by token count over pairs of
similar length (`training.batch_tokens`, padding measured), the mean of the last checkpoints
(`training.average_checkpoints`), early stopping on a validation metric (`training.early_stopping_patience`), label
smoothing (`training.label_smoothing_factor`), word dropout (`training.source_word_dropout`, `target_word_dropout`),
beam search's length penalty (`training.generation_length_penalty`),
and one final evaluation where the Trainer evaluated the last step already."""

import json
import random
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForSeq2SeqLM, TrainerCallback

from hf_attn_zoo.errors import UserError
from hf_attn_zoo.train import load_recipe, run_training
from hf_attn_zoo.train.batching import TokenBatchSampler

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "train" / "tiny_translation.yaml"
TINY_LM = ROOT / "configs" / "train" / "tiny_gqa.yaml"


def bible_like_lengths(count: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """Source and target lengths spread as verses are (5 to 64 tokens), the target near the source's length."""
    generator = random.Random(seed)
    sources = [generator.randint(5, 64) for _ in range(count)]
    return sources, [max(3, round(length * generator.uniform(0.8, 1.2))) for length in sources]


def test_token_batches_cover_every_pair_once_within_the_budget_with_little_padding():
    sources, targets = bible_like_lengths(5000)
    sampler = TokenBatchSampler(sources, targets, batch_tokens=2000, seed=3)
    batches = list(sampler)
    assert sorted(i for batch in batches for i in batch) == list(range(5000))
    for batch in batches:
        padded = len(batch) * (max(sources[i] for i in batch) + max(targets[i] for i in batch))
        assert padded <= 2000 or len(batch) == 1
    assert sampler.padding_fraction() <= 0.10  # the bound on padding waste
    # short pairs come many to a batch, long ones few
    sizes = {len(batch): max(sources[i] for i in batch) for batch in batches}
    assert max(sizes) > 3 * min(sizes)


def test_token_batches_are_deterministic_by_seed_and_change_with_the_epoch():
    sources, targets = bible_like_lengths(500)
    first = list(TokenBatchSampler(sources, targets, 600, seed=1))
    assert first == list(TokenBatchSampler(sources, targets, 600, seed=1))
    sampler = TokenBatchSampler(sources, targets, 600, seed=1)
    sampler.set_epoch(1)
    assert list(sampler) != first and sorted(map(sorted, sampler)) != sorted(map(sorted, first))


def test_token_batches_split_evenly_between_processes():
    sources, targets = bible_like_lengths(301)
    shares = [list(TokenBatchSampler(sources, targets, 500, seed=0, num_replicas=2, rank=rank)) for rank in (0, 1)]
    assert len(shares[0]) == len(shares[1])
    assert set(i for share in shares for batch in share for i in batch) == set(range(301))


def tiny_translation(tmp_path: Path, *overrides: str) -> dict:
    args = [
        "--training.max_steps",
        "6",
        "--training.eval_steps",
        "3",
        "--training.save_steps",
        "2",
        "--training.logging_steps",
        "1",
        "--training.output_dir",
        str(tmp_path),
        *overrides,
    ]
    return run_training(*load_recipe(RECIPE, args))


class CountEvaluations(TrainerCallback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_evaluate(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


def test_a_translator_trains_on_token_batches_and_reports_their_padding(tmp_path):
    counter = CountEvaluations()
    overrides = ["--training.batch_tokens", "300", "--training.output_dir", str(tmp_path)]
    args = load_recipe(RECIPE, ["--training.max_steps", "6", "--training.eval_steps", "3", *overrides])
    summary = run_training(*args, callbacks=[counter])
    assert summary["steps"] == 6 and 0 <= summary["padding_fraction"] <= 0.25
    # a step's tokens are those of the token batches, not per_device_train_batch_size pairs
    assert 0 < summary["train_tokens"] / summary["steps"] <= 300
    # the Trainer evaluated step 6 itself: the summary reuses it instead of a second pass of generate()
    assert counter.steps == [3, 6]
    assert summary["validation_bleu"] == summary["evaluations"][-1]["eval_bleu"]


def test_the_final_model_is_the_mean_of_the_last_checkpoints(tmp_path):
    summary = tiny_translation(tmp_path, "--training.average_checkpoints", "2")
    assert summary["averaged_checkpoints"] == ["checkpoint-4", "checkpoint-6"]
    weights = [load_file(str(tmp_path / name / "model.safetensors")) for name in summary["averaged_checkpoints"]]
    final = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "final").state_dict()
    for name, tensor in weights[0].items():
        torch.testing.assert_close(final[name], (tensor + weights[1][name]) / 2, rtol=0, atol=1e-7)
    assert any(not torch.equal(final[name], tensor) for name, tensor in weights[1].items())  # not the last weights


def test_early_stopping_ends_a_run_that_stopped_improving(tmp_path):
    """At learning rate 0 the validation loss never improves: with a patience of one evaluation the run stops at the
    second, 24 steps before max_steps."""
    overrides = ["--training.learning_rate", "0", "--training.early_stopping_patience", "1", "--training.save_steps"]
    summary = tiny_translation(
        tmp_path, *overrides, "3", "--training.metric_for_best_model", "loss", "--training.max_steps", "30"
    )
    evaluations = summary["evaluations"]
    assert summary["steps"] == 6 and [entry["step"] for entry in evaluations] == [3, 6, 6]
    # the run ends on the best checkpoint (step 3's weights), evaluated once more as the final model
    assert evaluations[2]["eval_loss"] == pytest.approx(evaluations[0]["eval_loss"], abs=1e-6)


def test_recipe_fields_that_cannot_work_are_refused(tmp_path):
    output = ["--training.output_dir", str(tmp_path)]
    with pytest.raises(UserError, match=r"early_stopping_patience=2 .*metric_for_best_model"):
        load_recipe(RECIPE, [*output, "--training.early_stopping_patience", "2"])
    with pytest.raises(UserError, match=r"average_checkpoints=3 .*save_total_limit=2.*raise save_total_limit"):
        load_recipe(RECIPE, [*output, "--training.average_checkpoints", "3", "--training.save_total_limit", "2"])
    with pytest.raises(UserError, match=r"batch_tokens=512 batches pairs .*per_device_train_batch_size"):
        run_training(*load_recipe(TINY_LM, [*output, "--training.batch_tokens", "512"]))
    # more checkpoints averaged than the run will write: refused before training, nothing written
    few, keep_three = tmp_path / "few", ("--training.save_total_limit", "3")
    with pytest.raises(UserError, match=r"average_checkpoints=2, but the run writes 1 .*save_steps=6 of 6 steps"):
        tiny_translation(few, "--training.average_checkpoints", "2", "--training.save_steps", "6")
    with pytest.raises(UserError, match=r"average_checkpoints=3, but the run writes 2 .*save_steps=3 of 6 steps"):
        tiny_translation(few, "--training.average_checkpoints", "3", "--training.save_steps", "0.5", *keep_three)
    with pytest.raises(UserError, match=r"writes 0 checkpoint\(s\) \(training.save_strategy=no\)"):
        tiny_translation(few, "--training.average_checkpoints", "2", "--training.save_strategy", "no")
    assert not few.exists()


def test_label_smoothing_is_the_smoothed_cross_entropy(tmp_path):
    """`training.label_smoothing_factor` e: the loss is (1 - e) * NLL + e * the mean over the vocabulary of -log p,
    over the target tokens."""
    from hf_attn_zoo.train.tasks import TASKS

    model_args, data_args, training_args = load_recipe(
        RECIPE, ["--training.output_dir", str(tmp_path), "--training.label_smoothing_factor", "0.1"]
    )
    task = TASKS["seq2seq"]()
    prepared = task.prepare(data_args)
    model = task.build(model_args, data_args, prepared).eval()
    trainer = task.trainer_class(
        model=model,
        args=training_args,
        train_dataset=prepared.train,
        eval_dataset=prepared.validation,
        data_collator=task.collator(model, prepared),
    )
    batch = task.collator(model, prepared)([prepared.train[i] for i in range(4)])
    labels = batch["labels"]
    with torch.no_grad():
        smoothed = trainer.compute_loss(model, dict(batch))
        log_probs = model(**batch).logits.float().log_softmax(-1)  # (B, T, V)
    kept = labels != -100
    nll = -log_probs.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)[kept].mean()
    uniform = -log_probs.mean(-1)[kept].mean()
    torch.testing.assert_close(smoothed, 0.9 * nll + 0.1 * uniform, rtol=1e-5, atol=1e-5)


def test_the_length_penalty_reaches_the_saved_generation_config(tmp_path):
    beams = ["--training.generation_num_beams", "2", "--training.generation_length_penalty", "1.3"]
    summary = tiny_translation(tmp_path, *beams)
    generation = json.loads((Path(summary["final_model"]) / "generation_config.json").read_text())
    assert generation["length_penalty"] == 1.3 and generation["num_beams"] == 2
    with pytest.raises(UserError, match=r"generation_length_penalty=1\.3 .*generation_num_beams to 2 or more"):
        load_recipe(RECIPE, ["--training.output_dir", str(tmp_path), "--training.generation_length_penalty", "1.3"])


def test_drop_words_replaces_tokens_at_the_rate_and_keeps_what_it_is_told():
    from hf_attn_zoo.train.trainer import drop_words

    torch.manual_seed(0)
    tokens = torch.randint(3, 100, (64, 256))  # (B, T)
    keep = torch.zeros_like(tokens, dtype=torch.bool)
    keep[:, 0] = True
    dropped = drop_words(tokens, 0.3, replacement=1, keep=keep)
    replaced = dropped != tokens
    assert torch.equal(dropped[replaced], torch.ones(int(replaced.sum()), dtype=tokens.dtype))
    assert not replaced[:, 0].any()
    # 16,320 draws at 0.3: the fraction within 5 standard deviations (0.018) of the rate
    assert abs(float(replaced[:, 1:].float().mean()) - 0.3) < 0.018
    assert drop_words(tokens, 0.0, replacement=1) is tokens


def test_word_dropout_reaches_the_training_batches_only(tmp_path):
    """`training.target_word_dropout`: the decoder's inputs of a training batch are the labels shifted right with
    some tokens replaced by the pad token (never the start token, never padding); the labels and the source stay.
    `training.source_word_dropout` does the same to the source. Evaluation batches are not touched."""
    from hf_attn_zoo.train.tasks import TASKS

    overrides = ["--training.target_word_dropout", "0.5", "--training.source_word_dropout", "0.25"]
    model_args, data_args, training_args = load_recipe(RECIPE, ["--training.output_dir", str(tmp_path), *overrides])
    task = TASKS["seq2seq"]()
    prepared = task.prepare(data_args)
    model = task.build(model_args, data_args, prepared)
    trainer = task.trainer_class(
        model=model,
        args=training_args,
        train_dataset=prepared.train,
        eval_dataset=prepared.validation,
        data_collator=task.collator(model, prepared),
    )
    batch = task.collator(model, prepared)([prepared.train[i] for i in range(16)])
    pad = model.config.pad_token_id
    torch.manual_seed(0)
    noisy = trainer.drop_words(model, dict(batch))
    shifted = model.prepare_decoder_input_ids_from_labels(labels=batch["labels"])
    changed = noisy["decoder_input_ids"] != shifted
    assert changed.any() and (noisy["decoder_input_ids"][changed] == pad).all()
    assert not changed[:, 0].any() and torch.equal(noisy["labels"], batch["labels"])
    real = (shifted != pad) & (torch.arange(shifted.shape[1]) > 0)
    assert 0.3 < float(changed[real].float().mean()) < 0.7
    source_changed = noisy["input_ids"] != batch["input_ids"]
    assert source_changed.any() and not source_changed[batch["attention_mask"] == 0].any()
    # the loss of a training step is the loss on the noisy batch; an evaluation's is the clean one
    model.train()
    model.config.hidden_dropout = model.config.attention_dropout = 0.0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    torch.manual_seed(1)
    trained = trainer.compute_loss(model, dict(batch))
    torch.manual_seed(1)
    expected = model(**trainer.drop_words(model, dict(batch))).loss
    torch.testing.assert_close(trained, expected, rtol=0, atol=0)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(trainer.compute_loss(model, dict(batch)), model(**batch).loss, rtol=0, atol=0)
    with pytest.raises(UserError, match=r"target_word_dropout=1\.0 is a probability .* \[0, 1\)"):
        load_recipe(RECIPE, ["--training.output_dir", str(tmp_path), "--training.target_word_dropout", "1.0"])


@pytest.mark.skipif(torch.accelerator.is_available(), reason="pinned memory is wanted beside an accelerator")
def test_no_memory_is_pinned_without_an_accelerator(tmp_path):
    from hf_attn_zoo.train.recipe import ZooTrainingArguments

    # torch's DataLoader warns on every CPU run that it cannot pin; pinning buys nothing without a device to copy to
    assert ZooTrainingArguments(output_dir=str(tmp_path)).dataloader_pin_memory is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = torch.utils.data.DataLoader(
            range(4), pin_memory=ZooTrainingArguments(str(tmp_path)).dataloader_pin_memory
        )
        assert [int(x) for batch in loader for x in batch] == [0, 1, 2, 3]
