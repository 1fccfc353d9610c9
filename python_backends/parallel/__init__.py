"""Tensor and pipeline parallelism: the rank context, the parallel layers, weight sharding, and
the group of rank processes one engine instance drives."""
