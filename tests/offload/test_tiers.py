import ast
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve import offload
from kvserve.offload import CpuTier, DiskTier, Tier
from kvserve.offload.disk_tier import encode_header

FP = hashlib.sha256(b"model A").digest()
OTHER_FP = hashlib.sha256(b"model B").digest()
KEYS = [bytes([0]) + hashlib.sha256(bytes([i])).digest()[:16] for i in range(8)]


def payload_for(key: bytes, size: int | None = None) -> bytes:
    """Payload derived from the key, so any reader can check what it got."""
    if size is None:
        size = 50 + key[-1] % 200
    return (hashlib.sha256(key).digest() * (size // 32 + 1))[:size]


def file_size(key: bytes, payload: bytes) -> int:
    return len(encode_header(FP, key, payload)) + len(payload)


class ReferenceLRU:
    """The model both tiers must match: a plain list, least recently used first."""

    def __init__(self, capacity: int, size_of) -> None:
        self.capacity = capacity
        self.size_of = size_of
        self.items: list[tuple[bytes, bytes]] = []

    def used(self) -> int:
        return sum(self.size_of(k, v) for k, v in self.items)

    def get(self, key: bytes) -> bytes | None:
        for i, (k, v) in enumerate(self.items):
            if k == key:
                self.items.append(self.items.pop(i))
                return v
        return None

    def put(self, key: bytes, payload: bytes) -> list[bytes]:
        if self.size_of(key, payload) > self.capacity:
            return []
        self.items = [(k, v) for k, v in self.items if k != key]
        evicted = []
        while self.used() + self.size_of(key, payload) > self.capacity:
            evicted.append(self.items.pop(0)[0])
        self.items.append((key, payload))
        return evicted


OPS = st.lists(
    st.tuples(st.sampled_from(["put", "get"]), st.integers(0, len(KEYS) - 1), st.integers(0, 400)),
    max_size=40,
)


def check_against_reference(tier: Tier, model: ReferenceLRU, ops) -> None:
    for op, index, size in ops:
        key = KEYS[index]
        if op == "put":
            payload = payload_for(key, size)
            assert tier.put(key, payload) == model.put(key, payload)
        else:
            assert tier.get(key) == model.get(key)
        assert tier.used_bytes == model.used() <= tier.capacity
        held = tier.keys()
        assert held == [k for k, _ in model.items]
        assert all(tier.contains(k) == (k in held) for k in KEYS)


# --- CPU tier ------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(1, 1000), ops=OPS)
def test_cpu_tier_is_an_lru_within_capacity(capacity, ops):
    tier = CpuTier(capacity)
    check_against_reference(tier, ReferenceLRU(capacity, lambda k, v: len(v)), ops)


def test_cpu_tier_basics():
    tier = CpuTier(100)
    assert isinstance(tier, Tier) and tier.medium == "CPU"
    assert tier.get(b"a") is None and not tier.contains(b"a")
    assert tier.put(b"a", b"x" * 60) == []
    assert tier.put(b"b", b"y" * 101) == []  # larger than the whole tier: not stored
    assert tier.keys() == [b"a"]
    assert tier.put(b"b", b"y" * 40) == []
    tier.get(b"a")  # b is now the least recently used
    assert tier.put(b"c", b"z" * 10) == [b"b"]
    assert tier.keys() == [b"a", b"c"] and tier.used_bytes == 70


def test_cpu_tier_copies_buffers():
    buf = bytearray(b"abcd")
    tier = CpuTier(100)
    tier.put(b"k", memoryview(buf))
    buf[:] = b"XXXX"
    assert tier.get(b"k") == b"abcd"


# --- disk tier: behaviour ------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(capacity=st.integers(1, 1500), ops=OPS)
def test_disk_tier_is_an_lru_within_capacity(capacity, ops):
    with tempfile.TemporaryDirectory() as path:
        tier = DiskTier(path, capacity, FP, rescan_interval=0)  # rescans must not disturb
        check_against_reference(tier, ReferenceLRU(capacity, file_size), ops)
        on_disk = sum(p.stat().st_size for p in Path(path).iterdir())
        assert on_disk == tier.used_bytes <= capacity
        # A restart sees the same blocks in the same LRU order.
        assert DiskTier(path, capacity, FP).keys() == tier.keys()


def test_disk_roundtrip(tmp_path):
    tier = DiskTier(tmp_path / "kv", 10_000, FP)
    assert isinstance(tier, Tier) and tier.medium == "STORAGE"
    key, payload = KEYS[0], payload_for(KEYS[0])
    assert not tier.contains(key) and tier.get(key) is None
    assert tier.put(key, payload) == []
    assert tier.contains(key) and tier.get(key) == payload
    name = FP[:8].hex() + "-" + key.hex() + ".kvb"
    assert os.listdir(tmp_path / "kv") == [name]
    assert tier.used_bytes == (tmp_path / "kv" / name).stat().st_size == file_size(key, payload)
    assert tier.put(key, b"new") == []  # replace
    assert tier.get(key) == b"new" and tier.used_bytes == file_size(key, b"new")
    assert tier.put(KEYS[1], b"x" * 10_000) == []  # larger than the tier: not stored
    assert tier.keys() == [key]


def test_disk_accepts_any_buffer(tmp_path):
    tier = DiskTier(tmp_path, 10_000, FP)
    values = memoryview(bytearray(range(64))).cast("I")  # 16 items of 4 bytes
    tier.put(KEYS[0], values)
    assert tier.get(KEYS[0]) == bytes(range(64))
    assert tier.used_bytes == file_size(KEYS[0], bytes(64))


def test_disk_lru_order_survives_restart(tmp_path):
    size = file_size(KEYS[0], payload_for(KEYS[0], 100))
    tier = DiskTier(tmp_path, 3 * size, FP)
    for key in KEYS[:3]:
        tier.put(key, payload_for(key, 100))
    assert tier.get(KEYS[0]) is not None  # order now 1, 2, 0
    tier = DiskTier(tmp_path, 3 * size, FP)  # restart
    assert tier.keys() == [KEYS[1], KEYS[2], KEYS[0]]
    assert tier.used_bytes == 3 * size
    assert tier.put(KEYS[3], payload_for(KEYS[3], 100)) == [KEYS[1]]
    assert DiskTier(tmp_path, 3 * size, FP).keys() == [KEYS[2], KEYS[0], KEYS[3]]
    assert not tier.contains(KEYS[1])


def test_other_fingerprints_are_left_alone(tmp_path):
    other = DiskTier(tmp_path, 10_000, OTHER_FP)
    other.put(KEYS[0], b"other model")
    tier = DiskTier(tmp_path, file_size(KEYS[0], b"x" * 100), FP)
    assert tier.keys() == [] and tier.used_bytes == 0 and not tier.contains(KEYS[0])
    tier.put(KEYS[1], b"x" * 100)
    assert tier.put(KEYS[2], b"y" * 100) == [KEYS[1]]
    assert other.get(KEYS[0]) == b"other model"
    assert len(os.listdir(tmp_path)) == 2


def test_stale_tmp_files_are_removed_at_start(tmp_path):
    name = FP[:8].hex() + "-" + KEYS[0].hex() + ".kvb"
    stale = tmp_path / f"{name}.123-abcd.tmp"
    fresh = tmp_path / f"{name}.456-ef01.tmp"
    unrelated = tmp_path / "notes.tmp"
    for p in (stale, fresh, unrelated):
        p.write_bytes(b"partial")
    old = time.time() - 120
    os.utime(stale, (old, old))
    os.utime(unrelated, (old, old))
    tier = DiskTier(tmp_path, 10_000, FP)
    assert not stale.exists() and fresh.exists() and unrelated.exists()
    assert tier.keys() == [] and tier.used_bytes == 0


def test_keys_must_fit_a_file_name(tmp_path):
    tier = DiskTier(tmp_path, 10_000, FP)
    for key in (b"", bytes(101)):
        with pytest.raises(ValueError, match="key must be"):
            tier.put(key, b"x")
    assert tier.put(bytes(100), b"x") == [] and tier.get(bytes(100)) == b"x"
    with pytest.raises(ValueError, match="fingerprint"):
        DiskTier(tmp_path, 10, b"short")


# --- disk tier: bad files are misses -------------------------------------------------------


def _block_file(tier: DiskTier, key: bytes) -> Path:
    return Path(tier.file_path(key))


def _truncate(tier, key, tmp_path):
    path = _block_file(tier, key)
    path.write_bytes(path.read_bytes()[:-7])


def _truncate_header(tier, key, tmp_path):
    path = _block_file(tier, key)
    path.write_bytes(path.read_bytes()[:20])


def _flip_payload_byte(tier, key, tmp_path):
    path = _block_file(tier, key)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))


