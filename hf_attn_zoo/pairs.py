"""Sentence pairs for translation: reading them, splitting them, a shared tokenizer and the model's inputs.

- Pairs: `.tsv`, `.csv`, `.jsonl`/`.json` files (`datasets`' loaders), or a `datasets` dataset (`data.dataset_name`:
  a folder written by `save_to_disk` or a name `load_dataset` knows). The source and target columns are
  `data.source_field` / `data.target_field` (default `source` / `target`; `en` / `es` for the Bible corpus), or keys
  of a `translation` column as Hub translation datasets hold them (`{"en": ..., "es": ...}`). With nothing given,
  `default_pairs()`: English/Spanish phrases built here, a corpus every installation has. A missing column or an
  empty cell is refused naming the file, the row and the field.
- Split: explicit validation files; or by group (`data.split_by` a column, `data.split_pattern` a regular expression
  whose first group is the group of a value, `data.validation_groups` / `data.test_groups`): no pair of a held-out
  group is trained on, as a split by book needs; or a deterministic random split (`data.validation_fraction`).
- Tokenizer: one byte-level BPE (`hf_attn_zoo.data.train_byte_level_bpe`) trained on source and target text together,
  so both sides share a vocabulary (and the model its embedding); it ends every text with `<|endoftext|>` as Marian's
  tokenizers end theirs with `</s>`, and pads on the right, where `DataCollatorForSeq2Seq` pads labels.
- Inputs: `input_ids`/`attention_mask` of the source and `labels` of the target; a pair longer than
  `data.max_source_length` / `data.max_target_length` tokens is refused (`data.long_pairs: refuse`), dropped or cut.
"""

import json
import re
from pathlib import Path

from tokenizers import processors
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from .data import END_OF_TEXT, DataArguments, expand_files, train_byte_level_bpe
from .errors import MissingPathError, UserError

# files of pairs, one pair per record: suffix -> (`datasets` loader, its keywords). Tables keep every cell as text
# ("NA", "None" and "null" are words of some pair) and only an empty cell is missing; tab-separated files have no
# quoting, so a quotation mark opening a sentence is text, not a quoted field.
PAIR_FORMATS = {
    ".tsv": ("csv", {"delimiter": "\t", "quoting": 3, "keep_default_na": False, "na_values": [""]}),
    ".csv": ("csv", {"keep_default_na": False, "na_values": [""]}),
    ".jsonl": ("json", {}),
    ".json": ("json", {}),
}
LONG_PAIRS = ("refuse", "drop", "truncate")

# the embedded corpus: English and Spanish subjects, verbs conjugated in the present tense, and objects
_SUBJECTS = [("I", "Yo", 0), ("You", "Tú", 1), ("He", "Él", 2), ("She", "Ella", 2), ("We", "Nosotros", 3)]
_SUBJECTS += [("They", "Ellos", 4)]
_VERBS = [  # English base form, third person, and the Spanish forms for yo, tú, él/ella, nosotros, ellos
    ("see", "sees", ("veo", "ves", "ve", "vemos", "ven")),
    ("want", "wants", ("quiero", "quieres", "quiere", "queremos", "quieren")),
    ("have", "has", ("tengo", "tienes", "tiene", "tenemos", "tienen")),
    ("need", "needs", ("necesito", "necesitas", "necesita", "necesitamos", "necesitan")),
    ("buy", "buys", ("compro", "compras", "compra", "compramos", "compran")),
    ("find", "finds", ("encuentro", "encuentras", "encuentra", "encontramos", "encuentran")),
]
_OBJECTS = [
    ("the book", "el libro"),
    ("the house", "la casa"),
    ("the coffee", "el café"),
    ("the song", "la canción"),
    ("the tree", "el árbol"),
    ("the pencil", "el lápiz"),
    ("the table", "la mesa"),
    ("the car", "el coche"),
    ("the key", "la llave"),
    ("the map", "el mapa"),
    ("the bread", "el pan"),
    ("the window", "la ventana"),
]


