"""Host-side planning of paged decode: tile geometry, head layout, cache strides, the work
pieces of each CTA column, the merge, and the packed index upload (argument checks are in
``decode_checks``).

No GPU work here. This module is the one home of the decode kernels' compile-time constants
(``NTHREADS``, ``STAGES``, ``PAGE_WARPS``, ... and the staged kernel's tile, ``stage_tile``):
:func:`cpp` emits them into the generated ``abi.cuh`` that ``kernels_cu/decode.cu`` and
``merge.cu`` include, and the pages kernel takes its tile (``page_tile``) as an argument.
``plan_launch`` fixes a launch's
shape (one persistent CTA per resident slot: ``columns`` x row groups); ``plan_work`` cuts
the sequences' key tiles into pieces for the columns from host copies of the lengths.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..core import abi
from ..core.device import SM90_SMEM_PER_CTA
from ..core.layouts import CacheStrides, layout_strides

NTHREADS = 128
NWARPS = NTHREADS // 32
STAGES = 3
MAX_SPLITS = 256
MAX_CTAS_PER_SM = 4   # beyond this, registers rather than shared memory limit residency
DEFAULT_SMS = 132     # an H200's SMs; used when no device is asked
DEFAULT_SMEM_PER_SM = 228 * 1024
SCHEDULES = ("balanced", "split")  # equal tile shares per column / equal cuts per sequence
MERGES = ("fused", "kernel")       # split pieces merged by their last CTA / by a second kernel
DESC_INTS = 8                      # ints per piece descriptor (decode.cu's Piece: two int4)
BACKENDS = ("auto", "pages", "staged")  # auto; whole blocks by cp.async.bulk (sm_90); cp.async tiles
PAGE_WARPS = 8                     # paged_decode_pages_kernel: its kv heads x token warps
PAGE_THREADS = 32 * PAGE_WARPS
PAGE_STAGES = 3
PAGE_TILE_BYTES = 32 * 1024        # a pages-kernel tile of one operand, unless a block is larger
PAGE_HEAD_DIMS = (64, 96, 128)     # whole 32-dim chunks per lane and row (PageMath)
# fp8 caches: whole 64-dim chunk rounds (PageMath); 256 is left out, its staged kernel
# spills on sm_80 (one 16-byte chunk a lane holds 16 dims' codes, widened to 8 words)
FP8_HEAD_DIMS = (64, 128)
PAGE_MIN_BATCH = 2                 # pages_preferred
MERGE_MAX_WARPS = 16               # merge.cu: warps of a merge_pieces_kernel CTA
PAGE_MIN_KV_HEADS = 4
# Tokens a pipeline stage of the staged kernel holds (Cfg::TILE), by the bytes of one K/V
# row: (most row bytes, tile) in order, None for any longer row.
STAGE_TILES = ((256, 64), (512, 32), (None, 16))
# The constants cpp() emits for the kernels (namespace cupaged::decode of abi.cuh).
KERNEL_CONSTANTS = ("NTHREADS", "NWARPS", "STAGES", "DESC_INTS", "PAGE_WARPS", "PAGE_THREADS",
                    "PAGE_STAGES", "MERGE_MAX_WARPS")
NO_PIECE = (-1, 0, 0, 0, 0, 1, -1, -1)
# "balanced" plans leave the last POOL_FRACTION of each sequence's tiles to a pool of pieces
# that CTAs take at run time once their own list is done: CTAs stream at slightly different
# rates, so fixed equal shares end on the slowest. About POOL_PIECES pieces a column; only
# where a column's fixed share is at least POOL_MIN_SHARE tiles: a pool piece cuts its
# sequence once more, and on short shares its partial rows and merge cost more than the
# spread it saves (benchmarks/NOTES.md, decode v6 pool and v10c).
POOL_FRACTION = 1 / 16
POOL_PIECES = 4
POOL_MIN_SHARE = 128
# "balanced" plans keep every sequence whole (no cut, no merge) where whole sequences dealt
# to the columns (whole_pieces) end no later than WHOLE_SLACK of a column's equal share, or
# WHOLE_SLACK_TILES tiles, after it: short batches then pay no cut and no merge
# (benchmarks/NOTES.md, decode v10c).
WHOLE_SLACK = 1 / 64
WHOLE_SLACK_TILES = 2


def stage_tile(row_bytes) -> int:
    """Tokens a stage of the staged kernel holds for K/V rows of ``row_bytes`` bytes."""
    return next(tile for most, tile in STAGE_TILES if most is None or row_bytes <= most)


def stage_row_pad(itemsize, head_dim) -> int:
    """Elements padding a K/V row of the staged kernel's tiles (Cfg::KROW = head_dim + pad):
    one 16-byte chunk for 16/32-bit caches (ldmatrix's 8 rows then hit 8 bank quads); for
    fp8 caches up to a row of 64 bytes past a multiple of 128, so that the 8 lanes of a
    quarter warp reading 16-byte chunks of two rows (PageMath) hit 8 distinct bank quads."""
    return (192 - head_dim % 128) % 128 if itemsize == 1 else 16 // itemsize


def cpp() -> str:
    """C++ of the decode kernels' constants for ``abi.cuh``: KERNEL_CONSTANTS,
    ``stage_tile(row_bytes)`` from STAGE_TILES and :func:`stage_row_pad`, in namespace
    ``decode``."""
    g = globals()
    lines = ["namespace decode {", abi.constants(None, {name: g[name] for name in KERNEL_CONSTANTS})]
    expr = ""
    for most, tile in STAGE_TILES:
        expr += f"{tile}" if most is None else f"row_bytes <= {most} ? {tile} : "
    lines.append("__host__ __device__ constexpr int stage_tile(int row_bytes) "
                 f"{{ return {expr}; }}")
    lines.append("__host__ __device__ constexpr int stage_row_pad(int itemsize, int head_dim) "
                 "{ return itemsize == 1 ? (192 - head_dim % 128) % 128 : 16 / itemsize; }")
    lines.append("}  // namespace decode")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- plans
class Step(NamedTuple):
    """One plan: host copies and, for device runs, the work plan and its device views."""
    batch: int
    block_tables: object  # int32 [batch, width], host
    seq_lens: object      # int32 [batch], host
    append: bool
    max_block: int        # largest block id the step reads (-1: none)
    work: object          # WorkPlan (device runs) or None
    merge: str            # one of MERGES (None on the NumPy path unless given)
    device: object        # decode.launch._DeviceStep (views of the uploaded indices) or None


def page_kv_heads(num_kv_heads):
    """kv heads one pages-kernel CTA serves: every one up to PAGE_WARPS, else the largest
    divisor of their number up to PAGE_WARPS (a row group each; 8 of MHA's 32)."""
    return max(h for h in range(1, PAGE_WARPS + 1) if num_kv_heads % h == 0)


def page_tile(block_size, num_kv_heads, head_dim, itemsize):
    """Tokens of a pages-kernel tile: whole blocks, at least 16 (an m-tile) for each of the
    ``PAGE_WARPS // page_kv_heads`` warps that split a kv head's tokens (16 with 8 kv heads
    a CTA, 128 with one), twice that for 1-byte (fp8) elements, so that a stage holds about
    as many bytes however few the heads and whatever the element size (the token warps'
    combine needs them); but no more blocks than PAGE_TILE_BYTES of an operand hold (at
    least one)."""
    heads = page_kv_heads(num_kv_heads)
    bs, token_warps = int(block_size), PAGE_WARPS // heads
    cap = PAGE_TILE_BYTES // (bs * heads * head_dim * itemsize)
    rows = 16 * token_warps * max(1, 2 // itemsize)
    return max(1, min(-(-rows // bs), cap)) * bs


def page_smem_bytes(block_size, num_kv_heads, head_dim, itemsize):
    """The pages kernel's ring: PAGE_STAGES tiles of K and of V, of a CTA's kv heads."""
    heads = page_kv_heads(num_kv_heads)
    tile = page_tile(block_size, num_kv_heads, head_dim, itemsize)
    return PAGE_STAGES * 2 * tile * heads * head_dim * itemsize


def pages_capable(compute_capability, itemsize, head_dim, layout, block_size, num_q_heads,
                  num_kv_heads):
    """True where paged_decode_pages_kernel applies: sm_90+, a 16-bit or fp8 (``itemsize``
    1) NHD cache (a block's tokens x kv heads contiguous) with blocks of a multiple or a
    divisor of 16 tokens, or an HND one (kv heads x tokens) with blocks of a multiple of 16
    (an m-tile of 16 tokens then lies in one block, its rows evenly spaced); head_dim
    64/96/128 (fp8: 64/128, whole 64-dim chunk rounds), up to 8 query heads a kv head, and a
    ring of a CTA's kv heads (``page_kv_heads``) that fits in shared memory."""
    blocks_ok = (block_size % 16 == 0 or (layout == "NHD" and 16 % block_size == 0))
    dims_ok = head_dim in PAGE_HEAD_DIMS and (itemsize == 2 or head_dim % 64 == 0)
    return (int(compute_capability) >= 90 and itemsize in (1, 2) and layout in ("NHD", "HND")
            and blocks_ok and dims_ok and num_q_heads // num_kv_heads <= 8
            and page_smem_bytes(block_size, num_kv_heads, head_dim, itemsize) + 1024
            <= SM90_SMEM_PER_CTA)


def pages_preferred(batch, num_kv_heads):
    """Whether the pages kernel is the default over the staged one: from PAGE_MIN_BATCH
    sequences, where its copies are whole blocks (a CTA serves every kv head) or a CTA
    serves at least PAGE_MIN_KV_HEADS kv heads (runs of one token's heads: 2 KB for 8 heads
    at d128, but 256 bytes for one). One sequence alone stays on the staged kernel: its
    fused merge saves the merge kernel's launch where the time is latency (ask for the pages
    kernel with ``backend="pages"``). Depends on the batch, not the lengths, so that a captured graph
    stays valid. The measurements behind the rule: benchmarks/NOTES.md, decode v5, v9c, v9d,
    v10a, v10b.

    Parameters
    ----------
    batch : int
        Sequences of the step.
    num_kv_heads : int
        KV heads of the cache.

    Returns
    -------
    bool
    """
    heads = page_kv_heads(num_kv_heads)
    return batch >= PAGE_MIN_BATCH and (heads == num_kv_heads or heads >= PAGE_MIN_KV_HEADS)


def resolve_backend(backend, compute_capability, itemsize, head_dim, layout, block_size,
                    num_q_heads, num_kv_heads, batch):
    """``True`` for the pages kernel, ``False`` for the staged one. ``backend="auto"``
    takes "pages" where it applies and is the faster (``pages_preferred``); "pages" where it
    does not apply raises."""
    capable = pages_capable(compute_capability, itemsize, head_dim, layout, block_size,
                            num_q_heads, num_kv_heads)
    if backend == "auto":
        return capable and pages_preferred(batch, num_kv_heads)
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "pages" and not capable:
        raise ValueError(
            f"backend: 'pages' needs sm_90+, a 16-bit or fp8 NHD cache with block_size a "
            f"multiple or a divisor of 16 or an HND one with block_size a multiple of 16, "
            f"head_dim in {PAGE_HEAD_DIMS} (fp8: a multiple of 64), at most 8 query heads a kv "
            f"head and a ring that fits in shared memory, got sm_{compute_capability}, "
            f"{8 * itemsize}-bit {layout}, head_dim "
            f"{head_dim}, block_size {block_size}, {num_q_heads}/{num_kv_heads} heads")
    return backend == "pages"


def resolve_merge(merge, launch):
    """``merge`` or, when None, "fused" (the CTA completing a sequence merges it; no second
    launch) unless a row group holds more than ``2 * NWARPS`` query heads: then "kernel",
    whose grid gives every head a warp, where the fused merge would walk 8 heads a warp
    (MQA) one after the other. The pages kernel takes "kernel" whatever its heads: its
    fused merge holds up a CTA's whole stream (benchmarks/NOTES.md, decode v10a)."""
    if merge is not None:
        return merge
    return "kernel" if launch.pages or launch.heads_per_group > 2 * NWARPS else "fused"


def merge_warps_per_head(launch, batch):
    """Warps of merge_pieces_kernel that split one head's pieces: a warp merges up to 16 in
    one L2 round trip, and a sequence has about ``1.5 columns / batch`` pieces (a column's
    share cuts few sequences when they are many; B1 has one or more a column), so the
    smallest power of two, up to MERGE_MAX_WARPS, for 16 pieces a warp. Depends on the
    batch, not the lengths, so that a captured graph stays valid."""
    pieces = 1.5 * launch.columns / max(1, batch)
    warps = 1
    while warps < MERGE_MAX_WARPS and 16 * warps < pieces:
        warps *= 2
    return warps


def merge_launch(launch, batch):
    """``(grid, threads, warps_per_head)`` of merge_pieces_kernel for ``batch`` sequences:
    CTAs of ``max(NWARPS, warps_per_head)`` warps, ``warps / warps_per_head`` query heads
    each."""
    wph = merge_warps_per_head(launch, batch)
    warps = max(NWARPS, wph)
    grid = (batch, launch.row_groups, -(-launch.heads_per_group // (warps // wph)))
    return grid, 32 * warps, wph


class IndexLayout(NamedTuple):
    """Offsets (int32 elements) in a plan's device index buffer: lengths, per-sequence piece
    info (``WorkPlan.seq_info``), descriptors (16-byte aligned) and block tables.

    Every region starts at a fixed offset whatever the batch, so device views keep their
    addresses from plan to plan (captured graphs stay valid) until a capacity grows.
    """
    max_batch: int
    rows: int   # descriptor capacity
    width: int  # block-table row capacity (0: tables not uploaded)

    @property
    def info(self):
        return self.max_batch

    @property
    def desc(self):
        return -(-3 * self.max_batch // 4) * 4

    @property
    def tables(self):
        return self.desc + DESC_INTS * self.rows

    @property
    def size(self):
        return self.tables + self.max_batch * self.width


def pack_index(layout, seq_lens, work, block_tables=None):
    """Host int32 image of an index buffer up to its last used element: lengths, piece
    info, descriptors (spare rows: no piece) and, with ``layout.width``, tables padded
    with -1."""
    batch = len(seq_lens)
    host = np.full(layout.tables + (batch * layout.width if layout.width else 0), -1, np.int32)
    host[:batch] = seq_lens
    host[layout.info:layout.info + 2 * batch] = work.seq_info.ravel()
    host[layout.desc:layout.tables].reshape(layout.rows, DESC_INTS)[:len(work.desc)] = work.desc
    if layout.width:
        host[layout.tables:].reshape(batch, layout.width)[:, :block_tables.shape[1]] = block_tables
    return host


# ----------------------------------------------------------------------------- geometry
class TileConfig(NamedTuple):
    """Compile-time geometry of one decode kernel specialisation."""
    tile: int            # tokens per pipeline stage
    head_tiles: int      # NT: n8 head tiles per warp (template parameter)
    heads_per_warp: int  # 8 * NT
    smem_bytes: int      # dynamic shared memory per CTA


def head_tiles(itemsize, head_dim, group) -> int:
    """NT = 2 (16 query heads a warp) for groups over 8 on 16-bit caches up to d128, else 1."""
    return 2 if itemsize == 2 and head_dim <= 128 and group > 8 else 1


def tile_config(itemsize, head_dim, vllm_v, nt) -> TileConfig:
    """Mirror of ``Cfg<KV, D, NT>`` and the kernel's shared-memory carve-up for caches of
    ``itemsize``-byte elements (1: fp8).

    ``vllm_v``: the value tile is stored transposed (``[D][TILE + VEC]``), as the vllm
    value layout keeps tokens contiguous.
    """
    vec = 16 // itemsize
    tile = stage_tile(head_dim * itemsize)
    k_elems = tile * (head_dim + stage_row_pad(itemsize, head_dim))
    v_elems = head_dim * (tile + vec) if vllm_v else k_elems
    smem = STAGES * (k_elems + v_elems) * itemsize
    if itemsize == 4:  # the CUDA-core path stages each warp's q rows in shared memory
        smem += NWARPS * 8 * nt * (head_dim + 4) * 4
    return TileConfig(tile, nt, 8 * nt, smem)


class HeadLayout(NamedTuple):
    head_warps: int   # warps splitting a CTA's query heads (the rest split its tokens)
    head_chunks: int  # CTAs splitting one kv head's group (groups beyond 4 warps' heads)


def head_layout(group, heads_per_warp) -> HeadLayout:
    warps = -(-group // heads_per_warp)
    head_warps = min(NWARPS, warps)
    return HeadLayout(head_warps, -(-group // (head_warps * heads_per_warp)))


def tile_spans(kv_lens, window_left, tile):
    """First visible key tile and the number of visible tiles per sequence (int64
    ``[batch]`` each) for ``kv_lens`` keys, as the kernel's ``first_visible`` has it."""
    kv = np.asarray(kv_lens, np.int64)
    lo = np.maximum(0, kv - 1 - window_left) if window_left >= 0 else np.zeros_like(kv)
    first = lo // tile
    return first, np.where(kv > 0, -(-kv // tile) - first, 0)


def ctas_per_sm(smem_bytes, smem_per_sm=DEFAULT_SMEM_PER_SM) -> int:
    """Resident CTAs per SM as shared memory allows (1 KB reserved per CTA)."""
    return max(1, min(MAX_CTAS_PER_SM, smem_per_sm // (smem_bytes + 1024)))


def choose_num_splits(ctas, max_tiles, slots) -> int:
    """Splits per (sequence, kv head) of the "split" schedule so that ``slots`` CTAs are
    busy.

    ``ctas`` (sequence, row group) pairs run without splitting and the longest sequence
    spans ``max_tiles`` tiles. With fewer than half the slots busy, split each into about
    ``slots // ctas``, keeping at least ``STAGES - 1`` tiles per split (a CTA's first loads
    all go out at once) and no split of the longest sequence empty.
    """
    if ctas <= 0 or max_tiles <= 0 or 2 * ctas > slots:
        return 1
    splits = max(1, min(slots // ctas, -(-max_tiles // (STAGES - 1)), MAX_SPLITS))
    return int(-(-max_tiles // -(-max_tiles // splits)))


def block_division(block_size):
    """``(magic, shift)`` with ``t // block_size == (t * magic) >> shift`` for ``0 <= t < 2**31``."""
    l = (int(block_size) - 1).bit_length()  # ceil(log2(block_size))
    shift = 31 + l
    return -(-(1 << shift) // int(block_size)), shift


class DecodeLaunch(NamedTuple):
    """Everything one paged-decode launch needs besides the arrays and the work plan."""
    head_dim: int
    num_kv_heads: int
    vllm_v: bool
    tiles: TileConfig
    heads: HeadLayout
    columns: int      # CTA columns (grid.x); each walks a list of pieces
    strides: CacheStrides
    block_size: int
    block_magic: int
    block_shift: int
    pages: bool = False  # paged_decode_pages_kernel: tiles are blocks, groups of <= 8 kv heads
    kv: object = None    # the caches' fp8 format ("fp8_e4m3", "fp8_e5m2"), None: q's dtype

    @property
    def row_groups(self):
        """grid.y: (kv head, head chunk) pairs, or for the pages kernel groups of
        ``head_warps`` kv heads (one of every head up to PAGE_WARPS of them)."""
        if self.pages:
            return self.num_kv_heads // self.heads.head_warps
        return self.num_kv_heads * self.heads.head_chunks

    @property
    def head_major(self):
        """The pages kernel on an HND cache: a kv head's rows of a block lie together."""
        return self.pages and self.strides.k_head > self.strides.k_tok

    @property
    def threads(self):
        """Threads per CTA of the decode kernel."""
        return PAGE_THREADS if self.pages else NTHREADS

    @property
    def merge_kv_heads(self):
        """kv heads as merge_pieces_kernel indexes row groups (for the pages kernel its row
        groups, each as one kv head of all the group's query heads)."""
        return self.row_groups if self.pages else self.num_kv_heads

    @property
    def heads_per_group(self):
        """Query heads a row group (one CTA) serves: the kernel's HPC."""
        return self.heads.head_warps * self.tiles.heads_per_warp

    @property
    def grid(self):
        return (self.columns, self.row_groups)


def plan_launch(*, itemsize, head_dim, layout, block_size, num_q_heads, num_kv_heads,
                slots=None, pages=False, kv=None) -> DecodeLaunch:
    """Choose the kernel specialisation, head layout and grid of a decoder's launches.

    ``itemsize``: bytes of a cache element (1 for an fp8 cache, format ``kv``).

    ``slots``: CTAs resident at once on the device (SMs x CTAs per SM, from the occupancy
    of the specialisation; default an estimate for DEFAULT_SMS SMs from shared memory). The
    grid holds one CTA per slot (``columns = slots // row_groups``, at least 1), whatever
    the lengths.
    ``pages``: the pages kernel (the caller checks ``pages_capable``): tiles are whole
    blocks (``page_tile``), row groups of ``page_kv_heads`` kv heads with all their query
    heads, PAGE_WARPS warps splitting them and their tokens.
    """
    group = num_q_heads // num_kv_heads
    vllm_v = layout == "vllm"
    if pages:
        tiles = TileConfig(page_tile(block_size, num_kv_heads, head_dim, itemsize), 1, group,
                           page_smem_bytes(block_size, num_kv_heads, head_dim, itemsize))
        heads = HeadLayout(page_kv_heads(num_kv_heads), 1)  # kv heads (warps) a row group
    else:
        tiles = tile_config(itemsize, head_dim, vllm_v, head_tiles(itemsize, head_dim, group))
        heads = head_layout(group, tiles.heads_per_warp)
    if slots is None:
        slots = DEFAULT_SMS * ctas_per_sm(tiles.smem_bytes)
    strides = layout_strides(layout, block_size, num_kv_heads, head_dim, itemsize)
    magic, shift = block_division(block_size)
    launch = DecodeLaunch(head_dim, num_kv_heads, vllm_v, tiles, heads, 1, strides,
                          int(block_size), magic, shift, bool(pages), kv)
    return launch._replace(columns=max(1, slots // launch.row_groups))


# ----------------------------------------------------------------------------- work
class Pieces(NamedTuple):
    """Cuts of the sequences' visible key tiles: the columns' fixed pieces ordered by column
    (then sequence, piece), then the run-time pool's pieces (column -1)."""
    seq: np.ndarray      # int64 [n] sequence of each piece
    offset: np.ndarray   # its first tile, counted from the sequence's first visible tile
    count: np.ndarray    # its tiles (0 only for the one piece of a sequence without keys)
    index: np.ndarray    # its index among the sequence's pieces
    column: np.ndarray   # the CTA column that runs it (non-decreasing), -1: the pool's
    per_seq: np.ndarray  # int64 [batch] pieces of each sequence


def _enumerate(per_seq):
    """``(seq, index)`` of every piece for ``per_seq`` pieces per sequence."""
    seq = np.repeat(np.arange(len(per_seq)), per_seq)
    return seq, np.arange(len(seq)) - np.repeat(np.cumsum(per_seq) - per_seq, per_seq)


def min_piece_terms(launch, merge="fused"):
    """``(stages, num, den)``: a "balanced" piece has at least ``max(stages,
    ceil(sqrt(max_tiles * num / den)))`` key tiles (:func:`min_piece_tiles`; the device plan
    takes the same integers).

    At least ``STAGES - 1`` (a column's first loads all go out at once). And, as one warp
    merges a head's P pieces (the fused merge's warps walk ``ceil(hpc / NWARPS)`` heads
    each, the kernel merge's one), a sequence of ``n`` tiles costs about ``n / P + c P``
    tile times, ``c = num / den`` the merge of one piece in tile-streaming times: a partial
    row is ``4 D`` bytes (fp32) a head against ``4 TILE D`` of 16-bit K/V a tile, and a
    warp merges at about half a CTA's streaming rate, so ``c = 2 * heads a warp / TILE``.
    The best P is ``sqrt(n / c)``, that is ``sqrt(n c)`` tiles a piece: 4 at 512 tiles for
    one head a warp (c = 1/32), 12 for the fused merge of MQA's 32 heads (c = 1/4). A
    pages-kernel tile holds a row group's kv heads of its tokens, so its ``c`` is divided
    by their number.
    """
    per_warp = 1 if merge == "kernel" else -(-launch.heads_per_group // NWARPS)
    tile_heads = launch.heads.head_warps if launch.pages else 1  # kv heads a tile holds
    return STAGES - 1, 2 * per_warp, launch.tiles.tile * tile_heads


def min_piece_tiles(launch, max_tiles, merge="fused") -> int:
    """Fewest key tiles per piece of the "balanced" schedule (:func:`min_piece_terms`)."""
    stages, num, den = min_piece_terms(launch, merge)
    return max(stages, int(np.ceil(np.sqrt(max_tiles * (num / den)))))


def balanced_pieces(n_tiles, columns, min_share=1) -> Pieces:
    """Equal tile shares: with the sequences' tiles laid end to end, column ``c`` takes
    tiles ``[c * P, (c + 1) * P)`` (``P = max(ceil(total / columns), min_share)``); a
    sequence crossing a share boundary is cut there. Every column ends at the same time,
    whatever the mix of lengths."""
    n = np.asarray(n_tiles, np.int64)
    share = max(1, min_share, -(-int(n.sum()) // columns))
    end = np.cumsum(n)
    start = end - n
    first = start // share
    per_seq = np.where(n > 0, (end - 1) // share, first) - first + 1
    seq, index = _enumerate(per_seq)
    chunk = first[seq] + index
    lo = np.maximum(start[seq], chunk * share)
    hi = np.minimum(end[seq], (chunk + 1) * share)
    return Pieces(seq, lo - start[seq], hi - lo, index, np.minimum(chunk, columns - 1), per_seq)


def whole_pieces(n_tiles, columns):
    """``(pieces, makespan)``: each sequence one piece, the longest first dealt to the
    columns back and forth (0 .. C-1, C-1 .. 0, ...); makespan: the most tiles a column
    gets."""
    n = np.asarray(n_tiles, np.int64)
    order = np.argsort(-n, kind="stable")
    rank = np.arange(len(n))
    lap, k = rank // columns, rank % columns
    column = np.empty(len(n), np.int64)
    column[order] = np.where(lap % 2 == 0, k, columns - 1 - k)
    makespan = int(np.bincount(column, weights=n, minlength=columns).max(initial=0))
    seq = np.lexsort((np.arange(len(n)), column))
    ones = np.ones(len(n), np.int64)
    return Pieces(seq, np.zeros(len(n), np.int64), n[seq], np.zeros(len(n), np.int64),
                  column[seq], ones), makespan


def split_pieces(n_tiles, num_splits, columns) -> Pieces:
    """Up to ``num_splits`` equal cuts of each sequence (none empty; one, empty, for a
    sequence without keys), dealt to the columns in order, an equal count each (+-1)."""
    n = np.asarray(n_tiles, np.int64)
    per = np.maximum(1, -(-n // np.clip(np.minimum(num_splits, n), 1, None)))
    per_seq = np.where(n > 0, -(-n // per), 1)
    seq, index = _enumerate(per_seq)
    offset = index * per[seq]
    column = np.arange(len(seq)) * columns // max(1, len(seq))
    return Pieces(seq, offset, np.minimum(per[seq], n[seq] - offset), index, column, per_seq)


def pool_tiles(n_tiles, columns, min_piece):
    """``(tail, size)``: the last ``tail[b]`` tiles of sequence b (``floor(n POOL_FRACTION)``)
    go to the run-time pool in pieces of ``size`` tiles (about POOL_PIECES a column, at least
    ``min_piece``); no pool (zeros, 0) when a column's fixed share would be under
    POOL_MIN_SHARE tiles."""
    n = np.asarray(n_tiles, np.int64)
    tail = (n * POOL_FRACTION).astype(np.int64)
    pooled = int(tail.sum())
    if not pooled or int(n.sum()) - pooled < POOL_MIN_SHARE * columns:
        return np.zeros_like(n), 0
    return tail, max(min_piece, -(-pooled // (POOL_PIECES * columns)))


def with_pool(fixed, n_fixed, tail, size):
    """``fixed`` pieces (cutting the first ``n_fixed`` tiles of each sequence) followed by
    the pool's: each sequence's ``tail`` tiles after those in pieces of ``size`` (its last
    one shorter), indexed after the sequence's fixed pieces."""
    if not size:
        return fixed
    per_pool = -(-tail // size)
    seq, k = _enumerate(per_pool)
    offset = n_fixed[seq] + k * size
    count = np.minimum(size, n_fixed[seq] + tail[seq] - offset)
    return Pieces(np.concatenate([fixed.seq, seq]), np.concatenate([fixed.offset, offset]),
                  np.concatenate([fixed.count, count]),
                  np.concatenate([fixed.index, fixed.per_seq[seq] + k]),
                  np.concatenate([fixed.column, np.full(len(seq), -1, np.int64)]),
                  fixed.per_seq + per_pool)


def pack_work(pieces, kv_lens, first_tiles, columns):
    """Descriptors int32 ``[rows, DESC_INTS]`` (decode.cu's Piece): column ``c``'s first
    fixed piece in row ``c`` (or NO_PIECE), the pool header ``(first row, count, 0...)`` in
    row ``columns``, the columns' other pieces after it linked by ``next``, then the pool's
    pieces; per-sequence ``(pieces, first partial slot or -1)`` int32 ``[batch, 2]``; the
    number of partial slots (pieces of split sequences, consecutive per sequence)."""
    seq, col, per_seq = pieces.seq, pieces.column, pieces.per_seq
    split = per_seq > 1
    slots = np.where(split, per_seq, 0)
    slot0 = np.cumsum(slots) - slots
    fixed = col >= 0
    lead = fixed.copy()
    lead[1:] &= col[1:] != col[:-1]
    rest = fixed & ~lead
    row = np.where(lead, col, columns + np.cumsum(~lead))  # pool rows follow the columns' rest
    nxt = np.full(len(seq), -1, np.int64)
    nxt[:-1] = np.where(rest[1:], row[1:], -1)
    t_begin = first_tiles[seq] + pieces.offset
    desc = np.empty((columns + 1 + int((~lead).sum()), DESC_INTS), np.int32)
    desc[:columns] = NO_PIECE
    pool = int((~fixed).sum())
    desc[columns] = (len(desc) - pool, pool, 0, 0, 0, 0, 0, 0)
    desc[row] = np.stack([seq, kv_lens[seq], t_begin, t_begin + pieces.count, pieces.index,
                          per_seq[seq], np.where(split[seq], slot0[seq] + pieces.index, -1),
                          nxt], axis=1)
    info = np.stack([per_seq, np.where(split, slot0, -1)], axis=1).astype(np.int32)
    return desc, info, int(slots.sum())


class WorkPlan(NamedTuple):
    """One step's pieces for a launch's columns."""
    schedule: str
    desc: np.ndarray      # int32 [rows, DESC_INTS]
    seq_info: np.ndarray  # int32 [batch, 2]: pieces, first partial slot (-1: not split)
    num_slots: int        # partial slots used
    max_pieces: int       # most pieces of one sequence (1: nothing to merge)
    pool_pieces: int = 0  # pieces taken by CTAs at run time


def plan_work(launch, seq_lens, append, window_left, schedule="balanced",
              num_splits=None, merge="fused") -> WorkPlan:
    """Cut the visible key tiles of ``seq_lens`` (host int32 ``[batch]``, + 1 with
    ``append``) into pieces for ``launch.columns`` columns by ``schedule``. "split" takes
    ``num_splits`` (default: ``choose_num_splits``); "balanced" sizes pieces for ``merge``
    (``min_piece_tiles``) and leaves each sequence's last tiles to the run-time pool
    (``pool_tiles``), unless whole sequences end nearly as soon (``whole_pieces``, within
    WHOLE_SLACK of a column's share)."""
    kv = np.asarray(seq_lens, np.int64) + int(append)
    first, n = tile_spans(kv, window_left, launch.tiles.tile)
    if schedule == "balanced":
        pieces, makespan = whole_pieces(n, launch.columns)
        share = -(-int(n.sum()) // launch.columns)
        if makespan > share + max(WHOLE_SLACK_TILES, share * WHOLE_SLACK):
            shortest = min_piece_tiles(launch, int(n.max(initial=0)), merge)
            tail, size = pool_tiles(n, launch.columns, shortest)
            pieces = with_pool(balanced_pieces(n - tail, launch.columns, shortest), n - tail,
                               tail, size)
    else:
        if num_splits is None:
            num_splits = choose_num_splits(len(kv) * launch.row_groups, int(n.max(initial=0)),
                                           launch.columns * launch.row_groups)
        pieces = split_pieces(n, num_splits, launch.columns)
    desc, info, slots = pack_work(pieces, kv, first, launch.columns)
    return WorkPlan(schedule, desc, info, slots, int(pieces.per_seq.max(initial=1)),
                    int((pieces.column < 0).sum()))


class DeviceIndex(NamedTuple):
    """Offsets (int32 elements) of a device-planned step in one index buffer: descriptors
    (``rows`` of DESC_INTS, 16-byte aligned), per-sequence piece info ``[batch, 2]``,
    checked lengths ``[batch]`` (-1: a bad sequence) and the plan kernel's scratch
    (kernels_cu/plan.cu: 5 ints a sequence and one a piece). Sized for ``batch`` sequences
    on ``columns`` columns: at most ``batch + columns - 1`` pieces (each of the fewer than
    ``columns`` share boundaries cuts one sequence once more), as many partial slots."""
    batch: int
    columns: int

    @property
    def pieces(self):
        return self.batch + self.columns

    @property
    def rows(self):
        return 2 * self.columns + self.batch + 1

    @property
    def info(self):
        return DESC_INTS * self.rows

    @property
    def lens(self):
        return self.info + 2 * self.batch

    @property
    def scratch(self):
        return self.lens + self.batch

    @property
    def size(self):
        return self.scratch + 5 * self.batch + self.pieces


def equal_share_plan(launch, seq_lens, append, window_left, merge):
    """``(descriptors, seq_info, slots)`` of the "balanced" schedule without its host
    refinements (no whole-sequence deal, no run-time pool): equal shares of at least
    ``min_piece_tiles`` tiles, as ``kernels_cu/plan.cu``'s decode_plan_kernel cuts them on
    the device (its specification)."""
    kv = np.asarray(seq_lens, np.int64) + int(append)
    first, n = tile_spans(kv, window_left, launch.tiles.tile)
    shortest = min_piece_tiles(launch, int(n.max(initial=0)), merge)
    return pack_work(balanced_pieces(n, launch.columns, shortest), kv, first, launch.columns)


def work_capacity(launch, max_batch):
    """``(descriptor rows, partial slots)`` that any "balanced" plan of up to ``max_batch``
    sequences fits in: at most ``columns - 1`` share boundaries cut a sequence's fixed
    tiles, and its pool tail adds at most one piece more than its share of
    ``POOL_PIECES * columns``."""
    pool = POOL_PIECES * launch.columns + max_batch
    return 2 * launch.columns + max_batch + 1 + pool, launch.columns + 2 * max_batch + pool
