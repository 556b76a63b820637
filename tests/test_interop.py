"""DLPack interop: zero-copy both ways, dtypes, refusal of host arrays, stream ordering."""
import subprocess
import sys

import numpy as np
import pytest

import cupaged
from cupaged import interop
from cupaged.core.arrays import accepts_dlpack, bfloat16


class HostDLPack:
    """A DLPack exporter on the CPU (device type 1), like a torch CPU tensor."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__()

    def __dlpack_device__(self):
        return (1, 0)


# ----------------------------------------------------------------------------- CPU
def _imported_after(code):
    probe = f"import sys; {code}; print(' '.join(m for m in ('torch', 'cupy', 'jax') if m in sys.modules))"
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout.split()


def test_import_cupaged_imports_no_framework():
    assert _imported_after("import cupaged, cupaged.interop") == []


def test_public_names_import_no_framework():
    # every module behind cupaged's public names loads without torch or cupy
    code = ("import cupaged\n"
            "for n in cupaged.__all__:\n"
            "    try: getattr(cupaged, n)\n"
            "    except ModuleNotFoundError as e:\n"
            "        if not (e.name or '').startswith('cupaged'): raise")
    assert _imported_after(code) == []


def test_as_cupy_refuses_host_dlpack_object():
    with pytest.raises(TypeError, match="CUDA array.*device CPU"):
        interop.as_cupy(HostDLPack(np.ones(4, np.float32)))


def test_as_cupy_refuses_numpy_and_plain_objects():
    with pytest.raises(TypeError, match="numpy.ndarray"):
        interop.as_cupy(np.ones(4, np.float32))
    with pytest.raises(TypeError, match="__dlpack__"):
        interop.as_cupy([1.0, 2.0])


def test_to_framework_refuses_host_arrays():
    with pytest.raises(TypeError, match="y: expected a cupy.ndarray"):
        interop.to_framework(np.ones(3), like=np.ones(3))


def test_caller_stream_is_a_no_op_for_host_arrays():
    with interop.caller_stream(np.ones(3)) as s:
        assert s is None


# ----------------------------------------------------------------------------- GPU: torch
@accepts_dlpack
def _double(x):
    """A public-op stand-in: records the CuPy stream it ran on."""
    import cupy
    _double.stream = cupy.cuda.get_current_stream().ptr
    return x * 2


def _torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_torch_zero_copy_both_ways(cp, dtype):
    torch = _torch()
    t = torch.randn(37, 5, 64, device="cuda").to(getattr(torch, dtype))
    x = interop.as_cupy(t)
    assert isinstance(x, cp.ndarray) and x.data.ptr == t.data_ptr()
    assert x.dtype == (bfloat16 if dtype == "bfloat16" else np.dtype(dtype))
    assert x.shape == tuple(t.shape)
    np.testing.assert_array_equal(x.get().astype(np.float32), t.float().cpu().numpy())
    y = cp.asarray(x * 3)
    back = interop.to_framework(y, like=t)
    assert isinstance(back, torch.Tensor) and back.data_ptr() == y.data.ptr
    assert back.dtype == t.dtype
    x[0, 0, 0] = 7  # writes through the shared memory
    torch.cuda.synchronize()
    assert float(t[0, 0, 0]) == 7


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_work_ordered_on_caller_stream(dtype):
    torch = _torch()
    n = 1 << 20
    side = torch.cuda.Stream()
    assert side.cuda_stream != torch.cuda.default_stream().cuda_stream
    with torch.cuda.stream(side):
        x = torch.empty(n, device="cuda", dtype=getattr(torch, dtype))
        torch.cuda._sleep(20_000_000)  # keep the stream busy so a reorder would show
        x.fill_(3)
        y = _double(x)                  # decorated op: torch in, torch out
        total = y.float().sum()
    torch.cuda.synchronize()
    assert _double.stream == side.cuda_stream
    assert isinstance(y, torch.Tensor) and y.dtype == x.dtype
    assert float(total) == 6.0 * n


@pytest.mark.gpu
def test_caller_stream_orders_cupy_code_behind_torch():
    torch = _torch()
    n = 1 << 20
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = torch.empty(n, device="cuda", dtype=torch.float16)
        torch.cuda._sleep(20_000_000)
        x.fill_(2)
        with interop.caller_stream(x) as s:
            assert s.ptr == side.cuda_stream
            y = interop.to_framework(interop.as_cupy(x) + 1, like=x)
        total = y.float().sum()
    torch.cuda.synchronize()
    assert float(total) == 3.0 * n


# ----------------------------------------------------------------------------- GPU: JAX
def _jax_gpu():
    jax = pytest.importorskip("jax")
    try:
        return jax, jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX has no GPU backend")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_jax_zero_copy_both_ways(cp, rng, dtype):
    jax, dev = _jax_gpu()
    host = rng.standard_normal((29, 3, 64), dtype=np.float32).astype(
        bfloat16 if dtype == "bfloat16" else dtype)
    a = jax.device_put(host, dev)
    x = interop.as_cupy(a)
    assert isinstance(x, cp.ndarray) and x.data.ptr == a.unsafe_buffer_pointer()
    np.testing.assert_array_equal(x.get().astype(np.float32), host.astype(np.float32))
    y = x * 2
    back = interop.to_framework(y, like=a)
    assert isinstance(back, jax.Array) and back.unsafe_buffer_pointer() == y.data.ptr
    np.testing.assert_array_equal(np.asarray(back).astype(np.float32),
                                  2 * host.astype(np.float32))


@pytest.mark.gpu
def test_jax_arrays_through_ops_twice(cp, rng):
    """Ops on JAX GPU arrays that JAX has just computed (queued on its own stream): the
    checked first call and the cached second one both read them after JAX wrote them, and
    hand back JAX arrays."""
    jax, dev = _jax_gpu()
    import jax.numpy as jnp
    from cupaged.reference import attention as ref
    hq, hk, d, bs = 8, 2, 64, 16
    lens = np.array([37, 5, 70], np.int32)
    tables = np.arange(15, dtype=np.int32).reshape(3, 5)
    kc = rng.standard_normal((15, bs, hk, d), dtype=np.float32).astype(np.float16)
    vc = rng.standard_normal((15, bs, hk, d), dtype=np.float32).astype(np.float16)
    q = rng.standard_normal((3, hq, d), dtype=np.float32).astype(np.float16)
    want = ref.paged_decode(q, kc, vc, tables, lens)
    put = lambda a: jax.device_put(a, dev)
    jk, jv, jt, jl = put(kc), put(vc), put(tables), put(lens)
    for step in range(3):
        jq = put(q / 2) * 2  # computed by JAX just before the call
        got = cupaged.paged_decode(jq, jk, jv, jt, jl)
        assert isinstance(got, jax.Array) and got.shape == q.shape
        np.testing.assert_allclose(np.asarray(got).astype(np.float32), want, rtol=2e-2, atol=2e-2)
