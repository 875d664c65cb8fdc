"""lm-evaluation-harness on a zoo checkpoint over a local text task (slow; skipped without `pip install lm-eval`)."""

import importlib.util

import pytest
import torch

from hf_attn_zoo.data import byte_level_tokenizer, tokenizer_fields
from hf_attn_zoo.evaluation.lm_eval_task import write_task
from hf_attn_zoo.evaluation.perplexity import score_texts
from hf_attn_zoo.models import VARIANTS

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="needs `pip install lm-eval`"),
]


def test_lm_eval_word_perplexity_equals_the_harness(tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    tokenizer = byte_level_tokenizer()
    config = VARIANTS["gqa"].config(
        **tokenizer_fields(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    model = VARIANTS["gqa"].causal_lm_class(config).eval()
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    text = "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n" * 3
    (tmp_path / "doc.txt").write_text(text)
    write_task([tmp_path / "doc.txt"], tmp_path / "tasks")
    results = simple_evaluate(
        model="hf",
        model_args=f"pretrained={tmp_path / 'model'},trust_remote_code=True",
        tasks=["zoo_text"],
        task_manager=TaskManager(include_path=str(tmp_path / "tasks")),
        batch_size=1,
        device="cpu",  # lm-eval's hf model asks for CUDA by default
    )
    metrics = results["results"]["zoo_text"]
    ours = score_texts(model, tokenizer, [text], max_length=512)  # BOS = EOS: lm-eval's prefix token too
    assert metrics["word_perplexity,none"] == pytest.approx(ours.word_perplexity, rel=1e-3)
    assert metrics["bits_per_byte,none"] == pytest.approx(ours.bits_per_byte, rel=1e-3)
