"""Pickle-free, verified, atomically committed checkpoints over fsspec.

Modules: ``codec`` (state tree <-> msgpack + raw tensor bytes), ``manifest`` (the commit
record with sizes and checksums), ``store`` (the commit protocol, listing, verifying, loading,
retention).
"""
