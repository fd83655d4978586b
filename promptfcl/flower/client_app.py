"""The promptfcl `ClientApp`: dispatches Flower messages to the configured method's client program.

Each SuperNode serves one client: `--node-config "partition-id=K num-partitions=N"`. The run config carries
the experiment YAML (`config-file`) and overrides (`overrides`, a JSON list of `key=value`). The client's
persistent state lives in `context.state`.

With `node-worker = true` (the app's default) the message is relayed to the node's long-lived worker
(`promptfcl.flower.node_worker`), which builds the runtime — dataset, scenario, frozen backbone — once per
node rather than once per message; this process then imports only Flower. With `node-worker = false` (used by
Flower's simulation runtime, whose workers live for the whole run) the step runs here, with the runtime cached
per process. Both paths run the same `client_step`. Optional node-config key: `worker-dir` (where the worker's
socket, status and log live; default a private folder under the system temp dir).
"""

from __future__ import annotations

from flwr.app import ConfigRecord, Context, RecordDict
from flwr.app import Message as FlowerMessage
from flwr.clientapp import ClientApp

app = ClientApp()


def _replace(target: RecordDict, source: RecordDict) -> None:
    for key in list(target.keys()):
        del target[key]
    for key, value in source.items():
        target[key] = value


def handle(msg: FlowerMessage, context: Context) -> FlowerMessage:
    pid = int(context.node_config["partition-id"])
    if bool(context.run_config.get("node-worker", True)):
        from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
        from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict  # pylint: disable=E0611

        from promptfcl.flower.worker_link import call_worker

        reply, state = call_worker(
            context.node_config,
            context.node_id,
            context.run_config,
            recorddict_to_proto(msg.content).SerializeToString(),
            recorddict_to_proto(context.state).SerializeToString(),
        )
        _replace(context.state, recorddict_from_proto(ProtoRecordDict.FromString(state)))
        content = recorddict_from_proto(ProtoRecordDict.FromString(reply))
    else:
        from promptfcl.flower.node_worker import client_step

        content = client_step(context.run_config, pid, msg.content, context.state)
    return FlowerMessage(content=content, reply_to=msg)


@app.query("promptfcl_hello")
def hello(msg: FlowerMessage, context: Context) -> FlowerMessage:
    """Tell the server which client this node is; with the node worker on, start it now, so that building the
    runtime is part of discovery (before the first round) rather than of the first round's time limit."""
    pid = int(context.node_config["partition-id"])
    if bool(context.run_config.get("node-worker", True)):
        from promptfcl.flower.worker_link import ensure_worker

        ensure_worker(context.node_config, context.node_id, context.run_config)
    return FlowerMessage(content=RecordDict({"hello": ConfigRecord({"partition-id": pid})}), reply_to=msg)


app.train()(handle)
app.query("promptfcl")(handle)  # every other kind (records.PROMPTFCL_QUERY); the kind travels in the record
