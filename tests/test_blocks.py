"""BlockPool and BlockTable: allocation, refcounts, copy-on-write, errors leave state intact."""
import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cupaged.engine.blocks import BlockPool, BlockTable, PoolExhausted


def snapshot(table):
    """Everything observable about a table and its pool, for 'nothing changed' checks."""
    pool = table.pool
    return (table.block_tables.copy(), table.seq_lens.copy(), pool.refcounts.copy(),
            sorted(pool.free_blocks().tolist()), dict(table._copies))


def assert_same(a, b):
    for x, y in zip(a, b):
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y)
        else:
            assert x == y


# ----------------------------------------------------------------------------- pool
def test_pool_allocate_and_free():
    pool = BlockPool(6, 4)
    a = pool.allocate(4)
    assert a.dtype == np.int32 and sorted(a.tolist()) == [0, 1, 2, 3]
    assert pool.num_free == 2 and pool.can_allocate(2) and not pool.can_allocate(3)
    pool.incref(a[:2])
    np.testing.assert_array_equal(pool.refcounts[a], [2, 2, 1, 1])
    released = pool.free(a)
    assert sorted(released.tolist()) == [2, 3] and pool.num_free == 4
    assert sorted(pool.decref(a[:2]).tolist()) == [0, 1] and pool.num_free == 6
    assert sorted(pool.allocate(6).tolist()) == list(range(6))


def test_pool_exhausted_changes_nothing():
    pool = BlockPool(3, 16)
    pool.allocate(2)
    before = (pool.refcounts.copy(), pool.free_blocks())
    with pytest.raises(PoolExhausted, match="need 2 blocks, only 1"):
        pool.allocate(2)
    assert isinstance(PoolExhausted("x"), RuntimeError)
    np.testing.assert_array_equal(pool.refcounts, before[0])
    np.testing.assert_array_equal(pool.free_blocks(), before[1])
    pool.allocate(1)
    with pytest.raises(PoolExhausted, match="need 1 block, only 0 of 3 are free"):
        pool.allocate(1)


def test_pool_double_free_and_bad_ids():
    pool = BlockPool(4, 2)
    a = pool.allocate(2)
    pool.free(a[0])
    before = pool.refcounts.copy()
    with pytest.raises(ValueError, match="double free"):
        pool.free(a[0])
    with pytest.raises(ValueError, match="double free"):
        pool.free([a[1], a[1]])            # one reference, freed twice in one call
    with pytest.raises(ValueError, match=r"block ids in \[0, 4\)"):
        pool.free(7)
    with pytest.raises(ValueError, match="is free"):
        pool.incref(a[0])
    with pytest.raises(TypeError, match="integer"):
        pool.free(np.array([0.5]))
    np.testing.assert_array_equal(pool.refcounts, before)
    assert pool.num_free == 3


@pytest.mark.parametrize("args, err", [((0, 4), ValueError), ((4, 0), ValueError),
                                       ((4.0, 4), TypeError), ((4, "4"), TypeError)])
def test_pool_bad_sizes(args, err):
    with pytest.raises(err):
        BlockPool(*args)


