import numpy as np
import numpy.typing as npt

# (component, lane) of slot slots[i] of block blocks[i] of a Blend.
def block_slots(
    slot_seed: int,
    blocks: npt.ArrayLike,
    slots: npt.ArrayLike,
    counts: npt.ArrayLike,
    segments: npt.ArrayLike,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]: ...

# (component, own position) of Blend positions q, in q's order.
def positions(
    slot_seed: int,
    q: npt.ArrayLike,
    m: int,
    seg_first: npt.ArrayLike,
    seg_counts: npt.ArrayLike,
    seg_before: npt.ArrayLike,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]: ...

# (component, index in component) of Blend positions q, in q's order.
def locate(
    slot_seed: int,
    q: npt.ArrayLike,
    m: int,
    seg_first: npt.ArrayLike,
    seg_counts: npt.ArrayLike,
    seg_before: npt.ArrayLike,
    sizes: npt.ArrayLike,
    comp_seeds: npt.ArrayLike,
    rounds: int,
    tables: dict[tuple[int, int, int], np.ndarray] | None,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]: ...
