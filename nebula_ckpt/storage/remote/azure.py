"""Azure Blob (adlfs + azure-storage-blob): staged blocks streamed from the caller's buffer.

``stage_block`` / ``commit_block_list`` go through the async ``BlobServiceClient`` that adlfs
built (its public ``service_client``: credentials and event loop); block bodies are memoryview
slices (no copy). Azure discards uncommitted blocks by itself, so a killed writer leaves no
upload to abort.
"""

from __future__ import annotations

import base64
import logging
from typing import Any

from nebula_ckpt.storage.remote.base import FsspecStorage
from nebula_ckpt.storage.remote.retry import Attempt
from nebula_ckpt.storage.remote.upload import PartLimits, Sink

logger = logging.getLogger("nebula_ckpt.storage.remote")

_MiB = 1 << 20
#: single-request uploads of a memoryview up to this size are copied to bytes first
_SMALL_COPY = 4 * _MiB


class _AzureSink(Sink):
    """Parallel staged blocks of one block blob."""

    def __init__(self, storage: "AzureBlobStorage", path: str) -> None:
        self._st = storage
        container, blob, _ = storage.fs.split_path(path)
        self._client = storage.fs.service_client.get_blob_client(container, blob)

    @staticmethod
    def _block_id(index: int) -> str:
        return base64.b64encode(f"nebula-{index:010d}".encode()).decode()

    def put_single(self, body: Any, attempt: Attempt) -> None:
        # upload_blob cannot take a memoryview (it concatenates bytes); small views are copied
        # (cheaper than a second round trip), large ones go up as one block (no copy)
        if isinstance(body, memoryview) and len(body) > _SMALL_COPY:
            self.complete([self.put_part(0, body, attempt)], len(body), attempt)
            return
        if isinstance(body, memoryview):
            body = body.tobytes()
        self._st.run_sdk(self._client.upload_blob, attempt, body, length=len(body), overwrite=True)

    def put_part(self, index: int, body: Any, attempt: Attempt) -> Any:
        bid = self._block_id(index)
        self._st.run_sdk(self._client.stage_block, attempt, bid, body, length=len(body))
        return bid

    def complete(self, tokens: list[Any], stored_bytes: int, attempt: Attempt) -> None:
        from azure.storage.blob import BlobBlock
        self._st.run_sdk(self._client.commit_block_list, attempt,
                      [BlobBlock(block_id=b) for b in tokens])


class AzureBlobStorage(FsspecStorage):
    """Remote tier on Azure Blob Storage (``az://container/prefix``, ``abfs://``, ``abfss://``).

    See :class:`FsspecStorage` for the arguments. Defaults added to ``storage_options`` where
    absent: ``connection_timeout`` / ``read_timeout`` (capped by ``remote_timeout_s``) and no
    listings cache; the SDK client's own retries are turned off (our retry loop governs).
    """

    _is_backend = True
    #: at most 50,000 blocks of at most 4000 MiB
    part_limits = PartLimits(max_parts=50_000, max_part=4000 * _MiB)

    def _set_default_options(self, options: dict[str, Any], connect_timeout: float,
                             read_timeout: float) -> None:
        options.setdefault("connection_timeout", connect_timeout)
        options.setdefault("read_timeout", read_timeout)
        options.setdefault("use_listings_cache", False)
        # per-request settings of the calls we make ourselves (public SDK keywords)
        self._request_kw = {"connection_timeout": options["connection_timeout"],
                            "read_timeout": options["read_timeout"], "retry_total": 0}

    def _configure_client(self, fs: Any, options: dict[str, Any]) -> None:
        """Turn off the SDK's retries (15 s+ backoff, ~85 s per refused call) and set transport
        timeouts on the client adlfs built, so adlfs's own calls fail fast into our loop.

        adlfs builds its ``BlobServiceClient`` itself and forwards neither retry settings nor
        transport timeouts to it, and the SDK has no public setter on a built client: so this
        adjusts the client's retry policy and transport config in place (private attributes,
        checked with ``getattr``; absent ones are logged and skipped).
        """
        sc = getattr(fs, "service_client", None)
        policy = getattr(getattr(sc, "_config", None), "retry_policy", None)
        if policy is not None:
            for attr in ("total_retries", "connect_retries", "read_retries", "status_retries"):
                if hasattr(policy, attr):
                    setattr(policy, attr, 0)
        else:  # pragma: no cover - depends on the SDK version
            logger.debug("azure client has no retry policy to tune; the deadline still applies")
        transport = getattr(getattr(sc, "_pipeline", None), "_transport", None)
        cc = getattr(transport, "connection_config", None)
        if cc is not None:
            cc.timeout = options["connection_timeout"]
            cc.read_timeout = options["read_timeout"]

    def run_sdk(self, coro_fn: Any, attempt: Attempt, *args: Any, **kw: Any) -> Any:
        """Run an async SDK call on adlfs's loop, cut off at the attempt's deadline."""
        from fsspec.asyn import sync
        return sync(self.fs.loop, coro_fn, *args, timeout=attempt.timeout, **kw, **self._request_kw)

    def _sink(self, path: str) -> Sink:
        return _AzureSink(self, path)

    def _probe(self, attempt: Attempt) -> None:
        container, key, _ = self.fs.split_path(self._root)
        cc = self.fs.service_client.get_container_client(container)
        request_kw = self._request_kw

        async def first_page() -> None:
            pages = cc.list_blobs(name_starts_with=f"{key}/" if key else None, results_per_page=1,
                                  **request_kw).by_page()
            async for page in pages:
                async for _ in page:
                    break
                break

        from fsspec.asyn import sync
        sync(self.fs.loop, first_page, timeout=attempt.timeout)

    def _close_client(self) -> None:
        from fsspec.asyn import sync
        sync(self.fs.loop, self.fs.service_client.close, timeout=5)
