"""Pipeline schedules as data: the :class:`Action`, the :class:`Schedule`, and the one place
where the dependency rules between actions are written down.

Pure policy: imports only ``fuelspmd.errors`` and the standard library.

Vocabulary. ``stages`` is the number of pipeline ranks ``p``; with ``chunks = c`` model
chunks per rank there are ``p * c`` *virtual stages*, assigned round-robin as Megatron does:
chunk ``j`` of rank ``r`` is virtual stage ``v = j * p + r``, so virtual stage ``v`` lives on
rank ``v % p``. The model runs virtual stages ``0 .. p*c - 1`` in order.

Kinds of action (on virtual stage ``v``, micro-batch ``i``):

``F`` forward. Needs the activation of ``v - 1`` (for ``v > 0``).
``B`` full backward (input and weight gradients). Needs the input gradient of ``v + 1``
      (for ``v < p*c - 1``; the last stage starts from its loss) and its own forward.
``I`` input-gradient half of the backward (zero-bubble schedules). Same inputs as ``B``;
      its output, the gradient with respect to the stage input, goes to ``v - 1``.
``W`` weight-gradient half. Needs the ``I`` of the same stage and micro-batch; local.

A micro-batch's activations on a virtual stage are held from its ``F`` until its ``B``
(or its ``W``, which still reads them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from fuelspmd.errors import ScheduleError

__all__ = ["KINDS", "Action", "ActionKind", "Message", "Schedule", "SendMode", "Step"]

ActionKind = Literal["F", "B", "I", "W"]
KINDS: tuple[ActionKind, ...] = ("F", "B", "I", "W")
SendMode = Literal["blocking", "nonblocking"]

_ACTION_RE = re.compile(r"^(\d+)([FBIW])(\d+)(?:\.c(\d+))?$")

# What an action produces or consumes: (what, virtual stage, micro-batch).
#   "act"  the forward output of the stage
#   "grad" the gradient with respect to the stage's input (from B or I)
#   "wgrad" the weight gradient (from B or W), consumed by nobody inside the schedule
Key = tuple[str, int, int]


@dataclass(frozen=True, order=True)
class Action:
    """One unit of pipeline work: rank ``stage`` runs ``kind`` on ``microbatch`` of ``chunk``.

    Prints as ``1F3`` (rank 1, forward, micro-batch 3) and, for chunk ``j > 0``, as
    ``1F3.c1``; :meth:`parse` reads both back, so ``Action.parse(str(a)) == a``.
    ``stage`` is the pipeline *rank*, not the virtual stage: an executor walking
    ``schedule.actions[rank]`` finds its own rank in every action.
    """

    stage: int
    kind: ActionKind
    microbatch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ScheduleError(f"action kind {self.kind!r} is not one of {', '.join(KINDS)}")
        for name in ("stage", "microbatch", "chunk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ScheduleError(f"action {name} must be an int >= 0, got {value!r}")

    def __str__(self) -> str:
        suffix = f".c{self.chunk}" if self.chunk else ""
        return f"{self.stage}{self.kind}{self.microbatch}{suffix}"

    def __repr__(self) -> str:
        return f"Action({self})"

    @property
    def label(self) -> str:
        """The short form drawn in a grid cell, where the row already names the rank."""
        suffix = f".{self.chunk}" if self.chunk else ""
        return f"{self.kind}{self.microbatch}{suffix}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Read ``1F3`` or ``1F3.c1`` back into an Action."""
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ScheduleError(
                f"cannot parse action {text!r}: expected RANK KIND MICROBATCH[.cCHUNK] "
                f"with KIND one of {', '.join(KINDS)}, e.g. '1F3' or '0B2.c1'"
            )
        stage, kind, micro, chunk = match.groups()
        return cls(int(stage), kind, int(micro), int(chunk) if chunk else 0)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Message:
    """A point-to-point transfer implied by the schedule: ``src`` sends ``what`` of
    micro-batch ``microbatch`` produced by virtual stage ``vstage`` to ``dst``.

    ``what`` is ``"act"`` (an activation, going forward) or ``"grad"`` (an input gradient,
    going backward). ``tag`` is unique within the schedule, so an executor can use it as
    the transport tag and a receive can never match the wrong send.
    """

    what: str
    vstage: int
    microbatch: int
    src: int
    dst: int
    tag: int

    def __str__(self) -> str:
        name = "activation" if self.what == "act" else "input gradient"
        return f"{name} of micro-batch {self.microbatch} from virtual stage {self.vstage}"


@dataclass(frozen=True)
class Step:
    """One action with the transfers around it: receive ``recvs`` before running
    ``action``, send ``sends`` after."""

    action: Action
    recvs: tuple[Message, ...]
    sends: tuple[Message, ...]


