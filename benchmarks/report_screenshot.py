"""A report made from any traces, and a picture of it: the verdicts, then one variant's timeline and flamegraph.

    python benchmarks/report_screenshot.py --out DIR [--png docs/report.png] [TRACE ...]

Without TRACE arguments it uses the committed H200 traces in tests/fixtures/traces (GeGLU eager, compiled and
training; Linear eager and compiled) with the walkthrough's diffs, writes DIR/report.html beside copies of the
traces, and, with --png, a screenshot of it taken in headless Chromium (Debian's chromium through Playwright,
or $MLPFUSE_CHROMIUM). The README's picture is made this way.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "src"))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "traces")
DEFAULT = ("geglu_eager", "geglu_compile", "geglu_eager_train", "linear_eager", "linear_compile")
DIFFS = (("geglu_eager", "geglu_compile"), ("linear_eager", "linear_compile"))


def build(out: str, traces: list[str]) -> str:
    from mlpfuse.profiling import diff
    from mlpfuse.report import load_variant, write

    os.makedirs(out, exist_ok=True)
    variants, analyses = [], {}
    for src in traces:
        dst = os.path.join(out, os.path.basename(src))
        if os.path.abspath(src) != os.path.abspath(dst):
            shutil.copyfile(src, dst)
        analysis, variant = load_variant(dst)
        variants.append(variant)
        analyses[variant.name] = analysis
    diffs = [(f"{a} -> {b}", diff(analyses[a], analyses[b]).to_dict()) for a, b in DIFFS
             if a in analyses and b in analyses]
    return write(os.path.join(out, "report.html"), "mlpfuse report: GeGLU MLP and Linear on an NVIDIA H200",
                 variants, diffs=diffs)


def screenshot(page: str, png: str) -> None:
    """The verdict table above the first variant's heading, timeline and flamegraph, as one PNG."""
    import matplotlib.image
    import numpy as np
    from playwright.sync_api import sync_playwright

    chromium = os.environ.get("MLPFUSE_CHROMIUM") or shutil.which("chromium")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu",
                                                                    "--disable-background-networking"])
        view = browser.new_page(viewport={"width": 1240, "height": 1000}, device_scale_factor=1)
        view.goto("file://" + os.path.abspath(page))
        parts = [view.locator("header").screenshot(), view.locator("#verdicts").screenshot()]
        first = view.locator("section[id^=v0-]")
        box = first.bounding_box()
        bottom = first.locator("svg.flame").bounding_box()
        parts.append(view.screenshot(full_page=True, clip={"x": box["x"], "y": box["y"], "width": box["width"],
                                                          "height": bottom["y"] + bottom["height"] - box["y"]}))
        browser.close()
    images = [matplotlib.image.imread(io.BytesIO(b), format="png")[..., :3] for b in parts]
    width = max(i.shape[1] for i in images)
    padded = [np.pad(i, ((0, 12), (0, width - i.shape[1]), (0, 0)), constant_values=1.0) for i in images]
    # A palette of 256 colours keeps the picture sharp and the file small (the page is flat colours and text).
    from PIL import Image

    picture = Image.fromarray((np.concatenate(padded) * 255).round().astype(np.uint8))
    picture.quantize(colors=256, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE).save(png, optimize=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="*", metavar="TRACE")
    parser.add_argument("--out", required=True, help="folder for report.html and the traces beside it")
    parser.add_argument("--png", help="also write a screenshot here")
    args = parser.parse_args(argv)
    traces = args.traces or [os.path.join(FIXTURES, f"{n}.json.gz") for n in DEFAULT]
    page = build(args.out, traces)
    print(f"wrote {page}")
    if args.png:
        screenshot(page, args.png)
        print(f"wrote {args.png} ({os.path.getsize(args.png) / 1e3:.0f} kB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
