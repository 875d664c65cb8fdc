"""The experiments live beside the package, never in it: `python -m experiments NAME` runs each from a checkout, and
nothing the package installs imports them."""

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.__main__ import EXPERIMENTS, main

REPOSITORY = Path(__file__).resolve().parents[1]
PACKAGE = REPOSITORY / "hf_attn_zoo"


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports when it runs, by its absolute name (relative imports stay inside the package;
    imports under `if TYPE_CHECKING:` never run)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    typing_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
        for statement in block.body
        for node in ast.walk(statement)
    }
    names = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_the_package_imports_nothing_from_the_experiments():
    files = [*PACKAGE.rglob("*.py"), REPOSITORY / "hf_attn_zoo_cli.py"]
    reaching = {
        str(path.relative_to(REPOSITORY)): sorted(name for name in imported_modules(path) if name.split(".")[0] in
                                                  ("experiments", "benchmarks", "common"))
        for path in files
    }  # fmt: skip
    assert {path: names for path, names in reaching.items() if names} == {}
    # nor does it look for them on the file system: no path into the checkout's experiments folder
    mentions = [str(p.relative_to(REPOSITORY)) for p in files if '"experiments"' in p.read_text()]
    assert mentions == []


def test_the_package_never_imports_its_command_line_front():
    """`hf_attn_zoo_cli` (beside the package, so that `--help` answers without torch) imports the package when a
    command runs; the package naming it back would make the two one cycle."""
    reaching = [
        str(p.relative_to(REPOSITORY)) for p in PACKAGE.rglob("*.py") if "hf_attn_zoo_cli" in imported_modules(p)
    ]
    assert reaching == []


def test_the_installed_package_runs_where_there_are_no_experiments(tmp_path):
    """Importing the package and its command line from outside the checkout leaves `experiments` unimported."""
    code = (
        "import sys, hf_attn_zoo, hf_attn_zoo.cli, hf_attn_zoo.convert, hf_attn_zoo.evaluation\n"
        "print(sorted(name for name in sys.modules if name.split('.')[0] == 'experiments'))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path, timeout=600
    )
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_every_experiment_names_a_benchmark_of_its_module(name):
    module = importlib.import_module(f"experiments.{EXPERIMENTS[name][0]}")
    assert name in module.BENCHMARKS
    with pytest.raises(SystemExit) as exit_info:
        main([name, "--help"])
    assert exit_info.value.code == 0


def test_every_benchmark_of_a_study_is_listed():
    modules = {module for module, _ in EXPERIMENTS.values()}
    declared = {
        name for module in modules for name in importlib.import_module(f"experiments.{module}").BENCHMARKS
    }  # fmt: skip
    assert declared == set(EXPERIMENTS)


def test_an_unknown_experiment_lists_them_all(capsys):
    assert main(["nope"]) == 2
    printed = capsys.readouterr().err
    assert printed.startswith("usage: python -m experiments NAME") and all(name in printed for name in EXPERIMENTS)
    assert main(["--help"]) == 0 and "quality" in capsys.readouterr().out


def test_a_list_option_is_emptied_by_brackets_or_null():
    """`--encoders []` (or `''`, `null`) empties a list option, as a recipe's list field; `none` alone is a name
    (the RNN without attention), and other lists stay as given."""
    from transformers import HfArgumentParser

    from experiments.common import empty_lists
    from experiments.translation.cells import TranslationSetup

    argv = ["--encoders", "[]", "--natives", "null", "--uptrain_methods", "", "--rnns", "none"]
    (setup,) = HfArgumentParser(TranslationSetup).parse_args_into_dataclasses([*argv, "--alphas", "0.05"])
    empty_lists(setup)
    assert setup.encoders == setup.natives == setup.uptrain_methods == []
    assert setup.rnns == ["none"] and setup.alphas == [0.05] and setup.seeds == [0, 1, 2]


def test_results_default_to_the_studys_folder():
    from experiments.speed.scaling import ScalingSetup

    assert Path(ScalingSetup().output_dir) == REPOSITORY / "experiments" / "speed" / "results"


def test_results_name_the_repositorys_paths_relative_to_it(tmp_path):
    from experiments.common import write_results

    inside = REPOSITORY / "data" / "sotu"
    setup = {"data_dir": str(inside), "recipe": inside / "x.yaml", "files": [str(inside)], "other": "/elsewhere/a"}
    write_results(tmp_path, "results", {"setup": setup, "count": 3}, log=lambda _: None)
    written = json.loads((tmp_path / "results.json").read_text())
    assert written == {
        "setup": {
            "data_dir": "data/sotu",
            "recipe": "data/sotu/x.yaml",
            "files": ["data/sotu"],
            "other": "/elsewhere/a",  # outside the repository: kept as it is
        },
        "count": 3,
    }


