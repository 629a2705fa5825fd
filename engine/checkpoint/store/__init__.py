"""Where checkpoints live: the run directory behind the ``Storage`` protocol and its local,
fsspec and S3 implementations, the catalogue of its checkpoints, committing one (the commit
request, the staged commit protocol, the store), retention, the writer lease, ``metrics.jsonl``
and the record of abandoned checkpoints.

The three storage implementations are imported here, once, so that ``Storage(url)`` finds each
of them registered (engine.checkpoint.store.storage imports none of them).
"""

from engine.checkpoint.store import fsspec_storage, local_storage, s3_storage  # noqa: F401  (each registers itself)
