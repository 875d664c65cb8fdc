"""FSDP2 on CPU: `accelerate launch --config_file configs/accelerate/fsdp_cpu.yaml` shards the model over 2 gloo
processes, trains the same loss trajectory as one process on the same global batch, and saves a plain checkpoint."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import assert_loads_without_the_package, free_port

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "train" / "tiny_gqa.yaml"
FSDP_CPU = ROOT / "configs" / "accelerate" / "fsdp_cpu.yaml"
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]
PER_DEVICE = 8  # the tiny recipe's batch; one process takes both ranks' batches at once
TOLERANCE = 1e-4  # fp32: the sharded run sums the same gradients in another order


def single_process(output_dir: Path, *overrides) -> dict:
    """The baseline: one process on the global batch of the 2-process run (accelerate hands global batch i's first
    half to rank 0 and its second half to rank 1, so both see the same blocks in the same order). A fresh process,
    as the sharded ranks are: nothing earlier tests left in this one can shift its numbers."""
    command = [sys.executable, str(ROOT / "training" / "train.py"), str(TINY), *common_overrides(output_dir)]
    command += ["--training.per_device_train_batch_size", str(2 * PER_DEVICE), *map(str, overrides)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=output_dir.parent, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((output_dir / "training_summary.json").read_text())


def common_overrides(output_dir: Path) -> list[str]:
    return ["--training.output_dir", str(output_dir), "--training.report_to", "none"]


def sharded(output_dir: Path, port: int, *overrides, launcher: list[str] | None = None) -> dict:
    """2 processes sharded by FSDP2 over gloo, launched as a user would (accelerate's FSDP config by default)."""
    launcher = launcher or [*ACCELERATE, "--config_file", str(FSDP_CPU), "--main_process_port", str(port)]
    command = [
        *launcher,
        str(ROOT / "training" / "train.py"),
        str(TINY),
        *common_overrides(output_dir),
        "--training.per_device_train_batch_size",
        str(PER_DEVICE),
        *map(str, overrides),
    ]
    result = subprocess.run(command, capture_output=True, text=True, cwd=output_dir.parent, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((output_dir / "training_summary.json").read_text())
    # FSDP, not the DDP accelerate falls back to on CPUs: the state says so, and only FSDP writes its model file
    assert summary["world_size"] == 2 and summary["distributed"] == "FSDP"
    checkpoints = sorted(output_dir.glob("checkpoint-*"))
    assert checkpoints and all((path / "pytorch_model_fsdp.bin").is_file() for path in checkpoints)
    return summary


def assert_same_run(sharded_summary: dict, single_summary: dict, steps: int) -> None:
    losses, baseline = torch.tensor(sharded_summary["losses"]), torch.tensor(single_summary["losses"])
    assert len(losses) == len(baseline) == steps
    torch.testing.assert_close(losses, baseline, rtol=0, atol=TOLERANCE)
    assert sharded_summary["train_tokens"] == single_summary["train_tokens"]


def assert_same_logits(sharded_final: str, single_final: str) -> None:
    """The sharded run's final model is a plain safetensors checkpoint (gathered on save, no FSDP class or sources
    in it) that loads as any other and computes what the single-process model computes."""
    folder = Path(sharded_final)
    assert (folder / "model.safetensors").is_file() and not list(folder.glob("_fsdp*"))
    assert "FSDP" not in json.dumps(json.loads((folder / "config.json").read_text()).get("auto_map", {}))
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    baseline = AutoModelForCausalLM.from_pretrained(single_final).eval()
    ids = torch.randint(0, model.config.vocab_size - 2, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, baseline(ids).logits, rtol=0, atol=TOLERANCE)


def test_fsdp2_on_two_cpu_processes_matches_one_process(tmp_path):
    common = ["--training.max_steps", 6, "--training.save_steps", 6, "--training.logging_steps", 1]
    one = single_process(tmp_path / "single", *common)
    two = sharded(tmp_path / "sharded", free_port(), *common)
    assert_same_run(two, one, 6)
    assert_same_logits(two["final_model"], one["final_model"])
    # what sharding is for: each rank holds half the parameters and Adam state one process holds (all but Adam's
    # step counters, one scalar per parameter on every rank)
    whole = one["memory_per_process"][0]["parameters_and_optimizer_bytes"]
    for entry in two["memory_per_process"]:
        assert entry["parameters_and_optimizer_bytes"] == pytest.approx(whole / 2, rel=1e-3)
    assert_loads_without_the_package(two["final_model"], tmp_path)


@pytest.mark.slow
def test_a_sharded_run_resumed_continues_the_same_trajectory(tmp_path):
    common = ["--training.max_steps", 12, "--training.save_steps", 6, "--training.logging_steps", 1]
    one = single_process(tmp_path / "single", *common)
    run = tmp_path / "sharded"
    sharded(run, free_port(), *common)
    # as if the run had stopped after checkpoint-6: its later checkpoint, summary and final model gone
    for leftover in [run / "checkpoint-12", run / "final"]:
        subprocess.run(["rm", "-rf", str(leftover)], check=True)
    (run / "training_summary.json").unlink()
    resumed = sharded(run, free_port(), *common, "--training.resume_from_checkpoint", "latest")
    assert_same_run(resumed, one, 12)
    assert_same_logits(resumed["final_model"], one["final_model"])


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["gqa", "sliding_window", "linformer", "aft_simple", "topk", "additive"])
def test_every_family_shards(tmp_path, variant):
    common = ["--model.variant", variant, "--training.max_steps", 8, "--training.save_steps", 8]
    common += ["--training.logging_steps", 1]
    one = single_process(tmp_path / "single", *common)
    two = sharded(tmp_path / "sharded", free_port(), *common)
    assert_same_run(two, one, 8)
    assert_same_logits(two["final_model"], one["final_model"])


@pytest.mark.slow
def test_the_trainers_own_fsdp_option_under_torchrun_shards_too(tmp_path):
    """No accelerate config: torchrun and the Trainer's `fsdp: true` (FSDP2, wrapped per decoder layer by the
    model's `_no_split_modules`) shard the same."""
    common = ["--training.max_steps", 6, "--training.save_steps", 6, "--training.logging_steps", 1]
    one = single_process(tmp_path / "single", *common)
    port = free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port)]
    two = sharded(tmp_path / "sharded", port, *common, "--training.fsdp", "true", launcher=torchrun)
    assert_same_run(two, one, 6)
    assert_same_logits(two["final_model"], one["final_model"])


