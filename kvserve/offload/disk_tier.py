"""Disk tier: one file per KV block in a directory that several engines may share.

Each file is named `<first 8 fingerprint bytes, hex>-<key hex>.kvb`; its format (a
header with the model's fingerprint and a checksum, then the payload) is block_file.py's.

Semantics, and why:

- Atomic writes. A block is written to a temp file in the same directory
  (`<name>.<pid>-<random>.tmp`) and renamed into place with os.replace, so a reader in any
  process sees the whole old file, the whole new one, or none. Two processes writing the
  same directory lose nothing: for one key the last rename wins, and both wrote the same
  bytes. fsync is optional (off by default, for speed): after a power loss a torn file
  fails its checks and is a miss, which is all a cache needs.
- Bad files are misses. A file that is truncated, too long, has the wrong magic, version,
  fingerprint or key, or fails its checksum is removed and a warning names the file and the
  reason. get() never raises for a bad file; a file another process removes while we open
  it is a plain miss.
- LRU survives restarts. A file's mtime is its last use: put stamps it, get touches it, and
  a new DiskTier orders the files it finds by mtime. Stamps are set explicitly and strictly
  increase within a process, because the kernel's file clock is coarser than back-to-back
  operations (on a file system with coarse timestamps the restored order is approximate).
- Accounting. `used_bytes` is the sum of the file sizes (header included) of the files this
  tier accounts for: those with its fingerprint prefix. Files of other fingerprints (other
  models, dtypes, layouts) in the same directory are left alone and do not count against
  this budget. A block whose file would be larger than the whole budget is not stored.
- Several processes. Each process keeps its own accounting, which lags what the others
  write and delete. A put first catches up with the directory when its last look is older
  than `rescan_interval` seconds (a name listing, plus one stat per name that appeared or
  vanished), so evictions see the other processes' blocks and a shared directory stays
  within about one budget: the overshoot is what the others wrote since that look. Blocks
  another process wrote join this tier's LRU order by their mtime, as most recently used
  on arrival; touches by other processes reorder only at the next restart. Another process
  may delete a file this one counts: get() then misses and the key is forgotten without a
  put reporting it. contains() stats the file, so it also sees blocks other processes
  wrote; keys() lists what this tier accounts for.
- Only regular files are blocks. Anything else under a block's name (a FIFO, a device, a
  directory) is a miss, never opened for reading (opening a FIFO would block the engine
  thread until a writer came) and never counted; a warning names it once per path. The
  next put of that key replaces it where a rename can (not over a directory).
- Temp files older than a minute are crash leftovers and are removed at start.
- Failures. A path that is a file, or a directory that cannot be created or listed, is a
  ValueError at start that says so. A write that fails later (read-only or full disk)
  raises OSError from put: the TierStack counts it and logs each cause once. A directory
  removed while the engine runs is created again by the next write.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
import threading
import time
from collections import OrderedDict
from typing import BinaryIO

from kvserve.offload.block_file import (
    FINGERPRINT_BYTES,
    BadBlockFile,
    encode_header,
    file_size,
    read_block,
)
from kvserve.offload.disk_files import make_directory, open_regular, reason, unlink_quietly

logger = logging.getLogger(__name__)

MAX_KEY_BYTES = 100  # 200 hex digits: the name (and its temp name) stay under 255 bytes
STALE_TMP_SECONDS = 60.0
SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
MAX_WARNED_PATHS = 1024  # the warned-once memory stays bounded whatever the directory holds


class DiskTier:
    """KV blocks as files in `path`, evicted least recently used first (see module doc)."""

    medium = "STORAGE"
    __slots__ = (
        "_entries",
        "_last_scan",
        "_last_stamp",
        "_lock",
        "_prefix",
        "_used",
        "_warned",
        "capacity",
        "fingerprint",
        "fsync",
        "path",
        "rescan_interval",
    )

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity: int,
        fingerprint: bytes,
        *,
        fsync: bool = False,
        rescan_interval: float = 1.0,
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"disk tier capacity must be positive, got {capacity}")
        if len(fingerprint) != FINGERPRINT_BYTES:
            raise ValueError(
                f"fingerprint must be {FINGERPRINT_BYTES} bytes, got {len(fingerprint)}"
            )
        self.path = os.fspath(path)
        self.capacity = capacity
        self.fingerprint = bytes(fingerprint)
        self.fsync = fsync
        self.rescan_interval = rescan_interval
        self._prefix = self.fingerprint[:8].hex() + "-"
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, LRU first
        self._used = 0
        self._last_stamp = 0
        self._last_scan = 0.0
        self._warned: set[str] = set()  # paths of non-regular files already warned about
        make_directory(self.path)
        try:
            self._remove_stale_tmp()
            with self._lock:
                self._scan()
        except OSError as exc:
            raise ValueError(f"cannot list {self.path}: {reason(exc)}") from None

    @staticmethod
    def stored_size(key_bytes: int, payload_bytes: int) -> int:
        """A block's file size: header, key and payload."""
        return file_size(key_bytes, payload_bytes)

    @property
    def used_bytes(self) -> int:
        return self._used

    def file_path(self, key: bytes) -> str:
        """Where the block of `key` lives (whether or not it exists)."""
        if not 0 < len(key) <= MAX_KEY_BYTES:
            raise ValueError(f"key must be 1 to {MAX_KEY_BYTES} bytes, got {len(key)}")
        return os.path.join(self.path, self._prefix + key.hex() + SUFFIX)

    def contains(self, key: bytes) -> bool:
        return os.path.isfile(self.file_path(key))

    def get(self, key: bytes) -> bytes | None:
        path = self.file_path(key)
        try:
            f = open_regular(path)
            if f is None:
                self._not_a_file(path, key)
                return None
            with f:
                try:
                    payload = read_block(f, self.fingerprint, key)
                except BadBlockFile as bad:
                    self._discard(path, f, key, str(bad))
                    return None
        except FileNotFoundError:
            self._lost(path, key)
            return None
        except OSError as exc:
            logger.warning("KV block file %s unreadable: %s", path, exc)
            return None
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
            stamp = self._stamp()
            # Replaced or removed meanwhile? The payload we read is still valid.
            with contextlib.suppress(OSError):
                os.utime(path, ns=(stamp, stamp))
        return payload

    def put(self, key: bytes, payload: bytes) -> list[bytes]:
        final = self.file_path(key)
        data: bytes | memoryview = payload
        if type(payload) is not bytes:
            data = memoryview(payload).cast("B")  # len() in bytes, whatever the item type
        size = self.stored_size(len(key), len(data))
        if size > self.capacity:
            return []
        try:
            tmp = self._write_tmp(final, key, data)  # outside the lock: gets go on meanwhile
        except FileNotFoundError:  # the directory was removed: make it again, once
            os.makedirs(self.path, exist_ok=True)
            tmp = self._write_tmp(final, key, data)
        if time.monotonic() - self._last_scan >= self.rescan_interval:
            self._catch_up()  # other processes may have added or removed files
        with self._lock:
            evicted = self._make_room(key, size)
            stamp = self._stamp()
            try:
                os.utime(tmp, ns=(stamp, stamp))
                os.replace(tmp, final)
            except OSError:
                unlink_quietly(tmp)
                raise
            self._forget(key)
            self._entries[key] = size
            self._used += size
        return evicted

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._entries)

    # --- internals -------------------------------------------------------------------------

    def _not_a_file(self, path: str, key: bytes) -> None:
        """A non-regular file under the key's name: not a block (not counted), warned once."""
        with self._lock:
            self._forget(key)
        if path in self._warned or len(self._warned) >= MAX_WARNED_PATHS:
            return
        self._warned.add(path)
        logger.warning(
            "KV block path %s is not a regular file: a miss, left alone (warned once)", path
        )

    def _write_tmp(self, final: str, key: bytes, payload: bytes | memoryview) -> str:
        """The block written to a temp file beside `final`; OSError if it cannot be."""
        tmp = f"{final}.{os.getpid()}-{secrets.token_hex(4)}{TMP_SUFFIX}"
        try:
            with open(tmp, "xb") as f:
                f.write(encode_header(self.fingerprint, key, payload))
                f.write(payload)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
        except OSError:
            unlink_quietly(tmp)
            raise
        return tmp

    def _make_room(self, key: bytes, size: int) -> list[bytes]:
        """Evict LRU files until `size` more bytes fit (the key itself is being replaced)."""
        if self._used - self._entries.get(key, 0) + size <= self.capacity:
            return []
        evicted: list[bytes] = []
        while self._used - self._entries.get(key, 0) + size > self.capacity:
            victim = next(k for k in self._entries if k != key)
            self._forget(victim)
            try:
                os.unlink(self.file_path(victim))
            except FileNotFoundError:
                pass  # another process evicted it first
            except OSError as exc:
                logger.warning("could not remove KV block file for %s: %s", victim.hex(), exc)
            evicted.append(victim)
        return evicted

    def _scan(self) -> None:
        """Build the accounting from the directory: our prefix, oldest mtime first."""
        found: list[tuple[int, str, bytes, int]] = []
        with os.scandir(self.path) as entries:
            for entry in entries:
                key = self._key_of(entry.name)
                if key is None or not entry.is_file(follow_symlinks=True):
                    continue
                try:
                    st = entry.stat()
                except OSError:
                    continue  # removed meanwhile
                found.append((st.st_mtime_ns, entry.name, key, st.st_size))
        found.sort()
        self._entries = OrderedDict((key, size) for _, _, key, size in found)
        self._used = sum(self._entries.values())
        if found:  # new stamps must be newer than anything on disk
            self._last_stamp = max(self._last_stamp, found[-1][0])
        self._last_scan = time.monotonic()

    def _catch_up(self) -> None:
        """Count what other processes added, forget what they removed: cheap, names only.

        The listing runs outside the lock; a key that differs between it and the accounting
        is checked with a stat under the lock, so this thread's own puts and evictions made
        meanwhile are never undone.
        """
        try:
            listed = {key for key in map(self._key_of, os.listdir(self.path)) if key}
        except FileNotFoundError:  # removed: every file went with it; writes make it again
            listed = set()
        except OSError as exc:
            logger.warning("could not list KV block directory %s: %s", self.path, exc)
            return
        with self._lock:
            for key in [k for k in self._entries if k not in listed]:
                if not os.path.isfile(self.file_path(key)):
                    self._forget(key)
            arrived: list[tuple[int, bytes, int]] = []
            for key in listed.difference(self._entries):
                try:
                    st = os.stat(self.file_path(key))
                except OSError:
                    continue  # removed meanwhile
                if not stat.S_ISREG(st.st_mode):
                    continue
                arrived.append((st.st_mtime_ns, key, st.st_size))
            for mtime, key, size in sorted(arrived):
                self._entries[key] = size
                self._used += size
                self._last_stamp = max(self._last_stamp, mtime)
            self._last_scan = time.monotonic()

    def _key_of(self, name: str) -> bytes | None:
        if not (name.startswith(self._prefix) and name.endswith(SUFFIX)):
            return None
        text = name[len(self._prefix) : -len(SUFFIX)]
        try:
            key = bytes.fromhex(text)
        except ValueError:
            return None
        ok = 0 < len(key) <= MAX_KEY_BYTES and key.hex() == text
        return key if ok else None

    def _discard(self, path: str, f: BinaryIO, key: bytes, reason: str) -> None:
        """Remove a bad file, unless another writer has meanwhile replaced it."""
        logger.warning("KV block file %s dropped: %s", path, reason)
        with self._lock:
            try:
                same = os.path.samestat(os.fstat(f.fileno()), os.stat(path))
                if same:
                    os.unlink(path)
            except FileNotFoundError:
                same = True
            except OSError as exc:
                logger.warning("could not remove KV block file %s: %s", path, exc)
                return
            if same:
                self._forget(key)

    def _lost(self, path: str, key: bytes) -> None:
        """Forget a counted key whose file is gone (another process evicted it)."""
        with self._lock:
            if key in self._entries and not os.path.isfile(path):
                self._forget(key)

    def _forget(self, key: bytes) -> None:
        size = self._entries.pop(key, None)
        if size is not None:
            self._used -= size

    def _stamp(self) -> int:
        """A strictly increasing mtime: the LRU order that survives restarts."""
        self._last_stamp = max(time.time_ns(), self._last_stamp + 1)
        return self._last_stamp

    def _remove_stale_tmp(self) -> None:
        cutoff = time.time() - STALE_TMP_SECONDS
        with os.scandir(self.path) as entries:
            for entry in entries:
                if not (entry.name.endswith(TMP_SUFFIX) and SUFFIX + "." in entry.name):
                    continue
                try:
                    if entry.stat().st_mtime < cutoff:
                        os.unlink(entry.path)
                except OSError:
                    pass  # renamed or removed by its writer meanwhile