@dataclass
class Schedule:
    """A pipeline schedule: ``actions[r]`` is the ordered work of rank ``r``.

    Send and receive are not listed: they are implied by the dependencies (see the module
    docstring) and spelled out per rank by :meth:`steps`. ``kind`` is the generator's name
    (``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"zb-h1"``) or anything for a hand-made one.

    ``sends`` is the communication discipline the order is proven safe under (see
    :mod:`fuelspmd.pipeline_parallel.validate`): ``"blocking"`` — rendezvous sends, batched
    with the next action's receives, are enough; ``"nonblocking"`` — the executor must post
    sends without waiting (isend) and wait for them at the end of the step.
    """

    kind: str
    stages: int
    microbatches: int
    chunks: int
    actions: list[list[Action]] = field(default_factory=list)
    sends: SendMode = "blocking"

    @property
    def virtual_stages(self) -> int:
        """``stages * chunks``: how many pieces the model is cut into."""
        return self.stages * self.chunks

    def vstage(self, action: Action) -> int:
        """The virtual stage ``chunk * stages + rank`` an action runs (Megatron's layout)."""
        return action.chunk * self.stages + action.stage

    def rank_of(self, vstage: int) -> int:
        """The rank that holds virtual stage ``vstage``."""
        return vstage % self.stages

    def action_at(self, kind: ActionKind, vstage: int, microbatch: int) -> Action:
        """The action of ``kind`` on ``vstage`` for ``microbatch``."""
        return Action(vstage % self.stages, kind, microbatch, vstage // self.stages)

    def produces(self, action: Action) -> tuple[Key, ...]:
        """What ``action`` makes, as ``(what, vstage, microbatch)`` keys."""
        v, i = self.vstage(action), action.microbatch
        return {
            "F": (("act", v, i),),
            "B": (("grad", v, i), ("wgrad", v, i)),
            "I": (("grad", v, i),),
            "W": (("wgrad", v, i),),
        }[action.kind]

    def needs(self, action: Action) -> tuple[Key, ...]:
        """What ``action`` must have before it starts, as keys (see the module docstring)."""
        v, i = self.vstage(action), action.microbatch
        if action.kind == "F":
            return (("act", v - 1, i),) if v > 0 else ()
        if action.kind == "W":
            return (("grad", v, i),)
        upstream = (("grad", v + 1, i),) if v < self.virtual_stages - 1 else ()
        return (*upstream, ("act", v, i))

    def message(self, key: Key, dst: int) -> Message:
        """The transfer that carries ``key`` from the rank that produced it to ``dst``."""
        what, v, i = key
        kind_id = 0 if what == "act" else 1
        tag = (kind_id * self.virtual_stages + v) * max(self.microbatches, 1) + i
        return Message(what, v, i, self.rank_of(v), dst, tag)

    def recvs_of(self, action: Action) -> tuple[Message, ...]:
        """The transfers ``action``'s rank must receive before running it."""
        return tuple(
            self.message(key, action.stage)
            for key in self.needs(action)
            if key[0] in ("act", "grad") and self.rank_of(key[1]) != action.stage
        )

    def sends_of(self, action: Action) -> tuple[Message, ...]:
        """The transfers ``action``'s rank sends after running it: its activation to the
        next virtual stage, or its input gradient to the previous one, when that stage
        is on another rank."""
        v = self.vstage(action)
        if action.kind == "F" and v + 1 < self.virtual_stages:
            dst = self.rank_of(v + 1)
        elif action.kind in ("B", "I") and v > 0:
            dst = self.rank_of(v - 1)
        else:
            return ()
        if dst == action.stage:
            return ()
        what = "act" if action.kind == "F" else "grad"
        return (self.message((what, v, action.microbatch), dst),)

    def steps(self, rank: int) -> list[Step]:
        """Rank ``rank``'s actions with the receives before and the sends after each."""
        return [Step(a, self.recvs_of(a), self.sends_of(a)) for a in self.actions[rank]]

    def in_flight(self, rank: int) -> list[int]:
        """How many (micro-batch, chunk) activations rank ``rank`` holds after each action.

        A forward adds one; the action that frees it (``B``, or ``W`` in a split backward)
        removes one. This depends only on the order, not on timing.
        """
        held, out = 0, []
        for a in self.actions[rank]:
            if a.kind == "F":
                held += 1
            elif a.kind in ("B", "W"):
                held -= 1
            out.append(held)
        return out

    def peak_in_flight(self) -> list[int]:
        """Per rank, the most activations held at once (the activation-memory bound)."""
        return [max(self.in_flight(r), default=0) for r in range(self.stages)]

    def format(self) -> str:
        """One line per rank: ``rank 0: 0F0 0F1 0B0 0B1``."""
        width = len(str(max(self.stages - 1, 0)))
        return "\n".join(
            f"rank {r:>{width}}: " + " ".join(str(a) for a in acts)
            for r, acts in enumerate(self.actions)
        )
