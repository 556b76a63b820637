"""The kernels' application binary interface, in one place: the argument struct of every
kernel family (:class:`cupaged.core.launch.Record`), the device error word's codes, and the
constants both sides use. ``kernels_cu`` sources ``#include "abi.cuh"``, which
``cupaged.core.compile`` generates from this module (:func:`header`), so a field or a constant
changes here and nowhere else.
"""
from __future__ import annotations

from .launch import TENSOR_MAP, Record

NULL = 0

# ----------------------------------------------------------------------------- device errors
# Index arrays that live on the device are checked by the kernels that read them. The first
# bad entry found is recorded in the device's error word (cupaged.errors), as
# (code, row, column, value, bound): code = argument << 4 | check.
ERROR_ARGUMENTS = ("block_tables", "seq_lens", "cu_seqlens_q", "cu_seqlens_k", "slot_mapping",
                   "positions", "block_mapping", "indptr", "indices", "v_idx", "s_idx",
                   "seqlens", "kv_seqlens")
ERROR_CHECKS = ("range", "order", "start", "end", "table", "increasing", "size", "last")
ERROR_WORDS = 8  # int64 words of the error record (5 used)


def error_code(argument, check):
    """The code of a bad entry of ``argument`` failing ``check`` (names above)."""
    return (ERROR_ARGUMENTS.index(argument) + 1) << 4 | (ERROR_CHECKS.index(check) + 1)


def decode_error(code):
    """``(argument, check)`` of an error code."""
    return ERROR_ARGUMENTS[(code >> 4) - 1], ERROR_CHECKS[(code & 15) - 1]


# ----------------------------------------------------------------------------- fp8 scales
# The fp8 scales of the cache write, decode, append and prefill records: kv head h's scale is
# k_scale[k_scale_stride * h] (stride 0: one value for every head, 1: one per head), or
# k_scale_value where k_scale is null (cupaged.core.fp8.kernel_scales); v_scale alike.
SCALES = [("const float* __restrict__", "k_scale", NULL),
          ("const float* __restrict__", "v_scale", NULL), ("int", "k_scale_stride", 0),
          ("int", "v_scale_stride", 0), ("float", "k_scale_value", 1.0),
          ("float", "v_scale_value", 1.0)]

# ----------------------------------------------------------------------------- decode
# Caches of element type KV: T itself, or an fp8 format (kernels_cu/fp8.cuh). rows (DECODE,
# MERGE_PIECES, DECODE_PLAN): the row map of paged_attention's decode launch, sequence b's
# q / out / lse row (its token in the mixed batch), -1 for a sequence that is not a decode
# row there (no keys, nothing written); null: row b.
DECODE = Record("DecodeArgs", [
    ("const T* __restrict__", "q"), ("T* __restrict__", "out"),
    ("float* __restrict__", "lse", NULL), ("float* __restrict__", "part_out", NULL),
    ("float* __restrict__", "part_lse", NULL), ("int* __restrict__", "counters", NULL),
    ("int* __restrict__", "pool_ctr", NULL), ("const int4* __restrict__", "work"),
    ("const KV* __restrict__", "k_cache"), ("const KV* __restrict__", "v_cache"),
    ("const int* __restrict__", "block_tables"),
    ("const float* __restrict__", "alibi_slopes", NULL), *SCALES,
    ("const float* __restrict__", "sinks", NULL),
    ("int", "kbs"), ("int", "khs"), ("int", "kts"), ("int", "kcs"), ("int", "vbs"),
    ("int", "vhs"), ("int", "vts"), ("int", "vcs"), ("int", "ves"), ("int", "block_size"),
    ("unsigned", "block_magic"), ("int", "block_shift"), ("int", "bt_stride"),
    ("int", "q_stride"), ("int", "num_q_heads"), ("int", "num_kv_heads"),
    ("int", "head_warps"), ("int", "head_chunks"), ("int", "window_left"),
    ("int", "fused_merge"), ("float", "scale_log2"), ("float", "sm_scale"),
    ("float", "soft_cap"), ("int", "tile_tokens"),
    ("const int* __restrict__", "rows", NULL),
], template="typename T, typename KV")

