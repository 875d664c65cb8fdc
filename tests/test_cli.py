"""The command line: `list`, `--help` of every command, both spellings of options, `bench` inside and outside a
checkout, and the main job `demo`."""

import argparse
import json
import math
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_attn_zoo import cli
from hf_attn_zoo.cli import build_parser, main
from hf_attn_zoo.models import VARIANTS


def test_list_prints_every_variant(capsys):
    assert main(["list"]) == 0
    table = capsys.readouterr().out
    for name, variant in VARIANTS.items():
        row = next(line for line in table.splitlines() if line.startswith(f"| `{name}` "))
        assert variant.model_type in row and variant.cache_per_token in row
        assert f"| {', '.join(variant.backends)} |" in row and "eager" in variant.backends


def command_paths(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command and subcommand of the CLI, e.g. ("bench", "decode")."""
    paths = [prefix]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, subparser in action.choices.items():
                paths += command_paths(subparser, (*prefix, name))
    return paths


COMMANDS = command_paths(build_parser())


def test_every_command_is_walked():
    assert {("train",), ("bench", "decode"), ("eval",), ("demo",)} <= set(COMMANDS)


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


def test_every_bench_name_has_its_script():
    for name, command in cli.COMMANDS["bench"].subcommands.items():
        with pytest.raises(SystemExit) as exit_info:
            command.run(["--help"])
        assert exit_info.value.code == 0, name


def test_bench_outside_a_checkout_says_where_benchmarks_live(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "checkout_root", lambda: tmp_path)  # an installed package: no benchmarks/ beside it
    monkeypatch.chdir(tmp_path)
    assert cli.benchmarks_folder() is None
    for args in (["bench", "llama"], ["bench", "scaling", "--help"]):
        assert main(args) == 2
        printed = capsys.readouterr()
        assert printed.out == "" and len(printed.err.strip().splitlines()) == 1
        assert "benchmarks/" in printed.err and "repository" in printed.err


def test_bench_finds_the_repositorys_benchmarks_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.benchmarks_folder() == Path(__file__).resolve().parents[1] / "benchmarks"


def test_bench_llama_writes_ratios(tmp_path, capsys):
    args = ["bench", "llama", "--hidden_size", "32", "--num_hidden_layers", "1", "--intermediate_size", "64"]
    args += ["--vocab_size", "64", "--train_seq_len", "16", "--train_steps", "1", "--prompt_len", "4"]
    args += ["--new_tokens", "3", "--decode_batch_sizes", "1", "2", "--decode_runs", "1", "--repeats", "2"]
    assert main([*args, "--output_dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "speed_gqa_vs_llama.json").read_text())
    assert len(result["ratios"]) == 3 and all(ratio > 0 for ratio in result["ratios"].values())
    assert all(len(sample["llama"]) == len(sample["zoo"]) == 2 for sample in result["samples"].values())
    assert "| zoo / Llama |" in (tmp_path / "speed_gqa_vs_llama.md").read_text()


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
