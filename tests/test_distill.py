"""Distillation losses: the full KL at a temperature against a naive reference, the top-k form against its own
reference and against the full KL at k = vocabulary, the precomputed top-k read back from disk, bad input."""

import datasets
import pytest
import torch
from torch.distributions import Categorical, kl_divergence

from hf_attn_zoo.convert.distill import (
    TOPK_COLUMNS,
    check_precomputed_temperature,
    distillation_loss,
    precompute_teacher_topk,
    teacher_topk,
    topk_distillation_loss,
    vocabulary_refusal,
)

from conftest import ATOL, VOCAB_SIZE, tiny_model


def logits_and_labels(seed: int = 0, batch: int = 2, length: int = 6, vocab: int = 11):
    generator = torch.Generator().manual_seed(seed)
    student = torch.randn(batch, length, vocab, generator=generator) * 2
    teacher = torch.randn(batch, length, vocab, generator=generator) * 2
    labels = torch.randint(0, vocab, (batch, length), generator=generator)
    labels[0, 3] = labels[1, 1] = -100  # positions 2 (row 0) and 0 (row 1) predict nothing
    return student, teacher, labels


def naive_loss(student, teacher, labels, temperature, alpha):
    """Position by position with torch.distributions: (1 - alpha) T² KL(teacher || student) + alpha CE."""
    kls, ces = [], []
    for row in range(student.shape[0]):
        for t in range(student.shape[1] - 1):
            target = int(labels[row, t + 1])
            if target == -100:
                continue
            p_teacher = Categorical(logits=teacher[row, t].double() / temperature)
            p_student = Categorical(logits=student[row, t].double() / temperature)
            kls.append(kl_divergence(p_teacher, p_student))
            ces.append(-torch.log_softmax(student[row, t].double(), -1)[target])
    return (1 - alpha) * temperature**2 * torch.stack(kls).mean() + alpha * torch.stack(ces).mean()


def naive_topk_kl(student, teacher, k, temperature):
    """Per scored position (no labels: all but the last), the KL of the distributions coarsened to the teacher's
    top-k tokens and one bucket for the rest, summed in a loop; the mean over positions times T²."""
    total, count = 0.0, 0
    for row in range(student.shape[0]):
        for t in range(student.shape[1] - 1):
            q = torch.softmax(teacher[row, t].double() / temperature, -1)
            p = torch.softmax(student[row, t].double() / temperature, -1)
            top = q.topk(k).indices.tolist()
            rest = [v for v in range(q.numel()) if v not in top]
            kl = sum(float(q[i] * (q[i].log() - p[i].log())) for i in top)
            if rest:
                q_tail, p_tail = q[rest].sum(), p[rest].sum()
                kl += float(q_tail * (q_tail.log() - p_tail.log()))
            total, count = total + kl, count + 1
    return temperature**2 * total / count


@pytest.mark.parametrize(("temperature", "alpha"), [(1.0, 0.0), (2.0, 0.0), (0.5, 0.3), (4.0, 1.0)])
def test_the_loss_equals_a_naive_reference(temperature, alpha):
    student, teacher, labels = logits_and_labels()
    loss = distillation_loss(student, teacher, labels, temperature=temperature, alpha=alpha)
    assert abs(loss.item() - naive_loss(student, teacher, labels, temperature, alpha).item()) < ATOL


def test_without_labels_every_position_but_the_last_counts():
    student, teacher, _ = logits_and_labels()
    all_labelled = torch.zeros(student.shape[:2], dtype=torch.long)
    expected = naive_loss(student, teacher, all_labelled, 2.0, 0.0)
    assert abs(distillation_loss(student, teacher, temperature=2.0).item() - expected.item()) < ATOL


def test_the_loss_is_zero_for_the_teacher_itself_and_has_gradients():
    student, teacher, labels = logits_and_labels()
    assert distillation_loss(teacher, teacher, labels, temperature=3.0).abs().item() < 1e-6
    student.requires_grad_(True)
    distillation_loss(student, teacher, labels, temperature=2.0, alpha=0.5).backward()
    assert student.grad.abs().sum() > 0 and student.grad[0, 2].abs().sum() == 0  # unscored position: no gradient


