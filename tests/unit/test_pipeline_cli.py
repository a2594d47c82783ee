"""``fuelspmd schedule`` and the renderers: the grid, the figures, and a PNG that decodes."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from fuelspmd.cli import main as fuelspmd_main
from fuelspmd.cli.schedule import main
from fuelspmd.pipeline_parallel import Action, schedule, simulate
from fuelspmd.pipeline_parallel.render import chrome_trace, grid, png


def decode_png(data: bytes) -> np.ndarray:
    """Read back an 8-bit RGB PNG with filter 0 rows (what render writes)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        tag, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(tag + body)
        if tag == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", body[:10])
            assert (depth, color) == (8, 2)
        elif tag == b"IDAT":
            idat += body
        pos += 12 + length
    raw = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(height, 1 + 3 * width)
    assert (raw[:, 0] == 0).all()
    return raw[:, 1:].reshape(height, width, 3)


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


def test_png_draws_every_action(tmp_path: Path) -> None:
    tl = simulate(schedule("1f1b", 3, 4), 1.0, 2.0)
    img = decode_png(png(tl, width=600))
    assert img.shape == (6 + 3 * (28 + 6) + 10 + 12, 600, 3)
    # the middle of rank 0's first action is blue-ish (forward), of its last green-ish
    px = (600 - 34 - 8) / tl.makespan
    y = 6 + 2
    first = next(a for a in tl.start if a.stage == 0 and a.kind == "F" and a.microbatch == 0)
    x = 34 + round((tl.start[first] + 0.1) * px)
    r, g, b = img[y, x].astype(int)
    assert b > r and b > 200
    last = next(a for a in tl.start if a.stage == 0 and a.kind == "B" and a.microbatch == 3)
    x = 34 + round((tl.start[last] + 0.1) * px)
    r, g, b = img[y, x].astype(int)
    assert g > r and g > b


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
    assert decode_png(out.read_bytes()).shape[1] == 1200


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
