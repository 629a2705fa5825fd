"""Pickle-free, verified, atomically committed checkpoints over fsspec.

The modules, from the run's side down to the bytes (docs/concepts.md draws the path):

- What a run asks: ``checkpointing`` (the protocol, and ``NoCheckpoints`` for a run without
  any), ``policy`` (``RunCheckpointer``: saves, the lease, failures), ``cadence`` and ``budget``
  (when a checkpoint is due: fixed, or "auto" within an overhead budget), ``tiering`` and
  ``tiers`` (one tier, or a fast node-local tier in front of the run dir), ``resume_choice`` and
  ``abandoned`` (which checkpoint a run resumes from, and what a resume by name abandons).
- What a checkpoint holds: ``state_keys`` (the state tree's top-level keys), ``codec`` (state
  tree <-> msgpack + raw tensor bytes), ``manifest`` (the commit record with sizes and
  checksums), ``checksum``, ``rank_files`` and ``names`` (file and directory names),
  ``rank_parts`` (what each rank's part holds, and the check of every part when a checkpoint is
  loaded), ``shards`` (sharded tensors and their placements), ``bounds`` (the largest shapes a
  file may describe), ``fingerprint`` (a hash of the trained state).
- Writing and reading: ``writer`` (synchronous and background writers; ``worker`` is their
  thread), ``commit`` (the commit request and the single-process committer), ``staged`` (the
  commit protocol), ``catalogue`` (listing, verifying, loading), ``store`` (the catalogue plus
  committing and retention), ``retention`` (what to keep), ``file_lock`` (a non-blocking flock), ``lease`` (the writer lease and its
  fence), ``metrics_log`` (``metrics.jsonl``, exactly once).
- The run directory: ``storage`` (the protocol; ``storage_local``, ``storage_fsspec`` and
  ``storage_s3`` implement it, one chosen when a run dir is opened).

This package imports nothing from the run, the loops or engine.distributed: a torchrun group
takes part through the protocols ``policy.RankGroup`` and ``commit.Committer``.
"""
