"""Data: files and directories, JSON lines, the split, the BPE tokenizer, packing and the unigram baseline."""

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
