"""Object storage: every location that is not a local folder (``s3://``, ``gs://``, ``az://``, ``abfs://``).

One layer that data/, trainer/, the CLI and the service call; none of them parses a URI itself.

- :mod:`~pf_trl.storage.uri`: which strings are bucket URIs, and their parts.
- :mod:`~pf_trl.storage.credentials`: where the cloud's standard chain finds credentials (for messages).
- :mod:`~pf_trl.storage.filesystem`: one fsspec filesystem per process, bounded retries, one-line errors.
- :mod:`~pf_trl.storage.retries`: which errors are worth another try on each backend; botocore's retries logged.
- :mod:`~pf_trl.storage.cache`: the node-local cache (one download per node, a lock, a size bound) and staging.
- :mod:`~pf_trl.storage.space`: the node cache's hard size limit (every file counts, downloads reserve first).
- :mod:`~pf_trl.storage.committed`: a prefix committed in place by a marker written last (the final model), read back
  only when committed, each file checked.
- :mod:`~pf_trl.storage.datasets`: a directory committed by its manifest written last; read back through the cache.
- :mod:`~pf_trl.storage.readahead`: a committed directory's files downloaded into the cache in the background, in the
  order a reader needs them (training starts before the whole dataset is local).
- :mod:`~pf_trl.storage.checkpoints`: checkpoints uploaded from staging, committed by a marker, found again.

Light on purpose: nothing here imports fsspec, torch or transformers until a URI is used.
"""

from pf_trl.storage.errors import RemoteNotFound, StorageError
from pf_trl.storage.uri import RemoteURI, is_remote, parse_uri

__all__ = ["RemoteNotFound", "RemoteURI", "StorageError", "is_remote", "parse_uri"]
