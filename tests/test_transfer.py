"""Conversion to any variant and attention transfer: exact where the converted layer is the parent's own, the loss
falling on a tiny model for every target, what each variant takes from the parent, refusals, and the command."""

import json

import pytest
import torch
from test_cli import one_line_error, saved_model
from transformers import AutoModelForCausalLM, TrainerCallback

from hf_attn_zoo.convert.transfer import attention_transfer, convert_attention, transfer_batches
from hf_attn_zoo.models import get_variant
from hf_attn_zoo_cli import main

from conftest import VOCAB_SIZE, tiny_model

# every conversion target with trainable attention, the fields it needs on the tiny parent
TARGETS = {
    "gqa": dict(num_key_value_heads=2),
    "mqa": {},
    "mla": dict(kv_lora_rank=8),
    "sliding_window": dict(sliding_window=4),
    "linformer": dict(linformer_k=4),
    "aft_simple": {},
    "aft_full": {},
    "aft_local": dict(aft_window=4),
    "topk": dict(topk=3),
    "additive": dict(additive_dim=8),
    "differential": {},
    "linear": {},
    # 8 blocks of 2 tokens, each query block reading 5 of them: sparser than the parent's full attention
    "bigbird": dict(attention_block_size=2, num_global_blocks=1, num_random_blocks=1),
}


def calibration(seed: int = 0, rows: int = 6, length: int = 16) -> list[torch.LongTensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB_SIZE, (2, length), generator=generator) for _ in range(rows)]


def state(model) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize(("parent_name", "target"), [("mha", "mha"), ("gqa", "gqa"), ("gqa", "mha")])
def test_the_parents_own_layer_has_zero_loss_and_stays_as_it_is(parent_name, target):
    """G = H (and GQA -> MHA, whose heads are the parent's repeated): the converted layer computes what the
    parent's does, bit for bit on the same kernel, so the loss is zero before and after and nothing moves."""
    parent = tiny_model(parent_name)
    fields = {"num_key_value_heads": parent.config.num_key_value_heads} if target == "gqa" else {}
    student = convert_attention(parent, target, **fields).model
    before = state(student)
    results = attention_transfer(parent, student, calibration(), learning_rate=1e-2)
    assert [result.loss_before for result in results] == [0.0, 0.0] or target != parent_name
    assert all(result.loss_after <= 1e-12 for result in results)
    if target == parent_name:
        assert all(result.loss_before == 0.0 and result.loss_after == 0.0 for result in results)
        assert all(torch.equal(tensor, student.state_dict()[name]) for name, tensor in before.items())


def test_the_loss_falls_and_the_model_moves_toward_its_parent():
    """MQA pooled from GQA: each layer's error falls, and the whole model's next-token distributions come closer to
    the parent's on text it was not trained on."""
    parent = tiny_model("gqa")
    student = convert_attention(parent, "mqa").model
    held_out = torch.randint(3, VOCAB_SIZE, (2, 24), generator=torch.Generator().manual_seed(9))

    def divergence() -> float:
        with torch.no_grad():
            teacher = parent(input_ids=held_out).logits.log_softmax(-1)
            learner = student(input_ids=held_out).logits.log_softmax(-1)
        return torch.nn.functional.kl_div(learner, teacher, log_target=True, reduction="batchmean").item()

    start = divergence()
    results = attention_transfer(parent, student, calibration(rows=12), epochs=3, learning_rate=1e-2)
    assert all(result.loss_after < 0.7 * result.loss_before for result in results)
    assert all(result.steps == 36 for result in results)
    assert divergence() < start


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_every_target_converts_and_transfers(target):
    parent = tiny_model("mha")  # 4 heads of width 8, each its own key/value head
    parent_before = state(parent)
    conversion = convert_attention(parent, target, **TARGETS[target])
    student = conversion.model
    assert student.config.model_type == get_variant(target).model_type
    declared = get_variant(target).attention_class.parent_weights
    if declared is not None:  # copied where declared (and the shapes allow), fresh elsewhere
        assert {name.split(".")[0] for name in conversion.copied} <= set(declared)
        assert not {name.split(".")[0] for name in conversion.fresh} & set(declared) - {"q_proj", "k_proj"}
        for name in conversion.copied:
            copied = student.state_dict()[f"model.layers.0.self_attn.{name}"]
            original = parent.state_dict()[f"model.layers.0.self_attn.{name}"]
            assert copied.shape != original.shape or torch.equal(copied, original)
    before = state(student)
    results = attention_transfer(parent, student, calibration(), epochs=2, learning_rate=3e-3)
    assert [result.layer for result in results] == [0, 1]
    assert all(result.loss_after < result.loss_before for result in results)
    after = student.state_dict()
    changed = {name for name, tensor in before.items() if not torch.equal(tensor, after[name])}
    assert changed and all(".self_attn." in name for name in changed)  # only attention parameters train
    assert all(torch.equal(tensor, parent.state_dict()[name]) for name, tensor in parent_before.items())
    logits = student(input_ids=calibration()[0]).logits
    assert logits.shape == (2, 16, VOCAB_SIZE) and torch.isfinite(logits).all()


