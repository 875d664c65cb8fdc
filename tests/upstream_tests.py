"""transformers' own model tests, assembled outside the repository for `tests/test_upstream_mixins.py`.

    python -m tests.upstream_tests [--snapshot PATH] [--ref REF]

The common mixins (`test_modeling_common.py`, `test_configuration_common.py`, `test_pipeline_mixin.py`, ...) ship in
transformers' source distribution; `pip download` gets the one of the installed version by package name. The model
test files (`tests/models/bart/test_modeling_bart.py`) and `tests/generation/test_utils.py` are not in
it: they come from a snapshot of transformers' repository, a checkout or
a bare git directory, named by `--snapshot` or `HF_ATTN_ZOO_TRANSFORMERS_SNAPSHOT` (`--ref` picks the commit of a git
directory, HEAD by default). A file in both comes from the source distribution, which matches the installed library.

The files land in `CACHE/<transformers version>/tests/` (`CACHE`: `HF_ATTN_ZOO_UPSTREAM_TESTS`, by default
~/.cache/hf_attn_zoo/transformers-tests) with `SOURCES.json` saying where each came from. Nothing is copied into the
repository. The test module imports them as the package `tests` (their own absolute imports name it so).
"""

import argparse
import ast
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import transformers

SNAPSHOT_VARIABLE = "HF_ATTN_ZOO_TRANSFORMERS_SNAPSHOT"
CACHE_VARIABLE = "HF_ATTN_ZOO_UPSTREAM_TESTS"
COMMAND = "python -m tests.upstream_tests --snapshot PATH_TO_A_TRANSFORMERS_REPOSITORY"

# what the test module imports; the files these import in turn (relative imports and `tests.` ones) come along
ENTRY_POINTS = (
    "tests/test_modeling_common.py",
    "tests/test_configuration_common.py",
    "tests/test_pipeline_mixin.py",
    "tests/generation/test_utils.py",
    "tests/models/bart/test_modeling_bart.py",
    # tests/utils/test_configuration_utils.py puts the repository's utils/ on sys.path and imports this from there
    "utils/test_module/__init__.py",
    "utils/test_module/custom_configuration.py",
    "tests/utils/tiny_model_summary.json",  # read by tests/test_pipeline_mixin.py at import
)
# the packages the upstream files import beyond the project's own dependencies (the `dev` extra installs them)
PACKAGES = {"parameterized": "parameterized", "timeout_decorator": "timeout-decorator"}


def cache_dir(version: str = transformers.__version__) -> Path:
    """Where the upstream test files of transformers `version` are assembled: its `tests/` package is inside."""
    root = os.environ.get(CACHE_VARIABLE) or Path.home() / ".cache" / "hf_attn_zoo" / "transformers-tests"
    return Path(root) / version


def missing(version: str = transformers.__version__) -> list[str]:
    """What the test module needs and does not find: upstream files absent from the cache (the entry points and
    what they import, as the last assembly found them), packages not installed."""
    root = cache_dir(version)
    manifest = root / "SOURCES.json"
    sources = json.loads(manifest.read_text()) if manifest.is_file() else {"files": {}, "missing": []}
    needed = {*ENTRY_POINTS, *sources["files"], *sources["missing"]}
    absent = sorted(path for path in needed if not (root / path).is_file())
    absent += [f"the package {name}" for module, name in PACKAGES.items() if not importlib.util.find_spec(module)]
    return absent


def imported_files(path: str, text: bytes) -> list[tuple[str, ...]]:
    """The files of transformers' `tests` package that the module at `path` imports: for each import, the candidate
    paths (`a/b.py`, `a/b/__init__.py`)."""
    package = path.split("/")[:-1]  # tests/models/bart/test_modeling_bart.py -> [tests, models, bart]
    found = []
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:  # from ...test_modeling_common import X: up level - 1 packages
            base = package[: len(package) - node.level + 1]
        elif node.module and node.module.split(".")[0] == "tests":
            base = []
        else:
            continue
        module = "/".join(base + (node.module.split(".") if node.module else []))
        found.append((f"{module}.py", f"{module}/__init__.py"))
    return found


def sdist_files(version: str) -> dict[str, bytes]:
    """The `tests/` files of transformers' source distribution `version` (pip downloads it by name)."""
    with tempfile.TemporaryDirectory() as download:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:"]
            + ["--dest", download, f"transformers=={version}"],
            check=True,
        )
        (archive,) = Path(download).glob("transformers-*.tar.gz")
        with tarfile.open(archive) as tar:
            # transformers-5.24.0/tests/x.py -> tests/x.py
            return {
                member.name.split("/", 1)[-1]: tar.extractfile(member).read()
                for member in tar.getmembers()
                if member.isfile() and member.name.split("/", 1)[-1].startswith("tests/")
            }


