"""The documentation's relative links resolve: every linked file exists, and every #anchor names a heading."""

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = sorted([os.path.join(ROOT, "README.md")] + glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(path: str) -> set:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"```.*?```", "", open(path, encoding="utf-8").read(), flags=re.S)
    headings = re.findall(r"^#+ (.+)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def _relative_links(path: str):
    text = re.sub(r"```.*?```", "", open(path, encoding="utf-8").read(), flags=re.S)
    for target in LINK.findall(text):
        if not re.match(r"^[a-z]+:", target):
            yield target


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_resolve(page):
    broken = []
    for target in _relative_links(page):
        file_part, _, anchor = target.partition("#")
        linked = os.path.normpath(os.path.join(os.path.dirname(page), file_part)) if file_part else page
        if not os.path.exists(linked):
            broken.append(f"{target} (no file {os.path.relpath(linked, ROOT)})")
        elif anchor and linked.endswith(".md") and anchor not in _anchors(linked):
            broken.append(f"{target} (no heading #{anchor} in {os.path.relpath(linked, ROOT)})")
    assert not broken, f"{os.path.relpath(page, ROOT)}: dead links: {broken}"


def test_the_checker_finds_a_dead_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\nSee [gone](missing.md) and [here](#title) and [no](#nowhere).\n")
    targets = list(_relative_links(str(page)))
    assert targets == ["missing.md", "#title", "#nowhere"]
    assert "title" in _anchors(str(page)) and "nowhere" not in _anchors(str(page))


def test_the_repository_names_no_design_file_it_does_not_have():
    """The design notes live in docs/design.md; nothing may point at a DESIGN.md outside the repository."""
    offenders = []
    for path in glob.glob(os.path.join(ROOT, "**", "*"), recursive=True):
        if ".venv" in path or "/.git/" in path or not path.endswith((".py", ".md", ".sh", "Dockerfile")):
            continue
        if path == os.path.abspath(__file__):
            continue
        if "DESIGN.md" in open(path, encoding="utf-8", errors="replace").read():
            offenders.append(os.path.relpath(path, ROOT))
    assert not offenders, offenders


def test_every_benchmark_has_its_block_in_a_committed_page():
    """Each benchmark writes its tables into a marked block of a page under docs/benchmarks/."""
    calls = []
    for script in glob.glob(os.path.join(ROOT, "benchmarks", "*.py")):
        if os.path.basename(script) == "publish.py":
            continue
        # A call may span lines and its text argument hold parentheses: up to the first page= after it.
        calls += re.findall(r'publish\(\s*"([\w-]+)",.*?page="(\w+)"', open(script, encoding="utf-8").read(), re.S)
    assert {block for block, _ in calls} == {"core_swap", "recompute", "planner", "allocator_validation",
                                             "allocator_held_out", "data_parallel", "cost_model", "partition",
                                             "pipeline_memory", "pipeline_recompute", "pipeline_calibration", "max_batch",
                                             "weights", "hybrid", "hybrid-target", "max-params", "weights-cpu-run",
                                             "weights-two-processes", "pipeline_budget"}
    for block, page in calls:
        text = open(os.path.join(ROOT, "docs", "benchmarks", f"{page}.md"), encoding="utf-8").read()
        begin, end = text.find(f"<!-- benchmark:{block} begin -->"), text.find(f"<!-- benchmark:{block} end -->")
        assert 0 <= begin < end and "|---" in text[begin:end], (block, page)
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert "docs/benchmarks/" in readme
