"""int8 weights (torchao) and a quantized key/value cache (optimum-quanto) on zoo models.

The int8-weight tests are the `torchao_test_*` functions. The dev set-up keeps torchao out of the interpreter (see
dev.py: transformers imports it whenever it is installed, and on a CPU-only torch it writes warnings), so
`test_int8_weights_with_torchao` runs them in a child pytest with dev.py's torchao folder on its path; they are
named so that this interpreter's pytest does not collect them itself.
"""

import copy
import importlib.machinery
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_attn_zoo import quantization
from hf_attn_zoo.quantization import int8_config, quantize_int8, quantized_cache_kwargs

from conftest import returned_cache
from test_integrations import byte_model

ROOT = Path(__file__).resolve().parents[1]
TORCHAO_SITE = Path(sys.prefix) / "torchao-site"  # where dev.py installs torchao


def relative_error(approximate: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approximate - exact).norm() / exact.norm())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # a larger init than the default makes the logits far from uniform, so quantization error is measurable
    model, tokenizer = byte_model("gqa", hidden_size=64, initializer_range=0.2)
    folder = tmp_path_factory.mktemp("fp32")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, model.eval(), tokenizer


def test_int8_weights_with_torchao(tmp_path):
    env = dict(os.environ)
    if TORCHAO_SITE.is_dir():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TORCHAO_SITE), env.get("PYTHONPATH")]))
    if importlib.machinery.PathFinder.find_spec("torchao", [str(TORCHAO_SITE), *sys.path]) is None:
        pytest.skip('torchao is not installed: pip install -e ".[quant]" in a clone, or set up with dev.py')
    result = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-o", "python_functions=torchao_test_*", "-p", "no:cacheprovider"]
        + ["-q", f"--basetemp={tmp_path}"],
        cwd=ROOT,  # the repository's pytest settings and conftest.py
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    # every int8 test ran: none skipped or deselected (e.g. torchao missing from the child after all)
    assert "passed" in summary and "skipped" not in summary and "deselected" not in summary, result.stdout[-3000:]


@pytest.mark.parametrize("mode", ["weight_only", "dynamic"])
def torchao_test_int8_weights_through_from_pretrained(checkpoint, mode):
    folder, fp32, tokenizer = checkpoint
    inputs = tokenizer(["int8 weights", "a second, longer prompt"], return_tensors="pt", padding=True)
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=int8_config(mode)).eval()
    linear = model.model.layers[0].mlp.up_proj.weight
    assert linear.dtype == torch.float32 and "Int8" in type(linear).__name__  # int8 storage behind a float API
    assert type(model.lm_head.weight) is torch.nn.Parameter  # the head stays full precision
    with torch.no_grad():
        quantized, exact = model(**inputs).logits, fp32(**inputs).logits
        in_place = quantize_int8(copy.deepcopy(fp32), mode)(**inputs).logits
    error = relative_error(quantized, exact)
    assert 0 < error < 0.1, error  # really quantized, and close (a few % on this deliberately sharp tiny model)
    torch.testing.assert_close(in_place, quantized, rtol=0, atol=0)  # the two routes are the same quantization
    assert model.generate(**inputs, max_new_tokens=4, do_sample=False).shape[1] == inputs.input_ids.shape[1] + 4


def torchao_test_int8_latent_attention_decodes_as_its_uncached_forward():
    """MLA's absorbed decoding folds `kv_b_proj`'s weight into the query; an int8 weight is no plain matrix, so the
    quantized model decodes through the expanded path, still equal to its own uncached forward."""
    model, tokenizer = byte_model("mla", hidden_size=64, initializer_range=0.2)
    quantized = quantize_int8(model.eval(), "weight_only")
    attention = quantized.model.layers[0].self_attn
    assert "Int8" in type(attention.kv_b_proj.weight).__name__ and not attention.up_projection_folds(
        torch.device("cpu")
    )
    input_ids = tokenizer(["latent int8"], return_tensors="pt").input_ids
    with torch.no_grad():
        generated = quantized.generate(input_ids, max_new_tokens=5, do_sample=False)
        for step in range(input_ids.shape[1], generated.shape[1]):  # each token is the uncached argmax
            expected = quantized(generated[:, :step], use_cache=False).logits[0, -1].argmax()
            assert generated[0, step] == expected


def torchao_test_int8_checkpoint_round_trip(checkpoint, tmp_path):
    folder, _, tokenizer = checkpoint
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=int8_config()).eval()
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    inputs = tokenizer(["saved in int8"], return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**inputs).logits, model(**inputs).logits, rtol=0, atol=0)
    assert sum(f.stat().st_size for f in tmp_path.glob("*.safetensors")) < 0.6 * sum(
        f.stat().st_size for f in folder.glob("*.safetensors")
    )