def test_a_hedgehog_map_starts_fresh_and_learns_the_parents_attention():
    """Linear attention with LoLCATs' learned feature map: the parent's projections copied, the maps fresh (the
    identity), and attention transfer trains the maps with the projections."""
    parent = tiny_model("mha")
    conversion = convert_attention(parent, "linear", feature_map="hedgehog")
    assert set(conversion.copied) >= {"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"}
    assert set(conversion.fresh) == {"query_feature_map", "key_feature_map"}
    student = conversion.model
    maps = student.model.layers[0].self_attn.query_feature_map.detach().clone()
    results = attention_transfer(parent, student, calibration(), epochs=2, learning_rate=3e-3)
    assert all(result.loss_after < result.loss_before for result in results)
    assert not torch.equal(student.model.layers[0].self_attn.query_feature_map, maps)


def test_the_command_offers_every_variant_an_attention_converts_to():
    """`hf-attn-zoo convert --to` lists exactly the registered variants a conversion builds from an MHA parent:
    every one but Mamba (its class takes nothing of an attention) and one head as wide as the model."""
    import typing

    from hf_attn_zoo.models import VARIANTS
    from hf_attn_zoo_cli import ConvertOptions

    def converts(name: str) -> bool:
        try:
            convert_attention(tiny_model("mha"), name, **TARGETS.get(name, {}))
        except ValueError:
            return False
        return True

    offered = set(typing.get_args(typing.get_type_hints(ConvertOptions)["to"]))
    assert offered == {name for name in VARIANTS if converts(name)} == set(TARGETS) | {"mha"}


def test_what_each_variant_copies_is_read_off_its_class():
    parent = tiny_model("gqa")
    assert convert_attention(parent, "sliding_window", sliding_window=4).copied == (
        "q_proj.weight",
        "k_proj.weight",
        "v_proj.weight",
        "o_proj.weight",
    )
    additive = convert_attention(parent, "additive")
    assert additive.copied == ("v_proj.weight", "o_proj.weight")
    assert additive.model.config.position_embedding_type == "alibi"  # RoPE does not apply to tanh scores
    # AFT keeps no heads: the parent's 2 value heads of width 8 are repeated to its 32 channels (4 query heads)
    aft = convert_attention(parent, "aft_simple")
    value = aft.model.state_dict()["model.layers.1.self_attn.v_proj.weight"]
    parent_value = parent.state_dict()["model.layers.1.self_attn.v_proj.weight"].view(2, 8, 32)
    assert torch.equal(value.view(4, 8, 32), parent_value.repeat_interleave(2, dim=0))


def test_one_layer_at_a_time():
    parent = tiny_model("gqa")
    student = convert_attention(parent, "mqa").model
    before = state(student)
    (result,) = attention_transfer(parent, student, calibration(), layers=[1], learning_rate=1e-2)
    assert result.layer == 1
    changed = {
        name.split(".")[2] for name, tensor in before.items() if not torch.equal(tensor, student.state_dict()[name])
    }
    assert changed == {"1"}


