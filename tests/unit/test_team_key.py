from __future__ import annotations

from queue_schemas.keys import TeamKey


def test_a_key_limited_to_adapters_reaches_its_pools_base_models_and_only_those_adapters() -> None:
    key = TeamKey(team="t", key_id="sk-x", pools=("chat",), adapters=("chat-sql",), created_at=0.0)
    assert key.allows_model("chat", None)
    assert key.allows_model("chat", "chat-sql")
    assert not key.allows_model("chat", "chat-poem")
    assert not key.allows_model("code", None)  # not one of its pools
    open_key = TeamKey(team="t", key_id="sk-y", created_at=0.0)
    assert open_key.allows_model("code", "code-review")
