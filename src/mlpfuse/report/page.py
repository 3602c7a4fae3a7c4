"""The HTML document: one file, its style inline, no script, and a Content-Security-Policy that lets it load
nothing from anywhere (images only as data: URIs, the one style block only by its hash).

`section` runs one part of the page; should that part fail on input nobody foresaw, the page still comes out,
with that part replaced by a line saying what could not be drawn and why.
"""

from __future__ import annotations

import base64
import hashlib
from typing import Callable

from mlpfuse.report.markup import esc

CSS = """
:root{--fg:#1d232b;--muted:#5b6675;--line:#d8dee6;--bg:#fff;--soft:#f4f6f9;--accent:#1f5fbf}
*{box-sizing:border-box}
body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--fg);background:var(--bg)}
main{max-width:1280px;margin:0 auto;padding:20px 24px 60px}
h1{font-size:24px;margin:0 0 4px}h2{font-size:20px;margin:36px 0 8px;padding-top:12px;border-top:2px solid var(--line)}
h3{font-size:16px;margin:22px 0 6px}h4{font-size:14px;margin:16px 0 6px}
p{margin:6px 0}code{font:12px ui-monospace,SFMono-Regular,Menlo,monospace;background:var(--soft);padding:1px 4px;
border-radius:3px;overflow-wrap:anywhere}
a{color:var(--accent)}
nav{margin:10px 0;display:flex;flex-wrap:wrap;gap:4px 14px;font-size:13px}
.sub{color:var(--muted)}.note{color:var(--muted);font-size:13px}
.missing{background:#fff6e0;border-left:4px solid #e0a000;padding:6px 10px;margin:8px 0}
.warn{background:#fff6e0;padding:4px 8px}
.broken{background:#fdecec;border-left:4px solid #c62828;padding:6px 10px;margin:8px 0}
table{border-collapse:collapse;margin:6px 0 10px;font-size:13px}
th,td{border-bottom:1px solid var(--line);padding:4px 8px;text-align:left;vertical-align:top}
th{background:var(--soft);font-weight:600}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.name{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:12px;overflow-wrap:anywhere}
.decoded{color:var(--muted);font-size:12px}
table.kernels td:first-child,table.ops td:first-child,table.diff td:nth-child(2){max-width:520px}
.badge{display:inline-block;padding:0 7px;border-radius:9px;font-size:12px;font-weight:600;white-space:nowrap}
.badge.good{background:#dff3e4;color:#1b6b32}.badge.warn{background:#fff0cc;color:#8a5a00}
.badge.muted{background:#eceff3;color:#4a5563}.badge.bad{background:#fde0e0;color:#a12020}
.badge.removed{background:#fde0e0;color:#a12020}.badge.added{background:#dff3e4;color:#1b6b32}
.badge.same{background:#eceff3;color:#4a5563}
table.verdicts th,table.verdicts td{white-space:nowrap}
ul.reasons{margin:4px 0 0;padding-left:20px;font-size:13px;color:var(--muted)}
.busybar rect.idle{fill:#e3e7ec}.busybar rect.busy{fill:#2f7d4f}
figure{margin:10px 0}figcaption{color:var(--muted);font-size:13px;margin-top:4px}
.scroll{overflow-x:auto;border:1px solid var(--line);border-radius:4px;background:#fcfcfd}
.plots img{max-width:100%;height:auto;border:1px solid var(--line)}
svg text{font:11px ui-monospace,SFMono-Regular,Menlo,monospace;fill:#1d232b;pointer-events:none}
svg text.lane{font:600 11px system-ui,sans-serif;fill:#3b4654}
svg text.tick{fill:#6b7685;font-size:10px}
svg line.axis{stroke:#9aa5b1}svg line.tick{stroke:#edf0f3}
svg line.step-edge{stroke:#9aa5b1;stroke-dasharray:4 3}
svg line.link{stroke:#6a4fb3;stroke-opacity:.55;stroke-width:1}
svg rect{stroke:#fff;stroke-width:.5}
rect.op{fill:#c9d7ea}rect.annotation{fill:#e6dcc4}rect.runtime{fill:#d6d9de}rect.launch{fill:#b99be0}
rect.py{fill:#d9e8d2}rect.root{fill:#aeb7c2}rect.thread{fill:#c3cad3}
rect.gpu{fill:#8fa3b8}rect.memset{fill:#a3a3a3}rect.memcpy{fill:#b07a4f}rect.other-step{fill:#e2e5e9}
rect.fam-gemm{fill:#3f7fd6}rect.fam-elementwise{fill:#f0a340}rect.fam-reduction{fill:#d9704a}
rect.fam-triton_pointwise{fill:#3eae6b}rect.fam-triton_reduction{fill:#2e8b57}rect.fam-triton_persistent{fill:#66c48d}
rect.fam-attention{fill:#9b59b6}rect.fam-communication{fill:#c0392b}rect.fam-copy{fill:#b07a4f}
rect.fam-memset{fill:#a3a3a3}rect.fam-other{fill:#8fa3b8}
rect.frame.launched{stroke:#fff}rect.gpu-strip{fill:#1f5fbf;stroke:none}
.legend{display:flex;flex-wrap:wrap;gap:4px 12px;font-size:12px;color:var(--muted);margin:4px 0}
.legend svg{vertical-align:middle}
details{margin:6px 0}summary{cursor:pointer;color:var(--accent)}
footer{margin-top:40px;color:var(--muted);font-size:12px;border-top:1px solid var(--line);padding-top:8px}
"""


def _hash(text: str) -> str:
    return base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii")


# Nothing may be fetched: no scripts at all, the one <style> block by its hash, images only from data: URIs.
CSP = (f"default-src 'none'; style-src 'sha256-{_hash(CSS)}'; img-src data:; base-uri 'none'; "
       "form-action 'none'")


def document(title: str, body: str) -> str:
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f'<meta name="generator" content="mlpfuse"><title>{esc(title, 200)}</title>'
        f"<style>{CSS}</style></head><body><main>{body}</main></body></html>\n"
    )


def section(what: str, build: Callable[[], str]) -> str:
    """`build()`, or, when it raises, one visible line naming the part of the page that could not be drawn."""
    try:
        return build()
    except Exception as exc:  # the page is the last thing a long run writes: it must come out whole
        return (f'<p class="broken">{esc(what, 200)} could not be drawn: {esc(type(exc).__name__, 80)}: '
                f"{esc(exc, 300)}</p>")


def legend(gpu: bool = True, runtime: bool = True) -> str:
    """The timeline's colours; without GPU events (a CPU run) the GPU lanes' entries are left out, without CUDA
    runtime events the launch calls'."""
    gpu_items = [("kernel: GEMM", "fam-gemm"), ("elementwise", "fam-elementwise"), ("reduction", "fam-reduction"),
                 ("Triton (Inductor / mlpfuse)", "fam-triton_pointwise"), ("attention", "fam-attention"),
                 ("memset", "memset"), ("memcpy", "memcpy"), ("other kernel", "fam-other"),
                 ("another step's GPU work", "other-step")]
    runtime_items = [("launch call", "launch"), ("other runtime call", "runtime")]
    items = (gpu_items if gpu else []) + [("CPU op", "op"), ("annotation", "annotation"), ("Python frame", "py")] \
        + (runtime_items if runtime else [])
    return '<div class="legend">' + "".join(
        f'<span><svg width="12" height="12" viewBox="0 0 12 12"><rect class="{cls}" width="12" height="12"/>'
        f"</svg> {label}</span>" for label, cls in items) + "</div>"
