"""What the `hf-attn-zoo` commands run: one function per command, named by `hf_attn_zoo_cli.COMMANDS`, which
parses the arguments (see that module for the commands and why it lives outside the package). The package never
imports that front: it names the option classes for type checking only.

A user's mistake is raised as `hf_attn_zoo.errors.UserError` (the command line prints it as one line); paths are
checked before anything loads (`hf_attn_zoo.loading`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import MissingPathError, UserError
from .models import VARIANTS

if TYPE_CHECKING:
    import torch

    from hf_attn_zoo_cli import (
        AttentionOptions,
        ConvertOptions,
        EvalOptions,
        ExportOptions,
        ImportOptions,
        LmEvalTaskOptions,
        PushOptions,
        ServeOptions,
        TranslateEvalOptions,
        TranslateOptions,
    )

    from .convert.transfer import LayerTransfer

# list


def deploy_targets(variant) -> str:
    """Where `hf-attn-zoo export` takes a variant, from its attention class's facts: the native transformers
    architecture computing it and llama.cpp's GGUF, else the zoo's own server; and whether vLLM serves the zoo
    checkpoint as it is (its transformers backend, `clients_zoo.vllm_refusal` of the variant's default config)."""
    from .models.clients_zoo import vllm_refusal

    attention = variant.attention_class
    targets = [f"`{attention.native_format}`"] if attention.native_format else []
    if attention.gguf_architecture:
        targets.append("GGUF")
    deploy = f"export: {', '.join(targets)}" if targets else "`hf-attn-zoo serve`"
    if vllm_refusal(attention, variant.config()) is None:
        deploy += "; vLLM as is"
    return deploy


def variant_table() -> str:
    """The registered variants as a markdown table."""
    lines = [
        "| variant | model_type | attention | KV cache per token | backends | positions | deploy |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, variant in VARIANTS.items():
        lines.append(
            f"| `{name}` | `{variant.model_type}` | {variant.description} | {variant.cache_per_token} "
            f"| {', '.join(variant.backends)} | {', '.join(variant.position_types)} | {deploy_targets(variant)} |"
        )
    return "\n".join(lines)


def list_command(options: None) -> None:
    print(variant_table())


# train


def recipe_fields() -> str:
    """The fields of each recipe section, for `train --help`."""
    from .train.recipe import SECTIONS

    return "fields of each recipe section:\n" + "\n".join(
        textwrap.fill(
            ", ".join(f.name for f in dataclasses.fields(cls) if f.init),
            width=100,
            initial_indent=f"  {section}: ",
            subsequent_indent="    ",
        )
        for section, cls in SECTIONS.items()
    )


# eval


def evaluate_command(options: EvalOptions) -> dict:
    from transformers import AutoConfig

    from .data import expand_files
    from .evaluation.perplexity import load_for_scoring, score_texts, window_lengths
    from .loading import check_model_folder, from_pretrained, resolve_source

    files = expand_files(options.data, "--data")
    texts = [path.read_text(encoding="utf-8", errors="replace")[: options.max_chars] for path in files]
    source = options.model if options.gguf_file else resolve_source(options.model)
    # the windows are checked against the config before the weights load
    check_model_folder(source, gguf_file=options.gguf_file)
    gguf = {"gguf_file": options.gguf_file} if options.gguf_file else {}
    config = from_pretrained(AutoConfig, source, trust_remote_code=options.trust_remote_code, **gguf)
    if getattr(config, "is_encoder_decoder", False):
        raise UserError(
            f"{options.model} is an encoder-decoder translator ({config.model_type}), not a language model of text: "
            f"score it on pairs with hf-attn-zoo translate-eval {options.model} --data PAIRS."
        )
    window_lengths(config, options.max_length, options.stride, notice=False)  # score_texts prints the notice
    model, tokenizer = load_for_scoring(source, options.trust_remote_code, options.gguf_file)
    result = score_texts(
        model, tokenizer, texts, options.max_length, options.stride, options.batch_size, progress=not options.json
    ).as_dict()
    if options.json:
        keys = ("perplexity", "bits_per_byte", "word_perplexity", "tokens", "bytes", "max_length", "stride")
        print(json.dumps({key: result[key] for key in keys}))
    else:
        print(
            f"{options.model} on {len(files)} file(s), windows of {result['max_length']} tokens every "
            f"{result['stride']}:"
        )
        print("| metric | value |\n| --- | ---: |")
        for key in ("perplexity", "bits_per_byte", "word_perplexity", "tokens", "bytes", "words"):
            value = result[key]
            print(f"| {key} | {value:,.4f} |" if isinstance(value, float) else f"| {key} | {value:,} |")
    return result


# translate-eval


def translate_command(options: TranslateOptions) -> list[str]:
    """Print the translations of the texts given (or of `--file`'s lines, or of standard input's), one per line."""
    from .evaluation.translation import check_source_lengths, encoder_positions, load_translator, translate

    if options.text and options.file is not None:
        raise UserError("translate: give texts or --file, not both.")
    if options.text:
        texts = list(options.text)
    elif options.file is not None:
        if not options.file.is_file():
            raise MissingPathError(f"--file {options.file} does not exist; give a text file, one source per line.")
        texts = options.file.read_text().splitlines()
    else:
        texts = sys.stdin.read().splitlines()
    model, tokenizer = load_translator(options.model, "translate", options.trust_remote_code)
    check_source_lengths(tokenizer, texts, encoder_positions(model.config), options.model, "max_position_embeddings")
    beams = options.num_beams or model.generation_config.num_beams or 1
    translations = translate(model, tokenizer, texts, beams, options.max_new_tokens, options.batch_size)
    for translation in translations:
        print(translation)
    return translations


def translate_eval_command(options: TranslateEvalOptions) -> dict:
    from .data import expand_files
    from .evaluation.translation import (
        check_source_lengths,
        encoder_positions,
        load_translator,
        score_translation,
    )
    from .pairs import read_pair_files

    pairs = read_pair_files(
        expand_files(options.data, "--data"), options.source_field, options.target_field, "--data", fix="--"
    )
    model, tokenizer = load_translator(options.model, "translate-eval", options.trust_remote_code)
    sources, targets = list(pairs["source"]), list(pairs["target"])
    positions = encoder_positions(model.config)
    if options.max_source_length is not None:
        check_source_lengths(tokenizer, sources, options.max_source_length, options.model, "--max_source_length")
    check_source_lengths(tokenizer, sources, positions, options.model, "the encoder's max_position_embeddings")
    result = score_translation(
        model, tokenizer, sources, targets, options.num_beams, options.max_new_tokens, options.batch_size
    )
    if options.out is not None:
        options.out.write_text(json.dumps(result, indent=2, ensure_ascii=False))
    if options.json:
        print(json.dumps({key: value for key, value in result.items() if key != "translations"}))
    else:
        search = "greedy" if options.num_beams == 1 else f"beam search ({options.num_beams} beams)"
        print(f"{options.model} on {result['pairs']} pair(s), {search}:")
        print("| metric | value |\n| --- | ---: |")
        for key in (
            "bleu",
            "chrf",
            "reference_perplexity",
            "reference_tokens",
            "decode_seconds",
            "generated_tokens_per_second",
        ):
            value = result[key]
            print(f"| {key} | {value:,.4f} |" if isinstance(value, float) else f"| {key} | {value:,} |")
        print(result["bleu_signature"])
    return result


# lm-eval-task


def lm_eval_task_command(options: LmEvalTaskOptions) -> None:
    from .data import expand_files
    from .evaluation.lm_eval_task import command, write_task

    print(f"task written to {write_task(expand_files(options.data, '--data'), options.out, options.name)}; run:")
    print(command(options.checkpoint, options.out, options.name))


# attention


def attention_command(options: AttentionOptions) -> None:
    from .evaluation.attention_maps import plot_attention, plot_cross_attention
    from .loading import load_model_and_tokenizer

    config_path = Path(options.checkpoint).expanduser() / "config.json"
    if config_path.is_file() and json.loads(config_path.read_text()).get("is_encoder_decoder"):
        from .evaluation.translation import load_translator

        model, tokenizer = load_translator(options.checkpoint, "attention", options.trust_remote_code)
        try:
            plot_cross_attention(model, tokenizer, options.text, options.layer, options.head, options.out)
        except ValueError as error:  # a layer or head out of range, a model without cross-attention weights
            raise UserError(f"{options.checkpoint}: {error}") from error
        heads = "every head" if options.head is None else f"head {options.head}"
        print(f"cross-attention of layer {options.layer}, {heads}, of {options.checkpoint} written to {options.out}")
        return
    model, tokenizer = load_model_and_tokenizer(options.checkpoint, trust_remote_code=options.trust_remote_code)
    head = 0 if options.head is None else options.head
    try:
        plot_attention(model.eval(), tokenizer, options.text, options.layer, head, options.out)
    except ValueError as error:  # a layer or head out of range, a variant without weights: named by attention_map
        raise UserError(f"{options.checkpoint}: {error}") from error
    print(f"layer {options.layer}, head {head} of {options.checkpoint} written to {options.out}")


# convert


def convert_command(options: ConvertOptions) -> Path:
    """Convert SRC to `--to` (pooled heads, a latent, or any variant from the parent's projections), optionally with
    attention transfer on `--data`; with `--eval_data`, a summary of held-out perplexity: the parent, the converted
    model before transfer and after. Every refusal comes before anything is written. With `--transfer` or
    `--distill`, each transferred layer, the model entering distillation and the Trainer's checkpoints are kept in
    `OUT.stages` until OUT is written: the same command run again after a stop resumes from them (`ConvertStages`)."""
    from .checkpoints import save_checkpoint
    from .convert import METHODS
    from .convert.calibrated import CALIBRATION_METHODS
    from .convert.latent import MLA_METHODS
    from .data import expand_files

    launch = time.perf_counter()
    latent, pooled = options.to == "mla", options.to in ("mha", "gqa", "mqa")
    if options.method is not None and not (latent or pooled):
        raise UserError(
            f"--method chooses how gqa/mqa pool heads or mla fits a latent; --to {options.to} copies the parent's "
            f"projections: leave --method out."
        )
    method = options.method or ("rorope" if latent else "mean")
    methods = MLA_METHODS if latent else METHODS
    if (latent or pooled) and method not in methods:
        raise UserError(f"--method {method} does not apply to --to {options.to}; use one of {' '.join(methods)}.")
    if options.to == "gqa" and options.num_key_value_heads is None:
        raise UserError("--to gqa needs --num_key_value_heads G (a divisor of the source's attention heads)")
    if latent and options.kv_lora_rank is None:
        raise UserError("--to mla needs --kv_lora_rank R: the latent's width (the cache keeps R + qk_rope_head_dim)")
    if not latent and (options.kv_lora_rank is not None or options.qk_rope_head_dim is not None):
        raise UserError("--kv_lora_rank and --qk_rope_head_dim size an MLA conversion: use them with --to mla.")
    fields = target_config(options)
    calibration, files = None, []
    if method in CALIBRATION_METHODS and not options.calibration:
        raise UserError(
            f"--method {method} is fitted on calibration text: pass --calibration FILE (text other than what you "
            f"will test on)."
        )
    if options.calibration and not latent and method not in CALIBRATION_METHODS:
        raise UserError(f"--calibration is read by --method {' / '.join(CALIBRATION_METHODS)}, not {method}.")
    if options.calibration:
        files = expand_files(options.calibration, "--calibration")
        calibration = [path.read_text(encoding="utf-8", errors="replace") for path in files]
    transfer_texts = transfer_data(options)
    held_out = []
    if options.eval_data:
        held_out = read_texts(expand_files(options.eval_data, "--eval_data"), options.eval_max_chars, "--eval_data")
    if options.transfer or options.distill:  # the window the command asks for (the parent's length: once loaded)
        default = getattr(VARIANTS[options.to].config_class(), "sliding_window", None)
        check_rows_exceed_window(options, fields.get("sliding_window", default))
    stages = ConvertStages(options)
    if (resumed := stages.resume()) is not None:  # an earlier run of this command got as far as distillation
        converted, tokenizer, state = resumed
        summary, details, scores = state["summary"], state["details"], state["scores"]
        how, seconds = state["how"], state["seconds"]
        # stages kept before the command counted its launches: their conversion and transfer
        earlier = state.get("elapsed", seconds + summary.get("transfer", {}).get("seconds", 0.0))
    else:
        converted, tokenizer, summary, details, scores, how, seconds = convert_and_transfer(
            options, method, calibration, files, fields, transfer_texts, held_out, stages
        )
        earlier = summary.get("transfer", {}).get("seconds_before_resume", 0.0)  # layers an earlier launch did
        if options.distill:  # the long stage: what came before is kept, so a stopped run resumes from here
            state = {"summary": summary, "details": details, "scores": scores, "how": how, "seconds": seconds}
            stages.keep(converted, tokenizer, {**state, "elapsed": earlier + time.perf_counter() - launch})
    if options.distill:
        converted, summary["distillation"] = run_distillation(options, converted, tokenizer, stages.folder)
        distillation = summary["distillation"]
        details["distillation"] = (
            f"{distillation['train_tokens']:,} tokens at T={options.temperature}, alpha={options.alpha} from "
            f"{options.src} ({'top-' + str(options.topk) if options.topk else 'run alongside'})"
            + (f", the MLPs through LoRA of rank {options.lora_rank}" if options.lora_rank is not None else "")
        )
        if held_out:
            scores["distilled"] = held_out_perplexity(converted, tokenizer, held_out, options)
        earlier += distillation.get("seconds_before_resume", 0.0)
    if scores:
        summary["held_out_perplexity"] = scores
    # the whole command's wall time: with stages resumed, the launches that made them too (not the work they lost)
    summary["seconds"] = round(earlier + time.perf_counter() - launch, 1)
    out = save_checkpoint(options.out, converted, tokenizer=tokenizer, training=details, summary=summary)
    stages.drop()
    print_convert_summary(options, converted, how, seconds, summary, out)
    return out


def convert_and_transfer(
    options: ConvertOptions, method: str, calibration, files, fields, transfer_texts, held_out, stages: ConvertStages
):
    """The parent loaded and converted, scored, and its attention transferred when asked, each layer kept in
    `stages` as it is done: (converted model, tokenizer, summary, model-card details, held-out scores, how the
    attention was initialised, seconds)."""
    from .loading import check_model_folder, load_model_and_tokenizer

    latent, pooled = options.to == "mla", options.to in ("mha", "gqa", "mqa")
    if options.gguf_file:  # a plain checkpoint of the GGUF file, which the Trainer and save_pretrained can use
        check_model_folder(options.src, gguf_file=options.gguf_file)
        model, tokenizer = load_model_and_tokenizer(str(Path(options.src).expanduser() / options.gguf_file))
    else:
        model, tokenizer = load_model_and_tokenizer(options.src)
    before = model.config.num_key_value_heads
    start = time.perf_counter()
    conversion = convert_model(options, model, tokenizer, method, calibration, fields)
    converted = conversion.model
    seconds = time.perf_counter() - start
    window = getattr(converted.config, "sliding_window", None)
    if options.transfer or options.distill:
        check_rows_exceed_window(options, window, converted.config.max_position_embeddings)
    gguf = f" / {options.gguf_file}" if options.gguf_file else ""
    details = {"converted from": f"{options.src}{gguf} ({model.config.model_type})"}
    if latent:
        new = converted.config
        details["attention"] = (
            f"{before} key/value heads -> a latent of {new.kv_lora_rank} and a shared RoPE key of "
            f"{new.qk_rope_head_dim} ({method}; TransMLA / MHA2MLA)"
        )
    elif pooled:
        details["key/value heads"] = (
            f"{before} -> {converted.config.num_key_value_heads}, {method}-pooled (Ainslie et al. 2023)"
        )
    else:
        details["attention"] = f"{options.to} {conversion.fields or ''}: {conversion.how} from the parent's attention"
    if files:
        names = ", ".join(path.name for path in files)
        details["calibration"] = f"{names} (at most {options.calibration_tokens} tokens)"
    summary = {"to": options.to, "conversion_seconds": seconds, "copied": conversion.copied, "fresh": conversion.fresh}
    scores = {}
    if held_out:
        scores["parent"] = held_out_perplexity(model, tokenizer, held_out, options)
        scores["converted"] = held_out_perplexity(converted, tokenizer, held_out, options)
    if options.transfer:
        summary["transfer"] = run_transfer(options, model, converted, tokenizer, transfer_texts, stages)
        names = ", ".join(path.name for path in options_data_files(options))
        details["attention transfer"] = (
            f"{summary['transfer']['tokens']:,} tokens of {names}, {options.transfer_epochs} epoch(s) per layer, Adam "
            f"at {options.transfer_learning_rate} (each layer trained to reproduce the parent's attention output)"
        )
        if held_out:
            scores["transferred"] = held_out_perplexity(converted, tokenizer, held_out, options)
    return converted, tokenizer, summary, details, scores, conversion.how, seconds


def check_rows_exceed_window(options: ConvertOptions, window: int | None, positions: int | None = None) -> None:
    """Refuse rows that fit in a sliding `window`: there the converted attention sees every key, is the parent's,
    and transfer or distillation on them cannot learn what the window changes. The rows read are `--block_size`
    tokens, or the model's `positions` where fewer."""
    if window is None:
        return
    if positions is not None and positions <= window:
        raise UserError(
            f"--to {options.to}: the parent reads at most {positions} positions, all within the window of {window} "
            f"keys, so the window changes nothing it can learn from; choose a window below {positions}."
        )
    rows = options.block_size if positions is None else min(options.block_size, positions)
    if rows <= window:
        raise UserError(
            f"--block_size {options.block_size}: rows of {rows} tokens fit in the window of {window} keys, so the "
            f"converted attention equals the parent's on every row and --transfer / --distill have nothing to "
            f"learn; give --block_size above {window} (e.g. {2 * window})."
        )


def target_config(options: ConvertOptions) -> dict:
    """The `--config` JSON mapping of target fields (with `--num_key_value_heads`, `--kv_lora_rank` and
    `--qk_rope_head_dim` where given), or a one-line refusal."""
    fields = {}
    if options.config:
        try:
            fields = json.loads(options.config)
        except ValueError as error:
            raise UserError(f"--config {options.config!r} is not JSON ({error}); give a mapping of fields.") from error
        if not isinstance(fields, dict):
            raise UserError(
                f"--config {options.config!r}: give a JSON mapping of config fields, e.g. '{{\"topk\": 8}}'"
            )
    for name in ("num_key_value_heads", "kv_lora_rank", "qk_rope_head_dim"):
        if getattr(options, name) is not None:
            fields[name] = getattr(options, name)
    if options.to == "mqa":
        fields.setdefault("num_key_value_heads", 1)
    return fields


def options_data_files(options: ConvertOptions) -> list[Path]:
    from .data import expand_files

    return expand_files(options.data, "--data") if options.data else []


def read_texts(files: list[Path], max_chars: int | None, option: str) -> list[str]:
    """The texts of `files` (the first `max_chars` characters of each); an empty one is refused naming it."""
    texts = []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")[:max_chars]
        if not text.strip():
            raise UserError(f"{option}: {path} is empty; give files with text in them (or leave it out).")
        texts.append(text)
    return texts


def transfer_data(options: ConvertOptions) -> list[str]:
    """The `--data` texts for `--transfer` and `--distill`, refused in one line when absent, empty, or given without
    either."""
    learns = options.transfer or options.distill
    if options.data and not learns:
        raise UserError("--data is the text --transfer / --distill learn from: add one, or leave --data out.")
    if not learns:
        return []
    if not options.data:
        raise UserError("--transfer and --distill need --data FILE...: text to learn the parent's behaviour on.")
    if options.lora_rank is not None and (not options.distill or options.lora_rank < 1):
        raise UserError(
            f"--lora_rank {options.lora_rank} adapts the MLPs while --distill trains: give a positive rank with "
            f"--distill, or leave --lora_rank out."
        )
    if options.distill and (options.temperature <= 0 or not 0 <= options.alpha <= 1):
        raise UserError(f"--temperature {options.temperature} must be > 0 and --alpha {options.alpha} in [0, 1].")
    if options.distill and not options.eval_data and len(options_data_files(options)) < 2:
        raise UserError(
            "--distill validates on a share of --data's files, and one file cannot be split: give --eval_data "
            "(held-out text) or more --data files."
        )
    for name in ("tokens", "block_size", "transfer_batch_size", "transfer_epochs"):
        if getattr(options, name) < 1:
            raise UserError(f"--{name} {getattr(options, name)} must be a positive number.")
    if not options.transfer_learning_rate > 0:
        raise UserError(f"--transfer_learning_rate {options.transfer_learning_rate} must be positive.")
    return read_texts(options_data_files(options), None, "--data")


def convert_model(options: ConvertOptions, model, tokenizer, method: str, calibration, fields: dict):
    """`convert_attention` of the loaded parent, its refusals as one line naming SRC."""
    from transformers import set_seed

    from .convert.transfer import convert_attention

    pooling = {"method": method} if options.to in ("mha", "gqa", "mqa", "mla") else {}
    set_seed(0)  # the same fresh parameters every run: a command resumed after a stop converts as its first launch did
    if calibration is not None:
        pooling.update(calibration=calibration, tokenizer=tokenizer, max_calibration_tokens=options.calibration_tokens)
    try:
        return convert_attention(model, options.to, **pooling, **fields)
    except ValueError as error:  # the source, the sizes or the calibration cannot be used: named by the conversion
        raise UserError(f"{options.src}: {error}") from error


def held_out_perplexity(model, tokenizer, texts: list[str], options: ConvertOptions) -> float:
    from .evaluation.perplexity import score_texts

    return score_texts(model, tokenizer, texts, options.eval_max_length, batch_size=4).perplexity


def run_transfer(
    options: ConvertOptions, parent, converted, tokenizer, texts: list[str], stages: ConvertStages
) -> dict:
    """Attention transfer of `converted` from `parent` on `texts` (`--tokens` of them in `--block_size` rows), with
    a progress bar; what it did, per layer and in all. Each layer is kept in `stages` once done, and the layers an
    earlier launch of the command kept there are read back instead of trained again."""
    from tqdm.auto import tqdm

    from .convert.transfer import attention_transfer, transfer_batches, transfer_steps

    block = min(options.block_size, converted.config.max_position_embeddings)
    batches = transfer_batches(texts, tokenizer, block, options.tokens, options.transfer_batch_size)
    tokens = sum(batch.numel() for batch in batches)
    if tokens < 2 * block:
        raise UserError(
            f"--data holds {tokens} tokens in rows of {block}: too little to learn from; give more text (at least "
            f"{2 * block} tokens) or a smaller --block_size."
        )
    done = stages.transferred(converted)
    if done:
        print(f"attention transfer: layers {', '.join(map(str, done))} read back from {stages.folder}")
    layers = converted.config.num_hidden_layers - len(done)
    start = time.perf_counter()
    with tqdm(total=transfer_steps(batches, layers, options.transfer_epochs), desc="attention transfer") as bar:
        results = attention_transfer(
            parent,
            converted,
            batches,
            epochs=options.transfer_epochs,
            learning_rate=options.transfer_learning_rate,
            progress=bar.update,
            done=done,
            on_layer=stages.keep_layer,
        )
    earlier = sum(result.seconds for result in done.values())
    return {
        "tokens": tokens,
        "seconds": earlier + time.perf_counter() - start,
        "layers": [dataclasses.asdict(result) for result in results],
        **({"resumed_layers": len(done), "seconds_before_resume": earlier} if done else {}),
    }


class ConvertStages:
    """`OUT.stages`, beside OUT while a `convert --transfer` or `--distill` runs: each layer attention transfer has
    finished (`transfer/layer-NNN.*`, its attention weights and what it measured), the model entering distillation
    (`start/`, with what the stages before it measured) and the distillation's Trainer checkpoints
    (`distillation/`), so that the same command run again after a stop resumes where it stood: from the
    distillation's newest checkpoint, or converting again and transferring only the layers not done. Kept for this
    command's options and text only (`options.json`: the options, and a digest of each text file they name):
    another command's stages, or stages made from text edited since, are set aside, never trained on. Dropped
    once OUT is written."""

    def __init__(self, options: ConvertOptions) -> None:
        self.folder = Path(options.out).with_name(Path(options.out).name + ".stages")
        self.options = json.loads(json.dumps(dataclasses.asdict(options), default=str))
        if options.transfer or options.distill:  # the commands that keep stages
            from .data import expand_files

            named = {"--calibration": options.calibration, "--data": options.data, "--eval_data": options.eval_data}
            texts = [path for field, paths in named.items() if paths for path in expand_files(paths, field)]
            self.options["text_digests"] = {str(path): file_digest(path) for path in texts}

    def resume(self):
        """(model, tokenizer, state) of a kept start of distillation for these options, or None. Stages another
        command left are set aside here, so that what is read later (`transferred`) is this command's."""
        from .loading import load_model_and_tokenizer

        stamp, start = self.folder / "options.json", self.folder / "start"
        if not self.folder.is_dir():
            return None
        kept = json.loads(stamp.read_text()) if stamp.is_file() else {}
        if kept != self.options:
            aside = self.folder.with_name(f"{self.folder.name}.other-{int(time.time())}")
            self.folder.rename(aside)
            differ = sorted(key for key in {*kept, *self.options} if kept.get(key) != self.options.get(key))
            why = f"it differs in {', '.join(differ)}" if kept else "it has no options.json"
            print(f"{self.folder} was not left by this command ({why}): moved to {aside}; starting over")
            return None
        if not (start / "stage.json").is_file():
            return None
        model, tokenizer = load_model_and_tokenizer(str(start))
        print(f"resuming from {start}: the stages before distillation, done by an earlier run of this command")
        return model, tokenizer, json.loads((start / "stage.json").read_text())

    def stamp(self) -> None:
        from .checkpoints import write_atomically

        self.folder.mkdir(parents=True, exist_ok=True)
        write_atomically(self.folder / "options.json", json.dumps(self.options, indent=2))

    def keep_layer(self, attention: torch.nn.Module, result: LayerTransfer) -> None:
        """One layer's finished transfer: its attention's weights, then what it measured (the marker)."""
        from safetensors.torch import save_file

        from .checkpoints import write_atomically

        self.stamp()
        folder = self.folder / "transfer"
        folder.mkdir(exist_ok=True)
        name = f"layer-{result.layer:03d}"
        weights = {key: value.detach().contiguous() for key, value in attention.state_dict().items()}
        staging = folder / f"{name}.safetensors.partial"
        save_file(weights, staging)
        os.replace(staging, folder / f"{name}.safetensors")  # whole or absent, and before its marker
        write_atomically(folder / f"{name}.json", json.dumps(dataclasses.asdict(result), indent=2))

    def transferred(self, converted) -> dict[int, LayerTransfer]:
        """The layers an earlier launch of this command transferred, by index: their attention weights loaded into
        `converted`, and what they measured (`LayerTransfer`)."""
        from safetensors.torch import load_file

        from .convert.transfer import LayerTransfer

        done = {}
        for record in sorted((self.folder / "transfer").glob("layer-*.json")):
            result = LayerTransfer(**json.loads(record.read_text()))
            attention = converted.model.layers[result.layer].self_attn
            attention.load_state_dict(load_file(record.with_suffix(".safetensors")))
            done[result.layer] = result
        return done

    def keep(self, model, tokenizer, state: dict) -> None:
        import shutil

        from .checkpoints import publish_folder, save_checkpoint

        self.stamp()

        def write(staging: Path) -> None:
            save_checkpoint(staging, model, tokenizer=tokenizer)
            (staging / "stage.json").write_text(json.dumps(state, indent=2))  # last: the stage is complete

        publish_folder(self.folder / "start", write)
        shutil.rmtree(self.folder / "transfer", ignore_errors=True)  # in start/ now

    def drop(self) -> None:
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)


def file_digest(path: str | os.PathLike) -> str:
    """SHA-256 of a file's bytes, read a megabyte at a time."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def run_distillation(options: ConvertOptions, converted, tokenizer, stages: Path) -> tuple:
    """Train `converted` on the parent's next-token distribution over `--data` (`--tokens` of it, rows of
    `--block_size`) through the one training path (`convert.distill`, `hf_attn_zoo.train.tasks.DistillationTask`),
    the Trainer's progress bar showing; returns the distilled model and the run's summary. The run starts from
    `stages/start` (saved there unless an earlier run did) and checkpoints into `stages/distillation` ten times,
    resuming from the newest checkpoint there."""
    import math
    import shutil

    from transformers import AutoModelForCausalLM

    from .checkpoints import save_checkpoint
    from .data import DataArguments
    from .train import ModelArguments, ZooTrainingArguments, run_training
    from .train.recipe import ConversionArguments
    from .train.trainer import complete_checkpoints

    teacher = str(Path(options.src).expanduser() / options.gguf_file) if options.gguf_file else options.src
    block = min(options.block_size, converted.config.max_position_embeddings)
    steps = max(1, math.ceil(options.tokens / (options.batch_size * block)))
    start_from, run = stages / "start", stages / "distillation"
    if not (start_from / "config.json").is_file():
        save_checkpoint(start_from, converted, tokenizer=tokenizer)
    if not complete_checkpoints(run):  # a stop before the first complete checkpoint left nothing to resume from
        shutil.rmtree(run, ignore_errors=True)
    model_args = ModelArguments(init_from=str(start_from), size=None)
    model_args.conversion = ConversionArguments(
        distill=True,
        teacher=teacher,
        temperature=options.temperature,
        alpha=options.alpha,
        teacher_topk=options.topk,
        lora_rank=options.lora_rank,
    )
    data_args = DataArguments(
        train_files=list(options.data),
        validation_files=list(options.eval_data or []),  # else a share of --data's files
        block_size=block,
        tokenizer=str(start_from),
    )
    training_args = ZooTrainingArguments(
        output_dir=str(run),
        resume_from_checkpoint="latest" if complete_checkpoints(run) else None,
        max_steps=steps,
        per_device_train_batch_size=options.batch_size,
        per_device_eval_batch_size=options.batch_size,
        learning_rate=options.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, steps // 20),
        weight_decay=0.0,
        logging_steps=max(1, steps // 10),
        save_strategy="steps",
        save_steps=max(1, steps // 10),
        save_total_limit=1,
        eval_strategy="no",
        report_to=[],
    )
    summary = run_training(model_args, data_args, training_args)
    if training_args.resume_from_checkpoint and "resumed_from_step" not in summary:
        # an earlier launch had finished it (its saved summary, read back): all its seconds came before this one
        summary = {**summary, "resumed_from_step": summary["steps"], "seconds_before_resume": summary["seconds"]}
    distilled = AutoModelForCausalLM.from_pretrained(summary["final_model"]).eval()
    keep = ("steps", "train_tokens", "seconds", "tokens_per_second", "losses", "validation_perplexity")
    keep += ("resumed_from_step", "seconds_before_resume") if "resumed_from_step" in summary else ()
    keep += ("lora_rank", "trainable_parameters") if options.lora_rank is not None else ()
    return distilled, {key: summary[key] for key in keep}


def print_convert_summary(options: ConvertOptions, converted, how: str, seconds: float, summary: dict, out) -> None:
    print(
        f"{converted.config.model_type} ({how}; converted in {seconds:.1f} s, {summary['seconds']:.0f} s in all) "
        f"written to {out}"
    )
    if "distillation" in summary:
        distillation = summary["distillation"]
        print(
            f"distillation: {distillation['train_tokens']:,} tokens in {distillation['steps']} steps, "
            f"{distillation['seconds']:.0f} s; loss {distillation['losses'][0]:.4f} -> "
            f"{distillation['losses'][-1]:.4f}"
        )
    if "transfer" in summary:
        transfer = summary["transfer"]
        layers = transfer["layers"]
        before = sum(layer["relative_before"] for layer in layers) / len(layers)
        after = sum(layer["relative_after"] for layer in layers) / len(layers)
        print(
            f"attention transfer: {transfer['tokens']:,} tokens x {len(layers)} layers in "
            f"{transfer['seconds']:.0f} s; attention output error relative to the parent's, mean over layers: "
            f"{before:.4f} -> {after:.4f}"
        )
    scores = summary.get("held_out_perplexity")
    if scores:
        print("| held-out perplexity | value |\n| --- | ---: |")
        names = {
            "parent": f"parent ({options.src})",
            "converted": "converted",
            "transferred": "after transfer",
            "distilled": "after distillation",
        }
        for key, value in scores.items():
            print(f"| {names[key]} | {value:,.2f} |")


# export, import


def export_command(options: ExportOptions) -> Path:
    from .export import export_checkpoint

    written = export_checkpoint(options.checkpoint, options.to, options.out, dtype=options.dtype)
    print(f"{options.checkpoint} exported --to {options.to}: {written}")
    return written


def import_command(options: ImportOptions) -> Path:
    from .export import import_checkpoint

    written = import_checkpoint(options.checkpoint, options.out)
    print(f"{options.checkpoint} imported as a zoo checkpoint: {written}")
    return written


# push


def push_command(options: PushOptions) -> None:
    from .hub import push_checkpoint

    print(push_checkpoint(options.checkpoint, options.repo, options.revision, options.private))


# serve


def serve_command(options: ServeOptions) -> int:
    from .serving import serve

    return serve(**dataclasses.asdict(options))
