"""One ``fit`` call at run time: the run itself, what its checkpoints hold, the metrics log,
the display and preemption."""
