"""The `gpu` extra resolves: pip's resolver, run against the package index with the project's
own pins (``pip install --dry-run``, nothing installed), finds one consistent set — the vLLM
and Transformer Engine that the extra names, on the torch the project pins."""

import json

from tests import gpu_resolve


def test_gpu_extra_resolves_with_the_project_pins() -> None:
    deps, gpu = gpu_resolve.requirements()
    torch_pin = next(d for d in deps if d.startswith("torch=="))
    assert any(d.startswith("vllm==") for d in gpu) and any(d.startswith("transformer-engine") for d in gpu)
    returncode, stderr, report = gpu_resolve.result()  # (started when this test was collected: tests/conftest.py)
    assert returncode == 0, stderr[-4000:]
    chosen = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]
              for i in json.loads(report.read_text())["install"]}
    assert chosen["torch"].split("+")[0] == torch_pin.split("==")[1]
    for dep in gpu:
        name, version = dep.split("==")
        assert chosen[name.split("[")[0]] == version, (dep, chosen.get(name.split("[")[0]))
