"""The loop tree. Each level is one object that owns its progress record and its state:

    FitLoop (epochs) -> EpochLoop (batches) -> [SplitLoop (TBPTT splits)] -> [OptimizerLoop] -> flow

``engine.loops.tree`` is the one place that reads feature flags and composes the tree.
"""
