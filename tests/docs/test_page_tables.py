"""The README's documentation table and the site's home page (docs/index.md) list the same
topic pages: every page under docs/ (but the dated notes and the API reference, which the
site's navigation holds), each once, so a new page cannot go missing from the front door."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _table_pages(text: str, prefix: str) -> list[str]:
    """The pages a markdown table links in its first column, in order."""
    return re.findall(r"^\| \[[^\]]+\]\(" + re.escape(prefix) + r"([\w.-]+\.md)\) \|", text, re.M)


def test_the_readme_and_the_home_page_list_every_topic_page():
    pages = sorted(p.name for p in (REPO / "docs").glob("*.md") if p.name != "index.md")
    readme = _table_pages((REPO / "README.md").read_text(), "docs/")
    home = _table_pages((REPO / "docs" / "index.md").read_text(), "")
    assert sorted(readme) == pages, set(pages) ^ set(readme)
    assert home == readme  # the same rows in the same order (the API row links a folder)