@pytest.mark.parametrize(
    ("parent", "target", "fields", "named"),
    [
        ("linformer", "mqa", {}, "not an MHA-family model"),
        ("gqa", "sliding_window", dict(hidden_size=64), "leave the backbone's fields"),
        ("gqa", "topk", dict(position_embedding_type="sinusoidal"), "residual stream"),
        ("gqa", "gqa", {}, "needs num_key_value_heads"),
        ("gqa", "mla", {}, "needs kv_lora_rank"),
        ("gqa", "sliding_window", dict(sliding_window=0), "sliding_window=0"),
        ("gqa", "differential", dict(head_dim=6), "head_dim=6"),
        ("gqa", "mamba", {}, "parent_weights is empty"),
        ("mha", "single_head", {}, "has one query and one key/value head"),
    ],
)
def test_targets_that_cannot_be_built_from_the_parent_are_named(parent, target, fields, named):
    with pytest.raises(ValueError, match=named):
        convert_attention(tiny_model(parent), target, **fields)


def test_transfer_batches_are_rectangular(tmp_path):
    from hf_attn_zoo.data import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    batches = transfer_batches(["a" * 100, "b" * 70], tokenizer, block_size=32, max_tokens=150, batch_size=2)
    assert [tuple(batch.shape) for batch in batches] == [(2, 32), (2, 32)]  # 3 + 2 full blocks within 150 tokens


# the command


@pytest.fixture
def texts(tmp_path):
    train, held_out = tmp_path / "train.txt", tmp_path / "held_out.txt"
    train.write_text("the quick brown fox jumps over the lazy dog. " * 30)
    held_out.write_text("a lazy dog sleeps under the brown tree. " * 6)
    return train, held_out


def test_convert_with_transfer_writes_a_model_and_a_summary(tmp_path, texts, capsys):
    parent = saved_model(tmp_path / "parent")
    out = tmp_path / "window"
    argv = ["convert", str(parent), str(out), "--to", "sliding_window", "--config", '{"sliding_window": 8}']
    options = ["--transfer", "--data", str(texts[0]), "--tokens", "640", "--block_size", "64"]
    assert main([*argv, *options, "--eval_data", str(texts[1])]) == 0
    printed = capsys.readouterr().out
    assert "attention transfer: 640 tokens x 1 layers" in printed and "| after transfer |" in printed
    summary = json.loads((out / "training_summary.json").read_text())
    assert set(summary["held_out_perplexity"]) == {"parent", "converted", "transferred"}
    (layer,) = summary["transfer"]["layers"]
    assert layer["loss_after"] < layer["loss_before"] and layer["steps"] == 10
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "zoo_sliding_window" and model.config.sliding_window == 8
    assert "attention transfer" in (out / "README.md").read_text()


def test_convert_transfer_and_distill_in_one_command(tmp_path, texts, capsys):
    """convert + transfer + distillation (the training path's convert.distill) in one command: the summary scores
    the model after each, and distillation's first loss is the KL of the transferred model to its parent."""
    parent = saved_model(tmp_path / "parent")
    out = tmp_path / "mqa"
    argv = ["convert", str(parent), str(out), "--to", "mqa", "--transfer", "--distill", "--data", str(texts[0])]
    options = ["--tokens", "640", "--block_size", "32", "--batch_size", "2", "--temperature", "2"]
    assert main([*argv, *options, "--eval_data", str(texts[1])]) == 0
    printed = capsys.readouterr().out
    assert "distillation: 640 tokens in 10 steps" in printed and "| after distillation |" in printed
    summary = json.loads((out / "training_summary.json").read_text())
    assert set(summary["held_out_perplexity"]) == {"parent", "converted", "transferred", "distilled"}
    distillation = summary["distillation"]
    assert distillation["steps"] == 10 and distillation["losses"][0] > 0
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "zoo_mqa" and "distillation" in (out / "README.md").read_text()


