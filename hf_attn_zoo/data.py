"""Text and tokenizers that need no download.

- `byte_level_tokenizer()`: a `PreTrainedTokenizerFast` over the 256 bytes (GPT-2's byte-to-unicode alphabet) plus
  special tokens; it encodes any text losslessly and is saved and reloaded like any transformers tokenizer.
- `stdlib_corpus_files()`: Python's own standard-library sources, located through `sysconfig`: real text present on
  every machine that runs this package, used when no corpus is given.
"""

import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

END_OF_TEXT = "<|endoftext|>"
PAD = "<|pad|>"


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters (the byte-level BPE alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return {b: chr(b if b in printable else next(shifted)) for b in range(256)}


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: id b is byte b (0-255), then `<|endoftext|>` (BOS and EOS) and `<|pad|>`."""
    vocab = {symbol: byte for byte, symbol in byte_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=END_OF_TEXT, eos_token=END_OF_TEXT, pad_token=PAD, padding_side="left"
    )


def tokenizer_fields(tokenizer: PreTrainedTokenizerBase) -> dict[str, int | None]:
    """The config fields a model takes from its tokenizer: vocabulary size and special token ids."""
    return {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def stdlib_corpus_files() -> list[Path]:
    """The `.py` files of the running interpreter's standard library (tests and site-packages excluded), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    excluded = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    files = [path for path in root.rglob("*.py") if not excluded.intersection(path.relative_to(root).parts)]
    if not files:
        raise FileNotFoundError(f"no Python sources under {root}; pass your own text files instead")
    return sorted(files)
