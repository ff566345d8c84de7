"""The documentation: README.md is the short way in (what megappo is, the quick start, the test command, a map) and
links every page of docs/, a MkDocs site that builds under `strict` (no broken link or anchor, every page in the
nav), and the site's home repeats the README's quick-start commands exactly."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
README = (REPO / "README.md").read_text()


def _pages() -> set[str]:
    return {p.name for p in DOCS.glob("*.md")}


def _nav_pages(nav) -> set[str]:
    out = set()
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        out |= _nav_pages(value) if isinstance(value, list) else {value}
    return out


def test_readme_is_short():
    assert len(README.splitlines()) < 250, "README.md is the short way in: move sections to a page of docs/"


def test_readme_links_every_docs_page():
    linked = set(re.findall(r"\]\(docs/([\w.-]+\.md)(?:#[\w-]*)?\)", README))
    assert _pages() - linked == set(), "README.md's map does not link these pages of docs/"
    assert linked - _pages() == set(), "README.md links pages docs/ does not have"


def test_the_nav_lists_every_page():
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    assert config["strict"] is True and config["docs_dir"] == "docs"
    assert config["theme"]["name"] in ("mkdocs", "readthedocs")  # built in: building needs no network
    assert _nav_pages(config["nav"]) == _pages()


def test_the_home_page_repeats_the_quick_start_commands():
    def commands(text):
        quick = text[text.index("## Quick start"):]
        return re.findall(r"^```bash\n(.*?)^```", quick, re.S | re.M)[:2]

    readme = commands(README)
    assert len(readme) == 2 and "megappo train --config recipes/cpu/tiny_ppo.yaml" in readme[0]
    assert "python -m pytest" in readme[1]
    assert commands((DOCS / "index.md").read_text()) == readme


def test_the_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="MkDocs is not installed (it is in the `test` extra: pip install -e .[test])")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(REPO / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()
