"""The command line: `list`, `--help` of every command, both spellings of options, and the main job `demo`."""

import argparse
import json
import math
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_attn_zoo import cli
from hf_attn_zoo.models import VARIANTS
from hf_attn_zoo_cli import build_parser, main

TINY_RECIPE = Path(__file__).resolve().parents[1] / "configs" / "train" / "tiny_gqa.yaml"


def test_list_prints_every_variant(capsys):
    assert main(["list"]) == 0
    table = capsys.readouterr().out
    for name, variant in VARIANTS.items():
        row = next(line for line in table.splitlines() if line.startswith(f"| `{name}` "))
        assert variant.model_type in row and variant.cache_per_token in row
        assert f"| {', '.join(variant.backends)} |" in row and "eager" in variant.backends


def command_paths(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command and subcommand of the CLI, e.g. ("train",)."""
    paths = [prefix]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, subparser in action.choices.items():
                paths += command_paths(subparser, (*prefix, name))
    return paths


COMMANDS = command_paths(build_parser())


def test_every_command_is_walked():
    assert {("train",), ("eval",), ("convert",), ("demo",)} <= set(COMMANDS)


@pytest.mark.parametrize("path", COMMANDS, ids=lambda path: " ".join(path) or "hf-attn-zoo")
def test_help_prints_usage(path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*path, "--help"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert printed.startswith("usage: hf-attn-zoo" + "".join(f" {p}" for p in path))


def test_train_help_lists_the_recipe_fields(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    printed = capsys.readouterr().out
    assert "model: variant, size" in printed and "learning_rate" in printed


def test_options_take_underscores_and_dashes():
    parser = build_parser()
    for spelling in ("--max_length", "--max-length"):
        namespace = parser.parse_args(["eval", "model", "--data", "a.txt", spelling, "64", "--trust-remote-code"])
        assert namespace.max_length == 64 and namespace.trust_remote_code is True and namespace.model == "model"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_demo_trains_scores_generates_and_saves(variant, tmp_path, capsys):
    out = tmp_path / "demo"
    args = ["--variant", variant, "--output_dir", str(out), "--max_steps", "3", "--max_documents", "8"]
    assert main(["demo", *args, "--max_new_tokens", "5"]) == 0
    printed = capsys.readouterr().out
    perplexity = float(printed.split("validation perplexity ")[1].split(";")[0])
    baseline = float(printed.split("unigram baseline of the same data ")[1].split()[0])
    assert math.isfinite(perplexity) and math.isfinite(baseline) and baseline > 1
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["steps"] == 3 and summary["variant"] == variant
    model, tokenizer = (
        AutoModelForCausalLM.from_pretrained(out / "final"),
        AutoTokenizer.from_pretrained(out / "final"),
    )
    ids = tokenizer("def f():", return_tensors="pt").input_ids
    assert model(ids).logits.shape == (1, ids.shape[1], len(tokenizer))
    assert tokenizer.decode(ids[0]) == "def f():"


# user errors: one line on stderr, exit status 2; bugs keep their traceback


def test_help_and_version_answer_without_importing_the_package():
    """`--help` and `--version` need only the front (hf_attn_zoo_cli): torch and the package stay unimported."""
    code = (
        "import sys, contextlib, io, hf_attn_zoo_cli\n"
        "for argv in (['--help'], ['--version'], ['eval', '--help'], ['convert', '--help']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        hf_attn_zoo_cli.main(argv)\n"
        "print(sorted(name for name in ('torch', 'hf_attn_zoo') if name in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=600)
    assert result.stdout.strip() == "[]"


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"hf-attn-zoo {version('hf-attn-zoo')}"


def saved_model(folder: Path, tokenizer: bool = True, **overrides) -> Path:
    """A tiny zoo_gqa checkpoint with 256 positions (and its byte-level tokenizer) in `folder`."""
    from hf_attn_zoo.data import byte_level_tokenizer, tokenizer_fields

    byte_tokenizer = byte_level_tokenizer()
    fields = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 256}
    config = VARIANTS["gqa"].config(**tokenizer_fields(byte_tokenizer), **{**fields, **overrides})
    VARIANTS["gqa"].causal_lm_class(config).save_pretrained(folder)
    if tokenizer:
        byte_tokenizer.save_pretrained(folder)
    return folder


def one_line_error(capsys, argv: list[str]) -> str:
    """The one line a user error prints (nothing on stdout, exit status 2, no traceback; transformers' progress bars
    of what loaded before the error may precede it)."""
    capsys.readouterr()  # what the test printed before
    assert main(argv) == 2
    printed = capsys.readouterr()
    lines = [line for line in printed.err.replace("\r", "\n").splitlines() if line.strip() and "%|" not in line]
    assert printed.out == "" and len(lines) == 1 and lines[0].startswith("hf-attn-zoo "), printed.err
    return lines[0]


@pytest.fixture
def text_file(tmp_path) -> Path:
    path = tmp_path / "text.txt"
    path.write_text("def add(a, b):\n    return a + b\n" * 40)
    return path


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "{missing}", "--data", "{text}"],
        ["convert", "{missing}", "{out}", "--to", "mqa"],
        ["attention", "{missing}", "some text"],
        ["serve", "{missing}"],
    ],
    ids=lambda argv: argv[0],
)
def test_a_missing_folder_is_one_line(argv, tmp_path, text_file, capsys):
    missing = tmp_path / "runs" / "nothing" / "final"
    argv = [a.format(missing=missing, text=text_file, out=tmp_path / "out") for a in argv]
    error = one_line_error(capsys, argv)
    assert f"hf-attn-zoo {argv[0]}: error: {missing}: no such folder" in error
    assert not (tmp_path / "out").exists()


def test_a_folder_without_tokenizer_or_weights_is_one_line(tmp_path, text_file, capsys):
    no_tokenizer = saved_model(tmp_path / "no-tokenizer", tokenizer=False)
    error = one_line_error(capsys, ["eval", str(no_tokenizer), "--data", str(text_file)])
    assert str(no_tokenizer) in error and "no tokenizer files (tokenizer.json" in error
    only_tokenizer = tmp_path / "only-tokenizer"
    shutil.copytree(saved_model(tmp_path / "full"), only_tokenizer, ignore=shutil.ignore_patterns("*.safetensors"))
    error = one_line_error(capsys, ["convert", str(only_tokenizer), str(tmp_path / "out"), "--to", "mqa"])
    assert str(only_tokenizer) in error and "no weights (model.safetensors" in error


def test_an_unknown_hub_name_is_one_line(tmp_path, text_file, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # `no-such-model` is no folder here: a Hub id
    error = one_line_error(capsys, ["eval", "no-such-model", "--data", str(text_file)])
    assert "no-such-model: no such local folder, and it could not be loaded as a Hugging Face Hub model id" in error


def test_missing_data_is_one_line(tmp_path, capsys):
    model = saved_model(tmp_path / "model")
    error = one_line_error(capsys, ["eval", str(model), "--data", str(tmp_path / "held_out")])
    assert "held_out does not exist" in error


def test_convert_errors_are_one_line_and_write_nothing(tmp_path, capsys):
    model = saved_model(tmp_path / "model")
    out = tmp_path / "out"
    assert "--num_key_value_heads G" in one_line_error(capsys, ["convert", str(model), str(out), "--to", "gqa"])
    error = one_line_error(capsys, ["convert", str(model), str(out), "--to", "gqa", "--num_key_value_heads", "3"])
    assert "num_key_value_heads" in error and str(model) in error
    assert not out.exists()


def test_eval_refuses_windows_beyond_the_models_positions(tmp_path, text_file, capsys):
    model = saved_model(tmp_path / "model")  # rope, 256 positions
    base = ["eval", str(model), "--data", str(text_file)]
    error = one_line_error(capsys, [*base, "--max_length", "1024"])
    assert "max_length=1024 is longer than the model's 256 positions" in error and "max_length <= 256" in error
    assert "max_length=0 must be a positive" in one_line_error(capsys, [*base, "--max_length", "0"])
    assert "stride=0 must be a positive" in one_line_error(capsys, [*base, "--stride", "0"])
    assert "stride=64 is larger than max_length=32" in one_line_error(
        capsys, [*base, "--max_length", "32", "--stride", "64"]
    )


def test_eval_scores_alibi_beyond_its_positions_with_a_notice(tmp_path, text_file, capsys):
    model = saved_model(tmp_path / "model", position_embedding_type="alibi", max_position_embeddings=64)
    assert main(["eval", str(model), "--data", str(text_file), "--max_length", "128", "--json"]) == 0
    printed = capsys.readouterr()
    assert json.loads(printed.out.strip().splitlines()[-1])["max_length"] == 128
    assert printed.err.count("beyond the model's max_position_embeddings=64; its alibi positions extrapolate") == 1


def stdlib_records(kind: str, folder: Path) -> Path:
    """40 standard-library sources as records with the text in a `text` column beside another column, written as a
    JSON lines or Parquet file, or a `Dataset` saved with `save_to_disk`."""
    from datasets import Dataset

    from hf_attn_zoo.data import stdlib_corpus_files

    rows = [{"path": str(path), "text": path.read_text(encoding="utf-8")} for path in stdlib_corpus_files()[:40]]
    target = folder / f"records.{kind}"
    if kind == "jsonl":
        target.write_text("\n".join(json.dumps(row) for row in rows))
    elif kind == "parquet":
        Dataset.from_list(rows).to_parquet(str(target))
    else:
        Dataset.from_list(rows).save_to_disk(str(target))
    return target


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "dataset"])
def test_train_reads_records_and_saved_datasets(kind, tmp_path, capsys):
    """`hf-attn-zoo train` on a JSON lines file whose text field is `text` (the default and the commonest layout), a
    Parquet file and a saved `Dataset`."""
    records = stdlib_records(kind, tmp_path)
    source = ["--data.dataset_name", str(records)] if kind == "dataset" else ["--data.train_files", str(records)]
    out = tmp_path / "run"
    argv = ["train", str(TINY_RECIPE), *source, "--training.max_steps", "2", "--training.output_dir", str(out)]
    assert main([*argv, "--training.report_to", "none"]) == 0
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["steps"] == 2 and math.isfinite(summary["validation_perplexity"])


def test_train_refuses_a_binary_data_file_in_one_line(tmp_path, capsys):
    binary = tmp_path / "corpus.xlsx"
    binary.write_bytes(b"PK\x03\x04" + bytes(range(256)) * 64)
    out = tmp_path / "run"
    error = one_line_error(
        capsys, ["train", str(TINY_RECIPE), "--data.train_files", str(binary), "--training.output_dir", str(out)]
    )
    assert f"{binary} is not UTF-8 text" in error and "supported:" in error and ".parquet" in error
    assert not out.exists()


def test_a_bug_keeps_its_traceback(monkeypatch):
    def broken(options):
        raise RuntimeError("a bug, not a user error")

    monkeypatch.setattr(cli, "list_command", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["list"])


def test_a_command_that_returns_what_it_made_exits_0(monkeypatch):
    """`train` returns the run's summary, `convert` the folder it wrote: exit status 0, not the object."""
    import hf_attn_zoo.train

    monkeypatch.setattr(hf_attn_zoo.train, "main", lambda argv: {"steps": 3, "argv": argv})
    assert main(["train", "recipe.yaml", "--training.max_steps", "3"]) == 0
