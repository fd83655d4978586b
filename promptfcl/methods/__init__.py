"""Methods: each module registers a server program, a client program and its paper-default hyper-parameters."""

from promptfcl.methods import ccvr, fedavg_ft, fedavg_prompt, fedproto, fedvit, hgp  # noqa: F401  (register)
from promptfcl.methods.registry import METHODS, register_method

__all__ = ["METHODS", "register_method"]
