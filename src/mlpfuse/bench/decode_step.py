"""One decode step with a static cache, as deployments run it (gpt-fast-style loops, graph-replaying servers).

The prompt is prefilled into a transformers StaticCache once; the step then feeds one new token per sequence at a
fixed cache position. Each call first rewinds the cache's write position to the prompt's end, so every call writes
the same slot with the same keys and values: the step can be called, compiled and replayed any number of times and
computes the same logits each time. On CUDA the step (compiled first for the compile variants, with
`fullgraph=True`) is captured in a CUDA graph and timed by replays; `do_bench_rounds` times the same replays with
Triton's `do_bench`, a second harness to cross-check the CUDA-event timing.
"""

from __future__ import annotations

import inspect

import torch

from mlpfuse.bench import timing


def _cache_kwarg(module: torch.nn.Module) -> str:
    """The forward's name for the cache: `cache` in transformers 5.2x, `past_key_values` before."""
    params = inspect.signature(module.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class StaticStep:
    """`step()` -> logits [B, 1, vocab] of the token after `ids`'s prompt, the cache holding the prompt."""

    def __init__(self, module: torch.nn.Module, ids: torch.Tensor, token: torch.Tensor):
        import transformers

        seq = ids.shape[1]
        self.module, self.token, self.seq = module, token, seq
        self.cache = transformers.StaticCache(config=module.config, max_cache_len=seq + 1)
        self.kwarg = _cache_kwarg(module)
        self.position = torch.full((1, 1), seq, dtype=torch.long, device=ids.device)
        with torch.no_grad():
            module(input_ids=ids, use_cache=True, **{self.kwarg: self.cache})
        layers = self.cache.layers
        # Releases that keep no write position on the device write at the position given: nothing to rewind.
        self.lengths = [n for n in (getattr(layer, "cumulative_length", None) for layer in layers)
                        if isinstance(n, torch.Tensor)]
        self.starts = [torch.full_like(length, seq) for length in self.lengths]
        # Python-int counts (sliding-window layers' `cumulative_length_int`; the count itself in older releases)
        # grow with each eager call too, and decide the write slot when traced: set back the same way.
        self.counted = [(layer, name) for layer in layers for name in ("cumulative_length", "cumulative_length_int")
                        if type(getattr(layer, name, None)) is int]

    def __call__(self) -> torch.Tensor:
        # Back to the prompt's end: the write position is a tensor per layer (rewound inside a captured graph too)
        if self.lengths:
            torch._foreach_copy_(self.lengths, self.starts)
        for layer, name in self.counted:
            setattr(layer, name, self.seq)
        return self.module(input_ids=self.token, position_ids=self.position, use_cache=True,
                           **{self.kwarg: self.cache}).logits


def step_bytes(module: torch.nn.Module, cache) -> int:
    """The bytes one decode step must read at the least: every weight and buffer of `module` once (tensors shared
    between modules counted once; the input embedding table left out unless the output head reads it, as a step
    looks up one row of it per sequence) and the whole static KV cache (attention reads every cached position)."""
    emb = module.get_input_embeddings() if hasattr(module, "get_input_embeddings") else None
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    skip = set()
    if emb is not None and getattr(emb, "weight", None) is not None:
        if head is None or getattr(head, "weight", None) is None or head.weight.data_ptr() != emb.weight.data_ptr():
            skip.add(emb.weight.data_ptr())
    seen, total = set(), 0
    tensors = [*module.parameters(), *module.buffers()]
    for layer in getattr(cache, "layers", ()):
        tensors += [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                    if isinstance(t, torch.Tensor)]
    for t in tensors:
        key = (t.data_ptr(), t.numel(), t.dtype)
        if t.numel() == 0 or t.data_ptr() in skip or key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def inference(fn):
    def call():
        with torch.no_grad():
            return fn()
    return call


class Replay:
    """A captured graph's replay that keeps alive what the graph reads. A CUDA graph holds addresses, not tensors:
    once the step (its cache, token, positions, compiled function) is garbage, the allocator hands that memory to
    the next tensor and the replay reads whatever lands there (a token id past the vocabulary: a device-side assert
    in the embedding's index_select). The step is held here for as long as the replay is."""

    __slots__ = ("graph", "step")

    def __init__(self, graph, step):
        self.graph, self.step = graph, step

    def __call__(self) -> None:
        self.graph.replay()


def capture(step, device: torch.device):
    """`step` recorded in a CUDA graph: (replay, the graph's output tensor, refreshed by each replay). Warmed up on a
    side stream first, as capture needs: lazy initialisation, autotuning and workspace allocation happen there. The
    replay holds `step` (see Replay)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    torch.cuda.synchronize(device)
    return Replay(graph, step), out


def do_bench_rounds(steps: dict, rounds: int) -> dict[str, timing.Stat]:
    """Per step, Triton's `do_bench` median (it flushes the L2 before each call) once per round, the steps
    interleaved as in `timing.interleaved`: µs, median over rounds with the spread."""
    from triton.testing import do_bench

    values: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            values[name].append(do_bench(step, warmup=25, rep=100, return_mode="median") * 1e3)
    return {name: timing.Stat.of_rounds(v, len(v)) for name, v in values.items()}
