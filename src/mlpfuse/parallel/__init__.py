"""Several GPUs: mlpfuse's MLP blocks under PyTorch's tensor parallelism (DTensor) and FSDP2.

`tensor_parallel(model, mesh)` shards every GatedMLP / PackedGatedMLP / MLP of a model, and every block
`mlpfuse.patch` put in one, column- then row-parallel; `block_plan(block)` gives one block's ParallelStyles for a
plan of one's own; `parallelize_module` with ColwiseParallel / RowwiseParallel on the blocks' children works as well
(`PackedColwiseParallel` for a packed gate_up_proj; `ReducedRowwiseParallel` on a gated block's down projection lets the
block run its all-reduce behind its own GEMMs). FSDP2's `fully_shard` needs nothing from here: the blocks see
plain unsharded parameters while it runs them.
"""

from mlpfuse.parallel.plan import PackedColwiseParallel, ReducedRowwiseParallel, block_plan, tensor_parallel

__all__ = ["tensor_parallel", "PackedColwiseParallel", "ReducedRowwiseParallel", "block_plan"]
