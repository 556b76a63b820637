"""TMA tensor maps (core.tma): the geometry of ragged K/V maps, the refusals, and the
driver-less error. CPU only; the maps' use is tested on an sm_90 device in test_prefill.py
(test_gpu_tma_*)."""
import numpy as np
import pytest

from cupaged.core import tma
from cupaged.core.layouts import layout_strides
from cupaged.prefill import plan as plan_


@pytest.mark.parametrize("head_dim", tma.HEAD_DIMS)
def test_ragged_geometry_boxes_one_column_block_of_a_tile(head_dim):
    geo = tma.ragged_kv_geometry(1000, 8, head_dim, 8 * head_dim, head_dim, 128)
    assert geo.dims == (head_dim, 1000, 8)
    assert geo.strides == (2 * 8 * head_dim, 2 * head_dim)
    assert geo.box == (64, 128, 1)  # 128 rows x 128 bytes: one swizzled column block
    assert head_dim // geo.box[0] * geo.box[0] * geo.box[1] * 2 == 128 * head_dim * 2


@pytest.mark.parametrize("args, match", [
    ((10, 2, 96, 192, 96, 128), "head_dim"),
    ((10, 2, 128, 260, 128, 128), "multiples of 16"),
    ((10, 2, 128, 256, 128, 512), "block_n"),
    ((0, 2, 128, 256, 128, 128), "total_k"),
])
def test_ragged_geometry_refuses_what_tma_cannot_copy(args, match):
    with pytest.raises(ValueError, match=match):
        tma.ragged_kv_geometry(*args)


def test_maps_need_contiguous_dims_and_no_keys_need_no_driver():
    strides = layout_strides("ragged", 1, 2, 128, 2)
    empty = tma.RaggedMaps(0, 2, 128, strides, 128)
    assert empty(0, 0) == (bytes(128), bytes(128))
    with pytest.raises(ValueError, match="contiguous"):
        tma.RaggedMaps(10, 2, 128, strides._replace(v_dim=2), 128)


def test_encode_names_the_driver_or_the_misaligned_address():
    geo = tma.ragged_kv_geometry(16, 1, 64, 64, 64, 128)
    with pytest.raises(ValueError, match="16-byte aligned"):
        tma.encode(8, geo)
    try:
        tma._driver()
    except RuntimeError as e:  # no CUDA driver here
        assert "libcuda.so.1" in str(e)
        with pytest.raises(RuntimeError, match="CUDA 12 driver"):
            tma.encode(256, geo)


@pytest.mark.parametrize("tile, head_dim, paged, match", [
    (plan_.tma_tile(128), 128, True, "ragged"),
    (plan_.tma_tile(128), 96, False, "head_dim"),
    (plan_.tma_tile(64)._replace(ws=False), 64, False, "warp-specialised"),
])
def test_tma_tiles_refuse_calls_they_cannot_run(tile, head_dim, paged, match):
    with pytest.raises(ValueError, match=match):
        plan_.check_tma(tile, head_dim, paged)
    plan_.check_tma(plan_.wgmma_tile(head_dim), head_dim, paged)  # not tma: nothing to refuse


def test_tma_specs_are_hopper_only():
    from cupaged.prefill import launch
    specs = [s for s in launch.kernel_specializations() if "prefill_ws_tma_kernel" in s.expr]
    assert len(specs) == 2 * len(plan_.TMA_HEAD_DIMS) * 2 and all(s.hopper for s in specs)


def test_ragged_default_takes_tma_where_it_fits():
    """The ragged default is the TMA tile for 16-bit K/V of the TMA head sizes with
    strides a tensor map takes; paged calls, fp8, other head sizes and odd strides stay on
    the cp.async producer; the mma.sync tile never has one."""
    for d in plan_.WGMMA_HEAD_DIMS:
        strides = layout_strides("ragged", 1, 4, d, 2)
        tile = plan_.wgmma_tile(d, ragged=(1000, strides))
        assert tile.tma == (d in plan_.TMA_HEAD_DIMS)
        assert tile.tma or tile == plan_.wgmma_tile(d)
        if tile.tma:
            assert tile == plan_.tma_tile(d) and tile.stages == plan_.TMA_STAGES
            assert tile.block_m == plan_.default_tile(d).block_m  # one work list
    strides = layout_strides("ragged", 1, 4, 128, 2)
    assert not plan_.wgmma_tile(128).tma  # paged (no ragged geometry)
    assert not plan_.wgmma_tile(128, "fp8_e4m3", ragged=(1000, strides)).tma
    assert not plan_.wgmma_tile(128, ragged=(2**31, strides)).tma
    assert not plan_.wgmma_tile(128, ragged=(1000, strides._replace(k_tok=4 * 128 + 4))).tma
    assert not plan_.wgmma_tile(128, ragged=(1000, strides._replace(v_dim=2))).tma
    assert not plan_.default_tile(128).tma and not plan_.launch_tile(np.float16, 128).tma
