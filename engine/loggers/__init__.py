"""Metric loggers: the rows of ``metrics.jsonl``, on rank 0, sent on to other tools as the run
produces them, and made to agree with ``metrics.jsonl`` again on every resume::

    config = engine.TrainerConfig(run_dir="runs/a", loggers=[
        engine.loggers.TensorBoard("runs/a/tensorboard"),   # needs splitloop[tensorboard]
        engine.loggers.CSV("runs/a/metrics.csv"),
    ])

``Logger`` is the base class of both, to subclass for another destination. Importing this
package does not import tensorboard; the TensorBoard logger imports it when a run starts.
See docs/loggers.md.
"""

from engine.loggers.base import Logger
from engine.loggers.csv_file import CSV
from engine.loggers.mlflow_tracker import MLflow
from engine.loggers.tensorboard import TensorBoard
from engine.loggers.wandb_tracker import WandB

__all__ = ["CSV", "Logger", "MLflow", "TensorBoard", "WandB"]
