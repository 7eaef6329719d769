"""tokload: feeds tokens to large-scale LLM training.

Global shuffling with nothing precomputed (:class:`Permutation`), computed per
index in O(1) time and memory and bit-compatible with the reference ``gfc``
library.  See README.md for the whole picture and ARCHITECTURE.md for the
invariants.
"""

from tokload._permute import Permutation, epoch_seed

__all__ = ["Permutation", "__version__", "epoch_seed"]

__version__ = "0.1.0"
