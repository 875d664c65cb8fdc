"""Translation end to end: the tiny recipe trains zoo_rnn on the embedded pairs through `Seq2SeqTrainer` and saves a
checkpoint transformers loads and generates from; pair files of every kind read; the shared tokenizer keeps Spanish
accents; `translate-eval` scores as sacrebleu does; `attention` draws the cross-attention; the Transformer recipe
trains an encoder-decoder both commands read; bad input is one line, exit status 2 and nothing written; the Bible
corpus split (when ../shared/data/bible_en_es is there) keeps every verse of a test book out of training."""

import csv as csv_module
import json
import shutil
from pathlib import Path

import pytest
import sacrebleu
import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

from hf_attn_zoo.data import DataArguments
from hf_attn_zoo.errors import UserError
from hf_attn_zoo.evaluation.translation import translation_budget
from hf_attn_zoo.models import get_variant
from hf_attn_zoo.pairs import default_pairs, read_pair_files, split_pairs, write_pairs
from hf_attn_zoo.train import load_recipe, run_training
from hf_attn_zoo_cli import main

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "train" / "tiny_translation.yaml"
TRANSFORMER_RECIPE = ROOT / "configs" / "train" / "tiny_translation_transformer.yaml"
BIBLE = ROOT.parent / "shared" / "data" / "bible_en_es" / "pairs.tsv"
STEPS = ["--training.max_steps", "40", "--training.eval_steps", "40", "--training.save_steps", "20"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The output folder of a short run of the tiny recipe (40 steps, a few seconds)."""
    output = tmp_path_factory.mktemp("translation") / "run"
    run_training(*load_recipe(RECIPE, [*STEPS, "--training.output_dir", str(output)]))
    return output


def test_the_tiny_recipe_saves_a_translator_transformers_loads(trained):
    final = trained / "final"
    model = AutoModelForSeq2SeqLM.from_pretrained(final).eval()
    tokenizer = AutoTokenizer.from_pretrained(final)
    generation = json.loads((final / "generation_config.json").read_text())
    assert generation["decoder_start_token_id"] == model.config.decoder_start_token_id is not None
    assert generation["num_beams"] == 1 and generation["max_length"] == 33  # max_target_length + the start token
    inputs = tokenizer(["I see the book.", "They do not have the key."], return_tensors="pt", padding=True)
    generated = model.generate(**inputs)  # (2, T)
    assert generated.shape[0] == 2 and (generated[:, 0] == model.config.decoder_start_token_id).all()
    summary = json.loads((trained / "training_summary.json").read_text())
    assert summary["task"] == "seq2seq" and summary["steps"] == 40
    for key in ("validation_bleu", "validation_chrf", "validation_perplexity"):
        assert summary[key] >= 0 and summary[key] == json.loads((final / "training_summary.json").read_text())[key]
    assert summary["validation_perplexity"] < len(tokenizer)  # learnt something beyond a uniform guess
    assert summary["evaluations"][-1]["eval_bleu"] == summary["validation_bleu"]
    seconds = [entry["elapsed_seconds"] for entry in summary["evaluations"]]  # the curve of BLEU against time
    assert seconds == sorted(seconds) and 0 < seconds[-1] <= summary["seconds"]
    assert (trained / "checkpoint-40" / "checkpoint_complete.json").is_file()
    assert len((trained / "validation_pairs.jsonl").read_text().splitlines()) == summary["validation_pairs"]


def test_resuming_a_finished_translation_run_writes_nothing(trained, capsys):
    before = (trained / "training_summary.json").read_text()
    overrides = [*STEPS, "--training.output_dir", str(trained), "--training.resume_from_checkpoint", "latest"]
    summary = run_training(*load_recipe(RECIPE, overrides))
    assert "already finished at step 40" in capsys.readouterr().out
    assert summary == json.loads(before) and (trained / "training_summary.json").read_text() == before


def test_the_shared_tokenizer_round_trips_spanish_accents(trained):
    tokenizer = AutoTokenizer.from_pretrained(trained / "final")
    text = "¿Él está bajo el árbol? Sí, señor: la canción y el café de Ñuñoa."
    ids = tokenizer(text)["input_ids"]
    assert ids[-1] == tokenizer.eos_token_id  # every source and target ends with EOS, as in training
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def write_pair_files(folder: Path, pairs: list[dict[str, str]]) -> dict[str, Path]:
    """The pairs as a TSV, a CSV and a JSON lines file with columns en/es, and as a datasets folder holding a
    Hub-style `translation` column."""
    from datasets import Dataset

    tsv, csv, jsonl = folder / "pairs.tsv", folder / "pairs.csv", folder / "pairs.jsonl"
    tsv.write_text("ref\ten\tes\n" + "".join(f"{i}\t{p['source']}\t{p['target']}\n" for i, p in enumerate(pairs)))
    with csv.open("w", newline="") as handle:  # quoted as spreadsheets write it: inner quotes doubled
        writer = csv_module.writer(handle)
        writer.writerows([("en", "es"), *((p["source"], p["target"]) for p in pairs)])
    jsonl.write_text("".join(json.dumps({"en": p["source"], "es": p["target"]}) + "\n" for p in pairs))
    saved = folder / "saved"
    translations = [{"translation": {"en": p["source"], "es": p["target"]}} for p in pairs]
    Dataset.from_list(translations).save_to_disk(str(saved))
    return {"tsv": tsv, "csv": csv, "jsonl": jsonl, "datasets": saved}


def test_pair_files_of_every_kind_read_the_same_pairs(tmp_path):
    # a quotation mark opening a TSV cell is text (no quoting), and "NA"/"None" are words, not missing values
    pairs = [*default_pairs()[:5], {"source": '"None" NA', "target": "«Ninguno» NA"}]
    files = write_pair_files(tmp_path, pairs)
    expected = [(p["source"], p["target"]) for p in pairs]
    for kind in ("tsv", "csv", "jsonl"):
        read = read_pair_files([files[kind]], "en", "es", "--data")
        assert list(zip(read["source"], read["target"])) == expected, kind
    args = DataArguments(dataset_name=str(files["datasets"]), source_field="en", target_field="es", seed=0)
    splits = split_pairs(args)
    assert sorted(zip(*(splits[s]["source"] for s in ("train",)))) != []  # the split has training pairs
    together = [*zip(splits["train"]["source"], splits["train"]["target"])]
    together += [*zip(splits["validation"]["source"], splits["validation"]["target"])]
    assert sorted(together) == sorted(expected)


def test_a_split_by_group_keeps_held_out_groups_out_of_training(tmp_path):
    pairs = default_pairs()[:60]
    tsv = tmp_path / "pairs.tsv"
    tsv.write_text(
        "ref\tsource\ttarget\n"
        + "".join(f"B{i % 3} {i}:1\t{p['source']}\t{p['target']}\n" for i, p in enumerate(pairs))
    )
    args = DataArguments(
        train_files=[str(tsv)],
        split_by="ref",
        split_pattern=r"^(\S+) \d+:\d+$",
        validation_groups=["B1"],
        test_groups=["B2"],
    )
    splits = split_pairs(args)
    assert {ref.split()[0] for ref in splits["train"]["ref"]} == {"B0"}
    assert {ref.split()[0] for ref in splits["validation"]["ref"]} == {"B1"}
    assert {ref.split()[0] for ref in splits["test"]["ref"]} == {"B2"} and len(splits["test"]) == 20
    # the pairs files a run writes keep the split column: the split can be checked from them
    rows = [json.loads(line) for line in write_pairs(splits["test"], tmp_path / "test.jsonl").read_text().splitlines()]
    assert [row["ref"] for row in rows] == splits["test"]["ref"] and rows[0]["source"] == splits["test"]["source"][0]


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    status = main([str(word) for word in argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_the_hour_report_reads_what_train_and_translate_eval_wrote(trained, tmp_path, capsys):
    """experiments/translation/hour.py over a run folder: the curve from training_summary.json, the test scores and
    translations from translate-eval's --out, ten examples by the fixed rule; a run not yet scored is named."""
    from experiments.translation import hour

    run = tmp_path / "tiny_rnn"
    shutil.copytree(trained, run, ignore=shutil.ignore_patterns("checkpoint-*"))
    with pytest.raises(SystemExit, match="translate-eval"):
        hour.main([str(run), "--out", str(tmp_path / "report")])
    shutil.copy(run / "validation_pairs.jsonl", run / "test_pairs.jsonl")  # the tiny recipe holds out no test books
    argv = ["translate-eval", run / "final", "--data", run / "test_pairs.jsonl", "--out", run / "test_scores.json"]
    assert run_cli(argv, capsys)[0] == 0
    assert hour.main([str(run), "--out", str(tmp_path / "report")]) == 0
    numbers = json.loads((tmp_path / "report" / "hour.json").read_text())[0]
    summary, scores = (json.loads((run / name).read_text()) for name in ("training_summary.json", "test_scores.json"))
    assert numbers["test"]["bleu"] == scores["bleu"] and numbers["steps"] == summary["steps"] == 40
    assert [point["step"] for point in numbers["curve"]] == [entry["step"] for entry in summary["evaluations"]]
    assert numbers["curve"][-1]["bleu"] == summary["validation_bleu"]
    pairs = [json.loads(line) for line in (run / "test_pairs.jsonl").read_text().splitlines()]
    report = (tmp_path / "report" / "hour.md").read_text()
    picked = [index * len(pairs) // 10 for index in range(10)]
    assert report.count("- reference: ") == 10 and picked[0] == 0
    # the curve by step: one column per evaluated step, the run's validation BLEU under it
    by_step = report.split("at each evaluation, by step:")[1].splitlines()
    header, row = by_step[2], next(line for line in by_step if line.startswith("| tiny_rnn |"))
    assert header == "| recipe | " + " | ".join(f"{point['step']:,}" for point in numbers["curve"]) + " |"
    assert row == "| tiny_rnn | " + " | ".join(f"{point['bleu']:.1f}" for point in numbers["curve"]) + " |"
    for index in picked:
        assert f"- reference: {pairs[index]['target']}" in report
        assert f"- tiny_rnn: {scores['translations'][index]}" in report


def test_the_hour_report_keeps_earlier_runs(trained, tmp_path, capsys):
    """A run joins the earlier runs of hour.json (their folders gone), a run given again replaces its row in place,
    no run folder redraws the report from hour.json alone, --fresh drops the earlier runs, and runs of another
    test file are refused."""
    from experiments.translation import hour

    report = tmp_path / "report"
    first, second = tmp_path / "first", tmp_path / "second"
    shutil.copytree(trained, first, ignore=shutil.ignore_patterns("checkpoint-*"))
    shutil.copy(first / "validation_pairs.jsonl", first / "test_pairs.jsonl")
    argv = [
        "translate-eval",
        first / "final",
        "--data",
        first / "test_pairs.jsonl",
        "--out",
        first / "test_scores.json",
    ]
    assert run_cli(argv, capsys)[0] == 0
    shutil.copytree(first, second)
    assert hour.main([str(first), "--out", str(report)]) == 0
    shutil.rmtree(first)
    assert hour.main([str(second), "--out", str(report)]) == 0
    rows = json.loads((report / "hour.json").read_text())
    assert [row["name"] for row in rows] == ["first", "second"] and rows[0]["examples"] == rows[1]["examples"]
    drawn = (report / "hour.md").read_text()
    assert "| first | rnn |" in drawn and "| second | rnn |" in drawn and drawn.count("- first: ") == 10

    summary = json.loads((second / "training_summary.json").read_text())
    summary["steps"] = 41
    (second / "training_summary.json").write_text(json.dumps(summary))
    assert hour.main([str(second), "--out", str(report)]) == 0
    rows = json.loads((report / "hour.json").read_text())
    assert [(row["name"], row["steps"]) for row in rows] == [("first", 40), ("second", 41)]
    assert hour.main(["--out", str(report)]) == 0
    assert (report / "hour.md").read_text() == hour.markdown(rows) + "\n"

    rows[0]["examples"][0]["source"] += " (another verse)"
    (report / "hour.json").write_text(json.dumps(rows))
    with pytest.raises(SystemExit, match="differ"):
        hour.main([str(second), "--out", str(report)])
    assert hour.main([str(second), "--out", str(report), "--fresh"]) == 0
    assert [row["name"] for row in json.loads((report / "hour.json").read_text())] == ["second"]
    with pytest.raises(SystemExit, match="no runs"):
        hour.main(["--out", str(tmp_path / "empty")])


def test_translate_eval_scores_as_sacrebleu_on_the_same_generations(trained, tmp_path, capsys):
    final, pairs = trained / "final", trained / "validation_pairs.jsonl"
    out = tmp_path / "scores.json"
    status, printed, _ = run_cli(["translate-eval", final, "--data", pairs, "--json", "--out", out], capsys)
    assert status == 0
    scores, written = json.loads(printed), json.loads(out.read_text())
    references = [json.loads(line)["target"] for line in pairs.read_text().splitlines()]
    translations = written["translations"]
    assert scores["bleu"] == pytest.approx(sacrebleu.corpus_bleu(translations, [references]).score, abs=1e-9)
    assert scores["chrf"] == pytest.approx(sacrebleu.corpus_chrf(translations, [references]).score, abs=1e-9)
    # the same generations, one source at a time (no padding): what the command scored, within the default budget
    model, tokenizer = AutoModelForSeq2SeqLM.from_pretrained(final).eval(), AutoTokenizer.from_pretrained(final)
    sources = [json.loads(line)["source"] for line in pairs.read_text().splitlines()]
    budget = translation_budget(model, max(len(ids) for ids in tokenizer(sources)["input_ids"]))
    assert budget >= model.generation_config.max_length - 1
    for source, translation in list(zip(sources, translations))[:8]:
        generated = model.generate(**tokenizer(source, return_tensors="pt"), max_new_tokens=budget)
        assert tokenizer.decode(generated[0], skip_special_tokens=True).strip() == translation
    # the references' perplexity: exp of the mean token NLL, by a plain loop over pairs
    total, count = 0.0, 0
    with torch.no_grad():
        for source, reference in zip(sources, references):
            labels = tokenizer(text_target=reference, return_tensors="pt")["input_ids"]  # (1, T)
            logits = model(**tokenizer(source, return_tensors="pt"), labels=labels).logits  # (1, T, V)
            total += torch.nn.functional.cross_entropy(logits[0], labels[0], reduction="sum").item()
            count += labels.shape[1]
    assert scores["reference_perplexity"] == pytest.approx(float(torch.tensor(total / count).exp()), rel=1e-5)
    # decoding's time and speed: the tokens generated are those of the translations scored
    assert scores["decode_seconds"] > 0 and scores["generated_tokens"] >= len(translations)
    assert scores["generated_tokens_per_second"] == pytest.approx(
        scores["generated_tokens"] / scores["decode_seconds"], rel=0.01
    )
    status, _, _ = run_cli(["translate-eval", final, "--data", pairs, "--num_beams", "3", "--json"], capsys)
    assert status == 0


def test_the_default_translation_budget_outgrows_the_training_length(trained):
    """A source longer than any the model trained on is not cut at the training targets' length."""
    model = AutoModelForSeq2SeqLM.from_pretrained(trained / "final")
    trained_length = model.generation_config.max_length - 1
    assert translation_budget(model, 4) == trained_length
    assert translation_budget(model, 100) == 160 > trained_length


def test_translate_prints_the_translations_of_texts_a_file_or_standard_input(trained, tmp_path, capsys, monkeypatch):
    """transformers 5 has no translation pipeline: `hf-attn-zoo translate` is how a checkpoint translates; its lines
    are `generate()`'s, one per source, whichever way the sources come."""
    import io

    final = trained / "final"
    sources = ["I see the book.", "They do not have the key.", "She does not want the coffee."]
    model, tokenizer = AutoModelForSeq2SeqLM.from_pretrained(final).eval(), AutoTokenizer.from_pretrained(final)
    budget = translation_budget(model, max(len(ids) for ids in tokenizer(sources)["input_ids"]))
    expected = [
        tokenizer.decode(model.generate(**tokenizer(s, return_tensors="pt"), max_new_tokens=budget)[0], True).strip()
        for s in sources
    ]
    status, printed, _ = run_cli(["translate", final, *sources], capsys)
    assert status == 0 and printed.splitlines() == expected
    (tmp_path / "sources.txt").write_text("\n".join(sources) + "\n")
    status, printed, _ = run_cli(["translate", final, "--file", tmp_path / "sources.txt", "--batch_size", "2"], capsys)
    assert status == 0 and printed.splitlines() == expected
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(sources)))
    status, printed, _ = run_cli(["translate", final], capsys)
    assert status == 0 and printed.splitlines() == expected
    status, _, err = run_cli(["translate", final, "--file", tmp_path / "none.txt"], capsys)
    assert status == 2 and "--file" in err and "does not exist" in err


