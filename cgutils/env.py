"""Where we are running: device, mode (live or recorded) and versions, for banners and provenance."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import os
import platform
import re
import subprocess
from pathlib import Path

import torch

from .checks import require_cuda

REPO_ROOT = Path(__file__).resolve().parent.parent
"""The checkout that holds this package (``pip install -e .``): notebooks/, results/, figures/."""


def cuda_available() -> bool:
    """True when torch sees a CUDA device."""
    return torch.cuda.is_available()


def mode() -> str:
    """``"live"`` when a CUDA device is visible, else ``"recorded"``.

    ``CGUTILS_MODE=recorded`` forces recorded mode on a GPU machine (to check what CI will show).

    Raises:
        NoCudaError: if ``CGUTILS_MODE=live`` is set but no CUDA device is visible.
    """
    forced = os.environ.get("CGUTILS_MODE", "").strip().lower()
    if forced == "recorded":
        return "recorded"
    if forced == "live":
        require_cuda("CGUTILS_MODE=live", "unset it to use recorded mode")
    return "live" if cuda_available() else "recorded"


def gpu_slug(name: str) -> str:
    """Folder name for a GPU: ``"NVIDIA H200"`` -> ``"nvidia-h200"``."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug or "unknown-gpu"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        return out.strip().splitlines()[0] if out.strip() else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def git_commit() -> str | None:
    """The commit the code ran at: ``CGUTILS_GIT_COMMIT`` if set (a copied tree has no .git), else git's."""
    env = os.environ.get("CGUTILS_GIT_COMMIT")
    if env:
        return env
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def cpu_model() -> str:
    """The host CPU's model name (it issues every kernel launch, so launch overhead depends on it)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def provenance() -> dict:
    """Facts that identify a measurement: GPU, driver, CUDA, library versions, date and commit.

    Returns:
        dict with keys ``gpu``, ``gpu_count``, ``driver``, ``cuda``, ``torch``, ``torchvision``,
        ``transformers``, ``python``, ``platform``, ``cpu``, ``cpu_count``, ``date`` (UTC, ISO 8601),
        ``git_commit``. GPU
        fields are ``None`` on a machine without CUDA.
    """
    has_cuda = cuda_available()
    return {
        "gpu": torch.cuda.get_device_name(0) if has_cuda else None,
        "gpu_count": torch.cuda.device_count() if has_cuda else 0,
        "driver": _driver_version() if has_cuda else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "torchvision": _version("torchvision"),
        "transformers": _version("transformers"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
    }


def describe(prov: dict) -> str:
    """One line naming GPU, driver, CUDA and versions, e.g. for a banner or a table caption."""
    commit = (prov.get("git_commit") or "unknown")[:10]
    return (f"{prov.get('gpu') or 'no GPU'} (driver {prov.get('driver') or '?'}, CUDA {prov.get('cuda') or '?'}), "
            f"torch {prov.get('torch')}, transformers {prov.get('transformers')}, "
            f"{(prov.get('date') or '?')[:10]}, commit {commit}")
