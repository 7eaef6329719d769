"""The object-store client: the one module of ``tokload.remote`` that knows obstore
(Rust ``object_store``), and so the one file a second client replaces.

Its credentials: as the store's own chain finds them (``storage_options``, the
environment, web identity, a task role, instance metadata), and the AWS CLI's
profiles (SSO, ``credential_process``) through boto3's session as a credential
provider (``_aws_credentials``).

What the rest of ``tokload.remote`` asks of a client, all of it here:

- ``connect(scheme, bucket, config, timeout, connect_timeout)``: ``(handle,
  credentials)``, the handle every request below takes and a few words on where its
  credentials come from; the client's own retries off (tokload retries, counted);
- ``get(handle, key, start, end, etag)``: an awaitable of the answer to a ranged GET
  of ``[start, end)`` that names ``etag`` in ``If-Match``; ``body(answer)``: its
  bytes at once (they came with it), ``body_async(answer)``: an awaitable of them
  (a large body, streamed).  ``get`` runs once per GET on the fetcher's hot path: no
  coroutine, no Python object of its own beyond the request's options;
- ``head``, ``list_prefix``, ``put``, ``delete``: awaitables of the other requests;
- ``kind(e)``: what an exception of the client's means (``CHANGED``, ``MISSING``,
  ``NO_BUCKET``, ``NO_CREDENTIALS``, ``DENIED``, ``NOT_PARTIAL``, ``UNREACHABLE``,
  ``TIMEOUT``, ``TRANSIENT``, or ``None``), from its type where the client gives one and its
  HTTP status or message otherwise; ``cause(e)``: what went wrong, in a few words.

``tests/test_remote_client.py`` reads datasets through an in-memory client made of
these functions alone.  Every request is sent, and every answer handed to Python,
by the client's own threads; the answers wake the fetcher's event loop through its
``call_soon_threadsafe`` (``tokload.remote.loop``).
"""

from __future__ import annotations

import asyncio
import configparser
import os
import re
import urllib.parse
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from tokload.errors import RemoteAccessError, UsageError

CHANGED = "changed"  # the object's ETag is not the one named (If-Match failed)
MISSING = "missing"  # no such object
NO_BUCKET = "no bucket"  # no such bucket
NO_CREDENTIALS = "no credentials"  # the client found none (and asked instance metadata)
DENIED = "denied"  # access denied, or not authenticated
NOT_PARTIAL = "not partial"  # a ranged GET answered with 200 and the whole object
UNREACHABLE = "unreachable"  # the endpoint could not be connected to (retried)
TIMEOUT = "timeout"  # a request took longer than its timeout (retried)
TRANSIENT = "transient"  # throttled, a server error, a dropped connection

_STATUS = re.compile(r"status code: (\d{3})")
_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_TIMEOUT = re.compile(r"kind: Timeout|timed out|timeout error", re.I)
_CONNECT = re.compile(r"kind: Connect\b|ConnectError")  # (not ConnectionReset: an answer cut)
_TRANSPORT = re.compile(
    r"kind: (Connect|Timeout|Request|Body|Decode|Interrupted)|error sending request"
    r"|connection (reset|closed)|IncompleteMessage|operation timed out",
    re.I,
)


def obstore() -> Any:
    """The obstore module (``ImportError`` naming the extra to install without it)."""
    try:
        import obstore
        import obstore.store
    except ImportError:
        raise ImportError(
            "reading s3://, gs:// or az:// URLs needs obstore: pip install 'tokload[cloud]'"
        ) from None
    return obstore


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# ---- connecting ---------------------------------------------------------------------


