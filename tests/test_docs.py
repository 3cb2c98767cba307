"""The documents a newcomer reads: their sizes, their links, and that they describe the present (history lives in git
and benchmarks/log/)."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HISTORY = re.compile(r"\bissue \d+|\b(sweep|sweeps)\b|\b(first|second|third|[a-z]+th) sweep|\bbefore this\b|"
                     r"\bno longer\b|\bused to\b|\bwas the default\b", re.IGNORECASE)


@pytest.mark.parametrize("path, most", [("README.md", 300), ("benchmarks/README.md", 250)])
def test_a_readme_stays_short(path, most):
    assert len((ROOT / path).read_text().splitlines()) <= most


@pytest.mark.parametrize("doc", DOCS + [ROOT / "benchmarks" / "README.md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    text = doc.read_text()
    targets = [t.split("#")[0] for t in LINK.findall(text) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]
    missing = [t for t in targets if t and not (doc.parent / t).exists()]
    assert not missing, f"{doc.name}: links to nothing: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_docs_describe_the_present(doc):
    text = LINK.sub("", doc.read_text())                # a log file's name may say when it was measured
    text = re.sub(r"benchmarks/log/\S+", "", text)
    found = sorted({m.group(0) for m in HISTORY.finditer(text)} | set(re.findall(r"\b20\d\d-\d\d-\d\d\b", text)))
    assert not found, f"{doc.name} narrates history: {found}"


def test_the_readme_links_every_doc():
    readme = (ROOT / "README.md").read_text()
    assert [d.name for d in DOCS[1:] if f"docs/{d.name}" not in readme] == []
