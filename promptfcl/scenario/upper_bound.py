"""Upper-bound scenarios: the same data, backbone, budget and evaluation as a federated scenario, with no
federation (`scenario.upper_bound: centralized`) and also no task sequence (`scenario.upper_bound: joint`).

Both are derived from the federated scenario built with the same config and seed, so they hold exactly its
images and classes:

- **centralized** (HePCo Table 1's "Prompting (centralized)": the prompted model trained in a traditional,
  non-federated continual-learning setting) keeps the class order, the tasks and the task-by-task evaluation
  (accuracy matrix, FAA / A_N, forgetting, BWT). In every round of task t one learner holds the union of the
  training images of every client that can take part in that round: with a fixed partition (`dirichlet`,
  `iid`, long-tailed) all the task's clients, so the learner holds the task's whole training set (partial
  participation is ignored: the upper bound sees every client); with HePCo's stateless sampling
  (`partition.kind: hepco`), that round's `num_clients` fresh draws, so round r's learner sees exactly the images
  the federation's round r saw (each once, where draws overlap): the budget-matched reading. HePCo's own row
  trains on each task's whole training set; its presets get that with `partition.kind: iid` (a fixed partition).
- **joint** (HGP Table 1's "Joint": trained on the global data distribution, "without federated or incremental
  splitting") additionally merges every task into one task holding all the classes (in class order, so the logit
  layout is the federated run's; with HePCo's stateless sampling round r's learner holds every task's round-r
  draws); the evaluation is then one accuracy over all classes (the run's FAA, which
  the report compares with the federated rows' FAA / A_N; forgetting and BWT are 0 by definition). On a
  long-tailed scenario (one task already) joint and centralized are the same run.

Budget: the loop keeps `rounds_per_task` rounds and the method its `local_epochs`, so each training image is
seen `rounds_per_task × local_epochs` times, exactly as often as in the federated run with full participation
(where each image belongs to one client and one task), and the learner takes about as many optimiser steps as all
clients together (ceil(N/B) against the sum of ceil(n_k/B) over the clients' shards).
A joint run does *not* get `num_tasks × rounds_per_task` rounds: that would show every image `num_tasks` times
more often than the federated learner does. The single learner is client 0 (stateless: client r is round r's
learner), so FedAvg-style aggregation is the identity and each method's server steps still run.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

import numpy as np

from promptfcl.config import ConfigError, ExperimentConfig, ScenarioConfig
from promptfcl.scenario.scenario import Scenario

UpperBound = Literal["centralized", "joint"]


def _union(parts: list[np.ndarray]) -> np.ndarray:
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)


def upper_bound_scenario(scenario: Scenario, cfg: ScenarioConfig, mode: UpperBound) -> Scenario:
    """The centralized (or joint) form of a class-incremental or long-tailed `scenario` (see the module doc)."""
    if scenario.schedule is not None or scenario.personalized:
        raise ValueError(f"scenario.upper_bound needs a class-incremental or long-tailed scenario, not {scenario.kind}")
    stateless = cfg.partition.kind == "hepco" and scenario.kind == "class_incremental"
    rounds = scenario.rounds_per_task
    # [task][learner]: the learners of one task; [task][round] → the learner training in that round
    if stateless:
        train = [
            [_union([task[k] for k in scenario.participants[t][r]]) for r in range(rounds)]
            for t, task in enumerate(scenario.client_train)
        ]
        participants = [[[r] for r in range(rounds)] for _ in train]
    else:
        train = [[_union(list(task))] for task in scenario.client_train]
        participants = [[[0] for _ in range(rounds)] for _ in train]
    task_classes, test_indices = scenario.task_classes, scenario.test_indices
    if mode == "joint":
        train = [[_union([task[k] for task in train]) for k in range(len(train[0]))]]
        participants = participants[:1]
        task_classes = [[c for classes in scenario.task_classes for c in classes]]
        test_indices = [_union(list(scenario.test_indices))]
    return replace(
        scenario,
        task_classes=task_classes,
        client_train=train,
        test_indices=test_indices,
        participants=participants,
        num_clients=len(train[0]),
        upper_bound=mode,
    )


def check_upper_bound(cfg: ExperimentConfig) -> None:
    """Refuse the combinations an upper-bound row cannot be defined on, saying how to fix each (asynchronous and
    personalized scenarios are refused by `ScenarioConfig` itself)."""
    mode = cfg.scenario.upper_bound
    if mode is None:
        return
    key, problems = f"scenario.upper_bound: {mode}", []
    if cfg.eval.regime == "client_local":
        problems.append(f"{key}: one learner has no client-local test splits; set eval.regime: auto")
    if cfg.engine.faults:
        problems.append(f"{key}: a fault plan needs real clients; remove engine.faults")
    if cfg.engine.min_clients > 1:
        problems.append(f"{key}: one learner answers each round; set engine.min_clients: 1")
    if problems:
        raise ConfigError("invalid upper-bound run:\n  " + "\n  ".join(problems))