@pytest.mark.slow
def test_sharded_compares_engines_with_one_process(tmp_path):
    """`python -m experiments sharded` at a tiny size: rows for one process, DDP and FSDP2, the losses equal, FSDP2's
    parameter and optimizer bytes half of DDP's; ZeRO rows say what they need where DeepSpeed is missing."""
    from experiments.__main__ import main as run_experiment

    arguments = ["sharded", "--engines", "ddp", "fsdp2", "--steps", "3", "--hidden_size", "32"]
    arguments += ["--num_hidden_layers", "1", "--num_attention_heads", "2", "--num_key_value_heads", "1"]
    arguments += ["--intermediate_size", "64", "--vocab_size", "300", "--block_size", "32"]
    assert run_experiment([*arguments, "--runs_dir", str(tmp_path / "runs"), "--output_dir", str(tmp_path)]) == 0
    rows = {row["engine"]: row for row in json.loads((tmp_path / "sharded.json").read_text())["rows"]}
    assert list(rows) == ["1 process", "ddp", "fsdp2"]
    assert all(row["losses_equal"] and row["max_loss_difference"] <= 1e-4 for row in rows.values())
    whole = rows["1 process"]["parameters_and_optimizer_mb"]
    assert rows["ddp"]["parameters_and_optimizer_mb"] == pytest.approx(whole)  # DDP: every rank holds it all
    assert rows["fsdp2"]["vs_ddp"]["parameters_and_optimizer"] == pytest.approx(0.5, rel=1e-2)
    assert rows["fsdp2"]["checkpoint"].startswith("FSDP") and "final: model.safetensors" in rows["fsdp2"]["checkpoint"]
    assert "| fsdp2 |" in (tmp_path / "sharded.md").read_text()
