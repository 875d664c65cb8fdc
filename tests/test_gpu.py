"""Kernels that only run on a CUDA GPU (skipped elsewhere): flash-attention 2 and flex attention against eager."""

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import left_padded_batch, tiny_config

pytestmark = pytest.mark.gpu

BACKENDS = ["sdpa", "flex_attention"]
if importlib.util.find_spec("flash_attn") is not None:
    BACKENDS.append("flash_attention_2")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["mha", "gqa", "mqa", "sliding_window"])
def test_gpu_backends_match_eager(name, backend):
    config = tiny_config(name, "rope", hidden_size=128, num_attention_heads=4)
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.bfloat16).cuda().eval()
    other = AutoModelForCausalLM.from_config(config, attn_implementation=backend, dtype=torch.bfloat16).cuda().eval()
    other.load_state_dict(eager.state_dict())
    input_ids, attention_mask, rows = left_padded_batch()
    input_ids, attention_mask = input_ids.cuda(), attention_mask.cuda()
    with torch.no_grad():
        expected = eager(input_ids, attention_mask=attention_mask).logits.float()
        actual = other(input_ids, attention_mask=attention_mask).logits.float()
    for i, row in enumerate(rows):
        torch.testing.assert_close(actual[i, -len(row) :], expected[i, -len(row) :], atol=2e-2, rtol=2e-2)
    generated = other.generate(input_ids, attention_mask=attention_mask, max_new_tokens=8, do_sample=False)
    assert generated.shape == (input_ids.shape[0], input_ids.shape[1] + 8)
