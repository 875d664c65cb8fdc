"""Compiled training: `training.torch_compile: true` in a recipe trains through torch.compile (inductor) with the
losses of eager training, and every variant's training step compiles to one graph (no graph breaks)."""

import warnings
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters, warn_once_cache

from hf_attn_zoo.models import VARIANTS
from hf_attn_zoo.train import load_recipe, run_training

from conftest import ATOL, tiny_model

TINY = Path(__file__).resolve().parents[1] / "configs" / "train" / "tiny_gqa.yaml"


def test_a_recipe_with_torch_compile_trains_with_the_eager_losses(tmp_path):
    """The Trainer compiles the model when the recipe says so; three steps of AFT-simple (its chunked scan is the
    kind of kernel compilation is for) give eager's losses, and nothing falls back to Python between graphs."""
    losses = {}
    counters.clear()
    for compiled in ("false", "true"):
        overrides = ["--training.output_dir", str(tmp_path / compiled), "--training.report_to", "none"]
        overrides += ["--model.variant", "aft_simple", "--training.max_steps", "3", "--training.logging_steps", "1"]
        overrides += ["--training.eval_strategy", "no", "--training.torch_compile", compiled]
        losses[compiled] = run_training(*load_recipe(TINY, overrides))["losses"]
    assert len(losses["true"]) == 3
    torch.testing.assert_close(torch.tensor(losses["true"]), torch.tensor(losses["false"]), rtol=0, atol=ATOL)
    assert not counters["graph_break"], dict(counters["graph_break"])


def training_losses(model, input_ids: torch.Tensor, steps: int = 3) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = model(input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.slow  # about 30 s a variant on 2 CPU cores, most of it compiling
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_variant_trains_compiled_in_one_graph(name):
    """fullgraph=True: a graph break is an error, not a silent fallback. Three AdamW steps, compiled against eager."""
    torch._dynamo.reset()
    input_ids = torch.randint(3, 90, (2, 24), generator=torch.Generator().manual_seed(0))
    eager = training_losses(tiny_model(name).train(), input_ids)
    compiled = training_losses(torch.compile(tiny_model(name).train(), fullgraph=True), input_ids)
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=0, atol=ATOL)


def test_compiling_traces_no_cache_wrapper():
    """The zoo's transformers-signature probe is a constant to dynamo: tracing a `functools.cache` wrapper (as it
    once did) draws a dynamo warning at every compile. One graph, and the loss of eager."""
    model = tiny_model("gqa")
    input_ids = torch.arange(2 * 16).reshape(2, 16) % model.config.vocab_size  # (B, T)
    warn_once_cache.clear()  # dynamo warns once per process: an earlier compile must not hide a warning here
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(model, fullgraph=True)(input_ids, labels=input_ids).loss
    assert not [str(w.message) for w in caught if "lru_cache" in str(w.message)]
    torch.testing.assert_close(compiled, model(input_ids, labels=input_ids).loss, rtol=0, atol=ATOL)
