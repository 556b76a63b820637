"""RoPE: the reference against complex multiplication, the public op on NumPy and CuPy."""
import numpy as np
import pytest

import cupaged
from cupaged.core.arrays import bfloat16
from cupaged.reference import rope as ref

DTYPES = [np.float16, bfloat16, np.float32]
TOL = {np.dtype(np.float16): 2e-3, bfloat16: 1e-2, np.dtype(np.float32): 1e-5}


def rand(rng, shape, dtype=np.float64):
    return rng.standard_normal(shape).astype(dtype)


def complex_rope(x, positions, rotary_dim, base, is_neox, pos_divisor=1.0):
    """Pairs as complex numbers times exp(i p / divisor * base^(-2f/rd)), float64."""
    x = np.asarray(x, np.float64)
    half = rotary_dim // 2
    if is_neox:
        z = x[..., :half] + 1j * x[..., half:rotary_dim]
    else:
        z = x[..., 0:rotary_dim:2] + 1j * x[..., 1:rotary_dim:2]
    f = np.arange(half)
    theta = (np.asarray(positions, np.float64) / pos_divisor)[:, None] * base ** (-2.0 * f / rotary_dim)
    z = z * np.exp(1j * theta)[:, None, :]
    out = x.copy()
    if is_neox:
        out[..., :half], out[..., half:rotary_dim] = z.real, z.imag
    else:
        out[..., 0:rotary_dim:2], out[..., 1:rotary_dim:2] = z.real, z.imag
    return out


def assert_close(actual, expected, dtype):
    tol = TOL[np.dtype(dtype)]
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    np.testing.assert_allclose(a, e, rtol=tol, atol=tol * max(1.0, np.abs(e).max(initial=0)))


# ----------------------------------------------------------------------------- reference
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [64, 32, 10])
def test_reference_is_complex_multiplication(rng, is_neox, rotary_dim):
    pos = rng.integers(0, 5000, size=9)
    q, k = rand(rng, (9, 4, 64)), rand(rng, (9, 2, 64))
    rq, rk = ref.apply_rope(pos, q, k, rotary_dim=rotary_dim, base=500.0, is_neox=is_neox)
    np.testing.assert_allclose(rq, complex_rope(q, pos, rotary_dim, 500.0, is_neox), atol=1e-12)
    np.testing.assert_allclose(rk, complex_rope(k, pos, rotary_dim, 500.0, is_neox), atol=1e-12)
    np.testing.assert_array_equal(rq[..., rotary_dim:], q[..., rotary_dim:])


@pytest.mark.parametrize("is_neox", [True, False])
def test_reference_preserves_norms_and_position_zero(rng, is_neox):
    pos = np.array([0, 1, 77, 4095])
    q, k = rand(rng, (4, 3, 32)), rand(rng, (4, 1, 32))
    rq, rk = ref.apply_rope(pos, q, k, rotary_dim=24, is_neox=is_neox,
                            scaling={"type": "dynamic", "factor": 2.0}, max_position=2048)
    np.testing.assert_allclose(np.linalg.norm(rq, axis=-1), np.linalg.norm(q, axis=-1), rtol=1e-12)
    np.testing.assert_allclose(np.linalg.norm(rk, axis=-1), np.linalg.norm(k, axis=-1), rtol=1e-12)
    np.testing.assert_allclose(rq[0], q[0], atol=1e-15)
    assert not np.allclose(rq[1:], q[1:])


def test_reference_relative_angles(rng):
    """<rope(q, p), rope(k, p')> depends only on p - p'."""
    q, k = rand(rng, (1, 1, 16)), rand(rng, (1, 1, 16))
    dots = []
    for p in (3, 40, 1000):
        rq, _ = ref.apply_rope(np.array([p + 5]), q, k)
        _, rk = ref.apply_rope(np.array([p]), q, k)
        dots.append(float((rq * rk).sum()))
    np.testing.assert_allclose(dots, dots[0], rtol=1e-10)


def test_linear_scaling_divides_positions(rng):
    q, k = rand(rng, (5, 2, 32)), rand(rng, (5, 2, 32))
    pos = np.array([0, 3, 10, 999, 4097])
    scaled = ref.apply_rope(pos, q, k, scaling={"type": "linear", "factor": 4.0})
    np.testing.assert_allclose(scaled[0], complex_rope(q, pos, 32, 10000.0, True, 4.0), atol=1e-12)
    np.testing.assert_allclose(scaled[1], complex_rope(k, pos, 32, 10000.0, True, 4.0), atol=1e-12)


