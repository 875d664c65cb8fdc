"""The package as users get it: a wheel, not the repository, carries everything the commands need."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from hf_attn_zoo.models import SEQ2SEQ, VARIANTS

ROOT = Path(__file__).resolve().parents[1]

FROM_THE_WHEEL = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path

    import torch

    import hf_attn_zoo
    from hf_attn_zoo_cli import main
    from hf_attn_zoo.evaluation import TRANSLATION
    from hf_attn_zoo.models import SEQ2SEQ, VARIANTS

    site, recipe = Path(sys.argv[1]), sys.argv[2]
    assert Path(hf_attn_zoo.__file__).is_relative_to(site), hf_attn_zoo.__file__  # the wheel's copy, not the repo
    built = []
    for name, variant in VARIANTS.items():
        for size in ("tiny", "small", "base"):
            with torch.device("meta"):  # shapes only: every preset builds
                model = variant.causal_lm_class(variant.config(size, vocab_size=512))
            built.append(f"{name}/{size}:{sum(p.numel() for p in model.parameters())}")
    for name, entry in SEQ2SEQ.items():
        for size in entry.presets:
            with torch.device("meta"):
                model = entry.generation_class(entry.config(size, vocab_size=512))
            built.append(f"{name}/{size}:{sum(p.numel() for p in model.parameters())}")
    # the translation metric's module is package data, loaded by path
    assert Path(TRANSLATION).is_relative_to(site) and (Path(TRANSLATION) / "zoo_translation.py").is_file()
    assert main(["train", recipe]) == 0
    print(json.dumps({"built": built}))
    """
)


def test_a_wheel_builds_every_preset_and_trains_from_a_preset_recipe(tmp_path):
    source = tmp_path / "source"  # the wheel is built from a copy, so nothing is written into the repository
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "hf_attn_zoo_cli.py"):  # the command line's front is a module beside
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "hf_attn_zoo", source / "hf_attn_zoo", ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", tmp_path / "wheels", source],
        check=True,
        timeout=600,
    )
    [wheel] = (tmp_path / "wheels").glob("*.whl")
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", site, wheel], check=True, timeout=600)

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n" * 200)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        json.dumps(  # JSON is YAML
            {
                "model": {"variant": "gqa", "size": "tiny"},  # a preset: found inside the installed package
                "data": {
                    "train_files": [str(corpus)],
                    "validation_files": [str(corpus)],
                    "vocab_size": 300,
                    "block_size": 32,
                },
                "training": {
                    "output_dir": str(tmp_path / "run"),
                    "max_steps": 2,
                    "per_device_train_batch_size": 2,
                    "report_to": "none",
                    "save_strategy": "no",
                },
            }
        )
    )
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", FROM_THE_WHEEL, str(site), str(recipe)],
        cwd=tmp_path,  # not the repository: its configs/ and hf_attn_zoo/ are out of reach
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    built = json.loads(result.stdout.strip().splitlines()[-1])["built"]
    # every preset of every variant and of every sequence-to-sequence model
    assert len(built) == 3 * len(VARIANTS) + sum(len(entry.presets) for entry in SEQ2SEQ.values())
    assert json.loads((tmp_path / "run" / "training_summary.json").read_text())["steps"] == 2
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()


def test_transformers_imports_quietly_in_this_environment():
    """transformers imports torchao at import time when it is installed, and every torchao release on PyPI then
    writes warnings on a CPU-only torch (CUDA kernel libraries it cannot load, deprecated enum registrations): the
    set-up keeps it out of the environment (dev.py), so that importing a model or evaluate prints nothing."""
    result = subprocess.run(
        [sys.executable, "-c", "import transformers.models.llama.modeling_llama; import evaluate"],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for warning in ("Failed to load", "torchao", "register_constant"):
        assert warning not in result.stderr, result.stderr[-3000:]
    assert result.stderr == "", result.stderr[-3000:]  # nothing else either
