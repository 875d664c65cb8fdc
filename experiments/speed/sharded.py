"""Sharded training (FSDP2; DeepSpeed ZeRO-2 and ZeRO-3, the latter also with small buckets) against DDP and against
one process: the same losses, the speed, and the memory each process needs.

Every run trains the same model from the same initial weights (saved once before any step: ZeRO-3 builds its model
under `deepspeed.zero.Init`, which draws other random numbers than a plain build) on the same global batches, through
`training/train.py` as a user launches it: `accelerate launch --config_file configs/accelerate/<engine>.yaml`, or
plain `python` for the single process, which takes the whole global batch at once. Reported per engine: the largest
difference of its losses from the single process's, training tokens/s relative to the single process, per process
(the largest over the ranks, from each run's `memory_per_process`) the resident set's peak over the training steps
and over the whole run, and the parameter and optimizer bytes the process holds, each relative to DDP; and the
checkpoint formats. All runs get `MALLOC_MMAP_THRESHOLD_` so that glibc hands freed blocks back at once and the
resident peak is the memory in use. The default model (gqa, 8 layers x 768, 52M parameters) is big enough for the
model's state to outweigh what the libraries themselves take (about 0.5 GB a process).

    python -m experiments sharded [--engines ddp fsdp2 zero2 zero3 zero3_lean] [--steps 20] [--output_dir DIR]

ZeRO-2/3 need DeepSpeed in this interpreter (`DS_BUILD_OPS=0 pip install -e ".[deepspeed]"`); without it their rows
say so. On a machine without GPUs the launches are gloo processes (DeepSpeed with `DS_ACCELERATOR=cpu`), in fp32.
"""

import argparse
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from experiments.common import REPOSITORY, Benchmark, Results, main, write_results

RECIPE = REPOSITORY / "configs" / "train" / "tiny_gqa.yaml"
TRAIN = REPOSITORY / "training" / "train.py"
ACCELERATE_CONFIGS = REPOSITORY / "configs" / "accelerate"
# engine -> (accelerate config on GPUs, on CPU processes, needs DeepSpeed)
ENGINES = {
    "ddp": ("multi_gpu.yaml", "multi_gpu.yaml", False),
    "fsdp2": ("fsdp.yaml", "fsdp_cpu.yaml", False),
    "zero2": ("zero2.yaml", "zero2.yaml", True),
    "zero3": ("zero3.yaml", "zero3.yaml", True),
    "zero3_lean": ("zero3_lean.yaml", "zero3_lean.yaml", True),
}
MEBIBYTE = 2**20
VALIDATION_CHARACTERS = 30_000  # about 70 blocks of 128 tokens
EQUAL_LOSSES = 1e-4  # fp32: the engines sum the same gradients in other orders
# per process, from the runs' memory_per_process: the resident peak over the training steps and over the whole of
# train() (engine set-up and checkpoint saves included), and the parameter and optimizer bytes held
MEMORY = ("step_peak_resident", "peak_resident", "parameters_and_optimizer")


@dataclass
class ShardedSetup(Results):
    """Sharded training (FSDP2, ZeRO-2/3) against DDP and one process: losses, tokens/s, memory per process."""

    engines: list[str] = field(default_factory=lambda: list(ENGINES), metadata={"help": f"of {list(ENGINES)}"})
    processes: int = field(default=2, metadata={"help": "processes of every sharded or DDP run"})
    steps: int = field(default=20, metadata={"help": "optimizer steps per run"})
    per_device_batch: int = field(default=4, metadata={"help": "blocks per process and step"})
    block_size: int = field(default=128, metadata={"help": "tokens per block"})
    hidden_size: int = field(default=768, metadata={"help": "the gqa model's width"})
    num_hidden_layers: int = field(default=8, metadata={"help": "its depth"})
    num_attention_heads: int = field(default=12, metadata={"help": "query heads"})
    num_key_value_heads: int = field(default=4, metadata={"help": "key/value heads"})
    intermediate_size: int = field(default=2048, metadata={"help": "MLP width"})
    vocab_size: int = field(default=2048, metadata={"help": "byte-level BPE trained on the recipe's text"})
    runs_dir: str = field(default=str(REPOSITORY / "runs" / "sharded"), metadata={"help": "training runs"})


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def environment() -> dict[str, str]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    if not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed would look for CUDA first
    return env


