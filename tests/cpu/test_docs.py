"""The README and docs/ stay true: every relative link (and its #anchor) resolves, the README's configuration
table lists every application field with its real default, and the product speaks of the product, not of how it
was developed."""

from __future__ import annotations

import pathlib
import re

import pytest

from specserve.serve.config import AppConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "deploy" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # '#' lines inside code blocks are not headings
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+)$", text, flags=re.M)}


def relative_links(page: pathlib.Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z]+:", t)]


def test_there_are_pages_and_links_to_check():
    assert (ROOT / "docs").is_dir() and len(PAGES) >= 6
    assert sum(len(relative_links(p)) for p in PAGES) >= 20


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}")
    assert not broken, broken


def test_slug_matches_githubs_rule():
    assert slug("dtype and the exactness caveat") == "dtype-and-the-exactness-caveat"
    assert slug("2026-11-22: the draft (`specserve distill`)") == "2026-11-22-the-draft-specserve-distill"


# fields whose default the table describes in words rather than as a literal
DESCRIBED = {"model_name", "api_key", "target_resources", "draft_resources", "stream_chunks_per_s", "compute_lanes",
             "kv_cache_tokens", "kv_memory_fraction"}


def _literal(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def test_readme_configuration_table_lists_every_field_with_its_default():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", section, flags=re.M))
    fields = AppConfig.model_fields
    assert set(rows) == set(fields), (set(fields) - set(rows), set(rows) - set(fields))
    wrong = {}
    for name, field in fields.items():
        if name in DESCRIBED:
            continue
        default = field.get_default(call_default_factory=True)
        if rows[name].strip() != f"`{_literal(default)}`":
            wrong[name] = (rows[name].strip(), _literal(default))
    assert not wrong, wrong


# words about how the project was developed, not about the product (a request's "session" is the product's own)
DEVELOPMENT = re.compile(r"\bissues? \d+|\bissue-\d+|\bstop \d+|\blease[sd]?\b|\bsittings?\b|device tool|device image|"
                         r"must-show|\bnewcomer|\b(?:GPU|H100|H200) session|next GPU session\b", re.I)
PRODUCT = [*PAGES, *sorted((ROOT / "cluster").glob("*.yaml")), *sorted((ROOT / "services").rglob("*.py")),
           ROOT / "Dockerfile", ROOT / "install.sh"]


def test_the_product_speaks_of_the_product():
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}" for path in PRODUCT
             for n, line in enumerate(path.read_text().splitlines(), 1) if DEVELOPMENT.search(line)]
    assert not found, found
