"""Schedule generators: ``schedule(kind, stages, microbatches, chunks)`` -> :class:`Schedule`.

Pure policy: imports only ``fuelspmd.errors`` and this package's ``actions``. Every rank
calls the same function with the same numbers and gets the same lists, so no rank needs to
tell another what it will do.

``p`` = stages (ranks), ``m`` = micro-batches, ``c`` = chunks per rank.

gpipe
    Every rank runs all ``m`` forwards, then all ``m`` backwards. Holds ``m`` activations.
1f1b
    PipeDream-flush / Megatron 1F1B: rank ``r`` runs ``min(p - r - 1, m)`` warm-up forwards,
    then alternates one forward and one backward, then drains the remaining backwards.
    Same bubble as GPipe, but at most ``p - r`` activations held on rank ``r``.
interleaved
    Megatron's interleaved 1F1B over ``c`` chunks per rank (virtual stage ``j*p + r`` on
    rank ``r``). Micro-batches go through in groups of ``p``: forward number ``k`` of a
    rank is chunk ``(k mod p*c) // p`` on micro-batch ``(k // (p*c)) * p + k mod p``; the
    backwards walk the chunks in reverse. Needs ``m`` divisible by ``p``. The bubble
    shrinks by about ``c`` because each action is ``1/c`` of the rank's model.
zb-h1
    Zero-bubble ZB-H1 (Qi et al., 2023): the backward is split into ``I`` (input
    gradient, on the critical path) and ``W`` (weight gradient, which nothing downstream
    waits for). Rank ``r`` follows 1F1B with ``I`` for ``B`` but defers its first ``r``
    ``W`` s, which then fill the drain where 1F1B idles. With uniform stage times,
    ``t_W <= min(t_F, t_I)`` and ``m >= p``, the step is
    ``m (t_F + t_I + t_W) + (p - 1)(t_F + t_I - t_W)``: the idle time per rank falls from
    1F1B's ``(p-1)(t_F + t_I + t_W)`` to ``(p-1)(t_F + t_I - t_W)`` (``3m + p - 1`` against
    ``3(m + p - 1)`` in unit times), and no rank holds more than ``p`` activations
    (rank 0's 1F1B peak).
"""

from __future__ import annotations

from fuelspmd.errors import ConfigError
from fuelspmd.pipeline_parallel.actions import Action, Schedule

__all__ = ["SCHEDULE_KINDS", "schedule"]

SCHEDULE_KINDS: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "zb-h1")


def schedule(kind: str, stages: int, microbatches: int, chunks: int = 1) -> Schedule:
    """Build the per-rank action lists of schedule ``kind``.

    ``chunks > 1`` is only meaningful for ``interleaved`` (which needs it); the others
    take ``chunks=1``. Bad sizes raise :class:`~fuelspmd.errors.ConfigError` naming them.
    """
    key = kind.lower().replace("_", "-")
    if key not in SCHEDULE_KINDS:
        raise ConfigError(
            f"unknown schedule kind {kind!r}: choose one of {', '.join(SCHEDULE_KINDS)}"
        )
    for name, value in (("stages", stages), ("microbatches", microbatches), ("chunks", chunks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
    if key == "interleaved":
        if chunks < 2:
            raise ConfigError(
                f"the interleaved schedule needs chunks >= 2 model chunks per rank, got "
                f"chunks={chunks}; use kind='1f1b' for one chunk"
            )
        if microbatches % stages:
            lower = microbatches - microbatches % stages
            fits = " or ".join(str(n) for n in (lower, lower + stages) if n > 0)
            raise ConfigError(
                f"the interleaved schedule needs microbatches divisible by stages: "
                f"{microbatches} micro-batches over {stages} stages leaves "
                f"{microbatches % stages}; use microbatches={fits}"
            )
        actions = [_interleaved(r, stages, microbatches, chunks) for r in range(stages)]
    elif chunks != 1:
        raise ConfigError(
            f"schedule {key!r} runs one model chunk per rank, got chunks={chunks}; "
            f"use kind='interleaved' for chunks > 1"
        )
    elif key == "gpipe":
        actions = [_gpipe(r, microbatches) for r in range(stages)]
    elif key == "1f1b":
        actions = [_one_f_one_b(r, stages, microbatches) for r in range(stages)]
    else:
        actions = [_zb_h1(r, stages, microbatches) for r in range(stages)]
    # Interleaved has both neighbours of a rank sending to it in the same steady-state
    # step; with rendezvous sends two ranks can each wait in a send to the other, so it
    # needs non-blocking sends (Megatron batches the sends of a step's F and B instead).
    sends = "nonblocking" if key == "interleaved" and stages > 1 else "blocking"
    return Schedule(key, stages, microbatches, chunks, actions, sends)


def _gpipe(rank: int, m: int) -> list[Action]:
    return [Action(rank, "F", i) for i in range(m)] + [Action(rank, "B", i) for i in range(m)]


def _one_f_one_b(rank: int, p: int, m: int) -> list[Action]:
    warmup = min(p - rank - 1, m)
    out = [Action(rank, "F", i) for i in range(warmup)]
    for i in range(m - warmup):
        out += [Action(rank, "F", warmup + i), Action(rank, "B", i)]
    out += [Action(rank, "B", i) for i in range(m - warmup, m)]
    return out


def _interleaved(rank: int, p: int, m: int, c: int) -> list[Action]:
    """Megatron-core's ``forward_backward_pipelining_with_interleaving`` order."""
    total = m * c
    group = p * c

    def forward(k: int) -> Action:
        return Action(rank, "F", (k // group) * p + k % p, (k % group) // p)

    def backward(k: int) -> Action:
        return Action(rank, "B", (k // group) * p + k % p, c - 1 - (k % group) // p)

    if m == p:
        warmup = total  # Megatron runs all forwards first when there is one group
    else:
        warmup = min((p - rank - 1) * 2 + (c - 1) * p, total)
    out = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        out += [forward(warmup + k), backward(k)]
    out += [backward(k) for k in range(total - warmup, total)]
    return out


def _zb_h1(rank: int, p: int, m: int) -> list[Action]:
    """1F1B with the backward split, rank ``r`` deferring its first ``r`` weight gradients.

    Warm-up and the F/I alternation are 1F1B's; ``W(i - r)`` follows the ``i``-th steady
    ``I``, and each drain ``I`` is followed by the oldest pending ``W``. Deferring ``r``
    ``W`` s lets the later ranks pass input gradients up without waiting behind a ``W``,
    and costs rank ``r`` at most ``r`` extra activations: ``(p - r) + r = p``, rank 0's
    1F1B peak.
    """
    warmup = min(p - rank - 1, m)
    out = [Action(rank, "F", i) for i in range(warmup)]
    done_w = 0
    for i in range(m - warmup):
        out += [Action(rank, "F", warmup + i), Action(rank, "I", i)]
        if i >= rank:
            out.append(Action(rank, "W", done_w))
            done_w += 1
    for i in range(m - warmup, m):
        out += [Action(rank, "I", i), Action(rank, "W", done_w)]
        done_w += 1
    out += [Action(rank, "W", i) for i in range(done_w, m)]
    return out
