"""The ``%%recorded`` cell magic and notebook set-up: one notebook, two modes (see ``env.mode``).

* **live** (CUDA present): a ``%%recorded KEY`` cell runs for real and the variables named by
  ``--save`` are written to :func:`~cgutils.store.live_store`. When ``CGUTILS_RECORD=1`` (set by
  ``make record``) that store is ``results/<slug>/`` and the cell's printed text, rich outputs and
  figures, its source hash and the provenance are recorded there too.
* **recorded** (no CUDA): the cell is not run; its recorded outputs are shown under a banner naming
  GPU, driver, versions and date, and the saved variables are restored. A cell whose source changed
  since recording is *stale*: :class:`~cgutils.errors.StaleRecordingError` is raised, as it is for a
  missing recording, so the tests fail instead of showing outdated numbers.
* ``--raises``: the cell is meant to fail (a lesson about an error). Live, its exception is recorded
  and re-raised; recorded, the outputs are shown and :class:`~cgutils.errors.RecordedCellError`
  carries the recorded error text. Tag such cells ``raises-exception`` for nbmake.

The store itself (layout, provenance, which GPU's recording is shown) and the staleness check live in
:mod:`cgutils.store`; their names are re-exported here, where notebooks have always imported them.
"""

from __future__ import annotations

import ast
import base64
import os
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from . import env
from .errors import InputError, RecordedCellError, RecordingError
from .libcode import changed_files, code_used
from .store import (
    MAGIC,
    CellStatus,
    ResultsStore,
    check_recordings,
    code_cell_sources,
    current_store,
    live_store,
    parse_magic_line,
    recorded_cells,
    recording_enabled,
    results_root,
    source_hash,
)

__all__ = [
    "MAGIC", "CellStatus", "ResultsStore", "check_recordings", "current_store", "live_store", "parse_magic_line",
    "recorded_cells", "recording_enabled", "results_root", "source_hash",
    "recorded_cell", "load_ipython_extension", "setup_notebook",
]

_state: dict[str, Any] = {"notebook": None}


@dataclass(frozen=True)
class _Cell:
    """One run of the magic: whose cell it is, its body and hash, and what it saves."""

    notebook: str
    key: str
    body: str
    digest: str  # source_hash of the magic's line and the body
    raises: bool
    targets: tuple[tuple[str, str], ...]  # (variable, store name) for each --save


def _cell(line: str, body: str) -> _Cell:
    notebook = _state["notebook"]
    if notebook is None:
        raise RecordingError("call cgutils.setup_notebook('NN_name') before using %%recorded")
    args = parse_magic_line(line)
    targets = []
    for item in args.save:
        var, _, name = item.partition(":")
        targets.append((var, name or f"cells/{notebook}/{args.key}.{var}"))
    return _Cell(notebook, args.key, body, source_hash(line, body), args.raises, tuple(targets))


def recorded_cell(line: str, cell: str) -> None:
    """Body of the ``%%recorded KEY [--save VAR[:NAME] ...] [--raises]`` cell magic (see the module docstring):
    replays the recording in recorded mode, runs (and records) the cell in live mode.

    Raises:
        RecordingError: no notebook name set (call :func:`setup_notebook`), or a missing recording.
        StaleRecordingError: in recorded mode, when the cell changed since it was recorded.
        RecordedCellError: in recorded mode, a ``--raises`` cell: the error recorded on the GPU.
        InputError: bad magic arguments, or a ``--save`` variable that the cell did not define.
        NoCudaError: ``CGUTILS_MODE=live`` without a CUDA device.
    """
    from IPython import get_ipython

    shell = get_ipython()
    c = _cell(line, cell)
    if env.mode() == "recorded":
        _replay_recorded(shell, c)
    elif recording_enabled() and not runs_live(c.notebook, c.key):
        # `record --changed` replays a cell whose recording is current; its imports run, for the live cells after
        exec(top_level_imports(c.body), shell.user_ns)  # noqa: S102 - the cell's own import lines
        _replay_recorded(shell, c)
    else:
        _run_and_record(shell, c)


# --- recorded mode: replay under a banner ------------------------------------------------------------


def _when(prov: dict) -> str:
    """``"2026-12-01 16:22 UTC"`` from a provenance's ISO date (the date alone when it has no time)."""
    date = str(prov.get("date") or "?")
    try:
        stamp = datetime.fromisoformat(date).astimezone(timezone.utc)
    except ValueError:
        return date[:10]
    return stamp.strftime("%Y-%m-%d %H:%M UTC")