def test_translations_batched_by_length_come_back_in_order_with_the_tokens_generated(trained):
    from hf_attn_zoo.evaluation.translation import generate_translations, generated_token_count, translate

    final = trained / "final"
    model, tokenizer = AutoModelForSeq2SeqLM.from_pretrained(final).eval(), AutoTokenizer.from_pretrained(final)
    sources = [json.loads(line)["source"] for line in (trained / "validation_pairs.jsonl").read_text().splitlines()]
    sources = sources[:7]
    out = generate_translations(model, tokenizer, sources, max_new_tokens=12, batch_size=3, by_length=True)
    assert out.texts == translate(model, tokenizer, sources, max_new_tokens=12, batch_size=3)
    # one source at a time (no padding): the tokens behind the start token up to and including the first EOS
    expected = 0
    for source, text in zip(sources, out.texts):
        generated = model.generate(**tokenizer(source, return_tensors="pt"), max_new_tokens=12)[0, 1:].tolist()
        ends = [i for i, token in enumerate(generated) if token == tokenizer.eos_token_id]
        expected += ends[0] + 1 if ends else len(generated)
        assert tokenizer.decode(generated, skip_special_tokens=True).strip() == text
    assert out.generated_tokens == expected
    # padding after a row's EOS is not generated work, whether the pad token is EOS (2) or another (0)
    rows = torch.tensor([[5, 6, 2, 2, 2], [5, 2, 0, 0, 0], [5, 6, 7, 8, 9]])  # (3, 5)
    assert generated_token_count(rows, 2) == 3 + 2 + 5 and generated_token_count(rows, None) == 15


