"""Reply-topic prefixes: which a team may register, and when one overlaps a prefix another team holds."""

from __future__ import annotations

from infra.keys import overlapping_prefix, prefixes_overlap, reply_prefix_problem
from queue_schemas.names import Names


def test_overlap_is_a_prefix_either_way() -> None:
    assert prefixes_overlap("acme.replies.", "acme.replies.")
    assert prefixes_overlap("acme.rep", "acme.replies.")
    assert prefixes_overlap("acme.replies.x", "acme.replies.")
    assert not prefixes_overlap("acme.replies.", "acme.other.")
    assert not prefixes_overlap("acme.replies", "acme-replies")


def test_only_another_teams_prefix_blocks_a_claim() -> None:
    held = {"acme.replies.": "acme"}
    assert overlapping_prefix(["acme.replies."], held, "beta") == "acme.replies."
    assert overlapping_prefix(["acme.rep"], held, "beta") == "acme.rep"
    assert overlapping_prefix(["acme.replies.x"], held, "beta") == "acme.replies.x"
    assert overlapping_prefix(["beta.replies.", "acme.r"], held, "beta") == "acme.r"
    assert overlapping_prefix(["beta.replies."], held, "beta") is None
    assert overlapping_prefix([], held, "beta") is None
    assert overlapping_prefix(["acme.replies.v2"], held, "acme") is None  # a team's own never blocks it
    # Team names that are prefixes of each other are different teams.
    assert overlapping_prefix(["acme.replies."], held, "acm") == "acme.replies."


def test_a_prefix_must_be_a_topic_prefix_clear_of_sluices_topics() -> None:
    names = Names("sluice")
    assert reply_prefix_problem("acme.replies.", names) is None
    for bad in ("ab", "acme replies", "sluice.results.", "sluice.", "slu"):
        assert reply_prefix_problem(bad, names) is not None, bad
