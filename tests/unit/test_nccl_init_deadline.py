"""ncclCommInitRank under the transport's deadline (``fuelspmd_nccl._transport.init_rank``),
with a stand-in for cupy's binding: the watchdog itself is real, so each case runs in a
process of its own, which a deadline that passes ends."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

_PROGRAM = """
import sys, time
from fuelspmd_nccl._transport import init_rank

class Binding:  # cupy.cuda.nccl's shape: NcclCommunicator(size, uid, rank)
    class NcclCommunicator:
        def __init__(self, size, uid, rank):
            time.sleep(float(sys.argv[1]))

comm = init_rank(Binding, 2, (0,) * 128, 0, 1.0)
time.sleep(1.5)  # past the deadline: the watchdog must be off once the call returned
print("joined", type(comm).__name__)
"""


def _run(join_s: float) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _PROGRAM, str(join_s)], capture_output=True,
                          text=True, timeout=60)
    return done, time.monotonic() - t0


def test_a_join_in_time_returns_the_communicator() -> None:
    done, _ = _run(0.1)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "joined NcclCommunicator"


@pytest.mark.timeout(60)
def test_a_hang_past_the_deadline_ends_the_process_with_its_stack() -> None:
    done, took = _run(30.0)
    assert done.returncode == 1
    assert took < 15
    assert "Timeout (0:00:01)!" in done.stderr and "in init_rank" in done.stderr
