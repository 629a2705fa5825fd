"""Who writes a checkpoint: the one ``Writer`` protocol (``protocol``) and the choice of a run's
writer, made once (``choice``: adding a writer is a module here and one line there); the
synchronous and background (thread) writers (``writer``; their
thread: ``worker``), the snapshot they take (``pending``, ``buffers``, the bulk copy
``snapshot_buffer``), how this process takes part in a commit (``committer``), and the writer
process (``process/``).

Imports engine.checkpoint.format and engine.checkpoint.store only.
"""
