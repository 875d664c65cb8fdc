"""The exporters, run for real on every registered variant: ExecuTorch's static-cache recipe (transformers'
`TorchExportableModuleForDecoderOnlyLM`), `torch.export` with a dynamic batch and length, and ONNX through
`torch.onnx.export(dynamo=True)` run in onnxruntime.

Each exported program is run at several shapes and compared with the eager model: a program specialised to the
example's shape would fail there, so a silently fixed shape cannot pass. Variants that decode from a running state
(Linformer, AFT) cannot be exported with a static key/value cache; the test asserts their refusal is clear and comes
before tracing reaches a layer.
"""

import pytest
import torch
from torch.export import Dim

from hf_attn_zoo.models import VARIANTS
from hf_attn_zoo.models.clients_zoo import config_shaped_cache_refusal

from conftest import CONFORMANCE, tiny_config, tiny_model

NAMES = [name for name in VARIANTS if name in CONFORMANCE]
ATOL = 1e-4  # an exported graph runs other kernels (dense instead of chunked, fused decompositions)
SHAPES = [(1, 5), (3, 13), (2, 40)]  # (batch, length): lengths below, at and past every chunk and window size


def decodes_from_state(name: str) -> bool:
    return VARIANTS[name].causal_lm_class.base_model_class.attention_class.decodes_from_state()


