"""Draw a :class:`Timeline`: a text grid for the terminal and a PNG picture.

Imports only the standard library, numpy and this package. Nothing here writes files:
:func:`grid` returns a string and :func:`png` returns the bytes of a PNG, which the
``fuelspmd schedule`` command prints or saves. No plotting library is needed: the PNG is
encoded here (RGB, one IDAT chunk, zlib) with a 3x5 bitmap font for labels.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

from fuelspmd.pipeline_parallel.simulate import Timeline

__all__ = ["chrome_trace", "encode_png", "grid", "png", "png_height"]

_ANSI = {"F": "34", "B": "32", "I": "36", "W": "33"}
_RGB = {"F": (66, 133, 244), "B": (52, 168, 83), "I": (0, 150, 170), "W": (230, 160, 0)}

# 3x5 glyphs, rows top to bottom, "#" = ink.
_FONT = {
    "0": ("###", "#.#", "#.#", "#.#", "###"),
    "1": (".#.", "##.", ".#.", ".#.", "###"),
    "2": ("###", "..#", "###", "#..", "###"),
    "3": ("###", "..#", "###", "..#", "###"),
    "4": ("#.#", "#.#", "###", "..#", "..#"),
    "5": ("###", "#..", "###", "..#", "###"),
    "6": ("###", "#..", "###", "#.#", "###"),
    "7": ("###", "..#", ".#.", ".#.", ".#."),
    "8": ("###", "#.#", "###", "#.#", "###"),
    "9": ("###", "#.#", "###", "..#", "###"),
    "F": ("###", "#..", "##.", "#..", "#.."),
    "B": ("##.", "#.#", "##.", "#.#", "##."),
    "I": ("###", ".#.", ".#.", ".#.", "###"),
    "W": ("#.#", "#.#", "#.#", "###", "#.#"),
    "r": ("...", "##.", "#..", "#..", "#.."),
    ".": ("...", "...", "...", "...", ".#."),
    " ": ("...", "...", "...", "...", "..."),
}


def chrome_trace(timeline: Timeline, *, scale: float = 1e6) -> dict[str, object]:
    """The timeline as a Chrome trace (``chrome://tracing``, Perfetto): one complete
    event (``"ph": "X"``) per action on thread ``rank``; ``scale`` turns the timeline's
    unit into microseconds (1e6 for seconds). ``json.dump`` the result to a file."""
    events: list[dict[str, object]] = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}}
        for r in range(timeline.schedule.stages)
    ]
    for a, t0 in sorted(timeline.start.items(), key=lambda item: (item[1], item[0].stage)):
        events.append(
            {
                "name": str(a),
                "cat": a.kind,
                "ph": "X",
                "pid": 0,
                "tid": a.stage,
                "ts": t0 * scale,
                "dur": (timeline.end[a] - t0) * scale,
                "args": {"microbatch": a.microbatch, "chunk": a.chunk},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _unit(timeline: Timeline) -> float:
    """The grid's time step: the shortest positive action duration."""
    durations = [timeline.end[a] - timeline.start[a] for a in timeline.start]
    positive = [d for d in durations if d > 0]
    return min(positive) if positive else 1.0


def grid(timeline: Timeline, *, color: bool = False) -> str:
    """The time-step x rank grid: one row per rank, one column per time step of the
    shortest action; a cell holds the action running then (``F3``, ``B3``; ``F3.1`` for
    chunk 1), ``-`` where a longer action continues, ``.`` where the rank idles."""
    s = timeline.schedule
    unit = _unit(timeline)
    columns = max(1, round(timeline.makespan / unit))
    cells = [["."] * columns for _ in range(s.stages)]
    kinds = [[""] * columns for _ in range(s.stages)]
    for a, t0 in timeline.start.items():
        c0 = round(t0 / unit)
        c1 = max(c0 + 1, round(timeline.end[a] / unit))
        for c in range(c0, min(c1, columns)):
            cells[a.stage][c] = a.label if c == c0 else "-"
            kinds[a.stage][c] = a.kind
    width = max(len(x) for row in cells for x in row)
    head = len(f"rank {s.stages - 1}")
    lines = [" " * head + " " + " ".join(f"{c:>{width}}" for c in range(columns))]
    for r, row in enumerate(cells):
        out = []
        for text, kind in zip(row, kinds[r]):
            cell = f"{text:>{width}}"
            if color and kind:
                cell = f"\x1b[{_ANSI[kind]}m{cell}\x1b[0m"
            out.append(cell)
        lines.append(f"{f'rank {r}':<{head}} " + " ".join(out))
    return "\n".join(lines)


def _text(
    img: np.ndarray, x: int, y: int, text: str, scale: int, rgb: tuple[int, int, int]
) -> None:
    """Stamp ``text`` in the 3x5 font, ``scale`` pixels per dot, top-left at (x, y)."""
    for k, ch in enumerate(text):
        glyph = _FONT.get(ch, _FONT[" "])
        for gy, row in enumerate(glyph):
            for gx, bit in enumerate(row):
                if bit == "#":
                    x0, y0 = x + (4 * k + gx) * scale, y + gy * scale
                    img[y0 : y0 + scale, x0 : x0 + scale] = rgb


PNG_MARGIN = 42  # pixels of a png row left of the time axis (the rank label) and right of it
READABLE_PX = 4  # an action narrower than this merges with its neighbours in the picture


def narrowest_action_px(timeline: Timeline, width: int = 1200) -> float:
    """The width in pixels of the shortest action in a :func:`png` of ``width`` pixels."""
    span = timeline.makespan or 1.0
    shortest = min((timeline.end[a] - t0 for a, t0 in timeline.start.items()), default=span)
    return shortest * (width - PNG_MARGIN) / span


def width_for(timeline: Timeline, px: float = READABLE_PX) -> int:
    """The :func:`png` width at which the shortest action is ``px`` pixels wide."""
    one = narrowest_action_px(timeline, PNG_MARGIN + 1)  # pixels per pixel of axis
    return PNG_MARGIN + int(px / one + 0.999) if one > 0 else PNG_MARGIN + 1


def png_height(stages: int, row: int = 28) -> int:
    """The height in pixels of a :func:`png` of ``stages`` ranks: their rows and the legend."""
    gap, scale = 6, 2
    return gap + stages * (row + gap) + 5 * scale + 2 * gap


def png(timeline: Timeline, *, width: int = 1200, row: int = 28) -> bytes:
    """A timeline picture: one row per rank, a rectangle per action coloured by kind
    (F blue, B green, I teal, W amber), lighter for later micro-batches, labelled with the
    kind and micro-batch (``F3``, or just ``3``) where it fits; later chunks carry a dark
    band along the bottom. A legend row of the kinds present sits underneath."""
    s = timeline.schedule
    margin, gap, scale = PNG_MARGIN - 8, 6, 2
    span = timeline.makespan or 1.0
    px = (width - margin - 8) / span
    legend_y = gap + s.stages * (row + gap)
    height = png_height(s.stages, row)
    img = np.full((height, width, 3), 255, dtype=np.uint8)
    kinds = [k for k in _RGB if any(a.kind == k for a in timeline.start)]
    for n, kind in enumerate(kinds):  # legend: a swatch per kind present, then its letter
        x = margin + n * 40
        img[legend_y : legend_y + 5 * scale, x : x + 14] = _RGB[kind]
        _text(img, x + 18, legend_y, kind, scale, (40, 40, 40))
    for r in range(s.stages):
        y = gap + r * (row + gap)
        img[y : y + row, margin : width - 8] = (238, 238, 238)
        _text(img, 4, y + (row - 5 * scale) // 2, f"r{r}", scale, (40, 40, 40))
    for a, t0 in timeline.start.items():
        y = gap + a.stage * (row + gap)
        x0 = margin + round(t0 * px)
        x1 = max(x0 + 1, margin + round(timeline.end[a] * px))
        shade = 0.55 * a.microbatch / max(s.microbatches - 1, 1)
        base = np.array(_RGB[a.kind], dtype=np.float64)
        rgb = tuple(int(v) for v in base + (255 - base) * shade)
        img[y : y + row, x0:x1] = rgb
        if x1 - x0 >= READABLE_PX:  # a thin seam between neighbours, where it leaves colour
            img[y : y + row, x0] = (255, 255, 255)
        if a.chunk:  # later chunks get a dark band at the bottom
            img[y + row - 3 * a.chunk : y + row, x0 + 1 : x1] = (60, 60, 60)
        for label in (f"{a.kind}{a.microbatch}", str(a.microbatch)):
            if (x1 - x0) >= 4 * scale * len(label) + 2:
                tx = x0 + (x1 - x0 - (4 * len(label) - 1) * scale) // 2
                ty = y + (row - 5 * scale) // 2 - (a.chunk > 0) * 2
                _text(img, tx, ty, label, scale, (0, 0, 0))
                break
    return encode_png(img)


def encode_png(img: np.ndarray) -> bytes:
    """Encode an ``(h, w, 3)`` uint8 array as an RGB PNG (filter 0 on every row)."""
    if img.ndim != 3 or img.shape[2] != 3 or img.dtype != np.uint8:
        raise ValueError(f"encode_png wants an (h, w, 3) uint8 array, got {img.shape} {img.dtype}")
    h, w, _ = img.shape
    raw = np.concatenate([np.zeros((h, 1), dtype=np.uint8), img.reshape(h, w * 3)], axis=1)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw.tobytes(), 9))
        + chunk(b"IEND", b"")
    )
