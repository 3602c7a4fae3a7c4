"""What `mlpfuse.patch` did: the blocks it swapped and the candidates it left, each with the reason."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Optional


@dataclass(frozen=True)
class Swapped:
    path: str  # dotted module path in the model ("model.layers.0.mlp")
    source: str  # class name of the replaced module
    layout: str  # "gated" | "two-layer" | "linear-act" | "post-norm"
    family: str
    activation: str
    matched: str = "name"  # "name": a row of the family table; "structure": its children, proven on numbers
    roles: str = ""  # which child plays which part ("gate=w1 up=w3 down=w2")
    precision: str = ""  # "fp8" when patch(precision="fp8") quantized the block's projections, "fp8-train" when
    # (on a model in train mode) the block trains in FP8 on its own weights
    fp8_error: Optional[float] = None  # its measured ‖Δy‖/‖y‖ against float64 (mlpfuse.patching.quantize)
    fp8_checkpoint: bool = False  # its FP8 weights are a FineGrainedFP8 checkpoint's, run as they are


@dataclass(frozen=True)
class Left:
    path: str
    source: str
    reason: str


@dataclass(frozen=True)
class FusedNorm:
    path: str  # the norm module, which now passes its input through
    into: str  # the block whose kernels apply it
    kind: str  # ops.norm.KINDS
    by: str = "decode kernels"  # which of the block's kernels: its decode kernels (bf16), or all its FP8 kernels


@dataclass(frozen=True)
class FusedResidual:
    path: str  # the layer whose forward now hands its residual add to the block (mlpfuse.patching.residual)
    into: str  # the block whose down projection adds it
    by: str = "its down projection's epilogue"  # FP8 blocks: in the weight-only epilogue at decode sizes only


@dataclass(frozen=True)
class FusedProjections:
    path: str  # the module (an attention) whose forward now computes these projections in one call
    names: str  # its children projected together ("q_proj+k_proj+v_proj")
    outputs: str = ""  # its other nn.Linear children now on the decode kernel ("o_proj")


@dataclass
class PatchReport:
    model: str
    backend: str
    swapped: list[Swapped] = field(default_factory=list)
    left: list[Left] = field(default_factory=list)
    already_patched: list[str] = field(default_factory=list)
    norms: list[FusedNorm] = field(default_factory=list)  # RMSNorms handed to the block after them
    norms_kept: list[Left] = field(default_factory=list)  # norms in front of a swapped block, kept, with why
    fp8_kept: list[Left] = field(default_factory=list)  # swapped blocks left in their dtype by precision="fp8"
    residuals: list[FusedResidual] = field(default_factory=list)  # layers whose add after the MLP the block does
    residuals_kept: list[Left] = field(default_factory=list)  # layers that keep their own add, with why
    projections: list[FusedProjections] = field(default_factory=list)  # attentions' projections in one decode call
    projections_kept: list[Left] = field(default_factory=list)  # modules whose projections stay apart, with why

    @property
    def changed(self) -> bool:
        return bool(self.swapped)

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "backend": self.backend,
            "swapped": [asdict(s) for s in self.swapped],
            "left": [asdict(item) for item in self.left],
            "already_patched": list(self.already_patched),
            "norms": [asdict(n) for n in self.norms],
            "norms_kept": [asdict(n) for n in self.norms_kept],
            "fp8_kept": [asdict(n) for n in self.fp8_kept],
            "residuals": [asdict(n) for n in self.residuals],
            "residuals_kept": [asdict(n) for n in self.residuals_kept],
            "projections": [asdict(n) for n in self.projections],
            "projections_kept": [asdict(n) for n in self.projections_kept],
        }

    def summary(self) -> str:
        """A few lines: one per kind of swap and per reason, with the layer indices folded ({0..31})."""
        head = f"mlpfuse.patch({self.model}, backend={self.backend!r}): "
        if not self.swapped and not self.left and not self.already_patched:
            return head + "no MLP block mlpfuse recognises; nothing changed"
        parts = [f"swapped {len(self.swapped)}"]
        if self.already_patched:
            parts.append(f"{len(self.already_patched)} already patched")
        parts.append(f"left {len(self.left)}")
        if self.norms:
            parts.append(f"{len(self.norms)} norms fused")
        if self.residuals:
            parts.append(f"{len(self.residuals)} residual adds fused")
        if self.projections:
            parts.append(f"{len(self.projections)} projection groups fused")
        errors = [s.fp8_error for s in self.swapped if s.precision in ("fp8", "fp8-train")]
        if errors or self.fp8_kept:
            spread = f" (output error vs float64 {min(errors):.2g}–{max(errors):.2g})" if errors else ""
            parts.append(f"{len(errors)} in fp8{spread}")
        return "\n".join([head + ", ".join(parts), *self.group_lines()])

    def group_lines(self, extra: Optional[dict[str, str]] = None) -> list[str]:
        """One line per kind of swap and per reason left, paths folded; `extra` adds text to a swapped path's
        group (the dry run's real shapes)."""
        groups: dict[tuple, list[str]] = {}
        for s in self.swapped:
            how = f"by {s.matched}" + (f": {s.roles}" if s.roles else "")
            precision = s.precision + (", the checkpoint's FP8 weights as they are" if s.fp8_checkpoint else "")
            what = ", ".join(part for part in (s.activation, how, precision) if part)  # post-norm: no activation
            more = f", {extra[s.path]}" if extra and s.path in extra else ""
            groups.setdefault(("swapped", f"{s.source} -> {s.layout} ({what}){more}"), []).append(s.path)
        for item in self.left:
            groups.setdefault(("left", f"{item.source}: {item.reason}"), []).append(item.path)
        for p in self.already_patched:
            groups.setdefault(("already", "patched before"), []).append(p)
        for n in self.norms:
            into = n.into.rpartition(".")[2]
            groups.setdefault(("norm", f"RMSNorm ({n.kind}) applied by {into}'s {n.by}"), []).append(n.path)
        for item in self.norms_kept:
            groups.setdefault(("norm", f"{item.source} kept: {item.reason}"), []).append(item.path)
        for r in self.residuals:
            into = r.into.rpartition(".")[2]
            groups.setdefault(("residual", f"the add after {into} done by {r.by}"), []).append(r.path)
        for item in self.residuals_kept:
            groups.setdefault(("residual", f"{item.source} keeps its add: {item.reason}"), []).append(item.path)
        for p in self.projections:
            outs = f"; {p.outputs} on the decode kernel" if p.outputs else ""
            groups.setdefault(("proj", f"{p.names} in one decode call{outs}"), []).append(p.path)
        for item in self.projections_kept:
            groups.setdefault(("proj", f"{item.source} keeps its projections: {item.reason}"), []).append(item.path)
        for item in self.fp8_kept:
            groups.setdefault(("not fp8", f"{item.source} stays in its dtype: {item.reason}"), []).append(item.path)
        return [f"  {kind:8s} {fold_paths(paths)}  {what}" + (f"  [{len(paths)}x]" if len(paths) > 1 else "")
                for (kind, what), paths in groups.items()]

    def __str__(self) -> str:
        return self.summary()


def fold_paths(paths: list[str]) -> str:
    """model.layers.0.mlp ... model.layers.31.mlp -> model.layers.{0..31}.mlp: each number that varies becomes a
    range (or a list); paths of different shapes are listed (the first three)."""
    if len(paths) == 1:
        return paths[0]
    split = [re.split(r"(\d+)", p) for p in paths]  # text, number, text, ...
    if len({tuple(parts[0::2]) for parts in split}) != 1:
        return ", ".join(paths[:3]) + (f", ... ({len(paths)})" if len(paths) > 3 else "")
    texts = split[0][0::2]
    out = texts[0]
    for i, text in enumerate(texts[1:]):
        values = sorted({int(parts[2 * i + 1]) for parts in split})
        if len(values) == 1:
            out += str(values[0])
        elif values == list(range(values[0], values[-1] + 1)):
            out += f"{{{values[0]}..{values[-1]}}}"
        else:
            out += "{" + ",".join(map(str, values)) + "}"
        out += text
    return out