# ----------------------------------------------------------------------------- table
def test_append_slots_and_arrays():
    table = BlockTable(BlockPool(8, 4), max_seqs=3, max_blocks_per_seq=4)
    s0 = table.append(0, 6)
    s1 = table.append(1, 3)
    s0b = table.append(0, 3)
    assert s0.dtype == np.int64
    bt = table.block_tables
    assert bt.dtype == np.int32 and bt.shape == (3, 4)
    np.testing.assert_array_equal(table.seq_lens, [9, 3, 0])
    expect = [bt[0, p // 4] * 4 + p % 4 for p in range(9)]
    np.testing.assert_array_equal(np.concatenate([s0, s0b]), expect)
    np.testing.assert_array_equal(s1, [bt[1, 0] * 4 + p for p in range(3)])
    assert (bt[0, 3:] == -1).all() and (bt[1, 1:] == -1).all() and (bt[2] == -1).all()
    with pytest.raises(ValueError):
        bt[0, 0] = 5                       # read-only view


def test_append_exhaustion_is_all_or_nothing():
    table = BlockTable(BlockPool(3, 4), 2, 8)
    table.append(0, 5)
    before = snapshot(table)
    assert not table.can_append(1, 5)
    with pytest.raises(PoolExhausted):
        table.append(1, 5)
    assert_same(before, snapshot(table))
    assert not table.is_live(1)


def test_bad_table_calls_change_nothing():
    table = BlockTable(BlockPool(16, 4), 3, 2)
    table.append(0, 3)
    before = snapshot(table)
    cases = [(lambda: table.append(0, 6), ValueError, "past max_blocks_per_seq"),
             (lambda: table.append(3, 1), ValueError, r"sequence id in \[0, 3\)"),
             (lambda: table.append(-1, 1), ValueError, ">= 0"),
             (lambda: table.append(1, -2), ValueError, "num_tokens"),
             (lambda: table.append(1, 1.5), TypeError, "num_tokens"),
             (lambda: table.fork(1, 2), ValueError, "unknown sequence 1"),
             (lambda: table.fork(0, 0), ValueError, "is live"),
             (lambda: table.free(2), ValueError, "unknown sequence 2"),
             (lambda: BlockTable(object(), 1, 1), TypeError, "BlockPool")]
    for call, err, msg in cases:
        with pytest.raises(err, match=msg):
            call()
        assert_same(before, snapshot(table))


def test_fork_copy_on_write():
    pool = BlockPool(8, 4)
    table = BlockTable(pool, 4, 4)
    table.append(0, 6)                     # blocks b0 (full), b1 (2 of 4)
    b0, b1 = table.block_tables[0, :2]
    table.fork(0, 1)
    assert pool.refcounts[b0] == 2 and pool.refcounts[b1] == 2
    slots = table.append(1, 1)             # into the shared partial block: copy on write
    new = table.block_tables[1, 1]
    assert new not in (b0, b1) and table.block_tables[1, 0] == b0
    assert slots.tolist() == [new * 4 + 2]
    table.append(0, 1)                     # sequence 0 now owns b1 alone: no copy
    assert table.block_tables[0, 1] == b1
    np.testing.assert_array_equal(table.take_copies(), [[b1, new]])
    assert table.take_copies().shape == (0, 2)
    assert pool.refcounts[b1] == 1 and pool.refcounts[b0] == 2


def test_copy_chain_resolves_to_block_with_data():
    pool = BlockPool(8, 4)
    table = BlockTable(pool, 4, 4)
    table.append(0, 2)
    p = table.block_tables[0, 0]
    table.fork(0, 1)
    table.append(1, 1)                     # p -> x queued
    x = table.block_tables[1, 0]
    table.fork(1, 2)
    table.append(2, 1)                     # x is itself a pending copy: p -> y
    y = table.block_tables[2, 0]
    copies = table.take_copies()
    assert sorted(map(tuple, copies.tolist())) == sorted([(p, x), (p, y)])


def test_free_drops_copy_into_freed_block():
    pool = BlockPool(4, 4)
    table = BlockTable(pool, 2, 2)
    table.append(0, 2)
    table.fork(0, 1)
    table.append(1, 1)
    table.free(0)                          # the queued copy's source stays held
    assert pool.num_free == 2
    table.free(1)                          # its destination dies: copy dropped
    assert table.take_copies().shape == (0, 2)
    assert pool.num_free == 4


def test_device_mirrors_upload_once_per_change(monkeypatch):
    uploads = []

    class FakeCupy:
        class cuda:
            class Device:
                id = 0

        @staticmethod
        def asarray(a):
            uploads.append(a.copy())
            return a.copy()

    monkeypatch.setitem(__import__("sys").modules, "cupy", FakeCupy)
    table = BlockTable(BlockPool(4, 2), 2, 2)
    table.append(0, 3)
    a = table.device_block_tables()
    assert table.device_block_tables() is a and len(uploads) == 1
    table.device_seq_lens(), table.device_seq_lens()
    assert len(uploads) == 2
    table.append(0, 1)
    b = table.device_block_tables()
    assert b is not a and len(uploads) == 3
    np.testing.assert_array_equal(b, table.block_tables)


# ----------------------------------------------------------------------------- stateful
class TableMachine(RuleBasedStateMachine):
    """Random append/fork/free/take_copies; no block leaks or is owned twice."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(12, 3)
        self.table = BlockTable(self.pool, 5, 4)
        self.lens = {}                      # model: live seq -> tokens

    seq = st.integers(0, 4)

    @rule(s=seq, n=st.integers(0, 7))
    def append(self, s, n):
        before = snapshot(self.table)
        try:
            slots = self.table.append(s, n)
        except (PoolExhausted, ValueError):
            assert_same(before, snapshot(self.table))
            return
        self.lens[s] = self.lens.get(s, 0) + n
        bs = self.pool.block_size
        blocks, offs = slots // bs, slots % bs
        row = self.table.block_tables[s]
        assert (blocks == row[np.arange(self.lens[s] - n, self.lens[s]) // bs]).all()
        assert (self.pool.refcounts[blocks] >= 1).all() and (offs < bs).all()

    @rule(src=seq, dst=seq)
    def fork(self, src, dst):
        if src not in self.lens or dst in self.lens:
            before = snapshot(self.table)
            with pytest.raises(ValueError):
                self.table.fork(src, dst)
            assert_same(before, snapshot(self.table))
            return
        self.table.fork(src, dst)
        self.lens[dst] = self.lens[src]

    @precondition(lambda self: self.lens)
    @rule(data=st.data())
    def free(self, data):
        s = data.draw(st.sampled_from(sorted(self.lens)))
        self.table.free(s)
        del self.lens[s]

    @rule()
    def take_copies(self):
        copies = self.table.take_copies()
        if copies.size:
            assert len(set(copies[:, 1])) == len(copies)
            assert not set(copies[:, 0]) & set(copies[:, 1])
            assert (self.pool.refcounts[copies[:, 1]] >= 1).all()

    @invariant()
    def refcounts_match_owners(self):
        bs = self.pool.block_size
        owners = np.zeros(self.pool.num_blocks, np.int64)
        for s in range(self.table.max_seqs):
            n = self.lens.get(s, 0)
            assert self.table.seq_lens[s] == n
            used = self.table.block_tables[s, :-(-n // bs)]
            assert (self.table.block_tables[s, len(used):] == -1).all()
            assert len(set(used.tolist())) == len(used)
            np.add.at(owners, used.astype(np.int64), 1)
        for dst, src in self.table._copies.items():
            assert owners[dst] >= 1         # a queued copy targets a block in use
            owners[src] += 1                # and holds its source
        np.testing.assert_array_equal(self.pool.refcounts, owners)
        free = self.pool.free_blocks()
        assert len(set(free.tolist())) == len(free) == self.pool.num_free
        assert (owners[free] == 0).all() and (owners > 0).sum() + len(free) == 12


TableMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                          deadline=None)
test_table_state_machine = TableMachine.TestCase
