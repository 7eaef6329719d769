"""Object-store URLs (``s3://``, ``gs://``, ``az://``): the policy of the I/O engine's
remote backend.

A dataset whose path is a URL is opened here (its manifest or index headers are
fetched, its objects listed with their sizes and ETags) and read through the
same I/O engine as local files, in two phases: the engine plans each batch's
read requests (object, offset, length, destination) in C and its reader thread
hands them over (``tokload/_remote.pyx``) and waits without the GIL; the
process's event loop thread (``tokload.remote.loop``) fetches them
(``tokload.remote.fetch``) and has their bytes copied into the batch buffers
without the GIL.  Requests for
nearby bytes of one object are merged; the process keeps as many GETs in flight,
for all its readers together, as cover the store's latency at the rate the reads
go (from the latency the GETs show); what a retry can help is retried; and every
answer is checked:

- every GET names the ETag the object had when the dataset was opened
  (``If-Match``): an object replaced since then is refused
  (``ObjectChangedError``), never mixed with the old one;
- a body shorter than the range asked for is retried, then refused;
- throttling (HTTP 429, 503 SlowDown), server errors (500, 502, 504), timeouts
  and dropped or refused connections are retried with exponential backoff and
  full jitter, at most ``retries`` times and ``retry_seconds`` seconds per
  range; then ``RemoteError`` names the URL, the byte range and the cause;
- no credentials, access denied (``RemoteAccessError``) and a missing bucket
  or object (``MissingShardError``) fail at once, in one line.

The client is obstore (Rust ``object_store``): one library for S3 and
S3-compatible stores, GCS and Azure, with credentials from the standard
environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_SESSION_TOKEN``, ``AWS_REGION``/``AWS_DEFAULT_REGION``, ``AWS_ENDPOINT_URL``;
``GOOGLE_APPLICATION_CREDENTIALS``; ``AZURE_STORAGE_ACCOUNT_NAME``, ...), web
identity and instance metadata, and bodies handed over without a copy; the AWS
CLI's profiles (SSO, ``credential_process``) come from boto3's session as a
credential provider.  Both are the optional extra ``tokload[cloud]``.  A plain
``http://`` endpoint (a local or on-premises S3-compatible server) is allowed.

``storage_options`` (a dict, on every view, ``open_dataset``, ``open_megatron``,
``open_flat``, ``tokload.build`` and ``tokload.merge``)
overrides the environment: the store's own keys (``endpoint``, ``region``,
``access_key_id``, ``secret_access_key``, ``session_token``,
``skip_signature``, ... as obstore names them for the scheme) and these of
tokload's: ``retries`` (default 10), ``retry_seconds`` (120), ``timeout`` (one
request, seconds, 30), ``connect_timeout`` (seconds, 5) and ``merge_gap``
(bytes between two requested ranges of one object up to which they are read as
one GET, 65536: a shuffled read keeps enough GETs in flight to cover the store's
latency, so a GET saved costs the client about 0.1 ms of CPU, while the bytes
between two ranges are fetched for nothing; object_store's ``get_ranges``
merges up to 1 MiB apart, which fetched 7 to 25 times the bytes asked for in
the object-storage benchmark's shuffled reads).

One job per module: ``urls`` (URLs and paths), ``client`` (the one module that
knows obstore: a second client is one file with its names), ``store`` (buckets
and objects as opened, and ``Settings``), ``failures`` (what is retried, and the
error named), ``loop`` (the fetcher's thread and a clean exit), ``objects``
(listings, HEADs, small reads, uploads, deletes) and ``fetch`` (the batches' GETs).
"""

from __future__ import annotations

from tokload.remote.loop import counters
from tokload.remote.objects import (
    delete,
    exists,
    head,
    listing,
    missing_bucket,
    put_file,
    read_object,
    read_objects,
)
from tokload.remote.store import RemoteObject, Settings, Store, store_for
from tokload.remote.urls import (
    SCHEMES,
    is_url,
    join,
    local_path,
    normalize,
    scheme_of,
    split_url,
)

__all__ = [
    "SCHEMES",
    "RemoteObject",
    "Settings",
    "Store",
    "counters",
    "delete",
    "exists",
    "head",
    "is_url",
    "join",
    "listing",
    "local_path",
    "missing_bucket",
    "normalize",
    "put_file",
    "read_object",
    "read_objects",
    "scheme_of",
    "split_url",
    "store_for",
]
