"""Pool.close() and Region.free() racing other threads' calls on the same
object. ctypes releases the GIL in a foreign call, so a call that passed the
liveness check runs in the library while another thread closes or frees the
handle it uses: close()/free() must wait for such calls, and a call arriving
afterwards must raise KvtierError("this Pool was closed" / "this Region was
freed"), never read freed memory. A use after free crashes the interpreter,
so each scenario runs in a child process: a crash fails the test instead of
killing pytest."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

# argv: scenario ("pool" or "region"), seconds. Prints "ok ROUNDS CALLS
# REFUSED", else (after running all rounds) the first unexpected errors and
# exits 1; a use after free dies by a signal.
SCRIPT = r'''
import random, sys, threading, time
from kvtier import KvtierError, Layout, Pool, device_bytes_for

scenario, seconds = sys.argv[1], float(sys.argv[2])
LAYOUT = Layout(64, 2, 16)
REGIONS = 12
DEVICE = f"anon:{device_bytes_for(LAYOUT, REGIONS)}"
CLOSED, FREED = "this Pool was closed", "this Region was freed"
bad, counts, lock = [], [0, 0, 0], threading.Lock()


def note(calls, refused, error=None):
    with lock:
        counts[0] += calls
        counts[1] += refused
        if error is not None:
            counts[2] += 1
            if len(bad) < 10:
                bad.append(f"{type(error).__name__}: {error}")


def pool_worker(pool, start, kind):
    calls = refused = 0
    start.wait()
    region = None
    try:
        while True:
            try:
                if kind == "info":
                    pool.info()
                else:
                    region = pool.alloc_region(request=calls)
                    region.publish()
                    pool.info()
                    region.free()
                    region = None
                calls += 1
            except KvtierError as e:
                if str(e) == CLOSED:
                    refused += 1
                    break
                raise
    except BaseException as e:
        note(calls, refused, e)
        return
    finally:
        if region is not None:
            region.free()
    note(calls, refused)


def region_worker(regions, start):
    # Each region is published once (publishing is a one-way transition), by
    # one worker, racing the freers.
    calls = refused = 0
    start.wait()
    try:
        for r in regions:
            try:
                r.publish()
                calls += 1
            except KvtierError as e:
                if str(e) != FREED:
                    raise
                refused += 1
    except BaseException as e:
        note(calls, refused, e)
        return
    note(calls, refused)


def refused_after(call, message, what):
    """`call` must raise KvtierError(message) now that the object is gone."""
    try:
        call()
        note(0, 0, AssertionError(f"{what} did not raise"))
    except KvtierError as e:
        if str(e) != message:
            note(0, 0, e)


def closer(close, start, delay=2e-4):
    start.wait()
    time.sleep(random.random() * delay)
    try:
        close()
    except BaseException as e:
        note(0, 0, e)


def pool_round():
    pool = Pool.create(LAYOUT, [DEVICE])
    start = threading.Barrier(6)
    threads = [threading.Thread(target=pool_worker, args=(pool, start, k)) for k in ("info", "alloc", "alloc", "alloc")]
    threads += [threading.Thread(target=closer, args=(pool.close, start)) for _ in range(2)]  # two closers
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    refused_after(pool.info, CLOSED, "info() after close()")


def region_round():
    pool = Pool.create(LAYOUT, [DEVICE])
    regions = [pool.alloc_region() for _ in range(REGIONS)]
    pool.close()  # the regions keep the pool's memory mapped until the last is freed
    shuffled = random.sample(regions, len(regions))
    start = threading.Barrier(5)
    threads = [threading.Thread(target=region_worker, args=(shuffled[i::3], start)) for i in range(3)]

    def free_all(order):
        for r in order:
            r.free()

    # two freers, in opposite orders
    for order in (regions, regions[::-1]):
        threads.append(threading.Thread(target=closer, args=(lambda o=order: free_all(o), start, 5e-5)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in regions:
        refused_after(r.publish, FREED, "publish() after free()")


rounds = {"pool": pool_round, "region": region_round}[scenario]
deadline = time.monotonic() + seconds
n = 0
while time.monotonic() < deadline:
    rounds()
    n += 1
if bad:
    print(f"{counts[2]} unexpected errors in {n} rounds, the first:")
    print("\n".join(bad))
    sys.exit(1)
print(f"ok {n} {counts[0]} {counts[1]}")
'''


def run_scenario(scenario: str, seconds: float) -> str:
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, scenario, str(seconds)],
        capture_output=True,
        text=True,
        timeout=seconds + 60,
    )
    if run.returncode < 0:
        pytest.fail(
            f"the child died by {signal.Signals(-run.returncode).name} (a use after free):\n{run.stdout}{run.stderr}"
        )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("ok "), run.stdout + run.stderr
    return run.stdout


def check_rounds(out: str):
    _, rounds, calls, refused = out.split()
    assert int(rounds) > 50 and int(calls) > 0 and int(refused) > 0, out


SECONDS = float(os.environ.get("KVTIER_THREAD_TEST_SECONDS", "4"))


def test_close_waits_for_calls_in_flight_on_the_pool():
    """Threads calling info(), alloc_region(), Region.publish() and free()
    while two others close the pool: every call succeeds or raises "this Pool
    was closed", and the process never crashes."""
    check_rounds(run_scenario("pool", SECONDS))


