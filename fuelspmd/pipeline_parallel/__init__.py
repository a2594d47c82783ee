"""Pipeline parallelism: stage partition, schedules as data, validator, simulator, executor.

All but the executor are pure policy (no tensor, no transport), so every rank computes the
same answer and one process can test them:

* :func:`partition` splits per-layer costs into contiguous stages, minimising the slowest.
* :func:`schedule` builds a :class:`Schedule` (``gpipe``, ``1f1b``, ``interleaved``,
  ``zb-h1``): ``schedule.actions[rank]`` is the ordered list of :class:`Action` s.
* :func:`validate` proves a schedule complete and deadlock-free under blocking send/recv.
* :func:`simulate` plays it with given times and returns a :class:`Timeline` (step time,
  bubble, peak activations in flight).

:class:`PipelineExecutor` runs a schedule for real over a pipeline Communicator (processes
or a DeviceGroup) and measures it (:meth:`PipelineExecutor.timeline`).
"""

from __future__ import annotations

from fuelspmd.pipeline_parallel.actions import Action, Message, Schedule, Step
from fuelspmd.pipeline_parallel.executor import PipelineExecutor, StepResult
from fuelspmd.pipeline_parallel.partition import Partition, partition
from fuelspmd.pipeline_parallel.schedules import SCHEDULE_KINDS, schedule
from fuelspmd.pipeline_parallel.simulate import Timeline, simulate
from fuelspmd.pipeline_parallel.validate import validate

__all__ = [
    "SCHEDULE_KINDS",
    "Action",
    "Message",
    "Partition",
    "PipelineExecutor",
    "Schedule",
    "Step",
    "StepResult",
    "Timeline",
    "partition",
    "schedule",
    "simulate",
    "validate",
]
