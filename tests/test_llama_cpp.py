"""`hf-attn-zoo export --to gguf`: the file llama.cpp reads, checked by llama.cpp itself.

Fast (the default suite, the `gguf` package only): a `llama` or `mamba` file is read back by transformers' own GGUF
loader, an independent reader that undoes llama.cpp's RoPE row order (llama) and its A = -exp(A_log) and squeezed
convolution (mamba), and computes the zoo's logits within 1e-5 at f32 and its 64 greedy tokens; its embedded
tokenizer tokenizes as the checkpoint's; every variant llama.cpp has no architecture for is refused up front with the
reason, the output folder untouched.

Slow (llama.cpp through llama-cpp-python, built once into a cached environment: experiments/speed/llama_cpp.py): for
every variant llama.cpp has an architecture for (the MHA family as `llama`, the sliding window as `granite_swa`, MLA as
`deepseek2`, Mamba as `mamba`), 64 greedy tokens from llama.cpp on the f32 file equal the zoo's `generate()` (for the
window, a prompt and a continuation far longer than it), llama.cpp tokenizes a few strings as the zoo's tokenizer does,
and its prompt logits match; q8_0's drift is measured (a loose bound asserted) and f16 loads and generates (gqa and
mamba). Why the window is not written as `llama` is measured too: llama.cpp's `llama` architecture, given the window's
weights, computes full causal attention, which leaves the window model's tokens once the prompt is longer than the
window.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_attn_zoo.checkpoints import save_checkpoint
from hf_attn_zoo.convert.gguf_writer import gguf_refusal, write_gguf
from hf_attn_zoo.data import train_byte_level_bpe
from hf_attn_zoo.errors import UserError
from hf_attn_zoo.export import export_checkpoint
from hf_attn_zoo.models import VARIANTS

from conftest import CONFORMANCE, tiny_config

pytest.importorskip("gguf", reason="the GGUF writer needs the `gguf` package (the [gguf] extra)")

NAMES = [name for name in VARIANTS if name in CONFORMANCE]
IN_LLAMA_CPP = [name for name in NAMES if VARIANTS[name].attention_class.gguf_architecture is not None]
TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0\n" * 8
STRINGS = ["def add(a, b):\n    return a + b", "héllo  wörld 123!", "   x = [1, 2]\n\n\tz", "a<|endoftext|>b"]
NEW_TOKENS = 64
# the llama.cpp architectures transformers' GGUF loader reads back (granite_swa and deepseek2 it does not)
READ_BY_TRANSFORMERS = ("llama", "mamba")


@pytest.fixture(scope="module")
def tokenizer():
    return train_byte_level_bpe([TEXT], vocab_size=320)


def zoo_checkpoint(folder, name: str, tokenizer, seed: int = 0, **overrides):
    """A tiny zoo checkpoint with `tokenizer`, long enough for the prompt and 64 new tokens."""
    torch.manual_seed(seed)
    fields = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, max_position_embeddings=128)
    config = tiny_config(name, **{**fields, **overrides})
    model = VARIANTS[name].causal_lm_class(config).eval()
    return save_checkpoint(folder, model, tokenizer=tokenizer), model


def prompt_ids(tokenizer) -> list[int]:
    return tokenizer("class Point:\n    x: int = 0\n").input_ids


def zoo_greedy(model, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    with torch.no_grad():
        output = model.generate(
            torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return output[0, len(prompt) :].tolist()


@pytest.mark.parametrize("name", NAMES)
def test_gguf_is_read_back_with_the_zoo_logits_or_refused(name, tokenizer, tmp_path, works_with):
    checkpoint, zoo = zoo_checkpoint(tmp_path / "zoo", name, tokenizer)
    out = tmp_path / "gguf"
    reason = gguf_refusal(zoo.config)
    if VARIANTS[name].attention_class.gguf_architecture is None:
        assert reason is not None
        with pytest.raises(UserError) as refused:
            export_checkpoint(checkpoint, "gguf", out)
        message = str(refused.value)
        assert "\n" not in message and VARIANTS[name].model_type in message and reason in message
        assert not out.exists() and not list(tmp_path.glob(".*partial"))
        works_with("llama_cpp", name, refused=reason)
        return
    path = export_checkpoint(checkpoint, "gguf", out, dtype="f32")
    assert path == out / "gguf.gguf" and (out / "README.md").is_file()
    architecture = VARIANTS[name].attention_class.gguf_architecture
    if architecture not in READ_BY_TRANSFORMERS:  # llama.cpp's own test of these files is slow
        from gguf import GGUFReader

        reader = GGUFReader(path)
        assert bytes(reader.fields["general.architecture"].parts[-1]).decode() == architecture
        sinks = zoo.config.num_hidden_layers if architecture == "granite_swa" else 0  # one sink vector per layer
        tied = 1 if zoo.config.tie_word_embeddings else 0
        assert len(reader.tensors) == len(zoo.state_dict()) - tied + sinks
        return
    # transformers' GGUF reader: an independent implementation of the format and of llama.cpp's RoPE row order
    loaded = AutoModelForCausalLM.from_pretrained(out, gguf_file=path.name).eval()
    ids = torch.randint(0, zoo.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, zoo(ids).logits, atol=1e-5, rtol=1e-5)
    prompt = prompt_ids(tokenizer)
    assert zoo_greedy(loaded, prompt) == zoo_greedy(zoo, prompt)
    embedded = AutoTokenizer.from_pretrained(out, gguf_file=path.name)
    for text in STRINGS:
        assert embedded(text).input_ids == tokenizer(text).input_ids, text


def test_q8_0_and_f16_files_are_smaller_and_a_mismatched_tokenizer_is_refused(tokenizer, tmp_path):
    checkpoint, zoo = zoo_checkpoint(tmp_path / "zoo", "gqa", tokenizer)
    sizes = {dtype: export_checkpoint(checkpoint, "gguf", tmp_path / dtype, dtype=dtype).stat().st_size
             for dtype in ("f32", "f16", "q8_0")}  # fmt: skip
    assert sizes["q8_0"] < sizes["f16"] < sizes["f32"]
    with pytest.raises(UserError, match="--dtype float16 does not apply to --to gguf"):
        export_checkpoint(checkpoint, "gguf", tmp_path / "bad", dtype="float16")
    from tokenizers import normalizers

    lowered = train_byte_level_bpe([TEXT], vocab_size=320)
    lowered.backend_tokenizer.normalizer = normalizers.Lowercase()
    with pytest.raises(ValueError, match="normalises text first"):
        write_gguf(zoo, lowered, tmp_path / "lowered.gguf")


# llama.cpp itself


@pytest.fixture(scope="module")
def llama_cpp():
    from experiments.speed.llama_cpp import LlamaCppUnavailable, llama_cpp_python

    try:
        return llama_cpp_python()
    except LlamaCppUnavailable as error:
        pytest.skip(f"llama-cpp-python cannot be built here: {error}")


@pytest.mark.slow
@pytest.mark.parametrize("name", IN_LLAMA_CPP)
def test_llama_cpp_generates_the_zoo_tokens(name, llama_cpp, tokenizer, tmp_path, works_with):
    from experiments.speed.llama_cpp import run_llama_cpp

    checkpoint, zoo = zoo_checkpoint(tmp_path / "zoo", name, tokenizer)
    prompt = prompt_ids(tokenizer)
    path = export_checkpoint(checkpoint, "gguf", tmp_path / "f32", dtype="f32")
    answer = run_llama_cpp(llama_cpp, path, prompt, NEW_TOKENS, strings=STRINGS, logits=True)
    assert answer["vocab"] == zoo.config.vocab_size
    for text in STRINGS:
        assert answer["tokens"][text] == tokenizer(text).input_ids, text
    with torch.no_grad():
        logits = zoo(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(torch.tensor(answer["logits"], dtype=torch.float32), logits, atol=1e-4, rtol=1e-4)
    assert answer["generated"] == zoo_greedy(zoo, prompt)
    works_with("llama_cpp", name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gqa", "mamba"])  # mamba: its convolution and A stay float32 as llama.cpp reads them
def test_llama_cpp_q8_0_drift_is_measured_and_f16_runs(name, llama_cpp, tokenizer, tmp_path):
    from experiments.speed.llama_cpp import run_llama_cpp

    checkpoint, zoo = zoo_checkpoint(tmp_path / "zoo", name, tokenizer)
    prompt = prompt_ids(tokenizer)
    expected = zoo_greedy(zoo, prompt)
    with torch.no_grad():
        logits = zoo(torch.tensor([prompt])).logits[0]
    drift = {}
    for dtype in ("f16", "q8_0"):
        path = export_checkpoint(checkpoint, "gguf", tmp_path / dtype, dtype=dtype)
        answer = run_llama_cpp(llama_cpp, path, prompt, NEW_TOKENS, logits=True)
        assert len(answer["generated"]) == NEW_TOKENS
        agreement = sum(a == b for a, b in zip(answer["generated"], expected)) / NEW_TOKENS
        first_difference = next((i for i, (a, b) in enumerate(zip(answer["generated"], expected)) if a != b), None)
        error = (torch.tensor(answer["logits"], dtype=torch.float32) - logits).abs()
        drift[dtype] = {"first_difference": first_difference, "mean": error.mean().item()}
        print(f"{dtype}: {agreement:.0%} of {NEW_TOKENS} greedy tokens equal (first difference at {first_difference}),"
              f" prompt logits |diff| max {error.max():.4f} mean {error.mean():.4f} (|logit| mean "
              f"{logits.abs().mean():.2f})")  # fmt: skip
    # loose: quantisation moves logits by a small fraction of their size, and the first tokens still agree
    for dtype, measured in drift.items():
        first = measured["first_difference"]
        assert measured["mean"] < 0.05 * logits.abs().mean() and (first is None or first >= 1), (dtype, measured)


@pytest.mark.slow
def test_llama_cpps_llama_architecture_ignores_the_sliding_window(llama_cpp, tokenizer, tmp_path):
    """Why the sliding window is written as `granite_swa`, not `llama`: its weights written as `llama` (a gqa model
    with the same state dict) make llama.cpp compute full causal attention, whose tokens leave the window model's
    past the window."""
    from experiments.speed.llama_cpp import run_llama_cpp

    _, windowed = zoo_checkpoint(tmp_path / "zoo", "sliding_window", tokenizer)
    fields = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, max_position_embeddings=128)
    full_config = tiny_config("gqa", **fields)  # the window's head counts, without the window
    full = VARIANTS["gqa"].causal_lm_class(full_config).eval()
    full.load_state_dict(windowed.state_dict())
    path = write_gguf(full, tokenizer, tmp_path / "window_as_llama.gguf", dtype="f32")
    prompt = prompt_ids(tokenizer)
    assert len(prompt) > windowed.config.sliding_window
    answer = run_llama_cpp(llama_cpp, path, prompt, NEW_TOKENS)
    assert answer["generated"] == zoo_greedy(full, prompt)  # full attention, exactly
    assert answer["generated"] != zoo_greedy(windowed, prompt)  # not the window's function
