"""Pickle-free, verified, atomically committed checkpoints over fsspec.

Modules: ``storage`` (the run directory behind a protocol; ``storage_local``,
``storage_fsspec``, ``storage_s3`` implement it), ``codec`` (state tree <-> msgpack + raw tensor
bytes), ``manifest`` (the commit record with sizes and checksums), ``names`` (the names under
checkpoints/), ``commit`` (the commit request; the single-process committer), ``staged`` (the
commit protocol), ``catalogue`` (listing, verifying, loading), ``store`` (the catalogue plus
committing and retention), ``retention`` (what to keep), ``writer`` (synchronous and background
writers; ``worker`` is their thread), ``lease`` (the writer lease).
"""
