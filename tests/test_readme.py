"""Every `tunegate` command the README shows, run on a fresh clone: it works, or it ends with a clear error.

The clone has what a fresh checkout has (no exported model, an empty tunegate cache, no running servers).
A command passes when it exits 0; or exits non-zero with a message and no traceback; or is still working
after RUN_S seconds (a tune, a demo, a server), when it is stopped with its process group. Placeholders are
filled in as a user would: `a|b` takes `a`, `[optional]` parts are left out, `SPEC` is a spec of the clone.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN_S = 6.0


def readme_commands(text: str) -> list[str]:
    """The `tunegate ...` lines of the README's bash blocks, continuations joined, comments and placeholders dealt with."""
    out: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL):
        for line in re.split(r"\n|;|&&", block.replace("\\\n", " ")):
            line = line.strip()
            if not line.startswith("tunegate "):
                continue
            line = re.sub(r"\s*\[[^\]]*\]", "", line)  # optional parts
            line = re.sub(r"\b(\w+)(\|\w+)+\b", r"\1", line)  # alternatives: the first
            line = re.sub(r"\bSPEC\b", "specs/minilm.toml", line)
            out.append(shlex.join(shlex.split(line, comments=True)))
    return out


def test_the_readme_parser_finds_the_commands() -> None:
    text = ("```bash\ntunegate a b  # c\ntunegate canary promote|pin m [--to 1]\n\\\nls\ntunegate x \\\n  --y z\n"
            "tunegate s m; tunegate d m\n```\n")  # fmt: skip
    assert readme_commands(text) == ["tunegate a b", "tunegate canary promote m", "tunegate x --y z", "tunegate s m",
                                     "tunegate d m"]  # fmt: skip


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("fresh") / "tunegate"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(dest)], check=True, timeout=120)
    shutil.copyfile(ROOT / "README.md", dest / "README.md")  # the README as it stands, committed or not
    (dest / "token").write_text("readme-test-token-0123456789")  # the README's `printf ... > token`
    return dest


def run_command(cmd: str, cwd: Path, env: dict[str, str]) -> tuple[int | None, str]:
    """(exit code, or None when still running after RUN_S; output)."""
    words = shlex.split(cmd)
    argv = [
        sys.executable,
        "-m",
        "tunegate.app.cli",
        *words[1:],
    ]  # the clone's package, not the installed one
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=RUN_S)
        return proc.returncode, out.decode(errors="replace")
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        return None, out.decode(errors="replace")


@pytest.mark.slow
def test_every_readme_command_works_or_says_what_to_do_on_a_fresh_clone(clone: Path, tmp_path: Path,
                                                                        minilm_onnx_path: Path) -> None:  # fmt: skip
    commands = readme_commands((clone / "README.md").read_text())
    assert len(commands) >= 5, commands
    # An empty cache but for the exported MiniLM (exporting it takes torch a minute; the demo tests cover it).
    (tmp_path / "cache" / "minilm").mkdir(parents=True)
    (tmp_path / "cache" / "minilm" / "model.onnx").symlink_to(minilm_onnx_path)
    env = {**os.environ, "TUNEGATE_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(clone),
           "TUNEGATE_ADMIN_TOKEN_FILE": str(clone / "token")}  # fmt: skip
    env.pop("TUNEGATE_SIDECAR_URL", None)
    bad = []
    for cmd in commands:
        code, out = run_command(cmd, clone, env)
        print(f"$ {cmd}\n  -> {'still running' if code is None else f'exit {code}'}: {out.strip()[-300:]}")
        usage_error = (
            code == 2 and "usage: tunegate" in out
        )  # the README shows a command the CLI does not take
        if "Traceback" in out or usage_error or (code not in (None, 0) and not out.strip()):
            bad.append(f"$ {cmd}\n(exit {code})\n{out[-1500:]}")
    assert not bad, "\n\n".join(bad)