def banner(prov: dict, digest: str, library: dict | None) -> dict:
    """The banner above a replayed cell, as display data (plain text and HTML): where and when it was recorded,
    and whether the library code the cell ran has changed since (``library``: path -> hash, as recorded)."""
    changed = changed_files(library) if library is not None else None
    if changed is None:
        drift = "which library code it ran was not recorded"
    elif changed:
        drift = f"library code changed since: {', '.join(changed)}"
    else:
        drift = ("the library file it ran is unchanged" if len(library) == 1 else
                 f"the {len(library)} library files it ran are unchanged")
    warn = changed is None or bool(changed)
    text = (f"Recorded output: this machine has no CUDA device, so this cell shows what it printed on "
            f"{env.describe(prov)} ({_when(prov)}); cell hash {digest}; {drift}.")
    commit = str(prov.get("git_commit") or "unknown")[:10]
    html = (f'<div style="border-left:4px solid {"#d08000" if warn else "#76b900"};padding:4px 8px;'
            f'background:{"#fdf3e1" if warn else "#f4f9ec"}">'
            f"<b>Recorded on {prov.get('gpu')}</b> · driver {prov.get('driver')} · CUDA "
            f"{prov.get('cuda')} · torch {prov.get('torch')} · transformers {prov.get('transformers')}"
            f" · {_when(prov)} · commit {commit} · cell {digest}"
            f"{'<br>⚠ ' + drift if warn else ' · ' + drift}</div>")
    return {"text/plain": text, "text/html": html}


def _user_traceback(exc: BaseException, note: str = "") -> None:
    """Make IPython show ``exc`` from the cell's own lines on (its ``_render_traceback_`` protocol), without
    the frames of the magic that ran the cell; ``note`` is added to the message line."""
    tb = exc.__traceback__
    while tb is not None and not tb.tb_frame.f_code.co_filename.startswith("<recorded cell"):
        tb = tb.tb_next
    lines = traceback.format_exception(type(exc), exc, tb) if tb is not None else \
        traceback.format_exception_only(type(exc), exc)
    if note:
        lines = [*lines[:-1], lines[-1].rstrip("\n") + f" {note}\n"]
    try:
        exc._render_traceback_ = lambda: [line.rstrip("\n") for line in "".join(lines).splitlines()]
    except (AttributeError, TypeError):
        pass  # an exception type without a __dict__: IPython shows its full traceback


def _replay_recorded(shell, c: _Cell) -> None:
    """Show the recorded outputs of ``c`` under a banner and restore its ``--save`` variables."""
    from IPython.display import publish_display_data

    store = ResultsStore()
    rec = store.load_cell(c.notebook, c.key, expected_hash=c.digest)
    prov = rec.get("provenance", {})
    publish_display_data(banner(prov, c.digest, rec.get("library")))
    for ev in rec.get("outputs", []):
        if ev["type"] == "stream":
            sys.stdout.write(ev["text"])
        else:
            publish_display_data(ev["data"], ev.get("metadata") or {})
    sys.stdout.flush()
    saved = rec.get("saved")
    for var, name in c.targets:
        # a failed --raises run saved only what it defined before failing
        if rec.get("error") and saved is not None and not any(Path(p).stem == Path(name).name for p in saved):
            continue
        shell.user_ns[var] = store.load_value(name)
    if rec.get("error"):
        err = rec["error"]
        failure = RecordedCellError(f"{err['ename']}: {err['evalue']}")
        # the error is the lesson: shown as the cell raised it on the GPU, not from inside this replay
        failure._render_traceback_ = lambda: [f"{err['ename']}: {err['evalue']}",
                                              f"(raised when this cell was recorded on {prov.get('gpu')}, {_when(prov)})"]
        raise failure


# --- live mode: run, and record ----------------------------------------------------------------------


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


@contextmanager
def _captured_outputs(shell) -> Iterator[list]:
    """Record printed text and displayed objects, in order, while still showing them; yields the events."""
    events: list = []
    pub = shell.display_pub
    original_publish = pub.publish

    def publish(data, metadata=None, *a, **kw):
        events.append({"type": "display", "data": _jsonable_data(dict(data)), "metadata": dict(metadata or {})})
        return original_publish(data, metadata, *a, **kw)

    old_stdout = sys.stdout
    sys.stdout = _Tee(old_stdout, events)
    pub.publish = publish
    try:
        yield events
    finally:
        sys.stdout = old_stdout
        del pub.publish  # drop the instance attribute: the class's method shows through again


