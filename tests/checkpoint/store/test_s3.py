"""``s3://`` run directories against a real S3 protocol server (moto, tests/s3_server.py): the
manifest, created only if absent, is the commit point; a writer that finds a name taken never
overwrites or deletes it; a writer that lost the lease never changes metrics.jsonl; runs killed
mid-checkpoint resume bit-exactly; the CLI reads them."""

import json
import sys

import fsspec
import pytest
import torch

from engine.checkpoint.format.codec import encode_state
from engine.checkpoint.store.request import CommitRequest
from engine.checkpoint.store.lease import WriterLease
from engine.checkpoint.format.manifest import MANIFEST_FILE
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.cli.plot import plot_run, read_rows
from engine.errors import ConfigError, WriterConflict
from engine.checkpoint.store.metrics_log import METRICS_FILE, RESUMES_FILE, MetricsLog
import forkserver
from kill_helpers import environment, run_until_done
from progress import Cursor, ProgressTree, encode_tree
from resume_helpers import assert_same_run
from s3_server import s3_endpoint, s3_run_url  # noqa: F401  (fixtures)
from scenarios import train_with_checkpoints


def commit(store, sequence, generation, value):
    cursor = Cursor(0, 0, sequence, 0)
    return store.write(CommitRequest.of_state(encode_state({"weight": torch.full((3,), float(value))}),
                                              encode_tree(ProgressTree(cursor=cursor)), cursor, generation,
                                              sequence=sequence))


def objects(url):
    filesystem, root = fsspec.core.url_to_fs(url, use_listings_cache=False)
    return {path[len(root) + 1:]: filesystem.cat_file(path) for path in filesystem.find(root)}


# ---- set-up ---------------------------------------------------------------------------------------
def test_an_s3_url_without_s3fs_is_a_clear_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "s3fs", None)  # import s3fs now raises ImportError
    with pytest.raises(ConfigError, match=r"splitloop\[s3\]"):
        Storage("s3://some-bucket/run")


def test_the_endpoint_comes_from_the_s3_specific_variable_first(s3_run_url, monkeypatch, s3_endpoint):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_endpoint)
    storage = Storage(s3_run_url)
    storage.write("probe", [b"reached"], durable=True)
    assert storage.read("probe") == b"reached"


# ---- the commit point -----------------------------------------------------------------------------
def test_commit_verify_and_retention_on_s3(s3_run_url):
    train_with_checkpoints("plain", s3_run_url, epochs=1, keep_last=2)
    store = CheckpointStore(Storage(s3_run_url, create=False), create=False)
    names = store.names()
    assert len(names) == 2 and "ckpt-0000000001" not in names  # one per batch (3 batches), 2 kept
    assert all(store.verifies(name) for name in names)
    assert store.latest().name == names[-1]
    assert len(read_rows(Storage(s3_run_url, create=False), METRICS_FILE)) == 3


def test_a_stale_writers_manifest_create_is_refused(s3_run_url):
    store = CheckpointStore(Storage(s3_run_url))
    manifest_path = f"checkpoints/ckpt-0000000005/{MANIFEST_FILE}"
    # The writer that took over committed ckpt-5 with its manifest (its data files aside).
    commit(CheckpointStore(Storage(s3_run_url)), 5, generation=2, value=2.0)
    winner_manifest = store.storage.read(manifest_path)
    for data_file in ("tensors.bin", "state.msgpack", "progress.msgpack"):
        store.storage.remove_file(f"checkpoints/ckpt-0000000005/{data_file}")
    with pytest.raises(WriterConflict, match="ckpt-0000000005"):
        commit(store, 5, generation=1, value=1.0)
    assert store.storage.read(manifest_path) == winner_manifest


def test_a_stale_writer_cannot_overwrite_or_delete_a_committed_checkpoint(s3_run_url):
    commit(CheckpointStore(Storage(s3_run_url)), 5, generation=2, value=2.0)
    before = objects(s3_run_url)
    stale = CheckpointStore(Storage(s3_run_url))
    with pytest.raises(WriterConflict, match="overtaken"):
        commit(stale, 5, generation=1, value=1.0)
    assert objects(s3_run_url) == before
    loaded = CheckpointStore(Storage(s3_run_url)).load("ckpt-0000000005")
    assert loaded.manifest.writer_generation == 2
    assert torch.equal(loaded.state["weight"], torch.full((3,), 2.0))


def test_data_files_without_a_manifest_are_never_a_checkpoint(s3_run_url):
    store = CheckpointStore(Storage(s3_run_url))
    commit(store, 1, generation=1, value=1.0)
    commit(store, 2, generation=1, value=2.0)
    store.storage.remove_file(f"checkpoints/ckpt-0000000002/{MANIFEST_FILE}")  # as if killed before it
    fresh = CheckpointStore(Storage(s3_run_url))
    with pytest.warns(UserWarning, match="ckpt-0000000002"):
        assert fresh.latest().name == "ckpt-0000000001"
    assert fresh.next_sequence() == 3  # the torn name is never reused


