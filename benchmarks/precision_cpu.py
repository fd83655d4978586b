"""engine.precision on the CPU: FedAvg-Prompt and HGP in fp32 and bf16 on the real CIFAR-100 with the distilled
ViT-Tiny at 112 px (a reduced protocol: 30 classes as 3 tasks, 40 train / 20 test images per class, 5 clients,
Dirichlet 0.5, 2 rounds per task, 2 local epochs). Prints and writes FAA, the accuracy matrices and timings.

    PROMPTFCL_ASSETS=/path/to/assets python benchmarks/precision_cpu.py RUN_DIR \
        benchmarks/results/precision_cifar100_cpu.json
"""

import json
import os
import sys
import time
from pathlib import Path

from promptfcl.config import build_config
from promptfcl.experiment import Experiment

assets = os.environ["PROMPTFCL_ASSETS"]
out = {}
for method in ("fedavg_prompt", "hgp"):
    for precision in ("fp32", "bf16"):
        raw = {
            "name": f"precision_{method}_{precision}",
            "seed": 0,
            "data": {
                "name": "cifar100",
                "root": f"{assets}/cifar-100-python",
                "train_per_class": 40,
                "test_per_class": 20,
            },
            "scenario": {
                "num_tasks": 3,
                "classes_per_task": [10, 10, 10],
                "num_clients": 5,
                "rounds_per_task": 2,
                "partition": {"kind": "dirichlet", "beta": 0.5, "min_samples": 4},
            },
            "backbone": {
                "name": "vit_tiny_patch16_224",
                "img_size": 112,
                "weights": f"{assets}/models/vit_tiny_patch16_112_distilled.safetensors",
            },
            "method": {"name": method, "length": 20, "local_epochs": 2, "batch_size": 16},
            "engine": {"device": "cpu", "precision": precision},
        }
        load = os.getloadavg()
        t0 = time.perf_counter()
        m = Experiment(build_config(raw), Path(sys.argv[1]) / f"{method}_{precision}", show_progress=False).run()
        out[f"{method}/{precision}"] = {
            "faa": m["summary"]["faa"],
            "accuracy_matrix": m["accuracy_matrix"],
            "client_seconds": m["timing"]["client_seconds"],
            "eval_seconds": m["timing"]["eval_seconds"],
            "wall_seconds": time.perf_counter() - t0,
            "load_average_at_start": list(load),
        }
        print(method, precision, json.dumps(out[f"{method}/{precision}"]), flush=True)
protocol = {k: v for k, v in raw.items() if k not in ("name", "method", "engine")}
protocol["method"] = {k: v for k, v in raw["method"].items() if k != "name"}
Path(sys.argv[2]).write_text(json.dumps({"protocol": protocol, "runs": out}, indent=2))
