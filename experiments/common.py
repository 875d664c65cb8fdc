"""What the experiments share: timed samples, samples alternating between a zoo model and its baseline,
paired (back-to-back) ratios, the same-size `LlamaForCausalLM` baseline, result writing (a docs page's measured part
too), the command line, and the boards' resumable results file (`Board`) with their statistics over seeds
(`mean_spread`, `figure`, `compare_seeds`).

A script here serves one or more named benchmarks (its `BENCHMARKS`: name -> `Benchmark`) and runs as

    python -m experiments NAME [options]                   (from the repository's root; `--help` lists the names)
    python -m experiments.STUDY.SCRIPT [NAME] [options]    (the same; NAME may be left out where there is one)

Options are the fields of the benchmark's setup dataclass, parsed by transformers' `HfArgumentParser`
(`--field value`; `--field-name` works as well; a list option given `[]`, `''` or `null` is emptied, as a list field of
the training path's recipes); `--help` lists them with their defaults. `--replot` redraws a
benchmark's figures from the results file in `--output_dir` (its `<stem>.json`) and nothing else: no run, and the
tables and JSON stay as they are.
"""

import fcntl
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol, TypeVar

from tqdm.auto import tqdm
from transformers import HfArgumentParser, LlamaConfig

from hf_attn_zoo.checkpoints import write_atomically
from hf_attn_zoo.errors import one_line
from hf_attn_zoo.models import get_variant

EXPERIMENTS = Path(__file__).resolve().parent
REPOSITORY = EXPERIMENTS.parent

Model = TypeVar("Model")
Sample = TypeVar("Sample")


@dataclass
class Results:
    """The folder a benchmark writes to; every benchmark's setup extends it."""

    output_dir: str = field(
        default="", metadata={"help": "folder for the table, the JSON and any plot (default: the study's results/)"}
    )

    def __post_init__(self) -> None:
        if not self.output_dir:  # the results/ folder beside the script that defines the setup
            self.output_dir = str(Path(sys.modules[type(self).__module__].__file__).resolve().parent / "results")


def fastest(fn: Callable[[], object], runs: int) -> float:
    """Seconds of the fastest of `runs` calls: on a shared machine interference only ever adds time (timeit's rule)."""
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def prefill_and_decode_seconds(generate: Callable[[int], object], new_tokens: int, runs: int) -> tuple[float, float]:
    """(seconds of the prefill, seconds of the `new_tokens - 1` decode steps after it), each the fastest of `runs`:
    `generate(n)` generates n tokens per row; the prefill is a generation of one token and decoding the rest of a
    generation of `new_tokens`, so a decode rate counts decode steps alone and both include what `generate()` adds
    around the model. The last call generates `new_tokens`."""
    first = fastest(lambda: generate(1), runs)
    whole = fastest(lambda: generate(new_tokens), runs)
    return first, max(whole - first, 1e-9)


def alternate(
    models: dict[str, Model],
    measures: dict[str, Callable[[Model], Sample]],
    repeats: int,
    warm_up: bool = True,
    after_repeat: Callable[[int, dict[str, dict[str, list[Sample]]]], None] | None = None,
) -> dict[str, dict[str, list[Sample]]]:
    """`samples[measure][model]`: every measure of every model, `repeats` times.

    Within a repeat each measure runs on all models back to back, in the order of `models` on even repeats and the
    reverse on odd ones (A B, B A, ...), so that drift of a shared machine falls on every model alike and each pair
    compares samples taken moments apart (`paired_ratio`). `warm_up`: one untimed call of each measure on each model
    first, since first calls pay for allocations and lazy initialisation. `after_repeat(repeat, samples)` reports
    progress."""
    if warm_up:
        for measure in measures.values():
            for model in models.values():
                measure(model)
    samples = {name: {label: [] for label in models} for name in measures}
    order = list(models.items())
    for repeat in range(repeats):
        for name, measure in measures.items():
            for label, model in order if repeat % 2 == 0 else order[::-1]:
                samples[name][label].append(measure(model))
        if after_repeat is not None:
            after_repeat(repeat, samples)
    return samples


def paired_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> float:
    """Median of the ratios of samples taken back to back: slow drift of the machine cancels within each pair."""
    return statistics.median(a / b for a, b in zip(numerators, denominators, strict=True))