def model_config(setup: ShardedSetup) -> list[str]:
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size")
    return ["--model.config", json.dumps({key: getattr(setup, key) for key in keys})]


def validation_text(runs: Path) -> Path:
    """A short validation text, the start of `argparse`'s source (the training text may hold it too: the benchmark
    compares training losses, speed and memory, not validation scores): every run ends with an evaluation, which on
    the recipe's whole validation split would take longer than the training."""
    path = runs / "validation.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(Path(argparse.__file__).read_text()[:VALIDATION_CHARACTERS])
    return path


def overrides(setup: ShardedSetup, output_dir: Path, per_device_batch: int, steps: int, model: list[str]) -> list[str]:
    """The recipe's fields a run sets: its folder, steps and batch, the block and vocabulary, the short validation
    text, and the model (a config over the recipe's gqa, or `--model.init_from` weights)."""
    arguments = ["--training.output_dir", str(output_dir), "--training.report_to", "none"]
    arguments += ["--data.validation_files", str(validation_text(output_dir.parent))]
    arguments += ["--training.max_steps", str(steps), "--training.save_steps", str(max(steps, 1))]
    arguments += ["--training.logging_steps", "1", "--training.per_device_train_batch_size", str(per_device_batch)]
    arguments += ["--data.block_size", str(setup.block_size), "--data.vocab_size", str(setup.vocab_size)]
    return arguments + model


def train(launcher: list[str], arguments: list[str], output_dir: Path, log) -> dict:
    """One run, started afresh (a leftover run folder would be resumed, not measured)."""
    shutil.rmtree(output_dir, ignore_errors=True)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    command = [*launcher, str(TRAIN), str(RECIPE), *arguments]
    result = subprocess.run(command, capture_output=True, text=True, env=environment(), cwd=REPOSITORY)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-4000:]}")
    summary = json.loads((output_dir / "training_summary.json").read_text())
    log(f"{output_dir.name}: {summary['distributed']} x{summary['world_size']}, {summary['tokens_per_second']} tok/s")
    return summary


def checkpoint_format(output_dir: Path) -> str:
    """What the engine writes to resume from (its last checkpoint), and the final model's format."""
    checkpoint = max(output_dir.glob("checkpoint-*"), key=lambda path: int(path.name.split("-")[-1]))
    if list(checkpoint.glob("global_step*")):
        resume = "DeepSpeed ZeRO shards (global_stepN/)"
    elif (checkpoint / "pytorch_model_fsdp.bin").is_file():
        resume = "FSDP full state dict (pytorch_model_fsdp.bin)"
    else:
        resume = "model.safetensors + optimizer.pt"
    final = output_dir / "final" / "model.safetensors"
    return f"{resume}; final: {'model.safetensors' if final.is_file() else 'none'}"


def engine_row(name: str, summary: dict, single: dict, ddp: dict | None, output_dir: Path) -> dict:
    losses, baseline = summary["losses"], single["losses"]
    difference = max(abs(a - b) for a, b in zip(losses, baseline, strict=True))
    row = {
        "engine": name,
        "processes": summary["world_size"],
        "distributed": summary["distributed"],
        "max_loss_difference": difference,
        "losses_equal": difference <= EQUAL_LOSSES,
        "tokens_per_second": summary["tokens_per_second"],
        "tokens_per_second_vs_single": summary["tokens_per_second"] / single["tokens_per_second"],
        "checkpoint": checkpoint_format(output_dir),
    }
    for key in MEMORY:  # the largest over the ranks
        row[f"{key}_mb"] = max(entry[f"{key}_bytes"] for entry in summary["memory_per_process"]) / MEBIBYTE
    if ddp is not None:
        row["vs_ddp"] = {key: row[f"{key}_mb"] / ddp[f"{key}_mb"] for key in MEMORY}
    return row


def engine_config(name: str) -> str:
    return ENGINES[name][0 if torch.cuda.is_available() else 1]