APPEND = Record("AppendArgs", [
    ("const T* __restrict__", "k_new"), ("const T* __restrict__", "v_new"),
    ("KV* __restrict__", "k_cache"), ("KV* __restrict__", "v_cache"),
    ("const int* __restrict__", "block_tables"), ("const int* __restrict__", "seq_lens"),
    *SCALES, ("int", "bt_stride"), ("int", "block_size"), ("int", "num_kv_heads"),
    ("int", "head_dim"),
    ("int", "k_new_stride"), ("int", "v_new_stride"),
    ("int", "kbs"), ("int", "khs"), ("int", "kts"), ("int", "kcs"), ("int", "vbs"),
    ("int", "vhs"), ("int", "vts"), ("int", "vcs"), ("int", "ves"),
], template="typename T, typename KV")

MERGE_PIECES = Record("MergePiecesArgs", [
    ("const float* __restrict__", "part_out"), ("const float* __restrict__", "part_lse"),
    ("const int* __restrict__", "seq_info"), ("const float* __restrict__", "sinks", NULL),
    ("TO* __restrict__", "out"), ("float* __restrict__", "lse", NULL),
    ("int", "num_q_heads"), ("int", "num_kv_heads"), ("int", "head_chunks"), ("int", "hpc"),
    ("int", "dim"), ("int", "wph"), ("const int* __restrict__", "rows", NULL),
], template="typename TO")

MERGE_STATES = Record("MergeStatesArgs", [
    ("const TI* __restrict__", "o_first"), ("const TI* __restrict__", "o_rest"),
    ("const float* __restrict__", "l_first"), ("const float* __restrict__", "l_rest"),
    ("const float* __restrict__", "sinks", NULL), ("TO* __restrict__", "out"),
    ("float* __restrict__", "lse_out", NULL),
    ("i64", "o_part_stride"), ("i64", "o_row_stride"), ("i64", "l_part_stride"),
    ("i64", "l_row_stride"),
    ("int", "num_parts"), ("int", "num_rows"), ("int", "num_heads"), ("int", "dim"),
], template="typename TI, typename TO")

# The device plan of a decode step (kernels_cu/plan.cu): block tables and lengths checked,
# the "balanced" pieces of decode_plan.balanced_pieces written as decode_plan.pack_work does.
DECODE_PLAN = Record("DecodePlanArgs", [
    ("const int* __restrict__", "block_tables"), ("const int* __restrict__", "seq_lens"),
    ("int* __restrict__", "work"), ("int* __restrict__", "seq_info"),
    ("int* __restrict__", "lens_out"), ("int* __restrict__", "scratch"),
    ("int* __restrict__", "done"), ("long long* __restrict__", "err", NULL),
    ("int", "batch"), ("int", "width"), ("int", "bt_stride"), ("int", "block_size"),
    ("int", "num_blocks"), ("int", "append"), ("int", "window_left"), ("int", "tile"),
    ("int", "columns"), ("int", "min_piece"), ("int", "piece_num"), ("int", "piece_den"),
    ("const int* __restrict__", "rows", NULL),
])

# ----------------------------------------------------------------------------- prefill
# Element (key j, dim d) of K sits at blk * k_block + hk * k_head + (d / X) * k_chunk + d % X
# + off * k_tok, of V at blk * v_block + hk * v_head + d * v_dim + off * v_tok; query row t
# of head h at t * q_tok + h * D. K and V hold elements of type KV: T itself, or an fp8
# format (kernels_cu/fp8.cuh) read with the kv head's scales (SCALES).
PREFILL = Record("Problem", [
    ("const T* __restrict__", "q"), ("const KV* __restrict__", "k"),
    ("const KV* __restrict__", "v"), ("T* __restrict__", "out"),
    ("float* __restrict__", "lse", NULL), ("const int4* __restrict__", "work"),
    ("const int* __restrict__", "cu_q"), ("const int* __restrict__", "kv_info"),
    ("const int* __restrict__", "block_tables", NULL),
    ("int", "max_blocks"), ("int", "block_size"), ("int", "paged"),
    ("i64", "k_block"), ("i64", "k_head"), ("i64", "k_chunk"), ("i64", "k_tok"),
    ("i64", "v_block"), ("i64", "v_head"), ("i64", "v_dim"), ("i64", "v_tok"),
    ("const float* __restrict__", "alibi", NULL), ("const float* __restrict__", "sinks", NULL),
    ("int", "num_q_heads"), ("int", "num_kv_heads"), ("float", "sm_scale"),
    ("float", "soft_cap"), ("int", "window_left"), ("int", "causal"), ("i64", "q_tok"),
    *SCALES,
], template="typename T, typename KV")

