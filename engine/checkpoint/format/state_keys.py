"""The top-level keys of a checkpoint's state tree, declared once.

engine.run.state builds and checks the tree (its module docstring shows it); the distributed
commit (engine.distributed) splits it into replicated and per-rank parts. Both import these
names: a key is never spelt twice.
"""

from typing import Any, Callable

SIGNATURE = "signature"
MODULE = "module"
OPTIMIZERS = "optimizers"
SCHEDULERS = "schedulers"
LOOPS = "loops"
RNG = "rng"
CALLBACKS = "callbacks"
METRICS_BYTES = "metrics_bytes"
ELAPSED_SECONDS = "elapsed_seconds"
ENVELOPE = "envelope"

STATE_KEYS = frozenset({SIGNATURE, MODULE, OPTIMIZERS, SCHEDULERS, LOOPS, RNG, CALLBACKS, METRICS_BYTES, ELAPSED_SECONDS,
                        ENVELOPE})

# Inside a callback's state: the hyperparameters of the module it runs (engine.lightning's
# save_hyperparameters()); ``python -m engine inspect`` shows them.
HYPERPARAMETERS = "hyperparameters"

# Checks a loaded state tree (the checkpoint's name, the tree); raises to refuse it
# (engine.run.state.validate is the run's).
StateValidator = Callable[[str, Any], None]