def test_llama_writes_ratios_from_the_command_line(tmp_path):
    """`python -m experiments llama` from the repository's root, as a user runs it."""
    args = ["llama", "--hidden_size", "32", "--num_hidden_layers", "1", "--intermediate_size", "64"]
    args += ["--vocab_size", "64", "--train_seq_len", "16", "--train_steps", "1", "--prompt_len", "4"]
    args += ["--new_tokens", "3", "--decode_batch_sizes", "1", "2", "--decode_runs", "1", "--repeats", "2"]
    command = [sys.executable, "-m", "experiments", *args, "--output_dir", str(tmp_path)]
    subprocess.run(command, cwd=REPOSITORY, check=True, capture_output=True, text=True, timeout=600)
    result = json.loads((tmp_path / "speed_gqa_vs_llama.json").read_text())
    assert len(result["ratios"]) == 4 and all(ratio > 0 for ratio in result["ratios"].values())
    training = [metric for metric in result["ratios"] if metric.startswith("training")]
    assert "both defaults" in training[0] and "opt-in" in training[1]  # the headline row compares defaults
    assert all(len(sample["llama"]) == len(sample["zoo"]) == 2 for sample in result["samples"].values())
    assert "| zoo / Llama |" in (tmp_path / "speed_gqa_vs_llama.md").read_text()


