"""One checkpoint tier or two: ``tiering`` (``SingleTier`` / ``TwoTiers``, chosen once) and
``fast`` (the fast node-local tier: its fence and lock, the tier writer and the copies into the
durable tier).

Imports engine.checkpoint.format, store and writers only.
"""
