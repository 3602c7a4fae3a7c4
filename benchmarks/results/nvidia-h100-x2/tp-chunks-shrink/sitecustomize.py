# Probe only: MLPFUSE_PROBE_BOUNDS=half restores the previous chunking (equal chunks, the last about half).
import os
if os.environ.get("MLPFUSE_PROBE_BOUNDS") == "half":
    try:
        from mlpfuse.ops import reduce_overlap as _ro

        def _bounds(m, n, q=None):
            size = 2 * m // (2 * n - 1) // 8 * 8
            cuts = [i * size for i in range(n)] + [m]
            return list(zip(cuts, cuts[1:]))

        _ro.bounds = _bounds
    except Exception as e:  # noqa
        print("probe patch failed", e)
