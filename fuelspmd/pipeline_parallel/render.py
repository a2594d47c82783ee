"""Draw a :class:`Timeline`: a text grid for the terminal, a Chrome trace, and a picture.

The grid and the trace need only the standard library. The picture is drawn with
matplotlib, an optional extra (``pip install 'fuelspmd[plot]'``), imported by
:func:`figure` when it draws, so importing this module loads no plotting library. Nothing
here writes files: the ``fuelspmd schedule`` command prints or saves what these return.
"""

from __future__ import annotations

import importlib.util
import math
from typing import TYPE_CHECKING

from fuelspmd.pipeline_parallel.actions import KINDS
from fuelspmd.pipeline_parallel.simulate import Timeline

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "NEEDS_MATPLOTLIB",
    "chrome_trace",
    "figure",
    "figure_height",
    "grid",
    "have_matplotlib",
    "narrowest_action_px",
    "width_for",
]

_ANSI = {"F": "34", "B": "32", "I": "36", "W": "33"}


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


NEEDS_MATPLOTLIB = "needs matplotlib, which is not installed; pip install 'fuelspmd[plot]'"
DPI = 100  # a picture's width and height are given in pixels at this resolution
LEFT, RIGHT, TOP, BOTTOM = 70, 20, 50, 75  # pixels around the axes: rank labels, title, legend
ROW_PX = 30  # pixels per rank
READABLE_PX = 4  # an action narrower than this merges with its neighbours in a picture
_NAMES = {"F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient"}
_COLOURS = {"F": "#4285f4", "B": "#34a853", "I": "#0096aa", "W": "#e6a000"}
_IDLE = "#e6e6e6"
_CHAR_PX = 6.5  # a label character at font size 7, with room to spare


def have_matplotlib() -> bool:
    """Whether :func:`figure` can draw; asked before any work, without importing it."""
    return importlib.util.find_spec("matplotlib") is not None


def figure_height(stages: int) -> int:
    """The height in pixels of a :func:`figure` of ``stages`` ranks, known before drawing
    so a caller can refuse a picture too large to hold."""
    return TOP + stages * ROW_PX + BOTTOM


def narrowest_action_px(timeline: Timeline, width: int = 1200) -> float:
    """The width in pixels of the shortest action in a :func:`figure` ``width`` pixels wide."""
    span = timeline.makespan or 1.0
    shortest = min((timeline.end[a] - t0 for a, t0 in timeline.start.items()), default=span)
    return shortest * (width - LEFT - RIGHT) / span


def width_for(timeline: Timeline, px: float = READABLE_PX) -> int:
    """The :func:`figure` width at which the shortest action is ``px`` pixels wide."""
    per_px = narrowest_action_px(timeline, LEFT + RIGHT + 1)  # action px per px of axis
    return LEFT + RIGHT + (math.ceil(px / per_px) if per_px > 0 else 1)


def figure(timeline: Timeline, *, width: int = 1200, time_unit: str = "time") -> Figure:
    """The timeline as a matplotlib ``Figure`` (Agg canvas; ``savefig`` writes png, svg or
    pdf): a row per rank, a bar per action coloured by kind and lighter for later
    micro-batches, hatched for chunks after the first, labelled ``F3`` (or ``3``) where
    the label fits; grey where the rank idles. The x axis is the simulator's time, called
    ``time_unit``; the title names the schedule, its sizes and the simulated bubble, and
    the legend every kind the schedule has.

    The axes sit at fixed pixel margins, so a bar's width in pixels is known while drawing
    (which labels fit, whether white seams between bars would cover narrow ones)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.collections import PolyCollection
        from matplotlib.colors import to_rgb
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(f"drawing a timeline {NEEDS_MATPLOTLIB}",
                                  name="matplotlib") from err
    s = timeline.schedule
    height = figure_height(s.stages)
    fig = Figure(figsize=(width / DPI, height / DPI), dpi=DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((LEFT / width, BOTTOM / height, (width - LEFT - RIGHT) / width,
                       (height - TOP - BOTTOM) / height))
    span = timeline.makespan or 1.0
    px = (width - LEFT - RIGHT) / span

    def box(t0: float, t1: float, row: int) -> list[tuple[float, float]]:
        return [(t0, row - 0.4), (t1, row - 0.4), (t1, row + 0.4), (t0, row + 0.4)]

    ax.add_collection(PolyCollection([box(0.0, span, r) for r in range(s.stages)],
                                     facecolors=_IDLE, linewidths=0))
    seam = 0.8 if narrowest_action_px(timeline, width) >= READABLE_PX else 0.0
    base = {k: to_rgb(c) for k, c in _COLOURS.items()}
    bars: dict[tuple[str, int], tuple[list, list]] = {}
    for a, t0 in timeline.start.items():
        verts, colours = bars.setdefault((a.kind, a.chunk), ([], []))
        t1 = timeline.end[a]
        verts.append(box(t0, t1, a.stage))
        lighter = 0.55 * a.microbatch / max(s.microbatches - 1, 1)
        colours.append(tuple(v + (1 - v) * lighter for v in base[a.kind]))
        for label in (f"{a.kind}{a.microbatch}", str(a.microbatch)):
            if (t1 - t0) * px >= _CHAR_PX * len(label) + 4:
                ax.text((t0 + t1) / 2, a.stage, label, ha="center", va="center", fontsize=7)
                break
    for (_, chunk), (verts, colours) in bars.items():
        ax.add_collection(PolyCollection(verts, facecolors=colours, edgecolors="white",
                                         linewidths=seam, hatch="//" * chunk or None))
    ax.set_xlim(0, span)
    ax.set_ylim(s.stages - 0.5, -0.5)  # rank 0 on top
    ax.set_yticks(range(s.stages), [f"rank {r}" for r in range(s.stages)], fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    ax.set_xlabel(time_unit, fontsize=9)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    chunks = f", {s.chunks} chunks per rank" if s.chunks > 1 else ""
    ax.set_title(f"{s.kind}: {s.stages} stages, {s.microbatches} micro-batches{chunks}\n"
                 f"simulated bubble {timeline.bubble:.2%}", fontsize=10)
    present = {a.kind for a in timeline.start}
    handles = [Patch(facecolor=_COLOURS[k], label=f"{k} {_NAMES[k]}") for k in KINDS
               if k in present]
    handles += [Patch(facecolor="#888888", edgecolor="white", hatch="//" * j,
                      label=f"chunk {j}") for j in range(1, s.chunks)]
    handles.append(Patch(facecolor=_IDLE, label="idle"))
    fig.legend(handles=handles, loc="lower center", ncols=len(handles), frameon=False,
               fontsize=8, borderaxespad=0.3)
    return fig
