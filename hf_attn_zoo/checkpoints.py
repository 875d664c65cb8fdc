"""Writing model folders: the package's one save path, and folders that an interrupted write never leaves looking
finished."""

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path


def write_atomically(path: Path, text: str) -> None:
    """Write a small file beside its destination and rename it into place."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def publish_folder(folder: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call `write(staging)` on a folder beside `folder`, then rename it into place. An existing `folder` is kept
    under a `.before-<time>` name, never deleted."""
    folder = Path(folder)
    staging = folder.with_name(folder.name + ".partial")
    if staging.exists():
        shutil.rmtree(staging)  # left by an interrupted write: never published, so nothing of value is lost
    write(staging)
    if folder.exists():
        folder.rename(folder.with_name(f"{folder.name}.before-{int(time.time())}"))
    staging.rename(folder)
    return folder


def save_checkpoint(
    folder: str | os.PathLike,
    model,
    tokenizer=None,
    training: dict | None = None,
    summary: dict | None = None,
) -> Path:
    """Save `model` where every command of the package saves one (training's final model, `convert`, the demo):
    weights, config with the `auto_map` of every Auto class and the model code (`save_pretrained`), the tokenizer,
    the model card with `training` details, and `summary` as training_summary.json. Written beside `folder` and
    renamed into place (`publish_folder`)."""

    def write(staging: Path) -> None:
        model.save_pretrained(staging, training=training)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        if summary is not None:
            (staging / "training_summary.json").write_text(json.dumps(summary, indent=2))

    return publish_folder(folder, write)
