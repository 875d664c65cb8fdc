"""Distillation from the model being converted: the student learns the parent's (the teacher's) next-token
distribution, as Hinton et al. (2015) distil and as LoLCATs, X-EcoMLA and MOHAWK repair a converted model.

`distillation_loss` (the teacher run alongside):

    loss = (1 - alpha) · T² · mean_t KL(p_teacher,T(·|t) || p_student,T(·|t)) + alpha · mean_t CE(student, label_t)

with p_·,T = softmax(logits / T). The T² keeps the gradients' scale independent of T (Hinton et al., section 2).
The means run over the positions t that have a label (`labels[t + 1] != ignore_index`, transformers' shifted
convention for a language model: the logits at t predict token t + 1); without labels, over every position but the
last, and alpha must be 0. An encoder-decoder's decoder predicts its labels in place (`shift=False`: the logits at t
predict `labels[t]`, the decoder having read the start token and `labels[:t]`), so every labelled position counts.
`num_items_in_batch` divides sums instead of counting positions, as transformers' loss does under gradient
accumulation.

`topk_distillation_loss` (the teacher's top-k precomputed once by `precompute_teacher_topk`, so a CPU run pays the
teacher once): per position the teacher keeps its k most likely tokens S, their log-probabilities log q_i at
temperature T (normalised over the whole vocabulary, not renormalised over S) and the log of the mass it puts
outside S, log q_tail = logsumexp over v not in S of log q_v. The loss is the KL divergence between the teacher's and
the student's distributions coarsened to the k + 1 outcomes {each i in S, "any other token"}:

    KL_k = Σ_{i ∈ S} q_i (log q_i - log p_i) + q_tail (log q_tail - log p_tail)

with p_i the student's probability of token i at temperature T and p_tail = 1 - Σ_{i ∈ S} p_i, computed as the
logsumexp of the student's log-probabilities outside S (exact, no cancellation). It is a true KL divergence (of
coarsened distributions, at most the full one), equals the full KL when k is the vocabulary (the tail is empty:
q_tail = 0 contributes nothing), and mixes with cross-entropy and T² as above.
"""

from collections.abc import Callable

import torch
from torch.nn import functional as F

# the columns `precompute_teacher_topk` adds to a tokenized dataset (one entry per token of each row)
TOPK_IDS, TOPK_LOGPROBS, TAIL_LOGPROB, TEMPERATURE = (
    "teacher_topk_ids",
    "teacher_topk_logprobs",
    "teacher_tail_logprob",
    "teacher_temperature",
)
TOPK_COLUMNS = (TOPK_IDS, TOPK_LOGPROBS, TAIL_LOGPROB, TEMPERATURE)


def scored_positions(
    shape: torch.Size, labels: torch.LongTensor | None, ignore_index: int, device, shift: bool = True
) -> tuple[torch.Tensor, torch.LongTensor | None]:
    """(mask `(B, T)` of the positions whose target is a label, the targets `(B, T)` or None): with `shift`
    transformers' language-model shift, the last position never scored; without, the labels in place (a decoder)."""
    batch, length = shape[:2]
    if labels is None:
        mask = torch.ones(batch, length, dtype=torch.bool, device=device)
        if shift:
            mask[:, -1] = False
        return mask, None
    if tuple(labels.shape) != (batch, length):
        raise ValueError(f"labels have shape {tuple(labels.shape)}, the logits {tuple(shape[:2])} positions.")
    targets = labels.to(device)
    if shift:
        targets = F.pad(targets, (0, 1), value=ignore_index)[:, 1:]  # token t + 1 is position t's target
    return targets != ignore_index, targets


def mix(
    kl_sum: torch.Tensor,
    student_logits: torch.Tensor,
    mask: torch.Tensor,
    targets: torch.LongTensor | None,
    temperature: float,
    alpha: float,
    num_items_in_batch,
) -> torch.Tensor:
    """(1 - alpha) · T² · KL + alpha · CE, both summed over the scored positions and divided by their count (or by
    `num_items_in_batch`)."""
    divisor = mask.sum() if num_items_in_batch is None else num_items_in_batch
    divisor = torch.as_tensor(divisor, dtype=torch.float32, device=kl_sum.device).clamp(min=1)
    loss = (1 - alpha) * temperature**2 * kl_sum / divisor
    if alpha:
        if targets is None:
            raise ValueError(f"alpha={alpha} mixes in cross-entropy, which needs labels; pass labels or alpha=0.")
        rows = student_logits[mask].float()  # (N, V)
        loss = loss + alpha * F.cross_entropy(rows, targets[mask], reduction="sum") / divisor
    return loss


