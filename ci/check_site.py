"""The built documentation site holds everything its nav and pages name.

    python ci/check_site.py mkdocs.yml SITE_DIR

Checks, after `mkdocs build --strict` (which checks links between pages, not what the built
files hold): every page the nav names was built and is not empty; every image, script and
stylesheet a built page loads is a file of the site and not empty; none is loaded from another
host (the site must work without a network: no CDN at view time). Prints what is wrong and
exits 1, else prints what it checked. Needs PyYAML (a dependency of mkdocs)."""
from __future__ import annotations

import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit


def nav_pages(nav) -> list[str]:
    """The Markdown files of a mkdocs nav (nested sections included), in order."""
    found: list[str] = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        if isinstance(value, list):
            found += nav_pages(value)
        elif isinstance(value, str) and value.endswith(".md"):
            found.append(value)
    return found


def built_path(site: Path, page: str, directory_urls: bool) -> Path:
    stem = page[:-3]
    if not directory_urls or stem == "index" or stem.endswith("/index"):
        return site / f"{stem}.html"
    return site / stem / "index.html"


class _Loads(HTMLParser):
    """What a page loads: (tag, url) of images, scripts and stylesheets."""

    def __init__(self) -> None:
        super().__init__()
        self.loads: list[tuple[str, str]] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        if tag in ("img", "script") and a.get("src"):
            self.loads.append((tag, a["src"]))
        elif tag == "link" and a.get("href") and "stylesheet" in (a.get("rel") or ""):
            self.loads.append((tag, a["href"]))


def check(config: dict, site: Path) -> tuple[list[str], int, int]:
    """(problems, pages checked, loads checked)."""
    problems: list[str] = []
    directory_urls = config.get("use_directory_urls", True)
    pages = nav_pages(config.get("nav") or [])
    if not pages:
        problems.append("the nav names no page")
    for page in pages:
        path = built_path(site, page, directory_urls)
        if not path.is_file() or path.stat().st_size == 0:
            problems.append(f"nav page {page}: {path} is missing or empty")
    loads = 0
    for html in sorted(site.rglob("*.html")):
        parser = _Loads()
        parser.feed(html.read_text(encoding="utf-8", errors="replace"))
        for tag, url in parser.loads:
            loads += 1
            parts = urlsplit(url)
            if parts.scheme or parts.netloc:
                problems.append(f"{html.relative_to(site)}: <{tag}> loads {url} from another host")
                continue
            path = unquote(parts.path)
            # 404.html names its assets from the site's root, the pages relative to themselves.
            target = (site / path.lstrip("/") if path.startswith("/") else html.parent / path).resolve()
            if not target.is_file() or target.stat().st_size == 0:
                problems.append(f"{html.relative_to(site)}: <{tag}> {url} is missing or empty in the site")
    return problems, len(pages), loads


def main(argv: list[str] | None = None) -> int:
    import yaml
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    config = yaml.safe_load(Path(args[0]).read_text(encoding="utf-8"))
    problems, pages, loads = check(config, Path(args[1]))
    for p in problems:
        print(f"site check: {p}", file=sys.stderr)
    if not problems:
        print(f"site check: {pages} nav pages built, {loads} images, scripts and stylesheets found, none remote")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
