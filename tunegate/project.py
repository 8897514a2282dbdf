"""Where the demo's specs and model repository live: the checkout, or a copy made from the installed package.

From a checkout, `specs/` and `model_repository/` are the ones beside `tunegate/` (the tuner writes new
versions into that repository, which git ignores). An installed wheel carries the same files as package
data (`tunegate/assets/`); the first command that needs them copies them to `<tunegate cache>/project/`
(staged, then renamed: a killed copy leaves no half project), where the specs' relative paths
(`repository = "../model_repository"`) hold as in a checkout.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from tunegate.models import cache_dir

CHECKOUT = Path(__file__).resolve().parent.parent
PACKAGED = Path(__file__).resolve().parent / "assets"
PARTS = ("specs", "model_repository")


def _is_project(root: Path) -> bool:
    return (root / "specs" / "minilm.toml").is_file() and (
        root / "model_repository" / "minilm" / "config.pbtxt"
    ).is_file()


def project_root() -> Path:
    """The checkout when running from one; else the cache's copy of the packaged project (made on first use)."""
    if not _installed() and _is_project(CHECKOUT):
        return CHECKOUT
    root = cache_dir() / "project"
    for part in PARTS:
        if not (root / part).exists():
            root.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{part}-", dir=root))
            try:
                shutil.copytree(PACKAGED / part, staging / part, symlinks=False)
                (staging / part).rename(root / part)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return root


def _installed() -> bool:
    """Whether this tunegate was installed into site-packages (a wheel), not run from a checkout."""
    return CHECKOUT.name in ("site-packages", "dist-packages")


def specs_dir() -> Path:
    return project_root() / "specs"


def repository() -> Path:
    return project_root() / "model_repository"
