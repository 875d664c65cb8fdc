"""Trainer callbacks of a run: peak memory per process, throughput (tokens per second and MFU), and crash-safe
checkpoints (a marker written once every file of a checkpoint is on disk)."""

import json
import sys
import time
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..checkpoints import write_atomically

COMPLETE_MARKER = "checkpoint_complete.json"


def _local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """The part of a parameter or state tensor this process holds: ZeRO-3 keeps it in `ds_tensor`, FSDP2 in the
    DTensor's local tensor; unsharded tensors are whole."""
    if hasattr(tensor, "ds_tensor"):
        return tensor.ds_tensor
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def held_training_state(model: torch.nn.Module, optimizer) -> int:
    """Bytes of parameters and optimizer state this process holds, each storage counted once: the parameters' local
    shards and every tensor of the optimizers along the wrapper chain (accelerate's wrapper, DeepSpeed's ZeRO
    optimizer, whose torch optimizer steps fp32 partitions of its own). Gradients are left out: the Trainer frees
    them after every step. Counted from the tensors themselves, so it is what each engine really keeps."""
    storages: dict[int, int] = {}

    def add(tensor) -> None:
        if isinstance(tensor, torch.Tensor):
            storage = _local_shard(tensor).untyped_storage()
            if storage.data_ptr():
                storages[storage.data_ptr()] = storage.nbytes()

    for parameter in model.parameters():
        add(parameter)
    seen = set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        if isinstance(optimizer, torch.optim.Optimizer):
            for group in optimizer.param_groups:
                for parameter in group["params"]:
                    add(parameter)
            for state in optimizer.state.values():
                for value in state.values():
                    add(value)
        optimizer = getattr(optimizer, "optimizer", None)
    return sum(storages.values())


def _reset_peaks() -> None:
    """Restart this process's peak memory counters: the resident set's high-water mark (Linux's
    /proc/self/clear_refs; elsewhere it stays the whole process's peak) and the CUDA allocator's."""
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current resident set
    except OSError:
        pass
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peaks() -> dict[str, int]:
    """Bytes at the peaks since the last `_reset_peaks`: the resident set's and, on a GPU, the CUDA allocator's."""
    status = Path("/proc/self/status")
    if status.is_file():
        line = next(line for line in status.read_text().splitlines() if line.startswith("VmHWM:"))
        resident = int(line.split()[1]) * 1024
    else:
        import resource

        resident = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        resident *= 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB elsewhere
    peaks = {"resident": resident}
    if torch.cuda.is_available():
        peaks["cuda"] = torch.cuda.max_memory_allocated()
    return peaks


class MemoryCallback(TrainerCallback):
    """This process's peak memory while it trains, twice: over all of `trainer.train()` (building the engine,
    sharding the model, saving checkpoints) and over the training steps alone (counted from when training begins,
    the model already wrapped or sharded, and set aside while a checkpoint is saved, since saving gathers whole
    state dicts on some engines): the memory sharding exists to save. `start()` goes just before `train()`."""

    def __init__(self) -> None:
        self.overall: dict[str, int] = {}
        self.steps: dict[str, int] = {}

    def _keep(self, into: dict[str, int]) -> None:
        for key, value in _peaks().items():
            into[key] = max(into.get(key, 0), value)

    def start(self) -> None:
        _reset_peaks()

    def on_train_begin(self, args, state, control, **kwargs):
        self._keep(self.overall)
        _reset_peaks()

    def on_step_end(self, args, state, control, **kwargs):
        self._keep(self.steps)  # before this step's checkpoint, if any (the Trainer saves after on_step_end)

    def on_save(self, args, state, control, **kwargs):
        self._keep(self.overall)
        _reset_peaks()

    def report(self, trainer: Trainer) -> dict[str, int]:
        """Bytes: the peaks, and the parameters and optimizer state the process holds (`held_training_state`)."""
        self._keep(self.overall)  # every step's window ends before a reset that folds it into the overall peak
        report = {f"peak_{key}_bytes": value for key, value in self.overall.items()}
        report |= {f"step_peak_{key}_bytes": value for key, value in self.steps.items()}
        return report | {"parameters_and_optimizer_bytes": held_training_state(trainer.model, trainer.optimizer)}


# Dense bf16 tensor-core peaks (FLOP/s) of the GPUs the MFU figure knows.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12}


def peak_flops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_FLOPS.items() if key in name), None)


