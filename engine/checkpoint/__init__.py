"""Pickle-free, verified, atomically committed checkpoints over fsspec.

The package is in rooms, each importing only the rooms below it (tests/test_architecture.py keeps
it so; docs/concepts.md draws the map):

- ``format/`` (the bottom): what a checkpoint holds, as bytes. ``state_keys`` (the state tree's
  top-level keys), ``codec``, ``tensor_bytes`` and ``encoded_state`` (state tree <-> msgpack +
  raw tensor bytes; ``bounds``: the largest shapes a file may describe), ``shards`` (sharded
  tensors and their placements), ``manifest`` and ``checksum`` (the commit record with sizes and
  checksums), ``names`` and ``rank_files`` (file and directory names), ``rank_parts`` (what each
  rank's part holds, checked when a checkpoint is loaded), ``fingerprint`` (a hash of the
  trained state).
- ``store/``: where checkpoints live. ``storage`` (the ``Storage`` protocol; ``local_storage``,
  ``fsspec_storage`` and ``s3_storage`` implement it, one chosen when a run dir is opened),
  ``catalogue`` (listing, verifying, loading), ``request`` (the plain-data ``CommitRequest``),
  ``staged`` (the commit protocol), ``checkpoint_store`` (the catalogue plus committing and
  cleaning up), ``retention`` (what to keep), ``lease`` and ``file_lock`` (the writer lease and
  its fence), ``metrics_log`` (``metrics.jsonl``, exactly once, or a null file), ``abandoned`` (what a resume by
  name abandons).
- ``writers/``: who writes. ``protocol`` (the one ``Writer`` protocol the rest of the package
  sees), ``choice`` (the kind of writer, chosen once from the configuration, and how it is
  built), ``writer`` (synchronous and background writers; ``worker`` is their thread), ``pending`` and ``buffers`` (the snapshot handed to a writer and the buffers it is
  copied into; ``snapshot_buffer``: the bulk copy), ``committer`` (how this process takes part in
  a commit), ``process/`` (the writer process: ``writer``, ``main``, ``channel``, ``arena``).
- ``tiers/``: ``tiering`` (one tier or two, chosen once) and ``fast`` (the fast node-local tier).
- The front, what a run asks: ``plan`` (``CheckpointPlan``: the configuration resolved once, with
  every rule that ties its fields together and its refusals), ``checkpointing`` (the protocol,
  and ``NoCheckpoints`` for a run without any), ``policy`` (``RunCheckpointer``: saves, the lease, failures), ``cadence`` and
  ``budget`` (when a checkpoint is due: fixed, or "auto" within an overhead budget),
  ``resume_choice`` (which checkpoint a run resumes from).

This package imports nothing from the run, the loops or engine.distributed: a torchrun group
takes part through the protocols ``policy.RankGroup`` and ``writers.committer.Committer``. It
imports nothing at import time either: the writer process imports its modules without torch.
"""
