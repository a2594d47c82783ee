"""``simulate(schedule, t_f, t_b, t_comm)``: event simulation of a schedule -> :class:`Timeline`.

Pure policy: imports only ``fuelspmd.errors`` and this package's modules.

Model. Each rank runs its actions in list order. An action starts when its rank is free
and every input it needs has arrived: an input made on the same rank is there when its
producer ends; one made on another rank arrives ``t_comm`` after its producer ends.
Sends do not hold up the sender (they are posted and waited on later, as an executor
with non-blocking sends does); :func:`validate`, run first, proves the order cannot
deadlock under the schedule's declared send discipline (``schedule.sends``).

Bubble. With uniform per-stage times and ``t_comm = 0``, GPipe and 1F1B both take
``(m + p - 1) (t_f + t_b)``: the first micro-batch's forward needs ``p - 1`` forward
hops before the last stage starts, and the last micro-batch's backward ``p - 1``
backward hops after the last stage ends, while each rank computes ``m (t_f + t_b)``.
So the idle share is ``(p - 1) / (m + p - 1)`` for any ratio ``t_b / t_f``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from fuelspmd.errors import ConfigError
from fuelspmd.pipeline_parallel.actions import Action, Schedule
from fuelspmd.pipeline_parallel.validate import validate

__all__ = ["Timeline", "simulate"]

Times = float | int | Sequence[float] | Mapping[Action, float]


@dataclass(frozen=True)
class Timeline:
    """When each action of a schedule ran, and what that adds up to.

    ``start[a]``/``end[a]`` per action; ``makespan`` the step time; ``busy[r]`` the compute
    time of rank ``r``; ``peak_in_flight[r]`` the most micro-batch activations rank ``r``
    held at once (forward done, backward not yet).
    """

    schedule: Schedule
    start: dict[Action, float]
    end: dict[Action, float]
    makespan: float
    busy: list[float]
    peak_in_flight: list[int]

    @property
    def bubble(self) -> float:
        """Idle share of the step: ``1 - sum(busy) / (ranks * makespan)``."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)

    def rank_bubble(self, rank: int) -> float:
        """Idle share of rank ``rank`` alone."""
        return 1.0 - self.busy[rank] / self.makespan if self.makespan > 0 else 0.0

    @classmethod
    def measured(
        cls, schedule: Schedule, start: Mapping[Action, float], end: Mapping[Action, float]
    ) -> Timeline:
        """A timeline from measured clock readings (any origin, e.g. ``time.perf_counter``
        on each rank after a barrier): shifted so the earliest start is 0, with the same
        step time, bubble and in-flight figures as a simulated one, so the two compare."""
        actions = [a for acts in schedule.actions for a in acts]
        missing = [str(a) for a in actions if a not in start or a not in end]
        if missing:
            raise ConfigError(
                f"measured timeline lacks {len(missing)} of {len(actions)} actions, "
                f"first {missing[0]}; time every action of the schedule"
            )
        t0 = min((start[a] for a in actions), default=0.0)
        shifted_start = {a: float(start[a] - t0) for a in actions}
        shifted_end = {a: float(end[a] - t0) for a in actions}
        bad = next((a for a in actions if shifted_end[a] < shifted_start[a]), None)
        if bad is not None:
            raise ConfigError(f"action {bad} ends before it starts: {start[bad]} > {end[bad]}; "
                              "give each action start <= end")
        busy = [0.0] * schedule.stages
        for a in actions:
            busy[a.stage] += shifted_end[a] - shifted_start[a]
        return cls(
            schedule=schedule,
            start=shifted_start,
            end=shifted_end,
            makespan=max(shifted_end.values(), default=0.0),
            busy=busy,
            peak_in_flight=schedule.peak_in_flight(),
        )


def _duration_of(name: str, spec: Times, schedule: Schedule) -> Callable[[Action], float]:
    """Turn one time argument into a function Action -> seconds, checking it up front."""
    if isinstance(spec, Mapping):

        def lookup(a: Action) -> float:
            if a not in spec:
                raise ConfigError(f"{name} has no duration for action {a}; give every action")
            return _checked(name, spec[a])

        return lookup
    if isinstance(spec, int | float):
        value = _checked(name, spec)
        return lambda a: value
    values = [_checked(name, x) for x in spec]
    p, v = schedule.stages, schedule.virtual_stages
    if len(values) == v:
        return lambda a: values[schedule.vstage(a)]
    if len(values) == p:
        return lambda a: values[a.stage]
    raise ConfigError(
        f"{name} has {len(values)} per-stage times; give {p} (one per rank)"
        + (f" or {v} (one per virtual stage)" if v != p else "")
    )


def _checked(name: str, x: object) -> float:
    if not isinstance(x, int | float) or isinstance(x, bool) or not math.isfinite(x) or x < 0:
        raise ConfigError(f"{name} must be finite and >= 0, got {x!r}")
    return float(x)


def simulate(
    schedule: Schedule,
    t_f: Times,
    t_b: Times | None = None,
    t_comm: float = 0.0,
    *,
    t_w: Times | None = None,
) -> Timeline:
    """Simulate ``schedule`` and return its :class:`Timeline`.

    ``t_f`` (forward), ``t_b`` (backward ``B``, or input-gradient ``I`` in a split
    schedule) and ``t_w`` (weight-gradient ``W``) are each a number, a list with one time
    per rank or per virtual stage, or a mapping Action -> seconds (measured times). Times
    are per action, so for ``interleaved`` pass the time of one chunk. With ``t_b=None``,
    ``t_f`` must be a mapping covering every action. ``t_comm`` is added per hop between
    ranks.
    """
    validate(schedule)
    if t_b is None and not isinstance(t_f, Mapping):
        raise ConfigError("t_b is missing: give a backward time, or a mapping as t_f")
    has_w = any(a.kind == "W" for acts in schedule.actions for a in acts)
    if has_w and t_w is None and not (t_b is None and isinstance(t_f, Mapping)):
        raise ConfigError(f"schedule {schedule.kind!r} has W actions: give t_w")
    comm = _checked("t_comm", t_comm)
    fwd = _duration_of("t_f", t_f, schedule)
    bwd = fwd if t_b is None else _duration_of("t_b", t_b, schedule)
    wgt = bwd if t_w is None else _duration_of("t_w", t_w, schedule)
    duration = {"F": fwd, "B": bwd, "I": bwd, "W": wgt}

    made: dict[tuple[str, int, int], tuple[float, int]] = {}  # key -> (time, rank)
    start: dict[Action, float] = {}
    end: dict[Action, float] = {}
    free = [0.0] * schedule.stages
    busy = [0.0] * schedule.stages
    nxt = [0] * schedule.stages
    remaining = sum(len(acts) for acts in schedule.actions)
    while remaining:
        progressed = False
        for r, acts in enumerate(schedule.actions):
            while nxt[r] < len(acts):
                a = acts[nxt[r]]
                needs = schedule.needs(a)
                if any(k not in made for k in needs):
                    break
                ready = max(
                    (t + (comm if src != r else 0.0) for t, src in (made[k] for k in needs)),
                    default=0.0,
                )
                t0 = max(free[r], ready)
                dt = duration[a.kind](a)
                start[a], end[a] = t0, t0 + dt
                free[r] = t0 + dt
                busy[r] += dt
                for key in schedule.produces(a):
                    made[key] = (t0 + dt, r)
                nxt[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("simulate made no progress on a validated schedule")
    return Timeline(
        schedule=schedule,
        start=start,
        end=end,
        makespan=max(free, default=0.0),
        busy=busy,
        peak_in_flight=schedule.peak_in_flight(),
    )
