"""Data: every documented input kind (text files, JSON lines, Parquet, CSV/TSV, saved datasets), the split, the BPE
tokenizer, packing and the unigram baseline; unsupported input refused in one line."""

import json

import pytest

from hf_attn_zoo.data import (
    DataArguments,
    byte_level_tokenizer,
    load_text_splits,
    pack_blocks,
    prepare_data,
    stdlib_corpus_files,
    train_byte_level_bpe,
    unigram_perplexity,
)
from hf_attn_zoo.errors import UserError

TEXT = "def add(a, b):\n    return a + b  # sum, ünïcode too\n"


def test_byte_tokenizer_is_bytes():
    tokenizer = byte_level_tokenizer()
    assert tokenizer(TEXT)["input_ids"] == list(TEXT.encode())
    assert (len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id) == (258, 256, 257)


def test_trained_bpe_round_trips_and_compresses():
    tokenizer = train_byte_level_bpe([TEXT * 50, "class A:\n    pass\n" * 30], vocab_size=300)
    assert 258 < len(tokenizer) <= 300
    ids = tokenizer(TEXT)["input_ids"]
    assert tokenizer.decode(ids) == TEXT and len(ids) < len(TEXT.encode())
    assert tokenizer.decode(tokenizer("any text at all: 日本語")["input_ids"]) == "any text at all: 日本語"


def test_files_directories_and_json_lines(tmp_path):
    (tmp_path / "docs").mkdir()
    for i in range(4):
        (tmp_path / "docs" / f"{i}.txt").write_text(f"document {i}\nsecond line\n")
    records = tmp_path / "records.jsonl"
    records.write_text("\n".join(json.dumps({"body": f"record {i}", "id": i}) for i in range(3)))
    validation = tmp_path / "held_out.txt"
    validation.write_text("held out text\n")
    args = DataArguments(
        train_files=[str(tmp_path / "docs"), str(records)], validation_files=[str(validation)], text_field="body"
    )
    splits = load_text_splits(args)
    assert sorted(splits["train"]["text"])[:2] == ["document 0\nsecond line\n", "document 1\nsecond line\n"]
    assert sum(text.startswith("record") for text in splits["train"]["text"]) == 3
    assert splits["validation"]["text"] == ["held out text\n"]
    with pytest.raises(ValueError, match="text_field='text' is not a field"):
        load_text_splits(DataArguments(train_files=[str(records)], validation_files=[str(validation)]))


RECORDS = [{"id": i, "text": f"record {i} " + "words " * i, "title": f"t{i}"} for i in range(12)]


def write_records(kind: str, folder) -> dict:
    """`RECORDS` (text in the column `text`, beside others) written as `kind`; the DataArguments that read them."""
    from datasets import Dataset, DatasetDict

    records = Dataset.from_list(RECORDS)
    path = folder / {"dataset": "saved", "dataset_dict": "saved"}.get(kind, f"records.{kind}")
    if kind in ("jsonl", "json"):
        lines = [json.dumps(record) for record in RECORDS]
        path.write_text("\n".join(lines) if kind == "jsonl" else json.dumps(RECORDS))
    elif kind == "parquet":
        records.to_parquet(str(path))
    elif kind in ("csv", "tsv"):
        records.to_csv(str(path), index=False, sep="," if kind == "csv" else "\t")
    elif kind == "dataset":
        records.save_to_disk(str(path))
    else:
        DatasetDict(train=records.select(range(10)), validation=records.select(range(10, 12))).save_to_disk(str(path))
    return {"dataset_name": str(path)} if kind.startswith("dataset") else {"train_files": [str(path)]}


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "csv", "tsv", "dataset", "dataset_dict"])
def test_every_input_kind_reads_its_text_column(kind, tmp_path):
    """The default `text_field` is `text`, in files of records beside other columns, and in saved datasets."""
    splits = load_text_splits(DataArguments(**write_records(kind, tmp_path)))
    assert splits["train"].column_names == splits["validation"].column_names == ["text"]
    documents = sorted([*splits["train"]["text"], *splits["validation"]["text"]])
    assert documents == sorted(record["text"] for record in RECORDS)
    if kind == "dataset_dict":  # its own validation split, not a fraction of the training one
        assert sorted(splits["validation"]["text"]) == sorted(record["text"] for record in RECORDS[10:])


def test_another_column_named_text_does_not_get_in_the_way(tmp_path):
    records = tmp_path / "records.jsonl"
    records.write_text("\n".join(json.dumps({"body": f"body {i}", "text": "not this"}) for i in range(4)))
    splits = load_text_splits(DataArguments(train_files=[str(records)], text_field="body"))
    assert sorted([*splits["train"]["text"], *splits["validation"]["text"]]) == [f"body {i}" for i in range(4)]


def test_a_directory_reads_text_and_record_files_together(tmp_path):
    write_records("parquet", tmp_path)
    (tmp_path / "notes.txt").write_text("a whole file is one document\n")
    splits = load_text_splits(DataArguments(train_files=[str(tmp_path)]))
    assert len(splits["train"]) + len(splits["validation"]) == len(RECORDS) + 1


