"""Text -> tokens -> packed blocks, with `datasets` and `tokenizers`, nothing downloaded unless asked for.

- Text: local files, directories of them, or a `datasets` dataset. A file is one document when it is text (`.txt`,
  `.py`, `.md`, any UTF-8 file), or one document per record of its `text_field` column when it holds records
  (`.jsonl`/`.json`, `.parquet`, `.csv`, `.tsv`, read by `datasets`' own loaders). `dataset_name` is a folder written
  by `save_to_disk` (a `Dataset` or a `DatasetDict`) or a name `load_dataset` knows (a hub dataset when a hub is
  reachable). With nothing given, Python's own standard-library sources (`stdlib_corpus_files`): a real corpus
  present on every machine. Anything else (a binary file, an unknown kind of folder) is refused naming what is
  supported.
- Split: explicit validation files, or a deterministic split of the documents (`validation_fraction`, `seed`).
- Tokenizer: an existing one (path or name), or a byte-level BPE trained on the training text (`vocab_size`); ids
  0-255 of the byte-level alphabet are GPT-2's byte symbols, `<|endoftext|>` is BOS/EOS and separates documents.
- Packing: documents are tokenized in parallel (`Dataset.map`), each ended by EOS, joined and cut into blocks of
  `block_size` tokens (the last partial block is dropped). `packing="eos"`: `labels` equal to `input_ids`, and a
  token attends across document boundaries to the end of the previous document. `packing="documents"` (padding-free
  training, as transformers' `DataCollatorWithFlattening`): each block also carries `position_ids` restarting at 0
  at every document (and at the block's start, where a cut document goes on), so no token attends to another
  document and positions count from each document's start; a document's first token is not a target (-100).
"""

import codecs
import glob
import math
import sysconfig
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from .errors import MissingPathError, UserError

END_OF_TEXT = "<|endoftext|>"
PAD = "<|pad|>"
TEXT_SUFFIXES = {".txt", ".py", ".md", ".rst", ".text"}
PACKING = ("eos", "documents")
# files of records, one document per record: suffix -> (`datasets` loader, its keywords)
RECORD_FORMATS = {
    ".jsonl": ("json", {}),
    ".json": ("json", {}),
    ".parquet": ("parquet", {}),
    ".csv": ("csv", {}),
    ".tsv": ("csv", {"delimiter": "\t"}),
}
SUPPORTED = (
    "UTF-8 text files (one document each), .jsonl/.json, .parquet, .csv or .tsv files (one document per record, "
    "the data.text_field column), directories of them, or a datasets folder written by save_to_disk as "
    "data.dataset_name"
)