def check_arguments(temperature: float, alpha: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be positive (1: the distributions as they are).")
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha={alpha} is the weight of cross-entropy, from 0 (distillation only) to 1 (none).")


def distillation_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.LongTensor | None = None,
    temperature: float = 1.0,
    alpha: float = 0.0,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | None = None,
    shift: bool = True,
) -> torch.Tensor:
    """(1 - alpha) · T² · KL(teacher || student) at temperature T + alpha · cross-entropy, averaged over the positions
    with a label (module docstring). `student_logits`, `teacher_logits`: `(B, T, V)`; `labels`: `(B, T)`, unshifted
    (transformers' convention), `ignore_index` where nothing is predicted; `shift=False` for a decoder's labels."""
    check_arguments(temperature, alpha)
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"teacher logits {tuple(teacher_logits.shape)} and student logits {tuple(student_logits.shape)} differ: "
            f"distillation compares distributions over one vocabulary at the same positions (same tokenizer, same "
            f"vocab_size)."
        )
    mask, targets = scored_positions(student_logits.shape, labels, ignore_index, student_logits.device, shift)
    student = F.log_softmax(student_logits[mask].float() / temperature, dim=-1)  # (N, V)
    teacher = F.log_softmax(teacher_logits[mask].to(student_logits.device).float() / temperature, dim=-1)
    kl_sum = F.kl_div(student, teacher, log_target=True, reduction="sum")  # Σ_N Σ_V q (log q - log p)
    return mix(kl_sum, student_logits, mask, targets, temperature, alpha, num_items_in_batch)


