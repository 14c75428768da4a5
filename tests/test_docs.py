"""The docs site: the generated config reference is current, and each check of the docs build
bites — a config field without a docstring fails naming it, a stale docs/config.md fails, a
broken internal link or anchor fails ``mkdocs build --strict``, and README's own links resolve."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.config import RunConfig
from tools import config_docs

ROOT = Path(__file__).resolve().parent.parent

SECTIONS = '''
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True)
class Section:
    documented: int = 1
    """A field with its doc, steps."""
    bare: float = 0.5


@dataclass(kw_only=True)
class Root:
    sec: Section = field(default_factory=Section)
    """A section."""
'''


def _load(tmp_path: Path, name: str, source: str) -> type:
    """``Root`` of a module written to ``tmp_path`` (registered: ast reads the class source)."""
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module.Root  # type: ignore[no-any-return]


def test_committed_config_reference_is_current_and_complete() -> None:
    assert config_docs.check(RunConfig, config_docs.TARGET) == []
    text = config_docs.TARGET.read_text()
    assert "| `rollout.kv_cache_gb` | `float` | `0.25` | KV cache per engine on CPU, GiB. |" in text
    assert "## critic.parallel" in text and "## train.tracking" in text


def test_a_field_without_docstring_fails_naming_it(tmp_path: Path) -> None:
    root = _load(tmp_path, "docs_missing_cfg", SECTIONS)
    problems = config_docs.check(root, tmp_path / "config.md")
    assert len(problems) == 1
    assert "sec.bare (Section.bare in " in problems[0] and "docs_missing_cfg.py" in problems[0]
    assert "documented" not in problems[0]
    with pytest.raises(config_docs.UndocumentedFields, match=r"sec\.bare"):
        config_docs.render(root)


def test_a_stale_reference_fails(tmp_path: Path) -> None:
    source = SECTIONS.replace("    bare: float = 0.5\n", '    bare: float = 0.5\n    """A bare field, seconds."""\n')
    root = _load(tmp_path, "docs_stale_cfg", source)
    out = tmp_path / "config.md"
    out.write_text(config_docs.render(root))
    assert config_docs.check(root, out) == []
    assert "| `sec.bare` | `float` | `0.5` | A bare field, seconds. |" in out.read_text()
    # the code moves on (a new default), the committed page does not
    root = _load(tmp_path, "docs_stale_cfg2", source.replace("= 0.5", "= 0.25"))
    (problem,) = config_docs.check(root, out)
    assert "is stale" in problem and "make docs" in problem
    assert "+| `sec.bare` | `float` | `0.25` |" in problem


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_site_builds_strict(tmp_path: Path) -> None:
    run = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "site" / "config.html").exists() and (tmp_path / "site" / "slurm.html").exists()


def test_a_broken_internal_link_or_anchor_fails_the_build(tmp_path: Path) -> None:
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")  # symlinked pages copied as files
    usage = tmp_path / "docs" / "usage.md"
    usage.write_text(
        usage.read_text() + "\nSee [the page](no_such_page.md) and [a field](config.md#no-such-section).\n"
    )
    run = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert run.returncode != 0
    assert "no_such_page.md" in run.stderr and "no-such-section" in run.stderr, run.stderr


def _slug(heading: str) -> str:
    """Python-Markdown's toc id for a heading (as GitHub's, for the headings used here)."""
    text = re.sub(r"[^\w\- ]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def test_readme_is_short_and_its_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    local = [link for link in links if not re.match(r"[a-z]+:", link)]
    assert local, "README links no page"
    for link in local:
        target, _, anchor = link.partition("#")
        path = ROOT / target if target else ROOT / "README.md"
        assert path.exists(), f"README.md links {link}: {path} does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", path.read_text(), flags=re.M)
            assert anchor in {_slug(h) for h in headings}, f"README.md links {link}: no such heading"
