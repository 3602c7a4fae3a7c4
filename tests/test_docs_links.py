"""Every relative link and image in README.md, docs/*.md and the benchmark READMEs points to a file or folder that
exists in the repository, so moving a page or a result folder cannot leave a dead link behind."""

import glob
import os
import re

from cli_run import ROOT

PAGES = ["README.md", "benchmarks/README.md", "benchmarks/README-profiler.md",
         *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
# `](target)` of a Markdown link or image, target up to the first space (a title may follow) or closing parenthesis
_LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def links(text: str) -> list[str]:
    """The link targets of `text` outside fenced code blocks."""
    found, fence = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence:
            found += _LINK.findall(line)
    return found


def test_the_pages_exist_and_hold_links():
    for page in PAGES:
        assert os.path.isfile(os.path.join(ROOT, page)), page
    with open(os.path.join(ROOT, "README.md")) as fh:
        readme = links(fh.read())
    assert {f"docs/{os.path.basename(p)}" for p in PAGES if p.startswith("docs")} <= set(readme)


def test_every_relative_link_resolves():
    dead = []
    for page in PAGES:
        with open(os.path.join(ROOT, page)) as fh:
            for target in links(fh.read()):
                if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                    continue  # a URL or an anchor in the same page
                path = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), target.split("#")[0]))
                if not os.path.exists(path):
                    dead.append(f"{page}: {target}")
    assert not dead, "dead links:\n" + "\n".join(dead)


def test_the_readme_stays_a_front_door():
    with open(os.path.join(ROOT, "README.md")) as fh:
        text = fh.read()
    assert len(text.splitlines()) <= 300
    assert "bash install.sh test && python3 -m pytest" in text  # CI runs this line as written
