"""The documentation builds with ``mkdocs --strict``, every ```python block in it runs, and
the output a page shows for a block is what the block prints.

Blocks of one page run in order in one namespace, in a fresh process (a page may call
``fs.init()``), from a scratch directory. A fenced block that follows a python block with at
most a line of prose between them (``prints``) is that block's output: each of its lines
must be in what the block printed (spaces and line breaks aside: the page may wrap a long
line), so a figure the docs show from the model, the planner or the simulator is
recomputed on every run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGES = sorted(DOCS.glob("*.md"))
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)
MARK = "\x00fuelspmd-docs-block"


def blocks(text: str) -> list[tuple[str, str, str]]:
    """Every fenced block as (language, body, the text between it and the previous one)."""
    out, last = [], 0
    for m in FENCE.finditer(text):
        out.append((m[1], m[2], text[last:m.start()]))
        last = m.end()
    return out


def shown_outputs(text: str) -> dict[int, str]:
    """python block number -> the output block the page shows right after it."""
    found, n = {}, -1
    parts = blocks(text)
    for k, (lang, body, before) in enumerate(parts):
        if lang == "python":
            n += 1
        elif (lang in ("", "text") and k and parts[k - 1][0] == "python"
              and len(before.strip().splitlines()) <= 1):
            found[n] = body
    return found


def shown_commands(text: str) -> list[tuple[list[str], str]]:
    """(argv, the output block shown after it) for each ``fuelspmd ...`` command block."""
    found = []
    parts = blocks(text)
    for k in range(1, len(parts)):
        (lang, command, _), (out_lang, shown, before) = parts[k - 1], parts[k]
        line = " ".join(command.replace("\\\n", " ").split())
        if (lang in ("", "bash") and line.startswith("fuelspmd ") and "\n" not in
                command.replace("\\\n", "").strip() and out_lang in ("", "text")
                and len(before.strip().splitlines()) <= 1):
            found.append((line.split()[1:], shown))
    return found


def _norm(line: str) -> str:
    return " ".join(line.split())


def test_mkdocs_builds_strict(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                    "-f", str(DOCS.parent / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                   check=True, timeout=120)


COMMANDS = [(page, argv, shown) for page in PAGES
            for argv, shown in shown_commands(page.read_text())]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("page", "argv", "shown"), COMMANDS,
                         ids=[f"{p.name}:{a[0]}" for p, a, _ in COMMANDS])
def test_shown_command_output_is_what_the_command_prints(page: Path, argv: list[str],
                                                         shown: str) -> None:
    done = subprocess.run([sys.executable, "-m", "fuelspmd", *argv], capture_output=True,
                          text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    got = _norm(done.stdout)
    missing = [line for line in shown.splitlines() if line.strip() and _norm(line) not in got]
    assert not missing, (f"{page.name}: `fuelspmd {' '.join(argv)}` no longer prints:\n"
                         + "\n".join(missing) + f"\n--- it printed:\n{done.stdout}")


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_python_blocks_run(page: Path, tmp_path: Path) -> None:
    text = page.read_text()
    code = [body for lang, body, _ in blocks(text) if lang == "python"]
    if not code:
        pytest.skip(f"{page.name} has no python blocks")
    script = tmp_path / "page.py"
    script.write_text("\n\n".join(f"{body}\nprint({MARK!r}, flush=True)" for body in code))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "MPI_", "OMPI_", "SLURM_"))}
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{page.name}:\n{result.stdout}\n{result.stderr}"
    printed = result.stdout.split(MARK + "\n")
    for n, shown in shown_outputs(text).items():
        got = _norm(printed[n])  # a long printed line may be wrapped on the page
        missing = [line for line in shown.splitlines() if line.strip()
                   and _norm(line) not in got]
        assert not missing, (f"{page.name}, python block {n + 1}: the page shows lines the "
                             f"block does not print:\n" + "\n".join(missing)
                             + f"\n--- it printed:\n{printed[n]}")