class Snapshot:
    """A transformers checkout, or a bare git directory read at `ref`."""

    def __init__(self, path: Path, ref: str = "HEAD") -> None:
        self.path = path
        self.git_dir = path if (path / "HEAD").is_file() and (path / "objects").is_dir() else None
        if self.git_dir is None:
            self.origin = f"checkout {path}"
        else:
            git = ["git", "--git-dir", str(self.git_dir)]
            self.commit = subprocess.run([*git, "rev-parse", ref], check=True, capture_output=True, text=True)
            self.commit = self.commit.stdout.strip()
            self.origin = f"snapshot {path} at {self.commit}"

    def read(self, path: str) -> bytes | None:
        if self.git_dir is None:
            return (self.path / path).read_bytes() if (self.path / path).is_file() else None
        shown = subprocess.run(
            ["git", "--git-dir", str(self.git_dir), "show", f"{self.commit}:{path}"], capture_output=True
        )
        return shown.stdout if shown.returncode == 0 else None


def choose(sdist: dict[str, bytes], snapshot: Snapshot | None, version: str) -> tuple[dict, list[str]]:
    """The files the entry points need, each from the source distribution where it has it, else from the snapshot;
    returns (path -> (origin, text), paths found nowhere). A source-distribution file importing what neither source
    has is taken from the snapshot instead, with the snapshot's imports (a snapshot older than the release lacks
    files the release's mixins import, and its own copies of those mixins do without them)."""
    from_snapshot: set[str] = set()
    while True:
        chosen, absent, queue = {}, [], list(ENTRY_POINTS)
        importers: dict[str, set[str]] = {}
        while queue:
            path = queue.pop()
            if path in chosen:
                continue
            text = snapshot.read(path) if snapshot is not None and path in from_snapshot else sdist.get(path)
            origin = snapshot.origin if path in from_snapshot else f"sdist transformers=={version}"
            if text is None and snapshot is not None:
                text, origin = snapshot.read(path), snapshot.origin
            if text is None:
                absent.append(path)
                continue
            chosen[path] = (origin, text)
            for candidates in imported_files(path, text) if path.endswith(".py") else ():
                existing = [c for c in candidates if c in sdist or (snapshot is not None and snapshot.read(c))]
                target = existing[0] if existing else candidates[0]
                importers.setdefault(target, set()).add(path)
                queue.append(target)
        switch = {
            importer
            for path in absent
            for importer in importers.get(path, ())
            if importer not in from_snapshot and snapshot is not None and snapshot.read(importer) is not None
        }
        if not switch:
            return chosen, sorted(set(absent))
        from_snapshot |= switch


def assemble(snapshot: Path | None = None, ref: str = "HEAD", version: str = transformers.__version__) -> Path:
    """Fill `cache_dir(version)` from the source distribution and, for the rest, from `snapshot`; returns the folder,
    with `SOURCES.json` listing where each file came from and what was found nowhere."""
    root = cache_dir(version)
    chosen, absent = choose(sdist_files(version), Snapshot(Path(snapshot), ref) if snapshot else None, version)
    if root.exists():
        shutil.rmtree(root)
    for path, (_, text) in chosen.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(text)
    for path in list(chosen):  # every folder is a package; the markers upstream are empty files
        for parent in Path(path).parents:
            marker = root / parent / "__init__.py"
            if parent.parts and parent.parts[0] == "tests" and not marker.exists():
                marker.write_text("")
                chosen[str(parent / "__init__.py")] = ("empty package marker", b"")
    # tests/test_pipeline_mixin.py imports the library from the repository's src/ at import: the installed one
    (root / "src").mkdir()
    (root / "src" / "transformers").symlink_to(Path(transformers.__file__).parent, target_is_directory=True)
    manifest = {"files": {path: origin for path, (origin, _) in sorted(chosen.items())}, "missing": absent}
    (root / "SOURCES.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m tests.upstream_tests")
    parser.add_argument(
        "--snapshot",
        type=Path,
        default=os.environ.get(SNAPSHOT_VARIABLE),
        help=f"a transformers checkout or git directory (default: ${SNAPSHOT_VARIABLE})",
    )
    parser.add_argument("--ref", default="HEAD", help="the commit of a git directory to read (default: HEAD)")
    args = parser.parse_args(argv)
    root = assemble(args.snapshot, args.ref)
    absent = missing()
    print(f"transformers {transformers.__version__}'s tests in {root}")
    if absent:
        print("still missing:\n  " + "\n  ".join(absent), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