def compare(samples: dict[str, list[float]], prefix: str) -> dict[str, float]:
    """`{prefix}_{model}`: the median of each of two models' samples (as `alternate` gives them); `{prefix}_ratio`:
    the paired ratio of the first model over the second."""
    (first, numerators), (second, denominators) = samples.items()
    return {
        f"{prefix}_{first}": statistics.median(numerators),
        f"{prefix}_{second}": statistics.median(denominators),
        f"{prefix}_ratio": paired_ratio(numerators, denominators),
    }


def llama_like(config, attn_implementation: str = "sdpa") -> LlamaConfig:
    """The config of the same-size baseline: `LlamaForCausalLM` with a zoo config's width, depth, MLP, head counts,
    vocabulary and positions. Llama's heads are as wide as the variant's value heads (the width of a head's output,
    which sizes o_proj), `head_dim` for most variants and MLA's `v_head_dim`."""
    return LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=get_variant(config.model_type).attention_class.value_width(config),
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        attn_implementation=attn_implementation,
    )


def write_results(
    output_dir: str | Path,
    stem: str,
    data: Any,
    table: str | None = None,
    plots: dict[str, Callable[[Path], bool]] | None = None,
    log: Callable[[str], None] = print,
) -> None:
    """Print `table` and write it to `<stem>.md`, `data` to `<stem>.json` (paths as strings, those inside this
    repository relative to it: committed results name no machine's folders), and each plot `file name -> draw(path)`;
    `draw` returns False when matplotlib is missing (the `plots` extra)."""
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    if table is not None:
        log(table)
        (folder / f"{stem}.md").write_text(table + "\n")
        written.append(f"{stem}.md")
    write_atomically(folder / f"{stem}.json", json.dumps(in_repository(data), indent=2, default=str) + "\n")
    written.append(f"{stem}.json")
    written += draw_figures(folder, plots or {})
    log(f"written to {folder}: {', '.join(written)}")


def in_repository(data: Any) -> Any:
    """`data` with every path (or absolute path string) inside this repository made relative to its root."""
    if isinstance(data, dict):
        return {key: in_repository(value) for key, value in data.items()}
    if isinstance(data, list | tuple):
        return [in_repository(value) for value in data]
    if isinstance(data, str | Path) and Path(data).is_absolute() and Path(data).is_relative_to(REPOSITORY):
        return str(Path(data).relative_to(REPOSITORY))
    return str(data) if isinstance(data, Path) else data


def replace_between(page: Path, markers: tuple[str, str], block: str) -> bool:
    """Replace what lies between the two `markers` (HTML comments) of `page` with `block`: the measured part of a
    docs page, rewritten by the experiment that measured it. False, and the page untouched, where the page or either
    marker is missing."""
    if not page.is_file():
        return False
    text = page.read_text()
    begin, end = markers
    if begin not in text or end not in text:
        return False
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    page.write_text(f"{head}{begin}\n{block}\n{end}{tail}")
    return True


def draw_figures(folder: str | Path, plots: dict[str, Callable[[Path], bool]]) -> list[str]:
    """Draw each plot `file name -> draw(path)` into `folder`; what was written, as `write_results` reports it."""
    return [
        name if draw(Path(folder) / name) else f"no {name} (no matplotlib, or no data for it)"
        for name, draw in plots.items()
    ]


# a benchmark's figures from its results: (the data of its results file) -> {file name: draw(path)}
Figures = Callable[[Any], dict[str, Callable[[Path], bool]]]


# ---------------------------------------------------------------------------------------------------------------
# The boards: one row per cell in a resumable results file, figures over seeds


def config_fields(text: str) -> dict:
    """A board's `--fields` option: a JSON mapping of config fields, or the board refused naming it."""
    try:
        extra = json.loads(text)
    except ValueError as error:
        raise SystemExit(f"--fields {text!r} is not JSON: {error}") from None
    if not isinstance(extra, dict):
        raise SystemExit(f"--fields {text!r}: give a JSON mapping of config fields")
    return extra


class BoardSetup(Protocol):
    """What `Board` reads of a board's setup: its folder and the options that define what a row means."""

    output_dir: str

    def defining(self) -> dict: ...


class BoardCell(Protocol):
    @property
    def name(self) -> str: ...


STOP = "STOP"  # a board stops between cells when its folder holds this file (`touch DIR/STOP`)


