"""Replays of what real inference engines do with a KV-cache directory (docs: CLIENTS.md).

Each test drives one engine's access pattern with the system calls that engine makes, then checks
every byte it wrote (a) right away, (b) after its chunks were demoted to the NVMe tier (checked
with `user.kvfs.where` before reading), and (c) after a clean remount. Some also crash the daemon
(SIGKILL: unsynced data must survive, DRAM is tmpfs) or "reboot" (SIGKILL and the DRAM tier lost:
fsynced data must survive). Block contents are slices of real KV tensors mixed with random bytes.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import glob
import hashlib
import json
import mmap
import os
import random
import secrets
import string
import struct
import tempfile
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

KV_NPY = Path(__file__).resolve().parents[2] / "shared/data/kv/smollm2_kv_bf16.npy"
ALIGN = 4096  # what O_DIRECT users align buffers, offsets and lengths to
FILL_FILE = 256 << 10


@pytest.fixture
def mount_factory(mount_factory):
    """The conftest factory, plus the tail of each daemon's log in the report of a failed test."""
    made = []

    def factory(*args, **kwargs):
        m = mount_factory(*args, **kwargs)
        made.append(m)
        return m

    yield factory
    for m in made:
        lines = m.log().splitlines()
        print(f"--- daemon log of {m.path} (last 60 of {len(lines)} lines) ---")
        print("\n".join(lines[-60:]))


# -- data --------------------------------------------------------------------------------------
@functools.cache
def kv_tensor() -> np.ndarray:
    """Real KV cache of SmolLM2: (layers, K/V, tokens, kv heads, head dim), bf16 bits as uint16."""
    if not KV_NPY.exists():
        pytest.skip(f"{KV_NPY} is missing")
    t = np.load(KV_NPY)
    assert t.ndim == 5 and t.shape[1] == 2 and t.dtype.itemsize == 2
    return t


def token_bytes() -> int:
    """Bytes of K and V of one token over all layers."""
    t = kv_tensor()
    return t[:, :, 0].nbytes


def tokens(t0: int, n: int) -> bytes:
    """K and V of tokens [t0, t0+n) over all layers, as an engine lays out one block."""
    t = kv_tensor()
    t0 %= t.shape[2] - n
    return t[:, :, t0 : t0 + n].tobytes()


def mixed(nbytes: int, rng: random.Random) -> bytes:
    """Tensor slices (one layer, K or V, a run of tokens), random bytes and a few zero runs."""
    t = kv_tensor()
    parts, have = [], 0
    while have < nbytes:
        r = rng.random()
        if r < 0.7:
            n = rng.randint(1, 48)
            t0 = rng.randrange(t.shape[2] - n)
            p = t[rng.randrange(t.shape[0]), rng.randrange(2), t0 : t0 + n].tobytes()
        elif r < 0.95:
            p = os.urandom(rng.randint(1 << 10, 48 << 10))
        else:
            p = bytes(rng.randint(1, 16) << 10)
        parts.append(p)
        have += len(p)
    return b"".join(parts)[:nbytes]


def round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def aligned(data: bytes) -> mmap.mmap:
    """A page-aligned buffer (anonymous mmap) holding *data*, as O_DIRECT writers use."""
    buf = mmap.mmap(-1, round_up(max(len(data), 1)))
    buf[: len(data)] = data
    return buf


def check(got, want: bytes, what: str) -> None:
    """Byte-for-byte equality; on failure say where the first difference is."""
    got = bytes(got)
    if got == want:
        return
    a, b = np.frombuffer(got, np.uint8), np.frombuffer(want, np.uint8)
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    first = int(diff[0]) if diff.size else n
    zeros = first < len(a) and not a[first : first + 4096].any()
    pytest.fail(
        f"{what}: read {len(got)} bytes, wrote {len(want)}; {diff.size} of the first "
        f"{n} differ, the first at byte {first} (64 KiB chunk {first >> 16})"
        + ("; the read returned zeros there" if zeros else "")
    )


def pmap(threads: int, fn, items) -> list:
    with ThreadPoolExecutor(threads) as ex:
        return list(ex.map(fn, items))


# -- tiers -------------------------------------------------------------------------------------
def not_on_nvme_only(m, rels) -> dict:
    """{file: [chunks that still have a DRAM copy, are not on NVMe, or are lost]}."""
    bad = {}
    for rel in rels:
        chunks = m.where(str(rel))
        assert chunks, f"{rel}: user.kvfs.where lists no chunks"
        wrong = [
            c["chunk"] for c in chunks if c["tiers"] != ["nvme"] or c.get("lost") or c.get("dirty")
        ]
        if wrong:
            bad[str(rel)] = wrong
    return bad


