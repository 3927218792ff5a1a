"""MkDocs hook: the configuration page's reference table is made from the settings model at build time
(server/config_reference.py), so the site lists every key once and never drifts from the code."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- configuration reference: generated from server/config.py -->"


def on_page_markdown(markdown: str, page, **_) -> str:
    if MARKER not in markdown:
        return markdown
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # this checkout's server package, not another one installed
    from server.config_reference import markdown as reference

    return markdown.replace(MARKER, reference())