def test_seq2seq_writes_ratios_cache_bytes_and_the_matched_rnn(tmp_path):
    """`python -m experiments seq2seq` at tiny sizes, one repeat: every field of the results, positive ratios, the
    cross-attention caches in the proportions of their key/value heads, the RNN within 5% of the Transformer's
    parameters. No timing is asserted."""
    args = ["seq2seq", "--vocab_size", "128", "--hidden_size", "32", "--intermediate_size", "64"]
    args += ["--encoder_layers", "1", "--decoder_layers", "1", "--num_attention_heads", "4"]
    args += ["--gqa_key_value_heads", "2", "--cache_batch_size", "2"]
    args += ["--train_batch_size", "2", "--source_len", "8", "--target_len", "6", "--train_steps", "1"]
    args += ["--new_tokens", "3", "--decode_batch_sizes", "1", "2", "--decode_runs", "1", "--repeats", "1"]
    assert main([*args, "--output_dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "seq2seq.json").read_text())
    assert set(result) >= {
        "setup",
        "parameters",
        "samples",
        "ratios",
        "rnn",
        "cross_attention_cache",
        "rnn_hidden_size",
    }
    for ratios in (result["ratios"], result["ratios_bart"]):
        assert len(ratios) == 3 and all(ratio > 0 for ratio in ratios.values())
    assert all(
        len(sample["zoo"]) == len(sample["t5"]) == len(sample["bart"]) == 1 for sample in result["samples"].values()
    )
    # FLOPs counted per token; utilisation = tokens/s x FLOPs/token / the measured matmul peak
    assert result["peak_flops"] > 0 and set(result["utilisation"]) == {"zoo", "t5", "bart"}
    for name, row in result["utilisation"].items():
        assert row["flops_per_token"] == result["flops_per_token"][name] > 2 * result["parameters"][name] / 2
        assert row["of_peak"] == pytest.approx(
            row["tokens_per_second"] * row["flops_per_token"] / result["peak_flops"]
        )
    assert result["rnn"]["tokens_per_second_ratio"] > 0 and result["rnn"]["tokens_per_second_rnn"] > 0
    parameters = result["parameters"]
    assert parameters["t5"] > 0 and abs(parameters["rnn"] / parameters["zoo"] - 1) < 0.05
    cache = {row["kind"]: row for row in result["cross_attention_cache"]}
    assert list(cache) == ["MHA", "GQA", "MQA", "additive"]
    assert all(row["bytes_per_source_token"] == row["formula_bytes_per_source_token"] for row in cache.values())
    # per layer and source token: keys and values of 4, 2 and 1 heads of 8 float32 numbers
    assert [cache[kind]["bytes_per_source_token"] for kind in ("MHA", "GQA", "MQA")] == [256, 128, 64]
    table = (tmp_path / "seq2seq.md").read_text()
    assert "| zoo / T5 | zoo / BART |" in table and "relative position bias" in table and "RoPE" in table
    assert "| of matmul peak |" in table


def test_two_runs_of_one_board_on_disjoint_cells_keep_each_others_rows(tmp_path):
    """Two processes (one per core) on one board folder: each records its cells without dropping the other's, and a
    finished row recorded elsewhere replaces this run's error row for the same cell."""
    from experiments.common import Board

    class Setup:
        output_dir = str(tmp_path)

        def defining(self) -> dict:
            return {"budget": 1}

    first, second = Board(Setup()), Board(Setup())  # both read the folder before either recorded anything
    first.record({"cell": "a-seed0", "value": 1})
    second.record({"cell": "a-seed2", "error": "RuntimeError: stopped"})
    first.record({"cell": "a-seed1", "value": 2})
    first.record({"cell": "a-seed2", "value": 3})
    second.record({"cell": "b-seed0", "value": 4})
    stored = json.loads((tmp_path / "board.json").read_text())
    assert stored["defining"] == {"budget": 1}
    assert {row["cell"]: row.get("value") for row in stored["rows"]} == {
        "a-seed0": 1,
        "a-seed1": 2,
        "a-seed2": 3,
        "b-seed0": 4,
    }
    assert Board(Setup()).finished(type("Cell", (), {"name": "a-seed2"})())


def test_a_board_stops_between_cells_when_its_folder_holds_stop(tmp_path):
    """`touch DIR/STOP` while a board runs: the cell under way finishes and is recorded, the next is not started;
    the next run removes the file and goes on from there."""
    from experiments.common import STOP, Board

    class Setup:
        output_dir = str(tmp_path)

        def defining(self) -> dict:
            return {"budget": 1}

    cells = [type("Cell", (), {"name": f"a-seed{seed}"})() for seed in range(3)]
    ran = []

    def run(cell) -> dict:
        ran.append(cell.name)
        (tmp_path / STOP).touch()  # as a user would while this cell runs
        return {"cell": cell.name}

    def board_run(board: Board) -> None:
        board.run(cells, run, keys=lambda c: {}, done=lambda r: "", write=lambda rows: None, desc="", log=print)

    board_run(Board(Setup()))
    assert ran == ["a-seed0"] and (tmp_path / STOP).exists()
    assert [row["cell"] for row in json.loads((tmp_path / "board.json").read_text())["rows"]] == ["a-seed0"]
    board_run(Board(Setup()))  # removes the file, runs the next cell, which touches it again
    assert ran == ["a-seed0", "a-seed1"]


def test_processes_of_one_board_share_its_cells(tmp_path):
    """The same board command run twice (one per core): a cell another process holds is passed over, and so is one
    another process finished after this one made its list; the rest run here."""
    import fcntl

    from experiments.common import Board

    class Setup:
        output_dir = str(tmp_path)

        def defining(self) -> dict:
            return {"budget": 1}

    cells = [type("Cell", (), {"name": f"a-seed{seed}"})() for seed in range(4)]
    ran, logged = [], []

    def run(cell) -> dict:
        ran.append(cell.name)
        if cell.name == "a-seed0":  # meanwhile the other process finishes a-seed2
            Board(Setup()).record({"cell": "a-seed2", "value": "there"})
        return {"cell": cell.name, "value": "here"}

    (tmp_path / "claims").mkdir()
    with open(tmp_path / "claims" / "a-seed1.lock", "w") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the other process is training a-seed1
        Board(Setup()).run(
            cells, run, keys=lambda c: {}, done=lambda r: "", write=lambda rows: None, desc="", log=logged.append
        )
    assert ran == ["a-seed0", "a-seed3"]
    assert "a-seed1: under way in another process of this board" in logged
    assert "a-seed2: finished in another process of this board" in logged
    rows = {row["cell"]: row["value"] for row in json.loads((tmp_path / "board.json").read_text())["rows"]}
    assert rows == {"a-seed0": "here", "a-seed2": "there", "a-seed3": "here"}
    # the claims went with this run: a rerun takes the cell the other process held (and stopped without finishing)
    Board(Setup()).run(cells, run, keys=lambda c: {}, done=lambda r: "", write=lambda rows: None, desc="", log=print)
    assert ran == ["a-seed0", "a-seed3", "a-seed1"]


def test_a_cell_that_needs_another_waits_for_the_process_holding_it(tmp_path):
    """`claim(..., wait=True)`: the translation board's uptraining cells wait for the process training their parent
    rather than train it a second time beside it."""
    import threading

    from experiments.common import claim

    order = []

    def waiter() -> None:
        with claim(tmp_path, "parent-mha-seed0", wait=True) as mine:
            order.append(("waiter", mine))

    with claim(tmp_path, "parent-mha-seed0") as mine:
        assert mine
        with claim(tmp_path, "parent-mha-seed0") as again:  # a second holder without waiting is told no at once
            assert not again
        thread = threading.Thread(target=waiter)
        thread.start()
        thread.join(timeout=0.5)
        assert thread.is_alive()  # still waiting while the parent is held
        order.append(("holder", True))
    thread.join(timeout=10)
    assert order == [("holder", True), ("waiter", True)]
