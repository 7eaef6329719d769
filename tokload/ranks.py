"""Which rank of how many a loader is: the one job of this module.

From a ``DeviceMesh`` (its data-parallel dimension), from the ``rank`` and
``world_size`` given, or from ``torch.distributed``; a loader made under a
launcher (``torchrun``) before the process group is refused rather than read as
rank 0 of 1 in every process (``tokload.loader.DataLoader`` documents it).
"""

from __future__ import annotations

import os
from typing import Any

from tokload.arguments import is_integer


def resolve_rank(
    rank: int | None, world_size: int | None, mesh: Any, mesh_dim: str | int | None
) -> tuple[int, int]:
    """``(rank, world_size)`` of a loader: from ``mesh`` (its data-parallel
    dimension ``mesh_dim``), else as given (integers, ``0 <= rank < world_size``),
    else from ``torch.distributed`` when it is initialized, else ``(0, 1)`` unless
    a launcher says several processes were started (``WORLD_SIZE`` > 1: then
    ValueError, as each would read every batch). ValueError for anything else."""
    if mesh is not None:
        if rank is not None or world_size is not None:
            raise ValueError("give either a DeviceMesh or rank/world_size, not both")
        if not all(callable(getattr(mesh, f, None)) for f in ("get_local_rank", "size")):
            raise TypeError(
                f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got "
                f"{type(mesh).__name__} {mesh!r:.80}"
            )
        dim = _mesh_index(mesh, 0 if mesh_dim is None else mesh_dim)
        where = getattr(mesh, "get_coordinate", None)
        if callable(where) and where() is None:
            raise ValueError(
                f"this process ({_global_rank()}) is not in the DeviceMesh {mesh!r:.200}: pass "
                "the mesh of the devices this process trains on"
            )
        return int(mesh.get_local_rank(dim)), int(mesh.size(dim))
    got = _without_mesh(rank, world_size)
    if mesh_dim is not None and got[1] > 1:
        # (a dp x tp job that forgot mesh= would split the data over the whole world,
        # and tensor-parallel peers would get different batches; alone, it is moot)
        raise ValueError(
            f"mesh_dim={mesh_dim!r} is given without a mesh, and this is rank {got[0]} of "
            f"{got[1]}: pass mesh= too, or no mesh_dim"
        )
    return got


def _without_mesh(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``resolve_rank`` without a mesh."""
    if rank is None and world_size is None:
        try:
            import torch.distributed as dist
        except ImportError:  # pragma: no cover - torch is a dependency
            return 0, 1
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        launched = os.environ.get("WORLD_SIZE", "")
        if _launched(launched) > 1:
            # torchrun started several processes: as rank 0 of 1 each would read
            # every batch of every other, silently
            raise ValueError(
                f"WORLD_SIZE={launched} (RANK={os.environ.get('RANK', '?')}) but "
                "torch.distributed is not initialized: call "
                "torch.distributed.init_process_group() before making the DataLoader, "
                "or pass rank and world_size (rank=0, world_size=1 for a loader of "
                "this process alone)"
            )
        return 0, 1
    if rank is None or world_size is None:
        raise ValueError("give both rank and world_size, or neither")
    if not is_integer(rank) or not is_integer(world_size):
        # a float would be truncated, a string from os.environ compared as text
        raise ValueError(
            f"rank and world_size must be integers, got rank={rank!r}, world_size={world_size!r}"
        )
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return int(rank), int(world_size)


def _mesh_index(mesh: Any, dim: str | int) -> int:
    """The index of ``mesh``'s dimension ``dim`` (a name of ``mesh.mesh_dim_names``, or
    an index): ``DeviceMesh.size`` takes an index only."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    ndim = int(getattr(mesh, "ndim", len(names) or 1))
    if isinstance(dim, str):
        if dim not in names:
            have = f"its dimensions are named {list(names)}" if names else "it has no names"
            raise ValueError(f"mesh_dim={dim!r} is not a dimension of the DeviceMesh: {have}")
        return names.index(dim)
    if not is_integer(dim) or not -ndim <= dim < ndim:
        raise ValueError(f"mesh_dim={dim!r} is not a dimension of a {ndim}-D DeviceMesh")
    return int(dim) % ndim


def _launched(value: str) -> int:
    """``WORLD_SIZE`` as torch reads it (``int()``: spaces and a newline around it
    too), 0 when it is not an integer."""
    try:
        return int(value)
    except ValueError:
        return 0


def _global_rank() -> str:
    """This process's global rank, as a message names it."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return f"global rank {dist.get_rank()}"
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return f"RANK={os.environ.get('RANK', '?')}"
