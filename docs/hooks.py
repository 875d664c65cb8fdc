"""mkdocs hook: the experiments' plots join the built site under their own paths (experiments/<study>/...png).

mkdocs copies only files under docs_dir, and the plots belong to the experiments that write them; copying them into
docs/ would keep two versions in git. Pages link them as `../experiments/quality/results/frontier.png` (from a page
one folder deep), which resolves in the built site, and mkdocs' link validation sees them as site files.
"""

from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]


def on_files(files: Files, config: MkDocsConfig) -> Files:
    for plot in sorted((ROOT / "experiments").rglob("*.png")):
        # src_dir is the repository root, so the file's site path is its path in the repository
        files.append(File(plot.relative_to(ROOT).as_posix(), str(ROOT), config.site_dir, config.use_directory_urls))
    return files
