"""`hf-attn-zoo export`: a zoo checkpoint as the model deployment engines already run, and `hf-attn-zoo import` back.

    export_checkpoint(CKPT, "native" | "llama" | "qwen2" | "mistral" | "deepseek_v3" | "mamba", OUT)
        the native transformers model computing the same function (loads with no remote code, so vLLM's own model
        classes, TGI and SGLang take it too), with the tokenizer, generation_config.json and a model card
    export_checkpoint(CKPT, "gguf", OUT, dtype="f32" | "f16" | "q8_0")
        OUT/<name>.gguf for llama.cpp (and ollama, llama-cpp-python), tokenizer inside
    import_checkpoint(CKPT, OUT)
        a native Llama, Mistral, Qwen2, dense DeepSeek-V2/V3 or Mamba checkpoint as the zoo variant computing it

Which native architecture holds a variant is a fact of its attention class (`native_format`, `gguf_architecture`:
Llama for the MHA family, Mistral for the sliding window, DeepSeek-V3 for MLA, Mamba for mamba); what a format lacks
for a given config is said by the converters (`native_refusal`, `deepseek_refusal`, `mamba_refusal`,
`gguf_refusal`). A refusal is a `UserError`
(a `ValueError`) of one line naming the checkpoint, what the format lacks and what to do instead; it comes before
any weight is read, and the output folder is never touched: an existing non-empty one is refused first, and the
export is written into a hidden sibling folder renamed into place at the end.
"""

import os
import shutil
from pathlib import Path

from .errors import MissingPathError, UserError

NATIVE_FORMATS = ("llama", "qwen2", "mistral", "deepseek_v3", "mamba")
FORMATS = ("native", *NATIVE_FORMATS, "gguf")
NATIVE_DTYPES = ("float32", "float16", "bfloat16")
INSTEAD = (
    "serve it with `hf-attn-zoo serve`, or load it with transformers (trust_remote_code=True, or after "
    "`import hf_attn_zoo`)"
)


def check_output_folder(output_dir: Path) -> None:
    """Refuse an output folder that exists and holds anything (nothing is ever written over)."""
    if output_dir.exists() and (not output_dir.is_dir() or any(output_dir.iterdir())):
        raise UserError(
            f"{output_dir} exists and is not empty; give a new folder (or remove it) so nothing is overwritten."
        )


def zoo_config(checkpoint: str | os.PathLike):
    """The zoo config of a checkpoint folder, refusing what is not a decoder-only zoo checkpoint."""
    from transformers import AutoConfig

    from . import models
    from .loading import check_model_folder

    check_model_folder(checkpoint, tokenizer=False)
    config = AutoConfig.from_pretrained(checkpoint)
    if getattr(config, "is_encoder_decoder", False) or not any(
        variant.model_type == config.model_type for variant in models.VARIANTS.values()
    ):
        raise UserError(
            f"{checkpoint} is a {config.model_type} checkpoint, not a decoder-only zoo model; export takes what the "
            f"zoo trained or converted (`hf-attn-zoo list`); for a native checkpoint use `hf-attn-zoo import`."
        )
    return config


def target_format(config, to: str) -> str:
    """The format `to` resolves to for `config` ("native": the variant's own native architecture)."""
    from .models import get_variant

    if to not in FORMATS:
        raise UserError(f"--to {to} is not one of {', '.join(FORMATS)}.")
    if to != "native":
        return to
    variant = get_variant(config.model_type)
    native = variant.attention_class.native_format
    if native is None:
        raise UserError(
            f"{config.model_type} has no native transformers architecture: none computes its attention "
            f"({variant.description}); {INSTEAD}."
        )
    return native


def refusal(config, to: str) -> str | None:
    """Why format `to` (resolved) cannot hold the model `config` describes (a clause), or None."""
    from .convert.deepseek import deepseek_refusal
    from .convert.gguf_writer import gguf_refusal
    from .convert.llama import native_refusal
    from .convert.mamba import mamba_refusal

    if to == "gguf":
        return gguf_refusal(config)
    if to == "mamba":
        return mamba_refusal(config)
    if to == "deepseek_v3":
        return deepseek_refusal(config)
    return native_refusal(config, to)


def instead(config, target: str) -> str:
    """What to do with a checkpoint that format `target` refused."""
    from .models import get_variant

    native = get_variant(config.model_type).attention_class.native_format
    if target == "gguf" and native is not None:
        return f"export it --to {native} (transformers, vLLM) or {INSTEAD}"
    return INSTEAD


