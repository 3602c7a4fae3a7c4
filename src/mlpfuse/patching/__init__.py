"""Swap the MLP blocks of a model (transformers or plain torch.nn) for mlpfuse's fused ones, in place.

    report = mlpfuse.patch(model)          # what was swapped, what was left and why
    mlpfuse.unpatch(model)                 # the original modules back

A block is recognised by its class name (the family table, data in mlpfuse.patching.table) or by its structure
(mlpfuse.patching.structure: children and shapes), and kept only when its output equals the module's own on random
rows (mlpfuse.patching.verify). The checks are in mlpfuse.patching.checks, the swap in mlpfuse.patching.swap, the
blocks in mlpfuse.patching.blocks; mlpfuse.patching.dry_run reports what would happen to a model from its config
alone (`mlpfuse patch --dry-run`).
"""

from mlpfuse.patching.blocks import GatedBlock, LinearActBlock, PatchedBlock, PostNormBlock, TwoLayerBlock
from mlpfuse.patching.dry_run import DryRun, dry_run
from mlpfuse.patching.report import PatchReport
from mlpfuse.patching.swap import patch, unpatch
from mlpfuse.patching.table import FAMILIES, Family

__all__ = ["patch", "unpatch", "PatchReport", "FAMILIES", "Family", "PatchedBlock", "GatedBlock", "TwoLayerBlock",
           "LinearActBlock", "PostNormBlock", "dry_run", "DryRun"]
