"""Unit tests for the pure-Python ``progress`` package: counters, cursor, tree, msgpack codec."""

from __future__ import annotations

import dataclasses
import json
import pickle
import subprocess
import sys

import msgpack
import pytest

import progress
from progress import Anomaly, Counts, Cursor, Progress, ProgressSchemaError, ProgressTree, RunEnd, decode_tree, encode_tree

COUNT_FIELDS = ("ready", "started", "processed", "completed")


# ---- helpers -----------------------------------------------------------------------------


def _leaves(value):
    """Every plain leaf of a record, recursing through dataclasses and dicts."""
    if dataclasses.is_dataclass(value):
        for field in dataclasses.fields(value):
            yield from _leaves(getattr(value, field.name))
    elif isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaves(item)
    else:
        yield value


def _assert_fields_equal(expected, actual, where="record"):
    """Compare two records field by field (via dataclasses.fields), recursing."""
    assert type(actual) is type(expected), f"{where}: {type(actual).__name__} != {type(expected).__name__}"
    if dataclasses.is_dataclass(expected):
        for field in dataclasses.fields(expected):
            _assert_fields_equal(getattr(expected, field.name), getattr(actual, field.name), f"{where}.{field.name}")
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{where}: keys differ"
        for key in expected:
            _assert_fields_equal(expected[key], actual[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{where}: lengths differ"
        for index, (mine, theirs) in enumerate(zip(expected, actual)):
            _assert_fields_equal(mine, theirs, f"{where}[{index}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def _distinct_counts(start: int) -> Counts:
    # Distinct, and in the order counters advance (ready >= started >= processed >= completed).
    fields = dataclasses.fields(Counts)
    return Counts(**{field.name: start + len(fields) - i for i, field in enumerate(fields)})


def _distinct_progress(start: int) -> Progress:
    # ``current`` is a part of ``total``.
    return Progress(total=_distinct_counts(start + 100), current=_distinct_counts(start))


def _distinct_cursor(start: int) -> Cursor:
    return Cursor(**{field.name: start + i for i, field in enumerate(dataclasses.fields(Cursor))})


def _distinct_tree() -> ProgressTree:
    return ProgressTree(
        records={"fit.epochs": _distinct_progress(1), "epoch.batches": _distinct_progress(1001),
                 "split.splits": _distinct_progress(2001)},
        cursor=_distinct_cursor(5001),
        end=_distinct_end(),
        anomalies=[_distinct_anomaly()],
    )


def _distinct_anomaly() -> Anomaly:
    return Anomaly(split=_distinct_cursor(8001), kind="loss spike", value=8100.5, rolled_back_to="ckpt-0000008200",
                   rolled_back_cursor=_distinct_cursor(8301), skipped=((8401, 8402), (8403, 8404)),
                   optimizer_steps=8501)


def _distinct_end() -> RunEnd:
    return RunEnd(reason="early stopping", max_epochs=7001, max_steps=7002, max_time=7003.5)


def _counts_as_tuple(counts: Counts) -> tuple[int, int, int, int]:
    return (counts.ready, counts.started, counts.processed, counts.completed)


def _envelope(**overrides):
    envelope = {"kind": "splitloop.progress", "schema": 1, "tree": {"records": {}, "cursor": None}}
    envelope.update(overrides)
    return envelope


# ---- counters ----------------------------------------------------------------------------


def test_counts_start_at_zero_and_reset():
    counts = Counts(ready=4, started=3, processed=2, completed=1)
    assert _counts_as_tuple(Counts()) == (0, 0, 0, 0)
    counts.reset()
    assert _counts_as_tuple(counts) == (0, 0, 0, 0)


def test_increments_advance_in_order_in_both_scopes():
    record = Progress()
    steps = [
        (record.increment_ready, (1, 0, 0, 0)),
        (record.increment_started, (1, 1, 0, 0)),
        (record.increment_processed, (1, 1, 1, 0)),
        (record.increment_completed, (1, 1, 1, 1)),
        (record.increment_ready, (2, 1, 1, 1)),
        (record.increment_started, (2, 2, 1, 1)),
    ]
    for increment, expected in steps:
        increment()
        assert _counts_as_tuple(record.total) == expected
        assert _counts_as_tuple(record.current) == expected


def test_reset_current_keeps_total():
    record = Progress()
    for _ in range(3):
        record.increment_ready()
        record.increment_started()
        record.increment_processed()
        record.increment_completed()
    record.reset_current()
    assert _counts_as_tuple(record.current) == (0, 0, 0, 0)
    assert _counts_as_tuple(record.total) == (3, 3, 3, 3)
    record.increment_ready()
    assert _counts_as_tuple(record.current) == (1, 0, 0, 0)
    assert _counts_as_tuple(record.total) == (4, 3, 3, 3)


def test_in_flight_is_started_minus_completed_of_current_scope():
    record = Progress(total=Counts(9, 9, 8, 2), current=Counts(5, 4, 3, 1))
    assert record.in_flight == 3
    record.increment_completed()
    assert record.in_flight == 2


def test_reset_on_restart_rolls_back_in_flight_in_both_scopes():
    record = Progress(total=Counts(ready=7, started=6, processed=5, completed=4),
                      current=Counts(ready=3, started=3, processed=2, completed=1))
    record.reset_on_restart()
    assert _counts_as_tuple(record.total) == (4, 4, 4, 4)
    assert _counts_as_tuple(record.current) == (1, 1, 1, 1)
    assert record.in_flight == 0


def test_interrupted_unit_is_counted_once_after_restart():
    record = Progress()
    for _ in range(3):
        record.increment_ready()
        record.increment_started()
        record.increment_processed()
        record.increment_completed()
    record.increment_ready()
    record.increment_started()  # the crash happens here
    restored = Progress.from_dict(record.to_dict())
    restored.reset_on_restart()
    restored.increment_ready()
    restored.increment_started()
    restored.increment_processed()
    restored.increment_completed()
    assert _counts_as_tuple(restored.total) == (4, 4, 4, 4)
    assert _counts_as_tuple(restored.current) == (4, 4, 4, 4)


def test_cursor_tuple_and_str():
    cursor = Cursor(epoch=3, batch=5, split=7, optimizer=1)
    assert cursor.as_tuple() == (3, 5, 7, 1)
    text = str(cursor)
    for part in ("epoch 3", "batch 5", "split 7", "optimizer 1"):
        assert part in text
    with pytest.raises(dataclasses.FrozenInstanceError):
        cursor.epoch = 4  # type: ignore[misc]


# ---- to_dict / from_dict field by field --------------------------------------------------

RECORD_BUILDERS = {
    "RunEnd": _distinct_end,
    "Counts": lambda: _distinct_counts(11),
    "Cursor": lambda: _distinct_cursor(21),
    "Progress": lambda: _distinct_progress(31),
    "ProgressTree": _distinct_tree,
    "Anomaly": _distinct_anomaly,
}


@pytest.mark.parametrize("name", sorted(RECORD_BUILDERS))
def test_round_trip_field_by_field(name):
    record = RECORD_BUILDERS[name]()
    leaves = list(_leaves(record))
    assert len(leaves) == len(set(leaves)), "test setup: every field must hold a distinct value"
    data = record.to_dict()
    assert set(data) == {field.name for field in dataclasses.fields(record)}
    json.dumps(data)  # plain data only
    restored = type(record).from_dict(data)
    _assert_fields_equal(record, restored)


@pytest.mark.parametrize("cls", [Counts, Cursor])
def test_leaf_records_to_dict_maps_each_field_to_its_value(cls):
    record = cls(**{field.name: 40 + i for i, field in enumerate(dataclasses.fields(cls))})
    assert record.to_dict() == {field.name: 40 + i for i, field in enumerate(dataclasses.fields(cls))}


def test_tree_round_trip_without_cursor_and_without_records():
    for tree in (ProgressTree(), ProgressTree(records={"a": _distinct_progress(3)}, cursor=None)):
        _assert_fields_equal(tree, ProgressTree.from_dict(tree.to_dict()))
        _assert_fields_equal(tree, decode_tree(encode_tree(tree)))


def test_encode_decode_tree_round_trip_field_by_field():
    tree = _distinct_tree()
    decoded = decode_tree(encode_tree(tree))
    _assert_fields_equal(tree, decoded)


def _valid_dicts():
    return {
        Counts: _distinct_counts(1).to_dict(),
        Cursor: _distinct_cursor(1).to_dict(),
        Progress: _distinct_progress(1).to_dict(),
        ProgressTree: _distinct_tree().to_dict(),
        RunEnd: _distinct_end().to_dict(),
    }


@pytest.mark.parametrize("cls", [Counts, Cursor, Progress, ProgressTree, RunEnd], ids=lambda c: c.__name__)
def test_from_dict_rejects_each_missing_key(cls):
    valid = _valid_dicts()[cls]
    for key in valid:
        if cls is ProgressTree and key in ("end", "anomalies"):
            continue  # added later: see test_a_tree_of_an_earlier_version_without_..._reads_as_...
        broken = {k: v for k, v in valid.items() if k != key}
        with pytest.raises(ProgressSchemaError, match="missing") as caught:
            cls.from_dict(broken)
        assert key in str(caught.value)


@pytest.mark.parametrize("cls", [Counts, Cursor, Progress, ProgressTree, RunEnd], ids=lambda c: c.__name__)
@pytest.mark.parametrize("extra", ["bogus", "Ready", 7])
def test_from_dict_rejects_unknown_keys(cls, extra):
    data = dict(_valid_dicts()[cls])
    data[extra] = 0
    with pytest.raises(ProgressSchemaError, match="unknown") as caught:
        cls.from_dict(data)
    assert repr(extra) in str(caught.value)


@pytest.mark.parametrize("cls", [Counts, Cursor], ids=lambda c: c.__name__)
@pytest.mark.parametrize("bad", [-1, True, False, 1.0, 2.5, "3", None, [1], {"a": 1}])
def test_from_dict_rejects_negative_bool_and_non_int_values(cls, bad):
    for field in dataclasses.fields(cls):
        data = dict(_valid_dicts()[cls])
        data[field.name] = bad
        with pytest.raises(ProgressSchemaError) as caught:
            cls.from_dict(data)
        assert f"{cls.__name__}.{field.name}" in str(caught.value)


@pytest.mark.parametrize("bad", [None, 3, "x", [1, 2], True])
def test_from_dict_rejects_non_mappings(bad):
    for cls in (Counts, Cursor, Progress, ProgressTree):
        with pytest.raises(ProgressSchemaError, match="mapping"):
            cls.from_dict(bad)


def test_a_tree_of_an_earlier_version_without_anomalies_reads_as_none():
    data = _distinct_tree().to_dict()
    del data["anomalies"]
    assert decode_tree(msgpack.packb(_envelope(tree=data))).anomalies == []


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_anomaly_value_round_trips_and_its_tree_equals_itself(value):
    tree = dataclasses.replace(_distinct_tree(), anomalies=[dataclasses.replace(_distinct_anomaly(), value=value)])
    decoded = decode_tree(encode_tree(tree))
    assert decoded.to_dict() == tree.to_dict()  # NaN equals nothing: it travels as text
    assert str(decoded.anomalies[0].value) == str(value)


@pytest.mark.parametrize("field, bad", [("kind", "overflow"), ("value", "1.5"), ("value", None),
                                        ("rolled_back_to", 3), ("skipped", [[1]]), ("skipped", [[-1, 2]])])
def test_anomaly_from_dict_rejects_bad_values(field, bad):
    data = _distinct_anomaly().to_dict()
    data[field] = bad
    with pytest.raises(ProgressSchemaError, match=f"Anomaly.{field}"):
        Anomaly.from_dict(data)


def test_a_tree_of_an_earlier_version_without_end_reads_as_not_ended():
    data = _distinct_tree().to_dict()
    del data["end"]
    envelope = msgpack.packb(_envelope(tree=data))
    assert decode_tree(envelope).end is None
    assert decode_tree(envelope).cursor == _distinct_cursor(5001)


@pytest.mark.parametrize("field, bad", [("reason", ""), ("reason", None), ("reason", 3), ("max_epochs", -1),
                                        ("max_steps", 2.5), ("max_steps", True), ("max_time", -1.0),
                                        ("max_time", float("nan")), ("max_time", "10")])
def test_run_end_from_dict_rejects_bad_values(field, bad):
    data = _distinct_end().to_dict()
    data[field] = bad
    with pytest.raises(ProgressSchemaError, match=f"RunEnd.{field}"):
        RunEnd.from_dict(data)


@pytest.mark.parametrize("now, raised", [
    ((3, 20, 60.0), []),
    ((2, 10, 30.0), []),  # lowered: not raised
    ((4, 20, 60.0), ["max_epochs 3 -> 4"]),
    ((3, None, 60.0), ["max_steps 20 -> no limit"]),
    ((3, 21, 61.0), ["max_steps 20 -> 21", "max_time 60.0 -> 61.0"]),
])
def test_run_end_names_the_raised_limits(now, raised):
    assert RunEnd("done", max_epochs=3, max_steps=20, max_time=60.0).raised_limits(*now) == raised


def test_a_limit_that_was_unset_is_never_raised():
    assert RunEnd("early stopping", max_epochs=None, max_steps=None, max_time=None).raised_limits(5, 10, 1.0) == []


def test_progress_from_dict_rejects_bad_nested_counts():
    data = _distinct_progress(1).to_dict()
    data["current"]["processed"] = -5
    with pytest.raises(ProgressSchemaError, match="processed"):
        Progress.from_dict(data)


@pytest.mark.parametrize("records", [[1, 2], "fit.epochs", {1: Progress().to_dict()}, {"a": 3}])
def test_tree_from_dict_rejects_bad_records(records):
    with pytest.raises(ProgressSchemaError):
        ProgressTree.from_dict({"records": records, "cursor": None})


@pytest.mark.parametrize("cursor", [5, "epoch 1", {"epoch": 1}, {"epoch": -1, "batch": 0, "split": 0, "optimizer": 0}])
def test_tree_from_dict_rejects_bad_cursor(cursor):
    with pytest.raises(ProgressSchemaError):
        ProgressTree.from_dict({"records": {}, "cursor": cursor})


# ---- encode_tree / decode_tree -----------------------------------------------------------


def test_encoded_tree_is_a_versioned_msgpack_envelope():
    tree = _distinct_tree()
    envelope = msgpack.unpackb(encode_tree(tree), raw=False)
    assert envelope["schema"] == progress.SCHEMA_VERSION
    assert set(envelope) == {"kind", "schema", "tree"}
    assert isinstance(envelope["kind"], str)
    _assert_fields_equal(tree, ProgressTree.from_dict(envelope["tree"]))


def test_decode_tree_accepts_a_hand_built_envelope():
    # Built from the documented format, not with encode_tree.
    tree = {"records": {"fit.epochs": {"total": {"ready": 2, "started": 2, "processed": 1, "completed": 1},
                                       "current": {"ready": 1, "started": 1, "processed": 0, "completed": 0}}},
            "cursor": {"epoch": 1, "batch": 2, "split": 3, "optimizer": 0}}
    decoded = decode_tree(msgpack.packb(_envelope(tree=tree)))
    assert decoded.cursor == Cursor(1, 2, 3, 0)
    assert decoded.records["fit.epochs"].total == Counts(2, 2, 1, 1)
    assert decoded.records["fit.epochs"].current == Counts(1, 1, 0, 0)


@pytest.mark.parametrize("schema", [0, 2, 99, "1", None, -1])
def test_decode_rejects_other_schema_versions(schema):
    with pytest.raises(ProgressSchemaError, match="schema"):
        decode_tree(msgpack.packb(_envelope(schema=schema)))


@pytest.mark.parametrize("schema", [True, 1.0])
def test_decode_rejects_schema_version_of_the_wrong_type(schema):
    with pytest.raises(ProgressSchemaError):
        decode_tree(msgpack.packb(_envelope(schema=schema)))


@pytest.mark.parametrize("kind", ["splitloop.state", "", "SPLITLOOP.PROGRESS", 1, None])
def test_decode_rejects_wrong_kind(kind):
    with pytest.raises(ProgressSchemaError, match="kind"):
        decode_tree(msgpack.packb(_envelope(kind=kind)))


class _Harmless:
    def __reduce__(self):
        return (print, ("never",))


@pytest.mark.parametrize(
    "data",
    [b"", b"\xc1", b"\x92\x01", b"\x83\xa4kind", b'{"kind": "splitloop.progress"}',
     pickle.dumps(_Harmless(), protocol=0), pickle.dumps(_Harmless(), protocol=5),
     msgpack.packb(_envelope()) + b"\x00"],
    ids=["empty", "reserved-byte", "truncated-array", "truncated-map", "json", "pickle0", "pickle5", "trailing-bytes"],
)
def test_decode_rejects_bytes_that_are_not_msgpack(data):
    with pytest.raises(ProgressSchemaError):
        decode_tree(data)


@pytest.mark.parametrize("data", [msgpack.packb(1), msgpack.packb([1, 2, 3]), msgpack.packb("splitloop.progress"),
                                  msgpack.packb(None), msgpack.packb({1: 2})])
def test_decode_rejects_msgpack_that_is_not_an_envelope(data):
    with pytest.raises(ProgressSchemaError):
        decode_tree(data)


@pytest.mark.parametrize("code", [0, 1, 2, 3, 42, 127])
@pytest.mark.parametrize("where", ["top", "kind", "schema", "counter", "cursor", "record-name-value"])
def test_decode_rejects_msgpack_extension_types(code, where):
    ext = msgpack.ExtType(code, b"\x00payload")
    tree = {"records": {"fit.epochs": Progress().to_dict()}, "cursor": Cursor().to_dict()}
    if where == "top":
        data = msgpack.packb(ext)
    elif where == "kind":
        data = msgpack.packb(_envelope(kind=ext))
    elif where == "schema":
        data = msgpack.packb(_envelope(schema=ext))
    elif where == "counter":
        tree["records"]["fit.epochs"]["total"]["ready"] = ext
        data = msgpack.packb(_envelope(tree=tree))
    elif where == "cursor":
        tree["cursor"]["split"] = ext
        data = msgpack.packb(_envelope(tree=tree))
    else:
        tree["records"]["fit.epochs"] = ext
        data = msgpack.packb(_envelope(tree=tree))
    with pytest.raises(ProgressSchemaError, match="extension"):
        decode_tree(data)


@pytest.mark.parametrize("extra", [{"extra": 1}, {"pickle": b"\x80\x04"}, {"Kind": "splitloop.progress"}])
def test_decode_rejects_extra_envelope_keys(extra):
    envelope = _envelope()
    envelope.update(extra)
    with pytest.raises(ProgressSchemaError):
        decode_tree(msgpack.packb(envelope))


@pytest.mark.parametrize("missing", ["kind", "schema", "tree"])
def test_decode_rejects_missing_envelope_keys(missing):
    envelope = _envelope()
    del envelope[missing]
    with pytest.raises(ProgressSchemaError):
        decode_tree(msgpack.packb(envelope))


def test_decode_rejects_extra_keys_inside_the_tree():
    tree = _distinct_tree().to_dict()
    tree["records"]["fit.epochs"]["total"]["skipped"] = 1
    with pytest.raises(ProgressSchemaError, match="skipped"):
        decode_tree(msgpack.packb(_envelope(tree=tree)))
    tree = _distinct_tree().to_dict()
    tree["hidden"] = None
    with pytest.raises(ProgressSchemaError, match="hidden"):
        decode_tree(msgpack.packb(_envelope(tree=tree)))


def test_schema_error_is_a_value_error():
    assert issubclass(ProgressSchemaError, ValueError)


# ---- independence from torch and engine --------------------------------------------------

_IMPORT_PROBE = """
import json, sys, types
{setup}
import progress
tree = progress.ProgressTree(records={{"a": progress.Progress()}}, cursor=progress.Cursor(1, 2, 3, 0))
assert progress.decode_tree(progress.encode_tree(tree)) == tree
loaded = sorted(name for name in sys.modules
                if name.split(".")[0] in ("torch", "engine"))
print(json.dumps(loaded))
"""


def _modules_loaded_by(setup: str, cwd) -> list[str]:
    result = subprocess.run([sys.executable, "-c", _IMPORT_PROBE.format(setup=setup)],
                            capture_output=True, text=True, timeout=120, cwd=cwd)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_importing_progress_does_not_import_torch_nor_engine(tmp_path):
    assert _modules_loaded_by("", tmp_path) == []


def test_import_probe_detects_torch_and_engine_modules(tmp_path):
    # Control for the test above (without paying for a real torch import): the probe reports
    # torch and engine modules when they are present in sys.modules.
    setup = "for name in ('torch', 'torch.nn', 'engine.checkpoint'): sys.modules[name] = types.ModuleType(name)"
    assert _modules_loaded_by(setup, tmp_path) == ["engine.checkpoint", "torch", "torch.nn"]