# The TMA-fed warp-specialised prefill kernel (prefill_ws_tma_kernel): Problem's fields, then
# the tensor maps of ragged K and V (cupaged.core.tma.ragged_kv_map) as by-value parameters.
PREFILL_TMA = Record("ProblemTma", [*PREFILL.fields, (TENSOR_MAP, "k_map"), (TENSOR_MAP, "v_map")],
                     template="typename T, typename KV", struct=False)

# The device work list of a prefill launch (kernels_cu/plan.cu), as prefill_plan.work_list
# (kv heads in sections of section_heads).
# With rows (paged_attention's split, prefill.plan.decode_rows): sequences of one query row
# get no item; rows[b] is their q row, -1 for the others (and for all of them when the
# prefix sums are bad), for the decode launch.
PREFILL_PLAN = Record("PrefillPlanArgs", [
    ("const int* __restrict__", "cu_q"), ("const int* __restrict__", "kv_info"),
    ("const int* __restrict__", "block_tables", NULL), ("int4* __restrict__", "work"),
    ("int* __restrict__", "scratch"), ("int* __restrict__", "done"),
    ("long long* __restrict__", "err", NULL), ("unsigned char* __restrict__", "out"),
    ("float* __restrict__", "lse", NULL), ("i64", "row_bytes"),
    ("int", "batch"), ("int", "total_q"), ("int", "total_k"), ("int", "paged"),
    ("int", "width"), ("int", "bt_stride"), ("int", "block_size"), ("int", "num_blocks"),
    ("int", "group"), ("int", "num_kv_heads"), ("int", "num_q_heads"), ("int", "block_m"),
    ("int", "block_n"), ("int", "causal"), ("int", "window_left"), ("int", "capacity"),
    ("int* __restrict__", "rows", NULL), ("int", "section_heads"),
])

# ----------------------------------------------------------------------------- sparse
# Block-sparse attention (kernels_cu/sparse_attention.cu): CTAs placed by bsr_prepare's
# schedule (bsr_meta, cta_bound); a CTA's K/V tiles come from the tile lists of
# sparse_index.cu (vertical+slash: list_counts, tiles in slots of list_cap, cols) or
# straight from a batched BSR pattern (indptr, indices). Keys: dense rows
# (cu_k; table null) or pages (block_tables); key j of kv head hk at hk * head_stride +
# j * tok_stride (dense) or table[j / page_size] * page_stride + (j % page_size) * tok_stride.
# Scores: scale_log2 = sm_scale * log2(e) on the plain path; sm_scale, soft_cap and alibi
# (float32 [Hq] slopes) feed score.cuh's epilogue; window_left as in the dense prefill.
SPARSE = Record("SparseArgs", [
    ("const T* __restrict__", "q"), ("const T* __restrict__", "k"),
    ("const T* __restrict__", "v"), ("T* __restrict__", "out"),
    ("float* __restrict__", "lse", NULL), ("const int* __restrict__", "cu_q"),
    ("const int* __restrict__", "cu_k", NULL),
    ("const int* __restrict__", "block_tables", NULL), ("int", "table_stride", 0),
    ("int", "page_size", 1), ("i64", "page_stride", 0), ("i64", "tok_stride"),
    ("i64", "head_stride"), ("i64", "q_tok"), ("int", "num_q_heads"), ("int", "group"),
    ("int", "head0", 0), ("const int* __restrict__", "list_counts", NULL),
    ("int", "list_cap", 0),
    ("const int2* __restrict__", "tiles", NULL),
    ("const int* __restrict__", "cols", NULL), ("int", "cols_heads", 0),
    ("int", "cols_width", 0), ("const int* __restrict__", "indptr", NULL),
    ("const int* __restrict__", "indices", NULL), ("const int* __restrict__", "bsr_meta", NULL),
    ("long long* __restrict__", "err", NULL), ("int", "batch", 0), ("int", "indptr_len", 0),
    ("int", "nnz", 0), ("int", "pattern_group", 1), ("int", "block_m", 64),
    ("int", "block_n", 64), ("int", "cta_bound", 0), ("int", "causal"),
    ("float", "scale_log2"), ("const float* __restrict__", "sinks", NULL),
    ("float", "sm_scale", 0.0), ("int", "window_left", -1), ("float", "soft_cap", 0.0),
    ("const float* __restrict__", "alibi", NULL),
], template="typename T")