def demote(m, rels, rounds: int = 6) -> None:
    """Write more than DRAM holds until every chunk of *rels* lives on NVMe only; then delete the
    filler. DRAM is a segmented LRU that protects chunks read since they were written (the files
    under test were), so each filler file is read back at once to be reused data too."""
    cap = m.status()["tiers"]["dram"]["capacity_bytes"]
    fill = m.path / "_filler"
    fill.mkdir(exist_ok=True)
    prev: list[Path] = []
    bad = not_on_nvme_only(m, rels)
    for r in range(rounds):
        if not bad:
            break
        new = []
        for i in range(max(8, cap * 5 // 4 // FILL_FILE)):
            p = fill / f"r{r}-{i}.bin"
            p.write_bytes(os.urandom(FILL_FILE))
            p.read_bytes()  # a reuse while still in DRAM: the filler takes the protected part
            new.append(p)
        for p in prev:
            p.unlink()
        prev = new
        deadline = time.monotonic() + 3
        while (bad := not_on_nvme_only(m, rels)) and time.monotonic() < deadline:
            time.sleep(0.1)
    for p in prev:
        p.unlink()
    fill.rmdir()
    assert not bad, f"chunks not demoted to NVMe-only after {rounds} rounds of filler: {bad}"
    for rel in rels:
        assert m.tiers(str(rel)) == {"nvme"}, rel


def nvme_reads(m) -> int:
    s = m.status()
    return s["reads"]["chunks_from_nvme"] + s["moves"]["promotions"]


def wait_no_chunks(m, timeout: float = 10) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        tiers = m.status()["tiers"]
        if tiers["dram"]["chunks"] == tiers["nvme"]["chunks"] == 0:
            return tiers
        if time.monotonic() > deadline:
            return tiers
        time.sleep(0.05)


def remount(m) -> None:
    m.unmount()
    m.start()


def crash(m) -> None:
    """SIGKILL the daemon (the DRAM tier survives: it is tmpfs) and start it again."""
    m.kill()
    m.start()


def reboot(m) -> None:
    """SIGKILL the daemon, lose the DRAM tier, start again."""
    m.reboot()
    m.start()


# -- 1. LMCache local disk backend ---------------------------------------------------------------
def test_lmcache_local_disk(kv):
    """Flat dir of `<model>@<world>@<worker>@<hash>@<dtype>.pt`; `open(wb).write` or O_DIRECT when
    the size is a multiple of f_bsize; whole-file readinto or O_DIRECT reads; LRU os.remove;
    4 I/O threads."""
    m = kv
    root = m.path / "lmcache"
    root.mkdir()
    bsize = os.statvfs(root).f_bsize
    assert bsize > 0
    model = "meta-llama%2FLlama-3.1-8B-Instruct"
    rng = random.Random(1)
    blocks: dict[str, bytes] = {}
    for i in range(24):
        ntok = rng.choice([16, 24, 32, 13, 37])  # 13 and 37 tokens: not a multiple of f_bsize
        chunk_hash = rng.getrandbits(63) - (1 << 62)  # LMCache chunk hashes are signed ints
        name = f"{model}@1@0@{chunk_hash}@bf16.pt"
        n = ntok * token_bytes()
        blocks[name] = tokens(rng.randrange(1024), ntok) if i % 3 else mixed(n, rng)
    use_direct = {name: rng.random() < 0.6 for name in blocks}
    limit = 8 << 20
    lru: OrderedDict[str, int] = OrderedDict()
    lock = threading.Lock()
    evicted: list[str] = []
    direct_puts = []

    def put(name: str) -> None:
        data, path = blocks[name], root / name
        if len(data) % bsize == 0 and use_direct.get(name, True):
            buf = aligned(data)
            fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o644)
            try:
                assert os.write(fd, buf) == len(data)
            finally:
                os.close(fd)
            direct_puts.append(name)
        else:
            with open(path, "wb") as f:
                assert f.write(data) == len(data)
        with lock:
            lru[name] = len(data)
            while sum(lru.values()) > limit:
                old, _ = lru.popitem(last=False)
                os.remove(root / old)
                evicted.append(old)

    def get_readinto(name: str) -> None:
        want = blocks[name]
        buf = bytearray(len(want))
        with open(root / name, "rb") as f:
            assert f.readinto(buf) == len(want), name
            assert f.read(1) == b""
        check(buf, want, name)

    def get_direct(name: str) -> None:
        want = blocks[name]
        if len(want) % bsize:
            return
        buf = mmap.mmap(-1, len(want))
        fd = os.open(root / name, os.O_RDONLY | os.O_DIRECT)
        try:
            assert os.readv(fd, [buf]) == len(want), name
        finally:
            os.close(fd)
        check(buf, want, f"{name} (O_DIRECT)")

    def read_all(what: str) -> None:
        live = sorted(lru)
        assert sorted(os.listdir(root)) == live, what
        for name in evicted:
            assert not os.path.exists(root / name), name
        for name in live:
            assert os.stat(root / name).st_size == len(blocks[name])
        pmap(4, get_readinto, live)
        pmap(4, get_direct, live)

    pmap(4, put, list(blocks))
    assert evicted and direct_puts
    last = next(reversed(lru))
    assert "dram" in m.tiers(f"lmcache/{last}"), "new writes land in DRAM first"
    read_all("right away")

    early = [f"lmcache/{n}" for n in list(lru)[:6]]
    demote(m, early)
    before = nvme_reads(m)
    read_all("after demotion")
    assert nvme_reads(m) > before

    remount(m)
    read_all("after remount")
    # keep going after the remount: more puts evict older blocks
    for i in range(4):
        name = f"{model}@1@0@{10_000 + i}@bf16.pt"
        blocks[name] = mixed(32 * token_bytes(), rng)
    pmap(4, put, [n for n in blocks if n not in lru and n not in evicted])
    read_all("after more puts and evictions")


# -- 2. LMCache fs:// connector ------------------------------------------------------------------
def test_lmcache_fs_connector(kv):
    """`<key>.data.tmp` then os.replace to `<key>.data`; glob("*.data"); statvfs before puts."""
    m = kv
    root = m.path / "lmcache_fs"
    root.mkdir()
    rng = random.Random(2)
    st0 = os.statvfs(root)
    assert st0.f_frsize > 0 and 0 < st0.f_bavail <= st0.f_bfree <= st0.f_blocks
    keys = [f"vllm@Qwen%2FQwen3-8B@1@0@{rng.getrandbits(64):016x}" for _ in range(16)]
    values: dict[str, bytes] = {}

    def put(key: str, data: bytes) -> None:
        st = os.statvfs(root)
        assert st.f_bavail * st.f_frsize > len(data), "connector refuses puts when full"
        tmp, final = root / f"{key}.data.tmp", root / f"{key}.data"
        if len(data) % st.f_bsize == 0 and key[-1] in "02468ace":
            fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_DIRECT, 0o644)
            try:
                assert os.write(fd, aligned(data)) == len(data)
            finally:
                os.close(fd)
        else:
            with open(tmp, "wb") as f:
                f.write(data)
        os.replace(tmp, final)
        values[key] = data

    def get(key: str) -> bytes:
        with open(root / f"{key}.data", "rb") as f:
            return f.read()

    def read_all(what: str) -> None:
        listed = sorted(Path(p).name[: -len(".data")] for p in glob.glob(str(root / "*.data")))
        assert listed == sorted(values), what
        assert not glob.glob(str(root / "*.tmp")), what
        for key, want in values.items():
            check(get(key), want, f"{key} ({what})")
        assert not os.path.exists(root / "vllm@absent@1@0@0.data")

    for key in keys:
        ntok = rng.choice([8, 16, 20, 32])
        put(
            key,
            tokens(rng.randrange(1024), ntok)
            if rng.random() < 0.6
            else mixed(ntok * token_bytes(), rng),
        )
    # the same keys stored again (a recomputed prefix): os.replace over an existing .data
    for key in keys[:4]:
        put(key, mixed(rng.randint(100_000, 600_000), rng))
    written = sum(len(v) for v in values.values())
    st1 = os.statvfs(root)
    assert st1.f_bavail < st0.f_bavail, "statvfs must see the stored data"
    assert (st0.f_bavail - st1.f_bavail) * st1.f_frsize <= 2 * written
    read_all("right away")

    demote(m, [f"lmcache_fs/{k}.data" for k in keys[4:10]])
    before = nvme_reads(m)
    read_all("after demotion")
    assert nvme_reads(m) > before

    remount(m)
    read_all("after remount")


