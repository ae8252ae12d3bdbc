"""The package installs under edgeinfer. only, both as a wheel and editable."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_puts_nothing_generic_into_site_packages(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), ROOT],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    wheel = next(tmp_path.glob("edgeinfer-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {n.split("/")[0] for n in names}
    assert top_level == {"edgeinfer", next(t for t in top_level if t.endswith(".dist-info"))}
    for module in (
        "edgeinfer/backends/base.py",
        "edgeinfer/models/catalog.py",
        "edgeinfer/py.typed",
        "edgeinfer/cli.py",
    ):
        assert module in names
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "edgeinfer = edgeinfer.console:main" in entry_points


def test_installed_package_imports_from_anywhere(tmp_path):
    # Run outside the checkout, so only the installed (here: editable) package can answer.
    code = "import edgeinfer.backends.base, edgeinfer.models.catalog, edgeinfer.tui; print(edgeinfer.__file__)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("edgeinfer/__init__.py")


def test_every_public_name_resolves():
    import edgeinfer

    assert sorted(edgeinfer.__all__) == sorted(edgeinfer._EXPORTS)
    for name in edgeinfer.__all__:
        assert getattr(edgeinfer, name).__name__ == name
