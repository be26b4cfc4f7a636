# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, auto_pickle=False
"""kvfs._index: compact in-memory index of every stored chunk.

``ChunkIndex`` maps a chunk key ``(ino, chunk)`` (two uint64) to the chunk's location, a
10-tuple ``(dram_slot, seg, off, rec_len, raw_len, stored_len, codec, flags, checksum, seq)``.
No Python object is kept per entry; tuples are built on the way out.

Layout (three malloc'd C arrays, "compact dict" style):

* ``keys[cap]``  -- ``Key {uint64 ino; uint64 chunk}``, 16 bytes, dense, insertion order.
* ``vals[cap]``  -- ``Val``, a packed 50-byte struct of the location fields, parallel to keys.
  Keys and values are split so that key compares and the per-inode scan of ``chunks_of``
  stream 16 bytes per entry instead of 66.
* ``slots[2**bits]`` -- the hash table: open addressing with linear probing, power-of-two size,
  load factor <= 0.75. A slot is 8 bytes ``{uint32 tag; uint32 pos}``: ``pos`` is the 1-based
  index into keys/vals (0 = empty slot, so a calloc'd table is empty) and ``tag`` is the top
  32 bits of the 64-bit key hash. The home slot is the top ``bits`` bits of the hash, i.e.
  ``tag >> (32 - bits)``, so resizing and backward-shift deletion never touch keys/vals, and
  most non-matching probes are rejected on the tag alone.

Hash: ``fmix64(chunk ^ fmix64(ino ^ SEED))`` (MurmurHash3 finalizer). fmix64 is a bijection,
so the chunks of one inode never collide in the full 64-bit hash, and the inode half is
computed once per ``chunks_of`` call.

Deletion is backward-shift (no tombstones); the dense arrays stay dense by moving the last
entry into the hole and repointing its slot. About 66 bytes of payload per entry plus
8 / load-factor bytes of table, plus dense-array growth slack (growth factor 1.25).

Single-threaded by design (the GIL is never released). Every mutation validates and converts
its input before touching the tables, and every read copies the C data before creating Python
objects, so neither bad input nor re-entrant calls (e.g. from a finalizer run by the GC) can
corrupt the index.
"""

cimport cython
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc, qsort, realloc
from libc.string cimport memset
from cpython.long cimport PyLong_Check
from cpython.number cimport PyNumber_Index

import operator

cdef extern from *:
    """
    #include <stdint.h>
    static inline uint64_t kvfs_fmix64(uint64_t k) {
        k ^= k >> 33;
        k *= 0xff51afd7ed558ccdULL;
        k ^= k >> 33;
        k *= 0xc4ceb9fe1a85ec53ULL;
        k ^= k >> 33;
        return k;
    }
    #if defined(__GNUC__) || defined(__clang__)
    #define kvfs_prefetch(p) __builtin_prefetch((p), 0, 1)
    #else
    #define kvfs_prefetch(p) ((void)(p))
    #endif
    static int kvfs_cmp_u64(const void *a, const void *b) {
        uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
        return (x > y) - (x < y);
    }
    """
    uint64_t kvfs_fmix64(uint64_t k) noexcept nogil
    void kvfs_prefetch(const void *p) noexcept nogil
    int kvfs_cmp_u64(const void *a, const void *b) noexcept nogil


ctypedef struct Slot:
    uint32_t tag   # top 32 bits of the key hash
    uint32_t pos   # 1-based index into keys/vals; 0 = empty

ctypedef struct Key:
    uint64_t ino
    uint64_t chunk

# Packed: the 8-byte fields come first so they stay aligned within the struct; the array
# stride is 50 bytes, and unaligned loads are cheap on the targets we run on.
ctypedef packed struct Val:
    int64_t dram_slot
    uint64_t off
    uint64_t checksum
    uint64_t seq
    uint32_t seg
    uint32_t rec_len
    uint32_t raw_len
    uint32_t stored_len
    uint8_t codec
    uint8_t flags


cdef enum:
    MIN_BITS = 4            # smallest table: 16 slots
    MAX_BITS = 32           # home = tag >> (32 - bits) needs bits <= 32
    MIN_CAP = 16
    PREFETCH_BATCH = 16
    # chunks_of cost model, in units of one key-array entry scanned (a 16-byte sequential,
    # bandwidth-bound read, ~0.5-0.8 ns): a probe for an absent chunk, batched and prefetched,
    # measured ~11 ns on small tables and ~30 ns on 10M entries (cache/TLB misses).
    PROBE_COST = 32

