"""Local training loops."""

from promptfcl.training.local import LocalTrainingParams, make_optimizer, masked_cross_entropy, train_local

__all__ = ["LocalTrainingParams", "make_optimizer", "masked_cross_entropy", "train_local"]