def test_quantized_key_value_cache(checkpoint):
    pytest.importorskip("optimum.quanto")
    _, fp32, tokenizer = checkpoint
    inputs = tokenizer(["a prompt longer than the residual length of the cache"], return_tensors="pt")
    settings = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
    exact = fp32.generate(**inputs, **settings)
    errors = {}
    for nbits in (2, 4):
        quantized = fp32.generate(**inputs, **settings, **quantized_cache_kwargs(fp32, nbits, residual_length=8))
        assert type(returned_cache(quantized)).__name__ == "QuantizedCache"
        # the prompt's keys and values went through `nbits` integers: the first decoded step's scores move
        errors[nbits] = relative_error(quantized.scores[1], exact.scores[1])
    assert 0 < errors[4] < errors[2] and errors[4] < 0.3, errors  # more bits, closer to float32


def test_quantization_errors(checkpoint):
    _, fp32, _ = checkpoint
    with pytest.raises(ValueError, match="mode='int4'"):
        int8_config("int4")
    with pytest.raises(ValueError, match="nbits=8"):
        quantized_cache_kwargs(fp32, nbits=8)
    state_model, tokenizer = byte_model("aft_simple")
    with pytest.raises(ValueError, match="decodes from a state"):
        state_model.generate(**tokenizer(["x"], return_tensors="pt"), max_new_tokens=2, **quantized_cache_kwargs(fp32))


@pytest.fixture
def unbuilt_quanto_extension(monkeypatch, tmp_path):
    """quanto's CPU extension as in a fresh installation: not loaded, and an empty build folder."""
    pytest.importorskip("optimum.quanto")
    extension = quantization._quanto_cpu_extension()
    monkeypatch.setattr(extension, "_lib", None)
    monkeypatch.setattr(extension, "build_directory", str(tmp_path / "build"))
    return extension


def test_a_quanto_build_is_announced_once(unbuilt_quanto_extension, checkpoint, monkeypatch, caplog):
    from optimum.quanto.library.extensions import extension as quanto_extension

    # the build itself is the library quanto already built in its own folder (test_quantized_key_value_cache builds
    # it on a fresh set-up): the minute-long real build is the slow test below
    built_directory = Path(quanto_extension.__file__).parent / "cpp" / "build"
    if not (built_directory / "pytorch_version.txt").is_file():
        pytest.skip("quanto's extension is not built in its own folder yet")
    real_load, loads = quanto_extension.load, []

    def load(**kwargs):
        loads.append(kwargs["name"])
        return real_load(**{**kwargs, "build_directory": str(built_directory)})

    monkeypatch.setattr(quanto_extension, "load", load)
    assert not quantization.quanto_cpu_extension_is_built()
    _, fp32, _ = checkpoint
    with caplog.at_level(logging.WARNING, logger="hf_attn_zoo.quantization"):
        quantized_cache_kwargs(fp32)
        quantized_cache_kwargs(fp32)
    notices = [r.getMessage() for r in caplog.records if "compiling its C++ extension" in r.getMessage()]
    assert len(notices) == 1 and "minutes" in notices[0], notices  # before the build, and once
    assert loads == ["quanto_cpp"] and unbuilt_quanto_extension._lib is not None


def test_a_missing_compiler_is_named_before_any_build(unbuilt_quanto_extension, checkpoint, monkeypatch):
    monkeypatch.setenv("CXX", "no-such-c++")  # torch's cpp_extension calls $CXX
    _, fp32, _ = checkpoint
    with pytest.raises(RuntimeError, match=r"'no-such-c\+\+'.* is not on PATH: install one .*apt-get install g\+\+"):
        quantized_cache_kwargs(fp32)
    assert not any(Path(unbuilt_quanto_extension.build_directory).glob("*.o"))  # nothing was compiled


@pytest.mark.slow
def test_a_real_quanto_build_is_announced(unbuilt_quanto_extension, checkpoint, caplog):
    """The real build (about 1.5 minutes on 2 cores), into an empty folder, then a quantized generation."""
    _, fp32, tokenizer = checkpoint
    with caplog.at_level(logging.WARNING, logger="hf_attn_zoo.quantization"):
        kwargs = quantized_cache_kwargs(fp32, residual_length=8)
    assert sum("compiling its C++ extension" in r.getMessage() for r in caplog.records) == 1
    assert quantization.quanto_cpu_extension_is_built()
    inputs = tokenizer(["a prompt longer than the residual length of the cache"], return_tensors="pt")
    generated = fp32.generate(**inputs, max_new_tokens=4, do_sample=False, **kwargs)
    assert generated.shape[1] == inputs.input_ids.shape[1] + 4
