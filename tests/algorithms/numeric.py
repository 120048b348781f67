"""What the hand-derived tests of `algorithms/` compare with: float64 expectations at an absolute tolerance."""

import torch

ATOL = 1e-6
F64 = torch.float64


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def close(actual: torch.Tensor, expected) -> None:
    """`actual` equals the hand-derived `expected` (a tensor or nested list) to `ATOL`, in float64."""
    expected = expected if isinstance(expected, torch.Tensor) else t(expected)
    torch.testing.assert_close(actual.detach().to(F64), expected.to(F64), atol=ATOL, rtol=0)
