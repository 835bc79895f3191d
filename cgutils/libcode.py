"""Which library code produced a recording: per-file hashes of the package, and the files a block of
code executed.

A recorded cell is only as current as the code it ran. Its own source is hashed by
:func:`cgutils.store.source_hash`; this module names the ``cgutils`` files the cell executed and their
content hashes, so that :func:`cgutils.store.check_recordings` can report a cell whose library code changed
after it was recorded.

Which files ran is found with :mod:`sys.monitoring` (Python >= 3.12, PEP 669): a ``PY_START`` callback
notes the file of each function the first time it starts and then returns ``DISABLE`` for that code
object, so each function costs one callback per cell and timed loops inside the cell run at full speed.
On older Pythons every file of the package is recorded (conservative: any change then marks the cell).
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
_TOOL_NAME = "cgutils-recording"


def _rel(path: Path, package: Path) -> str:
    return path.relative_to(package.parent).as_posix()


def file_hash(path: Path | str) -> str:
    """First 16 hex digits of the SHA-256 of a file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def library_hashes(package: Path = PACKAGE_DIR) -> dict[str, str]:
    """``{"cgutils/<module path>.py": hash}`` for every source file of the package, sorted by path."""
    return {_rel(p, package): file_hash(p) for p in sorted(package.rglob("*.py"))}


def changed_files(recorded: dict[str, str], package: Path = PACKAGE_DIR) -> list[str]:
    """Files of ``recorded`` (path -> hash, as :func:`code_used` filled it) whose content differs now or
    that no longer exist, sorted."""
    root = package.parent  # hash only the recorded files, not the whole package, once per banner and per check
    return sorted(p for p, h in recorded.items() if not (root / p).is_file() or file_hash(root / p) != h)


def _free_tool_id(monitoring) -> int | None:
    # ids 0-2 and 5 are the conventional debugger/coverage/profiler/optimizer slots; try the others first
    for tool in (3, 4, 2, 5, 1, 0):
        if monitoring.get_tool(tool) is None:
            return tool
    return None


@contextmanager
def code_used(package: Path = PACKAGE_DIR, ignore: Iterable[Path | str] = ()) -> Iterator[dict[str, str]]:
    """Collect the files of ``package`` (default ``cgutils``) that run inside the ``with`` block, with
    their hashes.

    Args:
        package: the package folder whose files are collected.
        ignore: files never collected: the recording machinery itself, whose hooks (the stdout tee, the
            display hook) run inside the block without producing what the cell shows.

    Yields:
        a dict, filled when the block ends: ``{"cgutils/<path>.py": hash}`` of each package file whose
        functions started in the block (all package files on Python < 3.12, or when every
        ``sys.monitoring`` tool slot is taken).
    """
    used: dict[str, str] = {}
    skip = {str(Path(f).resolve()) for f in ignore}
    monitoring = getattr(sys, "monitoring", None)
    tool = _free_tool_id(monitoring) if monitoring is not None else None
    if tool is None:
        try:
            yield used
        finally:
            used.update({p: h for p, h in library_hashes(package).items()
                         if str((package.parent / p).resolve()) not in skip})
        return

    prefix = str(package) + "/"
    files: set[str] = set()

    def on_start(code, offset):
        if code.co_filename.startswith(prefix) and code.co_filename not in skip:
            files.add(code.co_filename)
        return monitoring.DISABLE  # one callback per function: timed loops are not slowed

    monitoring.use_tool_id(tool, _TOOL_NAME)
    try:
        monitoring.register_callback(tool, monitoring.events.PY_START, on_start)
        monitoring.restart_events()  # functions disabled by an earlier block must report again
        monitoring.set_events(tool, monitoring.events.PY_START)
        try:
            yield used
        finally:
            monitoring.set_events(tool, 0)
    finally:
        monitoring.register_callback(tool, monitoring.events.PY_START, None)
        monitoring.free_tool_id(tool)
        for f in sorted(files):
            p = Path(f)
            if p.exists():
                used[_rel(p, package)] = file_hash(p)
