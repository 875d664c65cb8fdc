"""The quality board (experiments/quality/quality.py): a tiny board end to end, parameter matching over the
registry, resuming, failing cells, and the verdicts on the papers' claims."""

import json
import random

import pytest
import torch

from experiments.quality import quality
from hf_attn_zoo.models import VARIANTS

WORDS = "the of and to in a that we our for is this it be have will with as by nation people congress state".split()


def write_texts(folder, names, seed):
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for name in names:
        sentences = (" ".join(rng.choices(WORDS, k=12)).capitalize() + "." for _ in range(40))
        (folder / name).write_text(" ".join(sentences) + "\n")


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpora")
    years = [*range(1995, 2001), 2005, 2006, 2015, 2016]
    write_texts(root / "sotu", [f"{year}_President_party.txt" for year in years], seed=0)
    write_texts(root / "plays", ["hamlet_gut.txt", "macbeth_gut.txt"], seed=1)
    return root


def tiny_setup(corpora, output_dir, **fields) -> "quality.QualitySetup":
    options = {
        "output_dir": str(output_dir),
        "data_dir": str(corpora / "sotu"),
        "ood_dir": str(corpora / "plays"),
        "variants": ["gqa", "mqa"],
        "positions": ["rope"],
        "seeds": [0],
        "budget": 128,  # 2 steps of 2 x 32 tokens
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "fields": "{}",
        "lengths": [32, 64],
        "ood_chars_per_work": 600,
        "cache_tokens": 48,
        "overrides": [
            "--data.vocab_size", "300", "--data.block_size", "32",
            "--training.per_device_train_batch_size", "2", "--training.per_device_eval_batch_size", "2",
        ],
    }  # fmt: skip
    return quality.QualitySetup(**{**options, **fields})


ROW_FIELDS = {
    "cell", "variant", "positions", "seed", "parameters", "non_embedding_parameters", "reference_parameters",
    "intermediate_size", "max_position_embeddings", "train_tokens", "steps", "train_seconds", "tokens_per_second",
    "validation_perplexity", "test_perplexity", "test_bits_per_byte", "ood_perplexity", "ood_bits_per_byte",
    "extrapolation", "cache_bytes_per_token", "cell_seconds",
}  # fmt: skip


def test_a_tiny_board_writes_every_field_and_refuses_windows_past_a_table(corpora, tmp_path):
    setup = tiny_setup(corpora, tmp_path, positions=["rope", "learned"])
    rows = quality.run_board(setup, log=lambda _: None)
    assert [row["cell"] for row in rows] == ["gqa-rope-seed0", "gqa-learned-seed0", "mqa-rope-seed0"]
    stored = json.loads((tmp_path / "board.json").read_text())
    assert stored["rows"] == rows and stored["defining"]["budget"] == 128
    for row in rows:
        assert set(row) == ROW_FIELDS, row.get("error")
        assert row["train_tokens"] == 128 and row["steps"] == 2
        assert 1 < row["test_perplexity"] < 300 and row["test_bits_per_byte"] > 0 and row["ood_perplexity"] > 1
        # matched to mha's non-embedding parameters through the MLP width
        assert abs(row["non_embedding_parameters"] / row["reference_parameters"] - 1) <= 0.10
        assert row["extrapolation"]["32"]["perplexity"] == row["test_perplexity"]
    gqa, learned, mqa = rows
    assert mqa["intermediate_size"] > gqa["intermediate_size"]  # MQA's smaller key/value projections go to its MLP
    # the cache is measured: MQA holds half of GQA-2's keys and values (1 x 16 against 2 x 16 per layer, fp32)
    assert gqa["cache_bytes_per_token"] == 2 * 2 * 16 * 4 and mqa["cache_bytes_per_token"] == 2 * 1 * 16 * 4
    assert gqa["max_position_embeddings"] == 64 and "perplexity" in gqa["extrapolation"]["64"]
    # learned positions are a table of the training length: the longer window is refused with the model's reason
    assert learned["max_position_embeddings"] == 32
    assert "max_position_embeddings" in learned["extrapolation"]["64"]["refused"]
    table = (tmp_path / "board.md").read_text()
    assert "| gqa | learned | 1 |" in table and "refused" in table and "**Multi-head attention" in table