def default_pairs() -> list[dict[str, str]]:
    """864 short English/Spanish sentence pairs (`source`, `target`): every subject, verb and object above, said
    and negated ("I see the book." / "Yo veo el libro.", "She does not want the key." / "Ella no quiere la
    llave."). Accents (tú, él, café, canción, árbol, lápiz) are in the vocabulary a tokenizer learns from them."""
    pairs = []
    for english_subject, spanish_subject, person in _SUBJECTS:
        third = person == 2
        for base, third_form, spanish_forms in _VERBS:
            verb, spanish_verb = (third_form if third else base), spanish_forms[person]
            negated = "does not" if third else "do not"
            for english_object, spanish_object in _OBJECTS:
                pairs.append(
                    {
                        "source": f"{english_subject} {verb} {english_object}.",
                        "target": f"{spanish_subject} {spanish_verb} {spanish_object}.",
                    }
                )
                pairs.append(
                    {
                        "source": f"{english_subject} {negated} {base} {english_object}.",
                        "target": f"{spanish_subject} no {spanish_verb} {spanish_object}.",
                    }
                )
    return pairs


def _pair_columns(records, source_field: str, target_field: str, where: str, keep: list[str], fix: str):
    """`records` (a `Dataset`) as columns `source` and `target` (and the `keep` columns), from the named fields or
    from a `translation` column's keys; a field that is neither is refused naming `where` and the fix."""
    columns = records.column_names
    if source_field not in columns and target_field not in columns and "translation" in columns:
        first = records[0]["translation"] if len(records) else {}
        if isinstance(first, dict) and source_field in first and target_field in first:
            records = records.map(
                lambda record: {
                    source_field: record["translation"].get(source_field),
                    target_field: record["translation"].get(target_field),
                },
                remove_columns=["translation"],
            )
            columns = records.column_names
    for name, value in (("source_field", source_field), ("target_field", target_field)):
        if value not in columns:
            raise UserError(
                f"{fix}{name}={value!r} is not a column of {where} (columns: {columns}); set {fix}{name} to the "
                f"column that holds the {name.removesuffix('_field')} text."
            )
    for name in keep:
        if name not in columns:
            raise UserError(f"data.split_by={name!r} is not a column of {where} (columns: {columns}); fix it.")
    records = records.select_columns([source_field, target_field, *keep])  # before renaming: names may collide
    return records.map(
        lambda record: {"source": record[source_field], "target": record[target_field]},
        remove_columns=[c for c in (source_field, target_field) if c not in ("source", "target")],
    ).select_columns(["source", "target", *keep])


def check_pairs(records, where: str, source_field: str, target_field: str, fix: str) -> None:
    """Refuse an empty or missing cell (a blank line, a record without the key): the pair teaches nothing and,
    left in, a translation of nothing or into nothing."""
    for name, column, field_name in (("source", "source", source_field), ("target", "target", target_field)):
        for row, text in enumerate(records[column], start=1):
            if not isinstance(text, str) or not text.strip():
                raise UserError(
                    f"{where}: pair {row} has an empty {name} ({fix}{name}_field={field_name!r}); fill it in or "
                    f"remove the pair."
                )


def read_pair_files(
    files: list[Path], source_field: str, target_field: str, field: str, keep: list[str] = (), fix: str = "data."
):
    """A `Dataset` of pairs (`source`, `target` and the `keep` columns) from files of `PAIR_FORMATS`, each checked
    for its columns and empty cells. `field` names where the files came from in errors, `fix` the option prefix
    (`data.` in a recipe, `--` on the command line)."""
    from datasets import concatenate_datasets, load_dataset

    parts = []
    for path in files:
        if path.suffix not in PAIR_FORMATS:
            raise UserError(
                f"{field}: {path} is not a file of pairs; supported: {', '.join(PAIR_FORMATS)} files with a "
                f"source and a target column, or a datasets folder as data.dataset_name."
            )
        loader, options = PAIR_FORMATS[path.suffix]
        try:
            records = load_dataset(loader, data_files=[str(path)], split="train", **options)
        except Exception as error:  # datasets' loaders raise their parsers' errors, all meaning "not this format"
            raise UserError(
                f"{field}: {path} cannot be read as {path.suffix} pairs ({error}); fix the file."
            ) from None
        records = _pair_columns(records, source_field, target_field, str(path), list(keep), fix)
        check_pairs(records, str(path), source_field, target_field, fix)
        parts.append(records)
    return concatenate_datasets(parts) if len(parts) > 1 else parts[0]


