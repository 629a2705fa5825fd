"""Pickle-free, verified, atomically committed checkpoints over fsspec.

Modules: ``codec`` (state tree <-> msgpack + raw tensor bytes), ``manifest`` (the commit
record with sizes and checksums), ``commit`` (the write protocol), ``store`` (listing,
verifying, loading, retention), ``policy`` (when to save).
"""
