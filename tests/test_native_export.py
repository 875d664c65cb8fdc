"""`hf-attn-zoo export` to native transformers checkpoints and `hf-attn-zoo import` back, on every registered variant.

A variant whose attention class names a native architecture (`native_format`: Llama for the MHA family, Mistral for
the sliding window, DeepSeek-V3 for MLA) is exported, loaded by transformers with no remote code and compared with the
zoo model: logits within 1e-5 on an input longer than the sliding window, the same greedy tokens, and the same again
after importing the export back. Every other variant is refused up front with one line naming what it lacks, the
output folder untouched; the outcomes are the "native transformers export" column of the "Works with" table.
"""

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

from hf_attn_zoo.checkpoints import save_checkpoint
from hf_attn_zoo.convert.deepseek import from_deepseek, to_deepseek
from hf_attn_zoo.convert.latent import to_mla
from hf_attn_zoo.data import train_byte_level_bpe
from hf_attn_zoo.errors import UserError
from hf_attn_zoo.export import export_checkpoint, import_checkpoint
from hf_attn_zoo.models import VARIANTS

from conftest import CONFORMANCE, tiny_config

NAMES = [name for name in VARIANTS if name in CONFORMANCE]
LENGTH = 40  # ten times the tiny sliding window (4), and past 2w: the zoo takes its banded kernel there
TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n" * 4


@pytest.fixture(scope="module")
def tokenizer():
    return train_byte_level_bpe([TEXT], vocab_size=300)


def zoo_checkpoint(folder, name: str, tokenizer, seed: int = 0, **overrides):
    """A tiny zoo checkpoint of variant `name` with `tokenizer`, saved as the package saves every checkpoint."""
    torch.manual_seed(seed)
    config = tiny_config(name, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **overrides)
    model = VARIANTS[name].causal_lm_class(config).eval()
    return save_checkpoint(folder, model, tokenizer=tokenizer), model


def inputs(vocab_size: int, seed: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (2, LENGTH), generator=generator)


