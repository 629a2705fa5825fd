"""Forged parts of a sharded (FSDP2) checkpoint, their checksums recomputed so that sizes and
checksums all match: each is decoded and checked when a checkpoint is chosen, so the forged
checkpoint is INVALID with a reason naming it, and ``inspect``, ``load_weights``,
``export_weights`` and a 2-rank torchrun resume all take the one before (the resume ending bit
for bit as the uninterrupted run). A huge global shape is refused before anything is allocated
for it. The checkpoints come from a real 2-rank job of tests/distributed/fsdp_train.py."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
from typing import Any, Callable

import pytest
import torch

import engine
import forkserver
import fsdp_train
import torchrun_helpers as helpers
from engine.checkpoint.format.shards import TensorShard
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.cli.commands import inspect_run
from forged_checkpoints import MAIN, rank_part, replace_files, rewrite
from resume_helpers import copy_run_until

pytestmark = pytest.mark.slow
RANK_1 = rank_part(1)
WEIGHT = "embedding.weight"  # 15 rows of 8: rank 0 holds rows 0..7, rank 1 rows 8..14
# One epoch of whole batches (no TBPTT), one optimizer step each: 4 steps, a checkpoint after each.
OPTIONS = ("--epochs", "1", "--whole-batches", "--accumulate", "1")
LOAD_UNDER_LIMIT = str(pathlib.Path(__file__).with_name("export_under_memory_limit.py"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """An uninterrupted 2-rank sharded job (a checkpoint every step, the last 3 kept)."""
    tmp = tmp_path_factory.mktemp("forged")
    process, _, _ = helpers.train(tmp, "reference", 2, *OPTIONS, script=helpers.FSDP_SCRIPT)
    assert process.returncode == 0, process.stderr[-4000:]
    return tmp / "reference"


def _forged_copy(reference: pathlib.Path, run_dir: pathlib.Path,
                 forgeries: list[tuple[tuple[str, str], Callable[[Any], Any]]]) -> tuple[str, str]:
    """A copy of the reference run up to its second newest checkpoint, which is forged; returns
    (its name, the name of the one before)."""
    names = CheckpointStore(Storage(str(reference / "run")), create=False).names()
    forged, previous = names[-2], names[-3]
    copy_run_until(str(reference / "run"), str(run_dir), forged)
    for files, edit in forgeries:
        rewrite(run_dir / "checkpoints" / forged, files, edit)
    return forged, previous


def _placed(**changes: Any) -> Callable[[Any], Any]:
    """An edit of the embedding weight's shard: its placement fields replaced."""
    def edit(tree: Any) -> Any:
        shard = tree["module"][WEIGHT]
        assert isinstance(shard, TensorShard)
        tree["module"][WEIGHT] = dataclasses.replace(shard, **{key: tuple(value) for key, value in changes.items()})
        return tree
    return edit


def _local(change: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Any], Any]:
    def edit(tree: Any) -> Any:
        tree["module"][WEIGHT] = dataclasses.replace(tree["module"][WEIGHT], local=change(tree["module"][WEIGHT].local))
        return tree
    return edit


def _signature(**changes: Any) -> Callable[[Any], Any]:
    def edit(tree: Any) -> Any:
        tree["signature"].update(changes)
        return tree
    return edit


def _without(key: str) -> Callable[[Any], Any]:
    return lambda tree: {name: value for name, value in tree.items() if name != key}


def _rng(tree: Any) -> Any:
    tree["rng"] = {"torch": "not a state"}
    return tree


FORGERIES: dict[str, tuple[list[tuple[tuple[str, str], Callable[[Any], Any]]], str]] = {
    "offsets outside the tensor": ([(RANK_1, _placed(offsets=(9, 0)))], "lies outside the global shape"),
    "overlapping offsets": ([(RANK_1, _placed(offsets=(7, 0)))], "two saved shards overlap at offsets [7, 0]"),
    "a gap": ([(RANK_1, _local(lambda local: local[:6]))], "do not cover the global shape (15, 8)"),
    "another dtype": ([(RANK_1, _local(lambda local: local.double()))], "disagree on the global shape, dtype"),
    "negative offset": ([(RANK_1, _placed(offsets=(-1, 0)))], "offsets is malformed"),
    "a mesh of another size": ([(MAIN, _placed(mesh_shape=(4,))), (RANK_1, _placed(mesh_shape=(4,)))],
                               "device mesh of shape [4] (4 ranks) by 2 rank(s)"),
    "a larger world size": ([(MAIN, _signature(world_size=3))], "needs the parts of ranks 1..2"),
    "a signature that hides the sharding": ([(MAIN, _signature(sharded=False))],
                                            "its model holds sharded tensors but its signature does not record"),
    "a rank part without its shards": ([(RANK_1, _without("module"))], "a rank part has keys"),
    "a malformed RNG state in a rank part": ([(RANK_1, _rng)], "(the part of rank 1): the RNG state is malformed"),
    "a huge global shape": ([(files, _placed(global_shape=(2 ** 40, 8))) for files in (MAIN, RANK_1)],
                            "global shape (1099511627776, 8) is larger than any real tensor"),
    "a large global shape the shards do not cover": (
        [(files, _placed(global_shape=(2 ** 28, 8))) for files in (MAIN, RANK_1)],
        "do not cover the global shape (268435456, 8)"),
}