def test_a_failing_cell_is_recorded_the_board_goes_on_and_a_rerun_trains_only_what_is_unfinished(
    corpora, tmp_path, monkeypatch
):
    real = quality.run_training
    trained = []

    def failing_for_mqa(model_args, data_args, training_args):
        trained.append(model_args.variant)
        if model_args.variant == "mqa":
            raise RuntimeError("out of memory, say")
        return real(model_args, data_args, training_args)

    monkeypatch.setattr(quality, "run_training", failing_for_mqa)
    rows = quality.run_board(tiny_setup(corpora, tmp_path), log=lambda _: None)
    assert trained == ["gqa", "mqa"]
    assert "error" not in rows[0] and rows[1]["error"] == "RuntimeError: out of memory, say"
    assert "mqa-rope-seed0: RuntimeError: out of memory, say" in (tmp_path / "board.md").read_text()

    # the rerun skips the finished cell and tries the failed one again; a new seed adds its cells
    trained.clear()
    monkeypatch.setattr(quality, "run_training", lambda *args: trained.append(args[0].variant) or real(*args))
    rows = quality.run_board(tiny_setup(corpora, tmp_path, seeds=[0, 1]), log=lambda _: None)
    assert trained == ["gqa", "mqa", "mqa"]  # configuration by configuration: gqa seed 1, then mqa 0 and 1
    assert sorted(row["cell"] for row in rows if "error" not in row) == [
        "gqa-rope-seed0", "gqa-rope-seed1", "mqa-rope-seed0", "mqa-rope-seed1",
    ]  # fmt: skip

    # a board is resumed only with the options that made it
    with pytest.raises(SystemExit, match="budget=128"):
        quality.run_board(tiny_setup(corpora, tmp_path, budget=256), log=lambda _: None)


def test_every_registered_variant_matches_the_reference_parameters_at_the_default_board():
    setup = quality.QualitySetup()
    assert set(setup.variants) == set(VARIANTS)  # the board reads the registry: a new variant joins it unasked
    cells = quality.configurations(setup)
    assert ("gqa", "alibi") in cells and ("gqa", "none") in cells and len(cells) == len(VARIANTS) + 4
    gqa = cells.index(("gqa", "rope"))  # the sweep sits beside its default ...
    assert cells[gqa + 1 : gqa + 5] == [("gqa", p) for p in ("alibi", "sinusoidal", "learned", "none")]
    # ... and each configuration runs at all its seeds before the next starts
    assert [(c.variant, c.seed) for c in quality.plan(setup)[:4]] == [("mha", 0), ("mha", 1), ("mha", 2), ("mqa", 0)]
    for variant, positions in cells:
        fields, count, target = quality.cell_fields(setup, quality.Cell(variant, positions, 0), 4096, 256)
        assert abs(count / target - 1) <= 0.10, (variant, positions, count, target)
        assert fields["intermediate_size"] % 8 == 0 and fields["position_embedding_type"] == positions
        # built for 2,048 positions unless that changes the parameters (tables over positions)
        sized_by_length = positions == "learned" or variant in ("linformer", "aft_full", "aft_local")
        assert fields["max_position_embeddings"] == (256 if sized_by_length else 2048), (variant, positions)
    sliding, _, _ = quality.cell_fields(setup, quality.Cell("sliding_window", "rope", 0), 4096, 256)
    assert sliding["sliding_window"] == 64  # --fields reaches the variants whose config has the field
    # the sparse variants see fewer keys than a training row holds, else they would train exactly as gqa
    bigbird, _, _ = quality.cell_fields(setup, quality.Cell("bigbird", "rope", 0), 4096, 256)
    bigbird = VARIANTS["bigbird"].config(**bigbird)
    seen = bigbird.num_window_blocks + bigbird.num_global_blocks + bigbird.num_random_blocks
    assert seen * bigbird.attention_block_size == 128 and sliding["sliding_window"] < 256
    # heads as wide as the others': differential's presets halve the heads (two maps each), so does the board
    differential, _, _ = quality.cell_fields(setup, quality.Cell("differential", "rope", 0), 4096, 256)
    assert differential["num_attention_heads"] == 4 and sliding["num_attention_heads"] == 8
    config = VARIANTS["differential"].config(**differential)  # head_dim is a head's value width, two maps of half
    mha = VARIANTS["mha"].config("small", hidden_size=128, num_attention_heads=8)
    assert config.head_dim // 2 == mha.head_dim == 16
    odd = quality.QualitySetup(num_attention_heads=9, hidden_size=90)
    with pytest.raises(ValueError, match="differential: --num_attention_heads 9 gives it 3/6 as many"):
        quality.cell_fields(odd, quality.Cell("differential", "rope", 0), 64, 8)