# 0.75 * 2**32, so the table never needs more than 2**32 slots and pos (uint32) still fits
cdef size_t MAX_ENTRIES = 3221225472
cdef uint64_t SEED = 0x9E3779B97F4A7C15

LOC_FIELDS = (
    "dram_slot", "seg", "off", "rec_len", "raw_len", "stored_len",
    "codec", "flags", "checksum", "seq",
)


cdef inline uint64_t _ino_hash(uint64_t ino) noexcept nogil:
    return kvfs_fmix64(ino ^ SEED)


cdef inline uint64_t _key_hash(uint64_t ih, uint64_t chunk) noexcept nogil:
    return kvfs_fmix64(chunk ^ ih)


cdef inline size_t _limit(uint32_t bits) noexcept nogil:
    # max entries before the table of 2**bits slots must grow (load factor 0.75)
    return ((<size_t>3) << bits) >> 2


cdef uint32_t _bits_for(size_t n) except 0:
    cdef uint32_t b = MIN_BITS
    if n > MAX_ENTRIES:
        raise ValueError(f"ChunkIndex holds at most {MAX_ENTRIES} entries")
    while _limit(b) < n:
        b += 1
    return b


cdef inline object _int(object o):
    # Strict integer: ints and __index__ types (numpy ints) pass, floats/str raise TypeError.
    # (Cython's own C-int conversion would silently truncate floats.)
    if PyLong_Check(o):
        return o
    return PyNumber_Index(o)


cdef inline uint64_t _u64(object o) except? 0xFFFFFFFFFFFFFFFF:
    return _int(o)


cdef int _parse_loc(object loc, Val *v) except -1:
    """Converts and range-checks a location tuple into *v (Cython raises OverflowError or
    TypeError per field); *v is only used by the caller if this returns 0."""
    cdef tuple t
    if not isinstance(loc, tuple):
        raise TypeError(f"loc must be a tuple, not {type(loc).__name__}")
    t = <tuple>loc
    if len(t) != 10:
        raise ValueError(f"loc must have 10 fields {LOC_FIELDS}, got {len(t)}")
    v.dram_slot = _int(t[0])
    v.seg = _int(t[1])
    v.off = _int(t[2])
    v.rec_len = _int(t[3])
    v.raw_len = _int(t[4])
    v.stored_len = _int(t[5])
    v.codec = _int(t[6])
    v.flags = _int(t[7])
    v.checksum = _int(t[8])
    v.seq = _int(t[9])
    return 0


cdef inline tuple _loc_tuple(Val v):
    return (v.dram_slot, v.seg, v.off, v.rec_len, v.raw_len, v.stored_len,
            v.codec, v.flags, v.checksum, v.seq)


cdef class _U64Buf:
    """Growable uint64 array owned by a Python object, so it is freed even if building the
    result list raises."""
    cdef uint64_t *data
    cdef size_t n
    cdef size_t cap

    def __dealloc__(self):
        free(self.data)

    cdef int push(self, uint64_t x) except -1:
        cdef size_t ncap
        cdef uint64_t *p
        if self.n == self.cap:
            ncap = self.cap * 2 if self.cap else 64
            p = <uint64_t *>realloc(self.data, ncap * sizeof(uint64_t))
            if p == NULL:
                raise MemoryError()
            self.data = p
            self.cap = ncap
        self.data[self.n] = x
        self.n += 1
        return 0

    cdef list to_list(self):
        cdef size_t i
        return [self.data[i] for i in range(self.n)]