@contextmanager
def exclusive(lock_file: Path) -> Iterator[None]:
    """Hold an exclusive lock on `lock_file` (created if missing) for the block: processes sharing a results file
    read, merge and rewrite it one at a time."""
    with open(lock_file, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


@contextmanager
def claim(folder: Path, cell: str, wait: bool = False) -> Iterator[bool]:
    """True while this process holds the board's `cell` (an exclusive lock on `<folder>/claims/<cell>.lock`, which
    the system drops when the process ends, however it ends); False where another process holds it, or, with `wait`,
    True once that process lets it go (a cell that needs another's output waits for the process making it)."""
    claims = Path(folder) / "claims"
    claims.mkdir(parents=True, exist_ok=True)
    with open(claims / f"{cell}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True  # the lock goes with the file's closing


class Board:
    """board.json: the defining options and one row per cell, rewritten atomically after every cell."""

    def __init__(self, setup: BoardSetup) -> None:
        self.folder = Path(setup.output_dir)
        self.path = self.folder / "board.json"
        self.defining = setup.defining()
        self.rows: list[dict] = []
        if self.path.is_file():
            stored = json.loads(self.path.read_text())
            if stored["defining"] != self.defining:
                changed = sorted(k for k in self.defining if stored["defining"].get(k) != self.defining[k])
                was = "; ".join(f"{k}={stored['defining'].get(k)}" for k in changed)
                raise SystemExit(
                    f"{self.path} was trained with other options ({was}); rerun with those to resume it, or give "
                    f"another --output_dir"
                )
            self.rows = stored["rows"]

    def finished(self, cell: BoardCell) -> bool:
        return any(row["cell"] == cell.name and "error" not in row for row in self.rows)

    def refresh(self) -> None:
        """Take in the rows other processes of this board recorded since this one last read board.json."""
        if self.path.is_file():
            mine = {row["cell"]: row for row in self.rows}
            for stored in json.loads(self.path.read_text())["rows"]:
                if stored["cell"] not in mine or ("error" in mine[stored["cell"]] and "error" not in stored):
                    mine[stored["cell"]] = stored
            self.rows = list(mine.values())

    def claim(self, cell: BoardCell) -> AbstractContextManager[bool]:
        return claim(self.folder, cell.name)

    def record(self, row: dict) -> None:
        """Add (or replace) `row` and rewrite board.json. Under a lock, the rows another process on the same folder
        recorded since this one read the file are kept: several runs of one board (one per core) share its board.json
        without dropping each other's rows."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with exclusive(self.folder / "board.lock"):
            self.refresh()
            self.rows = [*(r for r in self.rows if r["cell"] != row["cell"]), row]
            write_atomically(self.path, json.dumps({"defining": self.defining, "rows": self.rows}, indent=2) + "\n")

    def run(
        self,
        cells: Sequence[BoardCell],
        run: Callable[[Any], dict],
        keys: Callable[[Any], dict],
        done: Callable[[dict], str],
        write: Callable[[list[dict]], None],
        desc: str,
        log: Callable[[str], None],
    ) -> None:
        """Run every unfinished cell (`run(cell)` -> its row) under a progress bar, recording each row the moment it
        ends and calling `write(rows)` after it; a cell that raises is recorded with its error (and `keys(cell)`),
        the board goes on, and a rerun tries it again. `done(row)` is the line logged for a finished cell. Several
        processes may run the same board at once (one per core): each cell is claimed by the first to reach it, and
        the others pass over it and over the cells they find finished. A file named `STOP` in the board's folder
        stops it between cells (every process of the board, each after its current cell; removed by the next run),
        so that a stop loses no cell's work."""
        stop = self.folder / STOP
        stop.unlink(missing_ok=True)
        todo = [cell for cell in cells if not self.finished(cell)]
        log(f"{len(cells) - len(todo)} of {len(cells)} cells finished already; {len(todo)} to run")
        with tqdm(total=len(todo), desc=desc, unit="cell", file=sys.stdout) as bar:
            for cell in todo:
                if stop.exists():
                    log(f"{stop} found: stopped before {cell.name}; rerun the same command to go on")
                    return
                bar.set_postfix_str(cell.name)
                with self.claim(cell) as mine:
                    self.refresh()
                    if not mine or self.finished(cell):
                        bar.update()
                        log(f"{cell.name}: {'finished' if mine else 'under way'} in another process of this board")
                        continue
                    try:
                        row = run(cell)
                    except Exception as error:  # recorded, and the board goes on; a rerun tries the cell again
                        row = {"cell": cell.name, **keys(cell), "error": f"{type(error).__name__}: {one_line(error)}"}
                    self.record(row)
                bar.update()
                log(f"{cell.name}: " + (row["error"] if "error" in row else done(row)))
                write(self.rows)


def mean_spread(values: list[float]) -> tuple[float, float]:
    """The mean of the seeds and their sample standard deviation (0 for one seed)."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def figure(values: list[float], digits: int = 2) -> str:
    """`mean ± standard deviation` of the seeds as a table shows it; the one value alone; empty for none."""
    if not values:
        return ""
    mean, spread = mean_spread(values)
    return f"{mean:.{digits}f} ± {spread:.{digits}f}" if len(values) > 1 else f"{mean:.{digits}f}"


def compare_seeds(a: list[float], b: list[float]) -> int:
    """-1 if every seed of `a` is below every seed of `b`, 1 if above, 0 where the ranges overlap (within noise)."""
    if not a or not b:
        return 0
    if max(a) < min(b):
        return -1
    if min(a) > max(b):
        return 1
    return 0


@dataclass(frozen=True)
class Benchmark:
    """One benchmark of a script: `run(setup)` measures, prints and writes; `setup` is the dataclass of its options."""

    setup: type
    run: Callable[[Any], object]
    # the figures `run` draws, from the data it writes to `<output_dir>/<results>.json`: `--replot` calls the same
    # function on that file, so a figure redrawn is the figure a run draws (None: the benchmark draws no figure)
    figures: Figures | None = None
    results: str = ""

    def replot(self, setup, log: Callable[[str], None] = print) -> list[str]:
        """Redraw the figures from `<setup.output_dir>/<results>.json` alone: nothing is measured or rewritten."""
        path = Path(setup.output_dir) / f"{self.results}.json"
        if not path.is_file():
            raise SystemExit(f"--replot: no {path}; run the benchmark first, or give the folder as --output_dir")
        written = draw_figures(path.parent, self.figures(json.loads(path.read_text())))
        log(f"redrawn in {path.parent} from {path.name}: {', '.join(written)}")
        return written


# what empties a list option (`--encoders []`): argparse's lists take one value at least and would read it as a name.
# Not `none`, which the recipes also accept: here it names a cell (the translation board's RNN without attention).
EMPTY_LIST = ("[]", "", "null")


def empty_lists(setup: object) -> None:
    """Empty the list options given one of `EMPTY_LIST` alone."""
    for option in fields(setup):
        value = getattr(setup, option.name)
        if isinstance(value, list) and len(value) == 1 and str(value[0]).strip().lower() in EMPTY_LIST:
            setattr(setup, option.name, [])


def main(benchmarks: dict[str, Benchmark], argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Run the benchmark `argv` names first (or a script's only one) with the options after the name."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = prog or Path(sys.argv[0]).name
    if argv and argv[0] in benchmarks:
        name, argv, prog = argv[0], argv[1:], f"{prog} {argv[0]}"
    elif len(benchmarks) == 1:
        (name,) = benchmarks
    else:
        listing = "\n".join(f"  {name:16s}{b.setup.__doc__.splitlines()[0]}" for name, b in benchmarks.items())
        asked = bool({"-h", "--help"} & set(argv[:1]))
        print(
            f"usage: {prog} {{{','.join(benchmarks)}}} [options]\n{listing}", file=sys.stdout if asked else sys.stderr
        )
        return 0 if asked else 2
    benchmark = benchmarks[name]
    parser = HfArgumentParser(benchmark.setup, prog=prog, description=benchmark.setup.__doc__)
    parser.add_argument(
        "--replot",
        action="store_true",
        help="redraw the figures from the results JSON in --output_dir: no run, tables and JSON untouched",
    )
    # the setup, and the namespace of the options that are no field of it (--replot)
    setup, options = parser.parse_args_into_dataclasses(argv, look_for_args_file=False)
    empty_lists(setup)
    if not options.replot:
        benchmark.run(setup)
    elif benchmark.figures is None:
        raise SystemExit(f"--replot: {name} draws no figures")
    else:
        benchmark.replot(setup)
    return 0
