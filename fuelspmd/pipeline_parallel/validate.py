"""``validate(schedule)``: prove a schedule complete, ordered and free of deadlock.

Pure policy: imports only ``fuelspmd.errors`` and this package's ``actions``.

Three checks, each raising :class:`~fuelspmd.errors.ScheduleError` that names the rank, the
action and the reason:

1. *Shape*: one action list per rank, each action on its own rank, micro-batch and chunk
   in range.
2. *Coverage*: on every virtual stage, every micro-batch has exactly one ``F`` and either
   exactly one ``B`` or exactly one ``I`` and one ``W``.
3. *Order and deadlock*: same-rank dependencies come earlier in the rank's list, and a
   replay of every rank's list under **rendezvous** (blocking) send/recv semantics finishes.

The blocking model (the one the executor must not be weaker than). A rank alternates
compute and communication: it posts the receives its first action needs, waits, runs the
action; then posts, as **one batch**, the sends of the action it just ran together with
the receives of its next action, waits for the whole batch, runs the next action, and so on;
after its last action it posts its last sends. A send completes only when the peer has
*posted* the matching receive, and a receive only when the peer has posted the matching
send — no buffering is assumed. Batching the sends of step ``k`` with the receives of
step ``k+1`` is Megatron's ``send_forward_recv_backward``; without it, plain 1F1B deadlocks
under rendezvous sends (rank 0 sends an activation while rank 1 sends a gradient back).
A schedule that finishes under this model also finishes when sends are buffered (isend
waited later), which only removes waits.

``schedule.sends == "nonblocking"`` selects the weaker model: a rank posts each send
without waiting (isend) right after the action that produced it and waits for all of them
at the end of the step; it blocks only in the receives before an action. Under it a
schedule finishes exactly when program order plus data dependencies form no cycle.
Megatron's interleaved order needs it: in its steady state two neighbouring ranks each
send to the other before receiving, which rendezvous sends turn into a deadlock.
"""

from __future__ import annotations

from collections import Counter

from fuelspmd.errors import ScheduleError
from fuelspmd.pipeline_parallel.actions import Action, Message, Schedule

__all__ = ["validate"]

