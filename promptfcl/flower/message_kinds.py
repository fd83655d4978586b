"""Message kinds the Flower ClientApp registers a handler for, kept free of heavy imports.

Flower routes a message by its type, so the ClientApp must register one handler per kind at import time. The
ClientApp process only relays messages to the node worker, so it must not import the methods (and torch) to
learn their kinds: the list lives here, and a test checks it equals every registered method's
`ClientProgram.message_kinds`.
"""

CLIENT_MESSAGE_KINDS: tuple[str, ...] = (
    "train",
    "label_counts",  # CAPT
    "update",  # CAPT
    "stats",  # C2Prompt
    "gram",  # LoRM (end-of-task Gram matrices)
    "signature",  # Powder (and C2Prompt with base: powder)
    "evaluate",  # the client_local evaluation regime (FedMGP and the baselines on personalized scenarios)
)