def connect(
    scheme: str, bucket: str, config: dict[str, Any], timeout: float, connect_timeout: float
) -> tuple[Any, str]:
    """A client for one bucket (or container): ``(handle, where its credentials come
    from)``.  ``config``: the store's own ``storage_options`` (obstore's names for the
    scheme, in any case, with or without ``aws_``).  ``timeout``, ``connect_timeout``:
    seconds, per request.

    Raises:
        UsageError: (a ValueError) an unknown option, a malformed endpoint.
        RemoteAccessError: an AWS profile that cannot give credentials.
    """
    obs = obstore()
    config = dict(config)
    given = _option(config, "endpoint", "endpoint_url")
    env = os.environ
    source = "storage_options (endpoint)"
    if given is None and scheme == "s3":
        for var in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT"):
            if env.get(var):
                given, source = env[var], f"the environment ({var})"
                config["endpoint"] = given
                break
    endpoint = str(given or "")
    if endpoint:
        _check_endpoint(f"{scheme}://{bucket}", endpoint, source)
    # (fixed-point: obstore parses no exponent, "1e-05s"; split_options bounds them)
    client: dict[str, Any] = {
        "timeout": f"{timeout:.3f}s",
        "connect_timeout": f"{connect_timeout:.3f}s",
    }
    if endpoint.lower().startswith("http://"):
        client["allow_http"] = True
    provider = None
    if scheme == "s3":
        provider, credentials = _aws_credentials(config)
    else:
        credentials = "the client's default chain for " + scheme
    try:
        # tokload retries itself (counted, and with the error it names):
        # obstore's own retries are off.
        handle = obs.store.from_url(
            f"{scheme}://{bucket}",
            config=config,
            client_options=client,
            retry_config={"max_retries": 0},
            credential_provider=provider,
        )
    except Exception as e:  # an unknown option, a malformed endpoint
        raise UsageError(f"{scheme}://{bucket}: storage_options: {first_line(e)}") from None
    return handle, credentials


def _check_endpoint(where: str, endpoint: str, source: str) -> None:
    """Refuse an endpoint that is not ``http(s)://host[:port][/path]``: the client
    takes it as it is, and a malformed one (no scheme: ``127.0.0.1:9000``) made
    its first request panic, with nothing naming the endpoint.

    Raises:
        UsageError: (a ValueError) naming the endpoint, where it came from and what
            is wrong.
    """
    parts = urllib.parse.urlsplit(endpoint)
    if any(c.isspace() for c in endpoint):  # (urlsplit drops a newline at the end)
        problem = "it holds white space (a newline from a file?)"
    elif parts.scheme not in ("http", "https"):
        problem = "it does not start with http:// or https://"
    elif not parts.hostname:
        problem = "it names no host"
    else:
        try:
            parts.port  # noqa: B018 (a port that is not a number in range raises)
            return
        except ValueError as e:
            problem = str(e)
    raise UsageError(
        f"{where}: the endpoint {endpoint!r} from {source} is not a URL of the form "
        f"http(s)://host[:port]: {problem}"
    )


def _option(config: dict[str, Any], *names: str) -> Any:
    """The value of the first option of ``config`` named one of ``names``, spelt as
    obstore takes it: in any case, with or without the ``aws_`` prefix
    (``AWS_ACCESS_KEY_ID``, ``aws_access_key_id`` and ``access_key_id`` are one
    option); None if there is none."""
    for key, value in config.items():
        k = str(key).lower()
        if (k[4:] if k.startswith("aws_") else k) in names:
            return value
    return None


def _aws_files() -> list[str]:
    """The AWS CLI's config and credentials files, where it reads them."""
    home, env = os.path.expanduser("~"), os.environ
    return [
        env.get("AWS_CONFIG_FILE", os.path.join(home, ".aws", "config")),
        env.get("AWS_SHARED_CREDENTIALS_FILE", os.path.join(home, ".aws", "credentials")),
    ]


def _profile_region(config: dict[str, Any]) -> None:
    """Set ``config``'s region from the AWS profile's (``AWS_PROFILE``, else
    ``default``, in ``~/.aws/config``) where neither ``config`` nor the environment
    (``AWS_REGION``, ``AWS_DEFAULT_REGION``) gives one, as the AWS CLI does whatever
    the credentials' source is (keys in the environment signed requests for
    us-east-1 while the profile named another region)."""
    env = os.environ
    given = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if _option(config, "region", "default_region") or given:
        return
    path = _aws_files()[0]
    if not os.path.isfile(path):
        return
    profile = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE") or "default"
    parser = configparser.RawConfigParser()
    try:
        parser.read(path, encoding="utf-8")
    except (configparser.Error, UnicodeDecodeError, OSError):
        return  # (left to boto3 to say, where a profile gives the credentials)
    sections = ["default", "profile default"] if profile == "default" else [f"profile {profile}"]
    for section in sections:
        region = parser.get(section, "region", fallback="").strip()
        if region:
            config["region"] = region
            return


