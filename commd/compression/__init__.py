"""Gradient compression: top-k sparsification and the cost of exchanging compressed gradients.

``commd.compression.costs`` holds the pure cost models (Tyagi & Swany, IEEE BigData 2023,
Table I) that pick the exchange: Allgather or the Allreduce-compatible top-k.
"""
