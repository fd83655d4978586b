"""promptfcl: federated continual learning with prompts on frozen foundation models."""

__version__ = "0.1.0"
