"""Writing model folders so that an interrupted write never looks like a finished one."""

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
