"""Markdown as a reader runs it: the fenced blocks of README.md and of the documentation pages (docs/), the checks
their shell commands must pass, and a runner for their Python blocks. tests/test_readme.py and tests/test_docs.py
share it.

A Python block whose first line is the comment `# illustration: not run` shows code that belongs elsewhere (an
entry of a test file, a fragment) and is skipped by the runner; everything else runs as written.
"""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import torch

from hf_attn_zoo.errors import UserError
from hf_attn_zoo.train import load_recipe
from hf_attn_zoo_cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
ILLUSTRATION = "# illustration: not run"


def blocks(text: str, language: str) -> list[tuple[int, str]]:
    """(line number, code) of every fenced block of `language`, in order."""
    return [
        (text[: match.start()].count("\n") + 1, match.group(2))
        for match in FENCE.finditer(text)
        if match.group(1) == language
    ]


def runnable_python(text: str) -> list[tuple[int, str]]:
    """The Python blocks a reader runs: all but those marked as illustrations."""
    return [(line, code) for line, code in blocks(text, "python") if not code.startswith(ILLUSTRATION)]


def shell_commands(text: str) -> list[tuple[int, list[str]]]:
    """(line, words) of every command of the bash blocks: continuation lines joined, comments and `&&` chains
    split, `[optional]` parts and placeholders in capitals left to the reader."""
    commands = []
    for line, code in blocks(text, "bash"):
        for part_text in code.replace("\\\n", " ").splitlines():
            for part in re.split(r"&&|;", part_text):
                words = shlex.split(part, comments=True)
                if words:
                    commands.append((line, words))
    return commands


def check_hf_attn_zoo_commands(name: str, text: str) -> None:
    """Each `hf-attn-zoo ...` line names a command and options that exist (train options are checked by the
    recipe check below)."""
    parser = build_parser()
    for line, words in shell_commands(text):
        if words[0] != "hf-attn-zoo":
            continue
        words = [word for word in words[1:] if not re.fullmatch(r"\[.*\]", word)]
        namespace, rest = parser.parse_known_args(words)
        if not namespace.command_.passes_through:
            assert not rest, f"{name} line {line}: unknown arguments {rest}"


def recipe_paths(text: str) -> list[tuple[int, str, list[str]]]:
    """(line, recipe, overrides) of every training command."""
    found = []
    for line, words in shell_commands(text):
        recipes = [i for i, word in enumerate(words) if word.startswith("configs/train") or "configs/uptrain" in word]
        # a script of experiments/ reads a recipe as one of its positional arguments, not followed by overrides
        script = words[0].startswith("python") and len(words) > 1 and words[1].startswith("experiments/")
        for i in recipes:
            found.append((line, words[i], [] if script else [w for w in words[i + 1 :] if not w.startswith("[")]))
    return found


def check_recipes_and_files(name: str, text: str) -> None:
    """Every recipe named loads with its overrides; every launch config and script named exists."""
    for line, recipe, overrides in recipe_paths(text):
        assert (ROOT / recipe).is_file(), f"{name} line {line}: {recipe} does not exist"
        try:
            load_recipe(ROOT / recipe, overrides)  # unknown fields and bad values fail here
        except UserError as error:  # a GPU recipe on a machine without one is refused up front, naming the CPU one
            assert not torch.cuda.is_available() and "GPU" in str(error), f"{name} line {line}: {error}"
    for line, words in shell_commands(text):
        for i, word in enumerate(words):
            if word == "--config_file" or word.endswith(".py") and not word.startswith("-"):
                path = words[i + 1] if word == "--config_file" else word
                assert (ROOT / path).is_file(), f"{name} line {line}: {path} does not exist"


def check_extras(name: str, text: str) -> None:
    """`pip install` lines name extras that pyproject.toml declares, and never the package from PyPI."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    extras = set(re.findall(r"^([\w-]+) = \[", pyproject.split("[project.optional-dependencies]")[1], re.M))
    for line, words in shell_commands(text):
        if words[:2] == ["pip", "install"]:
            for word in words:
                for named in re.findall(r"\[([\w,-]+)\]", word):
                    assert set(named.split(",")) <= extras, f"{name} line {line}: extras {named} of {word}"
                assert not word.startswith("hf-attn-zoo["), f"{name} line {line}: hf-attn-zoo is not on PyPI"


def run_demo(folder: Path) -> Path:
    """What `python3 dev.py demo` leaves in a clone (`outputs/demo/final`), from a shortened run in `folder`."""
    command = "from hf_attn_zoo_cli import main; raise SystemExit(main(sys.argv[1:]))"
    options = ["demo", "--max_steps", "3", "--max_documents", "8", "--max_new_tokens", "4"]
    subprocess.run([sys.executable, "-c", f"import sys; {command}", *options], cwd=folder, check=True, timeout=600)
    final = folder / "outputs" / "demo" / "final"
    assert final.is_dir()
    return final


# Runs one file's Python blocks in order in one namespace; a failing block names its file and line.
RUN_BLOCKS = """
import json, sys
name, found = json.load(open(sys.argv[1]))
for line, code in found:
    try:
        exec(compile(code, f"{name}:{line}", "exec"), globals())
    except Exception as error:
        raise SystemExit(f"the Python block at {name} line {line} fails: {error!r}") from error
"""


def run_python_blocks(
    name: str, found: list[tuple[int, str]], cwd: Path, env: dict[str, str], timeout: int = 900
) -> subprocess.CompletedProcess:
    """Run `found` (from `runnable_python`) in a fresh interpreter in `cwd`, in order, in one namespace."""
    script = cwd / "blocks.json"
    script.write_text(json.dumps([name, found]))
    return subprocess.run(
        [sys.executable, "-c", RUN_BLOCKS, str(script)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
