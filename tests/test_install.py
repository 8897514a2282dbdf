"""A non-editable install (`pip install .`) runs without the checkout: `tunegate demo --quick` and `tunegate routes`.

The wheel is built from this checkout and installed into a fresh virtual environment. Its third-party
dependencies are this environment's (a `.pth` line points at its site-packages: .pth files there are not
run, so this checkout's editable install is not seen), which keeps the test to what the wheel itself
carries: the packages, their data (templates, the demo's specs and model repository) and the entry point.
Commands run from an empty directory with an empty tunegate cache, except for the exported MiniLM, which is
linked in (exporting it needs torch, which `tunegate model prepare` covers).
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bin directory of a fresh venv holding tunegate installed from a wheel of this checkout."""
    work = tmp_path_factory.mktemp("install")
    # Built from a copy: building in the checkout would leave build/ and an egg-info there, whose stale entry
    # points shadow the editable install's.
    src = work / "src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", ".tunegate", "__pycache__", "*.onnx", ".*_cache"))  # fmt: skip
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(work / "wheel"), str(src)], check=True, timeout=300)  # fmt: skip
    [wheel] = (work / "wheel").glob("tunegate-*.whl")
    env_dir = work / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    Path(purelib, "deps-from-the-test-environment.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--quiet", "--no-deps",
                    str(wheel)], check=True, timeout=300)  # fmt: skip
    return env_dir / "bin"


def _run(
    bin_dir: Path, args: list[str], cwd: Path, cache: Path, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(TUNEGATE_CACHE=str(cache), PATH=f"{bin_dir}:{env.get('PATH', '')}")
    return subprocess.run([str(bin_dir / "tunegate"), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)  # fmt: skip


def test_the_installed_package_comes_from_the_wheel_not_the_checkout(installed: Path, tmp_path: Path) -> None:
    where = subprocess.run([str(installed / "python"), "-c", "import tunegate, sidecar, tuner; print(tunegate.__file__)"],
                           cwd=tmp_path, capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert str(ROOT) not in where and "site-packages" in where, where


@pytest.mark.slow
@pytest.mark.triton
def test_demo_quick_and_routes_run_from_an_installed_wheel(installed: Path, tmp_path: Path,
                                                           minilm_onnx_path: Path) -> None:  # fmt: skip
    cache = tmp_path / "cache"
    (cache / "minilm").mkdir(parents=True)
    (cache / "minilm" / "model.onnx").symlink_to(minilm_onnx_path)
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()

    quick = _run(installed, ["demo", "--quick", "--json"], cwd, cache)
    assert quick.returncode == 0, quick.stderr[-3000:]
    summary = json.loads(quick.stdout)
    assert summary["embedding_shape"] == [1, 384] and abs(summary["embedding_norm"] - 1.0) < 1e-3, summary
    project = cache / "project"
    assert (
        project / "model_repository" / "minilm" / "1" / "model.onnx"
    ).exists()  # the baseline, outside the wheel
    assert not list(cwd.iterdir())  # nothing written where the user stood

    routes = _run(
        installed, ["routes", str(project / "specs" / "minilm.toml"), "--json"], cwd, cache, timeout=120
    )
    assert routes.returncode == 0, routes.stderr[-3000:]
    assert json.loads(routes.stdout)["routes"], routes.stdout[:500]