def _append_byte(tier, key, tmp_path):
    with open(_block_file(tier, key), "ab") as f:
        f.write(b"!")


def _bad_magic(tier, key, tmp_path):
    path = _block_file(tier, key)
    path.write_bytes(b"NOTABLOK" + path.read_bytes()[8:])


def _bad_version(tier, key, tmp_path):
    path = _block_file(tier, key)
    path.write_bytes(path.read_bytes()[:8] + b"\x63\x00" + path.read_bytes()[10:])


def _other_fingerprint(tier, key, tmp_path):
    other = DiskTier(tmp_path / "other", 10_000, OTHER_FP)
    other.put(key, payload_for(key))
    shutil.copyfile(other.file_path(key), _block_file(tier, key))


def _other_key(tier, key, tmp_path):
    tier.put(KEYS[5], payload_for(key))  # same payload, but written for another key
    shutil.copyfile(_block_file(tier, KEYS[5]), _block_file(tier, key))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_truncate, "truncated"),
        (_truncate_header, "truncated header"),
        (_flip_payload_byte, "checksum mismatch"),
        (_append_byte, "trailing bytes"),
        (_bad_magic, "bad magic"),
        (_bad_version, "format version 99"),
        (_other_fingerprint, "another fingerprint"),
        (_other_key, f"expected {KEYS[0].hex()}"),
    ],
)
def test_bad_file_is_a_miss_removed_and_logged(tmp_path, caplog, damage, reason):
    tier = DiskTier(tmp_path / "kv", 10_000, FP)
    key = KEYS[0]
    tier.put(key, payload_for(key))
    damage(tier, key, tmp_path)
    path = _block_file(tier, key)
    with caplog.at_level(logging.WARNING, logger="kvserve.offload.disk_tier"):
        assert tier.get(key) is None
    assert not path.exists()
    held = tier.keys()
    assert key not in held and not tier.contains(key)
    assert tier.used_bytes == sum(p.stat().st_size for p in (tmp_path / "kv").iterdir())
    [record] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert str(path) in record.getMessage() and reason in record.getMessage()
    # The key can be stored again and read back.
    tier.put(key, payload_for(key))
    assert tier.get(key) == payload_for(key)


