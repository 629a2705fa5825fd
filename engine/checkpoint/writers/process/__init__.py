"""The writer process (``CheckpointConfig(writer="process")``): the training side
(``writer``: ``ProcessWriter``), the process itself (``main``, run as ``python -m
engine.checkpoint.writers.process.main``), their messages (``channel``) and the shared-memory
slots the snapshots travel in (``arena``).

Torch-free on the process's side: nothing here imports torch at import time.
"""
