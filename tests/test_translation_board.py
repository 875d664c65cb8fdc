"""The translation board (experiments/translation/: cells.py, board.py, claims.py, report.py): a tiny board end to
end on synthetic verse pairs, resuming and refusing other options, failing cells, parameter matching at the committed
scale, the verdicts on synthetic rows, and the docs' verdicts being the committed board's own."""

import csv
import dataclasses
import json
import shutil

import pytest

from experiments.translation import board, cells, claims, report
from hf_attn_zoo.pairs import default_pairs

BOOKS = ["Alpha", "Beta", "Gamma", "Mark", "Luke", "Acts"]


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    """pairs.tsv of the embedded English/Spanish phrases spread over six books, as the Bible corpus lays them out."""
    folder = tmp_path_factory.mktemp("bible")
    with (folder / "pairs.tsv").open("w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle, delimiter="\t", quoting=csv.QUOTE_NONE, escapechar="\\")
        writer.writerow(["ref", "en", "es"])
        for index, pair in enumerate(default_pairs()):
            book = BOOKS[index % len(BOOKS)]
            writer.writerow([f"{book} {index // 100 + 1}:{index % 100 + 1}", pair["source"], pair["target"]])
    return folder


def tiny_setup(corpus_dir, output_dir, **fields) -> cells.TranslationSetup:
    options = {
        "output_dir": str(output_dir),
        "data_dir": str(corpus_dir),
        "seeds": [0],
        "rnns": ["none", "bahdanau"],
        "cross_attentions": ["mha", "mqa"],
        "natives": ["marian"],
        "encoders": ["sliding_window"],
        "uptrain_methods": ["mean", "aligned"],
        "alphas": [0.0, 0.5],
        "budget": 6000,  # a few steps of the recipes' token batches
        "hidden_size": 64,  # an RNN state unit is under 1% of the parameters from about here
        "num_layers": 1,
        "num_attention_heads": 4,
        "gqa_key_value_heads": 2,
        "vocab_size": 300,
        "max_length": 16,
        "fields": '{"sliding_window": 4}',
        "test_pairs": 12,
        "validation_pairs": 8,
        "num_beams": 2,
        "buckets": [8, 12, 16],
        "parent_factor": 2.0,
        "calibration_pairs": 40,
        "alignment_verses": 1,
    }
    return cells.TranslationSetup(**{**options, **fields})


def test_a_tiny_board_end_to_end(corpus_dir, tmp_path):
    setup = tiny_setup(corpus_dir, tmp_path, repairs=["ce", "transfer", "transfer_distill"])
    rows = board.run_board(setup, log=lambda _: None)
    names = [row["cell"] for row in rows]
    assert names[:7] == [
        "rnn-none-seed0",
        "rnn-bahdanau-seed0",
        "transformer-mha-seed0",
        "transformer-mqa-seed0",
        "native-marian-seed0",
        "encoder-sliding_window-seed0",
        "parent-mha-seed0",
    ]
    # two targets, two methods, two alphas at one seed; then transfer and transfer + distillation of the mean-pooled
    # conversion at alpha 0.5, for both targets
    assert len(rows) == 7 + 2 * 2 * 2 + 2 * 2
    assert names[-4:] == [
        "uptrain-gqa-mean+transfer-0.5-seed0",
        "uptrain-gqa-mean+transfer_distill-0.5-seed0",
        "uptrain-mqa-mean+transfer-0.5-seed0",
        "uptrain-mqa-mean+transfer_distill-0.5-seed0",
    ]
    for row in rows:
        assert "error" not in row, row.get("error")
        assert 0 <= row["bleu"] <= 100 and row["test_perplexity"] > 1 and row["cache_bytes_per_source_token"] >= 0
        assert set(row["bleu_by_length"]) == {"1-8", "9-12", "13-16"}
        if row["family"] != "uptrain":
            # parameters matched to the MHA Transformer's within 1%, beam search scored
            assert abs(row["parameters"] / row["matched_to"] - 1) <= 0.01
            assert "bleu_beam" in row
    by_name = {row["cell"]: row for row in rows}
    # the cache is measured on generate()'s: MHA keeps 1 layer x 4 heads x (16 + 16) floats per source token, MQA
    # one head (decoder self- and cross-attention pooled), the RNN without attention nothing
    assert by_name["transformer-mha-seed0"]["cache_bytes_per_source_token"] == 4 * 32 * 4
    assert by_name["transformer-mqa-seed0"]["cache_bytes_per_source_token"] == 32 * 4
    assert by_name["native-marian-seed0"]["cache_bytes_per_source_token"] == 4 * 32 * 4  # Marian's MHA, the same
    assert by_name["rnn-none-seed0"]["cache_bytes_per_source_token"] == 0
    assert by_name["rnn-bahdanau-seed0"]["cache_bytes_per_source_token"] > 0
    assert by_name["uptrain-gqa-mean-0-seed0"]["cache_bytes_per_source_token"] == 2 * 32 * 4
    assert by_name["uptrain-gqa-mean-0-seed0"]["steps"] == 0 and by_name["uptrain-gqa-mean-0.5-seed0"]["steps"] >= 1
    assert by_name["rnn-bahdanau-seed0"]["alignment"] and by_name["transformer-mha-seed0"]["alignment"]
    # transfer alone trains no step after it; with distillation as many steps as cross-entropy's on the same alpha
    transferred, distilled = (by_name[f"uptrain-mqa-mean+{r}-0.5-seed0"] for r in ("transfer", "transfer_distill"))
    assert transferred["steps"] == 0 and distilled["steps"] == by_name["uptrain-mqa-mean-0.5-seed0"]["steps"]
    for row in (transferred, distilled):
        assert row["transfer"]["relative_error_after"] < row["transfer"]["relative_error_before"]
        assert row["method"] == f"mean+{row['repair']}" and row["transfer"]["tokens"] > 0
    table = (tmp_path / "board.md").read_text()
    assert "Attention beats the same RNN without it" in table and "Mean pooling converts best" in table
    assert "reaches at least the BLEU of transformers' own MarianMTModel" in table
    assert "MQA transfer + distill test perplexity" in table
    assert claims.verdict_block(rows, setup) in table
    assert (tmp_path / "tokenizer").is_dir() and (tmp_path / "cells" / "parent-mha-seed0" / "final").is_dir()
    pytest.importorskip("matplotlib")
    for name in ("frontier.png", "lengths.png", "uptraining.png", "alignment.png"):
        assert (tmp_path / name).is_file(), name


def fake_row(cell: cells.Cell) -> dict:
    return {
        "cell": cell.name,
        "family": cell.family,
        "config": cell.config,
        "seed": cell.seed,
        "bleu": 1.0,
        "cell_seconds": 0.0,
    }


def test_a_rerun_runs_only_unfinished_cells_retries_failures_and_refuses_other_options(
    corpus_dir, tmp_path, monkeypatch
):
    setup = tiny_setup(corpus_dir, tmp_path, uptrain_methods=[], alphas=[], seeds=[0, 1], natives=[])
    ran, failed = [], []

    def flaky(setup, cell, corpus):
        ran.append(cell.name)
        if cell.name == "rnn-bahdanau-seed1" and not failed:  # fails the first time only
            failed.append(cell.name)
            raise RuntimeError("out of memory")
        return fake_row(cell)

    monkeypatch.setattr(board, "run_cell", flaky)
    monkeypatch.setattr(board, "write_board", lambda *args, **kwargs: None)
    rows = board.run_board(setup, log=lambda _: None)
    assert len(ran) == 10 and [r["cell"] for r in rows if "error" in r] == ["rnn-bahdanau-seed1"]
    assert "RuntimeError: out of memory" in rows[3]["error"]
    ran.clear()
    rows = board.run_board(setup, log=lambda _: None)
    assert ran == ["rnn-bahdanau-seed1"] and not any("error" in r for r in rows)
    ran.clear()
    board.run_board(setup, log=lambda _: None)
    assert ran == []
    with pytest.raises(SystemExit, match="other options"):
        board.run_board(tiny_setup(corpus_dir, tmp_path, uptrain_methods=[], alphas=[], natives=[], budget=9000))


def test_every_cell_of_the_committed_board_matches_the_mha_transformer_within_one_percent():
    """At the default sizes, the default families and the optional ones (additive cross-attention, the efficient
    encoders of the earlier board)."""
    encoders = ["sliding_window", "linformer", "aft_simple", "topk"]
    additive = ["mha", "gqa", "mqa", "additive"]
    setup = cells.TranslationSetup(output_dir="unused", cross_attentions=additive, encoders=encoders)
    tokens = {"vocab_size": 8000, "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0}
    tokens["decoder_start_token_id"] = 0
    seen = set()
    for cell in cells.plan(setup):
        if cell.family in ("rnn", "transformer", "native", "encoder") and (cell.family, cell.config) not in seen:
            seen.add((cell.family, cell.config))
            _, fields, count, target = board.cell_spec(setup, cell, tokens)
            assert abs(count / target - 1) <= 0.01, cell
    assert len(seen) == 12


def synthetic(family: str, config: str, bleus: list[float], **metrics) -> list[dict]:
    rows = []
    for seed, bleu in enumerate(bleus):
        row = {"cell": f"{family}-{config}-seed{seed}", "family": family, "config": config, "seed": seed}
        row |= {"bleu": bleu, "tokens_per_second": 1000.0, "cache_bytes_per_source_token": 2048.0}
        row |= {key: value[seed] if isinstance(value, list) else value for key, value in metrics.items()}
        rows.append(row)
    return rows


def buckets(short: list[float], long: list[float]) -> list[dict]:
    return [{"1-16": {"pairs": 10, "bleu": s}, "17-64": {"pairs": 10, "bleu": b}} for s, b in zip(short, long)]


def verdicts(rows: list[dict], **fields) -> dict[str, str]:
    setup = cells.TranslationSetup(output_dir="unused", encoders=["linformer"], buckets=[16, 64], **fields)
    return dict(claims.claims(rows, setup))


def test_claims_say_holds_only_where_the_seeds_do_not_overlap():
    rows = synthetic(
        "rnn", "none", [2.0, 2.2, 2.1], bleu_by_length=buckets([3, 3, 3], [1, 1, 1]), test_perplexity=[300.0] * 3
    )
    rows += synthetic(
        "rnn", "bahdanau", [5.0, 5.5, 5.2], bleu_by_length=buckets([4, 4, 4], [5, 6, 5]), test_perplexity=[200.0] * 3
    )
    rows += synthetic("rnn", "luong", [1.0, 6.0, 3.0], bleu_by_length=buckets([3, 3, 3], [1, 1, 1]))
    rows += synthetic("transformer", "mha", [4.0, 4.5, 4.2], tokens_per_second=[3000.0, 3100.0, 2900.0])
    rows += synthetic("transformer", "mqa", [4.1, 4.3, 4.4], cache_bytes_per_source_token=512.0)
    rows += synthetic("encoder", "linformer", [3.9, 4.0, 4.1])
    found = verdicts(rows, uptrain_methods=[])
    by_start = {claim.split(" (")[0]: verdict for claim, verdict in found.items()}
    assert by_start["Attention beats the same RNN without it"].startswith(
        "holds: RNN + Bahdanau 5.23 ± 0.25 [5.00 to 5.50]"
    )
    assert (
        "; on test perplexity holds: RNN + Bahdanau 200.0 ± 0.0" in by_start["Attention beats the same RNN without it"]
    )
    assert by_start["Luong's attention beats the same RNN without it"].startswith("within noise")
    # the gap grows from 1 (short) to 4-5 (long) on every seed
    assert found[next(c for c in found if c.startswith("The gain from attention"))].startswith("holds")
    assert by_start["The Transformer beats the RNN with attention at the same parameters"].startswith(
        "does not hold at this scale"
    )
    trains = found[next(c for c in found if c.startswith("The Transformer trains faster"))]
    assert trains.startswith("holds") and trains.count("holds") == 2
    mqa = by_start["MQA loses quality against MHA"]
    assert mqa.startswith("within noise") and "4x less" in mqa
    assert found[next(c for c in found if "(linformer)" in c)].startswith("holds")  # 4.0 is 94% of 4.23
    assert by_start["GQA cross- and decoder self-attention match MHA's quality at a fraction of its cache"].startswith(
        "not measured"
    )


def test_uptraining_claims_read_alpha_zero_against_the_uptrained_seeds():
    rows = synthetic("parent", "mha", [10.0])
    rows += synthetic("transformer", "gqa", [4.0, 4.2, 4.1])
    for target, at_zero, after in (("gqa", 6.0, [9.0, 9.2, 9.1]), ("mqa", 3.0, [8.0, 8.3, 8.1])):
        rows += synthetic("uptrain", f"{target}-mean-0", [at_zero], target=target, method="mean", alpha=0.0)
        rows += synthetic("uptrain", f"{target}-mean-0.05", after, target=target, method="mean", alpha=0.05)
        rows += synthetic("uptrain", f"{target}-aligned-0.05", [8.5, 9.5, 8.7], target=target, method="aligned")
    found = verdicts(rows, uptrain_methods=["mean", "aligned"], alphas=[0.0, 0.05])
    recovery = found[next(c for c in found if c.startswith("Uptraining on 0.05"))]
    assert recovery.startswith("GQA BLEU: holds") and "77% of the 4.00 lost regained" in recovery
    assert "MQA BLEU: holds" in recovery and "perplexity" not in recovery  # no perplexities in these rows
    mean = found[next(c for c in found if c.startswith("Mean pooling converts best"))]
    assert "GQA alpha 0.05 BLEU: holds (within noise): mean 9.10 ± 0.10 [9.00 to 9.20] against aligned" in mean
    table = found[next(c for c in found if c.startswith("Uptrained GQA comes close"))]
    assert table.startswith("BLEU: holds (order of the means)") and table.endswith("against one parent): worse")
    scratch = found[next(c for c in found if c.startswith("Uptraining beats training"))]
    assert scratch.startswith("GQA BLEU: holds")


def test_docs_verdicts_are_rewritten_between_the_markers(tmp_path):
    page = tmp_path / "page.md"
    begin, end = report.MARKERS
    page.write_text(f"# Page\n\n{begin}\nold verdicts\n{end}\n\nafter\n")
    assert report.write_docs("- **claim**: holds.", page)
    assert page.read_text() == f"# Page\n\n{begin}\n- **claim**: holds.\n{end}\n\nafter\n"
    plain = tmp_path / "plain.md"
    plain.write_text("no markers\n")
    assert not report.write_docs("- x", plain) and plain.read_text() == "no markers\n"
    half = tmp_path / "half.md"  # a page with one marker only is left as it is
    half.write_text(f"{begin}\nkept\n")
    assert not report.write_docs("- x", half) and half.read_text() == f"{begin}\nkept\n"
    assert not report.write_docs("- x", tmp_path / "absent.md") and not (tmp_path / "absent.md").exists()


def test_the_docs_verdicts_are_the_committed_boards_own():
    path = cells.STUDY / "results" / "board.json"
    if not path.is_file():
        pytest.skip("no committed translation board")
    stored = json.loads(path.read_text())
    # a board stored before the recipes held its batch and learning rate kept them as options of its own
    known = {option.name for option in dataclasses.fields(cells.TranslationSetup)}
    setup = cells.TranslationSetup(**{name: value for name, value in stored["defining"].items() if name in known})
    block = claims.verdict_block(stored["rows"], setup)
    # a process running a subset of the cells (one per core) writes the same verdicts: they are board.json's alone
    for subset in ({"uptrain_methods": []}, {"rnns": [], "natives": [], "cross_attentions": []}):
        assert claims.verdict_block(stored["rows"], dataclasses.replace(setup, **subset)) == block, subset
    begin, end = report.MARKERS
    docs = report.DOCS.read_text()
    assert docs.split(begin, 1)[1].split(end, 1)[0].strip() == block
    assert block in (path.parent / "board.md").read_text()
    readme = report.README.read_text().split("\n")
    assert report.readme_row(stored["rows"], setup) in readme


def test_the_readme_row_is_replaced_by_its_question(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"| q | m | w |\n{report.README_ROW} old | link |\n| other | row | x |\n")
    assert report.write_readme(f"{report.README_ROW} new | link |", readme)
    assert readme.read_text() == f"| q | m | w |\n{report.README_ROW} new | link |\n| other | row | x |\n"
    assert not report.write_readme("x", tmp_path / "absent.md")


def test_the_native_control_is_marian_at_the_recipes_sizes(tmp_path):
    """experiments/translation/native.py: a fresh MarianMTModel of the Transformer recipe's sizes and dropout with the
    zoo run's tokenizer, within 1% of the zoo model's trained parameters, saved where `model.init_from` reads it."""
    from transformers import AutoModelForSeq2SeqLM

    from experiments.translation import native
    from hf_attn_zoo.data import tokenizer_fields, train_byte_level_bpe
    from hf_attn_zoo.pairs import seq2seq_tokenizer
    from hf_attn_zoo.train.recipe import load_recipe

    recipe = str(cells.REPOSITORY / "configs" / "train" / "bible_en_es_transformer.yaml")
    texts = [text for pair in default_pairs() for text in (pair["source"], pair["target"])]
    tokenizer = seq2seq_tokenizer(train_byte_level_bpe(texts, 400))
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    assert native.main([recipe, str(tmp_path / "tokenizer"), str(tmp_path / "marian")]) == 0
    marian = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "marian")
    model_args, _, _ = load_recipe(recipe)
    zoo = AutoModelForSeq2SeqLM.from_config(
        model_args.seq2seq_config(**tokenizer_fields(tokenizer), decoder_start_token_id=tokenizer.bos_token_id)
    )
    config = marian.config
    assert type(marian).__name__ == "MarianMTModel" and config.d_model == zoo.config.hidden_size == 256
    assert (config.encoder_layers, config.decoder_layers, config.encoder_attention_heads) == (3, 3, 4)
    assert config.dropout == zoo.config.hidden_dropout == 0.1 and config.vocab_size == len(tokenizer)
    assert config.decoder_start_token_id == tokenizer.bos_token_id and config.pad_token_id == tokenizer.pad_token_id
    # Marian's sinusoid tables are parameters, but fixed (never trained)
    count = sum(p.numel() for name, p in marian.named_parameters() if "embed_positions" not in name)
    assert abs(count / sum(p.numel() for p in zoo.parameters()) - 1) < 0.01
    assert (tmp_path / "marian" / "tokenizer.json").is_file()  # model.init_from takes the checkpoint's tokenizer


def test_the_optional_families_claims_appear_where_their_cells_have_rows():
    """The core claims are listed from the start ("not measured"); the native control's, additive
    cross-attention's, an efficient encoder's and the uptraining's only once a row of theirs exists (a failed one
    too), whatever the setup's family lists say: the verdicts are a function of the rows."""
    setup = cells.TranslationSetup()

    def failed(family: str, config: str) -> dict:
        return {"cell": f"{family}-{config}-seed0", "family": family, "config": config, "seed": 0, "error": "x"}

    def listed(rows: list[dict]) -> list[str]:
        return [claim for claim, _ in claims.claims(rows, setup)]

    core = listed([])
    assert len(core) == 7 and all("not measured" in verdict for _, verdict in claims.claims([], setup))
    assert not any("Marian" in c or "additive" in c or "encoder (" in c or "parent" in c for c in core)
    rows = [failed("native", "marian"), failed("transformer", "additive"), failed("encoder", "linformer")]
    extra = [c for c in listed(rows) if c not in core]
    assert len(extra) == 3 and "MarianMTModel" in extra[0] and "additive" in extra[1] and "(linformer)" in extra[2]
    assert any("parent's steps" in c for c in listed([failed("parent", "mha")]))


def test_uptraining_cells_retrain_a_parent_whose_checkpoint_is_gone(corpus_dir, tmp_path):
    """Checkpoints are not committed: a board resumed in another clone has the parent's row but not its model. Its
    uptraining cells train the parent again (same seed, same budget) instead of failing."""
    only = {"rnns": [], "cross_attentions": [], "natives": [], "encoders": [], "repairs": ["ce"]}
    setup = tiny_setup(corpus_dir, tmp_path, uptrain_methods=["mean"], alphas=[0.5], **only)
    names = ["parent-mha-seed0", "uptrain-gqa-mean-0.5-seed0", "uptrain-mqa-mean-0.5-seed0"]
    rows = board.run_board(setup, log=lambda _: None)
    assert [row["cell"] for row in rows] == names
    shutil.rmtree(tmp_path / "cells")
    stored = json.loads((tmp_path / "board.json").read_text())
    stored["rows"] = stored["rows"][:2]  # the MQA cell still to run
    (tmp_path / "board.json").write_text(json.dumps(stored))
    rows = board.run_board(setup, log=lambda _: None)
    assert [row["cell"] for row in rows] == names
    assert not any("error" in row for row in rows) and (tmp_path / "cells" / "parent-mha-seed0" / "final").is_dir()
    assert rows[0] == stored["rows"][0]  # the parent's row as it was