# SPARSE's fields, then the K and V tensor maps of ragged K/V (sparse_sm90.cu's TMA kernels).
SPARSE_TMA = Record("SparseArgsTma", [*SPARSE.fields, (TENSOR_MAP, "k_map"), (TENSOR_MAP, "v_map")],
                    template="typename T", struct=False)

# The device schedule of a batched BSR launch (sparse_index.cu, bsr_prepare): lengths and
# block tables checked, the CSR row and first CTA of each sequence, the CTA map, padding
# rows zeroed. Its output bsr_meta is int4 [batch + 1] then int [cta_bound]
# (cupaged.sparse.launch.bsr_meta_size).
BSR_PREPARE = Record("BsrPrepareArgs", [
    ("const int* __restrict__", "cu_q"), ("const int* __restrict__", "cu_k", NULL),
    ("const int* __restrict__", "seq_lens", NULL),
    ("const int* __restrict__", "block_tables", NULL), ("const int* __restrict__", "indptr"),
    ("int* __restrict__", "meta"), ("long long* __restrict__", "err", NULL),
    ("unsigned char* __restrict__", "out"), ("float* __restrict__", "lse", NULL),
    ("i64", "row_bytes"), ("int", "batch"), ("int", "total_q"), ("int", "total_k", 0),
    ("int", "table_stride", 0), ("int", "table_width", 0), ("int", "page_size", 1),
    ("int", "num_blocks", 0), ("int", "num_q_heads"), ("int", "pattern_heads"),
    ("int", "block_m"), ("int", "cta_rows"), ("int", "indptr_len"), ("int", "nnz"),
    ("int", "cta_bound"),
])

# Vertical+slash index preparation (sparse_index.cu vs_prepare, a CTA a row of the index
# arrays): sorted slashes deduplicated in place with their runs, sorted verticals
# deduplicated and counted, and (dense) the rows whose pattern keeps more than
# dense_threshold of its causal blocks.
VS_PREPARE = Record("VsPrepareArgs", [
    ("const int* __restrict__", "v_sorted"), ("int", "nv"), ("int* __restrict__", "s_sorted"),
    ("int", "ns"), ("const int* __restrict__", "kv_lens"),
    ("const int* __restrict__", "q_lens", NULL), ("int", "len_stride"), ("int", "heads"),
    ("int", "bm"), ("int", "bn"), ("double", "dense_threshold", 0.0),
    ("int* __restrict__", "v_unique"), ("int* __restrict__", "v_count"),
    ("int* __restrict__", "run_first"), ("int* __restrict__", "dense", NULL),
    ("long long* __restrict__", "err", NULL),
])

# MInference's lists of every query block (sparse_index.cu vs_index_kernel, a warp a block).
VS_INDEX = Record("VsIndexArgs", [
    ("const int* __restrict__", "seqlens"), ("const int* __restrict__", "kv_seqlens"),
    ("const int* __restrict__", "s_sorted"), ("const int* __restrict__", "run_first"),
    ("int", "ns"), ("const int* __restrict__", "v_unique"),
    ("const int* __restrict__", "v_count"), ("int", "nv"), ("int", "batch"), ("int", "heads"),
    ("int", "num_m"), ("int", "bm"), ("int", "bn"), ("int* __restrict__", "block_count"),
    ("int* __restrict__", "block_offset"), ("int", "w_s"), ("int* __restrict__", "column_count"),
    ("int* __restrict__", "column_index"), ("int", "w_v"), ("int", "max_q"), ("int", "max_kv"),
    ("long long* __restrict__", "err", NULL),
])

