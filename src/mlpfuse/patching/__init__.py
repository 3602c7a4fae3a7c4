"""Swap the MLP blocks of a model (transformers or plain torch.nn) for mlpfuse's fused ones, in place.

    report = mlpfuse.patch(model)          # what was swapped, what was left and why
    mlpfuse.unpatch(model)                 # the original modules back

The family table (which classes, where their projections are, which block replaces them) is data in
mlpfuse.patching.table; the checks and the swap are in mlpfuse.patching.swap; the blocks in mlpfuse.patching.blocks.
"""

from mlpfuse.patching.blocks import GatedBlock, LinearActBlock, PatchedBlock, TwoLayerBlock
from mlpfuse.patching.report import PatchReport
from mlpfuse.patching.swap import patch, unpatch
from mlpfuse.patching.table import FAMILIES, Family

__all__ = ["patch", "unpatch", "PatchReport", "FAMILIES", "Family", "PatchedBlock", "GatedBlock", "TwoLayerBlock",
           "LinearActBlock"]
