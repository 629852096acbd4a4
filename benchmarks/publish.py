"""Writes a benchmark's tables into its committed page under docs/benchmarks/.

Each page keeps its hand-written reading of the figures around a generated block::

    <!-- benchmark:planner begin -->
    ... tables written by benchmarks/planner.py ...
    <!-- benchmark:planner end -->

and the benchmark replaces only that block, so a rerun updates the figures and keeps the prose.
Raw results (JSON) go to benchmarks/out/, which is not committed.

Example:
    >>> import tempfile, pathlib
    >>> page = pathlib.Path(tempfile.mkdtemp()) / "p.md"
    >>> _ = page.write_text("# P\\n<!-- benchmark:x begin -->\\nold\\n<!-- benchmark:x end -->\\ntail\\n")
    >>> publish("x", "new table", page=page)
    >>> page.read_text()
    '# P\\n<!-- benchmark:x begin -->\\nnew table\\n<!-- benchmark:x end -->\\ntail\\n'
"""

import pathlib
import re

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
OUT = pathlib.Path(__file__).resolve().parent / "out"


def publish(block: str, text: str, *, page) -> None:
    """Replaces the ``block`` of ``page`` (a path, or a page name under docs/benchmarks/) with ``text``."""
    path = pathlib.Path(page) if "/" in str(page) else DOCS / f"{page}.md"
    content = path.read_text(encoding="utf-8")
    begin, end = f"<!-- benchmark:{block} begin -->", f"<!-- benchmark:{block} end -->"
    pattern = re.compile(re.escape(begin) + r"\n.*?\n" + re.escape(end), re.S)
    if not pattern.search(content):
        raise SystemExit(f"{path} has no {begin} ... {end} block for the benchmark's tables; add one where "
                         f"they belong.")
    path.write_text(pattern.sub(lambda _: f"{begin}\n{text.strip()}\n{end}", content), encoding="utf-8")
    print(f"tables written to {path}")
