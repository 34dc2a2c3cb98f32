"""The FLOP convention of every analytic count, the model's (``compute.flops``) and each selector's own
(``Selector.flops``): that of ``torch.utils.flop_counter.FlopCounterMode``, so the two agree to the FLOP.

It sits below both layers, without torch, so ``compute`` stays pure arithmetic.
"""


def matmul(rows: int, inner: int, columns: int) -> int:
    """FLOPs of a (rows, inner) @ (inner, columns) product."""
    return 2 * rows * inner * columns


__all__ = ["matmul"]