def test_unsupported_input_is_refused_naming_what_is_supported(tmp_path):
    from datasets import Dataset, DatasetDict

    binary = tmp_path / "table.xlsx"
    binary.write_bytes(b"PK\x03\x04" + bytes(range(256)) * 4)
    with pytest.raises(
        UserError, match=r"data\.train_files: .*table\.xlsx is not UTF-8 text .*supported: .*\.parquet"
    ):
        load_text_splits(DataArguments(train_files=[str(binary)]))
    with pytest.raises(UserError, match=r"data\.validation_files: .*table\.xlsx is not UTF-8"):
        load_text_splits(DataArguments(**write_records("csv", tmp_path), validation_files=[str(binary)]))
    with pytest.raises(UserError, match=r"data\.text_field='body' is not a field of .*\['id', 'text', 'title'\]"):
        load_text_splits(DataArguments(**write_records("parquet", tmp_path), text_field="body"))
    splits_without_train = tmp_path / "no_train"
    DatasetDict(test=Dataset.from_list(RECORDS)).save_to_disk(str(splits_without_train))
    with pytest.raises(UserError, match=r"has the splits \['test'\] and no `train`"):
        load_text_splits(DataArguments(dataset_name=str(splits_without_train)))


def test_split_is_deterministic_and_by_document():
    args = DataArguments(validation_fraction=0.1, seed=3)
    first, second = load_text_splits(args), load_text_splits(args)
    assert first["validation"]["text"] == second["validation"]["text"]
    assert not set(first["validation"]["text"]) & set(first["train"]["text"])
    assert len(first["train"]) + len(first["validation"]) <= len(stdlib_corpus_files())


def test_packing_joins_documents_with_eos_in_full_blocks():
    from datasets import Dataset

    tokenizer = byte_level_tokenizer()
    documents = Dataset.from_dict({"text": ["ab", "cde", "f"]})
    blocks = pack_blocks(documents, tokenizer, block_size=3)
    eos = tokenizer.eos_token_id
    a, b, c, d, e, f = b"abcdef"
    assert blocks["input_ids"] == [[a, b, eos], [c, d, e], [eos, f, eos]]
    assert blocks["labels"] == blocks["input_ids"]
    assert "position_ids" not in blocks.column_names


def test_document_packing_restarts_positions_and_targets_at_each_document():
    from datasets import Dataset

    tokenizer = byte_level_tokenizer()
    documents = Dataset.from_dict({"text": ["ab", "cde", "f"]})
    blocks = pack_blocks(documents, tokenizer, block_size=3, packing="documents")
    eos, x = tokenizer.eos_token_id, -100
    a, b, c, d, e, f = b"abcdef"
    assert blocks["input_ids"] == [[a, b, eos], [c, d, e], [eos, f, eos]]  # the same blocks as EOS packing
    # a block's start and the token after each EOS start a document: position 0, not a target
    assert blocks["position_ids"] == [[0, 1, 2], [0, 1, 2], [0, 0, 1]]
    assert blocks["labels"] == [[x, b, eos], [x, d, e], [x, x, eos]]
    with pytest.raises(ValueError, match="data.packing"):
        DataArguments(packing="padding")


def test_unigram_baseline_known_answer():
    # training tokens 0..3 once each; vocabulary 6: p = (1 + 1) / (4 + 6) for each scored token -> perplexity 5
    train = {"input_ids": [[0, 1, 2, 3]]}
    validation = {"input_ids": [[5, 0, 1, 2, 3]], "labels": [[5, 0, 1, 2, 3]]}  # a block's first is no target
    assert unigram_perplexity(train, validation, 6) == pytest.approx(5.0)
    validation = {"input_ids": [[5, 0, 1, 4, 2, 3]], "labels": [[5, 0, 1, -100, 2, 3]]}  # nor is a -100 label
    assert unigram_perplexity(train, validation, 6) == pytest.approx(5.0)


def test_prepare_data_reports_a_baseline_and_refuses_tiny_corpora(tmp_path):
    tokenizer, train, validation, unigram = prepare_data(DataArguments(max_documents=6, vocab_size=300, block_size=32))
    assert len(train[0]["input_ids"]) == 32 and unigram > 1
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(ValueError, match="block_size"):
        prepare_data(DataArguments(train_files=[str(short)], validation_files=[str(short)], block_size=64))


def test_missing_paths_are_named_as_such(tmp_path):
    from hf_attn_zoo.data import expand_files
    from hf_attn_zoo.errors import MissingPathError

    with pytest.raises(MissingPathError, match=r"data\.train_files: .*missing\.txt does not exist"):
        expand_files([str(tmp_path / "missing.txt")], "data.train_files")
    with pytest.raises(MissingPathError, match=r"data\.train_files: no file matches"):
        expand_files([str(tmp_path / "*.txt")], "data.train_files")
    (tmp_path / "empty").mkdir()
    with pytest.raises(MissingPathError, match=r"holds no text files"):
        expand_files([str(tmp_path / "empty")], "data.validation_files")
    (tmp_path / "a.txt").write_text(TEXT)
    (tmp_path / "b.txt").write_text(TEXT)
    args = DataArguments(
        train_files=[str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], tokenizer=str(tmp_path / "no")
    )
    with pytest.raises(MissingPathError, match=r"data\.tokenizer="):
        prepare_data(args)
