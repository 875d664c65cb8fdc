"""A user's mistakes in a recipe, an override or a launch: a `UserError` that names where and what, before any work;
`training/train.py` prints it as one line (rank 0 only) and exits with status 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_attn_zoo.errors import MissingPathError, UserError
from hf_attn_zoo.train import load_recipe, run_training
from hf_attn_zoo.train.recipe import check_launch

from conftest import free_port

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "train" / "tiny_gqa.yaml"
GPU_RECIPE = ROOT / "configs" / "train" / "base_gqa_gpu.yaml"
TRAIN_SCRIPT = ROOT / "training" / "train.py"


def recipe(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def test_a_missing_recipe_is_a_missing_path(tmp_path):
    with pytest.raises(MissingPathError, match="nowhere.yaml"):
        load_recipe(tmp_path / "nowhere.yaml")


def test_broken_yaml_names_the_file_and_the_line(tmp_path):
    path = recipe(tmp_path, "model:\n  variant: gqa\ntraining:\n  max_steps: [3\n  seed: 0\n")
    with pytest.raises(UserError, match=rf"{path}.*line \d+") as caught:
        load_recipe(path)
    assert "\n" not in str(caught.value)


def test_a_bad_value_names_the_recipe_the_field_and_the_value(tmp_path):
    path = recipe(tmp_path, "training:\n  max_steps: forty\n")
    with pytest.raises(UserError, match=rf"{path}: training\.max_steps.*'forty'"):
        load_recipe(path, ["--training.output_dir", str(tmp_path)])
    with pytest.raises(UserError, match=r"command line: training\.max_steps.*'forty'"):
        load_recipe(TINY, ["--training.max_steps", "forty"])
    with pytest.raises(UserError, match=r"command line: convert\.uptrain_fraction.*'half'"):
        load_recipe(TINY, ["--model.init_from", "x", "--convert.uptrain_fraction", "half"])


def test_validation_errors_of_the_sections_name_the_recipe_and_the_section(tmp_path):
    path = recipe(
        tmp_path,
        "training:\n  load_best_model_at_end: true\n  eval_strategy: steps\n  save_strategy: epoch\n",
    )
    with pytest.raises(UserError, match=rf"{path} and the command line: training: .*strateg"):
        load_recipe(path, ["--training.output_dir", str(tmp_path)])
    path = recipe(tmp_path, "model:\n  variant: gqa\n  config: {num_attention_heads: 4, num_key_value_heads: 3}\n")
    with pytest.raises(UserError, match=rf"{path}: model: .*num_key_value_heads"):
        load_recipe(path)
    with pytest.raises(UserError, match=rf"{TINY} and the command line: data\.block_size must"):
        load_recipe(TINY, ["--data.block_size", "1"])
    with pytest.raises(UserError, match=rf"{TINY} and the command line: model: unknown variant 'gqq'"):
        load_recipe(TINY, ["--model.variant", "gqq"])


def test_a_missing_data_file_is_a_missing_path(tmp_path):
    args = load_recipe(TINY, ["--training.output_dir", str(tmp_path), "--data.train_files", str(tmp_path / "no.txt")])
    with pytest.raises(MissingPathError, match=r"data\.train_files"):
        run_training(*args)


def parent_with_tokens(tmp_path: Path, tokens: int) -> Path:
    parent = tmp_path / "parent"
    parent.mkdir()
    (parent / "training_summary.json").write_text(json.dumps({"train_tokens": tokens}))
    return parent


def test_an_uptrain_fraction_that_gives_no_step_is_refused_before_any_work(tmp_path):
    parent = parent_with_tokens(tmp_path, 2048)  # tiny_gqa: 8 blocks of 64 tokens = 512 tokens a step
    args = ["--model.init_from", str(parent), "--convert.uptrain_fraction", "0.1"]
    args += ["--training.output_dir", str(tmp_path / "out"), "--training.report_to", "none"]
    with pytest.raises(UserError, match=r"convert\.uptrain_fraction=0\.1 .*2048.*512.*0\.13") as caught:
        run_training(*load_recipe(TINY, args))
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "out").exists()  # refused before data preparation


def test_a_gpu_recipe_is_refused_on_a_machine_without_one(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    copy = tmp_path / "gpu.yaml"
    copy.write_text(GPU_RECIPE.read_text())
    with pytest.raises(UserError, match=rf"{copy}: .*GPU.*configs/train/small_gqa\.yaml"):
        load_recipe(copy, ["--training.output_dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_a_process_count_that_did_not_materialise_is_refused(monkeypatch):
    # what `accelerate launch --num_processes 2` (no config file) leaves its one child on a machine without GPUs
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "False")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(UserError, match=r"one process.*torchrun --nproc_per_node.*configs/accelerate/multi_gpu\.yaml"):
        load_recipe(TINY)
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun / accelerate with a config: the processes exist
    check_launch()


def run_script(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, str(TRAIN_SCRIPT), *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300
    )


def test_train_script_prints_a_user_error_as_one_line(tmp_path):
    path = recipe(tmp_path, "training:\n  max_steps: forty\n")
    result = run_script(str(path), cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert f"train.py: error: {path}: training.max_steps" in result.stderr.splitlines()[-1]


def test_train_script_is_silent_on_other_ranks(tmp_path):
    path = recipe(tmp_path, "training:\n  max_steps: forty\n")
    result = run_script(str(path), cwd=tmp_path, env={"RANK": "1", "LOCAL_RANK": "1"})
    assert result.returncode == 2 and "error" not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_train_script_under_torchrun_prints_once(tmp_path):
    path = recipe(tmp_path, "training:\n  max_steps: forty\n")
    port = str(free_port())
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port]
    result = subprocess.run(
        [*command, str(TRAIN_SCRIPT), str(path)], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert result.returncode != 0 and "exitcode: 2" in result.stderr
    # one line from rank 0; torchrun's own report of the failed processes follows, the script's traceback does not
    assert result.stderr.count("train.py: error:") == 1 and "UserError" not in result.stderr


def test_accelerate_launch_without_a_config_is_refused_on_cpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("with GPUs accelerate starts the processes asked for")
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2"]
    result = subprocess.run(
        [*accelerate, str(TRAIN_SCRIPT), str(TINY), "--training.output_dir", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode != 0
    assert "train.py: error:" in result.stderr and "torchrun --nproc_per_node" in result.stderr
    assert not (tmp_path / "out").exists()


PAIRS_RECIPE = ROOT / "configs" / "train" / "bible_en_es_rnn.yaml"
TRANSFORMER_RECIPE = ROOT / "configs" / "train" / "tiny_translation_transformer.yaml"


@pytest.mark.parametrize("empty", ["[]", "", "null", "None"])
def test_a_list_field_is_emptied_from_the_command_line(tmp_path, empty):
    """`--data.test_groups []` (or '', null) holds out nothing: not a book named "[]"; later overrides still win."""
    _, data_args, _ = load_recipe(PAIRS_RECIPE, ["--data.test_groups", empty, "--training.output_dir", str(tmp_path)])
    assert data_args.test_groups == [] and data_args.validation_groups == ["Mark"]
    _, data_args, _ = load_recipe(
        PAIRS_RECIPE,
        ["--data.test_groups", empty, "--data.test_groups", "Luke", "--training.output_dir", str(tmp_path)],
    )
    assert data_args.test_groups == ["Luke"]


def test_a_list_field_takes_a_json_list(tmp_path):
    overrides = ["--data.test_groups", '["Luke", "Acts of the Apostles"]', "--training.output_dir", str(tmp_path)]
    _, data_args, _ = load_recipe(PAIRS_RECIPE, overrides)
    assert data_args.test_groups == ["Luke", "Acts of the Apostles"]
    with pytest.raises(UserError, match=r"--data\.test_groups \[Luke: not a JSON list"):
        load_recipe(PAIRS_RECIPE, ["--data.test_groups", "[Luke", "--training.output_dir", str(tmp_path)])


def test_a_config_override_changes_only_the_keys_it_names(tmp_path):
    """The recipe's `config` mapping stays, but for the keys `--model.config` gives (it was replaced whole, and the
    recipe's cross-attention heads fell back to the preset's unnoticed)."""
    recipe_config = load_recipe(TRANSFORMER_RECIPE, ["--training.output_dir", str(tmp_path)])[0].config_fields()
    overrides = ["--model.config", '{"dropout": 0.3, "cross_attention": "additive"}']
    model_args, _, _ = load_recipe(TRANSFORMER_RECIPE, [*overrides, "--training.output_dir", str(tmp_path)])
    assert model_args.config_fields() == {**recipe_config, "dropout": 0.3, "cross_attention": "additive"}
    assert recipe_config["cross_attention_num_key_value_heads"] == 2  # the key that used to be lost
