"""Observation views: a dataset read as a plain list, ``view[i]``, in constant time.

- ``TokenStream``: observation ``i`` is rows ``[i*stride, i*stride + window)``
  of the concatenated stream (it may span shards).
- ``Documents``: observation ``i`` is document ``i``.
- ``StreamWithMetadata``: token windows plus, per token, the position of
  its metadata record in the list of distinct records of the window (or of the
  batch), and that list.

Each view has ``len(view)``, ``view[i]`` and a bulk ``view.read(indices)``
that reads a batch in one call into the C core, without the GIL (into
preallocated arrays: ``out=`` for the windowed views, ``alloc=`` for
``Documents``). Any view can be cut to a contiguous range of its observations with
``subset`` (or ``split``, Megatron's ``"969,30,1"`` style) at no cost.
- ``Blend``: a weighted, scheduled mixture of views of one kind.

Every view keeps the contracts of ``tokload.views.contract``: the view
protocol the DataLoader reads through (``len``, ``fingerprint``,
``read_batch``) and, for views of documents, the document contract the
batching policies read through (``extents``, ``fields``, ``read_extents``).
One module per view: ``base`` (what they share), ``windows``, ``documents``,
``metadata``, ``blend`` (a blend's positions: layout, ``locate``, fingerprints),
with ``blend_reads`` (what a blend reads, by the kind of its components).
"""

from tokload.views.base import DataLike, Fields, View, open_source, split
from tokload.views.blend import Blend
from tokload.views.contract import ATTENTION_KEYS, Alloc, BatchView, DocumentView
from tokload.views.documents import DocumentBatch, Documents
from tokload.views.metadata import MetadataBatch, RecordList, StreamWithMetadata
from tokload.views.windows import BATCH_KEYS, BOUNDARY_KEYS, TokenStream

__all__ = [
    "ATTENTION_KEYS",
    "BATCH_KEYS",
    "BOUNDARY_KEYS",
    "Alloc",
    "BatchView",
    "Blend",
    "DataLike",
    "DocumentBatch",
    "DocumentView",
    "Documents",
    "Fields",
    "MetadataBatch",
    "RecordList",
    "StreamWithMetadata",
    "TokenStream",
    "View",
    "open_source",
    "split",
]
