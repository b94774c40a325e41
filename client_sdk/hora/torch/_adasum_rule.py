"""Adasum: Horovod's adaptive summation of gradients, as pure torch functions.

Adasum combines two gradients ``a`` and ``b`` so that their parallel parts are
averaged and their orthogonal parts are added::

    adasum(a, b) = (1 - a.b / (2 |a|^2)) * a + (1 - a.b / (2 |b|^2)) * b

Identical gradients give the same gradient back, orthogonal gradients add,
and opposite gradients cancel to zero. Over many ranks the rule is applied
pairwise along a binary tree over the ranks (see :func:`adasum_reduce`).

This module imports no collective, so the collectives can import it;
:mod:`.adasum` adds the allreduce over ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["adasum_pair", "adasum_reduce"]


def _check_pair(a: torch.Tensor, b: torch.Tensor) -> None:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise TypeError("adasum combines torch.Tensors")
    if a.shape != b.shape:
        raise ValueError(f"adasum needs tensors of one shape, got {tuple(a.shape)} "
                         f"and {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise TypeError(f"adasum needs tensors of one dtype, got {a.dtype} and {b.dtype}")
    if not a.is_floating_point():
        raise TypeError(f"adasum is defined for floating point tensors, got {a.dtype}")


def adasum_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Combines two tensors with the Adasum rule.

    The dot product, the squared norms and the combination are computed in
    float64 and the result is cast back to the inputs' dtype. A side whose
    squared norm is exactly zero contributes nothing, so the result is then the
    other side (and zeros when both are zero); this is the rule's limit and
    avoids dividing by zero.

    Args:
        a: a floating point tensor.
        b: a tensor of the same shape and dtype as ``a``.

    Returns:
        ``(1 - a.b / (2 |a|^2)) * a + (1 - a.b / (2 |b|^2)) * b`` with ``a``'s
        shape and dtype.

    Raises:
        TypeError: the inputs are not floating point tensors of one dtype.
        ValueError: the inputs differ in shape.
    """
    _check_pair(a, b)
    a64 = a.to(torch.float64)
    b64 = b.to(torch.float64)
    dot = torch.sum(a64 * b64)
    anormsq = torch.sum(a64 * a64)
    bnormsq = torch.sum(b64 * b64)
    if anormsq == 0:
        return b.clone()
    if bnormsq == 0:
        return a.clone()
    acoeff = 1.0 - dot / (2.0 * anormsq)
    bcoeff = 1.0 - dot / (2.0 * bnormsq)
    return (acoeff * a64 + bcoeff * b64).to(a.dtype)


def adasum_reduce(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Combines tensors, given in rank order, along a binary tree of Adasum pairs.

    Each level combines neighbours ``(0, 1), (2, 3), ...`` of the level below,
    as Horovod does for a power-of-two number of ranks; so for four tensors the
    result is ``adasum_pair(adasum_pair(t0, t1), adasum_pair(t2, t3))``.

    For a count that is not a power of two, a level with an odd number of
    elements carries its last element up to the next level unchanged. For
    example three tensors give ``adasum_pair(adasum_pair(t0, t1), t2)`` and five
    give ``adasum_pair(adasum_pair(adasum_pair(t0, t1), adasum_pair(t2, t3)), t4)``.
    The rule depends only on the count, so it is deterministic.

    Every intermediate result is rounded to the inputs' dtype, as each
    :func:`adasum_pair` returns it.

    Args:
        tensors: one or more floating point tensors of one shape and dtype.

    Returns:
        The combination, with the inputs' shape and dtype (a copy of the only
        tensor when there is one).

    Raises:
        ValueError: ``tensors`` is empty or the shapes differ.
        TypeError: the tensors are not floating point tensors of one dtype.
    """
    level = list(tensors)
    if not level:
        raise ValueError("adasum_reduce needs at least one tensor")
    if len(level) == 1:
        _check_pair(level[0], level[0])
        return level[0].clone()
    while len(level) > 1:
        paired = [adasum_pair(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            paired.append(level[-1])
        level = paired
    return level[0]
