"""Training: recipes, bad input caught before training, resume, crash-safe checkpoints, several processes."""

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from hf_attn_zoo.models import VARIANTS
from hf_attn_zoo.train import load_recipe, run_training
from hf_attn_zoo.train.build import build_model, build_seq2seq_model, training_flops_per_token
from hf_attn_zoo.train.callbacks import COMPLETE_MARKER, held_training_state

from conftest import free_port, tiny_model

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "configs" / "train").glob("*.yaml"))
TINY = ROOT / "configs" / "train" / "tiny_gqa.yaml"


class FakeTokenizer:
    """What `build_model` reads from a tokenizer: its size and special ids."""

    def __init__(self, size: int) -> None:
        self.size, self.bos_token_id, self.eos_token_id, self.pad_token_id = size, size - 2, size - 2, size - 1

    def __len__(self) -> int:
        return self.size


def native_control_start(recipe, folder) -> str:
    """The fresh MarianMTModel the native-control recipe starts from, written as its comment says (from the zoo
    recipe's sizes), with a small tokenizer of the embedded pairs."""
    from experiments.translation import native
    from hf_attn_zoo.data import train_byte_level_bpe
    from hf_attn_zoo.pairs import default_pairs, seq2seq_tokenizer

    texts = [text for pair in default_pairs() for text in (pair["source"], pair["target"])]
    seq2seq_tokenizer(train_byte_level_bpe(texts, 400)).save_pretrained(folder / "tokenizer")
    zoo_recipe = recipe.parent / "bible_en_es_transformer.yaml"
    assert native.main([str(zoo_recipe), str(folder / "tokenizer"), str(folder / "start")]) == 0
    return str(folder / "start")


@pytest.mark.parametrize("recipe", RECIPES, ids=[path.stem for path in RECIPES])
def test_every_shipped_recipe_loads_and_builds_its_model(recipe, tmp_path):
    overrides = ["--training.output_dir", str(tmp_path)]
    if not torch.cuda.is_available() and "requires_gpu: true" in recipe.read_text():
        # such a recipe is refused on a machine without a GPU, and TrainingArguments refuses its bf16 there
        overrides += ["--training.requires_gpu", "false", "--training.bf16", "false"]
    if "init_from:" in recipe.read_text():  # the native control starts from a checkpoint its comment says to write
        built = native_control_start(recipe, tmp_path)
        model_args, data_args, training_args = load_recipe(recipe, [*overrides, "--model.init_from", built])
        model = build_seq2seq_model(model_args, AutoTokenizer.from_pretrained(built), data_args.max_source_length)
        assert type(model).__name__ == "MarianMTModel" and model.config.is_encoder_decoder
        # its sinusoid tables are fixed and not saved: loaded, they must stay out of training (from_pretrained hands
        # them back trainable)
        positions = [p for name, p in model.named_parameters() if "embed_positions" in name]
        assert len(positions) == 2 and not any(p.requires_grad for p in positions)
        assert training_args.report_to == ["tensorboard"]
        return
    model_args, data_args, training_args = load_recipe(recipe, overrides)
    with torch.device("meta"):
        if model_args.seq2seq:  # a translator: built from its pairs' shared tokenizer (tests/test_translation.py)
            model = build_seq2seq_model(model_args, FakeTokenizer(data_args.vocab_size), data_args.max_source_length)
            assert model.config.is_encoder_decoder and model.config.decoder_start_token_id == data_args.vocab_size - 2
        else:
            model = build_model(model_args, FakeTokenizer(data_args.vocab_size), data_args.block_size)
    assert model.config.vocab_size == data_args.vocab_size
    assert training_args.report_to == ["tensorboard"] and training_args.ddp_find_unused_parameters is False


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("size, low, high", [("tiny", 0.05e6, 1.5e6), ("small", 9e6, 21e6), ("base", 95e6, 170e6)])
def test_presets_have_the_promised_sizes(name, size, low, high):
    vocab = {"tiny": 512, "small": 8192, "base": 32000}[size]
    variant = VARIANTS[name]
    config = variant.config(size, vocab_size=vocab)
    with torch.device("meta"):
        parameters = sum(p.numel() for p in variant.causal_lm_class(config).parameters())
    assert low <= parameters <= high, f"{name} {size}: {parameters / 1e6:.1f}M parameters"