def test_free_waits_for_publish_in_flight_on_the_region():
    """Threads publishing regions while two others free them: every publish
    succeeds or raises "this Region was freed", and a region is freed once."""
    check_rounds(run_scenario("region", SECONDS))


def test_calls_after_close_and_free_raise_cleanly():
    from kvtier import KvtierError, Layout, Pool, device_bytes_for

    layout = Layout(64, 2, 16)
    pool = Pool.create(layout, [f"anon:{device_bytes_for(layout, 2)}"])
    region = pool.alloc_region()
    region.free()
    region.free()  # a second free is a no-op
    with pytest.raises(KvtierError, match="this Region was freed"):
        region.publish()
    pool.close()
    pool.close()
    with pytest.raises(KvtierError, match="this Pool was closed"):
        pool.info()
    with pytest.raises(KvtierError, match="this Pool was closed"):
        pool.alloc_region()


def test_close_after_threads_finished_does_not_wait():
    """The in-flight count returns to zero after many threads' calls, so a
    later close() returns at once."""
    import threading

    from kvtier import Layout, Pool, device_bytes_for

    layout = Layout(64, 2, 16)
    pool = Pool.create(layout, [f"anon:{device_bytes_for(layout, 2)}"])
    errors = []

    def hammer():
        try:
            for _ in range(2000):
                pool.info()
        except BaseException as e:  # pragma: no cover
            errors.append(e)

    ts = [threading.Thread(target=hammer) for _ in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    t0 = time.monotonic()
    pool.close()
    assert time.monotonic() - t0 < 1.0


FORK_SCRIPT = r'''
import os, signal, sys, threading
from kvtier import KvtierError, Layout, Pool, device_bytes_for

layout = Layout(64, 2, 16)
pool = Pool.create(layout, [f"anon:{device_bytes_for(layout, 2)}"])
stop = False


def hammer():
    while not stop:
        pool.info()


t = threading.Thread(target=hammer)
t.start()
hung = 0
for _ in range(40):
    pid = os.fork()
    if pid == 0:
        # The hammering thread is gone here; a call it had in flight (or the
        # lock it held) at the fork must not make close() wait for it.
        signal.alarm(3)
        try:
            pool.close()
            pool.info()
        except KvtierError as e:
            os._exit(0 if str(e) == "this Pool was closed" else 3)
        os._exit(4)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        hung += 1
        print("child status", status)
        break
stop = True
t.join()
pool.close()
print("hung", hung)
sys.exit(1 if hung else 0)
'''


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_can_close_a_pool_in_use_by_the_parents_threads():
    """A child forked while another thread of the parent is inside a call on
    the pool does not wait for that call (the thread does not exist in the
    child): close() returns, and later calls raise."""
    run = subprocess.run([sys.executable, "-c", FORK_SCRIPT], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