def _garbage_part(run_dir: pathlib.Path, forged: str) -> None:
    replace_files(run_dir / "checkpoints" / forged, {"rank-00001.msgpack": b"\xc1 not msgpack"})


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_a_forged_part_makes_the_checkpoint_invalid_and_every_reader_takes_the_one_before(
        forgery: str, reference: pathlib.Path, tmp_path: pathlib.Path) -> None:
    forgeries, message = FORGERIES[forgery]
    run_dir = tmp_path / "run"
    forged, previous = _forged_copy(reference, run_dir, forgeries)
    _assert_invalid_and_skipped(run_dir, forged, previous, message, tmp_path)


def test_a_rank_part_that_is_not_msgpack_is_invalid_naming_the_checkpoint_and_the_part(
        reference: pathlib.Path, tmp_path: pathlib.Path) -> None:
    run_dir = tmp_path / "run"
    forged, previous = _forged_copy(reference, run_dir, [])
    _garbage_part(run_dir, forged)
    _assert_invalid_and_skipped(run_dir, forged, previous, "the part of rank 1 (rank-00001.msgpack / rank-00001.bin): "
                                                            "state header is not valid msgpack", tmp_path)


def _assert_invalid_and_skipped(run_dir: pathlib.Path, forged: str, previous: str, message: str,
                                tmp_path: pathlib.Path) -> None:
    report = inspect_run(str(run_dir))
    entry = next(entry for entry in report["checkpoints"] if entry["name"] == forged)
    assert entry["valid"] is False and entry["error"].startswith(forged) and message in entry["error"], entry["error"]
    assert report["latest"] == previous
    with pytest.warns(UserWarning, match=f"skipping checkpoint {forged}"):
        assert engine.load_weights(fsdp_train.Model(), str(run_dir)) == previous
    with pytest.warns(UserWarning, match=f"skipping checkpoint {forged}"):
        assert engine.export_weights(str(run_dir), str(tmp_path / "model.pt")) == previous
    with pytest.raises(engine.CheckpointCorrupt, match=f"^{forged}"):
        engine.load_weights(fsdp_train.Model(), str(run_dir), checkpoint=forged)


def test_a_huge_global_shape_is_refused_before_anything_is_allocated_for_it(reference: pathlib.Path,
                                                                           tmp_path: pathlib.Path) -> None:
    # 2**28 x 8 float32 is 8 GiB: under an address-space limit of 1 GiB more than the process
    # already maps, an allocation for it fails with a raw RuntimeError instead of the fallback.
    forgeries, _ = FORGERIES["a large global shape the shards do not cover"]
    forged, previous = _forged_copy(reference, tmp_path / "run", forgeries)
    process = forkserver.run([sys.executable, LOAD_UNDER_LIMIT, str(tmp_path / "run"), str(tmp_path / "model.pt")],
                             env=helpers.environment(), capture_output=True, text=True, timeout=helpers.TIMEOUT)
    assert process.returncode == 0, process.stderr[-4000:]
    assert process.stdout.split() == [previous, forged], process.stdout


def test_a_two_rank_resume_over_a_forged_newest_checkpoint_takes_the_one_before_and_ends_exactly(
        reference: pathlib.Path, tmp_path: pathlib.Path) -> None:
    job = tmp_path / "job"
    forgeries, _ = FORGERIES["offsets outside the tensor"]
    forged, previous = _forged_copy(reference, job / "run", forgeries)
    (job / "out").mkdir()
    process = helpers.run(helpers.torchrun_command(2, job / "run", job / "out", *OPTIONS,
                                                   script=helpers.FSDP_SCRIPT, forked_ranks=True),
                          helpers.environment())
    assert process.returncode == 0, process.stderr[-4000:]
    assert f"skipping checkpoint {forged}" in process.stderr
    resumes = [json.loads(line) for line in (job / "run" / "resumes.jsonl").read_text().splitlines()]
    assert [row["checkpoint"] for row in resumes] == [previous]
    helpers.assert_same_result(reference, job, 2)