Op = tuple[str, Message]  # ("send" | "recv", message)


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` is complete, ordered and cannot
    deadlock under rendezvous send/recv (see the module docstring)."""
    _check_shape(schedule)
    _check_coverage(schedule)
    _check_local_order(schedule)
    _replay(schedule)


def _check_shape(s: Schedule) -> None:
    for name in ("stages", "microbatches", "chunks"):
        value = getattr(s, name)
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"schedule {name} must be an int >= 1, got {value!r}")
    if len(s.actions) != s.stages:
        raise ScheduleError(
            f"schedule has {len(s.actions)} action lists for {s.stages} stages; "
            f"it needs exactly one list per rank"
        )
    for r, acts in enumerate(s.actions):
        for n, a in enumerate(acts):
            if not isinstance(a, Action):
                raise ScheduleError(f"rank {r} item {n} is {a!r}, not an Action; build it with "
                                    "Action(...) or Action.parse('1F3')")
            if a.stage != r:
                raise ScheduleError(
                    f"rank {r} lists action {a} (position {n}), which belongs to rank {a.stage}; "
                    f"move it to rank {a.stage}'s list"
                )
            if a.microbatch >= s.microbatches:
                raise ScheduleError(
                    f"rank {r} action {a} (position {n}): micro-batch {a.microbatch} is out "
                    f"of range for {s.microbatches} micro-batches (valid: 0..{s.microbatches - 1})"
                )
            if a.chunk >= s.chunks:
                raise ScheduleError(
                    f"rank {r} action {a} (position {n}): chunk {a.chunk} is out of range "
                    f"for {s.chunks} chunks (valid: 0..{s.chunks - 1})"
                )


def _check_coverage(s: Schedule) -> None:
    counts = Counter(a for acts in s.actions for a in acts)
    for a, n in counts.items():
        if n > 1:
            raise ScheduleError(f"rank {a.stage} runs {a} {n} times; each action must run once")
    for v in range(s.virtual_stages):
        for i in range(s.microbatches):
            f, b, inp, w = (s.action_at(k, v, i) for k in ("F", "B", "I", "W"))  # type: ignore[arg-type]
            r = f.stage
            if f not in counts:
                raise ScheduleError(f"rank {r} never runs the forward {f}; every micro-batch needs "
                                    "one forward per virtual stage")
            if b in counts and (inp in counts or w in counts):
                raise ScheduleError(
                    f"rank {r} runs the full backward {b} and also a split part "
                    f"({inp} or {w}); use either B or I + W"
                )
            if b not in counts and not (inp in counts and w in counts):
                missing = (
                    b if inp not in counts and w not in counts else (w if inp in counts else inp)
                )
                raise ScheduleError(
                    f"rank {r} never runs {missing}: micro-batch {i} of virtual stage {v} "
                    f"needs a backward {b}, or both {inp} and {w}"
                )


def _producer(s: Schedule, present: set[Action], key: tuple[str, int, int]) -> Action:
    what, v, i = key
    if what == "act":
        return s.action_at("F", v, i)
    full = s.action_at("B", v, i)
    return full if full in present else s.action_at("I", v, i)


def _check_local_order(s: Schedule) -> None:
    present = {a for acts in s.actions for a in acts}
    for r, acts in enumerate(s.actions):
        position = {a: n for n, a in enumerate(acts)}
        for n, a in enumerate(acts):
            for key in s.needs(a):
                if s.rank_of(key[1]) != r:
                    continue  # arrives by a message: the replay orders it
                src = _producer(s, present, key)
                if position[src] > n:
                    raise ScheduleError(
                        f"rank {r} runs {a} at position {n} before {src} at position "
                        f"{position[src]}, which it needs"
                    )


def _batches(s: Schedule, rank: int) -> list[frozenset[Op]]:
    """Rank ``rank``'s communication batches: batch ``k`` holds the sends of action
    ``k - 1`` and the receives of action ``k``."""
    steps = s.steps(rank)
    out: list[frozenset[Op]] = []
    previous: tuple[Message, ...] = ()
    for step in steps:
        out.append(frozenset([("send", m) for m in previous] + [("recv", m) for m in step.recvs]))
        previous = step.sends
    out.append(frozenset(("send", m) for m in previous))
    return out


def _replay(s: Schedule) -> None:
    if s.sends not in ("blocking", "nonblocking"):
        raise ScheduleError(f"schedule sends={s.sends!r}: choose 'blocking' or 'nonblocking'")
    if s.sends == "nonblocking":
        # Every send is posted as soon as its action ends and never blocks the sender, so
        # a send is modelled as already posted; only the trailing wait-for-sends remains,
        # which completes once every receive has been posted, i.e. once all ranks finish.
        batches = [
            [frozenset(("recv", m) for m in step.recvs) for step in s.steps(r)]
            for r in range(s.stages)
        ]
    else:
        batches = [_batches(s, r) for r in range(s.stages)]
    pos = [0] * s.stages
    matched: set[Message] = set()

    sent: set[Message] = set()  # non-blocking model: sends posted by finished actions

    def posted(rank: int, op: Op) -> bool:
        if op[0] == "send" and s.sends == "nonblocking":
            return op[1] in sent
        return pos[rank] < len(batches[rank]) and op in batches[rank][pos[rank]]

    progressed = True
    while progressed:
        progressed = False
        for r in range(s.stages):
            while pos[r] < len(batches[r]):
                complete = True
                for role, msg in batches[r][pos[r]]:
                    if msg in matched:
                        continue
                    peer, other = (msg.dst, "recv") if role == "send" else (msg.src, "send")
                    if posted(peer, (other, msg)):
                        matched.add(msg)
                    else:
                        complete = False
                if not complete:
                    break
                if s.sends == "nonblocking":
                    sent.update(s.sends_of(s.actions[r][pos[r]]))
                pos[r] += 1
                progressed = True
    stuck = [r for r in range(s.stages) if pos[r] < len(batches[r])]
    if stuck:
        raise ScheduleError(_deadlock_message(s, batches, pos, matched, stuck[0]))


def _other(role: str) -> str:
    return "receive" if role == "send" else "send"


def _deadlock_message(
    s: Schedule,
    batches: list[list[frozenset[Op]]],
    pos: list[int],
    matched: set[Message],
    first: int,
) -> str:
    """Follow the chain of waits from ``first`` until it repeats, naming each hop."""

    def where(r: int) -> str:
        k, acts = pos[r], s.actions[r]
        if len(batches[r]) <= k:
            return f"rank {r} finished"
        if k == 0:
            return f"rank {r} blocks before its first action {acts[0]}"
        if k < len(acts):
            return f"rank {r} blocks after {acts[k - 1]}, before {acts[k]}"
        return f"rank {r} blocks after its last action {acts[k - 1]}"

    lines: list[str] = []
    seen: set[int] = set()
    r = first
    while r not in seen and pos[r] < len(batches[r]):
        seen.add(r)
        pending = sorted(
            (op for op in batches[r][pos[r]] if op[1] not in matched),
            key=lambda op: (op[0], op[1].tag),
        )
        role, msg = pending[0]
        if role == "send":
            peer, verb = msg.dst, f"sending the {msg} to rank {msg.dst}"
        else:
            peer, verb = msg.src, f"receiving the {msg} from rank {msg.src}"
        lines.append(f"{where(r)}, {verb}, which has not posted the matching {_other(role)}")
        r = peer
    lines.append(where(r) + (" (a cycle: deadlock)" if r in seen else ""))
    return (
        f"schedule {s.kind!r} can deadlock with {s.sends} sends: "
        + "; ".join(lines)
        + ". Reorder the actions so that every send meets a posted receive."
    )
