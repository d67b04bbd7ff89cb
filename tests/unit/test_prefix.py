import pytest

from gpu_workers.kv_translate import KvTranslator, salt_of
from queue_schemas.messages import KvEventKind
from queue_schemas.prefix import block_hashes, cache_salt


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


def test_salted_chains_share_nothing_and_continue_from_their_parent() -> None:
    tokens = list(range(64))
    a, b = cache_salt("a", shared=False), cache_salt("b", shared=False)
    assert cache_salt("a", shared=True) is None
    chain_a, chain_b, plain = (block_hashes(tokens, 16, salt=s) for s in (a, b, None))
    assert not set(chain_a) & set(chain_b)
    assert not set(chain_a) & set(plain)
    assert block_hashes(tokens, 16, salt=a) == chain_a  # deterministic
    assert block_hashes(tokens[32:], 16, parent_hash=chain_a[1]) == chain_a[2:]


def test_the_translator_names_a_salted_chain_from_the_engines_extra_keys() -> None:
    tokens = list(range(32))
    salt = cache_salt("acme", shared=False)
    translator = KvTranslator(16)
    extra = [("lora-x", salt), None]  # vLLM puts the salt beside other keys of the first block
    change = translator.stored(["e1", "e2"], None, tokens, salt_of(extra))
    assert change == (KvEventKind.STORED, tuple(block_hashes(tokens, 16, salt=salt)))
    assert salt_of(None) is None
    assert salt_of([("lora-x",)]) is None


def test_an_adapter_salts_the_chain_even_where_teams_share_the_cache() -> None:
    tokens = list(range(64))
    salts = [
        cache_salt("a", shared=False, adapter="sql"),
        cache_salt("a", shared=False, adapter="poem"),
        cache_salt("a", shared=False),
        cache_salt("a", shared=True, adapter="sql"),
    ]
    assert len(set(salts)) == 4
    assert cache_salt("b", shared=True, adapter="sql") == salts[3]  # shared across teams, not adapters
    chains = [set(block_hashes(tokens, 16, salt=s)) for s in salts]
    assert all(not chains[i] & chains[j] for i in range(4) for j in range(i + 1, 4))
    salt = salts[0]
    change = KvTranslator(16).stored(["e1", "e2"], None, tokens[:32], salt_of([("sql", salt), None]))
    assert change == (KvEventKind.STORED, tuple(block_hashes(tokens[:32], 16, salt=salt)))