def test_bad_options_are_refused_naming_them(tmp_path):
    with pytest.raises(SystemExit, match="unknown variant.*nope"):
        quality.configurations(quality.QualitySetup(variants=["nope"]))
    with pytest.raises(SystemExit, match="--positions alibi: aft_simple supports"):
        quality.configurations(quality.QualitySetup(position_variant="aft_simple", positions=["alibi"]))
    with pytest.raises(SystemExit, match="--fields"):
        quality.QualitySetup(fields="{window: 3").extra_fields()


def fake_rows(test_perplexities: dict[tuple[str, str], list[float]], extrapolation=None) -> list[dict]:
    rows = []
    for (variant, positions), values in test_perplexities.items():
        for seed, value in enumerate(values):
            scores = (extrapolation or {}).get((variant, positions), {})
            rows.append(
                {
                    "variant": variant,
                    "positions": positions,
                    "seed": seed,
                    "test_perplexity": value,
                    "extrapolation": {n: s[seed] if isinstance(s, list) else s for n, s in scores.items()},
                }
            )
    return rows


def test_claims_say_holds_only_where_the_seeds_do_not_overlap():
    setup = quality.QualitySetup(lengths=[256, 2048])
    rows = fake_rows(
        {
            ("mha", "rope"): [20.0, 20.5, 21.0],
            ("single_head", "rope"): [22.0, 22.5, 23.0],  # apart: holds
            ("mqa", "rope"): [20.8, 21.5, 22.0],  # overlaps mha: within noise
            ("gqa", "rope"): [20.6, 21.0, 21.4],
            ("aft_local", "none"): [30.0, 31.0, 32.0],
            ("aft_simple", "none"): [29.0, 29.5, 29.9],  # apart, the other way: does not hold
        }
    )
    verdicts = dict(quality.claims(rows, setup))
    multi_head, mqa, alibi, aft, linformer, absolute, differential, linear, bigbird, mamba = verdicts.values()
    assert multi_head.startswith("holds: mha (rope) 20.50 ± 0.50 against single_head (rope) 22.50 ± 0.50")
    assert mqa.startswith("within noise") and "GQA's mean lies between them" in mqa
    assert aft.startswith("does not hold at this scale")
    assert alibi.startswith("not measured") and linformer.startswith("not measured (no finished cell of linformer")
    assert absolute.startswith("not measured") and differential.startswith("not measured (no finished cell of diff")
    assert bigbird.startswith("not measured (no finished cell of bigbird") and mamba.startswith("not measured")
    assert linear.startswith("not measured")

    # the three newest: linear against gqa with RoPE and without positions (the worse decides), BigBird within 5%,
    # Mamba no higher than gqa
    newest = rows + fake_rows(
        {
            ("gqa", "none"): [23.0, 23.5, 24.0],
            ("linear", "none"): [23.5, 24.0, 24.5],  # +14.3% on gqa (rope), +2.1% on gqa (none)
            ("bigbird", "rope"): [21.0, 21.5, 22.0],  # +2.4%
            ("mamba", "none"): [20.5, 20.8, 21.1],  # -1.0%
        }
    )
    found = dict(quality.claims(newest, setup))
    linear, bigbird, mamba = (
        found[next(c for c in verdicts if c.startswith(p))] for p in ("Linear", "BigBird", "Mamba")
    )
    assert linear.startswith("does not hold at this scale: linear (none) 24.00 ± 0.50 against gqa (rope)")
    assert "+2.1% (holds)" in linear
    assert bigbird == "holds: bigbird (rope) 21.50 ± 0.50 against gqa (rope) 21.00 ± 0.40, +2.4%"
    assert mamba == "holds: mamba (none) 20.80 ± 0.30 against gqa (rope) 21.00 ± 0.40, -1.0%"

    # absolute positions and differential attention: within 10% of their neighbour, the worst comparison decides
    near = rows + fake_rows({("gqa", "sinusoidal"): [22.0, 22.5, 23.0], ("gqa", "learned"): [30.0, 31.0, 32.0]})
    near += fake_rows({("differential", "rope"): [21.5, 22.5, 23.5]})
    verdicts_near = dict(quality.claims(near, setup))
    absolute = verdicts_near[next(c for c in verdicts if c.startswith("Sinusoidal"))]
    assert absolute.startswith("does not hold at this scale: gqa (sinusoidal) 22.50 ± 0.50 against gqa (rope)")
    learned = "gqa (learned) 31.00 ± 1.00 against gqa (rope) 21.00 ± 0.40, +47.6% (does not hold at this scale)"
    assert "+7.1% (holds); " in absolute and absolute.endswith(learned)
    differential = verdicts_near[next(c for c in verdicts if c.startswith("Differential"))]
    assert differential == "holds: differential (rope) 22.50 ± 1.00 against gqa (rope) 21.00 ± 0.40, +7.1%"

    # Linformer is close when its mean is at most 5% above gqa's; further off, overlapping seeds are within noise
    for seeds, verdict in (
        ([21.5, 22.0, 22.5], "holds"),
        ([21.0, 25.0, 29.0], "within noise"),
        ([30.0] * 3, "does not"),
    ):
        with_linformer = rows + fake_rows({("linformer", "rope"): seeds})
        linformer = dict(quality.claims(with_linformer, setup))[next(c for c in verdicts if c.startswith("Linformer"))]
        assert linformer.startswith(verdict), linformer

    scores = {
        ("gqa", "alibi"): {"256": [{"perplexity": v} for v in (20, 21, 22)], "2048": [{"perplexity": 19.5}] * 3},
        ("gqa", "sinusoidal"): {"256": [{"perplexity": 21}] * 3, "2048": [{"perplexity": 90}] * 3},
        ("gqa", "learned"): {"256": [{"perplexity": 21}] * 3, "2048": {"refused": "position 256 is beyond ..."}},
    }
    rows += fake_rows({key: [21.0] * 3 for key in scores}, scores)
    alibi = dict(quality.claims(rows, setup))[next(c for c in verdicts if c.startswith("ALiBi"))]
    assert alibi.startswith("holds: alibi 19.50 ± 0.00 at 2048, no worse than 21.00 ± 1.00 at 256")
    assert "sinusoidal 90.00 ± 0.00 at 2048, worse than" in alibi and "learned refused at 2048" in alibi


