"""The anchor (engine.checkpoint.store.retention): the newest checkpoint a resume on another world size
can start from is kept beyond keep_last, and the manifest records which checkpoints are anchors."""

import json

import pytest

import engine
from engine.checkpoint.format.manifest import Manifest
from engine.checkpoint.store.retention import retired_by_policy


def _manifest(sequence: int, anchor: bool = False) -> Manifest:
    return Manifest(sequence, None, {}, 0.0, 1, anchor=anchor)


def _entries(anchors: set[int], newest: int = 6) -> list[tuple[str, Manifest | None]]:
    """ckpt-<newest> down to ckpt-1, newest first, those in ``anchors`` marked anchors."""
    return [(f"ckpt-{sequence:010d}", _manifest(sequence, sequence in anchors)) for sequence in range(newest, 0, -1)]


def _retired(entries, keep_last: int = 2, abandoned=(), broken=()) -> list[str]:
    return sorted(retired_by_policy(entries, keep_last, None, (), abandoned, lambda name: name not in broken))


def test_the_newest_anchor_is_kept_beyond_keep_last_and_older_anchors_are_not() -> None:
    retired = _retired(_entries({1, 3}))
    assert "ckpt-0000000003" not in retired  # older than the last two, kept as the anchor
    assert retired == ["ckpt-0000000001", "ckpt-0000000002", "ckpt-0000000004"]


def test_without_anchors_retention_keeps_the_last_n_only() -> None:
    assert _retired(_entries(set())) == [f"ckpt-{sequence:010d}" for sequence in range(1, 5)]


def test_an_anchor_among_the_last_n_is_kept_once_and_costs_nothing_more() -> None:
    assert _retired(_entries({5, 2})) == [f"ckpt-{sequence:010d}" for sequence in range(1, 5)]


def test_an_anchor_that_does_not_verify_or_was_abandoned_gives_way_to_the_next_older_one() -> None:
    assert _retired(_entries({2, 3}), broken={"ckpt-0000000003"}) == \
        ["ckpt-0000000001", "ckpt-0000000003", "ckpt-0000000004"]
    assert _retired(_entries({2, 3}), abandoned={"ckpt-0000000003"}) == \
        ["ckpt-0000000001", "ckpt-0000000003", "ckpt-0000000004"]


def test_the_manifest_records_an_anchor_and_only_true() -> None:
    raw = _manifest(4, anchor=True).to_json()
    assert json.loads(raw)["anchor"] is True and Manifest.from_json(raw).anchor
    assert "anchor" not in json.loads(_manifest(4).to_json()) and not Manifest.from_json(_manifest(4).to_json()).anchor
    data = json.loads(raw)
    data["files"] = {}
    for value in (False, 1, "yes"):
        data["anchor"] = value
        with pytest.raises(engine.CheckpointCorrupt, match="'anchor' must be true when present"):
            Manifest.from_json(json.dumps(data).encode())