def _named_pairs(args: DataArguments, keep: list[str]):
    """(train, validation or None, test or None) pairs of `data.dataset_name`."""
    from datasets import Dataset, load_dataset, load_from_disk

    name, folder = args.dataset_name, Path(args.dataset_name).expanduser()
    if folder.is_dir() and any((folder / marker).is_file() for marker in ("dataset_dict.json", "state.json")):
        loaded = load_from_disk(str(folder))
    else:
        loaded = load_dataset(name, args.dataset_config)
    splits = {"train": loaded} if isinstance(loaded, Dataset) else dict(loaded)
    if "train" not in splits:
        raise UserError(f"data.dataset_name={name} has the splits {list(splits)} and no `train`; save one as train.")
    found = []
    for split in ("train", "validation", "test"):
        if split not in splits:
            found.append(None)
            continue
        where = f"{name} ({split})"
        records = _pair_columns(splits[split], args.source_field, args.target_field, where, keep, "data.")
        check_pairs(records, where, args.source_field, args.target_field, "data.")
        found.append(records)
    return tuple(found)


def group_of(value: str, pattern: str | None) -> str:
    """The group a `data.split_by` value belongs to: the first group of `pattern` matched at its start (the book of
    `Genesis 1:1` with `^(.*) \\d+:\\d+$`), or the whole value without a pattern."""
    if pattern is None:
        return value
    match = re.match(pattern, value)
    if match is None:
        raise UserError(f"data.split_pattern={pattern!r} does not match the data.split_by value {value!r}; fix it.")
    return match.group(1) if match.groups() else match.group(0)


def split_pairs(args: DataArguments):
    """`DatasetDict` with `train` and `validation` pairs, and `test` where `data.test_groups` (or a dataset's own
    `test` split) holds some out; see the module docstring for the ways of splitting."""
    from datasets import Dataset, DatasetDict

    keep = [args.split_by] if args.split_by else []
    test = None
    if args.dataset_name is not None:
        train, validation, test = _named_pairs(args, keep)
    elif args.train_files:
        train = read_pair_files(
            expand_files(args.train_files, "data.train_files"), *args.pair_fields, "data.train_files", keep
        )
        validation = None
        if args.validation_files:
            files = expand_files(args.validation_files, "data.validation_files")
            validation = read_pair_files(files, *args.pair_fields, "data.validation_files", keep)
    else:
        if keep:
            raise UserError("data.split_by needs data.train_files or data.dataset_name with that column; remove it.")
        train, validation = Dataset.from_list(default_pairs()), None
    if args.split_by:
        groups = [group_of(str(value), args.split_pattern) for value in train[args.split_by]]
        known = set(groups)
        for name in ("validation_groups", "test_groups"):
            unknown = sorted(set(getattr(args, name)) - known)
            if unknown:
                raise UserError(
                    f"data.{name}: {unknown} are not groups of data.split_by={args.split_by!r} (some groups: "
                    f"{sorted(known)[:8]}); fix the names or data.split_pattern."
                )
        held_out = {"validation": set(args.validation_groups), "test": set(args.test_groups)}
        indices = {"train": [], "validation": [], "test": []}
        for i, group in enumerate(groups):
            split = next((name for name, chosen in held_out.items() if group in chosen), "train")
            indices[split].append(i)
        if args.validation_groups:
            validation = train.select(indices["validation"])
        if args.test_groups:
            test = train.select(indices["test"])
        train = train.select(indices["train"])
    if validation is None:
        if len(train) < 2:
            raise UserError("one training pair cannot be split; add data.validation_files or more pairs.")
        split = train.train_test_split(test_size=args.validation_fraction, seed=args.seed, shuffle=True)
        train, validation = split["train"], split["test"]
    if len(train) == 0 or len(validation) == 0:
        empty = "training" if len(train) == 0 else "validation"
        raise UserError(f"the {empty} pairs are empty after the split; check data.validation_groups / test_groups.")
    if args.max_documents is not None:
        train = train.select(range(min(args.max_documents, len(train))))
        validation = validation.select(range(min(args.max_documents, len(validation))))
    splits = {"train": train, "validation": validation} | ({"test": test} if test is not None else {})
    return DatasetDict(splits)