def test_ablations_build_the_board_cell_with_exactly_their_change():
    """Each ablation is the board's cell (its shape and matched MLP) with the one change it names: the "before" rows
    rebuild the initialisations the fixes replaced, the fixed rows are the variants' defaults."""
    from experiments.quality import ablations

    setup = ablations.AblationSetup(output_dir="unused")

    def rms(tensor):
        return tensor.detach().pow(2).mean().sqrt().item()

    def built(name):
        return ablations.build(setup, ablations.ABLATIONS[name], 4096, 256)

    before, fixed = built("sinusoidal-before"), built("sinusoidal")
    tokens = torch.arange(1, 4096)
    assert rms(before.get_input_embeddings()(tokens)) == pytest.approx(0.02 * 128**0.5, rel=0.05)  # 0.23
    assert before.config.sinusoid_amplitude == 1.0
    assert rms(fixed.get_input_embeddings()(tokens)) == pytest.approx(0.02, rel=0.05)
    assert ablations.position_rms(fixed, 256) == pytest.approx(0.005, rel=1e-9)  # a quarter of the tokens' RMS
    assert ablations.position_rms(built("sinusoidal-token-rms"), 256) == pytest.approx(0.02, rel=1e-9)
    assert rms(built("learned-before").model.embed_positions.weight) == pytest.approx(0.02, rel=0.05)
    assert not built("learned").model.embed_positions.weight.any()
    assert torch.equal(built("differential-before").model.layers[0].self_attn.head_norm.weight, torch.ones(32))
    assert built("differential").model.layers[0].self_attn.head_norm.weight[0].item() == pytest.approx(0.02 * 128**0.5)
    # the fixed cells are the board's own: same fields, same initialisation
    board = quality.QualitySetup(output_dir="unused")
    for name in ("sinusoidal", "learned", "differential"):
        ablation = ablations.ABLATIONS[name]
        fields, _, _ = quality.cell_fields(board, quality.Cell(ablation.variant, ablation.positions, 0), 4096, 256)
        assert built(name).config.intermediate_size == fields["intermediate_size"]