def test_file_removed_by_another_process_is_a_miss(tmp_path, caplog):
    tier = DiskTier(tmp_path, 10_000, FP)
    tier.put(KEYS[0], b"data")
    os.unlink(tier.file_path(KEYS[0]))
    assert not tier.contains(KEYS[0])
    with caplog.at_level(logging.WARNING):
        assert tier.get(KEYS[0]) is None
    assert not caplog.records
    assert tier.keys() == [] and tier.used_bytes == 0


# --- disk tier: several writers ------------------------------------------------------------


def test_shared_directory_stays_within_one_budget(tmp_path):
    size = file_size(KEYS[0], bytes(100))
    a = DiskTier(tmp_path, 4 * size, FP, rescan_interval=0)
    b = DiskTier(tmp_path, 4 * size, FP, rescan_interval=0)
    for key in KEYS[:4]:
        a.put(key, bytes(100))
    assert b.get(KEYS[1]) == bytes(100)  # b reads a's block (and touches it)
    assert b.put(KEYS[4], bytes(100)) == [KEYS[0]]  # b's rescan counts a's files first
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) == 4 * size
    assert a.get(KEYS[0]) is None
    assert a.keys() == KEYS[1:4] and a.used_bytes == 3 * size  # a.get saw the file gone


def test_threads_put_while_others_get(tmp_path):
    tier = DiskTier(tmp_path, 40 * file_size(KEYS[0], payload_for(KEYS[0], 200)), FP)
    keys = [i.to_bytes(4, "big") for i in range(300)]
    errors = []

    def writer():
        for key in keys:
            tier.put(key, payload_for(key, 200))

    def reader():
        for key in keys * 2:
            got = tier.get(key)
            if got is not None and got != payload_for(key, 200):
                errors.append(key)

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert tier.used_bytes == sum(p.stat().st_size for p in tmp_path.iterdir()) <= tier.capacity


