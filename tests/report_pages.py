"""Report pages made from the committed GPU traces (tests/fixtures/traces, captured on an H200), and the oracle the
report tests hold them to: counts taken from the raw trace events, not from mlpfuse's analysis."""

import gzip
import json
import os
from html.parser import HTMLParser

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "traces")
GPU_TRACES = ("linear_eager", "linear_compile", "geglu_eager", "geglu_compile", "geglu_eager_train")
RUNTIME_CATS = ("cuda_runtime", "cuda_driver")
HOSTILE = {
    "kernel": "<script>alert(1)</script>",
    "op": '"><img src=x onerror=alert(2)>',
    "label": "</svg></figure><script>alert(3)</script><svg>",
    "bidi": "aten::\u202egnp.live",
}


def fixture_path(name: str) -> str:
    return os.path.join(FIXTURES, name + ".json.gz")


def raw(name: str) -> dict:
    with gzip.open(fixture_path(name)) as fh:
        return json.load(fh)


def write_doc(path, doc) -> str:
    with gzip.open(path, "wt") as fh:
        json.dump(doc, fh)
    return str(path)


def complete(doc) -> list:
    return [e for e in doc["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X"]


def step_span(doc, step_name: str) -> tuple[float, float]:
    (span,) = [e for e in complete(doc) if e.get("name") == step_name and e.get("cat") == "user_annotation"]
    return float(span["ts"]), float(span["ts"]) + float(span["dur"])


def kernels_launched_in(doc, step_name: str) -> list:
    """Kernel events whose launching runtime call (same correlation id) starts inside the step's span."""
    lo, hi = step_span(doc, step_name)
    launched = {e["args"]["correlation"] for e in complete(doc)
                if e.get("cat") in RUNTIME_CATS and lo <= e["ts"] <= hi and "correlation" in e.get("args", {})}
    return [e for e in complete(doc) if e.get("cat") == "kernel" and e.get("args", {}).get("correlation") in launched]


def hostile_doc(label: str = HOSTILE["label"]) -> dict:
    """geglu_eager with a kernel, an op and the step label renamed to markup (or to `label`), and a bidi override in
    another op."""
    doc = raw("geglu_eager")
    events = complete(doc)
    kernel = next(e["name"] for e in events if e.get("cat") == "kernel" and "elementwise" in e["name"])
    step = next(e["name"] for e in events if e.get("cat") == "user_annotation"
                and not e["name"].startswith("ProfilerStep"))
    for e in events:
        if e["name"] == kernel:
            e["name"] = HOSTILE["kernel"]
        elif e["name"] == "aten::gelu":
            e["name"] = HOSTILE["op"]
        elif e["name"] == step:
            e["name"] = label
        elif e["name"] == "aten::view":
            e["name"] = HOSTILE["bidi"]
    doc["mlpfuse_label"] = label
    return doc


def walkthrough_page(folder) -> tuple[str, dict]:
    """A page like the walkthrough's: every GPU fixture as a variant (traces beside the page), a failed variant,
    and two diffs. Returns the page's path and {variant name: raw trace document}."""
    from mlpfuse.profiling import diff
    from mlpfuse.report import Variant, load_variant, write

    variants, docs, analyses = [], {}, {}
    for name in GPU_TRACES:
        path = write_doc(os.path.join(folder, f"{name}.pt.trace.json.gz"), raw(name))
        analysis, variant = load_variant(path, name=name)
        variant.trace = None  # read back from the file, as the walkthrough does
        variants.append(variant)
        docs[name] = raw(name)
        analyses[name] = analysis
    variants.append(Variant("geglu_mlpfuse", error="RuntimeError: no CUDA device for the fused kernels"))
    diffs = [(f"{a} -> {b}", diff(analyses[a], analyses[b]).to_dict())
             for a, b in (("linear_eager", "linear_compile"), ("geglu_eager", "geglu_compile"))]
    page = write(os.path.join(folder, "report.html"), "mlpfuse walkthrough (fixtures)", variants, diffs=diffs)
    return page, docs


class Elements(HTMLParser):
    """Every start tag with its attributes, the text of the page, and the raw text inside each <style>."""

    def __init__(self, html: str):
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []
        self.styles: list[str] = []
        self._in_style = False
        self.feed(html)
        self.close()

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self._in_style = tag == "style"

    def handle_startendtag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_endtag(self, tag):
        self._in_style = False

    def handle_data(self, data):
        if self._in_style:
            self.styles.append(data)
        else:
            self.text.append(data)

    def find(self, tag: str, cls: str | None = None) -> list[dict]:
        return [a for t, a in self.tags if t == tag and (cls is None or cls in (a.get("class") or "").split())]


class _StartTags(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, list]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, attrs))

    handle_startendtag = handle_starttag


def start_tags(html: str) -> list[tuple[str, list[tuple[str, str | None]]]]:
    """Every start tag with its attributes as parsed, in order, repeats kept (a dict would hide a duplicate)."""
    parser = _StartTags()
    parser.feed(html)
    parser.close()
    return parser.tags


class _Timelines(HTMLParser):
    def __init__(self):
        super().__init__()
        self.found: list[tuple[dict, int]] = []
        self.open: list | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        classes = (attrs.get("class") or "").split()
        if tag == "svg" and "timeline" in classes:
            self.open = [attrs, 0]
        elif tag == "rect" and self.open is not None and "kernel" in classes:
            self.open[1] += 1

    handle_startendtag = handle_starttag

    def handle_endtag(self, tag):
        if tag == "svg" and self.open is not None:
            self.found.append((self.open[0], self.open[1]))
            self.open = None


def timeline_kernels(html: str) -> list[tuple[dict, int]]:
    """(attributes of each timeline <svg>, number of rect.kernel inside it), in page order."""
    parser = _Timelines()
    parser.feed(html)
    parser.close()
    return parser.found