def topk_distillation_loss(
    student_logits: torch.Tensor,
    teacher_topk_ids: torch.LongTensor,
    teacher_topk_logprobs: torch.Tensor,
    teacher_tail_logprob: torch.Tensor,
    labels: torch.LongTensor | None = None,
    temperature: float = 1.0,
    alpha: float = 0.0,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """`distillation_loss` against the teacher's precomputed top-k (`precompute_teacher_topk`, at the same
    `temperature`): the KL divergence over the k tokens and a tail bucket (module docstring). `teacher_topk_ids`,
    `teacher_topk_logprobs`: `(B, T, k)`; `teacher_tail_logprob`: `(B, T)`."""
    check_arguments(temperature, alpha)
    if teacher_topk_ids.shape[:2] != student_logits.shape[:2] or teacher_topk_logprobs.shape != teacher_topk_ids.shape:
        raise ValueError(
            f"the teacher's top-k {tuple(teacher_topk_ids.shape)} / {tuple(teacher_topk_logprobs.shape)} does not "
            f"cover the student's {tuple(student_logits.shape[:2])} positions: precompute it on the same token rows."
        )
    vocab = student_logits.shape[-1]
    if int(teacher_topk_ids.max()) >= vocab:
        raise ValueError(
            f"the teacher's top-k holds token id {int(teacher_topk_ids.max())}, beyond the student's vocabulary of "
            f"{vocab}: teacher and student must share one tokenizer and vocab_size."
        )
    device = student_logits.device
    mask, targets = scored_positions(student_logits.shape, labels, ignore_index, device)
    student = F.log_softmax(student_logits[mask].float() / temperature, dim=-1)  # (N, V)
    ids = teacher_topk_ids[mask].to(device).long()  # (N, k)
    teacher_top = teacher_topk_logprobs[mask].to(device).float()  # (N, k)
    teacher_tail = teacher_tail_logprob[mask].to(device).float()  # (N,)
    student_top = student.gather(-1, ids)  # (N, k)
    student_tail = torch.logsumexp(student.scatter(-1, ids, float("-inf")), dim=-1)  # (N,): log Σ_{v ∉ S} p_v
    kl_sum = F.kl_div(student_top, teacher_top, log_target=True, reduction="sum")
    # q_tail (log q_tail - log p_tail), zero where the teacher leaves nothing outside its top-k
    tail = torch.where(
        teacher_tail > float("-inf"),
        teacher_tail.exp() * (teacher_tail - student_tail),
        torch.zeros_like(teacher_tail),
    )
    return mix(kl_sum + tail.sum(), student_logits, mask, targets, temperature, alpha, num_items_in_batch)


def teacher_topk(logits: torch.Tensor, k: int, temperature: float = 1.0) -> dict[str, torch.Tensor]:
    """The top-k columns of teacher `logits` `(..., V)`: ids `(..., k)` (int32), their log-probabilities at
    `temperature` `(..., k)` and the log of the mass outside them `(...)` (float32; -inf when k = V)."""
    if not 1 <= k <= logits.shape[-1]:
        raise ValueError(f"k={k} must be from 1 to the vocabulary size {logits.shape[-1]}.")
    logprobs = F.log_softmax(logits.float() / temperature, dim=-1)
    top, ids = logprobs.topk(k, dim=-1)
    tail = torch.logsumexp(logprobs.scatter(-1, ids, float("-inf")), dim=-1)
    return {TOPK_IDS: ids.int(), TOPK_LOGPROBS: top, TAIL_LOGPROB: tail}


@torch.no_grad()
def precompute_teacher_topk(
    teacher,
    dataset,
    k: int,
    temperature: float = 1.0,
    batch_size: int = 8,
    input_column: str = "input_ids",
    progress: Callable[[int], None] | None = None,
):
    """`dataset` (a `datasets.Dataset` of token rows, `input_column`) with the teacher's top-k added per token:
    `teacher_topk_ids` (k int32 per token), `teacher_topk_logprobs` (k float32 per token, at `temperature`),
    `teacher_tail_logprob` (float32 per token) and `teacher_temperature` (per row). Save it with `save_to_disk` and
    read it back with `datasets.load_from_disk(...).with_format("torch")`: `topk_distillation_loss` takes the three
    teacher columns as they come out of a batch. Rows of different lengths run one at a time; `progress` is called
    with the number of rows done."""
    was_training = teacher.training
    teacher.eval()
    device = next(teacher.parameters()).device

    def add(rows: dict) -> dict:
        sequences = rows[input_column]
        lengths = {len(sequence) for sequence in sequences}
        groups = [sequences] if len(lengths) == 1 else [[sequence] for sequence in sequences]
        out = {column: [] for column in TOPK_COLUMNS}
        for group in groups:
            input_ids = torch.as_tensor(group, dtype=torch.long, device=device)  # (b, T)
            logits = teacher(input_ids=input_ids, use_cache=False).logits  # (b, T, V)
            columns = teacher_topk(logits, k, temperature)
            for column, values in columns.items():
                # arrays, not Python lists: datasets writes them to Arrow without boxing every float
                out[column] += list(values.cpu().numpy())
            out[TEMPERATURE] += [float(temperature)] * len(group)
        if progress is not None:
            progress(len(sequences))
        return out

    try:
        return dataset.map(add, batched=True, batch_size=batch_size, desc=f"teacher top-{k}")
    finally:
        teacher.train(was_training)


def check_precomputed_temperature(batch: dict, temperature: float) -> None:
    """Refuse a batch whose top-k was precomputed at another temperature than the loss is asked to use."""
    stored = batch.get(TEMPERATURE)
    if stored is None:
        return
    values = torch.as_tensor(stored, dtype=torch.float32).unique()
    if values.numel() != 1 or abs(float(values[0]) - temperature) > 1e-6:
        raise ValueError(
            f"the teacher's top-k was precomputed at temperature {values.tolist()}, the loss runs at {temperature}: "
            f"the stored log-probabilities hold at one temperature only; precompute again at {temperature}."
        )


def vocabulary_refusal(teacher, student, teacher_tokenizer=None, student_tokenizer=None) -> str | None:
    """Why `teacher` cannot be distilled into `student` (their output vocabularies differ: the logits' widths, or
    the tokenizers' vocabularies when both are given), as a sentence naming both and the fix; None when they agree."""
    widths = [model.get_output_embeddings().weight.shape[0] for model in (teacher, student)]
    if widths[0] != widths[1]:
        return (
            f"the teacher predicts {widths[0]} tokens, the student {widths[1]}: distillation compares next-token "
            f"distributions over one vocabulary; distil from the checkpoint the student was converted from (same "
            f"tokenizer and vocab_size)."
        )
    if teacher_tokenizer is not None and student_tokenizer is not None:
        if teacher_tokenizer.get_vocab() != student_tokenizer.get_vocab():
            return (
                "the teacher's and the student's tokenizers map tokens to different ids: distillation compares "
                "distributions token by token; use the student's parent and its tokenizer as the teacher."
            )
    return None


__all__ = [
    "TOPK_COLUMNS",
    "check_precomputed_temperature",
    "distillation_loss",
    "precompute_teacher_topk",
    "teacher_topk",
    "topk_distillation_loss",
    "vocabulary_refusal",
]
