"""Reading a CreateTopics answer: created, kept, or refused with the topic's name."""

from __future__ import annotations

import pytest
from aiokafka.errors import PolicyViolationError

from infra.topics import creation_outcomes


def test_created_and_existing_topics_are_told_apart() -> None:
    answer = [("a", 0, None), ("b", 36, "Topic with this name already exists.")]
    assert creation_outcomes(["a", "b"], answer) == [("a", True), ("b", False)]


def test_any_other_refusal_raises_the_brokers_error_naming_the_topic() -> None:
    answer = [("a", 0, None), ("b", 44, "replication factor above the brokers")]
    with pytest.raises(PolicyViolationError, match="topic b: replication factor above the brokers"):
        creation_outcomes(["a", "b"], answer)