@pytest.mark.parametrize("factor,max_position", [(2.0, 2048), (1.5, 1001), (4.0, 4096)])
def test_dynamic_scaling_grows_base(rng, factor, max_position):
    rd = 48
    q, k = rand(rng, (6, 2, 64)), rand(rng, (6, 1, 64))
    pos = rng.integers(0, int(max_position * factor), size=6)
    length = int(max_position * factor)
    new_base = 10000.0 * (factor * length / max_position - (factor - 1)) ** (rd / (rd - 2))
    rq, rk = ref.apply_rope(pos, q, k, rotary_dim=rd, is_neox=False, max_position=max_position,
                            scaling={"type": "dynamic", "factor": factor})
    np.testing.assert_allclose(rq, complex_rope(q, pos, rd, new_base, False), atol=1e-12)
    np.testing.assert_allclose(rk, complex_rope(k, pos, rd, new_base, False), atol=1e-12)


# ----------------------------------------------------------------------------- public op, NumPy
@pytest.mark.parametrize("dtype", DTYPES)
def test_numpy_path_matches_reference(rng, dtype):
    pos = rng.integers(0, 8000, size=7).astype(np.int32)
    q, k = rand(rng, (7, 4, 64), dtype), rand(rng, (7, 2, 64), dtype)
    q0, k0 = q.copy(), k.copy()
    rq, rk = cupaged.apply_rope(pos, q, k, rotary_dim=32, is_neox=False)
    wq, wk = ref.apply_rope(pos, q, k, rotary_dim=32, is_neox=False)
    assert rq.dtype == dtype and rq.shape == q.shape
    np.testing.assert_array_equal(rq, wq)
    np.testing.assert_array_equal(rk, wk)
    np.testing.assert_array_equal(q, q0)  # inputs untouched by default
    np.testing.assert_array_equal(k, k0)


def test_numpy_flattened_and_inplace(rng):
    pos = np.arange(5, dtype=np.int64) * 100
    q, k = rand(rng, (5, 3 * 64), np.float32), rand(rng, (5, 64), np.float32)
    want_q, want_k = ref.apply_rope(pos, q.reshape(5, 3, 64), k.reshape(5, 1, 64))
    rq, rk = cupaged.apply_rope(pos, q, k, head_dim=64, inplace=True)
    assert rq is q or np.shares_memory(rq, q)
    np.testing.assert_array_equal(q, want_q.reshape(5, 192))
    np.testing.assert_array_equal(k, want_k.reshape(5, 64))
    assert rk.shape == (5, 64)


def test_empty_tokens():
    q, k = np.zeros((0, 2, 64), np.float32), np.zeros((0, 1, 64), np.float32)
    rq, rk = cupaged.apply_rope(np.zeros(0, np.int32), q, k)
    assert rq.shape == (0, 2, 64) and rk.shape == (0, 1, 64)


BAD = [
    (dict(positions=np.zeros(4, np.float32)), TypeError, "positions"),
    (dict(positions=np.array([0, 1, -1, 2], np.int32)), ValueError, "positions"),
    (dict(max_position=8, scaling={"type": "linear", "factor": 2.0},
          positions=np.array([0, 1, 16, 2], np.int32)), ValueError, "positions"),
    (dict(positions=np.zeros(3, np.int32)), ValueError, "q"),
    (dict(rotary_dim=7), ValueError, "rotary_dim"),
    (dict(rotary_dim=128), ValueError, "rotary_dim"),
    (dict(scaling={"type": "yarn", "factor": 2.0}), ValueError, "scaling"),
    (dict(scaling={"factor": 2.0}), ValueError, "scaling"),
    (dict(scaling={"type": "linear", "factor": 0.0}), ValueError, "scaling"),
    (dict(scaling={"type": "dynamic", "factor": 2.0}), ValueError, "max_position"),
    (dict(base=-1.0), ValueError, "base"),
    (dict(k=np.zeros((4, 2, 64), np.float16)), TypeError, "k"),
    (dict(k=np.zeros((4, 2, 32), np.float32)), ValueError, "k"),
    (dict(q=np.zeros((4, 2, 64), np.int32)), TypeError, "q"),
    (dict(q=np.zeros((4, 128), np.float32)), ValueError, "head_dim"),
    (dict(q=np.zeros((4, 64, 2), np.float32).transpose(0, 2, 1)), ValueError, "q"),
    (dict(q=[[0.0]]), TypeError, "numpy.ndarray or cupy.ndarray"),
]


