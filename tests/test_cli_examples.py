"""Every `mlpfuse ...` example in the code blocks of README.md and docs/*.md, run on this (CPU) machine through the
console script: each exits 0, or 2 with one `mlpfuse: error:` line, and none shows a traceback. (The examples of
every command's --help are held to more, in tests/test_cli_help.py: each runs as shown and exits 0.)

Usage lines with placeholders (`mlpfuse analyze TRACE [--json]`) run with the placeholders filled from the test
fixtures and the bracketed options left out. Each example runs under a 6 GB address-space cap, so one that would
allocate more than that must be refused up front, and for at most MLPFUSE_EXAMPLE_SECONDS (default 45): the long
benchmarks are stopped there, and what they printed until then must hold no traceback. Two examples run at a time.
"""

import glob
import os
import re
import shlex
from concurrent.futures import ThreadPoolExecutor

import pytest

from cli_run import ROOT, cli_env, run_for
from conftest import HAS_CUDA

SECONDS = float(os.environ.get("MLPFUSE_EXAMPLE_SECONDS", "45"))
MEMORY_CAP = 6 << 30
TRACES = os.path.join(ROOT, "tests", "fixtures", "traces")
PLACEHOLDERS = {
    "TRACE": os.path.join(TRACES, "geglu_eager.json.gz"),
    "A": os.path.join(TRACES, "geglu_eager.json.gz"),
    "B": os.path.join(TRACES, "geglu_compile.json.gz"),
    "DIR": os.path.join(TRACES, "hta_sampled_ranks"),
}
_COMMAND = re.compile(r"(?:^|\s)(?:python3 -m )?mlpfuse ((?:walkthrough|analyze|diff|profile|bench)\b.*)$")


def _command(line: str) -> list[str] | None:
    """The argv of the `mlpfuse ...` command on `line`, or None: comments and two-space explanations dropped,
    bracketed options left out, placeholders filled."""
    m = _COMMAND.search(line)
    if not m:
        return None
    text = re.split(r"\s#|\s{2,}", m.group(1))[0]
    while re.search(r"\[[^\[\]]*\]", text):
        text = re.sub(r"\s*\[[^\[\]]*\]", "", text)
    return [PLACEHOLDERS.get(word, word) for word in shlex.split(text)]


def doc_pages() -> list[str]:
    """README.md and the reference pages it links to, as paths relative to the repository."""
    return ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]


def readme_examples() -> list[tuple[str, list[str]]]:
    found = []
    for page in doc_pages():
        with open(os.path.join(ROOT, page)) as fh:
            text = fh.read()
        fence = None
        for line in text.splitlines():
            if line.startswith("```"):
                fence = line[3:].strip() if fence is None else None
                continue
            if fence in ("", "bash", "sh", "console") and (argv := _command(line)):
                found.append((page, argv))
    return found


def examples() -> list[tuple[str, list[str]]]:
    seen, out = set(), []
    for where, argv in readme_examples():
        if tuple(argv) not in seen:
            seen.add(tuple(argv))
            out.append((where, argv))
    return out


def test_the_examples_are_found():
    found = examples()
    commands = {argv[0] for _, argv in found}
    assert {"walkthrough", "profile", "analyze", "diff", "bench"} <= commands
    assert any(argv[:2] == ["bench", "--model"] for _, argv in found)
    pages = {where for where, _ in readme_examples()}
    assert "README.md" in pages and any(p.startswith("docs" + os.sep) for p in pages)


@pytest.mark.slow
@pytest.mark.skipif(HAS_CUDA, reason="the examples are held to the CPU machine's rules; under an address-space cap "
                    "CUDA cannot even reserve its own memory")
def test_every_example_exits_0_or_with_one_error_line(tmp_path):
    env = cli_env(XDG_CACHE_HOME=tmp_path / "cache", MLPFUSE_CACHE_DIR=tmp_path / "cache")

    def run(i_example):
        i, (where, argv) = i_example
        cwd = tmp_path / f"run{i}"
        cwd.mkdir()
        return where, argv, *run_for(argv, SECONDS, cwd=cwd, memory_cap=MEMORY_CAP, env=env)

    problems = []
    with ThreadPoolExecutor(max_workers=2) as pool:
        for where, argv, code, out, err in pool.map(run, enumerate(examples())):
            print(f"{'stopped' if code is None else f'exit {code}'}: mlpfuse {' '.join(argv)}")  # shown with -s
            shown = f"{where}: mlpfuse {' '.join(argv)} -> {code}: {err[-1500:]}"
            if "Traceback" in err or "Traceback" in out:
                problems.append(shown)
            elif code == 2:
                errors = [line for line in err.splitlines() if line.startswith("mlpfuse: error: ")]
                if len(errors) != 1:
                    problems.append(shown)
            elif code not in (0, None):
                problems.append(shown)
    assert not problems, "\n\n".join(problems)
