"""Training data: the position inside an epoch (resumable) and TBPTT splitting."""
