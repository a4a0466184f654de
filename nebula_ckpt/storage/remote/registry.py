"""URL scheme -> backend class (imported lazily), and install hints for missing fsspec backends."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from nebula_ckpt.storage.base import Storage

_AZURE_HINT = "pip install 'nebula_ckpt[azure]'  (adlfs, azure-storage-blob)"
_S3_HINT = "pip install 'nebula_ckpt[s3]'  (s3fs)"
_GCS_HINT = "pip install gcsfs"

#: what to install when fsspec has no implementation for a scheme
INSTALL_HINTS = {
    "az": _AZURE_HINT, "abfs": _AZURE_HINT, "abfss": _AZURE_HINT, "adl": _AZURE_HINT,
    "s3": _S3_HINT, "s3a": _S3_HINT,
    "gs": _GCS_HINT, "gcs": _GCS_HINT,
}

#: schemes with a dedicated backend; every other scheme gets the generic fsspec backend
_BACKENDS = {
    "s3": ".s3:S3Storage", "s3a": ".s3:S3Storage",
    "az": ".azure:AzureBlobStorage", "abfs": ".azure:AzureBlobStorage",
    "abfss": ".azure:AzureBlobStorage",
}
_GENERIC = ".generic:GenericFsspecStorage"


def storage_class_for(url: str) -> "type[Storage]":
    """The backend class that serves ``url``, chosen by its scheme.

    ``FsspecStorage(url, ...)`` calls this itself; use it directly to subclass the right
    backend (e.g. a test double that fails at a named stage).

    Args:
        url: tier root, e.g. ``"s3://bucket/prefix"``.

    Returns:
        :class:`~.s3.S3Storage`, :class:`~.azure.AzureBlobStorage` or
        :class:`~.generic.GenericFsspecStorage`.

    Example::

        class Parking(storage_class_for(url)):
            ...
    """
    scheme = url.split("://", 1)[0].lower() if "://" in url else "file"
    module, _, name = _BACKENDS.get(scheme, _GENERIC).partition(":")
    return getattr(importlib.import_module(module, __package__), name)


def filesystem_class(protocol: str, display_url: str) -> Any:
    """The fsspec filesystem class for ``protocol``.

    Raises:
        ImportError: its implementation is not installed (the message says what to install).
        ValueError: fsspec knows no such scheme.
    """
    import fsspec
    try:
        return fsspec.get_filesystem_class(protocol)
    except ImportError:
        hint = INSTALL_HINTS.get(protocol, "install the fsspec implementation for this scheme")
        raise ImportError(f"remote tier {display_url}: the '{protocol}://' backend is not "
                          f"installed; {hint}") from None
    except ValueError as e:
        raise ValueError(f"remote tier {display_url}: unknown URL scheme '{protocol}://' ({e})") from None