# -- 3. SGLang HiCache file backend --------------------------------------------------------------
def test_sglang_hicache_file(kv):
    """numpy tofile to `.<uuid>.tmp`, os.replace to `<sha256>_<model>_<rank>_<size>.bin`;
    exists() probes (mostly negative); unbuffered readinto; startup LRU evictor."""
    m = kv
    root = m.path / "hicache"
    os.makedirs(root)
    t = kv_tensor()
    model, tp_size, page = "Llama-3.1-8B-Instruct", 2, 32
    rng = random.Random(3)
    hd = t.shape[4] // tp_size
    pages = []  # (hash, t0) of a prefix chain
    prev = ""
    for i in range(14):
        ids = [rng.randrange(128_000) for _ in range(page)]
        prev = hashlib.sha256((prev + ",".join(map(str, ids))).encode()).hexdigest()
        pages.append((prev, (i * page) % (t.shape[2] - page)))
    arrays: dict[str, np.ndarray] = {}
    for h, t0 in pages:
        for rank in range(tp_size):
            a = np.ascontiguousarray(t[:, :, t0 : t0 + page, :, rank * hd : (rank + 1) * hd])
            if rank and t0 % 64:
                a = a ^ np.frombuffer(os.urandom(a.nbytes), np.uint16).reshape(a.shape)
            arrays[f"{h}_{model}_{rank}_{tp_size}.bin"] = a
    absent = [
        f"{secrets.token_hex(32)}_{model}_{r}_{tp_size}.bin" for r in range(2) for _ in range(300)
    ]

    def rank_writer(rank: int) -> None:
        for name, a in arrays.items():
            if not name.endswith(f"_{rank}_{tp_size}.bin"):
                continue
            final = root / name
            assert not os.path.exists(final)  # the backend checks before storing
            tmp = root / f".{uuid.uuid4()}.tmp"
            a.tofile(str(tmp))
            os.replace(tmp, final)
            assert os.path.exists(final)  # the negative entry must not linger

    def load(name: str) -> None:
        want = arrays[name]
        buf = np.empty_like(want)
        with open(root / name, "rb", buffering=0) as f:
            n = f.readinto(memoryview(buf).cast("B"))
        assert n == want.nbytes, f"{name}: short read {n} of {want.nbytes}"
        check(buf.tobytes(), want.tobytes(), name)

    def read_all(what: str) -> None:
        names = sorted(os.listdir(root))
        assert names == sorted(arrays), what
        for name in absent:
            assert not os.path.exists(root / name), name
        for name in arrays:
            assert os.path.exists(root / name)
        pmap(tp_size, load, sorted(arrays))

    for name in absent[:100]:
        assert not os.path.exists(root / name)
    pmap(tp_size, rank_writer, range(tp_size))
    read_all("right away")

    first = [f"hicache/{h}_{model}_{r}_{tp_size}.bin" for h, _ in pages[:3] for r in (0, 1)]
    demote(m, first)
    before = nvme_reads(m)
    read_all("after demotion")
    assert nvme_reads(m) > before

    remount(m)
    read_all("after remount")
    # the evictor at startup: listdir + stat, statvfs, remove the oldest down to its budget
    entries = []
    for name in os.listdir(root):
        st = os.stat(root / name)
        assert st.st_size == arrays[name].nbytes
        entries.append((st.st_mtime_ns, name, st.st_size))
    free0 = os.statvfs(root).f_bavail
    used = sum(e[2] for e in entries)
    budget = used * 2 // 3
    for _, name, size in sorted(entries):
        if used <= budget:
            break
        os.remove(root / name)
        del arrays[name]
        used -= size
    assert os.statvfs(root).f_bavail > free0, "removing files must free space"
    read_all("after eviction")

    crash(m)
    read_all("after SIGKILL")


