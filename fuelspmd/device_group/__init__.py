"""``DeviceGroup``: one process, several devices, the same SPMD program (layer 5).

Built on an in-process Transport (:class:`~fuelspmd.device_group.transport.LocalTransport`),
so the very same :class:`~fuelspmd.comm.Communicator` code serves ``mpiexec`` and a group: a
strategy cannot tell the difference, which is invariant 6 by construction (rather than
direct multi-device graph nodes, which would be a second implementation of every
collective). :meth:`DeviceGroup.run` calls ``fn(comms[i], args...)`` for each device in its
own thread, so a program that realises mid-way (prints a loss) works as it does under
``mpiexec``. How collectives meet, the shared all_reduce result, host staging between
libraries and the errors naming missing devices are in :mod:`fuelspmd.device_group.transport`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from fuelspmd.backend import Device, parse_devices
from fuelspmd.backend import device as as_device
from fuelspmd.comm import Communicator
from fuelspmd.device_group.transport import LocalTransport, local_group
from fuelspmd.errors import (
    CollectiveMismatchError,
    CommTimeoutError,
    ConfigError,
    PeerAbortedError,
)

__all__ = ["DeviceGroup", "LocalTransport"]


class DeviceGroup:
    """Devices of one process running one SPMD program; see the module docstring."""

    def __init__(self, devices: Sequence[str | Device], *, timeout: float = 600.0,
                 bucket_bytes: int = 0) -> None:
        devs = [as_device(d) for d in devices]
        if not devs:
            raise ConfigError("DeviceGroup needs at least one device, e.g. "
                              "DeviceGroup(['cpu:0', 'cpu:1']) or DeviceGroup.cpu(2)")
        if len(set(devs)) != len(devs):
            raise ConfigError(f"DeviceGroup: devices {[str(d) for d in devs]} repeat one; "
                              "name each device once")
        if not timeout > 0:
            raise ConfigError(f"DeviceGroup(timeout={timeout}): give a positive number of "
                              "seconds")
        self.devices = devs
        self.timeout = float(timeout)
        self._group, seams = local_group([str(d) for d in devs], timeout=self.timeout)
        self.comms = [Communicator(seam, device=d, timeout=timeout, bucket_bytes=bucket_bytes)
                      for seam, d in zip(seams, devs)]

    @classmethod
    def cpu(cls, n: int, *, timeout: float = 600.0, bucket_bytes: int = 0) -> DeviceGroup:
        """Return a group of ``n`` host devices ``cpu:0`` .. ``cpu:n-1``."""
        if n < 1:
            raise ConfigError(f"DeviceGroup.cpu({n}): give at least 1 device")
        return cls([f"cpu:{i}" for i in range(n)], timeout=timeout, bucket_bytes=bucket_bytes)

    @classmethod
    def parse(cls, spec: str, *, timeout: float = 600.0, bucket_bytes: int = 0) -> DeviceGroup:
        """Return the group a ``--devices`` argument names (:func:`fuelspmd.backend.parse_devices`).

        ``"cpu:4"`` (a kind and a count, no comma) is the four devices ``cpu:0`` ..
        ``cpu:3``; a comma list (``"cuda:0,cuda:2"``, ``"cpu:0,strict:0"``, ``"cuda:1,"``)
        names each device. A bad spec raises DeviceError showing both forms.
        """
        return cls(parse_devices(spec), timeout=timeout, bucket_bytes=bucket_bytes)

    def __repr__(self) -> str:
        return f"DeviceGroup({', '.join(map(str, self.devices))})"

    @property
    def size(self) -> int:
        return len(self.devices)

    def run(self, fn: Callable[..., Any], *per_device_args: Sequence[Any]) -> list[Any]:
        """Call ``fn(comms[i], a[i], b[i], ...)`` for every device, each in its own thread;
        return the results in device order, or raise the first device's error."""
        n = self.size
        for k, a in enumerate(per_device_args):
            if len(a) != n:
                raise ConfigError(f"DeviceGroup.run: argument {k} has {len(a)} entries but "
                                  f"the group has {n} devices; give one per device")
        g = self._group
        with g.cond:
            g.gone.clear()
        results: list[Any] = [None] * n
        errors: list[BaseException | None] = [None] * n

        def body(i: int) -> None:
            how = "returned"
            try:
                results[i] = fn(self.comms[i], *(a[i] for a in per_device_args))
                self.comms[i].flush()
            except BaseException as e:
                errors[i], how = e, "failed"
            with g.cond:
                g.gone.setdefault(i, how)
                g.cond.notify_all()

        threads = [threading.Thread(target=body, args=(i,), name=f"fuelspmd-{d}", daemon=True)
                   for i, d in enumerate(self.devices)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout + 10.0)
            if t.is_alive():
                raise CommTimeoutError(f"DeviceGroup.run: {t.name} did not finish within "
                                       f"{self.timeout:g} s")
        first = next((e for e in errors if e is not None), None)
        if first is None:
            with g.cond:
                unread = sorted((k, len(v)) for k, v in g.mail.items() if v)
            if unread:
                first = CollectiveMismatchError("DeviceGroup.run: messages sent but never "
                                                "received: " + "; ".join(
                    f"{g.devices[a]} -> {g.devices[b]} (tag {t}): {c}"
                    for (a, b, t), c in unread) + "; give each send a matching recv")
        if first is not None:
            self._reset()
            # a device that failed first makes the others raise PeerAbortedError: report
            # the original failure, not the echo
            raise next((e for e in errors if e is not None
                        and not isinstance(e, PeerAbortedError)), first)
        return results

    def _reset(self) -> None:
        """After a failed run the devices stopped at different collectives: start the
        group and its communicators afresh, so the next run matches from zero again."""
        g = self._group
        with g.cond:
            g.seq = [0] * g.n
            g.slots.clear()
            g.mail.clear()
        for c in self.comms:
            c._reset()