def seq2seq_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """`tokenizer` ending every text with EOS (a fast tokenizer without its own post-processing gets one that
    appends it) and padding on the right: `DataCollatorForSeq2Seq` pads labels on the tokenizer's side, and labels
    padded on the left would put padding between the decoder's start token and the target."""
    if tokenizer.eos_token_id is None:
        raise UserError("data.tokenizer has no EOS token to end sources and targets with; choose another tokenizer.")
    ids = tokenizer("a")["input_ids"]
    if not ids or ids[-1] != tokenizer.eos_token_id:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise UserError("data.tokenizer does not end texts with EOS and is not a fast tokenizer; choose another.")
        eos = (tokenizer.eos_token, tokenizer.eos_token_id)
        backend.post_processor = processors.TemplateProcessing(
            single=f"$A {eos[0]}", pair=f"$A {eos[0]} $B {eos[0]}", special_tokens=[eos]
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    return tokenizer


def build_pair_tokenizer(args: DataArguments, train_pairs) -> PreTrainedTokenizerBase:
    """`data.tokenizer` loaded, or a byte-level BPE of `data.vocab_size` trained on the training pairs' source and
    target text together (one shared vocabulary), made to end texts with EOS (`seq2seq_tokenizer`)."""
    if args.tokenizer is not None:
        try:
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        except OSError as error:
            raise MissingPathError(f"data.tokenizer={args.tokenizer!r} cannot be loaded: {error}") from error
        return seq2seq_tokenizer(tokenizer)

    def texts():
        for start in range(0, len(train_pairs), 256):
            batch = train_pairs[start : start + 256]
            yield from batch["source"]
            yield from batch["target"]

    tokenizer = train_byte_level_bpe(texts(), args.vocab_size)
    assert tokenizer.eos_token == END_OF_TEXT
    return seq2seq_tokenizer(tokenizer)


def tokenize_pairs(pairs, tokenizer: PreTrainedTokenizerBase, args: DataArguments, where: str):
    """The model's inputs of `pairs`: `input_ids`, `attention_mask` (source) and `labels` (target), each ending in
    EOS, with pairs longer than `data.max_source_length` / `data.max_target_length` refused, dropped or cut
    (`data.long_pairs`)."""

    def tokenize(batch):
        inputs = tokenizer(batch["source"])
        inputs["labels"] = tokenizer(text_target=batch["target"])["input_ids"]
        return inputs

    tokens = pairs.map(tokenize, batched=True, num_proc=args.num_proc, remove_columns=pairs.column_names)
    limits = (("input_ids", "source", args.max_source_length), ("labels", "target", args.max_target_length))
    if args.long_pairs == "refuse":
        for column, side, limit in limits:
            for row, ids in enumerate(tokens[column], start=1):
                if len(ids) > limit:
                    raise UserError(
                        f"{where}: pair {row} has a {side} of {len(ids)} tokens, more than data.max_{side}_length="
                        f"{limit}; raise data.max_{side}_length, or set data.long_pairs to drop or truncate."
                    )
    elif args.long_pairs == "drop":
        tokens = tokens.filter(
            lambda record: (
                len(record["input_ids"]) <= args.max_source_length and len(record["labels"]) <= args.max_target_length
            )
        )
    else:

        def cut(record):
            # the last token stays EOS: a cut text still ends as every text the model reads
            source, target = record["input_ids"], record["labels"]
            if len(source) > args.max_source_length:
                source = source[: args.max_source_length - 1] + source[-1:]
            if len(target) > args.max_target_length:
                target = target[: args.max_target_length - 1] + target[-1:]
            return {"input_ids": source, "attention_mask": [1] * len(source), "labels": target}

        tokens = tokens.map(cut)
    return tokens


def write_pairs(pairs, path: Path) -> Path:
    """`pairs` (`source`, `target`, and the `data.split_by` column where the split kept it, so that the split can be
    checked from the file) as a JSON lines file, one pair per line: what `hf-attn-zoo translate-eval` reads back
    exactly (any character, tabs and quotes included)."""
    columns = ["source", "target", *(name for name in pairs.column_names if name not in ("source", "target"))]
    with path.open("w", encoding="utf-8") as handle:
        for row in zip(*(pairs[name] for name in columns)):
            handle.write(json.dumps(dict(zip(columns, row)), ensure_ascii=False) + "\n")
    return path