def test_translating_with_a_saved_length_limit_warns_nothing(trained):
    """A trained translator saves `max_length` in its generation config; translating with a budget of new tokens
    must not make generate() warn on every batch that both limits are set."""
    import logging

    from hf_attn_zoo.evaluation.translation import translate

    final = trained / "final"
    model, tokenizer = AutoModelForSeq2SeqLM.from_pretrained(final).eval(), AutoTokenizer.from_pretrained(final)
    assert model.generation_config.max_length is not None
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("transformers.generation.utils")
    logger.addHandler(handler)
    try:
        texts = translate(model, tokenizer, ["I see the book."], max_new_tokens=12)
    finally:
        logger.removeHandler(handler)
    assert not [r for r in records if "seem to have been set" in r.getMessage()]
    expected = model.generate(**tokenizer("I see the book.", return_tensors="pt"), max_new_tokens=12)[0]
    assert texts == [tokenizer.decode(expected, skip_special_tokens=True).strip()]


def test_attention_draws_the_cross_attention_of_a_translator(trained, tmp_path, capsys):
    out = tmp_path / "map.png"
    status, printed, _ = run_cli(
        ["attention", trained / "final", "She does not want the coffee.", "--out", out], capsys
    )
    assert status == 0 and "cross-attention" in printed
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_transformer_recipe_trains_an_encoder_decoder_that_translate_eval_and_attention_read(tmp_path, capsys):
    """The Transformer recipe, a few steps: a GQA encoder-decoder with GQA cross-attention that `translate-eval`
    scores and `attention` draws (one panel per head of the chosen layer)."""
    output = tmp_path / "run"
    overrides = ["--training.max_steps", "10", "--training.eval_steps", "10", "--training.save_steps", "10"]
    summary = run_training(*load_recipe(TRANSFORMER_RECIPE, [*overrides, "--training.output_dir", str(output)]))
    assert summary["task"] == "seq2seq" and summary["steps"] == 10 and summary["validation_bleu"] >= 0
    capsys.readouterr()  # the run's logs: the command's JSON is read alone below
    final = output / "final"
    config = AutoModelForSeq2SeqLM.from_pretrained(final).config
    assert config.model_type == "zoo_gqa" and config.is_encoder_decoder and config.cross_attention == "dot"
    assert (config.num_attention_heads, config.cross_attention_num_key_value_heads) == (4, 2)
    status, printed, _ = run_cli(
        ["translate-eval", final, "--data", output / "validation_pairs.jsonl", "--json"], capsys
    )
    scores = json.loads(printed)
    assert status == 0 and scores["bleu"] >= 0 and scores["chrf"] >= 0 and scores["reference_perplexity"] > 1
    out = tmp_path / "map.png"
    text = "She does not want the coffee."
    status, printed, _ = run_cli(["attention", final, text, "--layer", "1", "--out", out], capsys)
    assert status == 0 and "cross-attention of layer 1, every head" in printed
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def decoder_only(trained, tmp_path_factory) -> Path:
    """A tiny causal LM checkpoint with the translator's tokenizer."""
    folder = tmp_path_factory.mktemp("lm") / "gqa"
    tokenizer = AutoTokenizer.from_pretrained(trained / "final")
    model = get_variant("gqa").build("tiny", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def bad_inputs(trained: Path, decoder_only: Path, folder: Path) -> dict[str, tuple[list, str]]:
    """name -> (command line, a word the one-line message must hold)."""
    final, pairs = trained / "final", trained / "validation_pairs.jsonl"
    empty = folder / "empty.tsv"
    empty.write_text("source\ttarget\nI see the book.\tYo veo el libro.\nI see the car.\t\n")
    missing = folder / "missing.jsonl"
    missing.write_text(json.dumps({"source": "I see the book.", "es": "Yo veo el libro."}) + "\n")
    no_start = folder / "no_start"
    shutil.copytree(final, no_start)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((no_start / name).read_text())
        config["decoder_start_token_id"] = None
        (no_start / name).write_text(json.dumps(config))
    out = ["--out", folder / "out.json"]
    return {
        "empty cell": (["translate-eval", final, "--data", empty, *out], "--target_field"),
        "missing column": (["translate-eval", final, "--data", missing, *out], "--target_field"),
        "source too long": (["translate-eval", final, "--data", pairs, "--max_source_length", "3", *out], "pair 1"),
        "no decoder start": (["translate-eval", no_start, "--data", pairs, *out], "decoder_start_token_id"),
        "decoder-only to translate-eval": (
            ["translate-eval", decoder_only, "--data", pairs, *out],
            "hf-attn-zoo eval",
        ),
        "translator to eval": (["eval", final, "--data", pairs], "translate-eval"),
        "attention without decoder start": (
            ["attention", no_start, "I see.", "--out", folder / "map.png"],
            "decoder_start",
        ),
    }


CASES = [
    "empty cell",
    "missing column",
    "source too long",
    "no decoder start",
    "decoder-only to translate-eval",
    "translator to eval",
    "attention without decoder start",
]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_exit_2_and_nothing_written(case, trained, decoder_only, tmp_path, capsys):
    argv, word = bad_inputs(trained, decoder_only, tmp_path)[case]
    before = sorted(tmp_path.rglob("*"))
    status, printed, error = run_cli(argv, capsys)
    assert status == 2 and printed == ""
    # one line (the progress bars of datasets and transformers share stderr), no traceback
    lines = [line for line in error.splitlines() if ": error:" in line]
    assert len(lines) == 1 and word in lines[0] and "Traceback" not in error, error
    assert sorted(tmp_path.rglob("*")) == before  # no scores, no map


def test_a_training_pair_longer_than_the_recipe_allows_is_refused_before_anything_is_written(tmp_path):
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text("source\ttarget\n" + "".join(f"{p['source']}\t{p['target']}\n" for p in default_pairs()[:40]))
    output = tmp_path / "run"
    overrides = [*STEPS, "--training.output_dir", str(output), "--data.train_files", str(pairs)]
    with pytest.raises(UserError, match=r"data\.max_source_length=4; raise data\.max_source_length"):
        run_training(*load_recipe(RECIPE, [*overrides, "--data.max_source_length", "4"]))
    assert not output.exists()
    with pytest.raises(UserError, match=r"data\.target_field='es' is not a column"):
        run_training(*load_recipe(RECIPE, [*overrides, "--data.target_field", "es"]))
    assert not output.exists()


@pytest.mark.skipif(not BIBLE.is_file(), reason="the Bible corpus (../shared/data/bible_en_es) is not here")
def test_the_bible_split_keeps_every_test_book_verse_out_of_training():
    _, data_args, _ = load_recipe(
        ROOT / "configs" / "train" / "bible_en_es_rnn.yaml", ["--data.train_files", str(BIBLE)]
    )
    splits = split_pairs(data_args)
    books = {name: {ref.rsplit(" ", 1)[0] for ref in splits[name]["ref"]} for name in splits}
    assert books["validation"] == {"Mark"} and books["test"] == {"Luke", "Acts"}
    assert not books["train"] & {"Mark", "Luke", "Acts"} and len(books["train"]) == 61
    test_sources = set(splits["test"]["source"])
    lines = BIBLE.read_text(encoding="utf-8").splitlines()[1:]
    assert len(splits["train"]) + len(splits["validation"]) + len(splits["test"]) == len(lines)
    held_out = [line.split("\t") for line in lines if line.split("\t")[0].rsplit(" ", 1)[0] in ("Luke", "Acts")]
    assert {source for _, source, _ in held_out} == test_sources
    assert not {ref for ref, _, _ in held_out} & set(splits["train"]["ref"])


def test_a_decoder_variant_is_a_language_model_unless_the_recipe_says_seq2seq():
    """Every decoder variant also has an encoder-decoder form (in SEQ2SEQ); naming it alone still trains a language
    model, as it did before translators existed. A translator-only model (rnn) is seq2seq by itself."""
    from hf_attn_zoo.train import ModelArguments

    assert not ModelArguments(variant="gqa").seq2seq
    assert ModelArguments(variant="gqa", task="seq2seq").seq2seq
    assert ModelArguments(variant="gqa", config='{"is_encoder_decoder": true}').seq2seq
    assert ModelArguments(variant="rnn").seq2seq
