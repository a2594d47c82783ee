"""``fuelspmd trace DIR``: line the ranks' flight-recorder dumps up and find where they part.

Reads every ``DIR/rank<R>.json`` written by :meth:`fuelspmd.comm.Recorder.dump`. Per group,
it lines the ranks' collectives up by collective number (``cseq``: every rank of a group
must issue the same collectives in the same order, while their send/recv counts may
differ) and points at the first one where a rank is missing or the ranks disagree on op,
shape, dtype, reduce op or root, naming the ranks, the numbers and the fields. Records older
than some rank's ring buffer are not compared. When the collectives all agree it lists the
operations that failed (a mismatched or timed-out send/recv). Exit status: 0 when the ranks
line up and nothing failed, 1 when a difference or a failure was found, 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from fuelspmd.comm.recorder import load_dump
from fuelspmd.errors import ConfigError

__all__ = ["analyse", "main"]

_COMPARED = ("op", "shape", "dtype", "reduce_op", "root")
_P2P = ("send", "recv")


def _text(rec: dict[str, Any]) -> str:
    parts = [f"op #{rec['seq']} {rec['op']} shape {tuple(rec['shape'])} {rec['dtype']}"]
    parts += [f"{k}={rec[k]}" for k in ("reduce_op", "root", "src", "dst", "tag")
              if rec.get(k) is not None]
    return " ".join(parts) + f" [{rec['state']}]"


def _ranks(rs: list[int]) -> str:
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(str(r) for r in rs)


def analyse(dumps: dict[int, dict[str, Any]]) -> tuple[list[str], list[dict[str, Any]]]:
    """Return report lines and the differences found (one dict per group that parts)."""
    lines: list[str] = [f"{len(dumps)} rank dump(s): {_ranks(sorted(dumps))}"]
    found: list[dict[str, Any]] = []
    groups = sorted({rec["group"] for d in dumps.values() for rec in d["records"]})
    for group in groups:
        colls: dict[int, dict[int, dict[str, Any]]] = {}
        for rank, d in sorted(dumps.items()):
            mine = {rec["cseq"]: rec for rec in d["records"]
                    if rec["group"] == group and rec["op"] not in _P2P}
            if mine or any(rec["group"] == group for rec in d["records"]):
                colls[rank] = mine
        if not any(colls.values()):
            continue
        ranks = sorted(colls)
        lo = max(min(c) for c in colls.values() if c)
        hi = max(max(c) for c in colls.values() if c)
        diff = None
        for c in range(lo, hi + 1):
            row = {r: colls[r].get(c) for r in ranks}
            missing = [r for r, rec in row.items() if rec is None]
            present = {r: rec for r, rec in row.items() if rec is not None}
            first = next(iter(present.values()))
            fields = [f for f in _COMPARED
                      if any(rec[f] != first[f] for rec in present.values())]
            if missing or fields:
                diff = {"group": group, "cseq": c, "missing": missing, "fields": fields,
                        "seq": {r: rec["seq"] for r, rec in present.items()}, "row": row}
                break
        lines.append(f"group {group} ({_ranks(ranks)}):")
        if diff is None:
            lines.append(f"  collectives #{lo}..#{hi} line up on every rank")
            continue
        found.append({k: v for k, v in diff.items() if k != "row"})
        c = diff["cseq"]
        if c > lo:
            lines.append(f"  collectives #{lo}..#{c - 1} line up on every rank")
        lines.append(f"  FIRST DIFFERENCE at collective #{c}:")
        by_text: dict[str, list[int]] = {}
        for r, rec in diff["row"].items():
            if rec is None:
                last = max((k for k in colls[r] if k < c), default=None)
                text = (f"no collective #{c}: its last is #{last}, "
                        f"{_text(colls[r][last])}" if last is not None
                        else f"no collective #{c} (none recorded)")
            else:
                text = _text(rec)
            by_text.setdefault(text, []).append(r)
        for text, rs in by_text.items():
            lines.append(f"    {_ranks(rs)}: {text}")
        if diff["missing"]:
            lines.append(f"  {_ranks(diff['missing'])} never issued collective #{c} "
                         f"(skipped it, or stuck/dead before it)")
        if diff["fields"]:
            lines.append(f"  differing fields: {', '.join(diff['fields'])}")
    failed = [(r, rec) for r, d in sorted(dumps.items()) for rec in d["records"]
              if rec["state"] in ("mismatch", "timeout", "failed")]
    if failed and not found:
        lines.append("collectives agree; failed operations:")
        for r, rec in failed:
            lines.append(f"  rank {r}: {_text(rec)}: {rec.get('note', '')}")
        found.append({"failed": [{"rank": r, "seq": rec["seq"], "state": rec["state"]}
                                 for r, rec in failed]})
    reasons = {d.get("reason", "") for d in dumps.values()} - {""}
    for reason in sorted(reasons)[:4]:
        lines.append(f"dump reason: {reason}")
    return lines, found


def main(argv: list[str] | None = None) -> int:
    """Run ``fuelspmd trace DIR [--json]``; return 0 (aligned), 1 (difference), 2 (bad input)."""
    p = argparse.ArgumentParser(prog="fuelspmd trace",
                                description="Line up flight-recorder dumps and find the first "
                                            "collective where the ranks differ.")
    p.add_argument("dir", type=Path, help="directory holding rank<R>.json dumps")
    p.add_argument("--json", action="store_true", help="print the differences as JSON")
    args = p.parse_args(argv)
    files = sorted(args.dir.glob("rank*.json"))
    if not files:
        print(f"fuelspmd trace: no rank<R>.json dumps in {args.dir}", file=sys.stderr)
        return 2
    try:
        dumps = {int(d["rank"]): d for d in (load_dump(f) for f in files)}
    except ConfigError as e:
        print(f"fuelspmd trace: {e}", file=sys.stderr)
        return 2
    lines, found = analyse(dumps)
    if args.json:
        print(json.dumps({"ranks": sorted(dumps), "differences": found}, indent=1))
    else:
        print("\n".join(lines))
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
