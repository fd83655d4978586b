"""Conversions between promptfcl records and Flower records. Tensors travel as an `ArrayRecord`;
the kind and the JSON scalars as a `ConfigRecord` (one JSON string, so nesting survives)."""

from __future__ import annotations

import json

from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from promptfcl.federation.message import Message, Record

TENSORS, META, STATE = "promptfcl.tensors", "promptfcl.meta", "promptfcl.state"


PROMPTFCL_QUERY = "promptfcl"  # the one Flower query action every non-train kind travels under


def flower_message_type(kind: str) -> str:
    """Our kind → Flower's message type: "train" stays "train", every other kind travels as "query.promptfcl"
    (the kind itself is in the record's META, and the client program routes on it), so the ClientApp registers
    two handlers whatever kinds the methods declare, and its relay process needs no list of them."""
    return "train" if kind == "train" else f"query.{PROMPTFCL_QUERY}"


def to_record_dict(msg: Message) -> RecordDict:
    return RecordDict(
        {
            TENSORS: ArrayRecord(torch_state_dict={k: v.detach().cpu().contiguous() for k, v in msg.tensors.items()}),
            META: ConfigRecord({"kind": msg.kind, "scalars": json.dumps(msg.scalars)}),
        }
    )


def from_record_dict(content: RecordDict) -> Message:
    meta = content[META]
    tensors = content[TENSORS].to_torch_state_dict() if TENSORS in content else {}
    return Message(dict(tensors), json.loads(str(meta["scalars"])), kind=str(meta["kind"]))


def load_state(state: RecordDict) -> Record:
    """A node's persistent promptfcl state from Flower's `context.state` (empty on first contact)."""
    if STATE + ".meta" not in state:
        return Record()
    tensors = state[STATE + ".tensors"].to_torch_state_dict() if STATE + ".tensors" in state else {}
    return Record(dict(tensors), json.loads(str(state[STATE + ".meta"]["scalars"])))


def store_state(state: RecordDict, record: Record) -> None:
    state[STATE + ".tensors"] = ArrayRecord(
        torch_state_dict={k: v.detach().cpu().contiguous() for k, v in record.tensors.items()}
    )
    state[STATE + ".meta"] = ConfigRecord({"scalars": json.dumps(record.scalars)})
