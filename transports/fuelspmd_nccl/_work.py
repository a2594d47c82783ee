"""The Work of an NCCL operation: a CUDA event on the stream the operation was enqueued on.

NCCL calls return once the operation is enqueued on a CUDA stream; it completes on the
GPU later. So a Work records a CUDA event right after the enqueue: ``test`` is the event
query (``cudaEventQuery``, never blocks) and ``wait`` polls it against the deadline. Each
poll also asks the communicator for an asynchronous error (``ncclCommGetAsyncError``,
cupy's ``check_async_error``): a peer that died or a network failure is reported there,
while the event would simply never complete. On an error or a passed deadline the
communicator is aborted (``ncclCommAbort``), which frees the GPU from the stuck kernel, and
the wait raises CommError or CommTimeoutError; the transport then refuses further device
operations (an aborted NCCL communicator cannot be reused), and the job should end.

The wait sleeps between polls (50 us growing to 1 ms): unlike MPI, NCCL progresses on the
GPU and needs no host polls, so a rank that sleeps stalls nobody.
"""

from __future__ import annotations

import time
from typing import Any

from fuelspmd.errors import CommError, CommTimeoutError

__all__ = ["NCCLWork"]

_FIRST_PAUSE_S = 5e-5
_MAX_PAUSE_S = 1e-3


class NCCLWork:
    """A started NCCL operation; ``owner`` is the NCCLTransport that started it.

    ``keep`` holds the device buffers until the GPU is done with them, so a temporary
    passed in is not freed under NCCL. (Work that must follow the operation, such as the
    floor division of an integer avg, is enqueued on the same stream, not run here.)
    """

    __slots__ = ("_event", "_keep", "_op", "_owner", "_seq")

    def __init__(self, event: Any, owner: Any, op: str, seq: int, keep: Any = None) -> None:
        self._event = event
        self._owner = owner
        self._op = op
        self._seq = seq
        self._keep = keep

    def _complete(self) -> bool:
        self._event = None
        self._keep = None
        return True

    def _check(self) -> None:
        """Raise CommError (after aborting the communicator) on an asynchronous NCCL error."""
        reason = self._owner.async_error()
        if reason is not None:
            what = self._owner.explain(self._op, self._seq)
            self._owner.abort_communicator(f"{what}: {reason}")
            raise CommError(f"{what}: NCCL reported an asynchronous error ({reason}); the "
                            f"communicator was aborted (ncclCommAbort), end the job")

    def test(self) -> bool:
        """Return whether the operation completed on the GPU (never blocks)."""
        event = self._event
        if event is None:
            return True
        if event.done:
            return self._complete()
        self._check()
        return False

    def wait(self, timeout: float | None = None) -> None:
        """Block until complete; CommTimeoutError after ``timeout`` s (None: the transport's).

        On the timeout the NCCL communicator is aborted: a collective some rank never
        joined holds the GPU in a kernel that only ``ncclCommAbort`` ends.
        """
        event = self._event
        if event is None:
            return
        if event.done:
            self._complete()
            return
        limit = self._owner.timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + limit
        pause = _FIRST_PAUSE_S
        while not event.done:
            self._check()
            if time.monotonic() > deadline:
                what = self._owner.explain(self._op, self._seq)
                self._owner.abort_communicator(f"{what}: timed out after {limit:g} s")
                raise CommTimeoutError(
                    f"{what} did not complete within {limit:g} s: a rank of the group never "
                    f"joined it, or joined a different collective (every rank must issue "
                    f"the same collectives in the same order); the NCCL communicator was "
                    f"aborted. If it is only slow, raise the timeout (fs.init(timeout=...))")
            time.sleep(pause)
            pause = min(pause * 2, _MAX_PAUSE_S)
        self._complete()