# The attention kernel's tile lists of a head group (sparse_index.cu vs_plan_kernel, a warp a
# CTA of the attention launch).
VS_PLAN = Record("VsPlanArgs", [
    ("const int* __restrict__", "meta"), ("const int* __restrict__", "s_sorted"),
    ("const int* __restrict__", "run_first"), ("int", "ns"),
    ("const int* __restrict__", "v_unique"), ("const int* __restrict__", "v_count"),
    ("int", "nv"), ("const int* __restrict__", "dense", NULL), ("int", "batch"),
    ("int", "total_heads"), ("int", "head0"), ("int", "heads"), ("int", "cta_bound"),
    ("int", "bm"), ("int", "bn"), ("int", "tile_n"), ("int", "cap"),
    ("int* __restrict__", "counts"), ("int2* __restrict__", "tiles"),
])

# The pattern estimate (sparse_estimate.cu vs_estimate): phase 0 the chunks' row maxima and
# sums, phase 1 the vertical and slash sums under the combined rows.
VS_ESTIMATE = Record("VsEstimateArgs", [
    ("const T* __restrict__", "q"), ("i64", "q_row0"), ("int", "n"), ("int", "num_q_heads"),
    ("const T* __restrict__", "k"), ("const int* __restrict__", "block_table", NULL),
    ("int", "page_size"), ("i64", "page_stride"), ("i64", "tok_stride"), ("i64", "head_stride"),
    ("int", "group"), ("int", "kv_len"), ("int", "tiles_per_cta"), ("float", "scale_log2"),
    ("int", "phase"), ("float* __restrict__", "row_max"), ("float* __restrict__", "row_sum"),
    ("float* __restrict__", "vertical", NULL), ("float* __restrict__", "slash", NULL),
], template="typename T")

# The estimate's top verticals and slashes (sparse_estimate.cu vs_top_kernel, a CTA a row):
# the k largest of each row of scores [rows, width] (ties to the earlier), ascending positions
# out [rows, k] (k <= width).
VS_TOP = Record("VsTopArgs", [
    ("const float* __restrict__", "scores"), ("int* __restrict__", "out"), ("int", "width"),
    ("int", "k"),
])

# Quest page selection for decode (kernels_cu/quest.cu, cupaged.sparse.quest): per-page key
# bounds; page scores; the top pages of each (sequence, kv head) as a one-kv-head view's
# block table (tokens_per_page entries a page) and lengths; a sink folded into a decode's output.
# Key element (h, token, d) of block blk at blk * k_block + h * k_head + (d / X) * k_chunk +
# d % X + token * k_tok (X = 16 / sizeof(T)); bounds TB (float or bf16) [num_blocks, Hk, D].
QUEST_BOUNDS = Record("QuestBoundsArgs", [
    ("const T* __restrict__", "k_cache"), ("const int* __restrict__", "block_tables"),
    ("const int* __restrict__", "seq_lens"), ("TB* __restrict__", "k_min"),
    ("TB* __restrict__", "k_max"), ("long long* __restrict__", "err", NULL),
    ("i64", "k_block"), ("int", "k_head"), ("int", "k_chunk"), ("int", "k_tok"),
    ("int", "bt_stride"), ("int", "width"), ("int", "block_size"), ("int", "num_blocks"),
    ("int", "num_kv_heads"), ("int", "head_dim"), ("int", "last_page_only"),
], template="typename T, typename TB")

QUEST_SCORE = Record("QuestScoreArgs", [
    ("const T* __restrict__", "q"), ("const TB* __restrict__", "k_min"),
    ("const TB* __restrict__", "k_max"), ("const int* __restrict__", "block_tables"),
    ("const int* __restrict__", "seq_lens"), ("float* __restrict__", "scores"),
    ("long long* __restrict__", "err", NULL), ("i64", "q_stride"), ("int", "bt_stride"),
    ("int", "width"), ("int", "block_size"), ("int", "num_blocks"), ("int", "num_kv_heads"),
    ("int", "group"), ("int", "pages_per_cta"),
], template="typename T, typename TB")

