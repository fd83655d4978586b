"""Writes the Flower app project `flwr run` needs: a pyproject pointing at promptfcl's apps."""

from __future__ import annotations

from pathlib import Path

PYPROJECT = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "promptfcl-flower-app"
version = "0.1.0"
description = "promptfcl methods on Flower"
license = "MIT"
dependencies = ["promptfcl[flower]"]

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "promptfcl"

[tool.flwr.app.components]
serverapp = "promptfcl.flower.server_app:app"
clientapp = "promptfcl.flower.client_app:app"

[tool.flwr.app.config]
config-file = "configs/quickstart.yaml"
overrides = "[]"
run-dir = "results/flower"
resume = false
timeout = 600.0
timeout-factor = 5.0
liveness-interval = 5.0
node-worker = true
worker-idle-timeout = 900.0
"""


def write_app(directory: Path) -> Path:
    """Create (or refresh) the app project in `directory`; returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "pyproject.toml").write_text(PYPROJECT)
    return directory
