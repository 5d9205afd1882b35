"""The documentation site's shape: a short nav with the lab notes apart, figures drawn from the
run logs and embedded in the pages, the API page generated from the code, and the check that
.ci/run runs on the built site (ci/check_site.py) catching what it is there to catch.

(The build itself, `mkdocs build --strict`, runs in .ci/run with the pinned theme and plugins.)"""
from __future__ import annotations

import importlib.util
import re
import struct
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
LAB_NOTES = {"experiments.md", "benchmark-runs.md"}


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def nav() -> list[tuple[str, list[str]]]:
    """mkdocs.yml's nav as (top-level title, its pages), read without YAML (not a test
    requirement): the block's lines are ``- Title: page.md`` or ``- Title:`` with nested pages."""
    text = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    block = text[text.index("\nnav:\n") + 6:]
    items: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        m = re.match(r"^(\s*)- ([^:]+):\s*(\S+\.md)?\s*$", line)
        if not m:
            if line and not line.startswith(" "):
                break  # the next top-level key
            continue
        indent, title, page = m.groups()
        if len(indent) == 2:
            items.append((title, [page] if page else []))
        elif page:
            items[-1][1].append(page)
    return items


def test_nav_is_short_and_keeps_lab_notes_apart():
    items = nav()
    assert 5 <= len(items) <= 8, [t for t, _ in items]
    pages = [p for _, ps in items for p in ps]
    assert len(pages) == len(set(pages))
    assert sorted(pages) == sorted(p.name for p in DOCS.glob("*.md")), "every page in the nav, once"
    lab = dict(items)["Lab notes"]
    assert set(lab) == LAB_NOTES
    assert items[0] == ("Home", ["index.md"])


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", head[16:24])


def test_figures_are_embedded_where_the_text_discusses_them():
    """At least three figures drawn by benchmarks/plots.py, each embedded in a page and sized for
    the content column (readable without zooming: at most about 1,000 px wide)."""
    embeds = {}
    for page in DOCS.glob("*.md"):
        for target in re.findall(r"!\[[^\]]+\]\((img/[^)]+\.png)\)", page.read_text(encoding="utf-8")):
            embeds.setdefault(target, []).append(page.name)
    plots = (ROOT / "benchmarks" / "plots.py").read_text(encoding="utf-8")
    drawn = set(re.findall(r'out / "([a-z_]+\.png)"', plots))
    assert len(drawn) >= 3 and {f"img/{n}" for n in drawn} <= set(embeds), (drawn, embeds)
    assert embeds["img/cpu_threads.png"] == ["benchmarks.md"]
    assert embeds["img/bytes_per_param.png"] == ["memory.md"]
    assert embeds["img/lowbit_curves.png"] == ["lowbit.md"]
    for target in embeds:
        width, height = _png_size(DOCS / target)
        assert 600 <= width <= 1000 and height <= 1000, (target, width, height)


def test_plots_read_the_run_logs():
    plots = _load(ROOT / "benchmarks" / "plots.py")
    rows = plots.cpu_rows()
    for contender in ("ours", "torch fused", "deepspeed cpu_adam", "floor"):
        assert set(rows[("flat 64M", "fp32", contender)]) == {1, 4, 16}
    assert rows[("flat 64M", "fp32", "ours")][16] == 0.220  # the log's row, as written
    memory = dict(plots.memory_rows())
    assert memory["torch.optim.AdamW, fp32 params"] == 17.53 and len(memory) == 12
    curves = plots.read_curves()
    assert set(curves) == set(plots.MODES) and len({len(v) for v in curves.values()}) == 1


def test_api_page_is_generated_from_the_public_names():
    api = _load(ROOT / "ci" / "mkdocs_api.py")
    text = (DOCS / "api.md").read_text(encoding="utf-8")
    assert api.MARKER in text and "| `Adam` | `torch.optim.Adam`'s: `(params" not in text  # no hand-typed signatures
    import importlib

    import mps_fused_adam
    init = Path(mps_fused_adam.__file__)  # the installed package's: the checkout's python/ is not a test source
    names = api.public_names(init)
    reference = api.reference_markdown(names)
    for name, module in names.items():
        assert f"::: mps_fused_adam.{module}.{name}\n" in reference
        assert getattr(importlib.import_module(f"mps_fused_adam.{module}"), name) is getattr(mps_fused_adam, name)
    assert set(names) == set(mps_fused_adam.__all__) - {"__version__"}


def test_site_check_catches_missing_pages_images_and_remote_loads(tmp_path):
    check_site = _load(ROOT / "ci" / "check_site.py")
    site = tmp_path / "site"
    (site / "img").mkdir(parents=True)
    (site / "img" / "a.png").write_bytes(b"png")
    (site / "assets").mkdir()
    (site / "assets" / "x.js").write_text("1")
    good = '<img src="img/a.png"><script src="assets/x.js"></script>'
    (site / "index.html").write_text(good)
    (site / "api.html").write_text(good)
    config = {"use_directory_urls": False, "nav": [{"Home": "index.md"}, {"Ref": [{"API": "api.md"}]}]}
    problems, pages, loads = check_site.check(config, site)
    assert problems == [] and pages == 2 and loads == 4
    (site / "api.html").write_text('<img src="img/gone.png"><img src="img/empty.png">'
                                   '<script src="https://unpkg.com/x.js"></script>')
    (site / "img" / "empty.png").write_bytes(b"")
    (site / "index.html").unlink()
    problems, _, _ = check_site.check(config, site)
    assert any("nav page index.md" in p for p in problems)
    assert any("img/gone.png is missing" in p for p in problems)
    assert any("img/empty.png is missing or empty" in p for p in problems)
    assert any("from another host" in p for p in problems)
    assert check_site.built_path(site, "api.md", True) == site / "api" / "index.html"
