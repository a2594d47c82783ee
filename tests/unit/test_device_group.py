"""DeviceGroup: the in-process group runs the SPMD programs of tests/spmd_programs.py and
matches numpy; mixed numpy / array-api-strict devices; ordering; errors name devices."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import fuelspmd as fs
from fuelspmd.backend import DEVICES_FORMS, device_limit, parse_devices
from fuelspmd.device_group import DeviceGroup
from fuelspmd.errors import (
    CollectiveMismatchError,
    ConfigError,
    DeviceError,
    PeerAbortedError,
    ShapeError,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import spmd_programs as P

pytestmark = pytest.mark.timeout(60)
TIMEOUT = 10.0


def _check(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=P.RTOL, atol=1e-12, err_msg=k)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_collective_cpu(n: int) -> None:
    group = DeviceGroup.cpu(n, timeout=TIMEOUT)
    outs = group.run(P.every_collective, [P.rank_input(r, n) for r in range(n)])
    for got, want in zip(outs, P.every_collective_reference(n)):
        _check(got, want)


@pytest.mark.parametrize("devices", [["cpu:0", "strict:0"], ["strict:0", "cpu:0", "strict:1"]])
def test_every_collective_mixed_libraries(devices: list[str]) -> None:
    """numpy and array-api-strict devices in one group: hops staged through host memory."""
    n = len(devices)
    group = DeviceGroup(devices, timeout=TIMEOUT)
    outs = group.run(P.every_collective, [P.rank_input(r, n) for r in range(n)])
    for got, want in zip(outs, P.every_collective_reference(n)):
        _check(got, want)


@pytest.mark.parametrize("devices", [["cpu:0"], ["cpu:0", "cpu:1"], ["cpu:0", "strict:0",
                                                                     "cpu:1"]])
def test_gradients_through_collectives(devices: list[str]) -> None:
    n = len(devices)
    group = DeviceGroup(devices, timeout=TIMEOUT)
    ins = [P.grad_inputs(r, n) for r in range(n)]
    outs = group.run(P.grad_program, [x for x, _, _ in ins], [w for _, w, _ in ins],
                     [c for _, _, c in ins])
    for got, want in zip(outs, P.grad_reference(n)):
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)


def test_order_is_creation_order_whatever_is_realised_first() -> None:
    """Device 0 realises its second all_reduce first; it still pairs with the others'
    first one, and realising it realised the first."""
    def fn(comm: fs.Communicator, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
        t = fs.tensor(x, device=comm.device)
        a = comm.all_reduce(t)
        b = comm.all_reduce(t * 10.0)
        if comm.rank == 0:
            b.realize()
            earlier = a.realised
            return a.numpy(), b.numpy(), earlier
        return a.numpy(), b.numpy(), True

    xs = [np.full(4, float(r + 1)) for r in range(3)]
    outs = DeviceGroup.cpu(3, timeout=TIMEOUT).run(fn, xs)
    for a, b, earlier in outs:
        assert earlier
        np.testing.assert_array_equal(a, np.full(4, 6.0))
        np.testing.assert_array_equal(b, np.full(4, 60.0))


def test_all_reduce_computed_once_and_shared() -> None:
    """Host devices get the very same read-only result array, not n copies."""
    def fn(comm: fs.Communicator, x: np.ndarray) -> np.ndarray:
        y = comm.all_reduce(fs.tensor(x, device=comm.device)).realize()
        return y.node.buffer

    xs = [np.arange(8.0) * (r + 1) for r in range(4)]
    outs = DeviceGroup.cpu(4, timeout=TIMEOUT).run(fn, xs)
    assert all(o is outs[0] for o in outs)
    assert not outs[0].flags.writeable
    np.testing.assert_array_equal(outs[0], np.arange(8.0) * 10)
    # downstream compute on the shared result must not write into it
    after = DeviceGroup.cpu(2, timeout=TIMEOUT).run(
        lambda c, x: ((c.all_reduce(fs.tensor(x, device=c.device)) + 1.0) * 2.0).numpy(),
        [np.ones(3), np.ones(3)])
    np.testing.assert_array_equal(after[0], np.full(3, 6.0))


def test_device_that_never_joins_is_named() -> None:
    def fn(comm: fs.Communicator, x: np.ndarray) -> np.ndarray | None:
        if comm.rank == 2:
            return None
        return comm.all_reduce(fs.tensor(x, device=comm.device)).numpy()

    with pytest.raises(PeerAbortedError, match=r"cpu:2 \(returned\)"):
        DeviceGroup.cpu(3, timeout=TIMEOUT).run(fn, [np.ones(2)] * 3)


def test_failed_device_reported_not_its_echo() -> None:
    def fn(comm: fs.Communicator, x: np.ndarray) -> np.ndarray:
        if comm.rank == 1:
            raise KeyError("boom on device 1")
        return comm.all_reduce(fs.tensor(x, device=comm.device)).numpy()

    with pytest.raises(KeyError, match="boom"):
        DeviceGroup.cpu(3, timeout=TIMEOUT).run(fn, [np.ones(2)] * 3)


def test_a_device_that_failed_is_gone_from_every_split_too() -> None:
    """A device whose function failed has left its splits as well: a peer waiting in a
    split's collective (a pipeline's private communicator) raises at once, and the run
    reports the failure, not a timeout (it waited the whole deadline before)."""
    def fn(comm: fs.Communicator, x: np.ndarray) -> None:
        sub = comm.split(0, comm.rank)
        if comm.rank == 1:
            raise KeyError("device 1 failed")
        sub.all_reduce(fs.tensor(x, device=comm.device)).numpy()

    start = time.monotonic()
    with pytest.raises(KeyError, match="device 1 failed"):
        DeviceGroup.cpu(2, timeout=30.0).run(fn, [np.ones(2)] * 2)
    assert time.monotonic() - start < 10.0


def test_failed_device_makes_others_raise_quickly() -> None:
    seen: list[BaseException] = []
    lock = threading.Lock()

    def fn(comm: fs.Communicator, x: np.ndarray) -> None:
        if comm.rank == 0:
            raise KeyError("device 0 failed")
        try:
            comm.all_reduce(fs.tensor(x, device=comm.device)).numpy()
        except PeerAbortedError as e:
            with lock:
                seen.append(e)

    with pytest.raises(KeyError):
        DeviceGroup.cpu(3, timeout=30.0).run(fn, [np.ones(2)] * 3)
    assert len(seen) == 2 and all("cpu:0 (failed)" in str(e) for e in seen)


def test_device_that_returns_early_fails_a_recv_from_it_at_once() -> None:
    """As under mpiexec (tests/unit/test_peer_exit.py): a peer that finished without
    sending what this device receives makes the recv raise PeerAbortedError at once."""
    took: list[float] = []

    def fn(comm: fs.Communicator) -> None:
        if comm.rank == 0:
            start = time.monotonic()
            try:
                comm.recv((2,), "float64", 1).numpy()
            finally:
                took.append(time.monotonic() - start)

    with pytest.raises(PeerAbortedError, match=r"recv from cpu:1 #0: device\(s\) cpu:1 "
                       r"\(returned\) left the group without issuing it"):
        DeviceGroup.cpu(2, timeout=600.0).run(fn)
    assert took[0] < 5.0, took


def test_mismatch_names_devices_and_fields() -> None:
    def fn(comm: fs.Communicator, x: np.ndarray) -> np.ndarray:
        n = 3 if comm.rank == 1 else 2
        return comm.all_reduce(fs.tensor(x[:n], device=comm.device)).numpy()

    with pytest.raises(CollectiveMismatchError, match=r"collective #0: the ranks disagree "
                       r"\(shape: cpu:0 has \(2,\), cpu:1 has \(3,\)\)"):
        DeviceGroup.cpu(2, timeout=TIMEOUT).run(fn, [np.ones(4)] * 2)

    def other_op(comm: fs.Communicator, x: np.ndarray) -> np.ndarray:
        op = "max" if comm.rank == 2 else "sum"
        return comm.all_reduce(fs.tensor(x, device=comm.device), op).numpy()

    with pytest.raises(CollectiveMismatchError, match=r"disagree \(reduce_op: cpu:0 has sum, "
                       r"cpu:2 has max\); every rank must"):
        DeviceGroup.cpu(3, timeout=TIMEOUT).run(other_op, [np.ones(4)] * 3)


def test_build_time_errors() -> None:
    comm = DeviceGroup.cpu(3, timeout=TIMEOUT).comms[0]
    t = fs.tensor(np.ones((4, 6)), device="cpu:0")
    with pytest.raises(ShapeError, match="4 elements, not divisible by the 3 ranks"):
        comm.reduce_scatter(t, axis=0)
    with pytest.raises(ShapeError, match="not divisible"):
        comm.all_to_all(t, split_axis=0, concat_axis=1)
    with pytest.raises(ConfigError, match="root 3 is outside the group of 3"):
        comm.broadcast(t, root=3)
    with pytest.raises(ConfigError, match="dst -1"):
        comm.send(t, -1)
    with pytest.raises(DeviceError, match="cpu:1"):
        comm.all_reduce(fs.tensor(np.ones(2), device="cpu:1"))
    with pytest.raises(ConfigError, match="unknown reduce op"):
        comm.all_reduce(t, "median")
    with pytest.raises(ConfigError, match="2 entries but the group has 3"):
        DeviceGroup.cpu(3).run(lambda c, a: a, [1, 2])
    with pytest.raises(ConfigError, match="repeat"):
        DeviceGroup(["cpu:0", "cpu:0"])


def test_size_one_issues_nothing() -> None:
    """A size-1 communicator returns its inputs: no node, no transport call."""
    comm = DeviceGroup.cpu(1).comms[0]
    t = fs.tensor(np.arange(6.0).reshape(2, 3))
    for y in (comm.all_reduce(t), comm.all_gather(t, 1), comm.reduce_scatter(t, 0),
              comm.broadcast(t, 0), comm.all_to_all(t, 0, 1)):
        assert y is t
    comm.send(t * 2.0, 0)
    np.testing.assert_array_equal(comm.recv((2, 3), "float64", 0).numpy(),
                                  np.arange(6.0).reshape(2, 3) * 2)


def test_plan_cache_hits_on_the_next_step() -> None:
    """The same step rebuilt from new data reuses its plan: no sequence number in attrs."""
    from fuelspmd.graph import default_executor

    def fn(comm: fs.Communicator, x: np.ndarray) -> list[int]:
        cache = default_executor().cache
        misses = []
        for step in range(3):
            y = comm.all_reduce(fs.tensor(x * step, device=comm.device) * 2.0)
            before = cache.misses
            y.realize()
            misses.append(cache.misses - before)
        return misses

    outs = DeviceGroup.cpu(2, timeout=TIMEOUT).run(fn, [np.ones(3), np.ones(3)])
    for m in outs:
        assert m[1:] == [0, 0]


def _many_all_reduces(comm: fs.Communicator, xs: list[np.ndarray]) -> list[np.ndarray]:
    ys = [comm.all_reduce(fs.tensor(x, device=comm.device) * 2.0) for x in xs]
    ys.append(comm.all_reduce(ys[0] + 1.0))  # reads a member: must not join its bucket
    ys.append(comm.all_reduce(fs.tensor(xs[1], device=comm.device), "max"))
    fs.realize(*ys)
    return [y.numpy() for y in ys]


@pytest.mark.parametrize("n", [2, 3])
def test_bucketing_gives_identical_results(n: int) -> None:
    from fuelspmd.graph import default_executor

    rng = np.random.default_rng(5)
    per = [[rng.standard_normal(s) for s in [(3, 4), (7,), (2, 2, 2), (5,)]] for _ in range(n)]
    plain = DeviceGroup.cpu(n, timeout=TIMEOUT).run(_many_all_reduces, per)
    bucketed = DeviceGroup.cpu(n, timeout=TIMEOUT, bucket_bytes=200).run(_many_all_reduces, per)
    for a, b in zip(plain, bucketed):
        for u, v in zip(a, b):
            np.testing.assert_array_equal(u, v)
    want = [2.0 * sum(p[k] for p in per) for k in range(4)]
    for k in range(4):
        np.testing.assert_allclose(plain[0][k], want[k], rtol=1e-12)
    # the plan of the bucketed run: 96 + 56 bytes fit 200, the next 64 opens a new bucket
    comm = DeviceGroup.cpu(2, bucket_bytes=200).comms[0]
    ys = [comm.all_reduce(fs.tensor(p, device="cpu:0") * 2.0) for p in per[0]]
    plan, _ = default_executor().plan([y.node for y in ys])
    buckets = [len(s.members) for s in plan.steps if s.kind == "bucket_start"]
    assert buckets == [2, 2]


def test_bucketing_with_ranks_realising_differently_raises_not_hangs() -> None:
    """Device 0 realises two all_reduces together (one bucket), device 1 one by one."""
    def fn(comm: fs.Communicator, x: np.ndarray) -> None:
        t = fs.tensor(x, device=comm.device)
        a, b = comm.all_reduce(t), comm.all_reduce(t * 2.0)
        if comm.rank == 0:
            fs.realize(a, b)
        else:
            a.realize()
            b.realize()

    with pytest.raises(CollectiveMismatchError, match="shape"):
        DeviceGroup.cpu(2, timeout=TIMEOUT, bucket_bytes=1 << 20).run(fn, [np.ones(4)] * 2)


def test_donation_planned_only_for_dying_intermediates() -> None:
    from fuelspmd.graph import default_executor

    comm = DeviceGroup.cpu(2).comms[0]
    t = fs.tensor(np.ones(4))
    leaf_in = comm.all_reduce(t)
    mid_in = comm.all_reduce(t * 2.0)
    plan, _ = default_executor().plan([leaf_in.node, mid_in.node])
    donate = [s.donate for s in plan.steps if s.kind == "start"]
    assert donate == [False, True]


def test_overlap_starts_early_and_waits_late() -> None:
    """A collective starts when its input is ready and is waited where its result is first
    read, so independent compute (the matmul) runs while it is in flight; the next
    collective on the communicator starts only after the previous wait."""
    from fuelspmd.graph import default_executor

    def fn(comm: fs.Communicator, x: np.ndarray, y: np.ndarray) -> tuple[list[str], Any]:
        tx, ty = fs.tensor(x, device=comm.device), fs.tensor(y, device=comm.device)
        a = tx * 2.0
        c = comm.all_reduce(a)
        heavy = ty @ ty
        d = comm.all_reduce(heavy)
        out = a.sum() + heavy.sum() + c.sum() + d.sum()  # c is first read after the matmul
        plan, _ = default_executor().plan([out.node])
        kinds = [s.kind if s.kind != "matmul_out" else "matmul" for s in plan.steps]
        return kinds, out.numpy()

    xs = [np.full((4, 4), float(r + 1)) for r in range(2)]
    ys = [np.eye(4) * (r + 1) for r in range(2)]
    outs = DeviceGroup.cpu(2, timeout=TIMEOUT).run(fn, xs, ys)
    kinds = outs[0][0]
    order = [k for k in kinds if k in ("start", "wait", "matmul")]
    assert order == ["start", "matmul", "wait", "start", "wait"], kinds
    c = 2.0 * (xs[0] + xs[1]).sum()
    heavy = [(y @ y).sum() for y in ys]
    for r, (_, v) in enumerate(outs):
        np.testing.assert_allclose(v, 2.0 * xs[r].sum() + heavy[r] + c + sum(heavy),
                                   rtol=1e-12)


def test_unreceived_send_is_reported_and_the_group_recovers() -> None:
    def skip_recv(comm: fs.Communicator, x: np.ndarray) -> None:
        if comm.rank == 0:
            comm.send(fs.tensor(x, device=comm.device), 1)

    group = DeviceGroup.cpu(2, timeout=TIMEOUT)
    with pytest.raises(CollectiveMismatchError, match=r"cpu:0 -> cpu:1 \(tag 0\): 1"):
        group.run(skip_recv, [np.ones(2)] * 2)

    def mismatched(comm: fs.Communicator, x: np.ndarray) -> np.ndarray:
        t = fs.tensor(x, device=comm.device)
        comm.all_reduce(t).realize()
        if comm.rank == 0:
            comm.all_reduce(t).realize()  # device 1 never joins this one
        return x

    with pytest.raises(PeerAbortedError, match="cpu:1 \\(returned\\)"):
        group.run(mismatched, [np.ones(2)] * 2)
    # the failed runs left the devices at different collectives; the next run starts clean
    outs = group.run(lambda c, x: c.all_reduce(fs.tensor(x, device=c.device)).numpy(),
                     [np.ones(2), np.full(2, 2.0)])
    np.testing.assert_array_equal(outs[1], [3.0, 3.0])


def test_parse_reads_a_count_or_a_list() -> None:
    assert [str(d) for d in fs.DeviceGroup.parse("cpu:3").devices] == ["cpu:0", "cpu:1", "cpu:2"]
    assert [str(d) for d in fs.DeviceGroup.parse("cpu:0, strict:0").devices] == [
        "cpu:0", "strict:0"]
    # the comma tells the forms apart: a count of one is device 0, a list of one its index
    assert [str(d) for d in parse_devices("cpu:1")] == ["cpu:0"]
    assert [str(d) for d in parse_devices("cpu:1,")] == ["cpu:1"]
    assert [str(d) for d in parse_devices(" cpu:2 , cpu:0 ")] == ["cpu:2", "cpu:0"]


@pytest.mark.parametrize(("spec", "says"), [
    ("cpu:0", "asks for 0 devices; give at least 1 ('cpu:1'), or name the device cpu:0 "
              "alone as the list 'cpu:0,'"),
    ("cpu:-1", "a count is a whole number after 'cpu:'"),
    ("cpu", "a count is a whole number after 'cpu:'"),
    ("gpu:2", "unknown device kind 'gpu'"),
    ("cpu:0,,cpu:1", "an empty entry"),
    ("cpu:0,cpu:0", "names a device twice"),
    ("cpu:0,cpu", "entry 'cpu' is not KIND:INDEX"),
    ("cpu:0,cpu:-1", "entry 'cpu:-1' is not KIND:INDEX"),
])
def test_parse_errors_name_the_problem_and_show_both_forms(spec: str, says: str) -> None:
    with pytest.raises(DeviceError) as info:
        fs.DeviceGroup.parse(spec)
    assert says in str(info.value)
    assert DEVICES_FORMS in str(info.value)
    assert isinstance(info.value, ValueError)


def test_parse_checks_counts_and_indices_against_what_exists(
        monkeypatch: pytest.MonkeyPatch) -> None:
    limit = device_limit("cpu")
    assert limit >= 4  # 4 per core: a 2-device group fits on any machine
    assert len(parse_devices(f"cpu:{limit}")) == limit
    with pytest.raises(DeviceError, match=rf"asks for {limit + 1} cpu devices, but at most "
                                          rf"{limit} cpu devices here"):
        parse_devices(f"cpu:{limit + 1}")
    with pytest.raises(DeviceError, match=rf"asks for cpu:{limit}, but at most {limit}"):
        parse_devices(f"cpu:0,cpu:{limit}")
    monkeypatch.setattr("fuelspmd.backend.cuda_device_count", lambda: 2)
    assert [str(d) for d in parse_devices("cuda:1,")] == ["cuda:1"]
    assert [str(d) for d in parse_devices("cuda:2")] == ["cuda:0", "cuda:1"]
    with pytest.raises(DeviceError, match=r"asks for 3 cuda devices, but cupy sees 2 GPU\(s\), "
                                          r"cuda:0 \.\. cuda:1"):
        parse_devices("cuda:3")
    with pytest.raises(DeviceError, match=r"asks for cuda:2, but cupy sees 2"):
        parse_devices("cuda:0,cuda:2")
    monkeypatch.setattr("fuelspmd.backend.cuda_device_count", lambda: 0)
    with pytest.raises(DeviceError, match=r"cupy sees no GPU .*pip install -e '\.\[gpu\]'"):
        parse_devices("cuda:1")


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
def test_sixteen_bit_collectives_at_every_threshold(dt: str) -> None:
    """float16 and bfloat16 through every collective, alone and bucketed, at sizes past
    each threshold of the path (spare buffers, buckets): exact results."""
    n = 3
    group = DeviceGroup.cpu(n, timeout=TIMEOUT)
    for nbytes in P.SIXTEEN_BIT_BYTES:
        outs = group.run(P.sixteen_bit, [P.sixteen_bit_input(r, n, dt, nbytes)
                                         for r in range(n)])
        for got, want in zip(outs, P.sixteen_bit_reference(n, dt, nbytes)):
            assert got.keys() == want.keys()
            for k in want:
                assert got[k].dtype == want[k].dtype, k
                np.testing.assert_array_equal(got[k], want[k], err_msg=f"{nbytes} B {k}")
