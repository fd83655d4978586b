"""Validity signals of the methods whose defining mechanism is shared: the class-Gaussian server step (HGP, CCVR).

`rebalancing`: the server step retrains the head on features sampled from the clients' class Gaussians
(`method.rebalance` not `none`), and the final model predicts the test set better with the rebalanced head than
with the head FedAvg gave it in the last round (McNemar, `validity.component_mechanism`).
"""

from __future__ import annotations

from promptfcl.evaluation.validity import component_mechanism, switch_on

rebalancing_on = switch_on("rebalancing_on", "rebalance", "the server's head rebalancing")
rebalancing_mechanism = component_mechanism("rebalancing", "the server's head rebalancing")