def _execute(shell, cell: str) -> None:
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
        if value is not None and not cell.rstrip().endswith(";"):
            display(value)
    if "matplotlib.pyplot" in sys.modules:  # figures are shown here, inside the capture, not after
        import matplotlib.pyplot as plt

        for num in plt.get_fignums():
            display(plt.figure(num))
            plt.close(num)


def _run_and_record(shell, c: _Cell) -> None:
    """Run ``c`` for real, save its ``--save`` variables to the live store and, when recording, the cell."""
    failure: BaseException | None = None
    # this module's hooks (the stdout tee, the display hook) run inside the cell: not the cell's library code
    started = time.perf_counter()
    with _captured_outputs(shell) as events, code_used(ignore=[__file__]) as library:
        try:
            _execute(shell, c.body)
        except Exception as exc:
            if not c.raises:
                raise
            failure = exc  # the failure is the lesson: record it, then raise it as the cell would
    targets = c.targets
    missing = [v for v, _ in targets if v not in shell.user_ns]
    if missing and failure is None:
        raise InputError(f"--save names {missing}, which the cell did not define")
    if failure is not None:
        targets = tuple((v, n) for v, n in targets if v in shell.user_ns)  # the failure is the point: keep it
    elif c.raises:
        print("note: this --raises cell did not raise", file=sys.stderr)
    store = live_store()
    prov = store.write_meta()
    saved = [str(store.save_value(name, shell.user_ns[var], prov).relative_to(store.path)) for var, name in targets]
    if recording_enabled():
        store.save_cell({"notebook": c.notebook, "key": c.key, "source_hash": c.digest,
                         "source": c.body, "library": library, "provenance": prov, "outputs": events,
                         "saved": saved, "seconds": round(time.perf_counter() - started, 2),  # to plan GPU time
                         **({"error": {"ename": type(failure).__name__, "evalue": str(failure)[:4000]}}
                            if failure is not None else {})})
    if failure is not None:
        _user_traceback(failure)
        raise failure


# --- notebook set-up ---------------------------------------------------------------------------------


def load_ipython_extension(shell) -> None:
    """``%load_ext cgutils.recorded`` registers the ``%%recorded`` cell magic."""
    shell.register_magic_function(recorded_cell, magic_kind="cell", magic_name="recorded")


def setup_notebook(name: str) -> dict:
    """First cell of every notebook: name it, register ``%%recorded``, and report device and mode.

    Args:
        name: the notebook's file stem, e.g. ``"05_speedup_table"``; recordings are stored under it.

    Returns:
        dict with ``mode``, ``device`` and, in recorded mode, the ``recording`` provenance.

    Raises:
        NoCudaError: ``CGUTILS_MODE=live`` without a CUDA device.
    """
    from IPython import get_ipython

    _state["notebook"] = name
    shell = get_ipython()
    if shell is not None:
        load_ipython_extension(shell)
    m = env.mode()
    info: dict[str, Any] = {"mode": m, "recorded_cells": _recorded_cells(name)}
    here = _versions()
    if m == "live":
        import torch

        info["device"] = torch.cuda.get_device_name(0)
        print(f"Mode: live, on {info['device']}. Cells measure for real"
              + (" and are being recorded." if recording_enabled() else ".") + f" They run on {here}.")
    else:
        info["device"] = "cpu"
        cells = info["recorded_cells"]
        try:
            store = ResultsStore()
            info["recording"] = store.notebook_meta(name)
            print(f"Mode: recorded (no CUDA device here). The {cells if cells is not None else ''} GPU cells (marked %%recorded) show what they "
                  f"printed on {env.describe(info['recording'])} ({_when(info['recording'])}); the other cells run "
                  f"here, on {here}.")
        except RecordingError as exc:
            print(f"Mode: recorded, but {exc}")
    return info


def _versions() -> str:
    """The versions this kernel runs with, as a banner names them."""
    import platform

    import torch

    try:
        import transformers

        tf = f", transformers {transformers.__version__}"
    except ImportError:
        tf = ""
    return f"torch {torch.__version__}{tf}, Python {platform.python_version()}"


def _recorded_cells(name: str) -> int | None:
    """How many ``%%recorded`` cells notebooks/<name>.ipynb holds, or None when it cannot be read."""
    try:
        return len(recorded_cells(env.REPO_ROOT / "notebooks" / f"{name}.ipynb"))
    except (RecordingError, InputError):
        return None

