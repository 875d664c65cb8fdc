#!/usr/bin/env python3
"""Set up whatever is missing, then run the tests or the main job. Needs nothing but Python >= 3.10.

    python3 dev.py test [pytest arguments]    the test suite (what CI runs, through .ci/run), a worker per core
    python3 dev.py demo [demo options]        the main job (`hf-attn-zoo demo --help` lists the options)
    python3 dev.py docs [--serve]             the documentation site, built strictly into site/ (or served locally)

Set-up: a virtual environment in .venv with the package installed in editable mode with its [dev] extra, torch pinned
by constraints.txt. It is redone only when pyproject.toml or constraints.txt change.

torchao (int8 weights, the `quant` extra) goes to .venv/torchao-site, off the interpreter's path, and not into the
environment: transformers imports torchao at import time whenever it is installed, and every torchao release on PyPI
then writes warnings on a CPU-only torch 2.13 (CUDA kernel libraries it cannot load, or that its kernels do not match
this torch, and enums registered in a way torch 2.13 deprecates). tests/test_quantization.py runs the int8 tests in
an interpreter with that folder on its path; everything else imports transformers without them.
"""

import hashlib
import os
import shlex
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PYTHON = BIN / ("python.exe" if os.name == "nt" else "python")
STAMP = VENV / ".hf-attn-zoo-installed"
TORCHAO_SITE = VENV / "torchao-site"  # tests/test_quantization.py looks for it here


def requirements_fingerprint() -> str:
    digest = hashlib.sha256()
    for name in ("pyproject.toml", "constraints.txt"):
        digest.update((ROOT / name).read_bytes())
    return digest.hexdigest()


def set_up() -> None:
    if not PYTHON.exists():
        print(f"creating {VENV}", flush=True)
        venv.create(VENV, with_pip=True)
    fingerprint = requirements_fingerprint()
    if STAMP.exists() and STAMP.read_text() == fingerprint:
        return
    print("installing hf-attn-zoo[dev] with torch pinned by constraints.txt", flush=True)
    pip = [str(PYTHON), "-m", "pip", "install", "--disable-pip-version-check", "--quiet"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    constraints = ["-c", str(ROOT / "constraints.txt")]
    subprocess.run([*pip, *constraints, "-e", f"{ROOT}[dev]"], check=True)
    # set-ups from before torchao moved out of the environment have it inside
    if subprocess.run([str(PYTHON), "-m", "pip", "show", "--quiet", "torchao"], capture_output=True).returncode == 0:
        subprocess.run([str(PYTHON), "-m", "pip", "uninstall", "--yes", "--quiet", "torchao"], check=True)
    # torchao's pure-Python wheel: the platform wheels add CUDA kernels that a CPU-only torch cannot load
    pure_python = ["--only-binary", ":all:", "--platform", "any", "--implementation", "py", "--abi", "none"]
    subprocess.run(
        [*pip, *constraints, *pure_python, "--no-deps", "--upgrade", "--target", str(TORCHAO_SITE), "torchao"],
        check=True,
    )
    STAMP.write_text(fingerprint)


def workers(rest: list[str]) -> list[str]:
    """pytest-xdist options: one worker per core (at most 4), each test file whole on one worker so that a file's
    module fixtures are built once. Nothing when there is one core, when the arguments or PYTEST_ADDOPTS choose
    (`-n 0` runs in one process), or for the debugger (`--pdb`, `--trace`), which needs one process; a `--dist` of
    their own keeps its mode."""
    given = [*rest, *shlex.split(os.environ.get("PYTEST_ADDOPTS", ""))]  # as pytest reads it
    chosen = ("-n", "--numprocesses", "no:xdist", "--pdb", "--trace")
    if any(arg in chosen or arg.startswith(("-n", "--numprocesses=", "-pno:xdist")) for arg in given):
        return []
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if cores == 1:
        return []
    # a --dist of the user's own replaces loadfile; workers are still needed for it to distribute to
    dist = [] if any(arg == "--dist" or arg.startswith("--dist=") for arg in given) else ["--dist", "loadfile"]
    return ["--numprocesses", str(min(cores, 4)), *dist]


def docs(rest: list[str], env: dict[str, str]) -> int:
    """`mkdocs build --strict` into site/, or `mkdocs serve` with `--serve` (other arguments go to mkdocs)."""
    mkdocs = [str(PYTHON), "-m", "mkdocs"]
    if "--serve" in rest:
        rest = [arg for arg in rest if arg != "--serve"]
        return subprocess.call([*mkdocs, "serve", "--strict", *rest], cwd=ROOT, env=env)
    return subprocess.call([*mkdocs, "build", "--strict", "--site-dir", str(ROOT / "site"), *rest], cwd=ROOT, env=env)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("test", "demo", "docs"):
        print(__doc__)
        return 2
    set_up()
    command, rest = argv[0], argv[1:]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if command == "test":
        return subprocess.call([str(PYTHON), "-m", "pytest", *workers(rest), *rest], cwd=ROOT, env=env)
    if command == "docs":
        # mkdocs-material asks its users to consider a successor on every build; the build log should show the site
        return docs(rest, {**env, "NO_MKDOCS_2_WARNING": "1"})
    return subprocess.call([str(BIN / "hf-attn-zoo"), "demo", *rest], cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