class Logits(torch.nn.Module):
    """The causal LM's forward without a cache, returning the logits: what `torch.export` and ONNX trace."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def padded_inputs(batch: int, length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens, the last row left-padded by a third of the length."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 97, (batch, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[-1, : length // 3] = 0
    return input_ids, attention_mask


def dynamic_shapes():
    batch, length = Dim("batch", min=1, max=64), Dim("length", min=2, max=64)
    return {"input_ids": {0: batch, 1: length}, "attention_mask": {0: batch, 1: length}}


def max_error_on_real_tokens(expected: torch.Tensor, actual: torch.Tensor, attention_mask: torch.Tensor) -> float:
    # padding queries' outputs are never used, and kernels are free to differ there
    return (expected - actual)[attention_mask.bool()].abs().max().item()


def executorch_module(model, max_cache_len: int = 32):
    from transformers import GenerationConfig
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    model.generation_config = GenerationConfig(
        use_cache=True,
        cache_implementation="static",
        max_length=max_cache_len,
        cache_config={"batch_size": 1, "max_cache_len": max_cache_len},
    )
    return TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=max_cache_len)


def preallocation_refused(name: str) -> bool:
    """Whether the variant's keys and values (at the tiny test config) differ from the config's head shapes, which a
    static cache allocated before the first write assumes (state variants refuse every key/value cache)."""
    attention = VARIANTS[name].attention_class
    return not attention.decodes_from_state() and config_shaped_cache_refusal(attention, tiny_config(name)) is not None


@pytest.mark.parametrize(
    "name", [name for name in NAMES if not decodes_from_state(name) and not preallocation_refused(name)]
)
def test_executorch_static_cache_decodes_as_eager(name, works_with):
    model = tiny_model(name)
    program = executorch_module(model).export(input_ids=torch.tensor([[5]]), cache_position=torch.tensor([0]))
    input_ids = torch.tensor([[5, 7, 9, 11, 13, 2, 40, 41, 60, 3, 8, 90]])  # past every chunk and window size
    with torch.no_grad():
        expected = model(input_ids, use_cache=False).logits[0]  # (T, vocab)
    for step in range(input_ids.shape[1]):  # one token at a time, the cache inside the program
        logits = program.module()(input_ids=input_ids[:, step : step + 1], cache_position=torch.tensor([step]))
        torch.testing.assert_close(logits[0, -1], expected[step], atol=ATOL, rtol=0)
    works_with("executorch", name)


@pytest.mark.parametrize("name", [name for name in NAMES if decodes_from_state(name)])
def test_executorch_static_cache_refuses_state_variants(name, works_with):
    model = tiny_model(name)
    module = executorch_module(model)  # wrapping does not call the model
    reason = "decodes from a running state per layer"
    # the recipe's export (strict, through dynamo): the model's refusal is the error reported
    with pytest.raises(Exception, match=reason) as raised:
        module.export(input_ids=torch.tensor([[5]]), cache_position=torch.tensor([0]))
    assert "use_cache=False" in str(raised.value)
    # without dynamo's wrapping, the model's own error: raised before any layer runs
    with pytest.raises(TypeError, match=reason):
        module.export(input_ids=torch.tensor([[5]]), cache_position=torch.tensor([0]), strict=False)
    works_with(
        "executorch",
        name,
        refused="decodes from a running state, which a static key/value cache cannot hold; export without a cache",
    )


@pytest.mark.parametrize("name", [name for name in NAMES if preallocation_refused(name)])
def test_executorch_static_cache_refuses_other_widths(name, works_with):
    """A cache the recipe allocates from the config's head shapes before the first forward cannot hold this variant's
    (MLA: a latent and a RoPE key of their own widths): the export reports why and what to do instead."""
    model = tiny_model(name)
    reason = config_shaped_cache_refusal(model.model.attention_class, model.config)
    with pytest.raises(Exception, match="must size itself from its first write") as raised:
        executorch_module(model).export(input_ids=torch.tensor([[5]]), cache_position=torch.tensor([0]))
    assert reason in str(raised.value) and "use_cache=False" in str(raised.value)
    works_with(
        "executorch",
        name,
        refused="it caches a latent and a RoPE key of their own widths, which a static cache allocated at one "
        "head_dim cannot hold; export without a cache",
    )


@pytest.mark.parametrize("name", NAMES)
def test_torch_export_with_dynamic_batch_and_length(name, works_with):
    module = Logits(tiny_model(name))
    program = torch.export.export(
        module, (), dict(zip(("input_ids", "attention_mask"), padded_inputs(2, 9))), dynamic_shapes=dynamic_shapes()
    )
    for batch, length in SHAPES:
        input_ids, attention_mask = padded_inputs(batch, length, seed=length)
        with torch.no_grad():
            expected = module(input_ids, attention_mask)
            actual = program.module()(input_ids=input_ids, attention_mask=attention_mask)
        assert actual.shape == expected.shape
        assert max_error_on_real_tokens(expected, actual, attention_mask) <= ATOL
    works_with("export", name)


@pytest.mark.slow  # about 10 s a variant on 2 CPU cores
@pytest.mark.parametrize("name", NAMES)
def test_onnx_runs_in_onnxruntime_at_three_lengths(name, tmp_path, works_with):
    pytest.importorskip("onnx", reason="onnx is not installed")
    pytest.importorskip("onnxscript", reason="onnxscript is not installed (torch.onnx's dynamo exporter needs it)")
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed")
    module = Logits(tiny_model(name))
    path = tmp_path / f"{name}.onnx"
    program = torch.onnx.export(
        module, padded_inputs(2, 9), dynamo=True, dynamic_shapes=dynamic_shapes(), verbose=False
    )
    program.save(str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for graph_input in session.get_inputs():  # torch.onnx fixes a shape it could not keep dynamic: it must not
        assert all(isinstance(size, str) for size in graph_input.shape), (graph_input.name, graph_input.shape)
    for batch, length in SHAPES:
        input_ids, attention_mask = padded_inputs(batch, length, seed=length)
        with torch.no_grad():
            expected = module(input_ids, attention_mask)
        (logits,) = session.run(None, {"input_ids": input_ids.numpy(), "attention_mask": attention_mask.numpy()})
        assert logits.shape == tuple(expected.shape)
        assert max_error_on_real_tokens(expected, torch.from_numpy(logits), attention_mask) <= ATOL
    works_with("onnx", name)
