"""The documentation site builds with ``mkdocs build --strict``: a broken link or anchor, a page
missing from the navigation, an API symbol that does not resolve or a docstring griffe cannot
read fails the build, and so this test."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("TF_DETERMINISTIC_OPS", None)
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def _text(site, page):
    html = open(os.path.join(site, page, "index.html") if page else os.path.join(site, "index.html"),
                encoding="utf-8").read()
    return re.sub(r"<[^>]+>", "", html)


@pytest.mark.timeout(300)
def test_the_front_page_is_the_readme_with_working_links(site):
    text = _text(site, "")
    assert "Two commands" in text and "Headline figures" in text
    html = open(os.path.join(site, "index.html"), encoding="utf-8").read()
    assert 'href="usage/"' in html and 'href="docs/' not in html


@pytest.mark.timeout(300)
def test_the_api_reference_is_generated_from_the_docstrings(site):
    text = _text(site, "api/front-ends")
    for symbol in ("LMSCallback", "DistributedCallback", "LMSOptions", "measure_peak_memory"):
        assert symbol in text
    # Examples render as code, not as markdown quotes.
    html = open(os.path.join(site, "api", "core", "index.html"), encoding="utf-8").read()
    assert "&gt;&gt;&gt;" in html and "<blockquote>" not in html


@pytest.mark.timeout(300)
def test_troubleshooting_shows_the_librarys_own_messages(site):
    text = _text(site, "troubleshooting")
    assert text.count("lms_tf.LMSOptionError:") >= 4 and "lms_tf.InfeasibleBudgetError:" in text
    assert "the step runs eagerly" in text and "lms_tf.LMSWarning: LMSCallback: no GPU is visible" in text
    assert " at 0x" not in text  # messages name types, not object addresses


@pytest.mark.timeout(120)
def test_the_committed_troubleshooting_page_says_what_the_library_says_now():
    """The page on GitHub is the committed file: it must hold today's messages
    (``python scripts/mkdocs_hooks.py`` rewrites it)."""
    code = ("import sys; sys.path.insert(0, 'scripts'); import mkdocs_hooks as h; "
            "text = open(h.TROUBLESHOOTING).read(); print(h.with_messages(text) == text)")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert done.stdout.strip().splitlines()[-1:] == ["True"], (done.stdout[-500:], done.stderr[-2000:])
