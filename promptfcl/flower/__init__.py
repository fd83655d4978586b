"""The Flower engine: the same method programs on a real federation (flwr ≥ 1.41 Message API).

Install with `pip install 'promptfcl[flower]'`. The core never imports this package.
- `records`: promptfcl `Message`/`Record` ↔ Flower `RecordDict` (ArrayRecord + ConfigRecord);
- `grid`: `FlowerGrid`, our `Grid` over Flower's `Grid` (node ids ↔ client ids, timeouts, failures);
- `server_app` / `client_app`: the `ServerApp` driving the experiment loop, the `ClientApp` dispatching to the
  method's client program with per-node state in `context.state`;
- `project`: writes the small Flower app project that `flwr run` needs.
"""
