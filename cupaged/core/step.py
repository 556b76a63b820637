"""One batch step of a serving engine, checked and uploaded once, shared by every layer.

An engine builds a :class:`BatchStep` per step from its scheduler's metadata and hands it
to every layer (``cupaged.layers``), the model (``cupaged.engine.model``) or its own calls of
the ops: the prefix sums, lengths, block tables, slot mapping and positions live on the
device once, and the decode or prefill plan of each layer geometry is made once per step
(at its first layer) and reused by the others. Host (NumPy) metadata is checked on the
host and uploaded asynchronously through pinned memory; device metadata is used as it is
(the kernels check it, ``cupaged.errors``). Nothing in a step waits for the device.
"""
from __future__ import annotations

import numpy as np

from .arrays import array_module, check_array, host
from .checks import INT32_MAX, check_block_tables, check_cu_seqlens
from .device import uploader
from .errors import strict
from .layouts import CacheGeometry



class BatchStep:
    """The metadata of one batch step (any mix of prefill chunks and decode tokens).

    Sequence ``i`` owns query rows ``[cu_seqlens_q[i], cu_seqlens_q[i + 1])``, the last
    ``q_len_i`` of its ``seq_lens[i]`` positions; rows past ``cu_seqlens_q[-1]`` (up to
    ``num_tokens``) are padding, whose outputs are zeros.

    Parameters
    ----------
    cu_seqlens_q : array
        int32 ``[num_seqs + 1]`` query prefix sums.
    seq_lens : array
        int32 ``[num_seqs]`` keys of each sequence including its new tokens.
    block_tables : array
        int32 ``[num_seqs, max_blocks_per_seq]``, -1 padded.
    slot_mapping : array
        int64 ``[num_tokens]`` (or longer): cache slot of each row, -1 to skip (padding).
    positions : array, optional
        int32/int64 ``[num_tokens]`` absolute positions; default ``seq_len - q_len + i``.
    max_query_len : int, optional
        The longest ``q_len`` (1: a decode step, run by the decode kernels with split-KV);
        computed for host metadata, else taken as given (None: the unified prefill kernel).
    xp : module, optional
        Where the layers run: ``numpy`` (the reference) or ``cupy`` (the kernels); default
        the metadata's own module. Give ``cupy`` with host metadata to check it on the host
        and upload it once.
    validate : bool, optional
        Strict mode for device metadata (host checks, one sync).

    All four arrays are of one module: NumPy (checked here, uploaded once) or CuPy.
    """

    def __init__(self, cu_seqlens_q, seq_lens, block_tables, slot_mapping, positions=None, *,
                 max_query_len=None, xp=None, validate=None):
        src = array_module(cu_seqlens_q, seq_lens, block_tables, slot_mapping, positions)
        if xp is None:
            xp = src
        if src is not np and xp is np:
            raise TypeError("xp: expected cupy for device metadata, got numpy")
        self.xp = xp
        contents = src is np or strict(validate)
        cu = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, src, contents=contents)
        num_seqs = cu_seqlens_q.shape[0] - 1
        # shapes here; block ids and lengths against the block size by the layers' plans
        check_block_tables(block_tables, seq_lens, CacheGeometry(INT32_MAX, 1, 1, 1), src,
                           batch=num_seqs, contents=False)
        bt, sl = (host(block_tables), host(seq_lens)) if contents else (None, None)
        check_array("slot_mapping", slot_mapping, ndim=1, dtypes=np.int64, xp=src)
        if positions is not None:
            check_array("positions", positions, ndim=1, dtypes=(np.int32, np.int64), xp=src)
        self.host = None
        if contents:
            q_lens = np.diff(cu).astype(np.int64)
            short = sl.astype(np.int64) < q_lens
            if short.any():
                i = int(np.argmax(short))
                raise ValueError(f"seq_lens: sequence {i} has {int(sl[i])} keys, fewer than "
                                 f"its {int(q_lens[i])} new tokens")
            if slot_mapping.shape[0] < int(cu[-1]):
                raise ValueError(f"slot_mapping: expected at least {int(cu[-1])} entries, got "
                                 f"{slot_mapping.shape[0]}")
            if positions is None:
                starts = np.repeat(sl.astype(np.int64) - q_lens - cu[:-1], q_lens)
                positions = (np.arange(int(cu[-1])) + starts).astype(np.int32)
            max_query_len = int(q_lens.max(initial=0))
            self.host = dict(cu_seqlens_q=np.array(cu, np.int32), seq_lens=np.array(sl, np.int32),
                             block_tables=np.array(bt, np.int32),
                             slot_mapping=host(slot_mapping).astype(np.int64),
                             positions=host(positions))
        self.num_seqs = num_seqs
        self.num_tokens = int(slot_mapping.shape[0])
        self.max_query_len = max_query_len
        arrays = dict(cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens, block_tables=block_tables,
                      slot_mapping=slot_mapping, positions=positions)
        if self.host is not None:
            arrays = self.host if xp is np else _upload(xp, self.host)
        elif positions is None:
            arrays["positions"] = _device_positions(xp, cu_seqlens_q, seq_lens, self.num_tokens)
        self.cu_seqlens_q = arrays["cu_seqlens_q"]
        self.seq_lens = arrays["seq_lens"]
        self.block_tables = arrays["block_tables"]
        self.slot_mapping = arrays["slot_mapping"]
        self.positions = arrays["positions"]
        self._plans = {}

    @property
    def is_decode(self) -> bool:
        """One query token per sequence (``max_query_len == 1``)."""
        return self.max_query_len == 1

    @property
    def num_valid_tokens(self):
        """Rows that belong to a sequence (host metadata; None for device metadata)."""
        return None if self.host is None else int(self.host["cu_seqlens_q"][-1])

    def plan(self, key, make):
        """The plan of one layer geometry ``key`` for this step, made by ``make()`` at its
        first use (``PagedDecoder`` or ``PagedPrefiller`` planned on this step).

        Parameters
        ----------
        key : hashable
            The layer geometry (heads, head size, block size, dtype, layout, options).
        make : callable
            ``make()`` returns the plan; called once per key and step.

        Returns
        -------
        object
            The plan ``make()`` returned for ``key``.
        """
        p = self._plans.get(key)
        if p is None:
            p = self._plans[key] = make()
        return p


