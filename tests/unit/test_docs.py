"""The documentation builds with ``mkdocs --strict`` and every ```python block in it runs.

Blocks of one page run in order in one namespace, in a fresh process (a page may call
``fs.init()``), from a scratch directory.
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
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def test_mkdocs_builds_strict(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                    "-f", str(DOCS.parent / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                   check=True, timeout=120)


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_python_blocks_run(page: Path, tmp_path: Path) -> None:
    blocks = BLOCK.findall(page.read_text())
    if not blocks:
        pytest.skip(f"{page.name} has no python blocks")
    script = tmp_path / "page.py"
    script.write_text("\n\n".join(blocks))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "MPI_", "OMPI_", "SLURM_"))}
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{page.name}:\n{result.stdout}\n{result.stderr}"
