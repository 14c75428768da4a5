"""The package's import graph: no module imports, directly or through others, a module that
imports it back (no circles), and the layer contract in pyproject.toml holds (lint-imports;
`make lint` runs it too). Both read the real source tree."""

import subprocess
import sys
from pathlib import Path

import grimp

from tests.helpers import ROOT


def test_no_import_circles() -> None:
    graph = grimp.build_graph("megarl")  # type-checking imports count too
    circles = sorted(
        {
            tuple(sorted((a, b)))
            for a in graph.modules
            for b in graph.find_modules_directly_imported_by(a)
            if b.startswith("megarl") and graph.chain_exists(importer=b, imported=a)
        }
    )
    assert len(graph.modules) > 50  # the whole package was read
    assert circles == [], circles


def test_layer_contract_holds() -> None:
    lint = Path(sys.executable).parent / "lint-imports"  # installed beside this interpreter
    proc = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "1 kept, 0 broken" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