# --- record --changed: which recorded cells run on the GPU -----------------------------------------------
# Re-record only what changed: which ``%%recorded`` cells of a notebook must run on the GPU.
#
# ``python -m cgutils record --changed`` runs each notebook with the cells whose recording is current *replayed*
# (outputs shown, ``--save`` variables restored, top-level imports run) and the rest for real. A cell that runs
# for real may read a name only an earlier recorded body binds (a model, a graph): that cell runs for real too,
# transitively. Names are found with :mod:`ast`; one bound another way fails with a ``NameError``, and a full
# ``record`` of that notebook is the fallback. Why: a notebook's recording takes up to 7 minutes of scarce GPU
# time, mostly in unchanged cells; each cell's recording keeps its own provenance (commit, date).

PLAN_ENV = "CGUTILS_RECORD_LIVE"  # "notebook/key,notebook/key,...": the cells a --changed run runs for real


@dataclass(frozen=True)
class _CodeCell:
    key: str | None  # the recorded cell's key; None for a plain code cell
    saves: frozenset[str]  # the variables its --save restores when it is replayed
    binds: frozenset[str]
    reads: frozenset[str]
    imports: frozenset[str]  # bound by its top-level imports, which a replay runs too (top_level_imports)


def _python(source: str) -> str:
    """The cell as plain Python (IPython magics and ``!`` lines translated), for :mod:`ast`."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager
    except ImportError:  # without IPython no notebook runs either; keep the lines that parse
        return "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))
    return TransformerManager().transform_cell(source)


def _names(source: str) -> tuple[frozenset[str], frozenset[str]]:
    """(names the code binds at module level or anywhere, names it reads); both empty if it does not parse."""
    try:
        tree = ast.parse(_python(source))
    except SyntaxError:
        return frozenset(), frozenset()
    binds, reads = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (reads if isinstance(node.ctx, ast.Load) else binds).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            binds.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            binds.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.arg):
            binds.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            binds.add(node.name)
    return frozenset(binds), frozenset(reads - binds)


def top_level_imports(source: str) -> str:
    """The cell's top-level ``import`` statements as code: a ``record --changed`` run executes them when it
    replays the cell, so later cells that run for real find the modules the cell imported ('' if none)."""
    try:
        tree = ast.parse(_python(source))
    except SyntaxError:
        return ""
    return "\n".join(ast.unparse(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)))


def _imported(source: str) -> frozenset[str]:
    code = top_level_imports(source)
    return _names(code)[0] if code else frozenset()


def code_cells(notebook_path: Path | str) -> list[_CodeCell]:
    """Every code cell of a notebook file, in order, with the names it binds and reads.

    Raises:
        RecordingError: the file is missing or not JSON.
        InputError: a ``%%recorded`` line does not parse.
    """
    cells = []
    for line, src in code_cell_sources(notebook_path):
        key, saves = None, frozenset()
        if line is not None:
            args = parse_magic_line(line)
            key, saves = args.key, frozenset(item.partition(":")[0] for item in args.save)
        cells.append(_CodeCell(key, saves, *_names(src), _imported(src) if key else frozenset()))
    return cells


def cells_to_run(notebook_path: Path | str, changed: set[str]) -> list[str]:
    """The keys of the recorded cells to run for real: ``changed`` (stale or missing recordings) and every
    earlier recorded cell whose body binds a name one of them, or any plain cell, reads and no plain cell before it binds (and
    that its ``--save`` and top-level imports do not restore), transitively; in notebook order.

    Args:
        notebook_path: the ``.ipynb`` file.
        changed: keys of its recorded cells whose recording is not current.
    """
    if not changed:
        return []
    cells = code_cells(notebook_path)
    live = set(changed)
    grew = True
    while grew:
        grew = False
        for i, cell in enumerate(cells):
            if cell.key is not None and cell.key not in live:
                continue  # replayed; a plain cell runs whenever the notebook does (its live-mode branch too)
            for name in cell.reads:
                if any(c.key is None and name in c.binds for c in cells[:i]):
                    continue  # a plain cell binds it too, as recorded mode relies on (an import, a helper)
                binder = next((c for c in reversed(cells[:i]) if name in c.binds), None)
                if (binder is not None and binder.key is not None and binder.key not in live
                        and name not in binder.saves and name not in binder.imports):
                    live.add(binder.key)
                    grew = True
    return [c.key for c in cells if c.key in live]


def runs_live(notebook: str, key: str) -> bool:
    """False when a ``record --changed`` run replays this cell's current recording instead of running it."""
    plan = os.environ.get(PLAN_ENV)
    return plan is None or f"{notebook}/{key}" in plan.split(",")
