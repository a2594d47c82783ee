"""``fuelspmd schedule`` and the renderers: the grid, the figures, and the picture
(matplotlib's Figure read back: its bars, title and legend)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from matplotlib.collections import PolyCollection

from fuelspmd.cli import main as fuelspmd_main
from fuelspmd.cli.schedule import main
from fuelspmd.pipeline_parallel import Action, schedule, simulate
from fuelspmd.pipeline_parallel.render import chrome_trace, figure, figure_height, grid


def png_size(data: bytes) -> tuple[int, int]:
    """The width and height a PNG's header gives, after its signature."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_grid_one_cell_per_action() -> None:
    tl = simulate(schedule("1f1b", 4, 8), 1.0, 1.0)
    lines = grid(tl).splitlines()
    assert len(lines) == 5
    rows = [line.split()[2:] for line in lines[1:]]
    assert all(len(row) == 22 for row in rows)  # (m + p - 1) * 2 steps
    assert rows[0][:8] == ["F0", "F1", "F2", "F3", ".", ".", ".", "B0"]
    assert sum(cell != "." for row in rows for cell in row) == 4 * 16
    idle = sum(cell == "." for row in rows for cell in row)
    assert idle / (4 * 22) == pytest.approx(tl.bubble)


def test_grid_marks_longer_actions_and_colours() -> None:
    tl = simulate(schedule("gpipe", 2, 2), 1.0, 2.0)
    rows = [line.split()[2:] for line in grid(tl).splitlines()[1:]]
    assert rows[1] == [".", "F0", "F1", "B0", "-", "B1", "-", ".", "."]
    assert "\x1b[34m" in grid(tl, color=True)


def _bars(fig: object) -> list[PolyCollection]:
    """The figure's action bars: every PolyCollection but the first (the idle rows)."""
    return [c for c in fig.axes[0].collections if isinstance(c, PolyCollection)][1:]  # type: ignore[attr-defined]


def test_figure_draws_every_action_with_title_and_legend() -> None:
    tl = simulate(schedule("1f1b", 3, 4), 1.0, 2.0)
    fig = figure(tl, width=600, time_unit="time, in forwards")
    assert (fig.get_figwidth() * fig.dpi, fig.get_figheight() * fig.dpi) == (
        600, figure_height(3))
    bars = _bars(fig)
    assert sum(len(c.get_paths()) for c in bars) == len(tl.start) == 3 * 2 * 4
    # one collection per kind: forwards blue (F0 the darkest), backwards green
    forwards, backwards = (c.get_facecolors() for c in bars)
    assert forwards[0][2] > 0.9 and forwards[0][2] > forwards[0][0]
    assert backwards[0][1] > backwards[0][0] and backwards[0][1] > backwards[0][2]
    ax = fig.axes[0]
    assert ax.get_title() == "1f1b: 3 stages, 4 micro-batches\nsimulated bubble 33.33%"
    assert f"{tl.bubble:.2%}" == "33.33%"
    assert ax.get_xlabel() == "time, in forwards"
    assert ax.get_xlim() == (0, tl.makespan)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1", "rank 2"]
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["F forward", "B backward", "idle"]
    assert {t.get_text() for t in ax.texts} == {f"{k}{i}" for k in "FB" for i in range(4)}


@pytest.mark.parametrize(("kind", "chunks", "legend", "title"), [
    ("zb-h1", 1, ["F forward", "I input gradient", "W weight gradient", "idle"],
     "zb-h1: 4 stages, 8 micro-batches\nsimulated bubble 11.11%"),
    ("interleaved", 2, ["F forward", "B backward", "chunk 1", "idle"],
     "interleaved: 4 stages, 8 micro-batches, 2 chunks per rank\nsimulated bubble 15.79%"),
])
def test_figure_names_every_kind_and_chunk(kind: str, chunks: int, legend: list[str],
                                           title: str) -> None:
    t = 1.0 / chunks
    fig = figure(simulate(schedule(kind, 4, 8, chunks), t, t, t_w=t))
    assert [x.get_text() for x in fig.legends[0].get_texts()] == legend
    assert fig.axes[0].get_title() == title
    hatches = sorted(str(c.get_hatch()) for c in _bars(fig))
    assert hatches == (["//", "//", "None", "None"] if chunks == 2 else ["None"] * 3)


def test_cli_writes_the_format_of_the_suffix(tmp_path: Path) -> None:
    for suffix, magic in ((".svg", b"<?xml"), (".pdf", b"%PDF-"), (".PNG", b"\x89PNG")):
        out = tmp_path / f"s{suffix}"
        assert main(["--stages", "2", "--microbatches", "2", "--png", str(out)]) == 0
        assert out.read_bytes().startswith(magic)


def test_cli_prints_grid_and_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s.png"
    assert main(["--kind", "1f1b", "--stages", "4", "--microbatches", "8", "--png", str(out)]) == 0
    text = capsys.readouterr().out
    row0 = next(line for line in text.splitlines() if line.startswith("rank 0 "))
    assert row0.split()[2:10] == ["F0", "F1", "F2", "F3", ".", ".", ".", "B0"]
    assert "bubble         27.27%" in text
    assert "(formula (p-1)/(m+p-1) = 27.27%)" in text
    assert "rank 0: 4 rank 1: 3 rank 2: 2 rank 3: 1" in text
    assert "\x1b[" not in text  # not a tty: no colour
    assert png_size(out.read_bytes()) == (1200, figure_height(4))


def test_cli_interleaved_and_zero_bubble(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--kind", "interleaved", "--stages", "2", "--microbatches", "4"]) == 0
    text = capsys.readouterr().out
    assert "2 chunk(s)" in text and "(p-1)/(c*m+p-1) = 11.11%" in text
    assert "bubble         11.11%" in text
    assert main(["--kind", "zb-h1", "--stages", "4", "--microbatches", "8"]) == 0
    text = capsys.readouterr().out
    assert "bubble         11.11%   (formula (p-1)(tF+tI-tW)/step = 11.11%)" in text


def test_cli_bad_sizes_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--kind", "interleaved", "--stages", "4", "--microbatches", "6"]) == 2
    assert "divisible by stages" in capsys.readouterr().err


def test_fuelspmd_command_dispatches_here(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["schedule", "--kind", "gpipe", "--stages", "3", "--microbatches", "2"]
    assert fuelspmd_main([*args, "--color", "always"]) == 0
    text = capsys.readouterr().out
    assert "bubble         50.00%   (formula (p-1)/(m+p-1) = 50.00%)" in text
    assert "\x1b[34m" in text  # forced colour


def test_chrome_trace_has_one_event_per_action() -> None:
    tl = simulate(schedule("zb-h1", 3, 4), 1.0, 1.0, t_w=0.5)
    trace = json.loads(json.dumps(chrome_trace(tl, scale=1000.0)))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 3 * 3 * 4
    by_name = {e["name"]: e for e in spans}
    w = by_name["1W2"]
    assert w["tid"] == 1 and w["cat"] == "W" and w["dur"] == pytest.approx(500.0)
    assert w["ts"] == pytest.approx(tl.start[Action(1, "W", 2)] * 1000.0)
    assert {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"} == {
        "rank 0",
        "rank 1",
        "rank 2",
    }
