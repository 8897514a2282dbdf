"""The CLI: help lists the subcommands, errors exit non-zero with a message."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tunegate.app.cli import build_parser, main


def test_help_lists_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for cmd in ("model", "triton", "demo"):
        assert cmd in text


def test_every_subcommand_has_help() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name in sub.choices:  # type: ignore[union-attr]
        proc = subprocess.run(
            [sys.executable, "-m", "tunegate.app.cli", name, "--help"],
            capture_output=True,
            text=True,
            check=False,
        )
        assert proc.returncode == 0, (name, proc.stderr)


def test_a_route_expression_after_routes_is_its_value(capsys: pytest.CaptureFixture[str]) -> None:
    """`--routes -quant=int8-channel` (a value that starts with a dash, as every route expression does)."""
    spec = str(Path(__file__).resolve().parent.parent / "specs" / "tiny.toml")
    assert main(["tune", spec, "--routes", "-opt=disable", "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    [route] = [r["route"] if isinstance(r, dict) else r for r in plan["routes"]]
    assert route.startswith("-opt=disable "), route


def test_no_command_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2


def test_triton_on_missing_repository_exits_1(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tunegate.app.cli",
            "triton",
            "--repository",
            str(tmp_path / "x"),
            "--model",
            "m",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1 and "does not exist" in proc.stderr


@pytest.mark.slow
def test_demo_json_prints_an_embedding(tmp_path: Path, minilm_onnx_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tunegate.app.cli",
            "demo",
            "--quick",
            "--json",
            "--cache",
            str(minilm_onnx_path.parent.parent),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["embedding_shape"] == [1, 384] and abs(out["embedding_norm"] - 1.0) < 1e-4
