"""Layer 4: communication above the Transport seam.

So far the collective guard (:class:`Guard`, :class:`GuardedTransport`), the fingerprint it
exchanges (:class:`Fingerprint`) and the flight recorder (:class:`Recorder`). The lazy
Communicator joins this package later. Imports errors, dtypes, backend and transport only.
"""

from __future__ import annotations

from fuelspmd.comm.fingerprint import Fingerprint, group_id
from fuelspmd.comm.guard import MODES, Guard, Ticket
from fuelspmd.comm.guarded import GuardedTransport, GuardedWork
from fuelspmd.comm.recorder import Record, Recorder, load_dump

__all__ = ["MODES", "Fingerprint", "Guard", "GuardedTransport", "GuardedWork", "Record",
           "Recorder", "Ticket", "group_id", "load_dump"]
