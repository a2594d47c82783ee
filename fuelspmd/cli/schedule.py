"""``fuelspmd schedule``: build, validate, simulate and draw a pipeline schedule.

``fuelspmd schedule --kind 1f1b --stages 4 --microbatches 8 [--chunks 2] [--png out.png]``
prints the step x rank grid, the action lists, the simulated bubble beside the formula,
and the peak number of micro-batch activations each rank holds; ``--png`` also draws the
timeline (png, svg or pdf, by the file's suffix) with matplotlib, the ``plot`` extra. Times
are in units of one forward (``--t-b 2`` makes a backward twice as long); for
``interleaved`` they are the times of the whole per-rank model, and each chunk's action
takes ``1/chunks`` of them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fuelspmd.cli.arguments import count, number
from fuelspmd.errors import ConfigError, ScheduleError
from fuelspmd.pipeline_parallel import SCHEDULE_KINDS, schedule, simulate
from fuelspmd.pipeline_parallel.render import (
    DPI,
    NEEDS_MATPLOTLIB,
    READABLE_PX,
    figure,
    figure_height,
    grid,
    have_matplotlib,
    narrowest_action_px,
    width_for,
)

__all__ = ["FORMATS", "MAX_CELLS", "MAX_PIXELS", "PNG_WIDTH", "main"]

# The grid has a row per stage and a column per time step, about m * c + p of them: drawing,
# validating and simulating a schedule cost about p * (m * c + p) cells, which this bound
# keeps to seconds (docs/reliability.md has the times).
MAX_CELLS = 1 << 15
PNG_WIDTH = (400, 1 << 15)  # pixels: the title and the legend need the first 400
MAX_PIXELS = 1 << 25  # a picture of at most 128 MiB of RGBA while matplotlib draws it
FORMATS = ("png", "svg", "pdf")  # what --png writes, by the file's suffix
MAX_TIME = 1e9  # an action's time, in any unit: finite


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fuelspmd schedule",
        description="Draw a pipeline schedule and print its simulated bubble and memory.",
    )
    p.add_argument("--kind", default="1f1b", choices=SCHEDULE_KINDS)
    p.add_argument("--stages", type=count(1, MAX_CELLS), default=4, help="pipeline ranks p")
    p.add_argument("--microbatches", type=count(1, MAX_CELLS), default=8,
                   help="micro-batches m per step")
    p.add_argument("--chunks", type=count(1, MAX_CELLS), default=None,
                   help="model chunks per rank (interleaved)")
    time = number(0.0, MAX_TIME, above=True)
    p.add_argument("--t-f", type=time, default=1.0, help="forward time of a rank's model")
    p.add_argument(
        "--t-b", type=time, default=1.0, help="backward time (input-gradient part for zb-h1)"
    )
    p.add_argument("--t-w", type=time, default=1.0, help="weight-gradient time (zb-h1)")
    p.add_argument("--t-comm", type=number(0.0, MAX_TIME), default=0.0,
                   help="time per hop between ranks")
    p.add_argument("--png", type=Path, default=None,
                   help="write a timeline picture here: a .png, .svg or .pdf file (needs "
                        "matplotlib: pip install 'fuelspmd[plot]')")
    p.add_argument("--png-width", type=count(*PNG_WIDTH), default=1200,
                   help=f"the picture's width in pixels (at {DPI} dpi for svg and pdf), "
                        f"{PNG_WIDTH[0]} to {PNG_WIDTH[1]} (default %(default)s)")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    return p


def _formula(
    kind: str, p: int, m: int, c: int, t_f: float, t_b: float, t_w: float
) -> tuple[str, float] | None:
    """The closed-form bubble for uniform stage times and no communication time, where one
    is known (see fuelspmd.pipeline_parallel.simulate and .schedules)."""
    if kind in ("gpipe", "1f1b"):
        return "(p-1)/(m+p-1)", (p - 1) / (m + p - 1)
    if kind == "interleaved":
        return "(p-1)/(c*m+p-1)", (p - 1) / (c * m + p - 1)
    if kind == "zb-h1" and m >= p and t_w <= min(t_f, t_b):
        idle = (p - 1) * (t_f + t_b - t_w)
        return "(p-1)(tF+tI-tW)/step", idle / (m * (t_f + t_b + t_w) + idle)
    return None


def _cannot_draw(path: Path) -> str | None:
    """Why ``--png path`` cannot be written, found before the schedule is built."""
    if not have_matplotlib():
        return f"--png {NEEDS_MATPLOTLIB}"
    if path.suffix.lower().lstrip(".") not in FORMATS:
        return f"cannot write --png {path}: give a file name ending in .png, .svg or .pdf"
    if not path.parent.is_dir():
        return f"cannot write --png {path}: the folder {path.parent} does not exist"
    return None


def main(argv: list[str]) -> int:
    """Run ``fuelspmd schedule`` with ``argv`` (without the program name); return the exit code."""
    args = _parser().parse_args(argv)
    why = None if args.png is None else _cannot_draw(args.png)
    if why is not None:
        print(f"fuelspmd schedule: {why}", file=sys.stderr)
        return 2
    chunks = args.chunks if args.chunks is not None else (2 if args.kind == "interleaved" else 1)
    cells = args.stages * (args.microbatches * chunks + args.stages)
    if cells > MAX_CELLS:
        print(f"fuelspmd schedule: --stages {args.stages} x (--microbatches "
              f"{args.microbatches} x {chunks} chunk(s) + {args.stages} stages) is {cells} "
              f"grid cells, more than the {MAX_CELLS} this command draws in seconds; give "
              "fewer stages or micro-batches", file=sys.stderr)
        return 2
    try:
        sched = schedule(args.kind, args.stages, args.microbatches, chunks)
        per = 1.0 / chunks
        timeline = simulate(sched, args.t_f * per, args.t_b * per, args.t_comm, t_w=args.t_w * per)
    except (ConfigError, ScheduleError) as err:
        print(f"fuelspmd schedule: {err}", file=sys.stderr)
        return 2
    p, m, c = sched.stages, sched.microbatches, sched.chunks
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    print(
        f"{sched.kind}: {p} stages, {m} micro-batches, {c} chunk(s) per rank, "
        f"sends {sched.sends}; validated"
    )
    print(grid(timeline, color=color))
    print()
    print(sched.format())
    print()
    print(
        f"step time      {timeline.makespan:g} (t_f={args.t_f:g}, t_b={args.t_b:g}"
        + (f", t_w={args.t_w:g}" if sched.kind == "zb-h1" else "")
        + f", t_comm={args.t_comm:g})"
    )
    line = f"bubble         {timeline.bubble:.2%}"
    formula = _formula(sched.kind, p, m, c, args.t_f, args.t_b, args.t_w)
    if formula is not None and args.t_comm == 0:
        line += f"   (formula {formula[0]} = {formula[1]:.2%})"
    print(line)
    peaks = timeline.peak_in_flight
    print(
        "peak in flight "
        + " ".join(f"rank {r}: {n}" for r, n in enumerate(peaks))
        + ("  (chunk activations, each 1/c of a rank's)" if c > 1 else "")
    )
    if args.png is not None:
        height = figure_height(p)
        if args.png_width * height > MAX_PIXELS:
            print(f"fuelspmd schedule: a {args.png_width} x {height} px picture is more than "
                  f"the {MAX_PIXELS} px this command draws; give a smaller --png-width (at "
                  f"most {MAX_PIXELS // height}) or fewer stages", file=sys.stderr)
            return 2
        narrow = narrowest_action_px(timeline, args.png_width)
        if narrow < READABLE_PX:
            fits = width_for(timeline)
            fix = (f"give --png-width {fits} (or more), or fewer stages or micro-batches"
                   if fits <= min(PNG_WIDTH[1], MAX_PIXELS // height) else
                   "give fewer micro-batches: no picture this command draws is wide enough")
            print(f"fuelspmd schedule: warning: in a {args.png_width} px picture the shortest "
                  f"action is {narrow:.1f} px wide, so actions merge and carry no labels; "
                  f"{fix}", file=sys.stderr)
        unit = ("time, in forwards of a rank's model" if args.t_f == 1 else
                f"time, in the unit of --t-f (a rank's forward takes {args.t_f:g})")
        try:
            picture = figure(timeline, width=args.png_width, time_unit=unit)
            picture.savefig(args.png, format=args.png.suffix.lower().lstrip("."))
        except OSError as err:
            print(f"fuelspmd schedule: cannot write --png {args.png}: {err.strerror}",
                  file=sys.stderr)
            return 2
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
