"""Host-side block management: a refcounted block pool and per-sequence block tables.

``BlockPool`` hands out cache blocks from a free list and counts references to each, so
forked sequences share blocks. ``BlockTable`` maps sequences to blocks, turns appended
tokens into a ``slot_mapping`` for ``write_kv_cache`` and keeps the ``block_tables`` /
``seq_lens`` arrays the attention ops read, mirrored to the device once per change.

Every method checks its arguments and the pool's capacity before it changes anything: a
call that raises leaves the pool and the table exactly as they were.
"""
from __future__ import annotations

import numpy as np

from ..core.checks import check_int


class PoolExhausted(RuntimeError):
    """Too few free blocks for an allocation.

    A ``RuntimeError`` rather than a ``ValueError``: the arguments are fine, the same call
    succeeds once enough blocks are freed (a scheduler catches it to preempt a sequence).
    Nothing changes when it is raised.
    """


class BlockPool:
    """A free list of ``num_blocks`` cache blocks with a reference count per block.

    Parameters
    ----------
    num_blocks : int
        Blocks in the cache (block ids ``0 .. num_blocks - 1``).
    block_size : int
        Token slots per block.

    Notes
    -----
    ``allocate`` hands out blocks with count 1, ``incref`` adds a sharer, ``free`` (alias
    ``decref``) drops one; a block whose count reaches 0 returns to the free list. Freeing a
    free block raises ``ValueError`` (double free) and changes nothing.
    """

    def __init__(self, num_blocks, block_size):
        self.num_blocks = check_int("num_blocks", num_blocks)
        self.block_size = check_int("block_size", block_size)
        self._refcount = np.zeros(self.num_blocks, np.int32)
        # stack of free ids: the top (end) is handed out first; ids come out 0, 1, 2, ...
        self._free = np.arange(self.num_blocks - 1, -1, -1, dtype=np.int32)
        self._num_free = self.num_blocks

    @property
    def num_free(self) -> int:
        """Blocks on the free list."""
        return self._num_free

    @property
    def refcounts(self) -> np.ndarray:
        """int32 ``[num_blocks]`` reference counts (read-only view; 0 means free)."""
        view = self._refcount.view()
        view.flags.writeable = False
        return view

    def free_blocks(self) -> np.ndarray:
        """int32 ``[num_free]`` ids on the free list (a copy)."""
        return self._free[:self._num_free].copy()

    def can_allocate(self, n) -> bool:
        """True when ``n`` blocks are free.

        Parameters
        ----------
        n : int
            Blocks wanted, ``>= 0``.
        """
        return check_int("n", n, minimum=0) <= self._num_free

    def allocate(self, n) -> np.ndarray:
        """Take ``n`` free blocks, each with reference count 1.

        Parameters
        ----------
        n : int
            Blocks wanted, ``>= 0``.

        Returns
        -------
        numpy.ndarray
            int32 ``[n]`` block ids.

        Raises
        ------
        PoolExhausted
            If fewer than ``n`` blocks are free (nothing is allocated).
        """
        n = check_int("n", n, minimum=0)
        if n > self._num_free:
            raise PoolExhausted(f"allocate: need {n} block{'s' * (n != 1)}, only "
                                f"{self._num_free} of {self.num_blocks} are free")
        top = self._num_free
        blocks = self._free[top - n:top][::-1].copy()
        self._num_free -= n
        self._refcount[blocks] = 1
        return blocks

    def _ids(self, name, blocks):
        ids = np.atleast_1d(np.asarray(blocks))
        if ids.dtype.kind not in "iu" or ids.ndim != 1:
            raise TypeError(f"{name}: expected an int or a 1-D integer array, got {ids.dtype} "
                            f"with shape {ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_blocks):
            bad = ids[(ids < 0) | (ids >= self.num_blocks)][0]
            raise ValueError(f"{name}: expected block ids in [0, {self.num_blocks}), got {bad}")
        return ids.astype(np.int64)

    def _check_owned(self, name, ids):
        """Per-block use counts in ``ids``; raise if any exceeds the block's refcount."""
        uses = np.bincount(ids, minlength=self.num_blocks)
        over = uses > self._refcount
        if over.any():
            b = int(np.flatnonzero(over)[0])
            raise ValueError(f"{name}: block {b} has {self._refcount[b]} references, "
                             f"got {uses[b]} (free or double free)")
        return uses

    def incref(self, blocks):
        """Add one reference to each allocated block in ``blocks``.

        Parameters
        ----------
        blocks : int or array-like
            A block id or integer ``[k]`` ids of allocated blocks (repeats count once each).

        Raises
        ------
        ValueError
            If a block is free or out of range (nothing changes).
        """
        ids = self._ids("blocks", blocks)
        alive = self._refcount[ids] > 0
        if not alive.all():
            raise ValueError(f"blocks: expected allocated blocks, block {ids[~alive][0]} is free")
        np.add.at(self._refcount, ids, 1)

    def free(self, blocks) -> np.ndarray:
        """Drop one reference to each block in ``blocks``; return the ids that became free.

        Parameters
        ----------
        blocks : int or array-like
            A block id or integer ``[k]`` ids (a block may repeat up to its count).

        Returns
        -------
        numpy.ndarray
            int32 ``[k]`` blocks whose count reached 0, now on the free list.

        Raises
        ------
        ValueError
            If a block is free already, or appears more often than its count (double free).
        """
        ids = self._ids("blocks", blocks)
        self._check_owned("blocks", ids)
        np.subtract.at(self._refcount, ids, 1)
        released = np.unique(ids[self._refcount[ids] == 0]).astype(np.int32)
        self._free[self._num_free:self._num_free + released.size] = released[::-1]
        self._num_free += released.size
        return released

    decref = free

    def __repr__(self):
        return (f"BlockPool(num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"num_free={self._num_free})")


class BlockTable:
    """Block tables of up to ``max_seqs`` sequences over one ``BlockPool``.

    Parameters
    ----------
    pool : BlockPool
    max_seqs : int
        Sequence ids are ``0 .. max_seqs - 1``.
    max_blocks_per_seq : int
        Row length of ``block_tables``; a sequence holds at most
        ``max_blocks_per_seq * block_size`` tokens.

    Notes
    -----
    A sequence is live from its first ``append`` (or ``fork`` onto it) until ``free``.

    Copy-on-write: ``fork`` shares all of the source's blocks (reference counted). The first
    ``append`` into a shared, partially filled last block gives the appending sequence a
    fresh block and queues a copy ``(src, dst)`` of the old block. ``take_copies()`` returns
    and clears the queue; apply it with ``copy_blocks`` before writing the slots returned by
    the appends that queued it (the usual step: table updates, ``take_copies`` +
    ``copy_blocks``, then ``write_kv_cache``). A queued copy holds a reference to its source
    block until it is taken, so the source cannot be reused meanwhile; a copy whose
    destination is freed before it is taken is dropped. Source blocks are never destinations
    of other queued copies (chains are resolved), so the copies are order-independent.
    ``fork`` shares data as written: write a sequence's pending slots before forking it.
    """

    def __init__(self, pool, max_seqs, max_blocks_per_seq):
        if not isinstance(pool, BlockPool):
            raise TypeError(f"pool: expected a BlockPool, got {type(pool).__name__}")
        self.pool = pool
        self.max_seqs = check_int("max_seqs", max_seqs)
        self.max_blocks_per_seq = check_int("max_blocks_per_seq", max_blocks_per_seq)
        self._tables = np.full((self.max_seqs, self.max_blocks_per_seq), -1, np.int32)
        self._lens = np.zeros(self.max_seqs, np.int32)
        self._live = np.zeros(self.max_seqs, bool)
        self._copies = {}          # pending copy-on-write: dst block -> src block
        self._version = 0          # bumped on every change; keys the device mirrors
        self._mirrors = {}

    # ------------------------------------------------------------------ views
    @property
    def block_tables(self) -> np.ndarray:
        """int32 ``[max_seqs, max_blocks_per_seq]`` block ids, ``-1`` padded (read-only view)."""
        return self._readonly(self._tables)

    @property
    def seq_lens(self) -> np.ndarray:
        """int32 ``[max_seqs]`` tokens per sequence, 0 for free ids (read-only view)."""
        return self._readonly(self._lens)

    @staticmethod
    def _readonly(a):
        view = a.view()
        view.flags.writeable = False
        return view

    def is_live(self, seq_id) -> bool:
        """True from a sequence's first ``append`` (or ``fork`` onto it) until ``free``.

        Parameters
        ----------
        seq_id : int
            In ``[0, max_seqs)``.
        """
        return bool(self._live[self._seq("seq_id", seq_id)])

    def device_block_tables(self):
        """CuPy copy of ``block_tables``, uploaded once per change of the table."""
        return self._mirror("block_tables", self._tables)

    def device_seq_lens(self):
        """CuPy copy of ``seq_lens``, uploaded once per change of the table."""
        return self._mirror("seq_lens", self._lens)

    def _mirror(self, name, host_array):
        import cupy
        key = (name, cupy.cuda.Device().id)
        version, arr = self._mirrors.get(key, (-1, None))
        if version != self._version:
            arr = cupy.asarray(host_array)
            self._mirrors[key] = (self._version, arr)
        return arr

    # ------------------------------------------------------------------ checks
    def _seq(self, name, seq_id, live=None):
        s = check_int(name, seq_id, minimum=0)
        if s >= self.max_seqs:
            raise ValueError(f"{name}: expected a sequence id in [0, {self.max_seqs}), got {s}")
        if live is True and not self._live[s]:
            raise ValueError(f"{name}: unknown sequence {s} (not live)")
        if live is False and self._live[s]:
            raise ValueError(f"{name}: sequence {s} is live; expected a free id")
        return s

    def _plan_append(self, seq_id, num_tokens):
        """(seq, old_len, new_len, new blocks needed, shared last block to copy or -1)."""
        s = self._seq("seq_id", seq_id)
        n = check_int("num_tokens", num_tokens, minimum=0)
        bs = self.pool.block_size
        old = int(self._lens[s])
        new = old + n
        have, need = -(-old // bs), -(-new // bs)
        if need > self.max_blocks_per_seq:
            raise ValueError(f"num_tokens: sequence {s} would hold {new} tokens, past "
                             f"max_blocks_per_seq * block_size = "
                             f"{self.max_blocks_per_seq * bs}")
        cow = -1
        if n and old % bs:
            last = int(self._tables[s, have - 1])
            held = sum(1 for src in self._copies.values() if src == last)
            if self.pool.refcounts[last] - held > 1:   # shared with another table
                cow = last
        return s, old, new, need - have + (cow >= 0), cow

    # ------------------------------------------------------------------ verbs
    def can_append(self, seq_id, num_tokens) -> bool:
        """True when ``append(seq_id, num_tokens)`` would find enough free blocks.

        Parameters
        ----------
        seq_id : int
            In ``[0, max_seqs)``, live or not.
        num_tokens : int
            Tokens to add, ``>= 0``.
        """
        return self.pool.can_allocate(self._plan_append(seq_id, num_tokens)[3])

    def append(self, seq_id, num_tokens) -> np.ndarray:
        """Extend sequence ``seq_id`` by ``num_tokens`` tokens; start it if it is not live.

        A shared last block (after ``fork``) is replaced by a fresh one and its copy queued
        (``take_copies``).

        Parameters
        ----------
        seq_id : int
            In ``[0, max_seqs)``.
        num_tokens : int
            Tokens to add, ``>= 0``.

        Returns
        -------
        numpy.ndarray
            int64 ``[num_tokens]`` slots ``block * block_size + offset`` of the new tokens.

        Raises
        ------
        ValueError
            On a bad id, or a length past ``max_blocks_per_seq * block_size``.
        PoolExhausted
            If the pool lacks the blocks (all or nothing: nothing changes).
        """
        s, old, new, num_new, cow = self._plan_append(seq_id, num_tokens)
        fresh = self.pool.allocate(num_new)
        bs = self.pool.block_size
        have = -(-old // bs)
        if cow >= 0:
            src = self._copies.get(cow, cow)     # resolve chains to a block with data
            self.pool.incref(src)                # held until take_copies()
            self.pool.free(cow)                  # still referenced by the other sharers
            self._copies[int(fresh[0])] = src
            have -= 1
        self._tables[s, have:have + fresh.size] = fresh
        self._lens[s] = new
        self._live[s] = True
        self._version += 1
        pos = np.arange(old, new, dtype=np.int64)
        return self._tables[s, pos // bs].astype(np.int64) * bs + pos % bs

    def fork(self, src_id, dst_id):
        """Make live sequence ``dst_id`` share every block (and the length) of ``src_id``.

        Parameters
        ----------
        src_id : int
            A live sequence.
        dst_id : int
            A free sequence id in ``[0, max_seqs)``; live afterwards.

        Raises
        ------
        ValueError
            If ``src_id`` is not live or ``dst_id`` is.
        """
        src = self._seq("src_id", src_id, live=True)
        dst = self._seq("dst_id", dst_id, live=False)
        nblk = -(-int(self._lens[src]) // self.pool.block_size)
        self.pool.incref(self._tables[src, :nblk])
        self._tables[dst] = self._tables[src]
        self._lens[dst] = self._lens[src]
        self._live[dst] = True
        self._version += 1

    def free(self, seq_id):
        """Release sequence ``seq_id``'s blocks (one reference each) and retire the id.

        Parameters
        ----------
        seq_id : int
            A live sequence.
        """
        s = self._seq("seq_id", seq_id, live=True)
        nblk = -(-int(self._lens[s]) // self.pool.block_size)
        released = self.pool.free(self._tables[s, :nblk])
        dropped = [self._copies.pop(int(b)) for b in released if int(b) in self._copies]
        if dropped:
            self.pool.free(np.asarray(dropped, np.int64))
        self._tables[s] = -1
        self._lens[s] = 0
        self._live[s] = False
        self._version += 1

    def take_copies(self) -> np.ndarray:
        """Pending copy-on-write copies, cleared; apply them with ``copy_blocks``.

        Returns
        -------
        numpy.ndarray
            int32 ``[num_copies, 2]`` of ``(src, dst)`` block ids. Destinations are distinct
            and no source is a destination. The references held on the sources are
            released, so apply the copies before the next ``append``.
        """
        pairs = np.array([(s, d) for d, s in self._copies.items()], np.int32).reshape(-1, 2)
        self._copies.clear()
        if pairs.size:
            self.pool.free(pairs[:, 0])
        return pairs

    def __repr__(self):
        return (f"BlockTable(max_seqs={self.max_seqs}, "
                f"max_blocks_per_seq={self.max_blocks_per_seq}, "
                f"live={int(self._live.sum())}, pool={self.pool!r})")