def _upload(xp, arrays):
    """Device copies of the host metadata: one asynchronous copy through pinned memory into
    one new buffer, and views of it."""
    parts, views, offset = [], {}, 0
    for name in ("cu_seqlens_q", "seq_lens", "block_tables", "slot_mapping", "positions"):
        a = np.ascontiguousarray(arrays[name])
        offset = -(-offset // 8) * 8
        parts.append((name, offset, a))
        offset += a.nbytes
    image = np.zeros(max(offset, 8), np.uint8)
    for _, o, a in parts:
        image[o:o + a.nbytes] = a.view(np.uint8).ravel()
    buf = xp.empty(image.size, np.uint8)
    uploader().upload(buf, image)
    for name, o, a in parts:
        views[name] = buf[o:o + a.nbytes].view(a.dtype).reshape(a.shape)
    return views


def _device_positions(xp, cu_seqlens_q, seq_lens, num_tokens):
    """``seq_len - q_len + i`` for every row, computed on the device (rows past the last
    sequence: their sequence's next positions, unused)."""
    rows = xp.arange(num_tokens, dtype=np.int32)
    seq = xp.clip(xp.searchsorted(cu_seqlens_q, rows, side="right") - 1, 0,
                  max(seq_lens.shape[0] - 1, 0))
    if seq_lens.shape[0] == 0:
        return rows
    q_start = cu_seqlens_q[seq]
    q_len = cu_seqlens_q[seq + 1] - q_start
    return (rows - q_start + seq_lens[seq] - q_len).astype(np.int32)
