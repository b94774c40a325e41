"""A DistributedOptimizer's parameters: the names their allreduces take on every
rank, and the groups they are reduced in."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch


def _parameter_names(param_groups: list[dict[str, Any]], all_params: list[torch.Tensor],
                     named_parameters: Iterable[tuple[str, Any]] | None
                     ) -> dict[torch.Tensor, str]:
    if named_parameters is None:
        # Horovod's names, the same on every rank: group index, then position.
        return {p: f"allreduce.noname.{gi}.{pi}" for gi, group in enumerate(param_groups)
                for pi, p in enumerate(group["params"])}
    named = list(named_parameters)
    names = [n for n, _ in named]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"named_parameters has duplicate names: {dupes}")
    by_param = {p: n for n, p in named}
    unnamed = [i for i, p in enumerate(all_params) if p not in by_param]
    if unnamed:
        raise ValueError(
            f"named_parameters was given but {len(unnamed)} optimizer parameter(s) are not in "
            f"it (positions {unnamed[:5]}); pass model.named_parameters() of the model whose "
            f"parameters the optimizer updates")
    return {p: by_param[p] for p in all_params}


def _parameter_groups(all_params: list[torch.Tensor], groups: Any
                      ) -> list[list[torch.Tensor]]:
    """Splits parameters into allreduce groups: one each, N even groups, or given lists."""
    if groups is None or groups == 0:
        return [[p] for p in all_params]
    if isinstance(groups, int):
        if groups < 0:
            raise ValueError(f"groups must be >= 0, got {groups}")
        per = -(-len(all_params) // groups)
        return [all_params[i:i + per] for i in range(0, len(all_params), per)]
    if isinstance(groups, Sequence):
        given = [list(g) for g in groups]
        seen = {p for g in given for p in g}
        if len(seen) != sum(len(g) for g in given):
            raise ValueError("a parameter appears in more than one of the given groups")
        unknown = [p for p in seen if not any(p is q for q in all_params)]
        if unknown:
            raise ValueError("groups name parameters the optimizer does not update")
        # Parameters left out of every group are reduced on their own.
        return given + [[p] for p in all_params if p not in seen]
    raise TypeError(f"groups must be an int or a list of parameter lists, got {type(groups)}")
