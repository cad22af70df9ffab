"""Tensor parallelism on torch.distributed: sharding, the step broadcast, the rank processes."""