def test_a_new_writer_aborts_the_uploads_a_killed_one_left_unfinished(s3_run_url):
    store = CheckpointStore(Storage(s3_run_url))
    s3 = store.storage.fs
    bucket, key, _ = s3.split_path(store.storage.path("checkpoints/ckpt-0000000001/tensors.bin"))
    s3.call_s3("create_multipart_upload", Bucket=bucket, Key=key)  # a killed writer's torn upload
    outside = s3.call_s3("create_multipart_upload", Bucket=bucket, Key="elsewhere/big.bin")
    store.remove_temporaries()
    left = [upload["Key"] for upload in s3.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])]
    assert left == ["elsewhere/big.bin"]  # only the run's own checkpoints/ is cleaned
    s3.call_s3("abort_multipart_upload", Bucket=bucket, Key="elsewhere/big.bin", UploadId=outside["UploadId"])


def test_an_asynchronous_run_on_s3_equals_a_local_one(s3_run_url, tmp_path):
    reference = str(tmp_path / "reference")
    train_with_checkpoints("tbptt", reference, epochs=1)
    train_with_checkpoints("tbptt", s3_run_url, epochs=1, asynchronous=True)  # s3fs from the writer thread
    assert_same_run(reference, s3_run_url)


# ---- metrics.jsonl and resumes.jsonl (objects cannot be appended to in place) ----------------------
def test_appends_rewrite_the_object_and_keep_every_byte_past_the_multipart_threshold(s3_run_url):
    storage = Storage(s3_run_url)
    head = b"x" * (5 * 2**20 + 3)  # beyond 5 MiB s3fs copies the old bytes server-side
    storage.write(METRICS_FILE, [head], durable=False)
    storage.append(METRICS_FILE, b"tail\n")
    storage.append(METRICS_FILE, b"more\n")
    assert storage.read(METRICS_FILE) == head + b"tail\nmore\n"
    storage.truncate(METRICS_FILE, len(head) + 5)
    assert storage.read(METRICS_FILE) == head + b"tail\n"


class Writer:
    """One writer of a run dir: its lease (the fence) and its metrics.jsonl."""

    def __init__(self, url, stale_after):
        self.storage = storage = Storage(url)
        self.lease = WriterLease(storage, stale_after=stale_after)
        self.lease.acquire()
        self.metrics = MetricsLog(storage)
        self.metrics.fence_with(self.lease.verify)
        self.splits = 0

    def train(self, splits):
        """Buffer the rows of ``splits`` more splits; the length a checkpoint would record."""
        for _ in range(splits):
            self.splits += 1
            self.metrics.append(Cursor(0, 0, self.splits, 0), [float(self.splits)], self.splits)
        return self.metrics.snapshot()

    def commit(self, length):
        """What a checkpoint commit does with its metrics: fence, then write (writer.py)."""
        self.lease.verify()
        self.metrics.write_until(length)


def first_writer(url):
    """Generation 1, whose heartbeat (every 20 s) does not beat while the next one watches."""
    writer = Writer(url, stale_after=60)
    writer.metrics.start_fresh()
    writer.commit(writer.train(3))
    return writer


def take_over(url, committed_bytes, splits=2):
    """Generation 2: takes the unchanged lease over after 0.3 s, resumes at a checkpoint that
    recorded ``committed_bytes``, trains and commits its lines."""
    writer = Writer(url, stale_after=0.3)
    writer.metrics.resume_at(committed_bytes)
    writer.splits = 10
    writer.commit(writer.train(splits))
    return writer


def test_a_writer_that_lost_the_lease_never_changes_the_new_holders_metrics(s3_run_url):
    """The stale writer passed its commit's fence check, then the lease was taken over and the
    new holder committed lines; the stale writer's write comes after. (Before, it cut the file
    back to its own length, deleting the new holder's lines.)"""
    stale = first_writer(s3_run_url)
    length = stale.train(2)
    stale.lease.verify()  # the commit's fence check passes ...
    holder = take_over(s3_run_url, stale.metrics.committed_bytes)  # ... then the lease is taken over
    storage = Storage(s3_run_url)
    written = storage.read(METRICS_FILE)
    assert len(written.splitlines()) == 5
    with pytest.raises(WriterConflict, match="generation 2"):
        stale.metrics.write_until(length)
    assert storage.read(METRICS_FILE) == written
    holder.commit(holder.train(1))  # the holder goes on, its lines all there
    assert storage.read(METRICS_FILE).startswith(written) and len(storage.read(METRICS_FILE).splitlines()) == 6


