"""Recorded results: a store under ``results/<gpu-slug>/`` with provenance, and the ``%%recorded`` cell magic.

Two modes, one notebook (see ``env.mode``):

* **live** (CUDA present): a ``%%recorded KEY`` cell runs for real and the variables named by
  ``--save`` are written to :func:`live_store`. When ``CGUTILS_RECORD=1`` (set by ``make record``)
  that store is ``results/<slug>/`` and the cell's printed text, rich outputs and figures, its source
  hash and the provenance are recorded there too.
* **recorded** (no CUDA): the cell is not run; its recorded outputs are shown under a banner naming
  GPU, driver, versions and date, and the saved variables are restored. A cell whose source changed
  since recording is *stale*: :class:`~cgutils.errors.StaleRecordingError` is raised, as it is for a
  missing recording, so the tests fail instead of showing outdated numbers.
* ``--raises``: the cell is meant to fail (a lesson about an error). Live, its exception is recorded
  and re-raised; recorded, the outputs are shown and :class:`~cgutils.errors.RecordedCellError`
  carries the recorded error text. Tag such cells ``raises-exception`` for nbmake.

Layout of a store::

    results/<gpu-slug>/meta.json                      provenance of the latest recording run
    results/<gpu-slug>/<name>.csv                     frames saved with --save var:name
    results/<gpu-slug>/cells/<notebook>/<key>.json    one recorded cell
"""

from __future__ import annotations

import argparse
import ast
import base64
import hashlib
import json
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import env
from .errors import InputError, NoCudaError, RecordedCellError, RecordingError, StaleRecordingError

MAGIC = "%%recorded"


def results_root() -> Path:
    """``results/`` of the checkout, or ``$CGUTILS_RESULTS``."""
    return Path(os.environ.get("CGUTILS_RESULTS", env.REPO_ROOT / "results"))


def live_store() -> ResultsStore:
    """Where a live run writes: ``results/<slug>/`` when recording, else the git-ignored
    ``build/live/<slug>/`` (a user's own GPU measurements do not overwrite committed recordings).

    Raises:
        NoCudaError: without a CUDA device.
    """
    import torch

    if not env.cuda_available():
        raise NoCudaError("live_store() needs a CUDA device; use ResultsStore() for recordings")
    root = results_root() if recording_enabled() else env.REPO_ROOT / "build" / "live"
    return ResultsStore(env.gpu_slug(torch.cuda.get_device_name(0)), root=root)


def current_store() -> ResultsStore:
    """The store a notebook reads its GPU artefacts from: :func:`live_store` in live mode (where the
    live cells just wrote them), else the recorded store (:class:`ResultsStore` default)."""
    return live_store() if env.mode() == "live" else ResultsStore()


def recording_enabled() -> bool:
    """True when live runs should write recordings (``CGUTILS_RECORD=1``, as ``make record`` sets)."""
    return os.environ.get("CGUTILS_RECORD", "") == "1"


def source_hash(line: str, body: str) -> str:
    """Hash of a recorded cell: the magic's arguments plus the body, trailing whitespace ignored."""
    norm = line.strip() + "\n" + "\n".join(ln.rstrip() for ln in body.strip().splitlines())
    return hashlib.sha256(norm.encode()).hexdigest()[:16]


