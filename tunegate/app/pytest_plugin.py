"""pytest fixtures for a real embedded Triton (registered as the `tunegate` pytest plugin).

    def test_x(triton_factory):
        server = triton_factory(repo_path, models=["minilm"])
        ...  # stopped at the end of the test

`demo_repository` is a private copy of model_repository/ with the exported MiniLM linked in, so
tests that load, promote or write versions never touch the committed repository.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tunegate import models
from tunegate.models import copy_repository
from tunegate.triton import EmbeddedTriton, TritonOptions

__all__ = ["copy_repository"]


@pytest.fixture
def triton_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., EmbeddedTriton]]:
    servers: list[EmbeddedTriton] = []

    def start(repository: Path, models: Sequence[str] = (), **kwargs: Any) -> EmbeddedTriton:
        server = EmbeddedTriton(
            TritonOptions(repository=Path(repository), models=tuple(models), **kwargs),
            workdir=tmp_path_factory.mktemp("triton"),
        )
        server.start()
        servers.append(server)
        return server

    yield start
    for s in servers:
        s.stop()


@pytest.fixture(scope="session")
def minilm_onnx_path() -> Path:

    return models.minilm_onnx()


@pytest.fixture
def demo_repository(tmp_path: Path, minilm_onnx_path: Path) -> Path:
    return copy_repository(tmp_path / "repo", ["minilm"], minilm_onnx_path)


@pytest.fixture(scope="session")
def demo_triton(tmp_path_factory: pytest.TempPathFactory, minilm_onnx_path: Path) -> Iterator[EmbeddedTriton]:
    """One read-only Triton serving demo v1 for the whole test run (don't load or unload through it)."""
    repo = copy_repository(tmp_path_factory.mktemp("demo-repo"), ["minilm"], minilm_onnx_path)
    server = EmbeddedTriton(
        TritonOptions(repository=repo, models=("minilm",)), workdir=tmp_path_factory.mktemp("t")
    )
    server.start()
    yield server
    server.stop()
