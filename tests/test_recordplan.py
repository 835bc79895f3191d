"""Which recorded cells `python -m cgutils record --changed` runs for real (cgutils.recorded, its last section)."""

import json

import pytest

from cgutils import InputError, RecordingError
from cgutils.recorded import cells_to_run, runs_live, top_level_imports


def notebook(tmp_path, *sources):
    cells = [{"cell_type": "markdown", "source": ["# title"]}]
    cells += [{"cell_type": "code", "source": s.splitlines(True), "metadata": {}, "outputs": []} for s in sources]
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps({"cells": cells}))
    return path


SETUP = "%load_ext cgutils.recorded\nimport numpy as np\nfrom helpers import build"
MODEL = "%%recorded model --save table\nimport torch\nmodel = build()\nwarned = 1\ntable = np.ones(3)\ndef step(x):\n    return x"


def test_a_changed_cell_pulls_the_earlier_cell_whose_body_binds_what_it_reads(tmp_path):
    nb = notebook(tmp_path, SETUP, MODEL, "%%recorded uses\ny = model(torch.ones(1))")
    assert cells_to_run(nb, {"uses"}) == ["model", "uses"]


def test_saved_variables_imports_and_plain_cells_do_not_pull(tmp_path):
    nb = notebook(tmp_path, SETUP, MODEL,
                  "%%recorded reads-saved\nprint(table.sum(), torch.ones(1), np.zeros(2))",  # --save, import, setup
                  "model = None  # a plain cell binds it too",
                  "%%recorded after-plain\nprint(model)")
    assert cells_to_run(nb, {"reads-saved"}) == ["reads-saved"]
    assert cells_to_run(nb, {"after-plain"}) == ["after-plain"]


def test_pulls_are_transitive_and_in_notebook_order(tmp_path):
    nb = notebook(tmp_path, SETUP, MODEL, "%%recorded graph\ng = step(model)",
                  "%%recorded replay\nprint(g)", "%%recorded unrelated\nprint(1)")
    assert cells_to_run(nb, {"replay"}) == ["model", "graph", "replay"]
    assert cells_to_run(nb, set()) == []


def test_names_bound_inside_the_cell_or_as_arguments_do_not_pull(tmp_path):
    nb = notebook(tmp_path, SETUP, MODEL, "%%recorded own\nmodel = 3\nf = lambda step: step + model\nprint(f(1))\n"
                  "try:\n    pass\nexcept ValueError as warned:\n    print(warned)")
    assert cells_to_run(nb, {"own"}) == ["own"]


def test_top_level_imports_only():
    body = "import torch\nfrom os import path as p\ndef f():\n    import json\nx = 1"
    assert top_level_imports(body) == "import torch\nfrom os import path as p"
    assert top_level_imports("x = (") == ""


def test_runs_live_without_a_plan_and_by_the_plan(monkeypatch):
    monkeypatch.delenv("CGUTILS_RECORD_LIVE", raising=False)
    assert runs_live("01_x", "a")
    monkeypatch.setenv("CGUTILS_RECORD_LIVE", "01_x/a,02_y/b")
    assert runs_live("01_x", "a") and runs_live("02_y", "b") and not runs_live("01_x", "b")


def test_bad_notebooks_are_named(tmp_path):
    with pytest.raises(RecordingError, match="cannot read notebook"):
        cells_to_run(tmp_path / "missing.ipynb", {"a"})
    bad = notebook(tmp_path, "%%recorded\nx = 1")
    with pytest.raises(InputError):
        cells_to_run(bad, {"a"})


def test_a_plain_cell_pulls_too_when_the_notebook_runs(tmp_path):
    """A plain cell's live-mode branch may read a recorded body's name (notebook 10's Solutions did: the first
    `record --changed` run failed there with a NameError)."""
    nb = notebook(tmp_path, SETUP, MODEL, "%%recorded later\nprint(1)",
                  "if live:\n    print(model)\nelse:\n    print(table)")
    assert cells_to_run(nb, {"later"}) == ["model", "later"]
