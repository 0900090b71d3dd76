"""The shards that split an interpreter suite (tests/interpreted.py) lose no case and run none twice."""
import pytest
from hypothesis import given
from hypothesis import strategies as st
from interpreted import shard_of


@given(st.integers(0, 200), st.integers(1, 5))
def test_shards_partition_the_suite(count, n):
    items = [f"case{k}" for k in range(count)]
    kept = []
    for i in range(n):
        mine, others = shard_of(items, f"{i}/{n}")
        assert sorted(mine + others) == sorted(items)  # each shard sees the whole suite, split in two
        kept += mine
    assert sorted(kept) == sorted(items)  # together the shards run every case exactly once
    if count >= n:
        assert all(shard_of(items, f"{i}/{n}")[0] for i in range(n))  # and none is empty


@pytest.mark.parametrize("bad", ["2/2", "-1/2", "0/0"])
def test_bad_shard_is_named(bad):
    with pytest.raises(ValueError, match="NONANS_TEST_SHARD"):
        shard_of(["a"], bad)