def test_a_takeover_between_the_stale_writers_last_check_and_its_write_changes_nothing(s3_run_url):
    """The lease is taken over right after the fence check inside the stale writer's write:
    its conditional PutObject (If-Match on the version it read) is refused."""
    stale = first_writer(s3_run_url)
    length = stale.train(2)
    taken_over = []

    def fence_then_lose_the_lease():
        stale.lease.verify()
        taken_over.append(take_over(s3_run_url, stale.metrics.committed_bytes))

    stale.metrics.fence_with(fence_then_lose_the_lease)
    with pytest.raises(WriterConflict, match="changed while this writer appended"):
        stale.metrics.write_until(length)
    assert taken_over
    lines = Storage(s3_run_url).read(METRICS_FILE).decode().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 11, 12]


def test_past_5_mib_the_holder_keeps_its_bytes_server_side_and_cuts_a_stale_writers(s3_run_url, monkeypatch):
    """From 5 MiB the kept bytes are copied server-side into a multipart upload: every byte the
    holder committed stays, bytes a stale writer appended beyond them go. The copy and the
    completion are conditional on the version read (moto does not enforce these two
    conditions: the requests are checked here, the refusal on a small object above)."""
    storage = Storage(s3_run_url)
    head = b"x" * (5 * 2**20 + 3) + b"\n"
    storage.write(METRICS_FILE, [head], durable=False)
    holder = Writer(s3_run_url, stale_after=60)
    holder.metrics.resume_at(len(head))
    storage.append(METRICS_FILE, b'{"stage": "train", "stale": true}\n')
    s3 = holder.storage.fs
    bucket, key, _ = s3.split_path(storage.path(METRICS_FILE))
    version = s3.call_s3("head_object", Bucket=bucket, Key=key)["ETag"]
    calls = []
    original = s3.call_s3
    monkeypatch.setattr(s3, "call_s3", lambda method, **kwargs: calls.append((method, kwargs)) or original(method, **kwargs))
    holder.commit(holder.train(2))
    written = storage.read(METRICS_FILE)
    assert written[:len(head)] == head
    assert [json.loads(line)["step"] for line in written[len(head):].splitlines()] == [1, 2]
    conditions = {method: (kwargs.get("CopySourceIfMatch"), kwargs.get("IfMatch")) for method, kwargs in calls}
    assert conditions["upload_part_copy"] == (version, None)
    assert conditions["complete_multipart_upload"] == (None, version)


def test_plot_reads_an_s3_run_directory(s3_run_url, tmp_path):
    train_with_checkpoints("plain", s3_run_url, epochs=1)
    train_with_checkpoints("plain", s3_run_url, epochs=2)  # resumes: one row in resumes.jsonl
    drawn = plot_run(s3_run_url, str(tmp_path / "curves.png"))
    assert drawn == {"train": 6, "val": 0, "resumes": 1, "anomalies": 0, "hangs": 0}
    assert (tmp_path / "curves.png").read_bytes().startswith(b"\x89PNG")


# ---- real processes -------------------------------------------------------------------------------
@pytest.mark.exhaustive  # CI time (about 50 s: the default run keeps the asynchronous S3 run equal to a local one and commit, verify and retention on S3)
@pytest.mark.slow
def test_runs_killed_before_their_manifest_resume_bit_exactly_on_s3(tmp_path, s3_run_url):
    reference = str(tmp_path / "reference")
    train_with_checkpoints("tbptt", reference, epochs=1, keep_last=3)
    # 12 splits, each process killed before the manifest of its 5th checkpoint. A killed
    # writer leaves its heartbeat lease behind, so each restart waits out the (short) expiry.
    kills = run_until_done("tbptt", s3_run_url, "checkpoint_before_manifest:5:sigkill", "--epochs", "1",
                           "--lease-expiry", "1")
    assert kills >= 2
    assert_same_run(reference, s3_run_url)
    storage = Storage(s3_run_url, create=False)
    assert len(read_rows(storage, RESUMES_FILE)) == kills  # appended once per resumed process
    assert storage.read(METRICS_FILE) == Storage(reference).read(METRICS_FILE)


@pytest.mark.slow
def test_inspect_reads_an_s3_run_directory(s3_run_url):
    train_with_checkpoints("plain", s3_run_url, epochs=1, keep_last=2)
    store = CheckpointStore(Storage(s3_run_url))
    older, newest = store.names()
    store.storage.remove_file(f"checkpoints/{newest}/{MANIFEST_FILE}")  # a torn newest one
    process = forkserver.run([sys.executable, "-m", "engine", "inspect", s3_run_url, "--json"], capture_output=True,
                             text=True, env=environment(None), timeout=120)
    assert process.returncode == 0, process.stderr[-3000:]
    report = json.loads(process.stdout)
    assert [(entry["name"], entry["valid"]) for entry in report["checkpoints"]] == [
        (older, True), (newest, False)]
    assert report["latest"] == older
    assert report["fingerprint"]