QUEST_SELECT = Record("QuestSelectArgs", [
    ("const int* __restrict__", "block_tables"), ("const int* __restrict__", "seq_lens"),
    ("const float* __restrict__", "scores"), ("int* __restrict__", "positions", NULL),
    ("int* __restrict__", "sel_tables"), ("int* __restrict__", "sel_lens"),
    ("int", "bt_stride"), ("int", "width"), ("int", "block_size"), ("int", "num_blocks"),
    ("int", "num_kv_heads"), ("int", "top_k"), ("int", "first_pages"),
    ("int", "tokens_per_page"), ("int", "sel_stride"), ("int", "cache_keys", 0),
    ("int", "stage_positions", 0),
])

QUEST_SINKS = Record("QuestSinksArgs", [
    ("T* __restrict__", "out"), ("float* __restrict__", "lse"),
    ("const float* __restrict__", "sinks"), ("int", "rows"), ("int", "num_q_heads"),
    ("int", "head_dim"),
], template="typename T")

# ----------------------------------------------------------------------------- cache ops
# Strides in 16-byte input vectors: key[t, h] at t * key_tok + h * key_head; a cache block
# every k_block (v_block) cache vectors (a 16-byte input vector's image in the cache: 16
# bytes, or its fp8 codes, 4 or 8 bytes; 16 bytes in the vllm layout).
CACHE_WRITE = Record("CacheWriteArgs", [
    ("const uint4* __restrict__", "key"), ("const uint4* __restrict__", "value"),
    ("void* __restrict__", "k_cache"), ("void* __restrict__", "v_cache"),
    ("const i64* __restrict__", "slot_mapping"), ("long long* __restrict__", "err", NULL),
    *SCALES,
    ("i64", "num_slots"), ("i64", "k_block"), ("i64", "v_block"),
    ("int", "num_tokens"), ("int", "tpt_log2"), ("int", "row_vecs"), ("int", "head_vecs"),
    ("int", "num_kv_heads"), ("int", "block_size"), ("int", "key_tok"), ("int", "key_head"),
    ("int", "value_tok"), ("int", "value_head"),
])

COPY_BLOCKS = Record("CopyBlocksArgs", [
    ("const uint4* __restrict__", "src0"), ("uint4* __restrict__", "dst0"),
    ("const uint4* __restrict__", "src1", NULL), ("uint4* __restrict__", "dst1", NULL),
    ("const i64* __restrict__", "pairs"), ("long long* __restrict__", "err", NULL),
    ("i64", "block_vecs"), ("i64", "num_src"), ("i64", "num_dst"),
])

# Gather of a batch's cached keys and values into packed rows (a paged prefill's
# workspace): cache element strides (k_block ... v_tok as cupaged.core.layouts.CacheStrides,
# k_chunk of a 16-byte chunk of key elements), the packed rows [cu_k[b] + t, head, :] of
# 16-byte output vectors (chunks input chunks a head row).
GATHER_KV = Record("GatherKVArgs", [
    ("const void* __restrict__", "k_cache"), ("const void* __restrict__", "v_cache"),
    ("uint4* __restrict__", "k_out"), ("uint4* __restrict__", "v_out"),
    ("const int* __restrict__", "block_tables"), ("const int* __restrict__", "seq_lens"),
    ("int* __restrict__", "cu_k"), ("long long* __restrict__", "err", NULL),
    ("i64", "k_block"), ("i64", "v_block"), ("i64", "num_blocks"),
    ("int", "k_head"), ("int", "k_chunk"), ("int", "k_tok"), ("int", "v_head"),
    ("int", "v_dim"), ("int", "v_tok"), ("int", "bt_stride"), ("int", "max_blocks"),
    ("int", "batch"), ("int", "block_size"), ("int", "num_kv_heads"), ("int", "units"),
    ("int", "tpt_log2"),
])