@pytest.mark.parametrize("change,exc,name", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input(change, exc, name):
    args = dict(positions=np.arange(4, dtype=np.int32), q=np.zeros((4, 2, 64), np.float32),
                k=np.zeros((4, 1, 64), np.float32))
    args.update(change)
    kw = {key: args.pop(key) for key in list(args) if key not in ("positions", "q", "k")}
    with pytest.raises(exc, match=name):
        cupaged.apply_rope(args["positions"], args["q"], args["k"], **kw)


# ----------------------------------------------------------------------------- GPU
GPU_CASES = [  # head_dim, rotary_dim, is_neox, scaling, max_position
    (128, None, True, None, None),
    (128, None, False, None, None),
    (128, 32, True, {"type": "linear", "factor": 2.0}, None),
    (64, 20, True, None, None),            # rd/2 = 10: scalar path
    (64, 20, False, None, 4096),           # rd = 20: scalar GPT-J path
    (80, 64, False, {"type": "dynamic", "factor": 4.0}, 2048),
    (256, 64, True, {"type": "dynamic", "factor": 2.0}, 8192),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", GPU_CASES, ids=[str(i) for i in range(len(GPU_CASES))])
def test_gpu_matches_reference(rng, cp, dtype, case):
    d, rd, neox, scaling, max_pos = case
    t, hq, hk = 37, 5, 3
    limit = int(max_pos * (scaling["factor"] if scaling else 1)) if max_pos else 70000
    pos = rng.integers(0, limit, size=t).astype(np.int64 if d == 80 else np.int32)
    q, k = rand(rng, (t, hq, d), dtype), rand(rng, (t, hk, d), dtype)
    kw = dict(rotary_dim=rd, is_neox=neox, scaling=scaling, max_position=max_pos)
    want_q, want_k = cupaged.apply_rope(pos, q, k, **kw)
    got_q, got_k = cupaged.apply_rope(cp.asarray(pos), cp.asarray(q), cp.asarray(k), **kw)
    assert got_q.dtype == dtype and got_q.shape == q.shape
    assert_close(got_q.get(), want_q, dtype)
    assert_close(got_k.get(), want_k, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [bfloat16, np.float32])
@pytest.mark.parametrize("neox,rd", [(True, 64), (False, 64), (True, 20)])
def test_gpu_writes_every_element(rng, cp, dtype, neox, rd):
    """Poisoned outputs: every element (rotated and passed through) must be written."""
    from cupaged.core.launch import current_stream, ptr
    from cupaged.rope.api import _launch, _setup, plan_rope
    t, d = 19, 128
    pos = cp.asarray(rng.integers(0, 3000, size=t), dtype=cp.int32)
    q, k = cp.asarray(rand(rng, (t, 4, d), dtype)), cp.asarray(rand(rng, (t, 2, d), dtype))
    plan, q3, k3 = plan_rope(pos, q, k, rd, 10000.0, neox, None, None, None, cp)
    q_out, k_out = cp.full(q.shape, np.nan, dtype), cp.full(k.shape, np.nan, dtype)
    _launch(_setup(plan, pos, q3, k3, q_out, k_out), *(ptr(a) for a in (pos, q3, k3, q_out, k_out)),
            current_stream())
    want_q, want_k = ref.apply_rope(pos.get(), q.get(), k.get(), rotary_dim=rd, is_neox=neox)
    assert_close(q_out.get(), want_q, dtype)
    assert_close(k_out.get(), want_k, dtype)


@pytest.mark.gpu
def test_gpu_inplace_flattened_misaligned(rng, cp):
    """In place on flattened views whose base is not 16-byte aligned (scalar path)."""
    t, hq, hk, d = 11, 4, 2, 64
    buf = cp.asarray(rand(rng, (1 + t * (hq + hk) * d,), np.float16))
    q = buf[1:1 + t * hq * d].reshape(t, hq * d)
    k = buf[1 + t * hq * d:].reshape(t, hk * d)
    before = float(buf[0])
    pos = cp.asarray(rng.integers(0, 100000, size=t), dtype=cp.int64)
    want_q, want_k = ref.apply_rope(pos.get(), q.get().reshape(t, hq, d), k.get().reshape(t, hk, d))
    rq, rk = cupaged.apply_rope(pos, q, k, head_dim=d, inplace=True)
    assert rq.data.ptr == q.data.ptr
    assert_close(q.get().reshape(t, hq, d), want_q, np.float16)
    assert_close(k.get().reshape(t, hk, d), want_k, np.float16)
    assert float(buf[0]) == before  # the element before q is untouched


@pytest.mark.gpu
def test_gpu_frequencies_are_cached_and_large_positions_exact(cp, rng):
    """The kernel forms angles from float64 frequencies (kept per device and setting), so
    positions far past any table (a million) rotate as precisely as small ones."""
    from cupaged.rope import api as mod
    q, k = cp.asarray(rand(rng, (3, 1, 64), np.float32)), cp.asarray(rand(rng, (3, 1, 64), np.float32))
    kw = dict(base=12345.0)
    cupaged.apply_rope(cp.asarray([1, 5, 9], dtype=cp.int32), q, k, **kw)
    keys = [key for key in mod._FREQUENCIES if key[1] == 12345.0]
    assert len(keys) == 1 and mod._FREQUENCIES[keys[0]].dtype == np.float64
    first = mod._FREQUENCIES[keys[0]]
    pos = np.array([5000, 9, 1_000_003], np.int64)
    got_q, _ = cupaged.apply_rope(cp.asarray(pos), q, k, **kw)
    assert mod._FREQUENCIES[keys[0]] is first
    want_q, _ = ref.apply_rope(pos, q.get(), k.get(), base=12345.0)
    assert_close(got_q.get(), want_q, np.float32)