@cython.final
cdef class ChunkIndex:
    """Hash index (ino, chunk) -> location 10-tuple, stored in packed C arrays.

    ``capacity`` is a hint for the expected number of entries; the index grows (and shrinks
    after mass deletion) automatically but never below the hint.
    """

    cdef Slot *slots
    cdef Key *keys
    cdef Val *vals
    cdef uint32_t bits      # table has 2**bits slots
    cdef uint32_t min_bits
    cdef size_t count
    cdef size_t cap         # allocated entries in keys/vals
    cdef size_t min_cap
    # Entries chunks_of has walked the whole key array past: what it costs where asking
    # for "every chunk of this inode" grows with the whole store (status shows it).
    cdef readonly unsigned long long scanned

    def __cinit__(self, capacity=1024):
        cdef Py_ssize_t hint = operator.index(capacity)
        if hint < 0:
            raise ValueError("capacity must be >= 0")
        self.min_bits = _bits_for(<size_t>hint)
        self.min_cap = <size_t>hint if <size_t>hint > MIN_CAP else MIN_CAP
        self.bits = self.min_bits
        self.cap = self.min_cap
        self.slots = <Slot *>calloc((<size_t>1) << self.bits, sizeof(Slot))
        self.keys = <Key *>malloc(self.cap * sizeof(Key))
        self.vals = <Val *>malloc(self.cap * sizeof(Val))
        if self.slots == NULL or self.keys == NULL or self.vals == NULL:
            raise MemoryError()  # __dealloc__ frees whatever was allocated

    def __dealloc__(self):
        free(self.slots)
        free(self.keys)
        free(self.vals)
        self.slots = NULL
        self.keys = NULL
        self.vals = NULL

    # ---- C core: no Python code runs while the tables are being changed ----

    cdef inline Py_ssize_t _find(self, uint64_t ino, uint64_t chunk, uint64_t h) noexcept:
        """Slot index holding the key, or -1."""
        cdef uint32_t tag = <uint32_t>(h >> 32)
        cdef size_t mask = ((<size_t>1) << self.bits) - 1
        cdef size_t i = tag >> (32 - self.bits)
        cdef Slot s
        cdef Key *k
        while True:
            s = self.slots[i]
            if s.pos == 0:
                return -1
            if s.tag == tag:
                k = &self.keys[s.pos - 1]
                if k.ino == ino and k.chunk == chunk:
                    return <Py_ssize_t>i
            i = (i + 1) & mask

    cdef bint _rehash(self, uint32_t new_bits) noexcept:
        """Rebuilds the slot table with 2**new_bits slots from the tags alone; returns False
        (leaving the index unchanged) if the allocation fails."""
        cdef size_t old_n = (<size_t>1) << self.bits
        cdef size_t new_mask = ((<size_t>1) << new_bits) - 1
        cdef uint32_t shift = 32 - new_bits
        cdef Slot *new = <Slot *>calloc(new_mask + 1, sizeof(Slot))
        cdef Slot *old = self.slots
        cdef size_t i, j
        if new == NULL:
            return False
        for i in range(old_n):
            if old[i].pos:
                j = old[i].tag >> shift
                while new[j].pos:
                    j = (j + 1) & new_mask
                new[j] = old[i]
        free(old)
        self.slots = new
        self.bits = new_bits
        return True

    cdef int _reserve_one(self) except -1:
        """Makes room for one more entry; raises MemoryError with the index unchanged."""
        cdef size_t ncap
        cdef Key *nk
        cdef Val *nv
        if self.count >= MAX_ENTRIES:
            raise MemoryError(f"ChunkIndex is full ({MAX_ENTRIES} entries)")
        if self.count + 1 > _limit(self.bits):
            if not self._rehash(self.bits + 1):
                raise MemoryError()
        if self.count == self.cap:
            # 1.25x: large reallocs are mremap()s, so a small factor costs little time and
            # keeps the slack (memory_bytes) low.
            ncap = self.cap + (self.cap >> 2) + 16
            if ncap > MAX_ENTRIES:
                ncap = MAX_ENTRIES
            nk = <Key *>realloc(self.keys, ncap * sizeof(Key))
            if nk == NULL:
                raise MemoryError()
            self.keys = nk  # a bigger keys array alone is harmless if vals fails below
            nv = <Val *>realloc(self.vals, ncap * sizeof(Val))
            if nv == NULL:
                raise MemoryError()
            self.vals = nv
            self.cap = ncap
        return 0

    cdef void _delete_slot(self, size_t i) noexcept:
        """Empties slot i, shifting later members of the probe run back (no tombstones)."""
        cdef size_t mask = ((<size_t>1) << self.bits) - 1
        cdef uint32_t shift = 32 - self.bits
        cdef size_t j = i
        cdef size_t home
        while True:
            j = (j + 1) & mask
            if self.slots[j].pos == 0:
                break
            home = self.slots[j].tag >> shift
            # the entry at j may move to i only if its home is not cyclically in (i, j]
            if (i <= j and i < home <= j) or (i > j and (home > i or home <= j)):
                continue
            self.slots[i] = self.slots[j]
            i = j
        self.slots[i].pos = 0
        self.slots[i].tag = 0

    cdef void _remove_at(self, size_t i) noexcept:
        """Removes the entry whose slot is i, keeping keys/vals dense."""
        cdef size_t p = self.slots[i].pos - 1
        cdef size_t last = self.count - 1
        cdef size_t mask, j
        cdef uint64_t h
        self._delete_slot(i)
        if p != last:
            # move the last entry into the hole and repoint the slot that references it
            h = _key_hash(_ino_hash(self.keys[last].ino), self.keys[last].chunk)
            mask = ((<size_t>1) << self.bits) - 1
            j = (<uint32_t>(h >> 32)) >> (32 - self.bits)
            while self.slots[j].pos != last + 1:
                j = (j + 1) & mask
            self.slots[j].pos = <uint32_t>(p + 1)
            self.keys[p] = self.keys[last]
            self.vals[p] = self.vals[last]
        self.count = last
        self._maybe_shrink()

    cdef void _maybe_shrink(self) noexcept:
        # Hysteresis: shrink only at 1/4 use so alternating set/pop never thrashes.
        cdef size_t ncap
        cdef Key *nk
        cdef Val *nv
        if self.bits > self.min_bits and self.count < _limit(self.bits) >> 2:
            self._rehash(self.bits - 1)  # failure just keeps the bigger table
        if self.cap > self.min_cap and self.count < self.cap >> 2:
            ncap = self.cap >> 1
            if ncap < self.min_cap:
                ncap = self.min_cap
            nk = <Key *>realloc(self.keys, ncap * sizeof(Key))
            nv = <Val *>realloc(self.vals, ncap * sizeof(Val))
            # A failed realloc leaves its (bigger) block intact, so after any success both
            # arrays hold at least ncap entries; cap must never exceed the smaller one.
            if nk != NULL:
                self.keys = nk
            if nv != NULL:
                self.vals = nv
            if nk != NULL or nv != NULL:
                self.cap = ncap

    cdef int _probe_range(self, uint64_t ino, uint64_t lim, _U64Buf out) except -1:
        """chunks_of by hashing every c < lim; batches of hashes are computed and their home
        slots prefetched first, so the cache misses overlap."""
        cdef uint64_t ih = _ino_hash(ino)
        cdef uint64_t hs[PREFETCH_BATCH]
        cdef uint64_t c = 0
        cdef uint64_t nb, b
        cdef uint32_t shift = 32 - self.bits
        while c < lim:
            nb = lim - c
            if nb > PREFETCH_BATCH:
                nb = PREFETCH_BATCH
            for b in range(nb):
                hs[b] = _key_hash(ih, c + b)
                kvfs_prefetch(&self.slots[(<uint32_t>(hs[b] >> 32)) >> shift])
            for b in range(nb):
                if self._find(ino, c + b, hs[b]) >= 0:
                    out.push(c + b)
            c += nb
        return 0

    cdef int _scan_range(self, uint64_t ino, uint64_t lim, bint unbounded,
                         _U64Buf out) except -1:
        """chunks_of by streaming the dense key array; result sorted afterwards."""
        cdef size_t i
        cdef Key *k = self.keys
        self.scanned += self.count
        for i in range(self.count):
            if k[i].ino == ino and (unbounded or k[i].chunk < lim):
                out.push(k[i].chunk)
        if out.n > 1:
            qsort(out.data, out.n, sizeof(uint64_t), kvfs_cmp_u64)
        return 0

    cdef int _chunks_into(self, uint64_t ino, object upto, int method, _U64Buf out) except -1:
        # method: 0 = cheaper by the cost model, 1 = probe, 2 = scan
        cdef object n = operator.index(upto)
        cdef uint64_t lim
        cdef bint unbounded = n > 0xFFFFFFFFFFFFFFFF
        if n <= 0 or self.count == 0:
            return 0
        lim = 0xFFFFFFFFFFFFFFFF if unbounded else <uint64_t>n
        if method == 0:
            # probing costs ~lim * PROBE_COST, scanning ~count (compare in float: no overflow)
            method = 1 if <double>lim * PROBE_COST <= <double>self.count else 2
        if method == 1 and not unbounded:
            self._probe_range(ino, lim, out)
        else:
            self._scan_range(ino, lim, unbounded, out)
        return 0

    # ---- public API ----

    def set(self, ino, chunk, loc) -> None:
        """Inserts or replaces the location of (ino, chunk)."""
        cdef uint64_t k_ino = _u64(ino)
        cdef uint64_t k_chunk = _u64(chunk)
        cdef Val v
        _parse_loc(loc, &v)  # may run arbitrary __index__ code: do it before touching tables
        self._set(k_ino, k_chunk, &v)

    cdef int _set(self, uint64_t ino, uint64_t chunk, const Val *v) except -1:
        cdef uint64_t h = _key_hash(_ino_hash(ino), chunk)
        cdef Py_ssize_t i
        cdef size_t p
        i = self._find(ino, chunk, h)
        if i >= 0:
            self.vals[self.slots[i].pos - 1] = v[0]
            return 0
        self._reserve_one()
        p = self.count
        self.keys[p].ino = ino
        self.keys[p].chunk = chunk
        self.vals[p] = v[0]
        self._place(h, <uint32_t>(p + 1))
        self.count = p + 1
        return 0

    cdef void _place(self, uint64_t h, uint32_t pos) noexcept:
        cdef size_t mask = ((<size_t>1) << self.bits) - 1
        cdef uint32_t tag = <uint32_t>(h >> 32)
        cdef size_t i = tag >> (32 - self.bits)
        while self.slots[i].pos:
            i = (i + 1) & mask
        self.slots[i].tag = tag
        self.slots[i].pos = pos

    def get(self, ino, chunk):
        """Location tuple of (ino, chunk), or None."""
        return self._get(_u64(ino), _u64(chunk))

    cdef object _get(self, uint64_t ino, uint64_t chunk):
        cdef Py_ssize_t i = self._find(ino, chunk, _key_hash(_ino_hash(ino), chunk))
        if i < 0:
            return None
        return _loc_tuple(self.vals[self.slots[i].pos - 1])

    def pop(self, ino, chunk):
        """Removes (ino, chunk); returns its old location tuple, or None if absent."""
        return self._pop(_u64(ino), _u64(chunk))

    cdef object _pop(self, uint64_t ino, uint64_t chunk):
        cdef Py_ssize_t i = self._find(ino, chunk, _key_hash(_ino_hash(ino), chunk))
        cdef Val v
        if i < 0:
            return None
        v = self.vals[self.slots[i].pos - 1]
        self._remove_at(<size_t>i)
        return _loc_tuple(v)

    def __len__(self) -> int:
        return self.count

    def __contains__(self, key) -> bool:
        """``(ino, chunk) in idx``; like get, a malformed key raises instead of being absent."""
        cdef uint64_t ino, chunk
        if not isinstance(key, tuple) or len(key) != 2:
            raise TypeError("ChunkIndex keys are (ino, chunk) tuples")
        ino = _u64(key[0])
        chunk = _u64(key[1])
        return self._find(ino, chunk, _key_hash(_ino_hash(ino), chunk)) >= 0

    def chunks_of(self, ino, upto) -> list:
        """Ascending chunk numbers c present for ino with 0 <= c < upto.

        Probes every c < upto or scans the key array for ino, whichever the cost model
        says is cheaper for this call.
        """
        cdef _U64Buf out = _U64Buf()
        self._chunks_into(_u64(ino), upto, 0, out)
        return out.to_list()

    def _chunks_of_probe(self, ino, upto) -> list:
        """chunks_of forced to the probing strategy (tests and benchmarks)."""
        cdef _U64Buf out = _U64Buf()
        self._chunks_into(_u64(ino), upto, 1, out)
        return out.to_list()

    def _chunks_of_scan(self, ino, upto) -> list:
        """chunks_of forced to the scanning strategy (tests and benchmarks)."""
        cdef _U64Buf out = _U64Buf()
        self._chunks_into(_u64(ino), upto, 2, out)
        return out.to_list()

    def items(self) -> list:
        """All entries as (ino, chunk, loc) tuples, in no particular order."""
        cdef list out = []
        cdef size_t i = 0
        cdef Key k
        cdef Val v
        # count and the arrays are re-read every step: building tuples can run the GC,
        # whose finalizers could mutate this index.
        while i < self.count:
            k = self.keys[i]
            v = self.vals[i]
            out.append((k.ino, k.chunk, _loc_tuple(v)))
            i += 1
        return out

    def clear(self) -> None:
        """Removes every entry and returns to the initial (hinted) allocation."""
        cdef Slot *ns = <Slot *>calloc((<size_t>1) << self.min_bits, sizeof(Slot))
        cdef Key *nk = <Key *>malloc(self.min_cap * sizeof(Key))
        cdef Val *nv = <Val *>malloc(self.min_cap * sizeof(Val))
        self.count = 0
        if ns == NULL or nk == NULL or nv == NULL:
            # cannot allocate the small tables: keep the big ones, emptied
            free(ns)
            free(nk)
            free(nv)
            memset(self.slots, 0, ((<size_t>1) << self.bits) * sizeof(Slot))
            return
        free(self.slots)
        free(self.keys)
        free(self.vals)
        self.slots = ns
        self.keys = nk
        self.vals = nv
        self.bits = self.min_bits
        self.cap = self.min_cap

    def memory_bytes(self) -> int:
        """Bytes allocated for the C tables (slot table + key and value arrays)."""
        return (((<size_t>1) << self.bits) * sizeof(Slot)
                + self.cap * (sizeof(Key) + sizeof(Val)))

    def __repr__(self) -> str:
        return (f"ChunkIndex(len={self.count}, slots={(<size_t>1) << self.bits}, "
                f"memory_bytes={self.memory_bytes()})")
