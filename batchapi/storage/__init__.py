"""Object storage: the ``Storage`` protocol and ``make_storage`` (``base``), a local directory
(``local``) and S3 (``s3``), every object key (``keys``), shared stream adapters (``streams``)."""

from batchapi.storage.base import Storage, discard, make_storage, remove_partial_writes

__all__ = ["Storage", "discard", "make_storage", "remove_partial_writes"]
