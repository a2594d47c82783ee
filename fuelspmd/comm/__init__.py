"""Layer 4: communication above the Transport seam.

The lazy :class:`Communicator` (collectives as graph nodes over any Transport; its ops in
``comm.ops``), the collective guard (:class:`Guard`, :class:`GuardedTransport`), the
fingerprint it compares (:class:`Fingerprint`) and the flight recorder (:class:`Recorder`).
The guard imports errors, dtypes, backend and transport only; the Communicator also the
graph and the Tensor front (layers 2 and 3).
"""

from __future__ import annotations

from fuelspmd.comm.communicator import Communicator
from fuelspmd.comm.fingerprint import Fingerprint, group_id
from fuelspmd.comm.guard import MODES, Guard
from fuelspmd.comm.guarded import GuardedTransport, GuardedWork
from fuelspmd.comm.recorder import Record, Recorder, load_dump

__all__ = ["MODES", "Communicator", "Fingerprint", "Guard", "GuardedTransport", "GuardedWork",
           "Record", "Recorder", "group_id", "load_dump"]