def assert_same_function(zoo, native) -> None:
    """Logits within 1e-5 on a batch longer than the window, and the same 16 greedy tokens."""
    ids = inputs(zoo.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(native(ids).logits, zoo(ids).logits, atol=1e-5, rtol=1e-5)
    prompt = ids[:1, :12]
    settings = dict(max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(native.generate(prompt, **settings), zoo.generate(prompt, **settings))


@pytest.mark.parametrize("name", NAMES)
def test_native_export_computes_the_zoo_function_or_is_refused(name, tokenizer, tmp_path, works_with):
    checkpoint, zoo = zoo_checkpoint(tmp_path / "zoo", name, tokenizer)
    out = tmp_path / "native"
    native_format = VARIANTS[name].attention_class.native_format
    if native_format is None:
        with pytest.raises(UserError) as refused:
            export_checkpoint(checkpoint, "native", out)
        message = str(refused.value)
        assert "\n" not in message and VARIANTS[name].model_type in message and "hf-attn-zoo serve" in message
        assert not out.exists()
        works_with("native", name, refused="no native transformers architecture computes its attention")
        return
    assert export_checkpoint(checkpoint, "native", out) == out
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == native_format and "auto_map" not in config  # nothing to trust
    assert not list(out.glob("*.py"))
    assert {"generation_config.json", "tokenizer.json", "README.md", "model.safetensors"} <= {
        path.name for path in out.iterdir()
    }
    native = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(native).__module__.startswith(f"transformers.models.{native_format}.")
    assert_same_function(zoo, native)
    text = "def add(a, b):"
    assert AutoTokenizer.from_pretrained(out)(text).input_ids == tokenizer(text).input_ids
    # and back: the export imported as a zoo checkpoint is the same model again
    back = import_checkpoint(out, tmp_path / "back")
    reimported = AutoModelForCausalLM.from_pretrained(back).eval()
    assert reimported.config.model_type == VARIANTS[name].model_type
    assert_same_function(zoo, reimported)
    works_with("native", name)


@pytest.mark.parametrize(
    ("name", "to", "overrides"),
    [
        ("gqa", "llama", {}),
        ("gqa", "qwen2", {"attention_bias": False}),
        ("sliding_window", "mistral", {}),
        ("mla", "deepseek_v3", {}),
    ],
)
def test_each_native_format_loads_without_the_package(name, to, overrides, tokenizer, tmp_path):
    """Each format in a process where hf_attn_zoo cannot be imported: transformers alone loads the export and
    reproduces the zoo's logits."""
    checkpoint, zoo = zoo_checkpoint(tmp_path / "zoo", name, tokenizer, **overrides)
    out = export_checkpoint(checkpoint, to, tmp_path / to, dtype="float32")
    ids = inputs(zoo.config.vocab_size)
    with torch.no_grad():
        expected = zoo(ids).logits
    torch.save(ids, tmp_path / "ids.pt")
    script = (
        "import sys, torch\n"
        "sys.modules['hf_attn_zoo'] = None  # importing it would fail\n"
        "from transformers import AutoModelForCausalLM\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(out)!r}).eval()\n"
        f"ids = torch.load({str(tmp_path / 'ids.pt')!r})\n"
        "with torch.no_grad():\n"
        f"    torch.save(model(ids).logits, {str(tmp_path / 'logits.pt')!r})\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path, timeout=600)
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, atol=1e-5, rtol=1e-5)


def test_qwen2_refuses_an_output_bias_and_mistral_the_mha_family(tokenizer, tmp_path):
    checkpoint, _ = zoo_checkpoint(tmp_path / "zoo", "gqa", tokenizer, attention_bias=True)
    with torch.no_grad():  # a trained output bias: nonzero
        model = AutoModelForCausalLM.from_pretrained(checkpoint)
        model.model.layers[0].self_attn.o_proj.bias.fill_(0.5)
    biased = save_checkpoint(tmp_path / "biased", model, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="o_proj has a nonzero bias"):
        export_checkpoint(biased, "qwen2", tmp_path / "qwen2")
    assert not (tmp_path / "qwen2").exists()
    with pytest.raises(UserError, match="mistral holds the sliding_window variant, not zoo_gqa"):
        export_checkpoint(checkpoint, "mistral", tmp_path / "mistral")
    assert export_checkpoint(biased, "llama", tmp_path / "llama").is_dir()  # Llama holds every bias


@pytest.mark.parametrize("to", ["llama", "gguf"])
def test_a_post_norm_model_is_refused_naming_the_field(to, tokenizer, tmp_path):
    """Llama and llama.cpp normalise each branch's input: a post-norm model (`norm_position="post"`) computes another
    function there, so the export stops before writing anything."""
    checkpoint, _ = zoo_checkpoint(tmp_path / "zoo", "gqa", tokenizer, norm_position="post")
    with pytest.raises(UserError, match="norm_position='post'") as refused:
        export_checkpoint(checkpoint, to, tmp_path / to)
    assert "\n" not in str(refused.value) and not (tmp_path / to).exists()


@pytest.mark.parametrize("rope", [None, 4])
def test_a_converted_mla_exports_to_deepseek_exactly(rope, tokenizer, tmp_path):
    """`convert --to mla` writes a latent without a norm and RoPE frequencies chosen per layer (all of them, or 2 of
    the 4 per head); DeepSeek-V3 computes the same function through a constant latent channel and the whole ladder.
    llama.cpp's deepseek2 has no bias for that channel: its GGUF is refused, naming the latent norm."""
    torch.manual_seed(0)
    config = tiny_config("gqa", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    parent = VARIANTS["gqa"].causal_lm_class(config).eval()
    converted = to_mla(parent, kv_lora_rank=8, qk_rope_head_dim=rope).eval()
    assert not converted.config.latent_norm and converted.config.rope_frequencies is not None
    checkpoint = save_checkpoint(tmp_path / "mla", converted, tokenizer=tokenizer)
    out = export_checkpoint(checkpoint, "native", tmp_path / "deepseek")
    native = AutoModelForCausalLM.from_pretrained(out).eval()
    assert native.config.model_type == "deepseek_v3"
    assert_same_function(converted, native)
    back = import_checkpoint(out, tmp_path / "back")
    assert_same_function(converted, AutoModelForCausalLM.from_pretrained(back).eval())
    with pytest.raises(UserError, match="latent_norm=False") as refused:
        export_checkpoint(checkpoint, "gguf", tmp_path / "gguf")
    assert "\n" not in str(refused.value) and not (tmp_path / "gguf").exists()


def test_deepseek_with_interleaved_rope_imports_exactly():
    """DeepSeek-V2's RoPE (and V3's with rope_interleave) pairs channels 2i and 2i + 1: the import reorders the rows
    producing them, so the zoo model computes the same logits."""
    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=12,
        q_lora_rank=None,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        first_k_dense_replace=2,
        n_routed_experts=1,
        num_experts_per_tok=1,
        n_group=1,
        topk_group=1,
        rope_interleave=True,
        initializer_range=0.2,
    )
    native = DeepseekV3ForCausalLM(config).eval()
    zoo = from_deepseek(native).eval()
    ids = inputs(97)
    with torch.no_grad():
        torch.testing.assert_close(zoo(ids).logits, native(ids).logits, atol=1e-5, rtol=1e-5)
        # and out again, now with rotate_half pairs
        torch.testing.assert_close(to_deepseek(zoo).eval()(ids).logits, native(ids).logits, atol=1e-5, rtol=1e-5)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hf_attn_zoo_cli", *args], capture_output=True, text=True, timeout=600
    )


def test_bad_input_exits_2_with_one_line_and_leaves_the_output_alone(tokenizer, tmp_path):
    checkpoint, _ = zoo_checkpoint(tmp_path / "linformer", "linformer", tokenizer)
    # a variant a format cannot hold: its name and what the format lacks
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run_cli("export", str(checkpoint), "--to", "llama", str(empty))
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip()
    assert "\n" not in line and "zoo_linformer" in line and "llama holds the MHA family" in line
    assert empty.is_dir() and not any(empty.iterdir())
    # a checkpoint without tokenizer files, to GGUF
    bare, _ = zoo_checkpoint(tmp_path / "bare", "gqa", tokenizer)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (bare / file).unlink(missing_ok=True)
    result = run_cli("export", str(bare), "--to", "gguf", str(tmp_path / "gguf"))
    assert result.returncode == 2 and "no tokenizer files" in result.stderr and "save_pretrained" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "gguf").exists()
    # an output folder that exists and holds something
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    result = run_cli("export", str(bare), "--to", "llama", str(taken))
    assert result.returncode == 2 and "exists and is not empty" in result.stderr
    assert [path.name for path in taken.iterdir()] == ["notes.txt"] and (taken / "notes.txt").read_text() == "mine"
    assert not list(tmp_path.glob(".*partial"))  # no staging folder left behind either


def test_cli_export_and_import_round_trip(tokenizer, tmp_path):
    checkpoint, zoo = zoo_checkpoint(tmp_path / "zoo", "sliding_window", tokenizer)
    result = run_cli("export", str(checkpoint), "--to", "native", str(tmp_path / "mistral"))
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "mistral" / "config.json").read_text())["sliding_window"] == 4
    result = run_cli("import", str(tmp_path / "mistral"), str(tmp_path / "zoo_again"))
    assert result.returncode == 0, result.stderr
    assert_same_function(zoo, AutoModelForCausalLM.from_pretrained(tmp_path / "zoo_again").eval())
