"""Why FedMGP trails FedL2P in the CPU evidence study: what the test-time routing of the local prompts costs.

FedMGP's fine local prompts are class-wise (§4.2): in training each image gets its own class's prompt (chosen by
the label), at test time the prompt whose key is nearest to the global-prompted query V(x') (Eq. 10). The local
head of a task is fitted only to features made with the right class's prompt, so a key that routes an image to
another class's prompt hands the head a feature it never saw. This script loads a finished FedMGP run's final
checkpoint (server and every client's personal state) and scores each client on the local test split of every
task it has learned, task-aware as the `client_local` regime, with:

* `routed`: the local prompt chosen by key among the seen classes (what the run is scored with; it must reproduce
  the run's last accuracy row),
* `oracle`: the local prompt of the image's own class (as in training; reads the label, so an upper bound),
* `global_only`: the fused global prompts with the client's own global head H_g (no local prompt),

and the key hit rate on each task's images (top-1 among the seen classes' keys). It also reads the FedL2P run of
the same seed (same scenario) for its final per-task accuracies.

    PROMPTFCL_ASSETS=/path/to/assets python benchmarks/fedmgp_local_routing.py \\
        benchmarks/results/evidence_cpu/fedmgp/seed0 [...] --out benchmarks/results/fedmgp_local_routing.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

from promptfcl.checkpoint import load_checkpoint
from promptfcl.data.loader import LabeledSubset
from promptfcl.evaluation.client_local import count_correct
from promptfcl.federation.protocol import ClientContext
from promptfcl.runtime import Runtime
from promptfcl.scenario.label_space import masked_logits


def diagnose(run: Path) -> dict:
    rt, server = Runtime.restore_server(run)
    _, client = rt.programs()
    ck = load_checkpoint(run, restore_rng=False)
    scenario, train, env, device = rt.scenario, rt.dataset.train, rt.env, rt.device
    last = ck.next_task - 1
    message = server.evaluate_message()
    tf = env.eval_transform
    per: dict[str, list[list[float]]] = {"routed": [], "oracle": [], "global_only": [], "key_hit": []}
    for cid in range(scenario.num_clients):
        space = scenario.client_label_space(cid)
        domain = scenario.client_domain(cid)

        def local_test(t: int, cid: int = cid, space=space, domain=domain) -> LabeledSubset:
            return LabeledSubset.of(train, scenario.client_test_indices(t, cid), space.task_class_to_logit(t), domain)

        data = LabeledSubset.of(train, scenario.client_indices(last, cid), space.task_class_to_logit(last), domain)
        ctx = ClientContext(cid, last, 0, ck.clients[cid], data, 0, device, last, space, local_test)
        model = client._model(message, ctx).eval()
        routed = client.predict(model, ctx)
        rows: dict[str, list[float]] = {k: [] for k in per}
        for t in range(last + 1):
            data, mask = local_test(t), space.mask(space.tasks[t].logits)

            def acc(predict, data=data, mask=mask, t=t) -> float:
                c, n = count_correct(predict, data, t, mask, tf, 256, device)
                return 100.0 * c / max(n, 1)

            rows["routed"].append(acc(routed))
            hits, oracle_c, n = 0, 0, 0
            allowed = client.local_candidates(ctx, t)
            with torch.no_grad():
                for x, y in data.batches(256, tf, device=device):
                    ids = model.local_pool.select(model.local_query(x), allowed, 1, False)
                    hits += int((ids[:, 0] == y).sum())
                    oracle = masked_logits(model.local_logits(x, t, labels=y), mask.to(device))
                    oracle_c += int((oracle.argmax(1) == y).sum())
                    n += len(y)
            rows["oracle"].append(100.0 * oracle_c / max(n, 1))
            rows["key_hit"].append(100.0 * hits / max(n, 1))
            rows["global_only"].append(acc(lambda x, _t, m=model: m(x)))
        for k in per:
            per[k].append(rows[k])
    metrics = json.loads((run / "metrics.json").read_text())
    fedl2p = run.parent.parent / "fedl2p" / run.name / "metrics.json"

    def task_means(m: list[list[float]]) -> list[float]:  # per task, mean over clients (the regime's accuracy)
        return [round(statistics.mean(c[t] for c in m), 2) for t in range(last + 1)]

    out = {k: task_means(v) for k, v in per.items()}
    out = {"run": str(run), **out, "mean": {k: round(statistics.mean(v), 2) for k, v in out.items()}}
    out["scored_last_row"] = [round(a, 2) for a in metrics["accuracy_matrix"][-1]]
    if fedl2p.is_file():
        row = json.loads(fedl2p.read_text())["accuracy_matrix"][-1]
        out["fedl2p_last_row"] = [round(a, 2) for a in row]
        out["mean"]["fedl2p"] = round(statistics.mean(row), 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", default="benchmarks/results/fedmgp_local_routing.json")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rows = []
    for run in args.runs:
        r = diagnose(run)
        rows.append(r)
        print(f"{run}: {r['mean']}")
        print(f"  routed {r['routed']} (scored {r['scored_last_row']})\n  oracle {r['oracle']}\n"
              f"  global {r['global_only']}\n  hit {r['key_hit']}")  # fmt: skip
    Path(args.out).write_text(json.dumps({"rows": rows, "loadavg": list(os.getloadavg())}, indent=2))


if __name__ == "__main__":
    main()
