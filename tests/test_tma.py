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
    geo = tma.kv_geometry(head_dim, 8, 8 * head_dim, head_dim, 8 * head_dim * 1000, 1000, 1, 128)
    assert geo.dims == (head_dim, 1000, 8, 1)
    assert geo.strides == (2 * 8 * head_dim, 2 * head_dim, 2 * 8 * head_dim * 1000)
    assert geo.box == (64, 128, 1, 1)  # 128 rows x 128 bytes: one swizzled column block
    assert head_dim // geo.box[0] * geo.box[0] * geo.box[1] * 2 == 128 * head_dim * 2


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("block_size, rows", [(8, 8), (16, 16), (128, 128), (256, 128)])
def test_paged_maps_box_a_blocks_part_of_a_tile(layout, block_size, rows):
    """An NHD or HND cache: dims (dim, key in block, head, block) with the layout's strides,
    boxes of a cache block's part of a 128-key tile."""
    strides = layout_strides(layout, block_size, 4, 128, 2)
    maps = tma.KVMaps(4, 128, strides, 128, block_size=block_size, num_blocks=50)
    for geo, tok, head, blk in zip(maps._geo, (strides.k_tok, strides.v_tok),
                                   (strides.k_head, strides.v_head), (strides.k_block, strides.v_block)):
        assert geo.dims == (128, block_size, 4, 50)
        assert geo.strides == (2 * tok, 2 * head, 2 * blk)
        assert geo.box == (64, rows, 1, 1)
    assert strides.k_block == block_size * 4 * 128
    assert (strides.k_tok, strides.k_head) == ((4 * 128, 128) if layout == "NHD" else (128, block_size * 128))


@pytest.mark.parametrize("args, match", [
    ((96, 2, 192, 96, 1920, 10, 1, 128), "head_dim"),
    ((128, 2, 260, 128, 2600, 10, 1, 128), "multiples of 16"),
    ((128, 2, 256, 128, 2560, 10, 1, 512), "rows"),
    ((128, 2, 256, 128, 2560, 10, 1, 4), "rows"),
    ((128, 2, 256, 128, 2560, 0, 1, 128), "keys"),
])
def test_geometry_refuses_what_tma_cannot_copy(args, match):
    with pytest.raises(ValueError, match=match):
        tma.kv_geometry(*args)


def test_maps_need_contiguous_dims_and_no_keys_need_no_driver():
    strides = layout_strides("ragged", 1, 2, 128, 2)
    empty = tma.KVMaps(2, 128, strides, 128, total_k=0)
    assert empty(0, 0) == (bytes(128), bytes(128))
    with pytest.raises(ValueError, match="contiguous"):
        tma.KVMaps(2, 128, strides._replace(v_dim=2), 128, total_k=10)


def test_encode_names_the_driver_or_the_misaligned_address():
    geo = tma.kv_geometry(64, 1, 64, 64, 64 * 16, 16, 1, 128)
    with pytest.raises(ValueError, match="16-byte aligned"):
        tma.encode(8, geo)
    try:
        tma._driver()
    except RuntimeError as e:  # no CUDA driver here
        assert "libcuda.so.1" in str(e)
        with pytest.raises(RuntimeError, match="CUDA 12 driver"):
            tma.encode(256, geo)


_RAGGED = plan_.TmaGeometry(layout_strides("ragged", 1, 4, 128, 2), total_k=100)
_VLLM = plan_.TmaGeometry(layout_strides("vllm", 16, 4, 128, 2), block_size=16, num_blocks=9)


@pytest.mark.parametrize("tile, head_dim, kv, geometry, match", [
    (plan_.tma_tile(128), 96, None, _RAGGED, "head_dim"),
    (plan_.tma_tile(64)._replace(ws=False), 64, None, _RAGGED, "warp-specialised"),
    (plan_.tma_tile(128), 128, "fp8_e4m3", _RAGGED, "got kv fp8_e4m3"),
    (plan_.tma_tile(128), 128, None, _VLLM, "contiguous dims"),
])
def test_tma_tiles_refuse_calls_they_cannot_run(tile, head_dim, kv, geometry, match):
    with pytest.raises(ValueError, match=match):
        plan_.check_tma(tile, head_dim, kv, geometry)
    # not tma: nothing to refuse
    plan_.check_tma(plan_.wgmma_tile(head_dim), head_dim, kv, geometry)
    plan_.check_tma(plan_.tma_tile(128), 128, None, _RAGGED)  # fits


def test_tma_specs_are_hopper_only():
    from cupaged.prefill import launch
    specs = [s for s in launch.kernel_specializations() if "prefill_ws_tma_kernel" in s.expr]
    # (16-bit, each fp8 format) x q dtypes x head dims x score paths
    assert len(specs) == 3 * 2 * len(plan_.TMA_HEAD_DIMS) * 2 and all(s.hopper for s in specs)


def test_default_takes_tma_where_it_fits():
    """The default is the TMA tile for 16-bit K/V of the TMA head sizes, ragged or in NHD
    and HND caches of block sizes of whole 8 keys dividing the tile or multiples of it, with
    strides a tensor map takes; the vllm layout, fp8, other head sizes, block sizes and odd
    strides stay on the cp.async producer; the mma.sync tile never has one."""
    geo = plan_.TmaGeometry
    for d in plan_.WGMMA_HEAD_DIMS:
        tile = plan_.wgmma_tile(d, geometry=geo(layout_strides("ragged", 1, 4, d, 2), total_k=1000))
        assert tile.tma == (d in plan_.TMA_HEAD_DIMS)
        assert tile.tma or tile == plan_.wgmma_tile(d)
        if tile.tma:
            assert tile == plan_.tma_tile(d) and tile.stages == plan_.TMA_STAGES
            assert tile.block_m == plan_.default_tile(d).block_m  # one work list
    strides = layout_strides("ragged", 1, 4, 128, 2)
    assert not plan_.wgmma_tile(128).tma  # geometry unknown
    assert not plan_.wgmma_tile(128, "fp8_e4m3", geometry=geo(strides, total_k=1000)).tma
    assert not plan_.wgmma_tile(128, geometry=geo(strides, total_k=2**31)).tma
    assert not plan_.wgmma_tile(128, geometry=geo(strides._replace(k_tok=4 * 128 + 4), total_k=9)).tma
    assert not plan_.wgmma_tile(128, geometry=geo(strides._replace(v_dim=2), total_k=9)).tma
    for layout in ("NHD", "HND", "vllm"):
        for bs in (1, 4, 8, 16, 24, 128, 256, 384):
            cache = layout_strides(layout, bs, 4, 128, 2)
            want = layout != "vllm" and bs % 8 == 0 and (128 % bs == 0 or bs % 128 == 0)
            got = plan_.tma_fits(128, None, geo(cache, block_size=bs, num_blocks=100))
            assert got == want, (layout, bs)
    nhd = layout_strides("NHD", 16, 4, 128, 2)
    assert not plan_.tma_fits(128, None, geo(nhd, block_size=16, num_blocks=2**31))
    assert not plan_.default_tile(128).tma and not plan_.launch_tile(np.float16, 128).tma