@dataclass
class DataArguments:
    """Where the text comes from and how it becomes training blocks."""

    train_files: list[str] = field(
        default_factory=list,
        metadata={
            "help": "text files, glob patterns or directories (.txt/.py/... one document per file; .jsonl, .json, "
            ".parquet, .csv, .tsv one per record); empty: Python's standard-library sources"
        },
    )
    validation_files: list[str] = field(
        default_factory=list, metadata={"help": "held-out files; empty: a split of the training documents"}
    )
    validation_fraction: float = field(
        default=0.05, metadata={"help": "share of the training documents held out when no validation files"}
    )
    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "a `datasets` dataset instead of files: a folder written by save_to_disk (Dataset or "
            "DatasetDict), or a name load_dataset knows (a hub name needs a reachable hub)"
        },
    )
    dataset_config: str | None = field(default=None, metadata={"help": "its configuration name"})
    text_field: str = field(
        default="text", metadata={"help": "the text column of record files (.jsonl, .parquet, .csv ...) and datasets"}
    )
    tokenizer: str | None = field(
        default=None, metadata={"help": "tokenizer path or name; empty: train a byte-level BPE on the training text"}
    )
    vocab_size: int = field(default=8192, metadata={"help": "vocabulary of the trained BPE (>= 258)"})
    block_size: int = field(default=256, metadata={"help": "tokens per training block"})
    packing: str = field(
        default="eos",
        metadata={
            "help": "how documents share a block: eos (joined with EOS, attending across boundaries) or documents "
            "(padding-free: position_ids restart at each document, which attends to itself only)"
        },
    )
    max_documents: int | None = field(
        default=None, metadata={"help": "use only the first N documents of each split (quick runs)"}
    )
    num_proc: int | None = field(default=None, metadata={"help": "processes for tokenization (default: one)"})
    seed: int = field(default=0, metadata={"help": "seed of the train/validation split"})
    # pairs, for sequence-to-sequence training (hf_attn_zoo.pairs)
    source_field: str = field(
        default="source", metadata={"help": "source column of pair files and datasets (or key of `translation`)"}
    )
    target_field: str = field(
        default="target", metadata={"help": "target column of pair files and datasets (or key of `translation`)"}
    )
    max_source_length: int = field(default=128, metadata={"help": "tokens of a source, EOS included"})
    max_target_length: int = field(default=128, metadata={"help": "tokens of a target, EOS included"})
    long_pairs: str = field(
        default="refuse",
        metadata={"help": "a pair over the lengths above: refuse (an error naming it), drop, truncate"},
    )
    split_by: str | None = field(
        default=None, metadata={"help": "column whose groups split the pairs (a book), instead of a random split"}
    )
    split_pattern: str | None = field(
        default=None,
        metadata={"help": "regular expression whose first group is the group of a split_by value; empty: the value"},
    )
    validation_groups: list[str] = field(default_factory=list, metadata={"help": "split_by groups to validate on"})
    test_groups: list[str] = field(
        default_factory=list, metadata={"help": "split_by groups held out of training and validation (a test set)"}
    )

    @property
    def pair_fields(self) -> tuple[str, str]:
        return self.source_field, self.target_field

    def __post_init__(self):
        if not 0 < self.validation_fraction < 1:
            raise UserError(f"data.validation_fraction must be in (0, 1), got {self.validation_fraction}.")
        if self.block_size < 2:
            raise UserError(f"data.block_size must be at least 2, got {self.block_size}.")
        if self.packing not in PACKING:
            raise UserError(f"data.packing={self.packing!r} is not one of {list(PACKING)}.")
        for name in ("max_source_length", "max_target_length"):
            if getattr(self, name) < 2:
                raise UserError(f"data.{name} must be at least 2 (a token and EOS), got {getattr(self, name)}.")
        if self.long_pairs not in ("refuse", "drop", "truncate"):
            raise UserError(f"data.long_pairs={self.long_pairs!r} is not one of ['refuse', 'drop', 'truncate'].")
        if (self.validation_groups or self.test_groups or self.split_pattern) and not self.split_by:
            raise UserError(
                "data.validation_groups, test_groups and split_pattern need data.split_by: set the column."
            )
        if self.tokenizer is None and self.vocab_size < 258:
            raise UserError(f"data.vocab_size must be >= 258 (256 bytes + 2 special tokens), got {self.vocab_size}.")


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters (the byte-level BPE alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return {b: chr(b if b in printable else next(shifted)) for b in range(256)}


def _wrap(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=END_OF_TEXT, eos_token=END_OF_TEXT, pad_token=PAD, padding_side="left"
    )


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer without merges: id b is byte b (0-255), then `<|endoftext|>` and `<|pad|>`."""
    vocab = {symbol: byte for byte, symbol in byte_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([END_OF_TEXT, PAD])
    return _wrap(tokenizer)


def train_byte_level_bpe(texts, vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2 pre-tokenization) trained on `texts` (an iterable of strings) with `tokenizers`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return _wrap(tokenizer)


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
        raise MissingPathError(f"no Python sources under {root}; set data.train_files to your own text files instead.")
    return sorted(files)


def expand_files(paths: list[str], field: str) -> list[Path]:
    """Files named, matched (glob patterns such as `sotu/19*.txt`) or contained in `paths` (directories
    recursively, text and JSON lines files), in that order. `field` names where the paths came from in errors
    (`data.train_files` in a recipe, `--data` on the command line)."""
    files = []
    for name in paths:
        path = Path(name).expanduser()
        if glob.has_magic(str(path)):
            matched = sorted(Path(p) for p in glob.glob(str(path)) if Path(p).is_file())
            if not matched:
                raise MissingPathError(f"{field}: no file matches {path}; fix the pattern.")
            files.extend(matched)
        elif path.is_dir():
            suffixes = TEXT_SUFFIXES | set(RECORD_FORMATS)
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in suffixes)
            if not found:
                raise MissingPathError(f"{field}: the directory {path} holds no text files ({sorted(suffixes)}).")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise MissingPathError(f"{field}: {path} does not exist; fix the path.")
    return files


def check_utf8_text(path: Path, field: str) -> None:
    """Refuse a file that is not UTF-8 text (a binary format read as a text document) by its first 64 KiB, naming
    what is supported, before `datasets` fails deep inside its text loader."""
    with path.open("rb") as handle:
        head = handle.read(1 << 16)
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)  # a character cut at the end is fine
        binary = b"\0" in head
    except UnicodeDecodeError:
        binary = True
    if binary:
        raise UserError(f"{field}: {path} is not UTF-8 text ({path.suffix or 'no suffix'}); supported: {SUPPORTED}.")


def text_column(records, text_field: str, source: str):
    """The `text_field` column of `records` (a `Dataset`) alone, named `text`."""
    if text_field not in records.column_names:
        raise UserError(
            f"data.text_field={text_field!r} is not a field of {source} (fields: {records.column_names}); set "
            f"data.text_field to the column that holds the text."
        )
    records = records.select_columns([text_field])  # before renaming: another column may be called `text`
    return records if text_field == "text" else records.rename_column(text_field, "text")


def load_documents(files: list[Path], text_field: str, field: str = "data.train_files"):
    """A `datasets.Dataset` with one `text` per document: a whole text file, or one record of a file of records
    (`RECORD_FORMATS`). `field` names where the files came from in errors."""
    from datasets import concatenate_datasets, load_dataset

    parts = []
    text_files = [f for f in files if f.suffix not in RECORD_FORMATS]
    for path in text_files:
        check_utf8_text(path, field)
    if text_files:
        parts.append(load_dataset("text", data_files=list(map(str, text_files)), sample_by="document", split="train"))
    by_suffix: dict[str, list[str]] = {}
    for path in files:
        if path.suffix in RECORD_FORMATS:
            by_suffix.setdefault(path.suffix, []).append(str(path))
    for suffix, names in by_suffix.items():
        loader, options = RECORD_FORMATS[suffix]
        records = load_dataset(loader, data_files=names, split="train", **options)
        parts.append(text_column(records, text_field, names[0]))
    return concatenate_datasets(parts) if len(parts) > 1 else parts[0]


def load_named_dataset(args: "DataArguments"):
    """(train, validation or None) documents of `data.dataset_name`: a folder written by `save_to_disk` (a `Dataset`
    is the training split; a `DatasetDict` needs `train` and may have `validation`), or a name `load_dataset`
    knows."""
    from datasets import Dataset, load_dataset, load_from_disk

    name, folder = args.dataset_name, Path(args.dataset_name).expanduser()
    saved = folder.is_dir() and any((folder / marker).is_file() for marker in ("dataset_dict.json", "state.json"))
    if saved:
        loaded = load_from_disk(str(folder))
    elif folder.is_dir() and not any(folder.iterdir()):
        raise MissingPathError(f"data.dataset_name={name}: the folder is empty; supported: {SUPPORTED}.")
    else:
        loaded = load_dataset(name, args.dataset_config)
    if isinstance(loaded, Dataset):
        return text_column(loaded, args.text_field, name), None
    if "train" not in loaded:
        raise UserError(
            f"data.dataset_name={name} has the splits {list(loaded)} and no `train`; save the training documents "
            f"as the `train` split (and held-out ones as `validation`)."
        )
    validation = loaded["validation"] if "validation" in loaded else None
    if validation is not None:
        validation = text_column(validation, args.text_field, f"{name} (validation)")
    return text_column(loaded["train"], args.text_field, name), validation


def load_text_splits(args: DataArguments):
    """`DatasetDict` with `train` and `validation` documents (column `text`)."""
    from datasets import DatasetDict

    if args.dataset_name is not None:
        train, validation = load_named_dataset(args)
    else:
        train = (
            load_documents(expand_files(args.train_files, "data.train_files"), args.text_field)
            if args.train_files
            else load_documents(stdlib_corpus_files(), "text")
        )
        validation = None
        if args.validation_files:
            files = expand_files(args.validation_files, "data.validation_files")
            validation = load_documents(files, args.text_field, "data.validation_files")
    train = train.filter(is_document)
    if len(train) == 0:
        raise UserError("the training corpus is empty: every document is blank; check data.train_files.")
    if validation is None:
        if len(train) < 2:
            raise UserError("one training document cannot be split; add data.validation_files or more documents.")
        split = train.train_test_split(test_size=args.validation_fraction, seed=args.seed, shuffle=True)
        train, validation = split["train"], split["test"]
    else:
        validation = validation.filter(is_document)
    if args.max_documents is not None:
        train = train.select(range(min(args.max_documents, len(train))))
        validation = validation.select(range(min(args.max_documents, len(validation))))
    return DatasetDict(train=train, validation=validation)


def is_document(record: dict) -> bool:
    """A record with text in it: not blank, not a missing value (an empty cell of a table is None)."""
    return isinstance(record["text"], str) and bool(record["text"].strip())


def build_tokenizer(args: DataArguments, train_documents) -> PreTrainedTokenizerBase:
    if args.tokenizer is not None:
        try:
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        except OSError as error:  # neither a folder with a tokenizer nor a name the hub (or its cache) knows
            raise MissingPathError(f"data.tokenizer={args.tokenizer!r} cannot be loaded: {error}") from error
        if tokenizer.eos_token_id is None:
            raise UserError(f"data.tokenizer={args.tokenizer!r} has no EOS token to separate documents with.")
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer
    batches = (train_documents[i : i + 256]["text"] for i in range(0, len(train_documents), 256))
    return train_byte_level_bpe((text for batch in batches for text in batch), args.vocab_size)


def pack_blocks(
    documents,
    tokenizer: PreTrainedTokenizerBase,
    block_size: int,
    num_proc: int | None = None,
    packing: str = "eos",
):
    """Tokenize documents in parallel, end each with EOS, join them and cut blocks of `block_size` tokens (see the
    module docstring for `packing`)."""
    eos = tokenizer.eos_token_id

    def tokenize(batch):
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [document + [eos] for document in ids]}

    def group(batch):
        stream = [token for document in batch["input_ids"] for token in document]
        usable = len(stream) // block_size * block_size
        blocks = [stream[i : i + block_size] for i in range(0, usable, block_size)]
        if packing == "eos":
            return {"input_ids": blocks, "labels": [list(block) for block in blocks]}
        position_ids, labels = [], []
        for block in blocks:
            positions, position = [], 0
            for token in block:
                positions.append(position)
                position = 0 if token == eos else position + 1  # the token after EOS starts a document
            position_ids.append(positions)
            labels.append([-100 if at == 0 else token for token, at in zip(block, positions)])
        return {"input_ids": blocks, "labels": labels, "position_ids": position_ids}

    tokens = documents.map(tokenize, batched=True, num_proc=num_proc, remove_columns=documents.column_names)
    return tokens.map(group, batched=True, batch_size=1000, num_proc=num_proc)


def prepare_data(args: DataArguments):
    """(tokenizer, train blocks, validation blocks, unigram baseline perplexity of the validation blocks)."""
    splits = load_text_splits(args)
    tokenizer = build_tokenizer(args, splits["train"])
    train = pack_blocks(splits["train"], tokenizer, args.block_size, args.num_proc, args.packing)
    validation = pack_blocks(splits["validation"], tokenizer, args.block_size, args.num_proc, args.packing)
    for name, blocks in (("training", train), ("validation", validation)):
        if len(blocks) == 0:
            raise UserError(
                f"the {name} text gives fewer than data.block_size={args.block_size} tokens: lower block_size or "
                f"add text."
            )
    return tokenizer, train, validation, unigram_perplexity(train, validation, len(tokenizer))


def unigram_perplexity(train_blocks, validation_blocks, vocab_size: int) -> float:
    """Perplexity on the validation tokens of the training tokens' unigram distribution (add-one smoothed): the
    baseline a language model must beat. Scored like the model: the targets of each block (every token but the
    first; with `packing="documents"`, no document's first token)."""
    counts = Counter()
    for block in train_blocks["input_ids"]:
        counts.update(block)
    total = sum(counts.values()) + vocab_size
    nll, scored = 0.0, 0
    for block, labels in zip(validation_blocks["input_ids"], validation_blocks["labels"]):
        for token, label in zip(block[1:], labels[1:]):
            if label == -100:
                continue
            nll -= math.log((counts[token] + 1) / total)
            scored += 1
    return math.exp(nll / scored)
