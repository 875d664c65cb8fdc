"""The scaling benchmark's pieces (experiments/speed/scaling.py): the exponent fit, cache accounting, how its models
are sized, and a smoke run of the command."""

import dataclasses
import json

import pytest

from experiments.__main__ import main as run_experiment
from experiments.speed import scaling
from hf_attn_zoo.models import VARIANTS, get_variant

TINY = dict(hidden_size=32, num_hidden_layers=2, vocab_size=64)


def test_exponent_recovers_power_laws():
    for power in (1.0, 1.5, 2.0):
        rows = [{"length": n, "seconds": 3e-4 * n**power} for n in (512, 1024, 2048, 4096)]
        assert scaling.exponent(rows) == pytest.approx(power)


def test_cache_bytes_follow_the_head_counts():
    setup = scaling.ScalingSetup(**TINY)
    measured = {
        name: scaling.measure_decode_cache(scaling.benchmark_model(name, setup, 64), 12)
        for name in ("mha", "mqa", "gqa")
    }
    heads = 8  # mha: 8 KV heads, gqa: 2, mqa: 1
    assert measured["mha"] == heads * measured["mqa"]
    assert measured["gqa"] == 2 * measured["mqa"]
    tokens, layers, head_dim = 16 + 12 - 1, 2, 32 // heads
    assert measured["mqa"] == 2 * layers * 1 * head_dim * tokens * 4  # keys + values, float32


@pytest.mark.parametrize("name", ["aft_simple", "linformer", "aft_local", "sliding_window"])
def test_state_and_window_caches_stop_growing(name):
    setup = scaling.ScalingSetup(**TINY)
    model = scaling.benchmark_model(name, setup, 512)
    window = {"aft_local": 64, "sliding_window": 256}.get(name, 0)
    short, long = scaling.measure_decode_cache(model, window + 20), scaling.measure_decode_cache(model, window + 60)
    assert short == long


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_models_are_the_small_presets_at_the_benchmarks_size(name):
    preset = get_variant(name).preset("small")
    model = scaling.benchmark_model(name, scaling.ScalingSetup(**TINY), 128)
    expected = {**preset, **TINY, "max_position_embeddings": 128}
    if "num_attention_heads" in preset:
        expected["num_attention_heads"] = scaling.ScalingSetup().num_attention_heads
    assert {key: getattr(model.config, key) for key in expected} == expected
    assert model.config._attn_implementation == get_variant(name).default_backend


def test_scaling_command_writes_table_json_and_exponents(tmp_path):
    args = ["scaling", "--variants", "gqa", "aft_simple", "--lengths", "32", "64", "--decode_tokens", "4"]
    args += ["--hidden_size", "32", "--num_hidden_layers", "1", "--vocab_size", "64", "--runs", "1"]
    assert run_experiment([*args, "--output_dir", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "scaling.json").read_text())["results"]
    assert set(results) == {"gqa", "aft_simple"}
    for result in results.values():
        assert [row["length"] for row in result["forward"]] == [32, 64]
        assert all(row["seconds"] > 0 and row["peak_bytes"] >= 0 for row in result["forward"])
        assert result["cache_bytes"] > 0
    table = (tmp_path / "scaling.md").read_text()
    assert "| `gqa` |" in table and "| `aft_simple` |" in table


def test_scaling_add_keeps_the_other_rows_and_refuses_other_sizes(tmp_path):
    """`--add` measures new variants beside the earlier rows (kept as they were, in the registry's order); rows
    measured at other sizes are not mixed in, and nothing is measured before that is checked."""
    args = ["--lengths", "32", "64", "--decode_tokens", "4", "--hidden_size", "32", "--num_hidden_layers", "1"]
    args += ["--vocab_size", "64", "--runs", "1", "--output_dir", str(tmp_path)]
    setup = scaling.ScalingSetup(
        variants=["gqa", "aft_simple"],
        lengths=[32, 64],
        decode_tokens=4,
        hidden_size=32,
        num_hidden_layers=1,
        vocab_size=64,
        runs=1,
        output_dir=str(tmp_path),
    )
    rows = [{"length": n, "seconds": 0.5, "peak_bytes": 2**21} for n in (32, 64)]
    earlier = {
        name: {"parameters": 1, "forward": rows, "cache_bytes": 8, "cached_tokens": 19} for name in setup.variants
    }
    (tmp_path / "scaling.json").write_text(json.dumps({"setup": dataclasses.asdict(setup), "results": earlier}))
    assert run_experiment(["scaling", "--variants", "mqa", "--add", *args]) == 0
    data = json.loads((tmp_path / "scaling.json").read_text())
    assert list(data["results"]) == ["mqa", "gqa", "aft_simple"] == data["setup"]["variants"]
    assert data["results"]["aft_simple"] == earlier["aft_simple"] and data["results"]["gqa"] == earlier["gqa"]
    assert data["results"]["mqa"]["forward"][0]["seconds"] > 0  # measured by this run
    table = (tmp_path / "scaling.md").read_text()
    assert table.count("| `") == 3 and f"{data['results']['mqa']['measured']} (" in table
    wider = [a if a != "32" or i != args.index("--hidden_size") + 1 else "64" for i, a in enumerate(args)]
    with pytest.raises(SystemExit, match="--add: .* other hidden_size"):
        run_experiment(["scaling", "--variants", "mqa", "--add", *wider])
    assert json.loads((tmp_path / "scaling.json").read_text()) == data  # nothing written
