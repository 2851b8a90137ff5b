"""Tensor parallelism: how a model splits over ranks (``shard``) and how the ranks run together
(``ranks``)."""
