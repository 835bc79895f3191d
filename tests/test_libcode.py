"""Which library files a block of code ran (cgutils.libcode): the basis of library staleness."""

import sys

from cgutils import libcode


def _package(tmp_path):
    pkg = tmp_path / "demo_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "used.py").write_text("def f():\n    return 1\n")
    (pkg / "unused.py").write_text("def g():\n    return 2\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import demo_pkg.unused
        import demo_pkg.used
    finally:
        sys.path.remove(str(tmp_path))
    return pkg.resolve(), demo_pkg.used


def test_code_used_names_the_files_that_ran(tmp_path):
    pkg, used_mod = _package(tmp_path)
    for _ in range(2):  # a second block must see functions that the first one disabled
        with libcode.code_used(pkg) as used:
            used_mod.f()
        assert used["demo_pkg/used.py"] == libcode.file_hash(pkg / "used.py")
        if hasattr(sys, "monitoring"):  # Python >= 3.12: only what ran
            assert "demo_pkg/unused.py" not in used
        else:  # older Pythons record every file (any change marks the cell)
            assert "demo_pkg/unused.py" in used
    if hasattr(sys, "monitoring"):
        assert all(sys.monitoring.get_tool(t) != "cgutils-recording" for t in range(6))  # tool id released


def test_changed_files_sees_edits_and_deletions(tmp_path):
    pkg, used_mod = _package(tmp_path)
    with libcode.code_used(pkg) as used:
        used_mod.f()
    assert libcode.changed_files(used, pkg) == []
    (pkg / "used.py").write_text("def f():\n    return 3\n")
    assert libcode.changed_files(used, pkg) == ["demo_pkg/used.py"]
    (pkg / "used.py").unlink()
    assert libcode.changed_files(used, pkg) == ["demo_pkg/used.py"]


def test_ignored_files_are_never_collected(tmp_path):
    """The recording machinery's own hooks (recorded.py's stdout tee) ran inside every cell, so every recording
    listed recorded.py and any edit to it would have called every cell stale."""
    pkg, used_mod = _package(tmp_path)
    with libcode.code_used(pkg, ignore=[pkg / "used.py"]) as used:
        used_mod.f()
    assert "demo_pkg/used.py" not in used
