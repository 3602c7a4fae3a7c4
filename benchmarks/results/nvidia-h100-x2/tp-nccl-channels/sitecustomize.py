# As run for geom/ and geom-ch8/ (on PYTHONPATH before src): MLPFUSE_PROBE_BOUNDS=geom replaced
# reduce_overlap.bounds (then bounds(m, n)) with chunks shrinking by q = 0.6.
import os
if os.environ.get("MLPFUSE_PROBE_BOUNDS") == "geom":
    from mlpfuse.ops import reduce_overlap as _ro
    q = float(os.environ.get("MLPFUSE_PROBE_Q", "0.6"))

    def _bounds(m, n, q=q):
        w = [q ** i for i in range(n)]
        cuts, acc = [0], 0.0
        for wi in w[:-1]:
            acc += wi
            cuts.append(int(m * acc / sum(w)) // 8 * 8)
        cuts.append(m)
        return list(zip(cuts, cuts[1:]))

    _ro.bounds = _bounds
