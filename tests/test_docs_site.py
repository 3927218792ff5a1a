"""The documentation site builds with `mkdocs build --strict` (no broken link or anchor, no page left out
of the navigation), its configuration page carries the reference made from the settings model, and the
README stays a front page."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="mkdocs is not installed (the `dev` extra: pip install -e '.[dev]')")
pytest.importorskip("material", reason="mkdocs-material is not installed (the `dev` extra)")

from server.config_reference import keys  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def build(site: Path, config: Path = ROOT / "mkdocs.yml") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
                          timeout=300)


def test_the_site_builds_strictly_with_the_generated_configuration_reference(tmp_path):
    done = build(tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    page = (tmp_path / "site" / "configuration" / "index.html").read_text()
    assert "configuration reference: generated" not in page
    assert all(f"<code>{key.env}</code>" in page for key in keys())
    assert (tmp_path / "site" / "ui.png").is_file()
    assert (tmp_path / "site" / "results" / "accuracy-embedded-n8.json").is_file()
    # The README is outside the site: its links into docs/ are checked against the built pages here.
    links = re.findall(r"\]\((docs/[^)#]+)(?:#([^)]+))?\)", (ROOT / "README.md").read_text())
    assert len(links) >= 15
    missing = []
    for path, anchor in links:
        page = tmp_path / "site" / ("" if path == "docs/index.md" else path.removeprefix("docs/").removesuffix(".md"))
        html = (page / "index.html").read_text() if (page / "index.html").is_file() else None
        if html is None or (anchor and f'id="{anchor}"' not in html):
            missing.append(f"{path}#{anchor}")
    assert missing == []


def test_a_broken_anchor_fails_the_strict_build(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[the reference](configuration.md#no-such-section)\n")
    (docs / "configuration.md").write_text("# Configuration\n")
    config = tmp_path / "mkdocs.yml"
    text = (ROOT / "mkdocs.yml").read_text().replace("docs_dir: docs", f"docs_dir: {docs}")
    text = text.replace("  - docs/hooks/config_reference.py", f"  - {ROOT / 'docs/hooks/config_reference.py'}")
    config.write_text(text.split("\nnav:")[0] + "\nnav:\n  - index.md\n  - configuration.md\n")
    done = build(tmp_path / "site", config)
    assert done.returncode == 1
    assert "does not contain an anchor '#no-such-section'" in done.stdout + done.stderr


def test_the_readme_is_a_front_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