def _aws_credentials(config: dict[str, Any]) -> tuple[Any, str]:
    """Where an S3 store's credentials come from: ``(credential provider or None, source)``.

    object_store's own chain reads keys from ``storage_options`` and the
    environment, web identity (``AWS_WEB_IDENTITY_TOKEN_FILE``), ECS task roles
    and the instance metadata service. It does not read the AWS CLI's files:
    where none of the first three is there and a profile is (``AWS_PROFILE``,
    ``~/.aws/config`` or ``~/.aws/credentials``), boto3's session provides the
    credentials (profiles, SSO, ``credential_process``, assumed roles; refreshed
    as they expire). The profile's region is used unless one is set, wherever the
    credentials come from (``_profile_region``).
    """
    _profile_region(config)
    if str(_option(config, "skip_signature")).lower() == "true":
        return None, "nowhere (skip_signature: unsigned requests)"
    if _option(config, "access_key_id", "secret_access_key") is not None:
        return None, "storage_options (access_key_id)"
    env = os.environ
    if env.get("AWS_ACCESS_KEY_ID"):
        return None, "the environment (AWS_ACCESS_KEY_ID)"
    if env.get("AWS_WEB_IDENTITY_TOKEN_FILE"):
        return None, "web identity (AWS_WEB_IDENTITY_TOKEN_FILE)"
    if env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI") or env.get(
        "AWS_CONTAINER_CREDENTIALS_FULL_URI"
    ):
        return None, "the container's task role (AWS_CONTAINER_CREDENTIALS_*)"
    files = _aws_files()
    profile = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE")
    if profile or any(os.path.isfile(f) for f in files):
        try:
            import boto3
            from obstore.auth.boto3 import Boto3CredentialProvider
        except ImportError:
            return None, (
                "the instance metadata service (an AWS profile is configured, but reading "
                "it needs boto3: pip install 'tokload[cloud]')"
            )
        name = profile or "default"
        try:
            session = boto3.Session(profile_name=profile) if profile else boto3.Session()
            creds = session.get_credentials()
            found = creds is not None
        except Exception as e:  # botocore's: an unknown profile, a broken file, SSO expired
            raise RemoteAccessError(
                f"the AWS profile {name!r} cannot give credentials ({first_line(e)}); "
                f"files read: {', '.join(files)}"
            ) from None
        if found:
            method = getattr(creds, "method", None)
            if method in ("iam-role", "container-role"):
                # (as the AWS CLI does: a profile of a region alone, on EC2)
                role = "instance's" if method == "iam-role" else "container's"
                return Boto3CredentialProvider(session), (
                    f"the {role} role, through the AWS profile {name!r}, which holds no "
                    f"credentials of its own (boto3: {', '.join(files)})"
                )
            return Boto3CredentialProvider(session), (
                f"the AWS profile {name!r} (boto3, {method or 'its own'}: {', '.join(files)}; "
                "SSO and credential_process included)"
            )
        if profile:  # named, and empty (nor an instance's role that boto3 falls back to)
            raise RemoteAccessError(
                f"the AWS profile {name!r} cannot give credentials (it has no keys, SSO, "
                f"credential_process or role to assume); files read: {', '.join(files)}"
            )
    return None, "the instance metadata service (no keys, web identity, task role or profile)"


# ---- requests -----------------------------------------------------------------------


def get(handle: Any, key: str, start: int, end: int, etag: str | None) -> asyncio.Future[Any]:
    """A ranged GET of ``[start, end)``, as a future of the fetcher's loop (obstore's
    requests are); with ``etag``, an object replaced since it was opened is refused
    (``If-Match``: ``CHANGED``)."""
    opts: dict[str, Any] = {"range": (start, end)}
    if etag:
        opts["if_match"] = etag
    return obstore().get_async(handle, key, options=opts)  # type: ignore[no-any-return]


