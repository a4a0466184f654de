"""S3 (s3fs / aiobotocore): multi-part uploads streamed from the caller's buffer.

``create_multipart_upload`` / ``upload_part`` / ``complete_multipart_upload`` go through s3fs's
public ``call_s3`` (its client, credentials and event loop); each part body is a zero-copy
reader over a slice of the caller's memoryview (botocore rejects a bare ``memoryview``). Parts
are at least 5 MiB (S3's minimum); smaller zstd frames are coalesced into upload parts. S3
keeps the parts of an upload its writer never completed, so retention lists and aborts them.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from nebula_ckpt import knobs
from nebula_ckpt.storage.remote.base import FsspecStorage
from nebula_ckpt.storage.remote.retry import Attempt, Kind, RetryPolicy, classify, describe
from nebula_ckpt.storage.remote.upload import PartLimits, Sink, ViewReader

logger = logging.getLogger("nebula_ckpt.storage.remote")

_MiB = 1 << 20


class _S3Sink(Sink):
    """Parallel parts of one S3 object (multi-part upload)."""

    min_part = 5 * _MiB

    def __init__(self, storage: "S3Storage", path: str) -> None:
        self._st = storage
        self._bucket, self._key, _ = storage.fs.split_path(path)
        self._upload_id: Optional[str] = None

    def _call(self, method: str, attempt: Attempt, **kw: Any) -> Any:
        return self._st.call_s3(method, attempt, Bucket=self._bucket, Key=self._key, **kw)

    def put_single(self, body: Any, attempt: Attempt) -> None:
        self._call("put_object", attempt, Body=ViewReader(body), ContentLength=len(body))

    def begin(self, attempt: Attempt) -> None:
        self._upload_id = self._call("create_multipart_upload", attempt)["UploadId"]

    def put_part(self, index: int, body: Any, attempt: Attempt) -> Any:
        r = self._call("upload_part", attempt, UploadId=self._upload_id, PartNumber=index + 1,
                       Body=ViewReader(body), ContentLength=len(body))
        return {"PartNumber": index + 1, "ETag": r["ETag"]}

    def complete(self, tokens: list[Any], stored_bytes: int, attempt: Attempt) -> None:
        try:
            self._call("complete_multipart_upload", attempt, UploadId=self._upload_id,
                       MultipartUpload={"Parts": tokens})
        except Exception as e:
            # A retried complete whose first try succeeded server-side answers NoSuchUpload.
            if attempt.number > 1 and classify(e) == Kind.NOTFOUND:
                head = self._call("head_object", attempt)
                if int(head.get("ContentLength", -1)) == stored_bytes:
                    return
            raise
        self._upload_id = None

    def abort(self) -> None:
        if self._upload_id is None:
            return
        try:
            self._call("abort_multipart_upload", Attempt(1, RetryPolicy.from_knobs().timeout_s),
                       UploadId=self._upload_id)
        except Exception as e:  # noqa: BLE001 - best effort; retention retries later
            logger.warning("%s: could not abort the multipart upload of %s/%s (%s); its parts "
                           "stay until retention or a bucket lifecycle rule removes them",
                           self._st.display_url, self._bucket, self._key,
                           self._st.scrub(describe(e)))


class S3Storage(FsspecStorage):
    """Remote tier on S3 or an S3-compatible store (``s3://bucket/prefix``).

    See :class:`FsspecStorage` for the arguments. Defaults added to ``storage_options`` where
    absent: ``config_kwargs`` ``connect_timeout`` / ``read_timeout`` (capped by
    ``remote_timeout_s``), ``retries={"max_attempts": 0}`` (our retry loop governs),
    ``max_pool_connections`` for ``remote_concurrency`` parts, and no listings cache.
    """

    _is_backend = True
    #: every part but the last >= 5 MiB; at most 10,000 parts
    part_limits = PartLimits(min_part=5 * _MiB, max_parts=10_000)

    def _set_default_options(self, options: dict[str, Any], connect_timeout: float,
                             read_timeout: float) -> None:
        cfg = dict(options.get("config_kwargs") or {})
        cfg.setdefault("connect_timeout", connect_timeout)
        cfg.setdefault("read_timeout", read_timeout)
        cfg.setdefault("retries", {"max_attempts": 0, "mode": "standard"})
        cfg.setdefault("max_pool_connections", max(10, 2 * int(knobs.get("remote_concurrency"))))
        options["config_kwargs"] = cfg
        options.setdefault("use_listings_cache", False)

    def _configure_client(self, fs: Any, options: dict[str, Any]) -> None:
        # s3fs retries each call 5 times on its own (its public ``retries`` attribute): our
        # loop governs, with the deadline
        fs.retries = 1

    def call_s3(self, method: str, attempt: Attempt, **kw: Any) -> Any:
        """One S3 API call through s3fs's client, cut off at the attempt's deadline."""
        return self.fs.call_s3(method, timeout=attempt.timeout, **kw)

    def _sink(self, path: str) -> Sink:
        return _S3Sink(self, path)

    def _probe(self, attempt: Attempt) -> None:
        bucket, key, _ = self.fs.split_path(self._root)
        self.call_s3("list_objects_v2", attempt, Bucket=bucket, Prefix=f"{key}/" if key else "",
                   MaxKeys=1)

    def incomplete_uploads(self) -> list[tuple[str, str]]:
        """``(rel, upload_id)`` of multi-part uploads never completed under this root.

        A writer killed mid-upload leaves its parts stored (and billed) with no object to list;
        retention aborts them.
        """
        bucket, key, _ = self.fs.split_path(self._path(""))
        prefix = key.rstrip("/") + "/" if key else ""

        def ls(attempt: Attempt) -> list[tuple[str, str]]:
            out: list[tuple[str, str]] = []
            kw: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
            while True:
                page = self.call_s3("list_multipart_uploads", attempt, **kw)
                out.extend((u["Key"][len(prefix):], u["UploadId"]) for u in page.get("Uploads", []))
                if not page.get("IsTruncated"):
                    return out
                kw.update(KeyMarker=page["NextKeyMarker"], UploadIdMarker=page["NextUploadIdMarker"])

        return self._retry("list multipart uploads", "", ls)

    def abort_upload(self, rel: str, upload_id: str) -> None:
        """Abort one incomplete multi-part upload; an upload already gone is not an error."""
        bucket, key, _ = self.fs.split_path(self._path(rel))
        try:
            self._retry("abort multipart upload", rel, lambda attempt: self.call_s3(
                "abort_multipart_upload", attempt, Bucket=bucket, Key=key, UploadId=upload_id))
        except FileNotFoundError:
            pass

    def _close_client(self) -> None:
        # s3fs has no public close of its aiobotocore client; ``_s3`` is where it keeps it
        s3 = getattr(self.fs, "_s3", None)
        if s3 is not None:
            from fsspec.asyn import sync
            sync(self.fs.loop, s3.close, timeout=5)
            self.fs._s3 = None
