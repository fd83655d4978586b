"""The promptfcl `ClientApp`: dispatches Flower messages to the configured method's client program.

Each SuperNode serves one client: `--node-config "partition-id=K num-partitions=N"`. The run config carries
the experiment YAML (`config-file`) and overrides (`overrides`, a JSON list of `key=value`). The client builds
the same `Runtime` as the in-process engine (data, scenario from the seed, frozen backbone), once per process,
and keeps its persistent state in `context.state`.
"""

from __future__ import annotations

import json

from flwr.app import ConfigRecord, Context, RecordDict
from flwr.app import Message as FlowerMessage
from flwr.clientapp import ClientApp

from promptfcl.config import load_config
from promptfcl.federation.inprocess import run_client
from promptfcl.federation.protocol import ClientProgram
from promptfcl.flower.records import from_record_dict, load_state, store_state, to_record_dict
from promptfcl.methods import METHODS
from promptfcl.runtime import Runtime

app = ClientApp()
_RUNTIMES: dict[str, tuple[Runtime, ClientProgram]] = {}


def runtime_for(context: Context) -> tuple[Runtime, ClientProgram]:
    """The runtime of this run's config, built once per process."""
    rc = context.run_config
    key = json.dumps([rc.get("config-file"), rc.get("overrides", "[]")])
    if key not in _RUNTIMES:
        cfg = load_config(str(rc["config-file"]), json.loads(str(rc.get("overrides", "[]"))))
        rt = Runtime.build(cfg)
        _RUNTIMES[key] = (rt, rt.programs()[1])
    return _RUNTIMES[key]


def handle(msg: FlowerMessage, context: Context) -> FlowerMessage:
    rt, client = runtime_for(context)
    cid = int(context.node_config["partition-id"])
    state = load_state(context.state)
    reply = run_client(
        client, from_record_dict(msg.content), cid, state, rt.scenario, rt.dataset.train, rt.cfg.seed, rt.device
    )
    store_state(context.state, state)
    return FlowerMessage(content=to_record_dict(reply), reply_to=msg)


@app.query("promptfcl_hello")
def hello(msg: FlowerMessage, context: Context) -> FlowerMessage:
    pid = int(context.node_config["partition-id"])
    return FlowerMessage(content=RecordDict({"hello": ConfigRecord({"partition-id": pid})}), reply_to=msg)


app.train()(handle)
for _kind in sorted({k for _, spec in METHODS.items() for k in spec.client.message_kinds} - {"train"}):
    app.query(_kind)(handle)
