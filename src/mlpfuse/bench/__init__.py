"""The benchmark lab behind `mlpfuse bench`: every peer and every mlpfuse backend on the same weights and inputs.

presets   cases from presets and sweep flags          variants  the contestants and the fp64 check
timing    CUDA events, wall clock, interleaved rounds  roofline  FLOPs, min bytes, measured peaks (cached)
sweep     the run: build, check, time, profile         outputs   JSON / CSV / Markdown / terminal table
plots     time ratio vs tokens, roofline chart        commands  the CLI
"""