def test_a_stopped_convert_resumes_where_distillation_stands(tmp_path, texts, monkeypatch, capsys):
    """`convert --transfer --distill` stopped during distillation keeps OUT.stages (the transferred model, the
    Trainer's checkpoints) and writes no OUT; the same command again converts and transfers nothing, resumes the
    Trainer from its newest checkpoint, and gives what one uninterrupted run gives, its seconds counting the stopped
    launch too. Stages a command with other options left, or made from text edited since, are set aside, never
    trained on."""
    import hf_attn_zoo.cli as cli
    import hf_attn_zoo.train as train

    parent = saved_model(tmp_path / "parent")

    def argv(out, *extra):
        words = ["convert", str(parent), str(out), "--to", "mqa", "--transfer", "--distill", "--data", str(texts[0])]
        return [
            *words,
            "--tokens",
            "640",
            "--block_size",
            "32",
            "--batch_size",
            "2",
            "--eval_data",
            str(texts[1]),
            *extra,
        ]

    assert main(argv(tmp_path / "whole")) == 0
    whole = json.loads((tmp_path / "whole" / "training_summary.json").read_text())
    assert not (tmp_path / "whole.stages").exists()  # dropped once OUT is written

    real, resumed = train.run_training, []

    class StopHalfway(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == state.max_steps // 2

    def stopped(model_args, data_args, training_args):
        # stopped halfway, its checkpoint written; the stop comes before OUT
        real(model_args, data_args, training_args, callbacks=[StopHalfway()])
        raise RuntimeError("stopped")

    def watched(model_args, data_args, training_args):
        resumed.append(training_args.resume_from_checkpoint)
        return real(model_args, data_args, training_args)

    out, stages = tmp_path / "mqa", tmp_path / "mqa.stages"
    monkeypatch.setattr(train, "run_training", stopped)
    with pytest.raises(RuntimeError, match="stopped"):
        main(argv(out, "--temperature", "3"))
    assert not out.exists() and (stages / "start" / "stage.json").is_file()
    # another command on the same OUT: the stages are set aside, and it converts afresh
    monkeypatch.setattr(train, "run_training", watched)
    assert main(argv(out)) == 0 and resumed == [None]
    assert "was not left by this command (it differs in temperature)" in capsys.readouterr().out
    assert len(list(tmp_path.glob("mqa.stages.other-*"))) == 1 and not stages.exists()
    # the same command after its training text changed: the stages were made from other text, set aside too
    data = tmp_path / "data.txt"
    data.write_text(texts[0].read_text())
    edited = [*argv(tmp_path / "edited"), "--data", str(data)]
    monkeypatch.setattr(train, "run_training", stopped)
    with pytest.raises(RuntimeError, match="stopped"):
        main(edited)
    data.write_text(texts[0].read_text() + " One more sentence.")
    monkeypatch.setattr(train, "run_training", watched)
    assert main(edited) == 0 and resumed == [None, None]
    assert "(it differs in text_digests)" in capsys.readouterr().out
    assert len(list(tmp_path.glob("edited.stages.other-*"))) == 1

    out = tmp_path / "again"
    monkeypatch.setattr(train, "run_training", stopped)
    with pytest.raises(RuntimeError, match="stopped"):
        main(argv(out))

    def converted_again(*args, **kwargs):
        raise AssertionError("an earlier run's stages were not used")

    monkeypatch.setattr(cli, "convert_and_transfer", converted_again)
    monkeypatch.setattr(train, "run_training", watched)
    assert main(argv(out)) == 0 and resumed == [None, None, "latest"]
    again = json.loads((out / "training_summary.json").read_text())
    distillation = again["distillation"]
    assert distillation["resumed_from_step"] == distillation["steps"] // 2
    assert distillation["seconds_before_resume"] > 0
    assert again["seconds"] > distillation["seconds"] >= distillation["seconds_before_resume"]
    for stage, value in whole["held_out_perplexity"].items():
        assert again["held_out_perplexity"][stage] == pytest.approx(value, rel=1e-5), stage
    losses = [
        [layer[k] for layer in run["transfer"]["layers"] for k in ("loss_before", "loss_after")]
        for run in (again, whole)
    ]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)  # the first run's transfer, read back
    assert not (tmp_path / "again.stages").exists()

    # stopped after the distillation finished, before OUT: the next launch reads it back and counts all its seconds
    def finished_then_stopped(model_args, data_args, training_args):
        real(model_args, data_args, training_args)
        raise RuntimeError("stopped")

    monkeypatch.undo()  # convert_and_transfer as it is
    monkeypatch.setattr(train, "run_training", finished_then_stopped)
    with pytest.raises(RuntimeError, match="stopped"):
        main(argv(tmp_path / "late"))
    monkeypatch.setattr(train, "run_training", real)
    monkeypatch.setattr(cli, "convert_and_transfer", converted_again)  # resumed from its stages
    assert main(argv(tmp_path / "late")) == 0
    late = json.loads((tmp_path / "late" / "training_summary.json").read_text())
    assert late["distillation"]["seconds_before_resume"] == late["distillation"]["seconds"] > 0
    assert late["seconds"] > late["distillation"]["seconds"]


