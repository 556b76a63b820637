"""Cache ops: reference vs an element-by-element oracle, public ops on NumPy and CuPy."""
import numpy as np
import pytest

from cupaged.layouts import LAYOUTS, cache_shapes, k_as_nhd, v_as_nhd
from cupaged.reference import cache as ref


def _rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


def _slots(rng, num_tokens, num_slots, skip=0.2):
    """Distinct random slots with a fraction of -1 (skipped tokens)."""
    s = rng.choice(num_slots, size=num_tokens, replace=False).astype(np.int64)
    s[rng.random(num_tokens) < skip] = -1
    return s


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_reference_write_matches_loop(rng, layout, dtype):
    nb, bs, hk, d, t = 5, 4, 3, 16, 11
    ks, vs = cache_shapes(layout, nb, bs, hk, d, dtype)
    k, v = _rand(rng, ks, dtype), _rand(rng, vs, dtype)
    k0, v0 = k.copy(), v.copy()
    key, value = _rand(rng, (t, hk, d), dtype), _rand(rng, (t, hk, d), dtype)
    slots = _slots(rng, t, nb * bs)
    ref.write_kv_cache(key, value, k, v, slots, layout)
    want_k, want_v = k_as_nhd(k0, layout).copy(), v_as_nhd(v0, layout).copy()
    for i, s in enumerate(slots):
        if s >= 0:
            want_k[s // bs, s % bs] = key[i]
            want_v[s // bs, s % bs] = value[i]
    np.testing.assert_array_equal(k_as_nhd(k, layout), want_k)
    np.testing.assert_array_equal(v_as_nhd(v, layout), want_v)
