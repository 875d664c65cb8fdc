"""Training outputs: logits with the loss by default, as Llama, the loss computed by `causal_lm_loss` (transformers'
`ForCausalLMLoss` with a shorter backward); the opt-in fused head + loss equals `ForCausalLMLoss` on materialised
logits."""

import pytest
import torch
from torch.nn import functional as F
from transformers.loss.loss_utils import ForCausalLMLoss

from hf_attn_zoo.models import modeling_zoo
from hf_attn_zoo.models.loss_zoo import causal_lm_loss, causal_lm_loss_fused

from conftest import ATOL, left_padded_batch, tiny_model


@pytest.mark.parametrize("num_items_in_batch", [None, 17, torch.tensor(17)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_loss_equals_transformers_loss_and_its_gradient(num_items_in_batch, dtype):
    """The same value as `ForCausalLMLoss` (the same kernels: bit for bit), the logits' gradient the same within
    float32 rounding (softmax - one-hot written in one pass), ignored targets and bf16 logits (upcast) included."""
    torch.manual_seed(0)
    logits = torch.randn(3, 11, 97).to(dtype)
    labels = torch.randint(0, 97, (3, 11))
    labels[0, :4] = -100  # padding, ignored
    results = []
    for loss_function in (causal_lm_loss, ForCausalLMLoss):
        x = logits.clone().requires_grad_()
        loss = loss_function(x, labels, 97, num_items_in_batch=num_items_in_batch)
        (loss * 3).backward()  # a non-unit upstream gradient must scale the gradient
        results.append((loss.detach(), x.grad))
    (loss, grad), (expected_loss, expected_grad) = results
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=0)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-2)
    assert grad.dtype == dtype
    assert torch.all(grad[0, :3] == 0)  # rows whose target is ignored get no gradient


def test_default_loss_takes_shift_labels_and_gives_nothing_to_ignored_rows():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 13, requires_grad=True)
    shift_labels = torch.randint(0, 13, (2, 5))
    torch.testing.assert_close(
        causal_lm_loss(logits, None, 13, shift_labels=shift_labels),
        ForCausalLMLoss(logits, None, 13, shift_labels=shift_labels),
        rtol=0,
        atol=0,
    )
    ignored = torch.full((2, 5), -100)
    loss = causal_lm_loss(logits, ignored, 13)  # nothing to predict: nan, as transformers' mean over no targets
    assert torch.isnan(loss) and torch.isnan(ForCausalLMLoss(logits, ignored, 13))
    assert torch.all(torch.autograd.grad(loss, logits)[0] == 0)


def test_the_default_head_uses_the_zoo_loss_unless_told_otherwise():
    model = tiny_model("gqa")
    assert model.loss_function is causal_lm_loss
    model.loss_function = ForCausalLMLoss  # a loss set on the model is the one used, as in transformers
    assert model.loss_function is ForCausalLMLoss


@pytest.mark.parametrize("chunk_size", [None, 5, 64])
@pytest.mark.parametrize("num_items_in_batch", [None, 17])
def test_fused_loss_and_gradients_equal_the_plain_path(chunk_size, num_items_in_batch):
    torch.manual_seed(0)
    hidden = torch.randn(3, 11, 16, dtype=torch.float64)
    head = torch.nn.Linear(16, 97, bias=False).double()
    labels = torch.randint(0, 97, (3, 11))
    labels[0, :4] = -100  # padding, ignored
    targets = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]  # token t predicts token t + 1
    divisor = (targets != -100).sum() if num_items_in_batch is None else num_items_in_batch
    results = []
    for fused in (True, False):
        h = hidden.clone().requires_grad_()
        head.zero_grad()
        if fused:
            loss = causal_lm_loss_fused(h, head, labels, num_items_in_batch, chunk_size=chunk_size)
        else:  # the definition, in float64
            loss = F.cross_entropy(head(h).flatten(0, 1), targets.flatten(), reduction="sum") / divisor
        (loss * 3).backward()  # a non-unit upstream gradient must scale both gradients
        results.append((loss.detach(), h.grad, head.weight.grad.clone()))
    for fused, plain in zip(*results):
        torch.testing.assert_close(fused, plain, rtol=1e-12, atol=1e-12)


def test_float32_matches_transformers_loss():
    torch.manual_seed(0)
    hidden, head = torch.randn(4, 9, 8), torch.nn.Linear(8, 50, bias=False)
    labels = torch.randint(0, 50, (4, 9))
    labels[1, :3] = -100
    for num_items in (None, 20):
        fused = causal_lm_loss_fused(hidden, head, labels, num_items, chunk_size=7)
        torch.testing.assert_close(fused, ForCausalLMLoss(head(hidden), labels, 50, num_items_in_batch=num_items))


def test_shift_labels_are_taken_as_given():
    torch.manual_seed(0)
    hidden, head = torch.randn(2, 5, 8), torch.nn.Linear(8, 13, bias=False)
    shift_labels = torch.randint(0, 13, (2, 5))
    fused = causal_lm_loss_fused(hidden, head, labels=None, shift_labels=shift_labels)
    plain = ForCausalLMLoss(head(hidden), None, 13, shift_labels=shift_labels)
    torch.testing.assert_close(fused, plain)


def test_training_with_labels_returns_logits_by_default_as_llama_does():
    """Custom loops and callbacks read `outputs.logits` in training (token accuracy, distillation): the default
    forward keeps them, equal to evaluation's, with the loss transformers computes from them."""
    input_ids, attention_mask, _ = left_padded_batch()
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    model = tiny_model("gqa")
    assert model.config.fuse_linear_cross_entropy is False
    with torch.no_grad():
        evaluated = model(input_ids, attention_mask=attention_mask, labels=labels)
    trained = model.train()(input_ids, attention_mask=attention_mask, labels=labels)
    assert trained.logits is not None and trained.logits.requires_grad
    torch.testing.assert_close(trained.logits, evaluated.logits, rtol=0, atol=0)  # no dropout: the same arithmetic
    expected = ForCausalLMLoss(trained.logits, labels, model.config.vocab_size)
    torch.testing.assert_close(trained.loss, expected, rtol=0, atol=0)


@pytest.mark.parametrize("tie", [True, False])
def test_the_opt_in_fused_path_gives_the_same_loss_and_gradients(tie, caplog):
    input_ids, attention_mask, _ = left_padded_batch()
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    fused, plain = (tiny_model("gqa", tie_word_embeddings=tie).train() for _ in range(2))
    fused.config.fuse_linear_cross_entropy = True
    type(modeling_zoo.logger).warning_once.cache_clear()  # transformers' once-per-process memory of messages
    with caplog.at_level("WARNING", logger="hf_attn_zoo"):
        out_fused = fused(input_ids, attention_mask=attention_mask, labels=labels)
        fused(input_ids, attention_mask=attention_mask, labels=labels)
    said = [r.getMessage() for r in caplog.records if "fuse_linear_cross_entropy=True" in r.getMessage()]
    assert len(said) == 1 and "`logits` is None" in said[0]  # once, saying why
    out_plain = plain(input_ids, attention_mask=attention_mask, labels=labels)
    assert out_fused.logits is None and out_plain.logits is not None
    torch.testing.assert_close(out_fused.loss, out_plain.loss, rtol=0, atol=ATOL)
    out_fused.loss.backward(), out_plain.loss.backward()
    for (name, a), b in zip(fused.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=ATOL, msg=name)
    with torch.no_grad():  # evaluation keeps the logits
        assert fused(input_ids, labels=labels).logits is not None
    fused.eval()
    assert fused(input_ids, labels=labels).logits is not None
