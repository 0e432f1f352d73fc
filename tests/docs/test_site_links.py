"""The docs site in a real headless Chromium: `mkdocs build --strict` (mkdocs.yml) builds it
into a temporary folder, an `http.server` thread serves it on 127.0.0.1, and every built
page is opened. Every `<a href>` that points inside the site must load (HTTP 200) and its
`#anchor`, if any, must be an element id on the target page as the browser rendered it.

`test_check_finds_broken_links` runs the same check on a hand-written two-page site with a
missing page and a missing anchor, so the check is seen to fail when a link is broken.
Chromium comes from the Debian packages `chromium` and `chromium-driver` (the skip rule of
tests/report); mkdocs from the project's `docs` extra, which `make test` installs."""

from __future__ import annotations

import functools
import http.server
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Every element id of the page and every link's resolved address.
PAGE_JS = """
return {ids: [...document.querySelectorAll('[id]')].map(e => e.id),
        links: [...document.querySelectorAll('a[href]')].map(a => a.href)};
"""


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def serve():
    """serve(folder) -> the base URL of `folder` served over http on 127.0.0.1."""
    servers = []

    def start(folder: Path) -> str:
        handler = functools.partial(_Quiet, directory=str(folder))
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def page_urls(site: Path, base: str) -> list[str]:
    """The URL of every built HTML page (a folder's index.html by its folder), but 404.html."""
    urls = []
    for path in sorted(site.rglob("*.html")):
        rel = path.relative_to(site).as_posix()
        if rel == "404.html":
            continue
        urls.append(base + (rel[: -len("index.html")] if path.name == "index.html" else rel))
    return urls


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def check_links(browser, base: str, pages: list[str]) -> tuple[int, list[str]]:
    """Open every page of `pages`; check each link that starts with `base`. Returns the number
    of links checked and one line per broken one."""
    seen: dict[str, set[str] | None] = {}  # page URL -> its element ids (None: did not load)

    def visit(url: str) -> dict:
        status = http_status(url)
        if status != 200:
            seen[url] = None
            return {"status": status, "ids": [], "links": []}
        browser.open(url)
        found = browser.run(PAGE_JS)
        seen[url] = set(found["ids"])
        return {"status": status, **found}

    links: list[tuple[str, str]] = []
    for page in pages:
        found = visit(page)
        assert found["status"] == 200, f"{page}: HTTP {found['status']}"
        links += [(page, href) for href in found["links"] if href.startswith(base)]

    problems = []
    for page, href in links:
        target, _, fragment = href.partition("#")
        if target not in seen:
            if target.endswith(("/", ".html")):
                visit(target)
            else:  # an image or another file: it must load, it has no ids
                seen[target] = set() if http_status(target) == 200 else None
        ids = seen[target]
        where = f"{page[len(base) - 1:]} -> {href[len(base) - 1:]}"
        if ids is None:
            problems.append(f"{where}: HTTP {http_status(target)}")
        elif fragment and urllib.parse.unquote(fragment) not in ids:
            problems.append(f"{where}: no element with id '{urllib.parse.unquote(fragment)}' on the target page")
    return len(links), problems


def test_site_links_and_anchors(browser, serve, tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, (
        "mkdocs build --strict failed (the docs extra installs mkdocs: pip install -e '.[docs]')\n"
        + r.stdout + r.stderr)
    base = serve(site)
    pages = page_urls(site, base)
    # one built page per Markdown file of docs/
    sources = sorted(p.relative_to(REPO / "docs").with_suffix("").as_posix()
                     for p in (REPO / "docs").rglob("*.md"))
    expected = sorted(base + (s[: -len("index")] if s == "index" or s.endswith("/index") else s + "/")
                      for s in sources)
    assert sorted(pages) == expected
    checked, problems = check_links(browser, base, pages)
    assert not problems, f"{len(problems)} broken of {checked} internal links:\n" + "\n".join(problems)
    assert checked > 20 * len(pages)  # the navigation alone links every page from every page


def test_check_finds_broken_links(browser, serve, tmp_path):
    (tmp_path / "index.html").write_text(
        '<h1 id="top">a</h1><a href="#top">self</a> <a href="b.html#there">ok</a> '
        '<a href="b.html#missing">bad anchor</a> <a href="gone.html">missing page</a> '
        '<a href="sub/">folder</a> <a href="https://example.com/#x">outside</a>')
    (tmp_path / "b.html").write_text('<p id="there">b</p><a href="index.html#top">back</a>')
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "index.html").write_text('<a href="../b.html#there">up</a> <a href="../c.html#nowhere">no</a>')
    base = serve(tmp_path)
    checked, problems = check_links(browser, base, page_urls(tmp_path, base))
    assert checked == 8
    assert sorted(problems) == sorted([
        "/ -> /b.html#missing: no element with id 'missing' on the target page",
        "/ -> /gone.html: HTTP 404",
        "/sub/ -> /c.html#nowhere: HTTP 404",
    ])
