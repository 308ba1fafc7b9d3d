"""Object storage: the ``Storage`` protocol and ``make_storage`` (``base``), a local directory
(``local``) and S3 (``s3``), every object key (``keys``), shared stream adapters (``streams``)."""

from batchapi.storage.base import Storage, make_storage, remove_partial_writes

__all__ = ["Storage", "make_storage", "remove_partial_writes"]
