"""The results store: measurements recorded on real GPUs under ``results/<gpu-slug>/``, with provenance,
and the check that each recorded notebook cell still matches its source.

Which store a run uses:

* :func:`live_store` (CUDA present) is where a live run writes: ``results/<slug>/`` when
  ``CGUTILS_RECORD=1`` (set by ``make record``), else the git-ignored ``build/live/<slug>/`` so that a
  user's own measurements never overwrite committed recordings.
* :class:`ResultsStore` with no slug is the recording to show: ``$CGUTILS_RECORDED_GPU``, else the live
  GPU's, else the newest recording (:meth:`ResultsStore.default_slug`).
* :func:`current_store` is the one a notebook reads from: the live store in live mode, else the recording.

Layout of a store::

    results/<gpu-slug>/meta.json                      provenance of the latest recording run
    results/<gpu-slug>/<name>.csv                     frames saved with --save var:name
    results/<gpu-slug>/<name>.meta.json               that table's own provenance
    results/<gpu-slug>/cells/<notebook>/<key>.json    one recorded cell

A recorded cell is identified by its key (the first argument of ``%%recorded``) and its
:func:`source_hash`; :func:`check_recordings` compares every notebook's cells with the store.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import env
from .checks import require_cuda
from .errors import InputError, RecordingError, StaleRecordingError
from .libcode import changed_files

MAGIC = "%%recorded"


def results_root() -> Path:
    """``results/`` of the checkout, or ``$CGUTILS_RESULTS``."""
    return Path(os.environ.get("CGUTILS_RESULTS", env.REPO_ROOT / "results"))


def recording_enabled() -> bool:
    """True when live runs should write recordings (``CGUTILS_RECORD=1``, as ``make record`` sets)."""
    return os.environ.get("CGUTILS_RECORD", "") == "1"


def live_store() -> ResultsStore:
    """Where a live run writes: ``results/<slug>/`` when recording, else the git-ignored
    ``build/live/<slug>/`` (a user's own GPU measurements do not overwrite committed recordings).

    Raises:
        NoCudaError: without a CUDA device.
    """
    import torch

    require_cuda("live_store()", "use ResultsStore() to read recordings")
    root = results_root() if recording_enabled() else env.REPO_ROOT / "build" / "live"
    return ResultsStore(env.gpu_slug(torch.cuda.get_device_name(0)), root=root)


def current_store() -> ResultsStore:
    """The store a notebook reads its GPU artefacts from: :func:`live_store` in live mode (where the
    live cells just wrote them), else the recorded store (:class:`ResultsStore` default)."""
    return live_store() if env.mode() == "live" else ResultsStore()


class ResultsStore:
    """Recordings of one GPU under ``<root>/<slug>/``.

    Args:
        slug: GPU folder name (``env.gpu_slug``); ``None`` picks :meth:`default_slug`.
        root: the results folder; default :func:`results_root`.

    Raises:
        InputError: ``slug`` is not a GPU slug (lowercase letters, digits, dashes).
        RecordingError: when ``slug`` is ``None`` and no recording exists under ``root``.
    """

    def __init__(self, slug: str | None = None, root: Path | str | None = None):
        self.root = Path(root) if root is not None else results_root()
        if slug is not None and (not isinstance(slug, str) or slug != env.gpu_slug(slug)):
            raise InputError(f"GPU slug {slug!r} must look like 'nvidia-h200' (lowercase letters, digits, dashes)")
        self.slug = slug or self.default_slug(self.root)
        self.path = self.root / self.slug

    @staticmethod
    def available(root: Path | str | None = None) -> list[str]:
        """Slugs under ``root`` that hold a ``meta.json``, sorted."""
        r = Path(root) if root is not None else results_root()
        return sorted(p.parent.name for p in r.glob("*/meta.json"))

    @classmethod
    def default_slug(cls, root: Path | str | None = None) -> str:
        """The recording to show: ``$CGUTILS_RECORDED_GPU``, else the live GPU's, else the newest one.

        Raises:
            RecordingError: if nothing is recorded, or ``$CGUTILS_RECORDED_GPU`` names no recording.
        """
        if os.environ.get("CGUTILS_RECORDED_GPU"):
            slug = os.environ["CGUTILS_RECORDED_GPU"]
            if slug not in cls.available(root):
                raise RecordingError(f"CGUTILS_RECORDED_GPU={slug!r} has no recording; available: "
                                     f"{cls.available(root) or 'none'}")
            return slug
        if env.cuda_available():
            import torch

            return env.gpu_slug(torch.cuda.get_device_name(0))
        slugs = cls.available(root)
        if not slugs:
            raise RecordingError(f"no recordings under {root or results_root()}; run `make record` "
                                 f"on a CUDA machine to create one")
        dates = {s: _read_json(Path(root or results_root()) / s / "meta.json").get("date", "") for s in slugs}
        return max(slugs, key=lambda s: dates[s])

    # provenance
    def meta(self) -> dict:
        """Provenance of this recording (``meta.json``).

        Raises:
            RecordingError: if it is missing or unreadable.
        """
        return _read_json(self.path / "meta.json")

    def notebook_meta(self, notebook: str) -> dict:
        """Provenance of the newest recorded cell of ``notebook``; :meth:`meta` when it has none.

        ``meta.json`` names whichever notebook was recorded last, so a notebook recorded in an earlier
        run would otherwise show another run's commit and date in its banner.

        Raises:
            RecordingError: no cell of the notebook and no ``meta.json``.
        """
        provs = [_read_json(p).get("provenance") or {} for p in (self.path / "cells" / notebook).glob("*.json")]
        provs = [p for p in provs if p.get("date")]
        return max(provs, key=lambda p: p["date"]) if provs else self.meta()

    def write_meta(self, prov: dict | None = None) -> dict:
        """Write ``meta.json`` with the current (or given) provenance; returns it."""
        prov = prov or env.provenance()
        self.path.mkdir(parents=True, exist_ok=True)
        _write_json(self.path / "meta.json", prov)
        return prov

    # frames and values
    def _value_path(self, name: str, suffix: str) -> Path:
        if not isinstance(name, str) or not name or ".." in Path(name).parts or Path(name).is_absolute():
            raise InputError(f"result name {name!r} must be a relative path inside the store")
        return self.path / f"{name}{suffix}"

    def save_frame(self, name: str, df) -> Path:
        """Write a DataFrame to ``<slug>/<name>.csv``; returns the path."""
        p = self._value_path(name, ".csv")
        p.parent.mkdir(parents=True, exist_ok=True)
        df.to_csv(p, index=False)
        return p

    def load_frame(self, name: str):
        """Read ``<slug>/<name>.csv`` as a DataFrame.

        Raises:
            RecordingError: if it does not exist.
        """
        import pandas as pd

        p = self._value_path(name, ".csv")
        if not p.exists():
            raise RecordingError(f"no recorded table {name!r} for {self.slug} ({p}); run `make record` "
                                 f"on that GPU, or pick another with CGUTILS_RECORDED_GPU "
                                 f"(available: {self.available(self.root)})")
        return pd.read_csv(p)

    def save_value(self, name: str, value: Any, prov: dict | None = None) -> Path:
        """Save a DataFrame as CSV, anything else JSON-serialisable as JSON; returns the path.

        With ``prov``, the value's own provenance goes to ``<name>.meta.json`` beside it, so that a
        later recording of other tables (which rewrites ``meta.json``) cannot misattribute it.

        Raises:
            InputError: ``name`` leaves the store, or ``value`` is neither a DataFrame nor JSON-serialisable.
        """
        if prov is not None:
            p = self._value_path(name, ".meta.json")
            p.parent.mkdir(parents=True, exist_ok=True)
            _write_json(p, prov)
        # one format per name: a stale file of the other format would shadow this one on load
        self._value_path(name, ".json" if _is_frame(value) else ".csv").unlink(missing_ok=True)
        if _is_frame(value):
            return self.save_frame(name, value)
        p = self._value_path(name, ".json")
        p.parent.mkdir(parents=True, exist_ok=True)
        try:
            _write_json(p, value)
        except TypeError as exc:
            raise InputError(f"cannot save {name!r}: {exc}. --save takes DataFrames and JSON-serialisable "
                             f"values (dict, list, str, numbers)") from exc
        return p

    def meta_for(self, name: str) -> dict:
        """Provenance of one saved table or value: its ``<name>.meta.json``, else the store's ``meta.json``.

        Raises:
            RecordingError: if neither exists.
        """
        p = self._value_path(name, ".meta.json")
        return _read_json(p) if p.exists() else self.meta()

    def value_file(self, name: str) -> Path:
        """The file that holds a saved table or value: ``<name>.csv``, ``<name>.json``, or ``<name>`` itself
        (a file saved under its own name, e.g. ``traces/bert_replay.json.gz``).

        Raises:
            InputError: ``name`` leaves the store.
            RecordingError: no such file.
        """
        for suffix in (".csv", ".json", ""):
            p = self._value_path(name, suffix)
            if p.is_file():
                return p
        raise RecordingError(f"no recorded table, value or file {name!r} for {self.slug} under {self.path}; "
                             f"run `make record` on that GPU")

    def load_value(self, name: str) -> Any:
        """Inverse of :meth:`save_value`.

        Raises:
            RecordingError: if neither ``<name>.csv`` nor ``<name>.json`` exists.
        """
        if self._value_path(name, ".csv").exists():
            return self.load_frame(name)
        return _read_json(self._value_path(name, ".json"))

    # cells
    def cell_path(self, notebook: str, key: str) -> Path:
        """Where the recording of cell ``key`` of ``notebook`` lives (it may not exist)."""
        return self.path / "cells" / notebook / f"{key}.json"

    def save_cell(self, record: dict) -> Path:
        """Write one recorded cell (a dict with at least ``notebook`` and ``key``); returns the path."""
        p = self.cell_path(record["notebook"], record["key"])
        p.parent.mkdir(parents=True, exist_ok=True)
        _write_json(p, record)
        return p

    def load_cell(self, notebook: str, key: str, expected_hash: str | None = None) -> dict:
        """Load one recorded cell, checking its source hash.

        Raises:
            RecordingError: if the recording is missing.
            StaleRecordingError: if ``expected_hash`` differs from the recorded one.
        """
        p = self.cell_path(notebook, key)
        if not p.exists():
            raise RecordingError(f"cell {key!r} of {notebook} has no recording for {self.slug} ({p}). "
                                 f"Run `make record` on a CUDA machine to record it.")
        rec = _read_json(p)
        if expected_hash is not None and rec.get("source_hash") != expected_hash:
            raise StaleRecordingError(
                f"cell {key!r} of {notebook} changed since it was recorded on {self.slug} "
                f"({(rec.get('provenance') or {}).get('date', '?')[:10]}): recorded hash "
                f"{rec.get('source_hash')}, current {expected_hash}. Its recorded output may no longer "
                f"match the code: re-record with `make record` on a CUDA machine.")
        return rec


def _is_frame(x: Any) -> bool:
    return type(x).__name__ == "DataFrame" and hasattr(x, "to_csv")


def _read_json(p: Path) -> Any:
    try:
        with open(p, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise RecordingError(f"recording file {p} is missing; run `make record` on a CUDA machine") from None
    except json.JSONDecodeError as exc:
        raise RecordingError(f"recording file {p} is not valid JSON ({exc}); re-record it") from exc


def _write_json(p: Path, obj: Any) -> None:
    tmp = p.with_suffix(p.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=True, allow_nan=True)
        f.write("\n")
    tmp.replace(p)  # never leave a half-written recording behind


# --- a recorded cell's identity: its key and source hash ----------------------------------------------

_parser = argparse.ArgumentParser(prog=MAGIC, add_help=False)
_parser.add_argument("key")
_parser.add_argument("--save", nargs="+", action="extend", default=[], metavar="VAR[:NAME]")
_parser.add_argument("--raises", action="store_true")


def parse_magic_line(line: str) -> argparse.Namespace:
    """The arguments of a ``%%recorded KEY [--save VAR[:NAME] ...] [--raises]`` line (after the magic's name).

    Returns:
        ``argparse.Namespace`` with ``key`` (str), ``save`` (list of ``VAR[:NAME]``; repeated flags add
        up) and ``raises`` (bool).

    Raises:
        InputError: the line does not parse.
    """
    try:
        return _parser.parse_args(shlex.split(line))
    except SystemExit:
        raise InputError(f"bad {MAGIC} arguments {line!r}; use: {MAGIC} KEY [--save VAR[:NAME] ...] [--raises]") from None


def source_hash(line: str, body: str) -> str:
    """Hash of a recorded cell: the magic's arguments plus the body, trailing whitespace ignored."""
    norm = line.strip() + "\n" + "\n".join(ln.rstrip() for ln in body.strip().splitlines())
    return hashlib.sha256(norm.encode()).hexdigest()[:16]


# --- staleness check -------------------------------------------------------------------------------


@dataclass(frozen=True)
class CellStatus:
    """Recording status of one ``%%recorded`` cell.

    ``status`` is ``ok``; ``stale`` (the cell's source changed since it was recorded); ``library`` (the
    source is unchanged but a ``cgutils`` file the cell ran has changed, or the recording does not say
    which files it ran); or ``missing``.
    """

    notebook: str
    key: str
    status: str
    detail: str = ""


def code_cell_sources(notebook_path: Path | str) -> list[tuple[str | None, str]]:
    """``(line, code)`` of each code cell in a notebook file, in order: ``line`` is the text after
    ``%%recorded`` on a recorded cell's first line (``None`` on a plain cell), ``code`` the source below it.

    Raises:
        RecordingError: the file is missing or not JSON.
    """
    try:
        nb = json.loads(Path(notebook_path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RecordingError(f"cannot read notebook {notebook_path}: {exc}") from exc
    out = []
    for c in nb.get("cells", []):
        if c.get("cell_type") != "code":
            continue
        src = "".join(c.get("source", [])) if isinstance(c.get("source"), list) else c.get("source", "")
        first, _, body = src.partition("\n")
        out.append((first[len(MAGIC):], body) if first.startswith(MAGIC) else (None, src))
    return out


def recorded_cells(notebook_path: Path | str) -> list[tuple[str, str, str]]:
    """``(key, line, body)`` of each ``%%recorded`` cell in a notebook file.

    Raises:
        RecordingError: the file is missing or not JSON.
        InputError: a ``%%recorded`` line does not parse.
    """
    return [(parse_magic_line(line).key, line, body)
            for line, body in code_cell_sources(notebook_path) if line is not None]


def _library_status(notebook: str, key: str, rec: dict) -> CellStatus:
    """``ok``, or ``library`` when the package files the recorded cell ran have changed since."""
    when = ((rec.get("provenance") or {}).get("date") or "?")[:10]
    library = rec.get("library")
    if library is None:
        return CellStatus(notebook, key, "library", f"cell {key!r} of {notebook} was recorded on {when} without "
                          f"the list of library files it ran; re-record it with `make record` on a CUDA machine")
    changed = changed_files(library)
    if changed:
        return CellStatus(notebook, key, "library", f"cell {key!r} of {notebook} ran library code that changed "
                          f"since it was recorded on {when}: {', '.join(changed)}. Its recorded output may no "
                          f"longer match the code: re-record with `make record` on a CUDA machine")
    return CellStatus(notebook, key, "ok")


def check_recordings(notebooks_dir: Path | str | None = None, store: ResultsStore | None = None) -> list[CellStatus]:
    """Check every ``%%recorded`` cell of every notebook against the store.

    Args:
        notebooks_dir: folder of ``*.ipynb``; default the checkout's ``notebooks/``.
        store: the recording to check; default :class:`ResultsStore` ().

    Returns:
        One :class:`CellStatus` per recorded cell; all ``ok`` means recorded mode shows outputs that the
        notebook's cells and the library as they are now would produce on that GPU: a cell is current
        when its source and every ``cgutils`` file it ran (recorded with the cell, see
        :mod:`cgutils.libcode`) are unchanged.

    Raises:
        RecordingError: ``notebooks_dir`` is missing or holds no notebook.
    """
    nb_dir = Path(notebooks_dir) if notebooks_dir is not None else env.REPO_ROOT / "notebooks"
    if not nb_dir.is_dir() or not any(nb_dir.glob("*.ipynb")):
        raise RecordingError(f"{nb_dir} is not a folder of notebooks (*.ipynb); nothing to check")
    store = store or ResultsStore()
    result = []
    for nb_path in sorted(nb_dir.glob("*.ipynb")):
        for key, line, body in recorded_cells(nb_path):
            try:
                rec = store.load_cell(nb_path.stem, key, expected_hash=source_hash(line, body))
                result.append(_library_status(nb_path.stem, key, rec))
            except StaleRecordingError as exc:
                result.append(CellStatus(nb_path.stem, key, "stale", str(exc)))
            except RecordingError as exc:
                result.append(CellStatus(nb_path.stem, key, "missing", str(exc)))
    return result
