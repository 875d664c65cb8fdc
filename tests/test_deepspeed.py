"""DeepSpeed ZeRO-2 and ZeRO-3 through `accelerate launch` and the Trainer: 2 processes train like 1 process on the
same global batch, and the final model is an ordinary safetensors checkpoint.

Runs on CPUs (DeepSpeed's CPU accelerator, gloo) as well as GPUs. The first launch on a machine JIT-compiles
DeepSpeed's shared-memory communication op (about a minute on 2 cores; cached under ~/.cache/torch_extensions)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "deepspeed", reason='needs DeepSpeed: DS_BUILD_OPS=0 pip install -e ".[deepspeed]" (the extra; not in dev)'
)

from transformers import AutoModelForCausalLM  # noqa: E402

from conftest import free_port

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "train" / "tiny_gqa.yaml"
STEPS = 12
PER_DEVICE = 8  # the recipe's; 2 processes x 8 = the single process's batch of 16
COMMON = ["--training.max_steps", str(STEPS), "--training.logging_steps", "1", "--training.report_to", "none"]
RESUME = ["--training.resume_from_checkpoint", "latest"]


def environment() -> dict[str, str]:
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed would otherwise look for CUDA first
    return env


def train(output_dir: Path, *arguments: str, launcher: list[str]) -> dict:
    # from the repository root, as the README launches: zero3_lean.yaml names its DeepSpeed JSON relative to it
    command = [*launcher, str(ROOT / "training" / "train.py"), str(TINY), "--training.output_dir", str(output_dir)]
    result = subprocess.run(
        [*command, *arguments], capture_output=True, text=True, cwd=ROOT, env=environment(), timeout=900
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((output_dir / "training_summary.json").read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, dict]:
    """The initial weights every run starts from, and one process trained on the global batch of two.

    The runs load the same initial checkpoint (`model.init_from`) instead of each building a fresh model: under ZeRO-3
    the model is built inside `deepspeed.zero.Init`, whose initialisation draws other random numbers (rank 0
    initialises each gathered module; torch's default init at construction is skipped), so a fresh model is as
    good but not the same, and its losses could not be compared step by step."""
    folder = tmp_path_factory.mktemp("deepspeed")
    python = [sys.executable]
    train(folder / "initial", "--training.max_steps", "0", "--training.report_to", "none", launcher=python)
    initial = folder / "initial" / "final"
    single = train(
        folder / "single",
        "--model.init_from",
        str(initial),
        "--training.per_device_train_batch_size",
        str(2 * PER_DEVICE),
        *COMMON,
        launcher=python,
    )
    return initial, single


def zero_run(stage: str, run: Path, initial: Path, *arguments: str) -> dict:
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
    launcher += [str(ROOT / "configs" / "accelerate" / f"{stage}.yaml"), "--main_process_port", str(free_port())]
    summary = train(run, "--model.init_from", str(initial), *COMMON, *arguments, launcher=launcher)
    assert summary["world_size"] == 2 and summary["distributed"] == "DEEPSPEED"
    return summary


def assert_same_losses(summary: dict, single: dict, stage: str) -> None:
    assert summary["train_tokens"] == single["train_tokens"] == STEPS * 2 * PER_DEVICE * 64
    torch.testing.assert_close(
        torch.tensor(summary["losses"]), torch.tensor(single["losses"]), rtol=0, atol=1e-4, msg=stage
    )


# Of one process's parameter and optimizer bytes (parameters, a third; Adam's two moments, two thirds) each of 2
# ranks holds: ZeRO-2 the whole parameters, half the moments and an fp32 master copy of its half of the parameters
# (1/3 + 1/3 + 1/6); ZeRO-3 half of everything (with fp32 parameters its master copy is the shard itself).
STATE_SHARE = {"zero2": 1 / 3 + 1 / 6 + 1 / 3, "zero3": 1 / 2, "zero3_lean": 1 / 2}


@pytest.mark.parametrize("stage", ["zero2", "zero3", "zero3_lean"])
def test_zero_on_two_processes_trains_like_one(stage, reference, tmp_path):
    initial, single = reference
    summary = zero_run(stage, tmp_path / stage, initial)
    assert_same_losses(summary, single, stage)
    assert summary["parameters"] == single["parameters"]  # counted whole under ZeRO-3 too (ds_numel)
    whole = single["memory_per_process"][0]["parameters_and_optimizer_bytes"]
    for entry in summary["memory_per_process"]:
        assert entry["parameters_and_optimizer_bytes"] == pytest.approx(STATE_SHARE[stage] * whole, rel=1e-3)
    # the final model is gathered into one safetensors file that loads without DeepSpeed: no ZeRO shards beside it
    final = Path(summary["final_model"])
    assert (final / "model.safetensors").is_file() and not list(final.glob("global_step*"))
    model, info = AutoModelForCausalLM.from_pretrained(final, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    expected = AutoModelForCausalLM.from_pretrained(single["final_model"]).state_dict()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-4, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_a_zero_run_resumed_continues_the_same_trajectory(stage, reference, tmp_path):
    initial, single = reference
    run = tmp_path / stage
    zero_run(stage, run, initial, "--training.save_steps", str(STEPS // 2))
    assert list((run / f"checkpoint-{STEPS // 2}").glob("global_step*"))  # DeepSpeed's own sharded checkpoint
    # as if the run had stopped after the middle checkpoint: the later one, the summary and the final model gone
    for leftover in [run / f"checkpoint-{STEPS}", run / "final"]:
        shutil.rmtree(leftover)
    (run / "training_summary.json").unlink()
    resumed = zero_run(stage, run, initial, "--training.save_steps", str(STEPS // 2), *RESUME)
    assert_same_losses(resumed, single, stage)
