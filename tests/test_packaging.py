"""The `gpu` extra resolves: pip's resolver, run against the package index with the project's
own pins (``pip install --dry-run``, nothing installed), finds one consistent set — the vLLM
and Transformer Engine that the extra names, on the torch the project pins."""

import json
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

from tests.helpers import ROOT


def test_gpu_extra_resolves_with_the_project_pins(tmp_path: Path) -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_pin = next(d for d in meta["dependencies"] if d.startswith("torch=="))
    gpu = meta["optional-dependencies"]["gpu"]
    assert any(d.startswith("vllm==") for d in gpu) and any(d.startswith("transformer-engine") for d in gpu)
    env = tmp_path / "venv"
    venv.create(env, with_pip=False)  # empty: nothing installed counts as satisfied
    report = tmp_path / "report.json"
    # the project's runtime pins + the extra, as `pip install .[gpu]` would ask for them. This
    # venv's pip (the one `make venv` upgrades) resolves for the empty one (--python): Python
    # 3.11's bundled pip 23.2 took ~45 s longer for the same answer (docs/LOG.md, session 16)
    reqs = [*meta["dependencies"], *gpu]
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(env / "bin/python"), "install", "--dry-run",
                           "--quiet", "--report", str(report), *reqs], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    chosen = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]
              for i in json.loads(report.read_text())["install"]}
    assert chosen["torch"].split("+")[0] == torch_pin.split("==")[1]
    for dep in gpu:
        name, version = dep.split("==")
        assert chosen[name.split("[")[0]] == version, (dep, chosen.get(name.split("[")[0]))
