"""One ``fit`` call at run time: the run itself, what its checkpoints hold, the run directory,
the display and preemption."""