def check_dtype(to: str, dtype: str | None) -> str | None:
    from .convert.gguf_writer import GGUF_DTYPES

    allowed = GGUF_DTYPES if to == "gguf" else NATIVE_DTYPES
    if dtype is not None and dtype not in allowed:
        raise UserError(f"--dtype {dtype} does not apply to --to {to}; use one of {', '.join(allowed)}.")
    return dtype or ("f16" if to == "gguf" else None)


def generation_config_for(checkpoint: Path, native_config):
    """The checkpoint's generation config (or one made from the model config), as the native model takes it."""
    from transformers import GenerationConfig

    if (checkpoint / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(checkpoint)
    return GenerationConfig.from_model_config(native_config)


def export_card(config, target: str, source: str, extra: str = "") -> str:
    """The model card of an exported folder: what it is, where it came from, how to load it."""
    import yaml

    from .cards import card_metadata
    from .serving import VLLM_CPU_GAPS, VLLM_NATIVE_MISMATCHES

    native = target != "gguf"
    metadata = card_metadata(config, tags=[target, "hf-attn-zoo-export"])
    if not native:
        metadata.pop("library_name")  # llama.cpp reads the file, not transformers; the Hub reads the "gguf" tag
    use = (
        [
            "```python",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            'model = AutoModelForCausalLM.from_pretrained("PATH")  # no remote code: a native transformers model',
            'tokenizer = AutoTokenizer.from_pretrained("PATH")',
            "```",
            "",
            (
                f"Not for vLLM: {VLLM_NATIVE_MISMATCHES[target]}; serve it with transformers."
                if target in VLLM_NATIVE_MISMATCHES  # a format's name is its model_type
                else f"Not for vLLM on CPUs: {VLLM_CPU_GAPS[target]}; on CPUs serve it with transformers."
                if target in VLLM_CPU_GAPS
                else f"vLLM (`vllm serve PATH`), TGI and SGLang load it as they load any other {target} checkpoint."
            ),
        ]
        if native
        else [
            "```sh",
            f"llama-cli -m {extra} -p 'def '",
            f"ollama create NAME -f Modelfile   # Modelfile: FROM ./{extra}",
            "```",
        ]
    )
    lines = [
        "---",
        yaml.safe_dump(metadata, sort_keys=False, allow_unicode=True).rstrip("\n"),
        "---",
        "",
        f"# {config.model_type} as {target}",
        "",
        f"A `{config.variant_name}` model from the `hf_attn_zoo` package "
        f"({config.description}), exported from `{source}` by `hf-attn-zoo export --to {target}`: the same function "
        f"in {'the native ' + target + ' architecture of transformers' if native else 'a GGUF file for llama.cpp'}.",
        f"Paper: {config.paper}.",
        "",
        "## Use",
        "",
        *use,
        "",
    ]
    return "\n".join(lines)


def publish(staging: Path, output_dir: Path) -> None:
    """Move a finished staging folder to `output_dir` (absent, or an empty folder)."""
    if output_dir.exists():
        output_dir.rmdir()  # empty: check_output_folder refused anything else
    staging.rename(output_dir)


def staging_folder(output_dir: Path) -> Path:
    """A hidden folder beside `output_dir` for the export in progress (one left by a crash is replaced)."""
    staging = output_dir.with_name(f".{output_dir.name}.partial")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def export_checkpoint(
    checkpoint: str | os.PathLike, to: str, output_dir: str | os.PathLike, *, dtype: str | None = None
) -> Path:
    """Export the zoo checkpoint folder `checkpoint` to format `to` (`FORMATS`) in `output_dir`; returns the folder
    (native formats) or the GGUF file. `dtype`: float32 / float16 / bfloat16 for native formats (default: as
    saved), f32 / f16 / q8_0 for GGUF (default f16). Refusals are `UserError`s, raised before anything is written."""
    import torch
    from transformers import AutoTokenizer

    from .convert.deepseek import to_deepseek
    from .convert.gguf_writer import write_gguf
    from .convert.llama import to_native
    from .convert.mamba import to_mamba
    from .loading import TOKENIZER_FILES
    from .models import get_variant

    checkpoint, output_dir = Path(checkpoint).expanduser(), Path(output_dir).expanduser()
    check_output_folder(output_dir)
    config = zoo_config(checkpoint)
    target = target_format(config, to)
    dtype = check_dtype(target, dtype)
    reason = refusal(config, target)
    if reason is not None:
        raise UserError(
            f"{checkpoint} ({config.model_type}) cannot be exported --to {target}: {reason}; "
            f"{instead(config, target)}."
        )
    has_tokenizer = any((checkpoint / name).is_file() for name in TOKENIZER_FILES)
    if target == "gguf" and not has_tokenizer:
        raise MissingPathError(
            f"{checkpoint} has no tokenizer files ({' or '.join(TOKENIZER_FILES)}), and a GGUF file carries its "
            f"tokenizer; save one into the checkpoint with tokenizer.save_pretrained({str(checkpoint)!r})."
        )

    tokenizer = AutoTokenizer.from_pretrained(checkpoint) if has_tokenizer else None
    model = get_variant(config.model_type).causal_lm_class.from_pretrained(checkpoint, dtype=torch.float32).eval()
    staging = staging_folder(output_dir)
    try:
        if target == "gguf":
            name = output_dir.name
            write_gguf(model, tokenizer, staging / f"{name}.gguf", dtype=dtype, name=name)
            card = export_card(config, "gguf", str(checkpoint), f"{name}.gguf")
            (staging / "README.md").write_text(card, encoding="utf-8")
            publish(staging, output_dir)
            return output_dir / f"{name}.gguf"
        if target == "deepseek_v3":
            native = to_deepseek(model)
        elif target == "mamba":
            native = to_mamba(model)
        else:
            native = to_native(model, target)
        saved_dtype = getattr(torch, dtype) if dtype else (config.dtype or torch.float32)
        if isinstance(saved_dtype, str):
            saved_dtype = getattr(torch, saved_dtype)
        native = native.to(saved_dtype)
        native.config.dtype = saved_dtype
        native.generation_config = generation_config_for(checkpoint, native.config)
        native.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        (staging / "README.md").write_text(export_card(config, target, str(checkpoint)), encoding="utf-8")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    publish(staging, output_dir)
    return output_dir


def import_checkpoint(checkpoint: str | os.PathLike, output_dir: str | os.PathLike) -> Path:
    """A native checkpoint folder (Llama, Mistral, Qwen2, dense DeepSeek-V2/V3, Mamba) saved as the zoo variant
    computing the same function (`from_llama`, `from_mistral`, `from_deepseek`, `from_mamba`), with its tokenizer and
    a zoo model card."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .checkpoints import save_checkpoint
    from .convert.deepseek import DEEPSEEK_TYPES, from_deepseek
    from .convert.llama import LLAMA_FAMILY, from_llama, from_mistral
    from .convert.mamba import from_mamba
    from .loading import TOKENIZER_FILES, check_model_folder

    checkpoint, output_dir = Path(checkpoint).expanduser(), Path(output_dir).expanduser()
    check_output_folder(output_dir)
    check_model_folder(checkpoint, tokenizer=False)
    config = AutoConfig.from_pretrained(checkpoint)
    if config.model_type not in (*LLAMA_FAMILY, *DEEPSEEK_TYPES, "mamba"):
        raise UserError(
            f"{checkpoint} is a {config.model_type} checkpoint; import takes {', '.join(LLAMA_FAMILY)}, dense "
            f"{' / '.join(DEEPSEEK_TYPES)} and mamba ones."
        )
    native = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    try:
        if config.model_type in DEEPSEEK_TYPES:
            model = from_deepseek(native)
        elif config.model_type == "mamba":
            model = from_mamba(native)
        elif config.model_type == "mistral":
            model = from_mistral(native)
        else:
            model = from_llama(native)
    except ValueError as error:
        raise UserError(f"{checkpoint}: {error}") from error
    if (checkpoint / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(checkpoint)
    has_tokenizer = any((checkpoint / name).is_file() for name in TOKENIZER_FILES)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint) if has_tokenizer else None
    if output_dir.exists():
        output_dir.rmdir()  # empty: check_output_folder refused anything else
    details = {"converted from": f"{checkpoint} ({config.model_type})"}
    return save_checkpoint(output_dir, model, tokenizer=tokenizer, training=details)


__all__ = ["FORMATS", "NATIVE_FORMATS", "export_checkpoint", "import_checkpoint", "refusal", "target_format"]
