"""Per-round overhead of a Flower deployment versus the in-process engine, on one machine (loopback).

Runs the same config twice — in-process, then through a loopback SuperLink with one SuperNode per client
(`promptfcl.flower.LoopbackFederation`, the per-node worker on) — checks both give the same accuracy matrix,
and prints the mean seconds per round of each, their difference (the overhead) and ratio. The first round is
reported apart: the in-process engine has nothing to warm up, Flower nodes start their workers during
discovery, before it. Writes JSON beside the table.

    python benchmarks/flower_overhead.py [--config configs/quickstart.yaml] [--set key=value ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

import yaml

from promptfcl.config import dump_config, load_config
from promptfcl.experiment import Experiment
from promptfcl.flower.loopback import LoopbackFederation
from promptfcl.flower.project import write_app


def round_seconds(run_dir: Path) -> list[float]:
    return [json.loads(line)["seconds"] for line in (run_dir / "rounds.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/quickstart.yaml")
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--out", default="benchmarks/results/flower_overhead.json")
    args = ap.parse_args()
    cfg = load_config(args.config, args.overrides)
    work = Path(tempfile.mkdtemp(prefix="pf_overhead"))
    cfg_file = work / "config.yaml"
    cfg_file.write_text(dump_config(cfg))
    inproc = Experiment(cfg, work / "inprocess", show_progress=False).run()
    app = write_app(work / "app")
    clients = cfg.scenario.num_clients
    with LoopbackFederation(work / "flwr_home", clients=clients) as fed:
        if fed.wait_online(clients) != clients:
            raise SystemExit("the loopback SuperNodes did not come online")
        flower = fed.run(app, f"config-file='{cfg_file}' run-dir='{work / 'flower'}'", timeout=3600)
    if flower["accuracy_matrix"] != inproc["accuracy_matrix"]:
        raise SystemExit("Flower and in-process runs differ: the overhead comparison would be meaningless")
    a, b = round_seconds(work / "inprocess"), round_seconds(work / "flower")
    rows = {
        "in-process": {"first_round_s": a[0], "mean_round_s": statistics.mean(a[1:] or a)},
        "flower deployment": {"first_round_s": b[0], "mean_round_s": statistics.mean(b[1:] or b)},
    }
    overhead = rows["flower deployment"]["mean_round_s"] - rows["in-process"]["mean_round_s"]
    ratio = rows["flower deployment"]["mean_round_s"] / rows["in-process"]["mean_round_s"]
    result = {
        "config": yaml.safe_load(dump_config(cfg)),
        "clients": clients,
        "rounds": len(a),
        "cpu_count": os.cpu_count(),
        "engines": rows,
        "overhead_s_per_round": overhead,
        "ratio": ratio,
        "equal_accuracy_matrix": True,
    }
    print(f"{'engine':<20}{'first round (s)':>18}{'later rounds, mean (s)':>26}")
    for name, r in rows.items():
        print(f"{name:<20}{r['first_round_s']:>18.2f}{r['mean_round_s']:>26.2f}")
    print(f"overhead per round: {overhead:.2f} s ({ratio:.2f}x), {clients} clients, {len(a)} rounds")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
