"""``fuelspmd trace DIR``: line the ranks' flight-recorder dumps up and find where they part.

Reads every ``DIR/rank<R>.json`` written by :meth:`fuelspmd.comm.Recorder.dump`. Per group,
it lines the ranks' collectives up by collective number (``cseq``: every rank of a group
must issue the same collectives in the same order, while their send/recv counts may
differ) and points at the first one where a rank is missing or the ranks disagree on op,
shape, dtype, reduce op or root, naming the ranks, the numbers and the fields; for each
rank missing there, where it was instead (the operation it was in, in any group, with its
source line, or its line outside any operation), and which members of the group left no
dump at all. Records older than some rank's ring buffer are not compared. When the
collectives all agree it lists the operations that failed (a mismatched or timed-out
send/recv), or those the ranks were in when they dumped. Exit status: 0 when the ranks
line up, nothing failed and every dump was a look at a running job (SIGUSR1, on request);
1 when a difference or a failure was found, or a dump was written as its rank failed or
was ended (the job did not end cleanly); 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from fuelspmd.comm.recorder import IN_FLIGHT, load_dump
from fuelspmd.errors import ConfigError

__all__ = ["analyse", "main"]

_COMPARED = ("op", "shape", "dtype", "reduce_op", "root")
_P2P = ("send", "recv")


def _text(rec: dict[str, Any]) -> str:
    parts = [f"op #{rec['seq']} {rec['op']} shape {tuple(rec['shape'])} {rec['dtype']}"]
    parts += [f"{k}={rec[k]}" for k in ("reduce_op", "root", "src", "dst", "tag")
              if rec.get(k) is not None]
    at = f" at {rec['where']}" if rec.get("where") else ""
    return " ".join(parts) + f" [{rec['state']}]{at}"


def _ranks(rs: list[int]) -> str:
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(str(r) for r in rs)


def _instead(d: dict[str, Any]) -> str:
    """Where the rank of dump ``d`` was when it dumped: the operation it was in (any
    group's), else its line outside any operation; "" when the dump does not say."""
    flying = [rec for rec in d["records"] if rec["state"] in IN_FLIGHT]
    if flying:
        rec = flying[-1]
        return f"it was in {_text(rec)} (group {rec['group']})"
    if d.get("where"):
        return f"it was at {d['where']}, in no operation"
    return ""


def analyse(dumps: dict[int, dict[str, Any]]) -> tuple[list[str], list[dict[str, Any]]]:
    """Return report lines and what was found: one dict per group whose ranks part (the
    collective where they do, the ranks missing from it and where they were instead), and
    the failed operations when no group parts."""
    lines: list[str] = [f"{len(dumps)} rank dump(s): {_ranks(sorted(dumps))}"]
    found: list[dict[str, Any]] = []
    members: dict[int, set[int]] = {}
    for d in dumps.values():
        for g, ranks in d.get("groups", {}).items():
            members.setdefault(int(g), set()).update(ranks)
    groups = sorted({rec["group"] for d in dumps.values() for rec in d["records"]})
    for group in groups:
        colls: dict[int, dict[int, dict[str, Any]]] = {}
        for rank, d in sorted(dumps.items()):
            mine = {rec["cseq"]: rec for rec in d["records"]
                    if rec["group"] == group and rec["op"] not in _P2P}
            if mine or rank in members.get(group, ()) or any(
                    rec["group"] == group for rec in d["records"]):
                colls[rank] = mine
        absent = sorted(members.get(group, set()) - set(dumps))
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
        lines.append(f"group {group} ({_ranks(sorted(set(ranks) | set(absent)))}):")
        if absent:
            lines.append(f"  {_ranks(absent)} left no dump (killed, or ended by the job's "
                         f"abort before it could write), so never reported reaching "
                         f"collective #{hi}, which {_ranks(ranks)} reached")
        if diff is None:
            lines.append(f"  collectives #{lo}..#{hi} line up on every rank with a dump")
            if absent:
                found.append({"group": group, "cseq": hi, "missing": absent, "fields": [],
                              "instead": {}})
            continue
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
        instead = {r: _instead(dumps[r]) for r in diff["missing"]}
        for r in diff["missing"]:
            where = f": {instead[r]}" if instead[r] else ""
            lines.append(f"  rank {r} never issued collective #{c} (skipped it, or stuck/dead "
                         f"before it){where}")
        if diff["fields"]:
            lines.append(f"  differing fields: {', '.join(diff['fields'])}")
        found.append({**{k: v for k, v in diff.items() if k != "row"},
                      "missing": diff["missing"] + absent, "instead": instead})
    failed = [(r, rec) for r, d in sorted(dumps.items()) for rec in d["records"]
              if rec["state"] in ("mismatch", "timeout", "failed")]
    if failed:
        lines.append("failed operations:" if found else "collectives agree; failed operations:")
        for r, rec in failed:
            lines.append(f"  rank {r}: {_text(rec)}: {rec.get('note', '')}")
        if not found:
            found.append({"failed": [{"rank": r, "seq": rec["seq"], "state": rec["state"]}
                                     for r, rec in failed]})
    flying = [(r, rec) for r, d in sorted(dumps.items()) for rec in d["records"]
              if rec["state"] in IN_FLIGHT]
    if flying and not found:
        lines.append("in flight when dumped (the ranks line up, and wait here):")
        lines += [f"  rank {r}: {_text(rec)} (group {rec['group']})" for r, rec in flying]
    for r, d in sorted(dumps.items()):
        last = d["records"][-1]["state"] if d["records"] else "completed"
        if last == "completed" and d.get("where"):
            lines.append(f"rank {r} was at {d['where']}, in no operation, when it dumped")
    reasons = {d.get("reason", "") for d in dumps.values()} - {""}
    for reason in sorted(reasons)[:4]:
        lines.append(f"dump reason: {reason}")
    return lines, found


def ended_badly(dumps: dict[int, dict[str, Any]]) -> list[int]:
    """The ranks whose dump was written because the rank was ending abnormally (a failure,
    an abort, a signal that ended the job), not as a look at a running job."""
    return [r for r, d in sorted(dumps.items()) if d.get("final", True)]


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
        dumps: dict[int, dict[str, Any]] = {}
        for f in files:
            d = load_dump(f)
            if d["rank"] in dumps:
                raise ConfigError(f"{f}: a second dump of rank {d['rank']}; pass the folder "
                                  "of one job's dumps, one rank<R>.json per rank")
            dumps[d["rank"]] = d
    except ConfigError as e:
        print(f"fuelspmd trace: {e}", file=sys.stderr)
        return 2
    lines, found = analyse(dumps)
    ended = ended_badly(dumps)
    if ended:
        lines.append(f"the job did not end cleanly: {_ranks(ended)} dumped as "
                     f"{'it' if len(ended) == 1 else 'they'} failed or were ended")
    if args.json:
        print(json.dumps({"ranks": sorted(dumps), "differences": found,
                          "ended_badly": ended}, indent=1))
    else:
        print("\n".join(lines))
    return 1 if found or ended else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
