"""Where a cache lives: a local folder (/dev/shm, NVMe, a shared file system) or an fsspec URL.

Everything the writer and the manifest need from storage goes through `Location`, so the commit
protocol (write under a temporary name, rename, replace the manifest atomically) is written once.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import uuid
from pathlib import Path

from dflash_offline.runtime.errors import UserError
from dflash_offline.runtime.faults import fault_point


def is_url(path: str) -> bool:
    return "://" in str(path) and not str(path).startswith("file://")


class Location:
    def __init__(self, root: str, option: str = "--cache"):
        """root: a folder or an fsspec URL; option: how messages name it (the flag, or the recipe
        key and file it came from)."""
        root = str(root)
        if root.startswith("file://"):
            root = root[len("file://"):]
        self.root = root
        self.remote = is_url(root)
        if self.remote:
            import fsspec

            protocol = root.split("://", 1)[0].split("::")[-1]
            # File-system-like backends need parent folders; object stores have none to make.
            self.storage_options = {"auto_mkdir": True} if protocol in ("local", "file") else {}
            if protocol == "memory":
                raise UserError(f"{option} {root}: memory:// lives inside one process and workers are separate "
                                "processes; use a path (e.g. /dev/shm/cache) instead")
            try:
                self.fs, self._base = fsspec.core.url_to_fs(root, **self.storage_options)
            except (ImportError, ValueError) as e:
                raise UserError(f"{option} {root}: fsspec cannot open this URL ({e}); install the backend "
                                f"for '{protocol}://' (e.g. pip install s3fs for s3://)") from None
        else:
            self.storage_options = {}
            self.fs, self._base = None, str(Path(root).absolute())

    # -- paths ------------------------------------------------------------------------------
    def path(self, rel: str = "") -> str:
        return f"{self._base.rstrip('/')}/{rel}" if rel else self._base

    def url(self, rel: str = "") -> str:
        """A string zarr/fsspec can open (protocol kept for remote locations)."""
        if not self.remote:
            return self.path(rel)
        return f"{self.root.rstrip('/')}/{rel}" if rel else self.root

    def zarr_kwargs(self) -> dict:
        """Extra arguments for zarr.open_group on this location."""
        return {"storage_options": self.storage_options} if self.remote and self.storage_options else {}

    # -- queries ----------------------------------------------------------------------------
    def exists(self, rel: str) -> bool:
        return self.fs.exists(self.path(rel)) if self.remote else os.path.exists(self.path(rel))

    def listdir(self, rel: str) -> list[str]:
        if not self.exists(rel):
            return []
        if self.remote:
            return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.path(rel), detail=False))
        return sorted(os.listdir(self.path(rel)))

    def read_text(self, rel: str) -> str | None:
        try:
            if self.remote:
                return self.fs.cat_file(self.path(rel)).decode()
            with open(self.path(rel), encoding="utf-8") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def du(self, rel: str) -> int:
        if self.remote:
            return int(self.fs.du(self.path(rel)))
        total = 0
        for dirpath, _, names in os.walk(self.path(rel)):
            for n in names:
                total += os.path.getsize(os.path.join(dirpath, n))
        return total

    def unwritable(self) -> str | None:
        """Why a local location cannot hold a cache (its nearest existing folder is a file, or not
        writable), else None. URLs say so only when written."""
        if self.remote:
            return None
        p = Path(self.path()).absolute()
        while not p.exists():
            p = p.parent
        if not p.is_dir():
            return f"{p} is not a folder"
        if not os.access(p, os.W_OK | os.X_OK):
            return f"{p} is not writable"
        return None

    def free_bytes(self) -> int | None:
        """Free space where the cache will grow, or None when storage cannot say (URLs)."""
        if self.remote:
            return None
        p = Path(self.path())
        while not p.exists():
            p = p.parent
        return shutil.disk_usage(p).free

    # -- mutations --------------------------------------------------------------------------
    def makedirs(self, rel: str) -> None:
        if self.remote:
            self.fs.makedirs(self.path(rel), exist_ok=True)
        else:
            os.makedirs(self.path(rel), exist_ok=True)

    def rmtree(self, rel: str) -> None:
        if self.remote:
            if self.fs.exists(self.path(rel)):
                self.fs.rm(self.path(rel), recursive=True)
        else:
            shutil.rmtree(self.path(rel), ignore_errors=True)

    def fsync_tree(self, rel: str) -> None:
        """Flush every file of a folder to storage before it is renamed into place and committed,
        so a power loss cannot leave a committed shard whose chunks never reached the disk."""
        if self.remote:
            return  # object stores acknowledge a PUT once it is stored
        for dirpath, _, names in os.walk(self.path(rel)):
            for n in names:
                fd = os.open(os.path.join(dirpath, n), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            fsync_dir(dirpath)

    def rename(self, src: str, dst: str) -> None:
        if self.remote:
            self.fs.mv(self.path(src), self.path(dst), recursive=True)
        else:
            os.rename(self.path(src), self.path(dst))
            fsync_dir(os.path.dirname(self.path(dst)))

    def write_json_atomic(self, rel: str, obj: dict) -> None:
        """Write `rel` so that readers see the old or the new content, never a mix."""
        data = (json.dumps(obj, separators=(",", ":")) + "\n").encode()
        if self.remote:
            # Object stores replace a whole object in one PUT (makedirs is a no-op there, and
            # needed for file-system-like backends).
            self.fs.makedirs(self.path(rel).rsplit("/", 1)[0], exist_ok=True)
            self.fs.pipe_file(self.path(rel), data)
            return
        final = self.path(rel)
        tmp = f"{final}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:  # e.g. ENOSPC: the old manifest stands, and the partial copy goes
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

        fault_point("manifest-tmp-written")
        os.replace(tmp, final)
        fsync_dir(os.path.dirname(final))

    def try_run_lock(self, rel: str = ".run.lock"):
        """Hold an exclusive lock for a whole run; None if another run holds it (local paths).

        The kernel drops it when the holder dies. Returns the open descriptor to keep alive. The
        file stays empty: a rerun leaves the cache's bytes as they were."""
        if self.remote:
            return -1

        self.makedirs("")
        fd = os.open(self.path(rel), os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    def run_lock_held(self, rel: str = ".run.lock") -> bool:
        """Whether a run holds the lock try_run_lock takes (local paths; a URL: False). Creates
        nothing: a reader asks without leaving a file behind."""
        if self.remote or not os.path.exists(self.path(rel)):
            return False
        fd = os.open(self.path(rel), os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # closing drops a lock taken here
        return False

    @contextlib.contextmanager
    def lock(self, rel: str = ".manifest.lock"):
        """Exclusive lock around read-modify-replace of the manifest.

        Local and shared file systems: `fcntl.flock`, which the kernel drops when the holder dies,
        so a SIGKILLed worker never leaves a stale lock. URLs: no portable lock exists; the caller
        runs one writer per URL (see `extract.launch`).
        """
        if self.remote:
            yield
            return

        self.makedirs("")
        fd = os.open(self.path(rel), os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def fsync_dir(path: str) -> None:
    # A rename is durable only once the directory entry is on storage (power loss, not SIGKILL).
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
