"""S3 specifics of the persistent tier: option checks, parallel multipart upload, error hints.

The persistent tier talks to S3 (and S3-compatible stores: MinIO, Ceph RGW, …) through
s3fs, which itself uses aiobotocore. Credentials come from botocore's usual chain unless the
storage options name them: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` /
``AWS_SESSION_TOKEN``, then ``AWS_PROFILE`` (or the ``profile`` option) in
``~/.aws/credentials`` and ``~/.aws/config``, then a container or instance role (boto3's
"Configuring credentials" page lists the order).

Upload (:func:`multipart_put`): a file no larger than one part is one ``PutObject``; a larger
one is a multipart upload whose parts go up ``concurrency`` at a time while the next part is
read. The bytes are hashed as they are read, so the object is checked against the manifest
in the same pass, and a mismatch or any error aborts the upload: an S3 object appears only at
``CompleteMultipartUpload``, whole or not at all (a killed agent leaves at most an incomplete
upload, never an object; a bucket lifecycle rule ``AbortIncompleteMultipartUpload`` reclaims
its parts). S3 limits: parts of 5 MiB to 5 GiB, at most 10,000 of them (AWS "Amazon S3
multipart upload limits").

No torch here.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO

S3_PROTOCOLS = frozenset({"s3", "s3a"})
MIN_PART_SIZE = 5 * 1024**2
MAX_PART_SIZE = 5 * 1024**3
MAX_PARTS = 10_000
DEFAULT_PART_SIZE = 16 * 1024**2
DEFAULT_CONCURRENCY = 8
MAX_CONCURRENCY = 64

# fsspec's own options, accepted by every filesystem (the directory cache, instance cache)
_FSSPEC_OPTIONS = frozenset(
    {"use_listings_cache", "listings_expiry_time", "max_paths", "skip_instance_cache"}
)


def is_s3_url(url: str) -> bool:
    """Whether ``url`` is an ``s3://`` (or ``s3a://``) URL."""
    return url.partition("://")[0].lower() in S3_PROTOCOLS


def is_s3_fs(fs: Any) -> bool:
    """Whether ``fs`` is an s3fs filesystem."""
    protocol = getattr(fs, "protocol", ())
    protocols = (protocol,) if isinstance(protocol, str) else tuple(protocol)
    return bool(S3_PROTOCOLS & set(protocols))


