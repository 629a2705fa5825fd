"""submitit integration: ``engine.submitit.Checkpointable(train_fn)`` (docs/faults.md).

Needs the ``submitit`` extra (``pip install 'splitloop[submitit]'``); importing ``engine`` never
imports submitit.
"""

from engine.submitit.checkpointable import Checkpointable

__all__ = ["Checkpointable"]
