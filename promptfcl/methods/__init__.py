"""Methods: each module registers a server program, a client program and its paper-default hyper-parameters."""

from promptfcl.methods import (  # noqa: F401  (register)
    c2prompt,
    capt,
    ccvr,
    clip_baselines,
    fedavg_ft,
    fedavg_prompt,
    fedcprompt,
    fedlwf_mc,
    fedmgp,
    fedproto,
    fedprox_prompt,
    fedvit,
    hepco,
    hgp,
    lorm,
    pilora,
    pool_baselines,
    powder,
)
from promptfcl.methods.registry import METHODS, register_method

__all__ = ["METHODS", "register_method"]