class ThroughputCallback(TrainerCallback, ExportableState):
    """Adds `tokens_per_second` (all processes) to the logs and, on a known GPU, `mfu`: model FLOPs per token
    (`train.build.training_flops_per_token`: 6·N plus 3·L times the variant's mixing FLOPs, PaLM's 6·N + 12·L·H·d_h·T
    for MHA) against the device's dense bf16 peak (`PEAK_FLOPS`). Every log, evaluations' included, also gets
    `elapsed_seconds`: wall-clock time spent training, evaluations and saving included, so that a run's
    `trainer_state.json` holds its validation scores against minutes. Every checkpoint's trainer state keeps the
    seconds elapsed when it was saved (the callback's exported state), and a run resumed from it counts on from there
    (`carried_seconds`), so the curve and the summary's `seconds` cover the whole run, not only its last launch."""

    def __init__(self, tokens_per_step: int, flops_per_token: float, peak: float | None) -> None:
        self.tokens_per_step, self.flops_per_token, self.peak = tokens_per_step, flops_per_token, peak
        self._start, self._step, self._began = None, 0, None
        self.carried_seconds = 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self._began if self._began is not None else 0.0

    def state(self) -> dict:
        """What `Trainer._save_checkpoint` writes into the checkpoint's trainer state (`ExportableState`)."""
        arguments = {"tokens_per_step": self.tokens_per_step, "flops_per_token": self.flops_per_token}
        return {"args": {**arguments, "peak": self.peak}, "attributes": {"elapsed_at_save": round(self.elapsed(), 1)}}

    def on_train_begin(self, args, state, control, **kwargs):
        # By now the Trainer has read a resumed checkpoint's trainer state; a fresh run's holds this callback's
        # state as constructed, 0 seconds.
        name = type(self).__name__
        saved = state.stateful_callbacks.get(name)
        if saved is None:  # a checkpoint saved without this state: count from its last log, and export from now on
            logged = [entry["elapsed_seconds"] for entry in state.log_history if "elapsed_seconds" in entry]
            self.carried_seconds = logged[-1] if logged else 0.0
            state.stateful_callbacks[name] = self.state()  # the Trainer's save updates the entry it finds
        else:
            saved = saved[-1] if isinstance(saved, list) else saved
            self.carried_seconds = saved.get("attributes", {}).get("elapsed_at_save", 0.0)
        self._began = time.perf_counter() - self.carried_seconds

    def on_step_begin(self, args, state, control, **kwargs):
        if self._start is None:
            self._start, self._step = time.perf_counter(), state.global_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and self._began is not None:
            elapsed = {"elapsed_seconds": round(self.elapsed(), 1)}
            logs.update(elapsed)
            state.log_history[-1].update(elapsed)
        if logs is None or self._start is None or "loss" not in logs:
            return
        elapsed = time.perf_counter() - self._start
        steps = state.global_step - self._step
        if elapsed > 0 and steps > 0:
            tokens_per_second = steps * self.tokens_per_step / elapsed
            extra = {"tokens_per_second": round(tokens_per_second, 1)}
            if self.peak:
                extra["mfu"] = round(tokens_per_second * self.flops_per_token / (self.peak * args.world_size), 4)
            logs.update(extra)  # seen by the reporting callbacks that follow (run_training puts this one first)
            state.log_history[-1].update(extra)  # the Trainer recorded a copy of `logs` just before
        self._start, self._step = time.perf_counter(), state.global_step


class CheckpointCallback(TrainerCallback):
    """Checkpoints of a run: the model card every checkpoint's `save_pretrained` writes names the training details
    and the step (`card_details` on the model), and a checkpoint counts as complete only once its marker file is
    written, after every file of every process."""

    def __init__(self, details: dict) -> None:
        self.details = details

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if model is not None:  # read by save_pretrained if a checkpoint is written after this step
            model.card_details = {**self.details, "steps": state.global_step}

    def on_save(self, args, state, control, **kwargs):
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()  # every rank's part is on disk before the marker
        if args.should_save:
            folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
            write_atomically(folder / COMPLETE_MARKER, json.dumps({"step": state.global_step}))


def run_callbacks(
    tokens_per_step: float, flops_per_token: float, details: dict, memory: MemoryCallback, extra: list
) -> list[TrainerCallback]:
    """The callbacks of every training run, language model or translator: throughput (and MFU on a known GPU),
    crash-safe checkpoints carrying `details`, memory, then the caller's `extra`."""
    throughput = ThroughputCallback(tokens_per_step, flops_per_token, peak_flops())
    return [throughput, CheckpointCallback(details), memory, *extra]


def throughput_first(trainer) -> None:
    """Put the throughput callback before transformers' own, so that TensorBoard and the progress printer get its
    figures in the same logs."""
    trainer.callback_handler.callbacks.sort(key=lambda callback: not isinstance(callback, ThroughputCallback))
