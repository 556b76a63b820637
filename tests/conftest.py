import fcntl
import os
import tempfile
import time
import zlib

# pytest-xdist workers: one BLAS thread each (set before NumPy loads OpenBLAS), or every
# worker's reference matmuls start a thread per core and the workers thrash the CPUs.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from cupaged.core.arrays import gpu_available  # noqa: E402

# JAX (the interop tests) would otherwise claim 75% of the GPU when first used and hold it
# for the worker's lifetime, starving the other pytest-xdist workers' large tests.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run part I of N (1-based) of the collected tests, each test's part "
                          "fixed by its node id: the GPU suite in N device calls (1/2, then 2/2)")
    parser.addoption("--skip-done", default=None, metavar="FILE",
                     help="deselect the tests whose node ids are lines of FILE (those a "
                          "previous call passed): a suite resumed where a call stopped")


def _shard(config, items):
    """Keep part I of N of ``items`` (``--shard I/N``), the rest reported deselected."""
    spec = config.getoption("--shard")
    if spec is None:
        return
    try:
        part, parts = (int(x) for x in spec.split("/"))
    except ValueError:
        part = parts = 0
    if not 1 <= part <= parts:
        raise pytest.UsageError(f"--shard: expected I/N with 1 <= I <= N, got {spec!r}")
    mine = [_shard_of(item, parts) == part - 1 for item in items]
    config.hook.pytest_deselected(items=[item for item, m in zip(items, mine) if not m])
    items[:] = [item for item, m in zip(items, mine) if m]


def _shard_of(item, parts):
    """The shard of a test by its node id's CRC-32: a test keeps its shard when others are
    added or removed, so the two halves of a suite run at two commits still cover it."""
    return zlib.crc32(getattr(item, "nodeid", str(item)).encode()) % parts


def _skip_done(config, items):
    """Deselect the tests listed in ``--skip-done FILE`` (one node id a line)."""
    path = config.getoption("--skip-done")
    if path is None:
        return
    with open(path) as f:
        done = {line.strip() for line in f if line.strip()}
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid in done])
    items[:] = [item for item in items if item.nodeid not in done]


def pytest_collection_modifyitems(config, items):
    _shard(config, items)
    _skip_done(config, items)
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a usable CUDA device (CuPy sees none)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# $CUPAGED_TEST_TIMELINE (a file): every process (each xdist worker, or the one process)
# appends "<unix time> <process> <event> <node id>" lines to it (whole lines by O_APPEND),
# events the session's start, collection's end and each test's start, end and pass, so that
# a suite's wall time can be laid against its workers' busy time, and a suite stopped by a
# call's limit resumed with --skip-done (scripts/suite_timeline.py).
_TIMELINE = os.environ.get("CUPAGED_TEST_TIMELINE")


def _timeline(event, nodeid=""):
    if _TIMELINE:
        name = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(_TIMELINE, "a") as f:
            f.write(f"{time.time():.3f} {name} {event} {nodeid}\n")


def pytest_sessionstart(session):
    _timeline("session")


def pytest_collection_finish(session):
    _timeline("collected")


def pytest_runtest_logstart(nodeid, location):
    _timeline("start", nodeid)


def pytest_runtest_logfinish(nodeid, location):
    _timeline("end", nodeid)


def pytest_runtest_logreport(report):
    if report.when == "call" and report.passed:
        _timeline("passed", report.nodeid)


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test id so failures reproduce."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)


@pytest.fixture
def cp():
    import cupy
    return cupy


@pytest.fixture(autouse=True)
def _release_gpu_memory(request):
    """Hand pooled device memory back after each GPU test, so tests that allocate several
    GB (caches past 2**31 elements) do not starve the next ones or parallel workers."""
    yield
    if "gpu" not in request.keywords:
        return
    import sys
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        cupy.get_default_memory_pool().free_all_blocks()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _one_bigmem_test_at_a_time(request):
    """Tests marked ``bigmem`` (several GB of device memory each) hold an exclusive lock
    shared by every pytest-xdist worker, so that parallel workers never stack them."""
    if "bigmem" not in request.keywords:
        yield
        return
    path = os.path.join(tempfile.gettempdir(), "cupaged-tests-bigmem.lock")
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