def body(answer: Any) -> Any:
    """The body of a GET's answer, at once (a bytes-like object)."""
    return answer.bytes()


def body_async(answer: Any) -> Awaitable[Any]:
    """The body of a GET's answer, read from its stream."""
    return answer.bytes_async()  # type: ignore[no-any-return]


async def head(handle: Any, key: str) -> tuple[int, str | None]:
    """``(size, ETag)`` of an object as it is now."""
    meta = await obstore().head_async(handle, key)
    return int(meta["size"]), meta.get("e_tag")


async def list_prefix(handle: Any, prefix: str) -> list[tuple[str, int, str | None]]:
    """``(key, size, ETag)`` of every object under ``prefix`` (all of them for ``""``),
    in one paginated LIST."""
    metas = await obstore().list(handle, prefix or None).collect_async()
    return [(m["path"], int(m["size"]), m.get("e_tag")) for m in metas]


async def list_first(handle: Any, prefix: str) -> None:
    """The first page of a LIST under ``prefix`` (one request), for what its
    failure says: a HEAD's 404 has no body to tell a missing bucket by."""
    async for _ in obstore().list(handle, prefix or None, chunk_size=1):
        break


def put(handle: Any, key: str, path: str | os.PathLike[str]) -> Awaitable[Any]:
    """Upload the local file ``path`` as ``key`` (multipart for large files)."""
    return obstore().put_async(handle, key, Path(path))  # type: ignore[no-any-return]


def delete(handle: Any, key: str) -> Awaitable[Any]:
    """Delete ``key`` (its ``kind`` is ``MISSING`` where there is none)."""
    return obstore().delete_async(handle, key)  # type: ignore[no-any-return]


# ---- what an error means ------------------------------------------------------------


def _status(text: str) -> int | None:
    m = _STATUS.search(text)
    return int(m.group(1)) if m else None


def kind(e: BaseException) -> str | None:
    """What an exception raised by a request means (one of this module's kinds), or
    None: another error, not retried.  obstore gives a type to a missing object, a
    failed ``If-Match`` and a refused access; the rest is a ``GenericError`` whose
    HTTP status, and failing that its transport's kind, are only in its message."""
    ex = obstore().exceptions
    if isinstance(e, (ex.PreconditionError, ex.NotModifiedError)):
        return CHANGED
    text = str(e)
    status = _status(text)
    if isinstance(e, ex.NotFoundError) or status == 404:
        return NO_BUCKET if "NoSuchBucket" in text else MISSING
    if "169.254.169.254" in text:  # no credentials: the chain ended at instance metadata
        return NO_CREDENTIALS
    if isinstance(e, (ex.PermissionDeniedError, ex.UnauthenticatedError)) or status in (401, 403):
        return DENIED
    if "non-partial response" in text:  # object_store's GetResultError::NotPartial
        return NOT_PARTIAL
    if not isinstance(e, ex.GenericError):
        return None
    if status is not None:
        return TRANSIENT if status in _RETRY_STATUS else None
    if _TIMEOUT.search(text):  # worded "error sending request" too: not unreachable
        return TIMEOUT
    if _CONNECT.search(text):
        return UNREACHABLE
    return TRANSIENT if _TRANSPORT.search(text) else None


def cause(e: BaseException) -> str:
    """What went wrong, in a few words: ``HTTP 503 Service Unavailable
    (SlowDown)``, ``connect error: ...``, or the first line of the message."""
    text = str(e)
    m = re.search(r"status code: (\d{3}) ?([^:\n]*)", text)
    if m:
        code = re.search(r"<Code>([^<]+)</Code>", text)
        return f"HTTP {m.group(1)} {m.group(2).strip()}".strip() + (
            f" ({code.group(1)})" if code else ""
        )
    line = first_line(e)
    line = re.sub(r"^.*? in [0-9.]+\S*s - ", "", line)  # "Error performing GET <url> in 3ms - "
    k = re.search(r"kind: (\w+)", text)
    return f"{k.group(1).lower()} error: {line}" if k else line
