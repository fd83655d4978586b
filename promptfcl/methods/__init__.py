"""Methods: one folder each (`promptfcl/methods/<name>/`) on the shared floor `methods/base/`.

Importing this package registers every method in `promptfcl.registry.METHODS`.
"""

from promptfcl.methods import (  # noqa: F401  (register)
    baselines,
    c2prompt,
    capt,
    ccvr,
    clip_baselines,
    fedavgm_prompt,
    fedcprompt,
    fedlwf_mc,
    fedmgp,
    fedproto,
    fedprox_prompt,
    hepco,
    hgp,
    lorm,
    pilora,
    powder,
)
from promptfcl.methods.base import register_method
from promptfcl.registry import METHODS

__all__ = ["METHODS", "register_method"]
