"""The local-only control of FedAvg-style methods (`method.local_only: true`): clients that never learn from
each other.

Each client trains its own copy of the method's trainable state, starting from the shared initial model, and
resumes from it the next time it takes part; nothing is averaged. The server keeps every client's model only so
that the experimenter can test it: in a deployment of this control nothing would leave the client (the simulation
still moves each client's own state to and from it, so its communication log is not a real cost). The run is
scored as the mean over clients of each client's model on the global test set (`ServerProgram.personal_models`,
read by the class-incremental regime); a client that never took part is scored with the initial model. The
prompt effect of the validity gate is counted over every client's model on the same test images: its McNemar test
treats the clients' paired predictions as independent, so its p-value is optimistic for this control.

It answers "does federating help at all?" beside a federated method's row. Only methods that run the plain
FedAvg round (no hook of the round overridden) can be run this way; the others are refused at start, since their
server-side steps (statistics, distillation, clustering) have no local-only reading.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from promptfcl.federation.message import Message

PREFIX = "local/"


class LocalModels:
    """Every client's own trainable state for the local-only control, checkpointed under `local/<client>/…`."""

    def __init__(self, initial: dict[str, torch.Tensor], num_clients: int) -> None:
        if num_clients <= 0:
            raise ValueError("method.local_only needs the scenario's number of clients")
        self.initial = {k: v.detach().clone() for k, v in initial.items()}
        self.clients: dict[int, dict[str, torch.Tensor]] = {}
        self.num_clients = num_clients

    @staticmethod
    def check_round(server: type, base: type) -> None:
        """Refuse a method whose round differs from `base`'s (its extra steps would be silently dropped)."""
        hooks = ("run_round", "before_round", "configure", "downlink", "aggregate", "after_aggregate", "after_round")
        changed = [h for h in hooks if getattr(server, h) is not getattr(base, h)]
        if changed:
            raise ValueError(
                f"method.local_only: {server.__name__} changes the FedAvg round ({', '.join(changed)}), so a "
                "local-only run would drop its own steps; run the control with a plain FedAvg method (e.g. "
                "promptfl, maple_fedavg, fedavg_prompt) or remove method.local_only"
            )

    def state_of(self, client: int) -> dict[str, torch.Tensor]:
        """What `client` resumes from: its own last trained state, or the initial model."""
        return {k: v.clone() for k, v in self.clients.get(client, self.initial).items()}

    def keep(self, replies: dict[int, Message]) -> None:
        """Store each usable reply's trained state as its client's own model (nothing is averaged)."""
        for client, reply in replies.items():
            self.clients[client] = {k: reply.tensors[k].detach().clone() for k in self.initial}

    def models(self, model: torch.nn.Module) -> Iterator[tuple[int, torch.nn.Module]]:
        """Each client's model in turn, loaded into the one object `model` (valid until the next item)."""
        for client in range(self.num_clients):
            model.set_state(self.state_of(client))
            yield client, model

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every client's state (the initial one for clients that never trained), under `local/<client>/<name>`;
        clients still at the initial model share its tensors (a checkpoint must copy them)."""
        return {
            f"{PREFIX}{c}/{k}": v for c in range(self.num_clients) for k, v in self.clients.get(c, self.initial).items()
        }

    @staticmethod
    def owns(name: str) -> bool:
        return name.startswith(PREFIX)

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore the client models from `tensors` (what `tensors()` wrote); clients equal to the initial model
        are left untrained."""
        self.clients = {}
        for name, value in tensors.items():
            if self.owns(name):
                client, key = name[len(PREFIX) :].split("/", 1)
                self.clients.setdefault(int(client), {})[key] = value
        self.clients = {
            c: st for c, st in self.clients.items() if any(not torch.equal(st[k], self.initial[k]) for k in st)
        }
