import pytest

from queue_schemas.prefix import block_hashes


def test_only_full_blocks_are_hashed() -> None:
    assert len(block_hashes(list(range(33)), 16)) == 2
    assert block_hashes(list(range(15)), 16) == []


def test_hash_chains_over_the_whole_prefix() -> None:
    a = block_hashes([1] * 16 + [2] * 16, 16)
    b = block_hashes([9] * 16 + [2] * 16, 16)
    assert a[1] != b[1], "same second block after a different first block must hash differently"
    assert block_hashes([1] * 16 + [2] * 16 + [3] * 16, 16)[:2] == a


def test_hashes_are_stable_across_calls() -> None:
    assert block_hashes(list(range(64)), 16) == block_hashes(tuple(range(64)), 16)


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1, 2], 0)