def test_a_stopped_transfer_trains_only_the_layers_not_done(tmp_path, texts, monkeypatch, capsys):
    """`convert --transfer` keeps each layer in OUT.stages once transferred; stopped after the first of three, the
    same command again converts, reads that layer back and trains only the other two, ending where one uninterrupted
    run ends (each layer learns from the parent's hidden states, so the others' state does not change it)."""
    import hf_attn_zoo.cli as cli
    from hf_attn_zoo.convert import transfer

    parent = saved_model(tmp_path / "parent", num_hidden_layers=3)

    def argv(out):
        words = ["convert", str(parent), str(out), "--to", "mqa", "--transfer", "--data", str(texts[0])]
        return [*words, "--tokens", "640", "--block_size", "32", "--transfer_epochs", "2"]

    assert main(argv(tmp_path / "whole")) == 0
    keep_layer, trained = cli.ConvertStages.keep_layer, []

    def kept_then_stopped(stages, attention, result):
        keep_layer(stages, attention, result)
        raise RuntimeError("stopped")

    monkeypatch.setattr(cli.ConvertStages, "keep_layer", kept_then_stopped)
    out, stages = tmp_path / "mqa", tmp_path / "mqa.stages"
    with pytest.raises(RuntimeError, match="stopped"):
        main(argv(out))
    assert not out.exists()
    assert sorted(path.name for path in (stages / "transfer").iterdir()) == ["layer-000.json", "layer-000.safetensors"]

    transfer_layer = transfer.transfer_layer

    def counted(index, *args):
        trained.append(index)
        return transfer_layer(index, *args)

    monkeypatch.setattr(cli.ConvertStages, "keep_layer", keep_layer)
    monkeypatch.setattr(transfer, "transfer_layer", counted)
    assert main(argv(out)) == 0 and trained == [1, 2]
    assert "layers 0 read back" in capsys.readouterr().out and not stages.exists()
    whole, resumed = (AutoModelForCausalLM.from_pretrained(folder) for folder in (tmp_path / "whole", out))
    for (name, expected), (_, actual) in zip(whole.state_dict().items(), resumed.state_dict().items(), strict=True):
        torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5, msg=name)
    summaries = [
        json.loads((folder / "training_summary.json").read_text())["transfer"] for folder in (tmp_path / "whole", out)
    ]
    assert summaries[1]["resumed_layers"] == 1 and summaries[1]["seconds_before_resume"] > 0
    assert summaries[1]["layers"][0] == summaries[0]["layers"][0] | {"seconds": summaries[1]["layers"][0]["seconds"]}


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--transfer"], "--transfer and --distill need --data"),
        (["--distill"], "--transfer and --distill need --data"),
        (["--distill", "--data", "{train}"], "give --eval_data"),
        (["--distill", "--data", "{train}", "--alpha", "2", "--eval_data", "{train}"], "--alpha 2.0 in [0, 1]"),
        (["--data", "{train}"], "add one, or leave --data out"),
        (["--transfer", "--data", "{train}", "--lora_rank", "4"], "--lora_rank 4 adapts the MLPs while --distill"),
        (["--transfer", "--data", "{empty}"], "is empty"),
        (["--transfer", "--data", "{train}", "--eval_data", "{empty}"], "is empty"),
        (["--transfer", "--data", "{train}", "--tokens", "10"], "too little to learn from"),
        (["--transfer", "--data", "{train}", "--config", "{{oops"], "is not JSON"),
        (["--transfer", "--data", "{train}", "--config", '{{"hidden_size": 64}}'], "leave the backbone's fields"),
        (["--transfer", "--data", "{train}", "--method", "mean"], "leave --method out"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, texts, capsys, extra, named):
    parent = saved_model(tmp_path / "parent")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    out = tmp_path / "out"
    extra = [word.format(train=texts[0], empty=empty) for word in extra]
    error = one_line_error(capsys, ["convert", str(parent), str(out), "--to", "topk", "--block_size", "32", *extra])
    assert named in error
    assert not out.exists()


