"""The dependency floor and the clients that need it.

`pyproject.toml` asks for transformers >= FLOOR: the oldest release the suite passes on. A slow test builds a virtual
environment at exactly that release (with kvpress, whose 0.5 releases ask for transformers < 5.3), runs a core subset
of the suite and the kvpress tests there, and records what they found for README's "Works with" table.

The kvpress tests below run wherever kvpress imports (so not beside the newest transformers, which kvpress refuses):
a press keeps on a zoo model exactly what it keeps on `LlamaForCausalLM` with the same weights, and a variant that
decodes from a running state refuses it with an error that says why.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from packaging.version import Version
from test_llama_parity import tiny_llama
from transformers import DynamicCache, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from hf_attn_zoo.convert import from_llama
from hf_attn_zoo.convert.llama import LLAMA_BACKBONE, SHARED_FIELDS
from hf_attn_zoo.models import VARIANTS
from hf_attn_zoo.models.clients_zoo import kv_compression_refusal

from conftest import ATOL, CACHE_KWARG, VOCAB_SIZE, tiny_model

REPO = Path(__file__).resolve().parents[1]
FLOOR_TESTS = [
    "tests/test_conformance.py",
    "tests/test_transformers_contract.py",
    "tests/test_decoding.py",
    "tests/test_llama_parity.py",
    "tests/test_checkpoints.py",
    "tests/test_seq2seq.py",
    "tests/test_rnn.py",
    "tests/test_translators.py",
    "tests/test_floor.py",
]


def transformers_floor() -> str:
    """The lowest transformers `pyproject.toml` accepts (`"transformers>=X,..."` in its dependencies)."""
    return re.search(r'^\s*"transformers>=([\w.]+)', (REPO / "pyproject.toml").read_text(), re.MULTILINE).group(1)


def kvpress_spec() -> str:
    """The range of the `kvpress` extra (`kvpress = ["kvpress>=...,<..."]`)."""
    return re.search(r'^kvpress = \["([^"]+)"\]', (REPO / "pyproject.toml").read_text(), re.MULTILINE).group(1)


@pytest.mark.slow
def test_suite_passes_at_the_transformers_floor(tmp_path, works_with):
    """A fresh venv at the floor (pip's cache and the torch pin of constraints.txt reused), the package with its
    kvpress extra, the core tests and the kvpress tests: all pass; their client outcomes join this run's table."""
    floor = transformers_floor()
    venv = tmp_path / "venv"
    python = venv / "bin" / "python"
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    install = [str(python), "-m", "pip", "install", "-q", "-c", str(REPO / "constraints.txt")]
    subprocess.run([*install, "-e", f"{REPO}[dev]", f"transformers=={floor}", kvpress_spec()], check=True)
    version = subprocess.run(
        [str(python), "-c", "import transformers, kvpress; print(transformers.__version__)"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert Version(version) == Version(floor)  # `==5.2` installs 5.2.0
    recorded = tmp_path / "works_with.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *FLOOR_TESTS, "--works-with", str(recorded)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    outcomes_by_client = json.loads(recorded.read_text())
    assert outcomes_by_client.get("kvpress", {}).get("gqa") == "works", result.stdout[-3000:]  # the kvpress tests ran
    for client, outcomes in outcomes_by_client.items():
        for variant, outcome in outcomes.items():
            works_with(client, variant, refused=outcome.removeprefix("refused: ") if outcome != "works" else None)
    print(f"transformers {floor}: venv, install and {len(FLOOR_TESTS)} test files in {time.monotonic() - start:.0f} s")


# --- kvpress ---------------------------------------------------------------------------------------------------------

PRESSES = ["knorm", "streaming_llm", "expected_attention", "snapkv"]
STATE_VARIANTS = [name for name, variant in VARIANTS.items() if variant.decodes_from_state]
PROMPT_LENGTH = 40


def make_press(name: str, compression_ratio: float = 0.5):
    kvpress = pytest.importorskip("kvpress", reason="kvpress 0.5 needs transformers < 5.3 (the floor venv has it)")
    return {
        "knorm": lambda: kvpress.KnormPress(compression_ratio=compression_ratio),
        "streaming_llm": lambda: kvpress.StreamingLLMPress(compression_ratio=compression_ratio, n_sink=4),
        # fewer future positions than its default 512: the tiny models' max_position_embeddings is 128
        "expected_attention": lambda: kvpress.ExpectedAttentionPress(
            compression_ratio=compression_ratio, n_future_positions=64, n_sink=4
        ),
        "snapkv": lambda: kvpress.SnapKVPress(compression_ratio=compression_ratio, window_size=8, kernel_size=5),
    }[name]()


def prefill(model, press, input_ids: torch.Tensor) -> tuple[DynamicCache, torch.Tensor]:
    """Prefill under the press, as kvpress's README does; the cache after it, and the next-token logits of one decode
    step from the compressed cache."""
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model(input_ids, **{CACHE_KWARG: cache})
    with torch.no_grad():
        next_token = torch.full((input_ids.shape[0], 1), 5)
        logits = model(next_token, **{CACHE_KWARG: cache}).logits[:, -1]
    return cache, logits


def prompt(batch_size: int = 2) -> torch.Tensor:
    """Rows of distinct tokens. In the first layer a key's norm depends on its token alone (RoPE rotates, keeping the
    norm), so a repeated token ties with itself under KnormPress, and 1e-7 of kernel noise would pick either copy."""
    generator = torch.Generator().manual_seed(3)
    rows = [3 + torch.randperm(94, generator=generator)[:PROMPT_LENGTH] for _ in range(batch_size)]
    return torch.stack(rows)


def kept(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


@pytest.mark.parametrize("press_name", PRESSES)
@pytest.mark.parametrize("name, num_key_value_heads", [("gqa", 2), ("mha", 4), ("mqa", 1)])
def test_press_keeps_what_it_keeps_on_llama(press_name, name, num_key_value_heads, works_with):
    """The zoo model built from a Llama's weights: after the same prefill under the same press, every layer keeps the
    same keys and values (hence the same tokens), and the next token's logits agree."""
    llama = tiny_llama(num_key_value_heads)
    zoo = from_llama(llama, variant=name)
    input_ids = prompt()
    llama_cache, llama_logits = prefill(llama, make_press(press_name), input_ids)
    zoo_cache, zoo_logits = prefill(zoo, make_press(press_name), input_ids)
    expected_length = int(PROMPT_LENGTH * 0.5)
    for (zoo_keys, zoo_values), (keys, values) in zip(kept(zoo_cache), kept(llama_cache), strict=True):
        assert keys.shape[-2] == expected_length + 1  # the compressed prompt, then the decoded token
        torch.testing.assert_close(zoo_keys, keys, atol=ATOL, rtol=0)
        torch.testing.assert_close(zoo_values, values, atol=ATOL, rtol=0)
    torch.testing.assert_close(zoo_logits, llama_logits, atol=ATOL, rtol=0)
    works_with("kvpress", name)


@pytest.mark.parametrize("name", STATE_VARIANTS)
def test_press_on_a_state_variant_refuses_saying_why(name, works_with):
    """A state variant has no per-token keys and values to evict: entering the press fails at once, naming the
    reason; a client reading its cache layers directly is refused by the layers too."""
    model = tiny_model(name).eval()
    with pytest.raises(AttributeError, match="kvpress.*running state per layer"), torch.no_grad():
        with make_press("knorm")(model):
            pytest.fail("the press was entered")
    cache = model.model.make_cache()
    model(torch.randint(3, VOCAB_SIZE, (1, 16)), cache=cache)
    with pytest.raises(AttributeError, match="running state"):
        _ = cache.layers[0].keys
    works_with("kvpress", name, refused=kv_compression_refusal(model.model.attention_class, model.config))


def llama_like(num_key_value_heads: int = 2, **changes):
    """`tiny_llama`'s config with `changes` (head count, depth), freshly initialised."""
    config = tiny_llama(num_key_value_heads).config
    for name, value in changes.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.set_attn_implementation("sdpa")
    return model.eval()


def zoo_with_llama_weights(llama, name: str, **fields):
    """Variant `name` (`fields` its own settings) with a Llama's backbone and weights: its projections are Llama's."""
    shared = {field: getattr(llama.config, field) for field in SHARED_FIELDS}
    shared["rope_parameters"] = dict(llama.config.rope_parameters)
    config = VARIANTS[name].config(**shared, **LLAMA_BACKBONE, hidden_dropout=0.0, scale_residual_init=False, **fields)
    model = VARIANTS[name].causal_lm_class(config)
    model.load_state_dict(llama.state_dict(), strict=True)
    return model.eval()


def assert_keeps_the_same(cache, reference_cache, expected_length: int = int(PROMPT_LENGTH * 0.5)) -> None:
    for (keys, values), (reference_keys, reference_values) in zip(kept(cache), kept(reference_cache), strict=True):
        assert reference_keys.shape[-2] == expected_length + 1  # the compressed prompt, then the decoded token
        torch.testing.assert_close(keys, reference_keys, atol=ATOL, rtol=0)
        torch.testing.assert_close(values, reference_values, atol=ATOL, rtol=0)


@pytest.mark.parametrize("press_name", PRESSES)
def test_press_on_single_head_keeps_what_it_keeps_on_one_head_llama(press_name, works_with):
    """One head as wide as the model (Llama with num_attention_heads=1): the same keys, values and logits."""
    llama = llama_like(1, num_attention_heads=1, head_dim=64)
    zoo = from_llama(llama)
    assert zoo.config.model_type == "zoo_single_head"
    zoo_cache, zoo_logits = prefill(zoo, make_press(press_name), prompt())
    llama_cache, llama_logits = prefill(llama, make_press(press_name), prompt())
    assert_keeps_the_same(zoo_cache, llama_cache)
    torch.testing.assert_close(zoo_logits, llama_logits, atol=ATOL, rtol=0)
    works_with("kvpress", "single_head")


@pytest.mark.parametrize("press_name", PRESSES)
def test_press_on_sliding_window_keeps_what_it_keeps_on_mistral(press_name, works_with):
    """A window of 16 over a 40-token prompt (the window bites in the prefill, whose output the presses score):
    the same keys, values and next-token logits as `MistralForCausalLM` with the same window and weights. After the
    press both cache all kept tokens in one full layer (kvpress passes `DynamicCache()`), so the decode step masks
    by cache slot as transformers' sliding-window mask does; the zoo follows Mistral there too."""
    llama = tiny_llama(2)
    fields = {k: v for k, v in llama.config.to_dict().items() if k in MistralConfig().to_dict()}
    mistral = MistralForCausalLM(MistralConfig(**{**fields, "model_type": "mistral", "sliding_window": 16}))
    mistral.load_state_dict(llama.state_dict(), strict=True)
    mistral.set_attn_implementation("sdpa")
    zoo = zoo_with_llama_weights(llama, "sliding_window", sliding_window=16)
    assert PROMPT_LENGTH > 2 * zoo.config.sliding_window  # the prefill takes the banded kernel
    zoo_cache, zoo_logits = prefill(zoo, make_press(press_name), prompt())
    mistral_cache, mistral_logits = prefill(mistral.eval(), make_press(press_name), prompt())
    assert_keeps_the_same(zoo_cache, mistral_cache)
    torch.testing.assert_close(zoo_logits, mistral_logits, atol=ATOL, rtol=0)
    works_with("kvpress", "sliding_window")


@pytest.mark.parametrize("press_name", PRESSES)
def test_press_on_topk_keeps_what_it_keeps_on_llama(press_name, works_with):
    """Top-k built from a one-layer Llama: its queries, keys and values are Llama's (one layer, so no earlier top-k
    output feeds them), and each press keeps exactly Llama's keys and values. k = 24 of 40 bites in the prefill (its
    logits differ from Llama's); the decode step sees 21 kept keys, all within k, so top-k's own attention over the
    kept cache is softmax attention, and its logits are Llama's."""
    llama = llama_like(2, num_hidden_layers=1)
    zoo = zoo_with_llama_weights(llama, "topk", topk=24, query_chunk_size=8)
    input_ids = prompt()
    with torch.no_grad():
        assert not torch.allclose(zoo(input_ids).logits, llama(input_ids).logits, atol=1e-3)  # the selection bites
    zoo_cache, zoo_logits = prefill(zoo, make_press(press_name), input_ids)
    llama_cache, llama_logits = prefill(llama, make_press(press_name), input_ids)
    assert_keeps_the_same(zoo_cache, llama_cache)
    torch.testing.assert_close(zoo_logits, llama_logits, atol=ATOL, rtol=0)
    works_with("kvpress", "topk")


@pytest.mark.parametrize("press_name", PRESSES)
@pytest.mark.parametrize("name", ["additive", "bigbird", "differential", "mla"])
def test_press_on_a_variant_it_cannot_be_faithful_to_refuses_saying_why(name, press_name, works_with):
    """Additive scores, differential's two maps and MLA's latent are not the attention the presses rebuild from
    `q_proj` and the rotary embedding, and BigBird places its cached keys by slot, which evicting shifts: entering the
    press fails at once, before any token runs, with the variant's reason."""
    model = tiny_model(name)
    reason = kv_compression_refusal(model.model.attention_class, model.config)
    assert reason and "\n" not in reason
    with pytest.raises(AttributeError, match="kvpress") as refusal, torch.no_grad():
        with make_press(press_name)(model):
            pytest.fail("the press was entered")
    assert reason in str(refusal.value)
    works_with("kvpress", name, refused=reason)


@pytest.mark.parametrize("position", ["alibi", "learned"])
def test_press_on_a_model_without_rope_refuses_saying_why(position):
    model = tiny_model("gqa", position)
    with pytest.raises(AttributeError, match=f"position_embedding_type='{position}'"), torch.no_grad():
        with make_press("expected_attention")(model):
            pytest.fail("the press was entered")
