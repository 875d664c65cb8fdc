"""The package's shape: no import cycle anywhere in `hf_attn_zoo` (imports inside functions included, so that a
lazy import cannot hide one), one function that builds a `Trainer` for training runs, and no package registry's
address in any tracked file (install by package name with the registry's own client)."""

import ast
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hf_attn_zoo"


def module_files() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, whether it is a package's __init__)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports, at any depth of its code. `from . import x` and `from .a import x`
    count as importing the submodule `x` where there is one, else the module `a` (whose __init__ runs)."""
    modules = module_files()
    graph = {}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rsplit(".", 1)[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                for alias in node.names:
                    submodule = f"{module}.{alias.name}"
                    targets.add(submodule if submodule in modules else module)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[name] = {target for target in targets if target in modules and target != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "hf_attn_zoo.train.run" in graph and "hf_attn_zoo.train.tasks" in graph["hf_attn_zoo.train.run"]
    assert cycles(graph) == []


TRAINER_CLASSES = {"Trainer", "Seq2SeqTrainer", "ZooTrainer", "ZooSeq2SeqTrainer", "trainer_class"}


def test_one_function_builds_the_trainer_of_a_training_run():
    """Every training run, whatever its task, goes through `run_training`: the package constructs a Trainer
    (`trainer_class(...)`, `ZooTrainer(...)`, `Seq2SeqTrainer(...)`, `Trainer(...)`) in exactly one function."""
    builders = []
    for path, _ in module_files().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef):
                continue
            for call in ast.walk(node):
                if isinstance(call, ast.Call):
                    callee = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
                    if callee in TRAINER_CLASSES:
                        builders.append(f"{path.relative_to(ROOT)}:{node.name}")
    assert builders == ["hf_attn_zoo/train/run.py:run_training"]


# the registries the project installs from, by host; spelled in parts so that this file names none of them
REGISTRY_HOSTS = [
    ".".join(parts)
    for parts in (
        ("registry", "npmjs", "org"),
        ("pypi", "org"),
        ("files", "pythonhosted", "org"),
        ("deb", "debian", "org"),
    )
]


def test_no_tracked_file_names_a_package_registry_address():
    try:
        files = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=120
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no tracked files to read")
    hits = []
    for name in filter(None, files.decode().split("\0")):
        path = ROOT / name
        if not path.is_file():
            continue
        text = path.read_bytes()
        if b"\0" in text[:4096]:
            continue  # binary
        lowered = text.decode("utf-8", "replace").lower()
        hits += [f"{name}: {host}" for host in REGISTRY_HOSTS if host in lowered]
    assert hits == [], "install by package name with the registry's client instead of its address"