def test_num_items_in_batch_divides_the_sum():
    student, teacher, labels = logits_and_labels()
    mean = distillation_loss(student, teacher, labels, temperature=2.0, alpha=0.2)
    summed = distillation_loss(student, teacher, labels, temperature=2.0, alpha=0.2, num_items_in_batch=1)
    assert abs(summed.item() / 8 - mean.item()) < ATOL  # 2 rows x 5 scored positions, 2 ignored


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_topk_at_the_whole_vocabulary_equals_the_full_kl(temperature):
    student, teacher, labels = logits_and_labels()
    columns = teacher_topk(teacher, k=teacher.shape[-1], temperature=temperature)
    assert torch.isinf(columns["teacher_tail_logprob"]).all()
    for alpha in (0.0, 0.4):
        full = distillation_loss(student, teacher, labels, temperature=temperature, alpha=alpha)
        top = topk_distillation_loss(
            student,
            columns["teacher_topk_ids"],
            columns["teacher_topk_logprobs"],
            columns["teacher_tail_logprob"],
            labels,
            temperature=temperature,
            alpha=alpha,
        )
        assert abs(full.item() - top.item()) < ATOL


@pytest.mark.parametrize("k", [1, 3, 10])
def test_topk_equals_the_kl_of_the_coarsened_distributions(k):
    student, teacher, _ = logits_and_labels(seed=3)
    columns = teacher_topk(teacher, k=k, temperature=1.5)
    loss = topk_distillation_loss(student, *(columns[name] for name in TOPK_COLUMNS[:3]), temperature=1.5)
    assert abs(loss.item() - naive_topk_kl(student, teacher, k, 1.5)) < ATOL
    # coarsening never adds divergence
    assert loss.item() <= distillation_loss(student, teacher, temperature=1.5).item() + ATOL


def test_the_precomputed_topk_reads_back_from_disk(tmp_path):
    teacher, student = tiny_model("gqa"), tiny_model("mqa", seed=1)
    rows = torch.randint(3, VOCAB_SIZE, (5, 12), generator=torch.Generator().manual_seed(0))
    dataset = datasets.Dataset.from_dict({"input_ids": rows.tolist()})
    precompute_teacher_topk(teacher, dataset, k=VOCAB_SIZE, temperature=2.0, batch_size=2).save_to_disk(tmp_path)
    stored = datasets.load_from_disk(str(tmp_path)).with_format("torch")
    batch = stored[:3]
    check_precomputed_temperature(batch, 2.0)
    with pytest.raises(ValueError, match="precomputed at temperature"):
        check_precomputed_temperature(batch, 1.0)
    with torch.no_grad():
        student_logits = student(input_ids=batch["input_ids"]).logits
        teacher_logits = teacher(input_ids=batch["input_ids"]).logits
    assert batch["teacher_topk_ids"].shape == (3, 12, VOCAB_SIZE)
    top = topk_distillation_loss(
        student_logits,
        batch["teacher_topk_ids"],
        batch["teacher_topk_logprobs"],
        batch["teacher_tail_logprob"],
        batch["input_ids"],
        temperature=2.0,
        alpha=0.1,
    )
    full = distillation_loss(student_logits, teacher_logits, batch["input_ids"], temperature=2.0, alpha=0.1)
    assert abs(top.item() - full.item()) < ATOL


def test_bad_input_is_named():
    student, teacher, labels = logits_and_labels()
    with pytest.raises(ValueError, match="one vocabulary"):
        distillation_loss(student, teacher[..., :-1], labels)
    with pytest.raises(ValueError, match="temperature"):
        distillation_loss(student, teacher, labels, temperature=0)
    with pytest.raises(ValueError, match="alpha"):
        distillation_loss(student, teacher, labels, alpha=1.5)
    with pytest.raises(ValueError, match="needs labels"):
        distillation_loss(student, teacher, alpha=0.5)
    columns = teacher_topk(teacher, k=3)
    with pytest.raises(ValueError, match="vocabulary"):
        topk_distillation_loss(student[..., :4], *(columns[name] for name in TOPK_COLUMNS[:3]))
    with pytest.raises(ValueError, match="k=0"):
        teacher_topk(teacher, k=0)


def test_a_teacher_of_another_vocabulary_is_refused():
    assert vocabulary_refusal(tiny_model("gqa"), tiny_model("mqa")) is None
    refusal = vocabulary_refusal(tiny_model("gqa"), tiny_model("mqa", vocab_size=VOCAB_SIZE + 3))
    assert "the teacher predicts 97 tokens, the student 100" in refusal
