"""Live progress display for long runs (rich), silent when disabled."""

from __future__ import annotations

from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class RunProgress:
    """One bar over all rounds; the description shows task / round / client / last loss."""

    def __init__(self, total_rounds: int, enabled: bool = True, console: Console | None = None) -> None:
        self.enabled = enabled
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console or Console(stderr=True),
            transient=False,
            disable=not enabled,
        )
        self._bar = self._progress.add_task("starting", total=total_rounds)
        self.where = ""

    def __enter__(self) -> RunProgress:
        self._progress.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._progress.stop()

    def skip(self, rounds: int) -> None:
        self._progress.advance(self._bar, rounds)

    def round_started(self, task: int, num_tasks: int, rnd: int, num_rounds: int) -> None:
        self.where = f"task {task + 1}/{num_tasks} round {rnd + 1}/{num_rounds}"
        self._progress.update(self._bar, description=self.where)

    def client_done(self, client: int, loss: float | None) -> None:
        text = f"{self.where} client {client}" + (f" loss {loss:.3f}" if loss is not None else "")
        self._progress.update(self._bar, description=text)

    def round_done(self) -> None:
        self._progress.advance(self._bar)

    def note(self, text: str) -> None:
        self._progress.update(self._bar, description=f"{self.where} {text}")