class ResultsStore:
    """Recordings of one GPU under ``<root>/<slug>/``.

    Args:
        slug: GPU folder name (``env.gpu_slug``); ``None`` picks :meth:`default_slug`.
        root: the results folder; default :func:`results_root`.

    Raises:
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
            RecordingError: if nothing is recorded.
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
        return self.path / "cells" / notebook / f"{key}.json"

    def save_cell(self, record: dict) -> Path:
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


# --- the cell magic ---------------------------------------------------------------------------------

_state: dict[str, Any] = {"notebook": None}

_parser = argparse.ArgumentParser(prog=MAGIC, add_help=False)
_parser.add_argument("key")
_parser.add_argument("--save", nargs="+", action="extend", default=[], metavar="VAR[:NAME]")
_parser.add_argument("--raises", action="store_true")


def _parse_line(line: str) -> argparse.Namespace:
    try:
        return _parser.parse_args(shlex.split(line))
    except SystemExit:
        raise InputError(f"bad {MAGIC} arguments {line!r}; use: {MAGIC} KEY [--save VAR[:NAME] ...] [--raises]") from None


def _save_targets(args: argparse.Namespace, notebook: str) -> list[tuple[str, str]]:
    out = []
    for item in args.save:
        var, _, name = item.partition(":")
        out.append((var, name or f"cells/{notebook}/{args.key}.{var}"))
    return out


@dataclass
class _Tee:
    """A stdout stand-in that records what is written and passes it through (live output stays live)."""

    target: Any
    events: list

    def write(self, s: str) -> int:
        if s:
            if self.events and self.events[-1]["type"] == "stream":
                self.events[-1]["text"] += s
            else:
                self.events.append({"type": "stream", "name": "stdout", "text": s})
        return self.target.write(s)

    def flush(self) -> None:
        self.target.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.target, name)


def _jsonable_data(data: dict) -> dict:
    return {k: base64.b64encode(v).decode() if isinstance(v, bytes) else v for k, v in data.items()}


def _run_live(shell, cell: str) -> None:
    """Run ``cell`` in the user namespace; display the value of a trailing expression, like IPython."""
    import linecache

    from IPython.display import display

    tree = ast.parse(cell)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    ns = shell.user_ns
    # Registered with linecache so that tracebacks and cgutils' sync points can quote the cell's lines.
    name = f"<recorded cell {source_hash('', cell)}>"
    linecache.cache[name] = (len(cell), None, cell.splitlines(True), name)
    exec(compile(tree, name, "exec"), ns)  # noqa: S102 - this is a notebook cell
    if last is not None:
        value = eval(compile(ast.Expression(last.value), name, "eval"), ns)  # noqa: S307
        if value is not None and not _ends_with_semicolon(cell):
            display(value)
    if "matplotlib.pyplot" in sys.modules:  # figures are shown here, inside the capture, not after
        import matplotlib.pyplot as plt

        for num in plt.get_fignums():
            display(plt.figure(num))
            plt.close(num)


def _ends_with_semicolon(cell: str) -> bool:
    return cell.rstrip().endswith(";")


def recorded_cell(line: str, cell: str) -> None:
    """Body of the ``%%recorded KEY [--save VAR[:NAME] ...]`` cell magic (see the module docstring).

    Raises:
        RecordingError: no notebook name set (call :func:`setup_notebook`), or a missing recording.
        StaleRecordingError: in recorded mode, when the cell changed since it was recorded.
        InputError: bad magic arguments, or a ``--save`` variable that the cell did not define.
    """
    from IPython import get_ipython
    from IPython.display import publish_display_data

    shell = get_ipython()
    notebook = _state["notebook"]
    if notebook is None:
        raise RecordingError("call cgutils.setup_notebook('NN_name') before using %%recorded")
    args = _parse_line(line)
    digest = source_hash(line, cell)
    targets = _save_targets(args, notebook)

    if env.mode() == "recorded":
        store = ResultsStore()
        rec = store.load_cell(notebook, args.key, expected_hash=digest)
        prov = rec.get("provenance", {})
        text = (f"Recorded output: this machine has no CUDA device, so this cell shows what it printed on "
                f"{env.describe(prov)}; cell hash {digest}.")
        html = (f'<div style="border-left:4px solid #76b900;padding:4px 8px;background:#f4f9ec">'
                f"<b>Recorded on {prov.get('gpu')}</b> · driver {prov.get('driver')} · CUDA "
                f"{prov.get('cuda')} · torch {prov.get('torch')} · transformers {prov.get('transformers')}"
                f" · {str(prov.get('date'))[:10]} · cell {digest}</div>")
        publish_display_data({"text/plain": text, "text/html": html})
        for ev in rec.get("outputs", []):
            if ev["type"] == "stream":
                sys.stdout.write(ev["text"])
            else:
                publish_display_data(ev["data"], ev.get("metadata") or {})
        sys.stdout.flush()
        saved = rec.get("saved")
        for var, name in targets:
            # a failed --raises run saved only what it defined before failing
            if rec.get("error") and saved is not None and not any(Path(p).stem == Path(name).name for p in saved):
                continue
            shell.user_ns[var] = store.load_value(name)
        if rec.get("error"):
            err = rec["error"]
            raise RecordedCellError(f"(recorded on {prov.get('gpu')}) {err['ename']}: {err['evalue']}")
        return

    events: list = []
    pub = shell.display_pub
    original_publish = pub.publish

    def publish(data, metadata=None, *a, **kw):
        events.append({"type": "display", "data": _jsonable_data(dict(data)),
                       "metadata": dict(metadata or {})})
        return original_publish(data, metadata, *a, **kw)

    old_stdout = sys.stdout
    sys.stdout = _Tee(old_stdout, events)
    pub.publish = publish
    failure: BaseException | None = None
    try:
        _run_live(shell, cell)
    except Exception as exc:
        if not args.raises:
            raise
        failure = exc  # the failure is the lesson: record it, then raise it as the cell would
    finally:
        sys.stdout = old_stdout
        del pub.publish  # drop the instance attribute: the class's method shows through again
    missing = [v for v, _ in targets if v not in shell.user_ns]
    if missing and failure is None:
        raise InputError(f"--save names {missing}, which the cell did not define")
    if failure is not None:
        targets = [(v, n) for v, n in targets if v in shell.user_ns]  # the failure is the point: keep it
    elif args.raises:
        print("note: this --raises cell did not raise", file=sys.stderr)
    store = live_store()
    prov = store.write_meta()
    saved = [str(store.save_value(name, shell.user_ns[var], prov).relative_to(store.path)) for var, name in targets]
    if recording_enabled():
        store.save_cell({"notebook": notebook, "key": args.key, "source_hash": digest,
                         "source": cell, "provenance": prov, "outputs": events, "saved": saved,
                         **({"error": {"ename": type(failure).__name__, "evalue": str(failure)[:4000]}}
                            if failure is not None else {})})
    if failure is not None:
        raise failure


def load_ipython_extension(shell) -> None:
    """``%load_ext cgutils.recorded`` registers the ``%%recorded`` cell magic."""
    shell.register_magic_function(recorded_cell, magic_kind="cell", magic_name="recorded")


def setup_notebook(name: str) -> dict:
    """First cell of every notebook: name it, register ``%%recorded``, and report device and mode.

    Args:
        name: the notebook's file stem, e.g. ``"05_speedup_table"``; recordings are stored under it.

    Returns:
        dict with ``mode``, ``device`` and, in recorded mode, the ``recording`` provenance.
    """
    from IPython import get_ipython

    _state["notebook"] = name
    shell = get_ipython()
    if shell is not None:
        load_ipython_extension(shell)
    m = env.mode()
    info: dict[str, Any] = {"mode": m}
    if m == "live":
        import torch

        info["device"] = torch.cuda.get_device_name(0)
        print(f"Mode: live, on {info['device']}. Cells measure for real"
              + (" and are being recorded." if recording_enabled() else "."))
    else:
        info["device"] = "cpu"
        try:
            store = ResultsStore()
            info["recording"] = store.notebook_meta(name)
            print(f"Mode: recorded (no CUDA device here). GPU cells show results recorded on "
                  f"{env.describe(info['recording'])}.")
        except RecordingError as exc:
            print(f"Mode: recorded, but {exc}")
    return info


# --- staleness check -------------------------------------------------------------------------------


@dataclass(frozen=True)
class CellStatus:
    """Recording status of one ``%%recorded`` cell: ``status`` is ``ok``, ``stale`` or ``missing``."""

    notebook: str
    key: str
    status: str
    detail: str = ""


def recorded_cells(notebook_path: Path | str) -> list[tuple[str, str, str]]:
    """``(key, line, body)`` of each ``%%recorded`` cell in a notebook file."""
    nb = _read_json(Path(notebook_path))
    out = []
    for c in nb.get("cells", []):
        if c.get("cell_type") != "code":
            continue
        src = "".join(c.get("source", [])) if isinstance(c.get("source"), list) else c.get("source", "")
        first, _, body = src.partition("\n")
        if first.startswith(MAGIC):
            line = first[len(MAGIC):]
            out.append((_parse_line(line).key, line, body))
    return out


def check_recordings(notebooks_dir: Path | str | None = None, store: ResultsStore | None = None) -> list[CellStatus]:
    """Check every ``%%recorded`` cell of every notebook against the store.

    Returns:
        One :class:`CellStatus` per recorded cell; all ``ok`` means recorded mode will show current
        outputs. A cell is current when its source is unchanged; the code it calls may have changed
        since, which the banner's commit (provenance) tells.

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
                store.load_cell(nb_path.stem, key, expected_hash=source_hash(line, body))
                result.append(CellStatus(nb_path.stem, key, "ok"))
            except StaleRecordingError as exc:
                result.append(CellStatus(nb_path.stem, key, "stale", str(exc)))
            except RecordingError as exc:
                result.append(CellStatus(nb_path.stem, key, "missing", str(exc)))
    return result
