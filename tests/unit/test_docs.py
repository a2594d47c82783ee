"""The documentation builds with ``mkdocs --strict``, every ```python block in it runs, and
the output a page shows for a block is what the block prints.

Blocks of one page run in order in one namespace, in a fresh process (a page may call
``fs.init()``), from a scratch directory, as a module named ``fuelspmd_docs`` rather than
``__main__``: a program's ``if __name__ == "__main__":`` guard leaves it to the page's
later blocks to call its ``main`` (with the arguments they show). A fenced block that
follows a python block with at most a line of prose between them (``prints``) is that
block's output: each of its lines must be in what the block printed (spaces and line
breaks aside: the page may wrap a long line), so a figure the docs show from the model,
the planner or the simulator is recomputed on every run.
"""

from __future__ import annotations

import json
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
    preamble = ('import sys\nsys.modules["fuelspmd_docs"] = sys.modules["__main__"]\n'
                '__name__ = "fuelspmd_docs"\n')
    script.write_text(preamble + "\n\n".join(f"{body}\nprint({MARK!r}, flush=True)"
                                               for body in code))
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


def _bus_tables(text: str) -> dict[str, list[list[str]]]:
    """topology.md's bus-bandwidth tables, by the topology they are of."""
    out: dict[str, list[list[str]]] = {}
    for head, body in re.findall(r"^\*\*(8 H100 on NVLink|2 nodes x 8 H100)[^\n]*\n\n"
                                 r"\|[^\n]*\n\|[-| ]*\n((?:\|[^\n]*\n)+)", text, re.M):
        out[head] = [[c.strip() for c in row.strip().strip("|").split("|")]
                     for row in body.splitlines()]
    return out


def test_topology_bus_bandwidth_tables_are_the_models() -> None:
    """Every cell of the two tables of predicted nccl-tests bus bandwidth, recomputed."""
    from fuelspmd.cost import CostModel
    from fuelspmd.topology import Topology

    tables = _bus_tables((DOCS / "topology.md").read_text())
    assert set(tables) == {"8 H100 on NVLink", "2 nodes x 8 H100"}
    units = {"MiB": 2**20, "GiB": 2**30}
    for head, (topo, n) in {"8 H100 on NVLink": (Topology.load("dgx-h100"), 8),
                            "2 nodes x 8 H100": (Topology.load("two-node-h100-ib"), 16)}.items():
        model = CostModel(topo)
        per = topo.nodes[0].nics if n > 8 else 1  # across nodes: per NIC of a node
        for size, ring_ms, ring_bw, best, best_bw in tables[head]:
            count, unit = size.split()
            nbytes = int(count) * units[unit]
            bus = 2 * (n - 1) / n * nbytes / 1e9 / per  # nccl-tests' busbw x seconds
            ring = model.predict("all_reduce", nbytes, range(n), algorithm="ring")
            choice = model.best_algorithm("all_reduce", nbytes, range(n))
            assert (f"{ring * 1e3:.3f}", f"{bus / ring:.1f}") == (ring_ms, ring_bw), size
            assert (choice.algorithm, f"{bus / choice.seconds:.1f}") == (best, best_bw), size


PLAN_1T = ["plan", "--layers", "128", "--hidden", "25600", "--heads", "160", "--seq", "2048",
           "--vocab", "51200", "--batch", "3072", "--gpus", "3072", "--topology", "a100-selene"]
PLAN_175B = ["plan", "--layers", "96", "--hidden", "12288", "--heads", "96", "--seq", "2048",
             "--vocab", "51200", "--batch", "1536", "--gpus", "1024", "--topology",
             "a100-selene", "--top", "20", "--json"]


@pytest.mark.timeout(180)
def test_topology_prose_figures_are_the_planners() -> None:
    """The planner's figures topology.md quotes in its prose, recomputed: the 1T run's
    replayed pipeline against the formula, and the 175B run's predicted TFLOP/s."""
    text = " ".join((DOCS / "topology.md").read_text().split())
    sim = subprocess.run([sys.executable, "-m", "fuelspmd", *PLAN_1T, "--top", "1",
                          "--simulate"], capture_output=True, text=True, timeout=150)
    found = re.search(r"([0-9.]+) s simulated, ([0-9.]+) s by the formula \(([-+0-9.]+)%\)",
                      sim.stdout)
    assert found, sim.stdout + sim.stderr
    replay, formula, gap = (float(x) for x in found.groups())
    assert (f"the replay takes {replay:.1f} s against the formula's {formula:.1f} s "
            f"({gap:.1f}%") in text, sim.stdout
    plans = json.loads(subprocess.run([sys.executable, "-m", "fuelspmd", *PLAN_175B],
                                      capture_output=True, text=True, timeout=60).stdout)
    best = plans["plans"][0]
    tp8 = next(p for p in plans["plans"] if (p["tp"], p["pp"]) == (8, 16))
    assert (best["tp"], best["pp"]) == (4, 16)
    assert (f"the planner's best layout (tp 4, pp 16) predicts {best['tflops_per_gpu']:.0f} "
            f"(+{best['tflops_per_gpu'] / 140 - 1:.0%}) and its tp 8, pp 16 layout "
            f"{tp8['tflops_per_gpu']:.0f} (+{tp8['tflops_per_gpu'] / 140 - 1:.0%})") in text


def test_the_index_links_every_page_and_the_nav_lists_it() -> None:
    index = (DOCS / "index.md").read_text()
    nav = (DOCS.parent / "mkdocs.yml").read_text()
    for page in PAGES:
        if page.name != "index.md":
            assert f"]({page.name})" in index, f"docs/index.md does not link {page.name}"
        assert f": {page.name}\n" in nav, f"mkdocs.yml's nav does not list {page.name}"


# how the project's own development machines were described; a user's page has no use for it
DEVELOPMENT = re.compile(r"2-core machine|shared with other jobs|GPU suite|the project's own|"
                         r"the project's \d|device tool|these machines|we are lent", re.I)
# pages another change is rewriting, with the reason; each is checked all the same
BEING_REWRITTEN: dict[str, str] = {}


@pytest.mark.parametrize("page", [
    pytest.param(p, marks=pytest.mark.xfail(reason=BEING_REWRITTEN[p.name]))
    if p.name in BEING_REWRITTEN else p for p in [*PAGES, DOCS.parent / "README.md"]],
    ids=lambda p: p.name)
def test_pages_speak_to_users_not_of_the_development_machines(page: Path) -> None:
    found = [f"{page.name}:{n}: {line.strip()}"
             for n, line in enumerate(page.read_text().splitlines(), 1)
             if DEVELOPMENT.search(line)]
    assert not found, "\n".join(found)