def check_s3_options(options: dict[str, Any]) -> None:
    """Check storage options for an ``s3://`` URL against what s3fs accepts.

    Args:
        options: fsspec storage options (``endpoint_url``, ``key``, ``secret``, ``profile``,
            ``client_kwargs``, ``config_kwargs``, …).

    Raises:
        ValueError: an option s3fs does not know (it would otherwise be ignored without a
            word), or a wrong type for ``endpoint_url``, ``client_kwargs`` or
            ``config_kwargs``; the message names the option and lists the known ones.
        ImportError: s3fs is not installed.
    """
    from aiobotocore.session import AioSession
    from s3fs import S3FileSystem

    known = set(_FSSPEC_OPTIONS)
    # s3fs's own arguments, and what it hands on to aiobotocore's session (``profile``)
    for fn in (S3FileSystem.__init__, AioSession.__init__):
        params = inspect.signature(fn).parameters
        known |= {n for n, p in params.items() if n != "self" and p.kind is p.POSITIONAL_OR_KEYWORD}
        known |= {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(
            f"unknown s3 storage option(s) {', '.join(map(repr, unknown))}; s3fs accepts "
            f"{', '.join(sorted(known))} (region: client_kwargs.region_name)"
        )
    endpoint = options.get("endpoint_url")
    if endpoint is not None and not (
        isinstance(endpoint, str) and endpoint.startswith(("http://", "https://"))
    ):
        raise ValueError(
            f"endpoint_url {endpoint!r}: use an http:// or https:// URL such as "
            "http://minio.example:9000"
        )
    for name in ("client_kwargs", "config_kwargs", "s3_additional_kwargs"):
        if name in options and not isinstance(options[name], dict):
            raise ValueError(f"{name} must be a JSON object, not {options[name]!r}")


def store_errors() -> tuple[type[BaseException], ...]:
    """The exceptions a store call can raise: ``OSError`` (s3fs turns S3 error codes into
    ``OSError`` subclasses) and botocore's own (no credentials, endpoint unreachable, bad
    configuration), which are not ``OSError``."""
    try:
        from botocore.exceptions import BotoCoreError
    except ImportError:
        return (OSError,)
    return (OSError, BotoCoreError)


def explain(exc: BaseException, *, endpoint: str | None) -> str:
    """One line for an S3 failure, with what to fix where the cause is known.

    Args:
        exc: What the call raised.
        endpoint: The endpoint URL in use (None: AWS).
    """
    name = type(exc).__name__
    text = f"{name}: {exc}" if str(exc) else name
    lower = str(exc).lower()
    where = endpoint or "AWS S3"
    if name in {"NoCredentialsError", "PartialCredentialsError"}:
        return (
            f"{text} (no usable AWS credentials: set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE / TIERWATCH_S3_PROFILE, or run with an "
            "instance or container role)"
        )
    if name == "ProfileNotFound":
        return f"{text} (the profile must exist in ~/.aws/config or ~/.aws/credentials)"
    if name in {"EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError"} or (
        isinstance(exc, ConnectionError)
    ):
        return f"{text} (cannot reach {where}: check TIERWATCH_S3_ENDPOINT_URL and the network)"
    if "bucket does not exist" in lower or "nosuchbucket" in lower:
        return f"{text} (create the bucket first; the agent never creates buckets)"
    if isinstance(exc, PermissionError) or any(
        s in lower for s in ("access denied", "invalidaccesskeyid", "signaturedoesnotmatch")
    ):
        return (
            f"{text} (the credentials in use may not read/write this bucket: check them and "
            "the bucket policy)"
        )
    return text


Hasher = Callable[[bytes], None]
Check = Callable[[], None]
Progress = Callable[[int], None]


def multipart_put(
    fs: Any,
    src: BinaryIO,
    path: str,
    *,
    size: int,
    part_size: int = DEFAULT_PART_SIZE,
    concurrency: int = DEFAULT_CONCURRENCY,
    update: Hasher | None = None,
    check: Check | None = None,
    progress: Progress | None = None,
) -> int:
    """Upload ``local`` to ``path`` (``bucket/key``) on an s3fs filesystem.

    Args:
        fs: An ``s3fs.S3FileSystem``.
        src: The file to upload, open for reading at its start (the caller opens it without
            following links and closes it).
        path: ``bucket/key`` (no protocol).
        size: Its size in bytes (from ``fstat``; picks one ``PutObject`` or a multipart
            upload).
        part_size: Bytes per part (5 MiB … 5 GiB); a file of at most this size is one
            ``PutObject``. Raised as needed to stay within 10,000 parts.
        concurrency: Parts in flight at once (1 … 64); memory held is at most
            ``(concurrency + 1) * part_size`` bytes.
        update: Called with every chunk read, in file order (a hash).
        check: Called once every byte was read and sent, before the object is made visible;
            an exception from it aborts the upload (nothing is left behind) and propagates.
        progress: Called with the bytes of each part once S3 has it.

    Returns:
        Bytes uploaded.

    Raises:
        OSError, botocore.exceptions.BotoCoreError: a read or S3 call failed (the multipart
            upload, if one was started, is aborted first).
        Exception: what ``check`` raised.
        ValueError: ``part_size`` or ``concurrency`` out of range.
    """
    if not MIN_PART_SIZE <= part_size <= MAX_PART_SIZE:
        raise ValueError(f"part_size {part_size}: must be between 5 MiB and 5 GiB")
    if not 1 <= concurrency <= MAX_CONCURRENCY:
        raise ValueError(f"concurrency {concurrency}: must be between 1 and {MAX_CONCURRENCY}")
    bucket, key, _ = fs.split_path(path)
    part_size = max(part_size, -(-size // MAX_PARTS))
    if size <= part_size:
        body = src.read(size + 1)  # one byte more than announced shows a grown file
        if update:
            update(body)
        if check:
            check()
        fs.call_s3("put_object", Bucket=bucket, Key=key, Body=body)
        if progress:
            progress(len(body))
        fs.invalidate_cache(path)
        return len(body)
    upload_id = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
    try:
        total = _upload_parts(
            fs, src, bucket, key, upload_id, part_size, concurrency, update, progress
        )
        if check:
            check()
        fs.call_s3(
            "complete_multipart_upload",
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            MultipartUpload={"Parts": total[1]},
        )
    except BaseException:
        try:
            fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        except store_errors():
            pass  # the first error is the one to report; a lifecycle rule reclaims it
        raise
    fs.invalidate_cache(path)
    return total[0]


def _upload_parts(
    fs: Any,
    src: Any,
    bucket: str,
    key: str,
    upload_id: str,
    part_size: int,
    concurrency: int,
    update: Hasher | None,
    progress: Progress | None,
) -> tuple[int, list[dict[str, Any]]]:
    """Read ``src`` part by part and upload the parts, ``concurrency`` at a time (a sliding
    window: a new part starts as soon as one finishes). Returns (bytes, parts for
    ``CompleteMultipartUpload``)."""
    window = threading.BoundedSemaphore(concurrency)
    futures: list[Future[dict[str, Any]]] = []
    failed = threading.Event()

    def send(number: int, body: bytes) -> dict[str, Any]:
        try:
            out = fs.call_s3(
                "upload_part",
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
                PartNumber=number,
                Body=body,
            )
            if progress:
                progress(len(body))
            return {"PartNumber": number, "ETag": out["ETag"]}
        except BaseException:
            failed.set()
            raise
        finally:
            window.release()

    total = 0
    with ThreadPoolExecutor(concurrency, thread_name_prefix="s3-part") as pool:
        number = 0
        while not failed.is_set():
            window.acquire()
            body = src.read(part_size)
            if not body:
                window.release()
                break
            number += 1
            total += len(body)
            if update:
                update(body)
            futures.append(pool.submit(send, number, body))
        parts = [f.result() for f in futures]  # raises the first failure
    return total, parts
