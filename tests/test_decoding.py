"""Static caches and the compiled decode step give the tokens of the dynamic cache."""

import logging
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers
from packaging.version import Version

from hf_attn_zoo import decoding
from hf_attn_zoo.decoding import generate_compiled, static_cache
from hf_attn_zoo.models import VARIANTS

from test_integrations import byte_model

PROMPTS = ["hi", "a much longer prompt, longer than twice the window"]  # left padding, and a banded prefill


def key_value_variants() -> list[str]:
    """Variants whose cache holds keys and values (the others decode from a recurrent state)."""
    return [name for name, variant in VARIANTS.items() if not variant.decodes_from_state]


def prompts(tokenizer):
    return tokenizer(PROMPTS, return_tensors="pt", padding=True)


# The floor of pyproject.toml is older: there a static cache's length is a guess from the non-zero slots of row 0, so
# a left-padded batch gives the zoo's masks a wrong past length (the static cache's own mask reads cache_position).
STATIC_CACHE_LENGTH = pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.3"),
    reason="transformers < 5.3: StaticCache.get_seq_length counts non-zero slots of row 0, wrong for left padding",
)


@STATIC_CACHE_LENGTH
@pytest.mark.parametrize(
    "name, position",
    [
        (name, position)
        for name in key_value_variants()
        for position in ("rope", "alibi", "learned")  # relative, biased scores, absolute: each reads positions
        if position in VARIANTS[name].position_types
    ],
)
def test_static_cache_generates_the_tokens_of_the_dynamic_cache(name, position):
    model, tokenizer = byte_model(name, position_embedding_type=position)
    inputs = prompts(tokenizer)
    dynamic = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    static = model.generate(**inputs, max_new_tokens=12, do_sample=False, cache_implementation="static")
    torch.testing.assert_close(static, dynamic, rtol=0, atol=0)


@STATIC_CACHE_LENGTH
@pytest.mark.parametrize("name", ["gqa", "sliding_window"])
def test_compiled_decode_step_generates_the_tokens_of_the_dynamic_cache(name, monkeypatch, caplog):
    model, tokenizer = byte_model(name)
    inputs = prompts(tokenizer)
    dynamic = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    monkeypatch.setattr(decoding, "_compile_announced", False)  # as in a fresh process
    with caplog.at_level(logging.WARNING, logger="hf_attn_zoo.decoding"):
        compiled = generate_compiled(model, **inputs, max_new_tokens=12, do_sample=False)
        assert hasattr(model, "_compiled_call")  # generate() really took the compiled decode step
        again = generate_compiled(model, **inputs, max_new_tokens=12, do_sample=False)  # reuses the graph
    torch.testing.assert_close(compiled, dynamic, rtol=0, atol=0)
    torch.testing.assert_close(again, dynamic, rtol=0, atol=0)
    # the wait of the first compilation is announced, once
    notices = [r.getMessage() for r in caplog.records if r.name == "hf_attn_zoo.decoding"]
    assert len(notices) == 1 and notices[0].startswith("torch.compile is compiling the decode step"), notices


def test_the_compile_notice_reaches_stderr_without_logging_set_up():
    """A warning of a logger nobody configured goes to stderr (logging's last resort): users see it by default."""
    script = textwrap.dedent(
        """
        import torch
        from transformers import PretrainedConfig

        from hf_attn_zoo.decoding import generate_compiled

        class Model:  # what generate_compiled reads of a model; its generate() stops before any compilation
            _can_compile_fullgraph = True
            config = PretrainedConfig(num_hidden_layers=1)

            def generate(self, *args, **kwargs):
                return None

        for _ in range(2):
            generate_compiled(Model(), torch.zeros(1, 2, dtype=torch.long))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if "compiling the decode step" in line]
    assert len(lines) == 1 and lines[0].startswith("torch.compile is compiling"), result.stderr[-3000:]


def test_static_cache_refuses_a_state_variant():
    model, _ = byte_model("aft_simple")
    with pytest.raises(ValueError, match="_can_compile_fullgraph"):
        static_cache(model, 32)
