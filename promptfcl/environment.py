"""What a run ran on: package versions, Python, platform, device and the git commit of the promptfcl source.

Written to every run directory as `environment.json` and shown by `promptfcl compare` / `promptfcl report`, so
a number can be traced to the exact code that produced it. The commit is read with `git` from the checkout the
package was imported from; `dirty: true` means that checkout had uncommitted changes (the commit alone does not
pin the code). An installed (non-checkout) package records `commit: null` and its version only.
"""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = ("torch", "torchvision", "timm", "numpy", "pydantic", "safetensors", "matplotlib", "flwr", "open_clip_torch")


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str]:
    """Installed versions of `names` (absent packages are left out)."""
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        res = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def git_info(path: Path | None = None) -> dict[str, Any]:
    """Commit, branch and dirty flag of the git checkout holding `path` (default: the promptfcl package)."""
    where = path or Path(__file__).resolve().parent
    commit = _git(["rev-parse", "HEAD"], where)
    if commit is None:
        return {"commit": None, "note": f"{where} is not in a git checkout (installed package)"}
    status = _git(["status", "--porcelain", "--untracked-files=no"], where)
    return {
        "commit": commit,
        "branch": _git(["rev-parse", "--abbrev-ref", "HEAD"], where),
        "dirty": bool(status),
    }


def environment_info() -> dict[str, Any]:
    """The environment record of a run (environment.json)."""
    import torch

    from promptfcl import __version__

    info: dict[str, Any] = {
        "promptfcl": __version__,
        "git": git_info(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": package_versions(),
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    for name in ("torch", "timm", "numpy"):  # flat keys kept for readers of older environment.json files
        info[name] = info["packages"].get(name)
    return info