def test_rows_that_fit_in_the_window_are_refused(tmp_path, texts, capsys):
    """A window as wide as the rows sees every key of every row: the converted attention is the parent's there, and
    transfer or distillation on such rows cannot learn what the window changes."""
    parent = saved_model(tmp_path / "parent")
    out = tmp_path / "out"
    argv = ["convert", str(parent), str(out), "--to", "sliding_window", "--config", '{"sliding_window": 32}']
    argv += ["--transfer", "--data", str(texts[0]), "--block_size", "32"]
    assert "rows of 32 tokens fit in the window of 32 keys" in one_line_error(capsys, argv)
    assert not out.exists() and not (tmp_path / "out.stages").exists()
    wider = [*argv[:6], '{"sliding_window": 300}', *argv[7:-1], "512"]  # rows of 512, but the parent reads 256
    assert "reads at most 256 positions, all within the window of 300" in one_line_error(capsys, wider)
    assert main([*argv[:-1], "33"]) == 0  # a row one longer: its last query no longer sees the first key
    assert not out.with_name("out.stages").exists()


def test_conversion_to_fresh_parameters_is_the_same_every_run(tmp_path):
    """Linformer's sequence projections start fresh: converted twice, the same numbers, so a command resumed after a
    stop trains the layers it had not done from where its first launch would have."""
    parent = saved_model(tmp_path / "parent")
    for out in ("a", "b"):
        assert main(["convert", str(parent), str(tmp_path / out), "--to", "linformer"]) == 0
    first, second = (AutoModelForCausalLM.from_pretrained(tmp_path / out).state_dict() for out in ("a", "b"))
    assert all(torch.equal(first[name], second[name]) for name in first)  # the same computation, bit for bit


def test_a_parent_without_a_tokenizer_is_refused(tmp_path, texts, capsys):
    parent = saved_model(tmp_path / "parent", tokenizer=False)
    out = tmp_path / "out"
    argv = ["convert", str(parent), str(out), "--to", "mqa", "--transfer", "--data", str(texts[0])]
    assert "no tokenizer files" in one_line_error(capsys, argv)
    assert not out.exists()


def test_a_layer_that_training_does_not_improve_keeps_its_weights():
    """Top-k at k = 8 of 16 keys starts close to its parent; Adam at a learning rate far too high overshoots, and
    the layer is put back as it was."""
    parent = tiny_model("mha")
    student = convert_attention(parent, "topk", topk=8).model
    before = state(student)
    results = attention_transfer(parent, student, calibration(), learning_rate=1.0)
    assert all(result.kept_initial and result.loss_after == result.loss_before for result in results)
    assert all(torch.equal(tensor, student.state_dict()[name]) for name, tensor in before.items())
