#!/usr/bin/env bash
# Installs mlpfuse into the current Python environment (PYTHON, default python3).
#   bash install.sh        mlpfuse, its runtime needs and transformers (the walkthrough ends on a transformers
#                          model's layer, patched); no Triton where there is no CUDA: there `auto` runs mlpfuse's
#                          PyTorch path, which is what a CPU run shows
#   bash install.sh test   the same, plus what the test suite needs (pytest, hypothesis, transformers 5; Debian's
#                          chromium too, when run as root)
# An installed torch is never replaced: a CUDA build stays as it is. Only where no torch is importable does this
# install one, pinned (MLPFUSE_TORCH, default torch==2.13.0) so that a CPU machine gets that release's CPU wheel
# from its package index rather than whatever newest build pip would resolve on its own.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "install.sh: no torch found; installing ${MLPFUSE_TORCH:-torch==2.13.0}" >&2
    pip_install "${MLPFUSE_TORCH:-torch==2.13.0}"
fi

case "${1:-run}" in
    run) pip_install -e ".[models]" ;;
    test)
        pip_install -e ".[test,models]"
        # Without CUDA the suite runs the Triton kernels through Triton's interpreter (Triton 3.6, which needs
        # numpy < 2.4). A CUDA machine keeps its own Triton and numpy.
        if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
            "$PY" -c "import triton" >/dev/null 2>&1 || pip_install "triton==3.6.0"
            pip_install "numpy<2.4"
        fi
        # tests/test_report_browser.py opens the HTML report in a real Chromium (Debian's package), driven through
        # Playwright's driver (a PyPI package; no browser download). Without it that test skips, or fails under CI.
        if [ -z "${MLPFUSE_CHROMIUM:-}" ] && ! command -v chromium >/dev/null 2>&1; then
            if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
                echo "install.sh: installing Debian's chromium for the report's browser test" >&2
                { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
                    || echo "install.sh: could not install chromium; the browser test will skip (fail under CI)" >&2
            else
                echo "install.sh: no chromium (install it, or set MLPFUSE_CHROMIUM); the browser test will skip" >&2
            fi
        fi
        ;;
    *) echo "install.sh: unknown target '$1' (expected: run or test)" >&2; exit 2 ;;
esac