def test_overrides_are_typed_and_unknown_keys_are_named(tmp_path):
    model_args, data_args, training_args = load_recipe(
        TINY,
        [
            "--training.learning_rate",
            "1e-3",
            "--model.size=small",
            "--data.block_size",
            "32",
            "--training.output_dir",
            str(tmp_path),
        ],
    )
    assert training_args.learning_rate == 1e-3 and model_args.size == "small" and data_args.block_size == 32
    with pytest.raises(ValueError, match=r"training\.learning_rat is not a field.*did you mean 'learning_rate'"):
        load_recipe(TINY, ["--training.learning_rat", "1e-3"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  varient: gqa\n")
    with pytest.raises(ValueError, match=r"model\.varient.*did you mean 'variant'"):
        load_recipe(bad)
    bad.write_text("optimizer:\n  lr: 1\n")
    with pytest.raises(ValueError, match="unknown sections"):
        load_recipe(bad)
    with pytest.raises(ValueError, match="must name a section"):
        load_recipe(TINY, ["--max_steps", "3"])


def tiny_run(output_dir, *overrides, callbacks=()):
    args = ["--training.output_dir", str(output_dir), "--training.report_to", "none", *map(str, overrides)]
    return run_training(*load_recipe(TINY, args), callbacks=list(callbacks))


def test_bad_input_fails_before_training(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.train_files"):
        tiny_run(tmp_path / "a", "--data.train_files", tmp_path / "missing.txt")
    blank = tmp_path / "blank.txt"
    blank.write_text("   \n")
    with pytest.raises(ValueError, match="empty"):
        tiny_run(tmp_path / "b", "--data.train_files", blank, "--data.validation_files", blank)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        tiny_run(tmp_path / "c", "--data.block_size", 300)  # the tiny preset has 256 positions
    assert not list((tmp_path / "c").glob("checkpoint-*"))
    short = tmp_path / "short.txt"  # one block of validation for batches of 8: the evaluation would be empty
    short.write_text("x = 1\n" * 30)
    with pytest.raises(ValueError, match="per_device_eval_batch_size"):
        tiny_run(tmp_path / "d", "--data.validation_files", short, "--training.dataloader_drop_last", "true")
    assert not list((tmp_path / "d").glob("checkpoint-*"))


class StopAt(TrainerCallback):
    """Interrupts training after `step` (and its checkpoint), as a crash or a pre-emption would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def test_resume_continues_the_same_loss_trajectory(tmp_path):
    common = ["--training.max_steps", 16, "--training.save_steps", 8, "--training.logging_steps", 1]
    straight = tiny_run(tmp_path / "straight", *common)
    tiny_run(tmp_path / "resumed", *common, callbacks=[StopAt(8)])
    saved = json.loads((tmp_path / "resumed" / "checkpoint-8" / "trainer_state.json").read_text())
    first_part = saved["stateful_callbacks"]["ThroughputCallback"]["attributes"]["elapsed_at_save"]
    assert first_part >= saved["log_history"][-1]["elapsed_seconds"]  # the save itself is counted too
    resumed = tiny_run(tmp_path / "resumed", *common, "--training.resume_from_checkpoint", "latest")
    assert len(straight["losses"]) == len(resumed["losses"]) == 16
    assert resumed["losses"][:8] == straight["losses"][:8]  # the history restored from checkpoint-8
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(straight["losses"]), rtol=0, atol=1e-5)
    # the clock counts on from the checkpoint: the time before the stop is in the summary and in the curve
    assert "resumed_from_step" not in straight and resumed["resumed_from_step"] == 8
    assert resumed["seconds_before_resume"] == first_part > 0 and resumed["seconds"] > first_part
    history = json.loads((tmp_path / "resumed" / "checkpoint-16" / "trainer_state.json").read_text())["log_history"]
    seconds = [entry["elapsed_seconds"] for entry in history]
    assert len(seconds) == 16 and seconds == sorted(seconds) and seconds[8] >= first_part  # one per loss


def test_a_checkpoint_without_the_clock_state_resumes_counting_from_its_last_log(tmp_path):
    """A checkpoint written without the throughput callback's exported state (by an earlier version): the run
    resumes, counts on from the last logged elapsed_seconds, and its next checkpoints carry the state."""
    common = ["--training.max_steps", 8, "--training.save_steps", 4, "--training.logging_steps", 1]
    tiny_run(tmp_path / "run", *common, callbacks=[StopAt(4)])
    state_file = tmp_path / "run" / "checkpoint-4" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    del state["stateful_callbacks"]["ThroughputCallback"]
    state_file.write_text(json.dumps(state))
    resumed = tiny_run(tmp_path / "run", *common, "--training.resume_from_checkpoint", "latest")
    assert resumed["steps"] == 8 and resumed["seconds_before_resume"] == state["log_history"][-1]["elapsed_seconds"]
    saved = json.loads((tmp_path / "run" / "checkpoint-8" / "trainer_state.json").read_text())
    assert saved["stateful_callbacks"]["ThroughputCallback"]["attributes"]["elapsed_at_save"] > 0


def test_padding_free_training_keeps_documents_apart(tmp_path):
    summary = tiny_run(tmp_path / "run", "--training.max_steps", 4, "--data.packing", "documents")
    assert summary["steps"] == 4 and math.isfinite(summary["validation_perplexity"])
    assert summary["packing"] == "documents"


def test_checkpoints_are_complete_or_set_aside(tmp_path):
    run = tmp_path / "run"
    summary = tiny_run(run, "--training.max_steps", 8, "--training.save_steps", 4)
    checkpoint = run / "checkpoint-8"
    assert (checkpoint / COMPLETE_MARKER).is_file() and (checkpoint / "README.md").is_file()
    assert AutoTokenizer.from_pretrained(checkpoint) is not None
    assert json.loads((checkpoint / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"]
    final = AutoModelForCausalLM.from_pretrained(summary["final_model"])
    assert final.config.model_type == "zoo_gqa"
    assert summary["flops_per_token"] == training_flops_per_token(final, 64)  # tiny_gqa's block_size
    # every log of the run, evaluations' included, carries the wall-clock seconds since training began
    history = json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
    seconds = [entry["elapsed_seconds"] for entry in history]
    assert seconds and seconds == sorted(seconds) and seconds[0] > 0
    with pytest.raises(ValueError, match="already holds checkpoint"):
        tiny_run(run, "--training.max_steps", 8)  # would overwrite: refused
    # a crash while checkpoint-8 was written: no marker; resuming takes checkpoint-4 and keeps checkpoint-8's files
    (checkpoint / COMPLETE_MARKER).unlink()
    resumed = tiny_run(
        run, "--training.max_steps", 8, "--training.save_steps", 4, "--training.resume_from_checkpoint", "latest"
    )
    assert (run / "incomplete-checkpoint-8" / "model.safetensors").is_file()
    assert resumed["steps"] == 8 and (run / "checkpoint-8" / COMPLETE_MARKER).is_file()


def test_two_processes_on_cpu(tmp_path):
    """torchrun with 2 processes: both ranks take part (world size 2, gloo) and the loss goes down."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(ROOT / "training" / "train.py"),
        str(TINY),
        "--training.output_dir",
        str(tmp_path),
        "--training.max_steps",
        "16",
        "--training.report_to",
        "none",
        "--training.logging_steps",
        "4",
    ]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "training_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["distributed"] == "MULTI_CPU"
    assert summary["train_tokens"] == 16 * 8 * 2 * 64  # steps x batch x ranks x block
    assert summary["losses"][-1] < summary["losses"][0] - 0.5
    # DDP: every rank holds the whole model and Adam state (parameters and two moments, fp32), and reports it
    parameter_bytes = 4 * summary["parameters"]
    assert [entry["rank"] for entry in summary["memory_per_process"]] == [0, 1]
    for entry in summary["memory_per_process"]:
        assert entry["parameters_and_optimizer_bytes"] == pytest.approx(3 * parameter_bytes, rel=1e-3)
        assert entry["peak_resident_bytes"] > 3 * parameter_bytes


def test_held_training_state_counts_every_tensor_once():
    """Parameters and AdamW's state, found through a wrapper's `optimizer` (as accelerate's and DeepSpeed's wrap
    theirs), the tied embedding and head counted once, gradients left out."""
    model = tiny_model("gqa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 32, (2, 8)), labels=torch.randint(0, 32, (2, 8))).loss.backward()
    optimizer.step()
    assert model.lm_head.weight is model.get_input_embeddings().weight
    parameters = list(model.parameters())
    parameter_bytes = sum(4 * p.numel() for p in parameters)
    steps = sum(optimizer.state[p]["step"].untyped_storage().nbytes() for p in parameters)  # one scalar each
    wrapped = SimpleNamespace(optimizer=SimpleNamespace(optimizer=optimizer))
    assert held_training_state(model, wrapped) == 3 * parameter_bytes + steps  # gradients still held, not counted
    assert held_training_state(model, None) == parameter_bytes


def listing(folder: Path) -> dict[str, int]:
    """Every path under `folder` with its modification time: what a run wrote."""
    return {str(path.relative_to(folder)): path.stat().st_mtime_ns for path in sorted(folder.rglob("*"))}


def test_a_finished_run_resumed_is_a_no_op_and_a_raised_max_steps_trains_on(tmp_path, capfd, caplog):
    run = tmp_path / "run"
    common = ["--training.save_steps", 2, "--training.logging_steps", 1, "--training.resume_from_checkpoint", "latest"]
    first = tiny_run(run, "--training.max_steps", 4, "--training.save_steps", 2, "--training.logging_steps", 1)
    before = listing(run)
    capfd.readouterr()
    again = tiny_run(run, "--training.max_steps", 4, *common)
    assert "already" in capfd.readouterr().out
    assert (again["steps"], again["validation_perplexity"]) == (4, first["validation_perplexity"])
    assert listing(run) == before  # no new checkpoint, no final.before-*, no rewritten summary
    more = tiny_run(run, "--training.max_steps", 6, *common)
    assert more["steps"] == 6 and len(more["losses"]) == 6 and more["losses"][:4] == first["losses"]
    assert "missing keys" not in caplog.text  # the tied lm_head.weight is not reported as missing on resume


def test_a_run_stopped_after_its_last_checkpoint_finishes_without_another_step(tmp_path):
    """The last checkpoint is at max_steps but the final model was never written (a crash in between): resuming
    evaluates and saves it, training no further step (the Trainer would take one more from a mid-epoch state)."""
    run = tmp_path / "run"
    first = tiny_run(run, "--training.max_steps", 4, "--training.save_steps", 2, "--training.logging_steps", 1)
    (run / "training_summary.json").unlink()
    resumed = tiny_run(
        run, "--training.max_steps", 4, "--training.save_steps", 2, "--training.resume_from_checkpoint", "latest"
    )
    assert resumed["steps"] == 4 and resumed["losses"] == first["losses"]
    assert resumed["validation_perplexity"] == pytest.approx(first["validation_perplexity"], rel=1e-6)
    assert not (run / "checkpoint-5").exists()


def test_the_demo_run_again_changes_nothing(tmp_path, capsys):
    from hf_attn_zoo.demo import run_demo
    from hf_attn_zoo_cli import DemoOptions

    options = DemoOptions(output_dir=str(tmp_path / "demo"), max_steps=4, max_documents=8, max_new_tokens=3)
    first = run_demo(options)
    before = listing(tmp_path / "demo")
    capsys.readouterr()
    second = run_demo(options)
    assert "already" in capsys.readouterr().out
    assert (second["steps"], second["validation_perplexity"]) == (4, first["validation_perplexity"])
    assert listing(tmp_path / "demo") == before
    assert not list((tmp_path / "demo").glob("final.before-*"))