WORKER = """
import hashlib, sys
from kvserve.offload import DiskTier
path, who, capacity, interval = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
tier = DiskTier(path, capacity, hashlib.sha256(b"model A").digest(), rescan_interval=interval)
def payload(key):
    return (hashlib.sha256(key).digest() * 8)[: 50 + key[-1] % 200]
own = [b"own-" + who.encode() + i.to_bytes(2, "big") for i in range(200)]
shared = [b"shared" + i.to_bytes(2, "big") for i in range(200)]
for i, key in enumerate(own):
    for k in (key, shared[i], shared[-1 - i]):
        tier.put(k, payload(k))
        assert tier.used_bytes <= capacity
        got = tier.get(shared[(i * 7) % 200])
        assert got is None or got == payload(shared[(i * 7) % 200])
"""


def run_writers(path: Path, capacity: int, rescan_interval: float) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(path), who, str(capacity), str(rescan_interval)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for who in ("a", "b")
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err.decode()
        assert not err, err.decode()


def _payload(key: bytes) -> bytes:
    return (hashlib.sha256(key).digest() * 8)[: 50 + key[-1] % 200]


def test_two_processes_lose_nothing(tmp_path):
    run_writers(tmp_path, 1 << 30, rescan_interval=0.01)
    keys = [b"own-" + who + i.to_bytes(2, "big") for who in (b"a", b"b") for i in range(200)]
    keys += [b"shared" + i.to_bytes(2, "big") for i in range(200)]
    assert not list(tmp_path.glob("*.tmp"))
    tier = DiskTier(tmp_path, 1 << 30, FP)
    assert sorted(tier.keys()) == sorted(keys)
    for key in keys:
        assert tier.get(key) == _payload(key)


def test_two_processes_evicting_each_other(tmp_path, caplog):
    capacity = 30 * 300
    run_writers(tmp_path, capacity, rescan_interval=0)
    assert not list(tmp_path.glob("*.tmp"))
    with caplog.at_level(logging.WARNING):
        tier = DiskTier(tmp_path, capacity, FP)
        held = tier.keys()
        assert held
        for key in held:
            assert tier.get(key) == _payload(key)
    assert not caplog.records  # every file left behind is whole
    # Each process keeps the directory within its budget, give or take the block the other
    # one renamed in while it was evicting.
    assert tier.used_bytes <= capacity + 2 * 300


def test_tiers_never_import_torch():
    """The tiers are bytes in, bytes out: they must load where torch does not."""
    package = Path(offload.__file__).parent
    for name in ("__init__", "options", "tiers", "cpu_tier", "disk_tier"):
        source = (package / f"{name}.py").read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                assert all(not a.name.startswith("torch") for a in node.names), name
            elif isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("torch"), name
