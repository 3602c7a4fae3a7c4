"""report.html in a real headless browser (Chromium driven by Playwright): it loads with no console error and no
network request, shows its sections, draws one rectangle per kernel of the chosen step (counted here from the raw
trace events), renders to a screenshot that is not blank, and runs nothing a hostile trace put in it.

Needs the Python package `playwright` (its driver only; no browser download) and a Chromium: Debian's `chromium`
package, or the executable named by $MLPFUSE_CHROMIUM. `bash install.sh test` installs both where it can. Without
them the tests skip, saying why; under CI (CI set in the environment) they fail instead, so CI cannot pass
without having run them.
"""

import io
import os
import shutil

import matplotlib.image
import pytest

from report_pages import HOSTILE, fixture_path, hostile_doc, kernels_launched_in, walkthrough_page, write_doc

CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run", "--disable-quic",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the Python package playwright is not installed (pip install playwright; bash install.sh test does)"
    if not _chromium():
        return ("no Chromium found: install Debian's chromium package (bash install.sh test does) or set "
                "MLPFUSE_CHROMIUM to a Chromium executable")
    return None


def _chromium() -> str | None:
    named = os.environ.get("MLPFUSE_CHROMIUM")
    if named:
        return named
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


@pytest.fixture(scope="module")
def browser():
    why = _missing()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"browser test cannot run in CI: {why}")
        pytest.skip(why)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=_chromium(), args=CHROMIUM_FLAGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    from mlpfuse.report import analyze_to_html, diff_to_html

    folder = tmp_path_factory.mktemp("pages")
    walkthrough, docs = walkthrough_page(folder)
    hostile = write_doc(folder / "hostile.json.gz", hostile_doc())
    analyze_to_html(hostile, folder / "hostile.html")
    diff_to_html(fixture_path("geglu_eager"), fixture_path("geglu_compile"), folder / "diff.html")
    return {"walkthrough": walkthrough, "docs": docs, "hostile": str(folder / "hostile.html"),
            "hostile_doc": hostile_doc(), "diff": str(folder / "diff.html"), "folder": folder}


class Visit:
    """One page load with every console message, page error, dialog and request recorded."""

    def __init__(self, browser, path: str, javascript: bool = True):
        self.url = "file://" + os.path.abspath(path)
        self.context = browser.new_context(java_script_enabled=javascript, viewport={"width": 1280, "height": 900})
        self.page = self.context.new_page()
        self.console, self.errors, self.dialogs, self.requests, self.failed = [], [], [], [], []
        self.page.on("console", lambda m: self.console.append((m.type, m.text)))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.on("requestfailed", lambda r: self.failed.append((r.url, r.failure)))
        # Anything but the page itself is refused here too, so a leak shows as a recorded request, never traffic.
        self.context.route("**/*", lambda route: route.continue_() if route.request.url == self.url
                           else route.abort())
        self.page.goto(self.url, wait_until="load")

    def console_errors(self) -> list:
        return [text for kind, text in self.console if kind in ("error", "warning")]

    def close(self):
        self.context.close()


@pytest.fixture
def visit(browser):
    opened = []

    def open_page(path, **kw):
        v = Visit(browser, path, **kw)
        opened.append(v)
        return v

    yield open_page
    for v in opened:
        v.close()


def _kernel_counts(page) -> list[tuple[str, int]]:
    svgs = page.locator("svg.timeline")
    return [(svgs.nth(i).get_attribute("data-step"), svgs.nth(i).locator("rect.kernel").count())
            for i in range(svgs.count())]


def test_page_loads_clean_with_its_sections(visit, pages):
    v = visit(pages["walkthrough"])
    assert v.console_errors() == [] and v.errors == [] and v.dialogs == []
    assert v.requests == [v.url]  # the document itself, nothing else
    for section in ("#verdicts", "#diffs", "#v0-linear_eager", "#v4-geglu_eager_train", "#v5-geglu_mlpfuse"):
        assert v.page.locator(section).is_visible()
    assert v.page.locator("#verdicts table tbody tr").count() == len(pages["docs"]) + 1
    assert "no CUDA device for the fused kernels" in v.page.locator("#v5-geglu_mlpfuse").inner_text()
    assert v.page.locator("svg.flame").count() == len(pages["docs"])


def test_timelines_have_one_rectangle_per_kernel_of_the_step(visit, pages):
    v = visit(pages["walkthrough"])
    counts = _kernel_counts(v.page)
    assert len(counts) == len(pages["docs"])
    for (step, drawn), (name, doc) in zip(counts, pages["docs"].items()):
        assert drawn == len(kernels_launched_in(doc, step)) > 0, name
    # drawn, not only present: each kernel box of the first timeline has a size on screen
    boxes = v.page.locator("svg.timeline").first.locator("rect.kernel")
    assert all(boxes.nth(i).bounding_box()["width"] >= 1 for i in range(boxes.count()))


def test_readable_without_javascript(visit, pages):
    on = _kernel_counts(visit(pages["walkthrough"]).page)
    off = visit(pages["walkthrough"], javascript=False)
    assert _kernel_counts(off.page) == on and off.console_errors() == []
    assert "Verdicts" in off.page.locator("#verdicts h2").inner_text()


def test_screenshot_is_not_blank(visit, pages):
    v = visit(pages["diff"])
    image = matplotlib.image.imread(io.BytesIO(v.page.screenshot(full_page=True)), format="png")[..., :3]
    inked = (image < 0.9).any(axis=-1).mean()
    assert image.std() > 0.05 and inked > 0.02, (image.std(), inked)
    timeline = matplotlib.image.imread(io.BytesIO(v.page.locator("svg.timeline").first.screenshot()), format="png")
    colours = {tuple(px) for px in (timeline[..., :3].reshape(-1, 3) * 255).round().astype(int)[::7].tolist()}
    assert len(colours) > 20  # lanes, boxes of several families, links, labels


def test_hostile_names_are_text_and_run_nothing(visit, pages):
    v = visit(pages["hostile"])
    assert v.dialogs == [] and v.errors == [] and v.console_errors() == [] and v.requests == [v.url]
    assert v.page.locator("script").count() == 0 and v.page.locator("img").count() == 0
    text = v.page.locator("body").inner_text()
    assert HOSTILE["kernel"] in text and HOSTILE["op"] in text
    ((step, drawn),) = _kernel_counts(v.page)
    assert drawn == len(kernels_launched_in(pages["hostile_doc"], step))


def test_the_harness_sees_what_the_policy_blocks(visit, pages):
    """Control: markup the policy forbids, added to a real page, is blocked and reported, so the clean runs above
    mean something."""
    html = open(pages["diff"], encoding="utf-8").read()
    bad = html.replace("<main>", '<main><p style="color:red">x</p><img src="https://example.invalid/p.png">'
                                 "<script>alert(1)</script>", 1)
    path = pages["folder"] / "blocked.html"
    path.write_text(bad, encoding="utf-8")
    v = visit(str(path))
    assert v.dialogs == []  # the script did not run
    # the inline style, the image and the script: each refused by the policy, and reported
    assert sum("Content Security Policy" in e for e in v.console_errors()) == 3
    # the harness sees a request the moment a page asks for anything; the policy stopped this one
    assert [u for u in v.requests if u != v.url] == ["https://example.invalid/p.png"]
    assert v.failed == [("https://example.invalid/p.png", "csp")]
