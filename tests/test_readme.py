"""README.md as a new user reads it: its Python blocks run as written, in order, its shell commands name commands,
options, recipes, files and extras that exist, and its variant table is `hf-attn-zoo list`'s.

The blocks run where a fresh clone is after the two set-up commands: `python3 dev.py demo` has written
`outputs/demo/final` (here a short demo run into a temporary folder stands in for it) and the working directory is
that folder. The documentation pages get the same checks in tests/test_docs.py (tests/markdown_blocks.py reads both).
"""

import os

import pytest
from markdown_blocks import (
    ROOT,
    check_extras,
    check_hf_attn_zoo_commands,
    check_recipes_and_files,
    recipe_paths,
    run_demo,
    run_python_blocks,
    runnable_python,
    shell_commands,
)

from hf_attn_zoo.cli import variant_table

README = (ROOT / "README.md").read_text()


def test_the_readme_has_the_blocks_this_test_reads():
    assert len(runnable_python(README)) >= 1 and len(shell_commands(README)) >= 5


def test_the_readme_stays_short():
    """A newcomer reads it in five minutes; everything else is in docs/."""
    assert README.count("\n") <= 250


def test_the_variant_table_is_hf_attn_zoo_list():
    """The README's table block, from its header row to the first line that is not a row, is the registry's."""
    lines = README.splitlines()
    start = lines.index(variant_table().splitlines()[0])
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    assert "\n".join(lines[start:end]) == variant_table(), "README's variant table is not `hf-attn-zoo list`'s"


def test_every_hf_attn_zoo_command_parses():
    check_hf_attn_zoo_commands("README", README)


def test_every_recipe_and_launch_config_named_exists_and_loads():
    assert recipe_paths(README)
    check_recipes_and_files("README", README)


def test_every_extra_named_exists():
    check_extras("README", README)


@pytest.mark.slow
def test_the_python_blocks_run_in_order(tmp_path):
    """Every Python block, as written, in one interpreter, in README order, after a short demo run (about 30 s)."""
    run_demo(tmp_path)
    result = run_python_blocks("README.md", runnable_python(README), tmp_path, dict(os.environ))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "demo-mqa" / "config.json").is_file()  # the quick start's converted model
