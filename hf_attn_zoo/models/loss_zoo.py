"""The training loss of the causal LM: transformers' `ForCausalLMLoss`, computed two ways.

- `causal_lm_loss` (the default): from the logits, as transformers does, same loss value; its backward writes the
  logits' gradient (softmax minus one-hot, scaled) in one pass over the saved log-probabilities (`CrossEntropy`).
- `causal_lm_loss_fused`: without the logits. In training with labels the `(tokens, vocab)` logits are the largest
  activation of a small model; `LinearCrossEntropy` never holds them (the approach of Liger's fused linear
  cross-entropy). `ZooForCausalLM` uses it when `config.fuse_linear_cross_entropy` is on (an opt-in, off by default:
  the output's `logits` is then None) and the head is a plain `nn.Linear` (not wrapped by PEFT or a quantizer).

This module travels with every checkpoint (remote code): it imports only torch.
"""

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn import functional as F


class CrossEntropy(torch.autograd.Function):
    """`nll_loss(log_softmax(logits), targets)`, summed or averaged over valid targets, as `F.cross_entropy` computes
    it (the same kernels, so the same loss value), with a shorter backward. torch's backward first writes the dense
    gradient of the log-probabilities (a `(N, vocab)` tensor of zeros with one entry per row, `nll_loss_backward`)
    and then reads it back beside the log-probabilities (`log_softmax_backward`); the gradient is `(softmax -
    one_hot) * scale`, written here in one pass over the log-probabilities and a scatter of one entry per row. On
    CPU that is a quarter less time for the loss (8 x 256 tokens, vocabulary 16384), the gradient the same to an
    ulp (`exp` is torch's, where softmax's backward has its own vectorised one)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, mean: bool) -> torch.Tensor:
        # logits (N, V), targets (N,)
        log_probs = torch.log_softmax(logits, dim=-1)
        loss = F.nll_loss(log_probs, targets, ignore_index=ignore_index, reduction="mean" if mean else "sum")
        ctx.ignore_index, ctx.mean = ignore_index, mean
        ctx.save_for_backward(log_probs, targets)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: torch.Tensor):
        log_probs, targets = ctx.saved_tensors
        valid = targets != ctx.ignore_index
        scale = grad_output / valid.sum() if ctx.mean else grad_output  # what nll_loss's backward puts on a target
        row_scale = torch.where(valid, scale, 0).to(log_probs.dtype)[:, None]  # (N, 1): ignored rows get nothing
        grad = torch.exp(log_probs).mul_(row_scale)
        grad.scatter_add_(1, torch.where(valid, targets, 0)[:, None], -row_scale)
        return grad, None, None, None


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.LongTensor,
    vocab_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.LongTensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """transformers' `ForCausalLMLoss` (the same arguments, the same value): logits upcast to float32, labels shifted
    (token t predicts token t + 1), the mean over valid targets, or their sum / `num_items_in_batch` when given (the
    Trainer's count over gradient-accumulation steps); computed by `CrossEntropy`."""
    logits = logits.float()
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    logits = logits.view(-1, vocab_size)  # (B, T, V) -> (B*T, V)
    targets = shift_labels.reshape(-1).to(logits.device)
    loss = CrossEntropy.apply(logits, targets, ignore_index, num_items_in_batch is None)
    if num_items_in_batch is not None:
        loss = loss / (
            num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch
        )
    return loss


class LinearCrossEntropy(torch.autograd.Function):
    """`cross_entropy(hidden @ weight.T, targets)` summed over valid targets and divided by `divisor`, without ever
    holding the `(N, vocab)` logits: tokens go through in chunks, and each chunk's gradients (softmax minus one-hot,
    pushed through the head at once) are computed in the forward pass, then scaled in the backward (the approach of
    Liger's fused linear cross-entropy). Same three matmuls as the plain path, a fraction of the memory traffic.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, divisor, ignore_index: int, chunk_size: int):
        # hidden (N, d), weight (V, d), targets (N,)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        loss_dtype = torch.promote_types(hidden.dtype, torch.float32)  # bf16/fp16 logits upcast, as transformers does
        total = torch.zeros((), dtype=loss_dtype, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            chunk = hidden[start : start + chunk_size]  # (n, d)
            target = targets[start : start + chunk_size]  # (n,)
            logits = (chunk @ weight.T).to(loss_dtype)  # (n, V)
            valid = target != ignore_index
            safe_target = torch.where(valid, target, 0)
            log_normaliser = torch.logsumexp(logits, dim=-1)  # (n,)
            target_logit = logits.gather(1, safe_target[:, None]).squeeze(1)
            total += ((log_normaliser - target_logit) * valid).sum()
            # d(sum of losses)/d(logits) = softmax - one_hot(target) on valid rows; computed in the logits' buffer
            grad_logits = logits.sub_(log_normaliser[:, None]).exp_().mul_(valid[:, None])
            grad_logits.scatter_add_(1, safe_target[:, None], -valid[:, None].to(grad_logits.dtype))
            grad_logits = grad_logits.to(hidden.dtype)
            torch.mm(grad_logits, weight, out=grad_hidden[start : start + chunk_size])
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.T, chunk)
        ctx.save_for_backward(grad_hidden, grad_weight, divisor)
        return total / divisor

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight, divisor = ctx.saved_tensors
        scale = (grad_output / divisor).to(grad_hidden.dtype)
        return grad_hidden * scale, None if grad_weight is None else grad_weight * scale, None, None, None, None


def causal_lm_loss_fused(
    hidden_states: torch.Tensor,
    lm_head: nn.Linear,
    labels: torch.LongTensor,
    num_items_in_batch: torch.Tensor | int | None = None,
    shift_labels: torch.LongTensor | None = None,
    ignore_index: int = -100,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """transformers' `ForCausalLMLoss` (shifted labels, mean over valid tokens or sum / `num_items_in_batch`), computed
    by `LinearCrossEntropy`."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]  # token t predicts token t + 1
    targets = shift_labels.reshape(-1).to(hidden_states.device)
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])  # (B, T, d) -> (B*T, d)
    divisor = (targets != ignore_index).sum() if num_items_in_batch is None else num_items_in_batch
    divisor = torch.as_tensor(divisor, device=hidden.device, dtype=torch.promote_types(hidden.dtype, torch.float32))
    if chunk_size is None:  # about 8 MiB of fp32 logits per chunk on CPU (cache-sized), 1 GiB on accelerators
        budget = 1 << (21 if hidden.device.type == "cpu" else 28)
        chunk_size = max(1, budget // lm_head.out_features)
    return LinearCrossEntropy.apply(hidden, lm_head.weight, targets, divisor, ignore_index, chunk_size)
