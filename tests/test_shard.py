"""The test suite's ``--shard I/N`` option (tests/conftest.py ``_shard``): parts that are
disjoint and together the whole collection, each reporting the rest deselected, a test's
part unmoved by other tests coming or going, and a refused spec."""
import pytest

from conftest import _shard


class _Config:
    def __init__(self, spec):
        self.spec, self.deselected = spec, []
        self.hook = self

    def getoption(self, name):
        assert name == "--shard"
        return self.spec

    def pytest_deselected(self, items):
        self.deselected += items


def test_shards_partition_the_collection():
    items = [f"tests/test_x.py::t{k}" for k in range(300)]
    parts = []
    for i in (1, 2, 3):
        config, part = _Config(f"{i}/3"), list(items)
        _shard(config, part)
        assert sorted(part + config.deselected) == sorted(items)
        parts.append(part)
    assert sorted(sum(parts, [])) == sorted(items)
    assert all(70 <= len(p) <= 130 for p in parts), [len(p) for p in parts]  # about a third each
    whole = list(items)
    _shard(_Config(None), whole)
    assert whole == items


@pytest.mark.parametrize("spec", ["0/2", "3/2", "a/b", "2"])
def test_bad_shard_is_refused(spec):
    with pytest.raises(pytest.UsageError, match="--shard"):
        _shard(_Config(spec), ["t0"])


def test_a_tests_shard_stays_when_others_are_added():
    items = [f"tests/test_x.py::t{k}" for k in range(100)]
    before, after = list(items), ["tests/test_a.py::new"] + items
    _shard(_Config("2/2"), before)
    _shard(_Config("2/2"), after)
    assert [t for t in after if t in items] == before
