"""Session hooks: slow work a collected test will need, started early in the background."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any(item.nodeid.endswith("test_packaging.py::test_gpu_extra_resolves_with_the_project_pins") for item in items):
        from tests import gpu_resolve

        gpu_resolve.start()
