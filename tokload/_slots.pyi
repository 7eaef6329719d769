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