# -- 4. vLLM ExampleConnector (safetensors) ------------------------------------------------------
def _safetensors_write(path: Path, data: bytes) -> None:
    """What safetensors does: `.tmpXXXXXX` O_RDWR|O_CREAT|O_EXCL 0600, ftruncate, write, rename."""
    suffix = "".join(random.choices(string.ascii_letters + string.digits, k=6))
    tmp = path.parent / f".tmp{suffix}"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, len(data))
        assert os.write(fd, data) == len(data)
    finally:
        os.close(fd)
    os.rename(tmp, path)


def _safetensors_map_check(path: Path, want_bytes: bytes, want: np.ndarray) -> None:
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
        try:
            (hlen,) = struct.unpack_from("<Q", mm, 0)
            header = json.loads(mm[8 : 8 + hlen])
            begin, end = header["kv_cache"]["data_offsets"]
            arr = np.frombuffer(mm, np.uint16, (end - begin) // 2, 8 + hlen + begin)
            ok = np.array_equal(arr.reshape(header["kv_cache"]["shape"]), want)
            del arr
            check(mm[:], want_bytes, str(path))
            assert ok, f"{path}: tensor differs"
        finally:
            mm.close()
        # the second map is writable and private: changes stay in this process
        mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            mm[-64:] = b"\xff" * 64
            check(mm[:-64], want_bytes[:-64], f"{path} (writable private map)")
        finally:
            mm.close()
    with open(path, "rb") as f:
        check(f.read(), want_bytes, f"{path} after a private map was written")


def test_vllm_example_connector(kv):
    """`<root>/<prompt hash>/<layer>.safetensors`; makedirs; safetensors temp+rename writes;
    mmap(MAP_PRIVATE) reads, the second one PROT_READ|PROT_WRITE."""
    from safetensors.numpy import save

    m = kv
    storage = m.path / "vllm_example"
    t = kv_tensor()
    rng = random.Random(4)
    files: dict[str, tuple[bytes, np.ndarray]] = {}
    for ntok in (100, 150, 120):
        ids = [rng.randrange(128_000) for _ in range(ntok)]
        folder = storage / hashlib.md5(np.array(ids).tobytes()).hexdigest()
        os.makedirs(folder, exist_ok=True)
        t0 = rng.randrange(t.shape[2] - ntok)
        for layer in range(t.shape[0]):
            kvc = np.ascontiguousarray(t[layer, :, t0 : t0 + ntok])
            data = save({"kv_cache": kvc})
            path = folder / f"model.layers.{layer}.self_attn.attn.safetensors"
            _safetensors_write(path, data)
            files[str(path.relative_to(m.path))] = (data, kvc)

    def read_all(what: str) -> None:
        for rel, (data, kvc) in files.items():
            st = os.stat(m.path / rel)
            assert st.st_size == len(data) and st.st_mode & 0o777 == 0o600, (rel, what)
            _safetensors_map_check(m.path / rel, data, kvc)
        leftovers = glob.glob(str(storage / "*" / ".tmp*"))
        assert not leftovers, leftovers
        assert not os.path.exists(storage / ("0" * 32))  # a prompt never stored

    read_all("right away")
    rels = list(files)
    demote(m, rels[:30])
    before = nvme_reads(m)
    read_all("after demotion")
    assert nvme_reads(m) > before
    remount(m)
    read_all("after remount")


# -- 5. vLLM offloading fs tier ------------------------------------------------------------------
def test_vllm_offload_fs_tier(mount_factory):
    """Two-level fan-out; O_DIRECT probe; `<dest>_<rand>.tmp` O_CREAT|O_EXCL|O_WRONLY|O_TRUNC|
    O_DIRECT, one aligned write, os.replace; O_DIRECT reads with one readv; access() lookups;
    8 threads."""
    m = mount_factory(nvme_size="96M")
    rng = random.Random(5)
    base = m.path / "vllm_offload" / f"Llama-3.1-8B_{secrets.token_hex(4)}_r0"
    os.makedirs(base)
    probe = base / ".odirect_probe"
    fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        os.write(fd, aligned(bytes(ALIGN)))
        direct = True
    except OSError as exc:
        assert exc.errno == errno.EINVAL
        direct = False
    finally:
        os.close(fd)
        os.unlink(probe)
    assert direct, "kvfs must accept aligned O_DIRECT writes (vLLM falls back to buffered I/O)"
    block_tokens = 16
    size = block_tokens * token_bytes()
    assert size % ALIGN == 0
    blocks: dict[Path, bytes] = {}
    parent = ""
    for i in range(32):
        group = i % 2
        parent = hashlib.sha256(f"{parent}/{i}".encode()).hexdigest()
        h = parent
        dest = base / h[:3] / f"{h[3:5]}_g{group}" / f"{h}.bin"
        blocks[dest] = tokens(i * block_tokens, block_tokens) if group == 0 else mixed(size, rng)
    absent = [
        base / h[:3] / f"{h[3:5]}_g0" / f"{h}.bin"
        for h in (secrets.token_hex(32) for _ in range(200))
    ]

    def store(dest: Path) -> None:
        data = blocks[dest]
        os.makedirs(dest.parent, exist_ok=True)
        tmp = f"{dest}_{secrets.token_hex(4)}.tmp"
        flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_TRUNC | os.O_DIRECT
        fd = os.open(tmp, flags, 0o644)
        try:
            assert os.write(fd, aligned(data)) == len(data)
        finally:
            os.close(fd)
        os.replace(tmp, dest)

    def load(dest: Path) -> None:
        want = blocks[dest]
        bufs = [mmap.mmap(-1, len(want) // 2), mmap.mmap(-1, len(want) - len(want) // 2)]
        fd = os.open(dest, os.O_RDONLY | os.O_DIRECT)
        try:
            n = os.readv(fd, bufs)
        finally:
            os.close(fd)
        if n != len(want):
            os.unlink(dest)  # what vLLM does with a short read
            pytest.fail(f"{dest}: short read {n} of {len(want)}")
        check(bufs[0][:] + bufs[1][:], want, str(dest))

    def read_all(what: str) -> None:
        for dest in blocks:
            assert os.access(dest, os.F_OK), (dest, what)
        for dest in absent:
            assert not os.access(dest, os.F_OK), dest
        pmap(8, load, list(blocks))
        tmps = [p for p in glob.glob(str(base / "*" / "*" / "*")) if p.endswith(".tmp")]
        assert not tmps, tmps
        assert sum(len(f) for _, _, f in os.walk(base)) == len(blocks)

    for dest in absent[:50]:
        assert not os.access(dest, os.F_OK)
    pmap(8, store, list(blocks))
    read_all("right away")
    rels = [str(p.relative_to(m.path)) for p in blocks]
    demote(m, rels[:8])
    before = nvme_reads(m)
    read_all("after demotion")
    assert nvme_reads(m) > before
    remount(m)
    read_all("after remount")


# -- 6. llama.cpp slot save/restore --------------------------------------------------------------
def _llama_state(n_tok: int, rng: random.Random) -> list[bytes]:
    """The sequence of fwrite() calls of a slot save: header, tokens, per-layer K and V rows in
    32 KiB and 4 KiB pieces."""
    t = kv_tensor()
    t0 = rng.randrange(t.shape[2] - n_tok)
    writes = [
        struct.pack("<III", 0x67677371, 9, n_tok),
        np.array([rng.randrange(128_000) for _ in range(n_tok)], np.int32).tobytes(),
    ]
    for layer in range(t.shape[0]):
        for kv in range(2):
            rows = t[layer, kv, t0 : t0 + n_tok].tobytes()
            if (layer + kv) % 7 == 3:
                rows = mixed(len(rows), rng)
            writes.append(struct.pack("<iQ", 30, len(rows) // n_tok))
            pos = 0
            while pos < len(rows):
                step = (32 << 10) if len(rows) - pos >= (32 << 10) else 4096
                writes.append(rows[pos : pos + step])
                pos += step
    return writes


def test_llamacpp_slot_save_restore(kv):
    """stdio fopen("wb") with st_blksize buffering, 4 and 32 KiB writes; restore with fstat,
    seek to the end and back, sequential 4-32 KiB reads. Also a crash without fsync."""
    m = kv
    root = m.path / "slots"
    root.mkdir()
    rng = random.Random(6)
    slots: dict[str, bytes] = {}

    def save(name: str, n_tok: int) -> None:
        writes = _llama_state(n_tok, rng)
        fd = os.open(root / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
        bs = os.fstat(fd).st_blksize
        assert bs >= 512
        with os.fdopen(fd, "wb", buffering=bs) as f:
            for w in writes:
                assert f.write(w) == len(w)
        slots[name] = b"".join(writes)

    def restore(name: str, what: str) -> None:
        want = slots[name]
        with open(root / name, "rb") as f:
            assert os.fstat(f.fileno()).st_size == len(want)
            assert f.seek(0, os.SEEK_END) == len(want)
            f.seek(0)
            parts, pos = [], 0
            while True:
                p = f.read(random.choice([4096, 8192, 16384, 32768]))
                if not p:
                    break
                parts.append(p)
                pos += len(p)
        check(b"".join(parts), want, f"{name} ({what})")

    def restore_all(what: str) -> None:
        assert sorted(os.listdir(root)) == sorted(slots)
        for name in slots:
            restore(name, what)

    for i, n_tok in enumerate((150, 110, 170)):
        save(f"slot{i}.bin", n_tok)  # 2.5-3.9 MiB each: more than the 4 MiB DRAM tier together
    restore_all("right away")
    demote(m, ["slots/slot0.bin", "slots/slot1.bin"])
    before = nvme_reads(m)
    restore_all("after demotion")
    assert nvme_reads(m) > before
    remount(m)
    restore_all("after remount")
    save("slot0.bin", 90)  # overwrite in place: fopen("wb") truncates the old state
    save("slot3.bin", 100)
    crash(m)  # no fsync: the DRAM tier outlives the daemon
    restore_all("after SIGKILL")


def reserve(fd: int, size: int, *, posix: bool) -> str:
    """Reserve [0, size): fallocate(2) mode 0 as a C/C++/Rust engine calls it, or glibc's
    posix_fallocate (which emulates it with a 1-byte write per 4 KiB where the filesystem has no
    fallocate); on failure ftruncate, as the engines fall back. Returns what happened."""
    if posix:
        try:
            os.posix_fallocate(fd, 0, size)
            return "posix_fallocate"
        except OSError as exc:
            why = errno.errorcode[exc.errno]
    else:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
        if libc.fallocate(fd, 0, 0, size) == 0:
            return "fallocate(2)"
        why = errno.errorcode[ctypes.get_errno()]
    os.ftruncate(fd, size)
    return f"ftruncate ({'posix_fallocate' if posix else 'fallocate(2)'} failed with {why})"


# -- 7. NVIDIA Dynamo KVBM disk tier -------------------------------------------------------------
def test_dynamo_kvbm_disk_tier(kv):
    """mkostemp + unlink while open; fcntl(F_SETFL, O_DIRECT); fallocate (or ftruncate);
    pwrite/pread at block offsets; the space is freed on close, and after a crash."""
    m = kv
    rng = random.Random(7)
    block_tokens, nblocks = 16, 24
    bsz = block_tokens * token_bytes()
    size = bsz * nblocks
    fd, path = tempfile.mkstemp(prefix="kvbm-disk-", dir=m.path)
    fd_path = f"/proc/self/fd/{fd}"
    unreserved = ""
    try:
        os.unlink(path)
        assert not os.path.exists(path)
        assert os.listdir(m.path) == []
        fl = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, fl | os.O_DIRECT)
        assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
        free0 = os.statvfs(m.path).f_bavail
        alloc = reserve(fd, size, posix=True)
        print(f"dynamo: space reserved by {alloc}")
        assert os.fstat(fd).st_size == size, alloc
        if alloc == "posix_fallocate":
            # success promises that writes into the range cannot fail for lack of space
            sv, blocks = os.statvfs(m.path), os.fstat(fd).st_blocks * 512
            taken = (free0 - sv.f_bavail) * sv.f_frsize
            if blocks < size or taken < size:
                unreserved = (
                    f"posix_fallocate({size}) succeeded but reserved nothing: st_blocks*512 = "
                    f"{blocks}, f_bavail*f_frsize dropped by {taken}"
                )
        data = {
            i: tokens(i * block_tokens, block_tokens) if i % 4 else mixed(bsz, rng)
            for i in range(nblocks)
        }

        def put(i: int) -> None:
            assert os.pwrite(fd, aligned(data[i]), i * bsz) == bsz

        def get(i: int) -> None:
            buf = mmap.mmap(-1, bsz)
            assert os.preadv(fd, [buf], i * bsz) == bsz
            check(buf, data[i], f"block {i}")

        order = list(range(nblocks))
        rng.shuffle(order)
        pmap(4, put, order)
        pmap(4, get, order)
        demote(m, [fd_path])
        before = nvme_reads(m)
        pmap(4, get, range(nblocks))
        assert nvme_reads(m) > before
        for i in (0, 5, nblocks - 1):  # KVBM reuses block slots
            data[i] = mixed(bsz, rng)
            put(i)
        pmap(4, get, range(nblocks))
        assert os.fstat(fd).st_size == size
        assert m.status()["files"] == 0
    finally:
        os.close(fd)
    tiers = wait_no_chunks(m)
    assert tiers["dram"]["chunks"] == tiers["nvme"]["chunks"] == 0, (
        f"the unlinked file's chunks outlive its last close: {tiers}"
    )
    remount(m)
    assert os.listdir(m.path) == []
    assert m.status()["files"] == 0

    # the engine crashes (here: the daemon) while its unlinked cache file is open
    fd, path = tempfile.mkstemp(prefix="kvbm-disk-", dir=m.path)
    os.unlink(path)
    os.ftruncate(fd, size)
    for i in range(0, nblocks, 3):
        os.pwrite(fd, tokens(i, block_tokens), i * bsz)
    crash(m)
    with contextlib.suppress(OSError):
        os.close(fd)
    assert os.listdir(m.path) == []
    assert m.status()["files"] == 0
    tiers = wait_no_chunks(m)
    assert tiers["dram"]["chunks"] == tiers["nvme"]["chunks"] == 0, (
        f"an orphan (unlinked while open at the crash) keeps its space after restart: {tiers}"
    )
    assert not unreserved, unreserved


# -- 8. SGLang 3FS-style backend -----------------------------------------------------------------
def test_sglang_3fs_sparse_file(kv):
    """One 1 TiB sparse file; concurrent pwrite and pread at page offsets from 16 threads."""
    m = kv
    rng = random.Random(8)
    tib = 1 << 40
    page = 16 * token_bytes()  # not a multiple of the chunk size: pages share chunks
    npages = tib // page
    run = rng.randrange(npages - 16)
    idx = list(range(run, run + 8))  # neighbours: concurrent writes into shared chunks
    while len(idx) < 32:
        i = rng.randrange(npages)
        if all(abs(i - j) > 2 for j in idx):
            idx.append(i)
    data = {i: tokens(i, 16) if i % 3 else mixed(page, rng) for i in idx}
    holes = [run - 1, run + 8] + [i + 2 for i in idx[8:12]]
    rel = "3fs/rank0.bin"
    os.makedirs(m.path / "3fs")
    path = m.path / rel
    written = page * len(idx)

    def open_file() -> int:
        return os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o644)

    def read_all(fd: int, what: str) -> None:
        assert os.fstat(fd).st_size == tib

        def get(i: int) -> None:
            check(os.pread(fd, page, i * page), data[i], f"page {i} ({what})")

        pmap(16, get, idx)
        for i in holes:
            check(os.pread(fd, page, i * page), bytes(page), f"hole page {i} ({what})")
        blocks = os.fstat(fd).st_blocks * 512
        assert written // 4 <= blocks <= written + len(idx) * 2 * (64 << 10), (blocks, what)

    fd = open_file()
    try:
        os.ftruncate(fd, tib)
        assert os.fstat(fd).st_blocks * 512 < 1 << 20

        def put(i: int) -> None:
            assert os.pwrite(fd, data[i], i * page) == page

        order = idx[:]
        rng.shuffle(order)
        pmap(16, put, order)
        read_all(fd, "right away")
    finally:
        os.close(fd)
    demote(m, [rel])
    before = nvme_reads(m)
    fd = open_file()
    try:
        read_all(fd, "after demotion")
    finally:
        os.close(fd)
    assert nvme_reads(m) > before
    remount(m)
    fd = open_file()
    try:
        read_all(fd, "after remount")
    finally:
        os.close(fd)


# -- 9. Mooncake Store SSD offload ---------------------------------------------------------------
def _du(root: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(root):
        for n in names:
            total += os.lstat(os.path.join(dirpath, n)).st_blocks * 512
    return total


def fsync_dir(path: Path) -> None:
    dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def test_mooncake_ssd_offload(kv):
    """A fallocated data file written with pwritev and read with preadv; bucket files + .meta;
    a checkpoint written tmp + fsync + rename + dir fsync; evictions unlink; reboot (DRAM lost)
    keeps everything that was fsynced; the st_blocks walk agrees with what was written."""
    m = kv
    rng = random.Random(9)
    t = kv_tensor()
    root = m.path / "mooncake"
    os.makedirs(root / "buckets")
    data_path = root / "kv_data.bin"
    data_size = 6 << 20
    st = os.statvfs(root)
    assert st.f_bavail * st.f_frsize > data_size
    fd = os.open(data_path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o644)
    alloc = reserve(fd, data_size, posix=False)
    print(f"mooncake: data file reserved by {alloc}")
    # objects: K and V of a run of tokens over all layers, at 4 KiB-aligned offsets
    objects: dict[str, tuple[int, bytes, bytes]] = {}
    off = 0
    while True:
        n = rng.randint(8, 24)
        t0 = rng.randrange(t.shape[2] - n)
        k = t[:, 0, t0 : t0 + n].tobytes()
        v = t[:, 1, t0 : t0 + n].tobytes() if rng.random() < 0.7 else mixed(len(k), rng)
        if off + len(k) + len(v) > data_size:
            break
        objects[f"key-{secrets.token_hex(8)}"] = (off, k, v)
        off = round_up(off + len(k) + len(v))
    for _key, (o, k, v) in objects.items():
        assert os.pwritev(fd, [k, v], o) == len(k) + len(v)
    buckets: dict[str, bytes] = {}
    for b in range(3):
        parts = [mixed(rng.randint(60_000, 200_000), rng) for _ in range(5)]
        bpath = root / "buckets" / f"bucket-{b:04d}.bucket"
        bfd = os.open(bpath, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        try:
            assert os.pwritev(bfd, parts, 0) == sum(map(len, parts))
            os.fsync(bfd)
        finally:
            os.close(bfd)
        meta = json.dumps({"sizes": [len(p) for p in parts]}).encode()
        with open(root / "buckets" / f"bucket-{b:04d}.meta", "wb") as f:
            f.write(meta)
            f.flush()
            os.fsync(f.fileno())
        buckets[bpath.name] = b"".join(parts)
        buckets[f"bucket-{b:04d}.meta"] = meta

    fsync_dir(root / "buckets")

    def read_objects(dfd: int, what: str) -> None:
        for key, (o, k, v) in objects.items():
            kb, vb = bytearray(len(k)), bytearray(len(v))
            assert os.preadv(dfd, [kb, vb], o) == len(k) + len(v), (key, what)
            check(kb, k, f"{key} K ({what})")
            check(vb, v, f"{key} V ({what})")

    def ckpt_bytes() -> bytes:
        return json.dumps(
            {
                key: [o, len(k), len(v), hashlib.sha256(k + v).hexdigest()]
                for key, (o, k, v) in objects.items()
            },
            sort_keys=True,
        ).encode()

    def write_checkpoint() -> None:
        tmp = root / "checkpoint.json.tmp"
        cfd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        try:
            assert os.write(cfd, ckpt_bytes()) == len(ckpt_bytes())
            os.fsync(cfd)
        finally:
            os.close(cfd)
        os.rename(tmp, root / "checkpoint.json")
        fsync_dir(root)

    def written() -> int:
        return (
            sum(len(k) + len(v) for _, k, v in objects.values())
            + sum(map(len, buckets.values()))
            + len(ckpt_bytes())
        )

    def check_all(what: str) -> None:
        assert sorted(os.listdir(root)) == ["buckets", "checkpoint.json", "kv_data.bin"], what
        check((root / "checkpoint.json").read_bytes(), ckpt_bytes(), f"checkpoint ({what})")
        assert sorted(os.listdir(root / "buckets")) == sorted(buckets), what
        for name, want in buckets.items():
            check((root / "buckets" / name).read_bytes(), want, f"{name} ({what})")
        dfd = os.open(data_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            assert os.fstat(dfd).st_size == data_size, what
            read_objects(dfd, what)
        finally:
            os.close(dfd)
        # Mooncake sums st_blocks*512 over its tree to account its usage
        du = _du(root)
        nfiles = 2 + len(buckets)
        upper = round_up(data_size, 64 << 10) + sum(
            round_up(len(b), 64 << 10) for b in buckets.values()
        )
        upper += (data_size // (64 << 10) + nfiles) * 4096 + (64 << 10)
        assert written() // 4 <= du <= upper, (du, written(), upper, what)
        sv = os.statvfs(m.path)
        df_used = (sv.f_blocks - sv.f_bfree) * sv.f_frsize
        assert abs(df_used - du) <= (1 << 20) + du // 50, (
            f"st_blocks walk says {du} bytes, statvfs says {df_used} used ({what})"
        )

    try:
        read_objects(fd, "right away")
        os.fsync(fd)
    finally:
        os.close(fd)
    write_checkpoint()
    assert m.tiers("mooncake/kv_data.bin") >= {"nvme"}
    assert all("nvme" in c["tiers"] for c in m.where("mooncake/kv_data.bin"))
    check_all("right away")

    demote(
        m,
        ["mooncake/kv_data.bin", "mooncake/checkpoint.json", "mooncake/buckets/bucket-0000.bucket"],
    )
    before = nvme_reads(m)
    check_all("after demotion")
    assert nvme_reads(m) > before

    remount(m)
    check_all("after remount")

    # eviction of one bucket: unlink data and meta, fsync the directory; update some objects
    for name in ("bucket-0001.bucket", "bucket-0001.meta"):
        os.unlink(root / "buckets" / name)
        del buckets[name]
    fsync_dir(root / "buckets")
    fd = os.open(data_path, os.O_RDWR | os.O_CLOEXEC)
    try:
        for key in list(objects)[:3]:
            o, k, v = objects[key]
            objects[key] = (o, mixed(len(k), rng), v)
            assert os.pwritev(fd, [objects[key][1], v], o) == len(k) + len(v)
        os.fsync(fd)
    finally:
        os.close(fd)
    write_checkpoint()
    check_all("before reboot")
    reboot(m)
    check_all("after reboot (DRAM lost)")