def launch_command(name: str, setup: ShardedSetup) -> str:
    config = engine_config(name)
    prefix = "DS_ACCELERATOR=cpu " if ENGINES[name][2] and not torch.cuda.is_available() else ""
    return f"{prefix}accelerate launch --config_file configs/accelerate/{config} --num_processes {setup.processes}"


def table(rows: list[dict], setup: ShardedSetup, parameters: int) -> str:
    lines = [
        f"Sharded training on {setup.processes} {'GPU' if torch.cuda.is_available() else 'CPU'} processes: gqa "
        f"{setup.num_hidden_layers} x {setup.hidden_size} ({parameters / 1e6:.1f}M parameters), {setup.steps} steps "
        f"of {setup.processes} x {setup.per_device_batch} blocks of {setup.block_size} tokens, fp32, from the same "
        f"initial weights. Memory per process is the largest over the ranks.",
        "",
        "| engine | launch | loss = 1 process (max diff) | tokens/s vs 1 process | peak resident MB, steps (vs DDP) "
        "| peak resident MB, whole run (vs DDP) | parameters + optimizer MB (vs DDP) | checkpoint |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in rows:
        if "skipped" in row:
            lines.append(f"| {row['engine']} | `{row['launch']}` | {row['skipped']} | | | | | |")
            continue
        equal = f"{'yes' if row['losses_equal'] else 'NO'} ({row['max_loss_difference']:.1e})"
        memory = [
            f"{row[f'{key}_mb']:.0f}" + (f" ({row['vs_ddp'][key]:.2f}x)" if "vs_ddp" in row else "") for key in MEMORY
        ]
        lines.append(
            f"| {row['engine']} | `{row['launch']}` | {equal} | {row['tokens_per_second_vs_single']:.2f} "
            f"| {' | '.join(memory)} | {row['checkpoint']} |"
        )
    return "\n".join(lines)


def run_sharded(setup: ShardedSetup, log=print) -> list[dict]:
    unknown = sorted(set(setup.engines) - set(ENGINES))
    if unknown:
        raise SystemExit(f"--engines: unknown {unknown}; choose from {list(ENGINES)}")
    runs = Path(setup.runs_dir)
    python = [sys.executable]
    # the initial weights every run starts from: a run of 0 steps saves the freshly built model
    initial = train(python, overrides(setup, runs / "initial", 1, 0, model_config(setup)), runs / "initial", log)
    start = ["--model.init_from", str(runs / "initial" / "final")]
    global_batch = setup.processes * setup.per_device_batch
    single = train(python, overrides(setup, runs / "single", global_batch, setup.steps, start), runs / "single", log)
    summaries, skipped = {"1 process": (single, "python", runs / "single")}, []
    for name in ["ddp", *(engine for engine in setup.engines if engine != "ddp")]:  # DDP: the memory baseline
        launch = launch_command(name, setup)
        if ENGINES[name][2] and importlib.util.find_spec("deepspeed") is None:
            skipped.append({"engine": name, "launch": launch, "skipped": 'needs DeepSpeed (the "deepspeed" extra)'})
            continue
        config = ACCELERATE_CONFIGS / engine_config(name)
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
        launcher += ["--num_processes", str(setup.processes), "--main_process_port", str(free_port())]
        arguments = overrides(setup, runs / name, setup.per_device_batch, setup.steps, start)
        summaries[name] = (train(launcher, arguments, runs / name, log), launch, runs / name)
    ddp = engine_row("ddp", summaries["ddp"][0], single, None, runs / "ddp") if "ddp" in summaries else None
    rows = [
        engine_row(name, summary, single, ddp, output_dir) | {"launch": launch}
        for name, (summary, launch, output_dir) in summaries.items()
        if name == "1 process" or name in setup.engines
    ]
    write_results(
        setup.output_dir,
        "sharded",
        {"setup": vars(setup), "parameters": initial["parameters"], "rows": rows + skipped},
        table(rows + skipped, setup, initial["parameters"]),
        log=log,
    )
    return rows


BENCHMARKS = {"sharded": Benchmark(ShardedSetup, run_sharded)}

if __name__ == "__main__":
    sys.exit(main(BENCHMARKS))
