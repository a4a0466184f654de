"""Internal: remote (object store) storage over fsspec: Azure Blob, S3, and any other fsspec URL.

``FsspecStorage(url, storage_options, compression=None)`` returns the backend for the URL's
scheme (:func:`storage_class_for`): :class:`S3Storage` (``s3://``), :class:`AzureBlobStorage`
(``az://``, ``abfs://``, ``abfss://``) or :class:`GenericFsspecStorage` (``memory://``,
``file://``, ``gs://``, ...); ``compression`` (``None`` or ``"zstd"``) is how its writes
encode, while reads decode by each object's recorded storage info. Blob stores have no atomic
rename, so shard data is written straight to its final (unique) name and the commit marker uses
a create-only write (``If-None-Match: *``).

The package, by concern:

* :mod:`.base`: the common logic of every backend (Storage API, read plan; ``fs`` and ``scrub``
  are what the backends build their own calls on);
* :mod:`.calls`: one request under the retry policy, failing with our scrubbed exception;
* :mod:`.paths`: relative paths checked, objects named in messages, listings normalised;
* :mod:`.s3`, :mod:`.azure`, :mod:`.generic`: one backend class per service;
* :mod:`.retry`: error classification and the retry loop with a deadline (knobs
  ``remote_retries``, ``remote_timeout_s``; the backoff delays are constants there);
* :mod:`.errors`: the exceptions, and the one function that turns a backend exception into ours;
* :mod:`.scrub`: what a credential looks like; every message and log line goes through it;
* :mod:`.upload`: upload streams, part sizing and the parallel multi-part pipeline;
* :mod:`.frames`: zstd framing and the validation of storage info before any allocation (the
  frame table by :func:`nebula_ckpt.storage.frame_table.frame_table`, as when a manifest is parsed).
"""

from nebula_ckpt.storage.remote.azure import AzureBlobStorage
from nebula_ckpt.storage.remote.base import FsspecStorage
from nebula_ckpt.storage.remote.errors import (
    CorruptRemoteDataError,
    RemoteAuthError,
    RemoteBackendError,
    RemoteContainerNotFoundError,
    RemoteStorageError,
    RemoteUnavailableError,
    StorageInfoError,
)
from nebula_ckpt.storage.remote.generic import GenericFsspecStorage
from nebula_ckpt.storage.remote.registry import storage_class_for
from nebula_ckpt.storage.remote.s3 import S3Storage

__all__ = [
    "FsspecStorage", "S3Storage", "AzureBlobStorage", "GenericFsspecStorage", "storage_class_for",
    "RemoteStorageError", "RemoteAuthError", "RemoteContainerNotFoundError",
    "RemoteUnavailableError", "RemoteBackendError", "CorruptRemoteDataError", "StorageInfoError",
]
