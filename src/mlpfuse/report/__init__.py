"""One self-contained HTML page per run: verdicts, diffs, a timeline and a CPU flamegraph per variant (SVG drawn
from the trace), the analysis tables with decoded kernel names, and the bench lab's plots and tables.

    from mlpfuse.report import Variant, write
    write("report.html", "my run", [Variant("eager", analysis.to_dict(), trace_path="eager.pt.trace.json.gz")])

No torch import: a page can be made wherever the trace is.
"""

from mlpfuse.report.build import Bench, Variant, build_page, write
from mlpfuse.report.runs import analyze_to_html, diff_to_html, load_variant

__all__ = ["Bench", "Variant", "build_page", "write", "analyze_to_html", "diff_to_html", "load_variant"]
