"""A store on object storage: ``--store s3://bucket/prefix``.

The store's layout is the same on S3 as on disk (``calls/*.parquet``, ``rollouts/…``, the migration
record), and a local folder mirrors it: writers keep their write-ahead log there (it never leaves the
machine) and upload each Parquet file once it is whole — one PUT, so a reader sees all of a file or
none of it; readers download the files they do not have yet (files never change once written, so a
name present locally is up to date) and query the mirror with DuckDB as usual.

Not mirrored: ``_wal/`` (each writer's own), ``_proxy/`` (the HMAC secret and the CA key: give
every proxy replica and the trainer the same ones, e.g. ``$LGT_PROXY_SECRET`` and a shared
``_proxy`` folder, rather than putting them in a bucket), temporary and lock files.

S3 settings come from the usual environment: ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_REGION`` (``AWS_DEFAULT_REGION``), and ``AWS_ENDPOINT_URL`` for S3-compatible servers (MinIO,
a local test server). The mirror is ``$LGT_STORE_CACHE/<bucket>/<prefix>`` (default
``~/.cache/lgt/stores``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from urllib.parse import urlsplit

from .files import atomic_path

log = logging.getLogger("lgt.store")

SKIPPED_DIRS = ("_wal", "_proxy")


def is_remote(spec: str | os.PathLike) -> bool:
    return str(spec).startswith("s3://")


class RemoteStore:
    """``s3://bucket/prefix`` and its local mirror (see the module docstring)."""

    def __init__(self, url: str, cache: str | os.PathLike | None = None) -> None:
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc:
            raise ValueError(f"{url!r} is not an s3://bucket/prefix store")
        self.url = url.rstrip("/")
        self.base = f"{parts.netloc}/{parts.path.strip('/')}".rstrip("/")
        root = Path(cache or os.environ.get("LGT_STORE_CACHE") or Path.home() / ".cache" / "lgt" / "stores")
        self.local = (root / self.base).resolve()
        self.local.mkdir(parents=True, exist_ok=True)
        self._fs = None

    @property
    def fs(self):  # noqa: ANN201 - pyarrow.fs.S3FileSystem
        if self._fs is None:
            from pyarrow import fs

            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            kw = {}
            if endpoint:
                u = urlsplit(endpoint)
                kw.update(endpoint_override=u.netloc, scheme=u.scheme or "https")
            region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
            if region:
                kw["region"] = region
            self._fs = fs.S3FileSystem(**kw)
        return self._fs

    def _listing(self) -> dict[str, int]:
        """Every file under the prefix: relative path -> size."""
        from pyarrow import fs

        try:
            infos = self.fs.get_file_info(fs.FileSelector(self.base, recursive=True, allow_not_found=True))
        except OSError as e:
            raise OSError(f"cannot list {self.url}: {e}") from None
        return {i.path[len(self.base) + 1:]: i.size for i in infos if i.type == fs.FileType.File}

    @staticmethod
    def _mirrored(rel: str) -> bool:
        first = rel.split("/", 1)[0]
        name = rel.rsplit("/", 1)[-1]
        return first not in SKIPPED_DIRS and not name.endswith((".tmp", ".lock")) and not name.startswith(".")

    def push(self, path: str | os.PathLike) -> None:
        """Upload one whole local file (a Parquet file just renamed in, the migration record)."""
        path = Path(path)
        rel = path.relative_to(self.local).as_posix()
        with open(path, "rb") as src, self.fs.open_output_stream(f"{self.base}/{rel}") as dst:
            while chunk := src.read(8 << 20):
                dst.write(chunk)

    def push_all(self) -> int:
        """Upload every local file the bucket lacks (or holds at another size); how many."""
        remote = self._listing()
        n = 0
        for path in sorted(p for p in self.local.rglob("*") if p.is_file()):
            rel = path.relative_to(self.local).as_posix()
            if self._mirrored(rel) and remote.get(rel) != path.stat().st_size:
                self.push(path)
                n += 1
        return n

    def pull(self) -> int:
        """Download every file of the bucket's store the mirror lacks; how many."""
        n = 0
        for rel in sorted(self._listing()):
            dest = self.local / rel
            if not self._mirrored(rel) or dest.exists():
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(dest) as tmp, self.fs.open_input_stream(f"{self.base}/{rel}") as src, \
                    open(tmp, "wb") as dst:
                while chunk := src.read(8 << 20):
                    dst.write(chunk)
            n += 1
        return n


def resolve(spec: str | os.PathLike) -> tuple[Path, RemoteStore | None]:
    """A ``--store`` value as the local folder to work in and, for ``s3://…``, the remote store."""
    if is_remote(spec):
        remote = RemoteStore(str(spec))
        return remote.local, remote
    return Path(spec), None
