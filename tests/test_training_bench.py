"""The training-throughput benchmark (experiments/speed/speed.py training): one row per variant, mode and shape against
Llama of the same size, compiled beside eager, and its options checked before anything is built; and how the decode
benchmark (experiments/speed/decode.py) keeps earlier rows."""

import json

import pytest
from transformers import LlamaForCausalLM

from experiments.speed import speed
from hf_attn_zoo.models import get_variant


def test_rows_per_mode_and_shape_and_one_table_line_per_shape(tmp_path):
    setup = speed.TrainingThroughputSetup(
        variants=["aft_simple"],
        size="tiny",
        vocab_size=64,
        shapes=["2x16", "1x40"],
        modes=["eager"],
        steps=1,
        repeats=1,
        output_dir=str(tmp_path),
    )
    rows = first = speed.run_training_throughput(setup)
    assert [(r["mode"], r["batch"], r["seq_len"]) for r in rows] == [("eager", 2, 16), ("eager", 1, 40)]
    assert all(r["tokens_per_second_zoo"] > 0 and r["tokens_per_second_llama"] > 0 for r in rows)
    table = (tmp_path / "training_throughput_tiny.md").read_text()
    assert "| `aft_simple` | " in table and "| 1 x 40 |" in table and "eager zoo / Llama" in table
    assert len(json.loads((tmp_path / "training_throughput_tiny.json").read_text())) == 2

    # a later run over another variant and one shape keeps the rows it did not measure, in registry order
    setup.variants, setup.shapes = ["aft_full"], ["2x16"]
    speed.run_training_throughput(setup)
    setup.variants = ["aft_simple"]
    speed.run_training_throughput(setup)  # measured again: replaced, not doubled
    rows = json.loads((tmp_path / "training_throughput_tiny.json").read_text())
    assert [(r["variant"], r["seq_len"]) for r in rows] == [("aft_full", 16), ("aft_simple", 16), ("aft_simple", 40)]
    assert rows[2] == json.loads(json.dumps(first[1]))  # the row not measured again is kept as it was
    assert "| `aft_full` | " in (tmp_path / "training_throughput_tiny.md").read_text()


def test_runs_over_different_shapes_time_one_model():
    """Positions, and with them AFT's and Linformer's parameters, are sized by --max_position_embeddings rather than
    by the shapes one run measures: a row at 8 tokens and a row at 300 measured apart describe the same model."""
    rows = []
    for shape in ("1x8", "1x300"):
        setup = speed.TrainingThroughputSetup(
            variants=["aft_full"], size="tiny", vocab_size=64, shapes=[shape], modes=["eager"], steps=1, repeats=1
        )
        setup.max_position_embeddings = 320  # above the tiny preset's 256, so that a shape of 300 fits either way
        rows += speed.training_throughput(setup, log=lambda line: None)
    assert rows[0]["parameters"] == rows[1]["parameters"]


@pytest.mark.parametrize("name", ["mha", "gqa", "differential"])
def test_the_llama_baseline_is_as_large_as_a_variant_with_llama_projections(name):
    """A variant whose attention is q/k/v/o projections as Llama's is measured against a Llama of its own parameter
    count (differential's λ vectors and head norms aside, 0.2% here): differential attention's heads against Llama
    heads as wide as its values, not as one of its two maps, which would make a Llama with half its attention
    width."""
    zoo = get_variant(name).build("tiny", vocab_size=64)
    llama = LlamaForCausalLM(speed.llama_like(zoo.config))
    zoo_parameters = sum(p.numel() for p in zoo.parameters())
    assert sum(p.numel() for p in llama.parameters()) == pytest.approx(zoo_parameters, rel=0.005)


@pytest.mark.parametrize(
    "field, value, message",
    [("shapes", ["256"], "BATCHxLENGTH"), ("shapes", ["0x8"], "BATCHxLENGTH"), ("modes", ["jit"], "--modes jit")],
)
def test_bad_options_are_named(field, value, message):
    setup = speed.TrainingThroughputSetup(**{field: value})
    with pytest.raises(SystemExit, match=message):
        speed.training_throughput(setup)


def test_a_decode_run_of_some_variants_replaces_their_rows_and_keeps_the_others(tmp_path):
    from experiments.speed import decode

    def run(variants):
        setup = decode.DecodeSetup(
            variants=variants, batch_sizes=[1], prompt_len=8, new_tokens=2, runs=1, repeats=1, output_dir=str(tmp_path)
        )
        return decode.run_decode(setup)

    run(["mqa", "gqa"])
    rows = run(["gqa"])  # measured again: replaced, not doubled, and kept in registry order
    assert [(row["variant"], row["batch_size"]) for row in rows] == [("mqa", 1), ("gqa", 1)]
    assert json.loads((tmp_path / "decode.json").read_text()) == rows
    assert "| `mqa` | 1 |" in (tmp_path / "decode.md").read_text()
