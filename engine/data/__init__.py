"""Training data: the position inside an epoch (resumable), streams, mixtures and TBPTT splitting."""

from engine.data.mixture import Mixture

__all__ = ["Mixture"]