# ----------------------------------------------------------------------------- rope
ROPE = Record("RopeArgs", [
    ("const void* __restrict__", "positions"), ("const double* __restrict__", "inv_freq"),
    ("const T*", "q"), ("const T*", "k"), ("T*", "q_out"), ("T*", "k_out"),
    ("long long* __restrict__", "err", NULL),
    ("i64", "num_tokens"), ("i64", "max_positions"), ("i64", "q_tok"), ("i64", "k_tok"),
    ("i64", "qo_tok"), ("i64", "ko_tok"),
    ("int", "positions_are_64bit"), ("int", "q_heads"), ("int", "k_heads"), ("int", "head_dim"),
    ("int", "rotary_dim"), ("int", "rot_units"), ("int", "pass_units"),
], template="typename T")

# ----------------------------------------------------------------------------- sink softmax
SINK_SOFTMAX = Record("SinkSoftmaxArgs", [
    ("const T* __restrict__", "x"), ("const float* __restrict__", "sinks", NULL),
    ("T* __restrict__", "y", NULL), ("float* __restrict__", "stats", NULL),
    ("i64", "num_rows"), ("i64", "n"), ("i64", "chunk", 0), ("i64", "rows_per_head", 1),
    ("int", "heads", 1), ("int", "chunks", 1), ("int", "vec"),
], template="typename T")

# ----------------------------------------------------------------------------- model
GEMM = Record("GemmArgs", [
    ("const float* __restrict__", "a"), ("const float* __restrict__", "b"),
    ("float* __restrict__", "c"), ("i64", "lda"), ("i64", "ldb"), ("i64", "ldc"),
    ("int", "m"), ("int", "n"), ("int", "k"),
])

RECORDS = (DECODE, APPEND, MERGE_PIECES, MERGE_STATES, DECODE_PLAN, PREFILL, PREFILL_TMA,
           PREFILL_PLAN, SPARSE, SPARSE_TMA, BSR_PREPARE, VS_PREPARE, VS_INDEX, VS_PLAN,
           VS_ESTIMATE, VS_TOP,
           QUEST_BOUNDS, QUEST_SCORE, QUEST_SELECT, QUEST_SINKS, CACHE_WRITE, COPY_BLOCKS,
           GATHER_KV, ROPE, SINK_SOFTMAX, GEMM)


# log2(e): score scales reach the kernels as scale_log2 = sm_scale * LOG2E (their exp2 softmax;
# kernels_cu/common.cuh has the float32 value for in-kernel use)
LOG2E = 1.4426950408889634

# the plan kernel (kernels_cu/plan.cu) of decode and prefill: its block, and its grid's most CTAs
# (sequences are checked a CTA at a time)
PLAN_THREADS = 512
PLAN_CTAS = 64


def constants(namespace, values):
    """C++ of ``values`` (name -> int) as ``constexpr int`` in ``namespace`` of cupaged (None:
    cupaged itself), for a family's ``cpp()``."""
    lines = [f"constexpr int {name} = {int(v)};" for name, v in values.items()]
    return "\n".join(lines if namespace is None else
                     [f"namespace {namespace} {{", *lines, f"}}  // namespace {namespace}"])


def header(*parts):
    """Text of ``abi.cuh``: the error codes, the constants ``parts`` give (C++ text, e.g.
    :func:`cupaged.decode.plan.cpp`) and every record's struct."""
    lines = ["// Generated by cupaged/core/abi.py: kernel argument structs, error codes, constants.",
             "#pragma once", "namespace cupaged {", "typedef long long i64;"]
    for i, name in enumerate(ERROR_ARGUMENTS):
        lines.append(f"constexpr int ARG_{name.upper()} = {i + 1};")
    for i, name in enumerate(ERROR_CHECKS):
        lines.append(f"constexpr int CHECK_{name.upper()} = {i + 1};")
    lines.append("__host__ __device__ constexpr int error_code(int argument, int check) "
                 "{ return argument << 4 | check; }")
    lines.append(f"constexpr int ERROR_WORDS = {ERROR_WORDS};")
    lines.append(constants("plan", dict(THREADS=PLAN_THREADS)))
    lines += parts
    lines += [r.cpp() for r in RECORDS]
    lines.append("}  // namespace cupaged")
    return "\n".join(lines) + "\n"
