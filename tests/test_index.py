"""Tests for kvfs._index.ChunkIndex (the Cython chunk index), checked against a dict model."""

import random
import time
from typing import NamedTuple

import pytest
from kvfs._index import ChunkIndex

U64 = 2**64 - 1
U32 = 2**32 - 1
I64_MIN = -(2**63)
I64_MAX = 2**63 - 1


class Loc(NamedTuple):
    dram_slot: int
    seg: int
    off: int
    rec_len: int
    raw_len: int
    stored_len: int
    codec: int
    flags: int
    checksum: int
    seq: int


def loc(n: int) -> tuple:
    """A distinct, valid location tuple derived from n."""
    return (
        n % 1000 - 1,
        n % 7,
        (n * 4096) & U64,
        n % 5000,
        n % 6000,
        n % 7000,
        n % 256,
        (n * 7) % 256,
        (n * 0x9E3779B97F4A7C15) & U64,
        n & U64,
    )


def rand_loc(rng: random.Random) -> tuple:
    return (
        rng.randint(-1, I64_MAX),
        rng.randint(0, U32),
        rng.randint(0, U64),
        rng.randint(0, U32),
        rng.randint(0, U32),
        rng.randint(0, U32),
        rng.randint(0, 255),
        rng.randint(0, 255),
        rng.randint(0, U64),
        rng.randint(0, U64),
    )


def check_model(idx: ChunkIndex, model: dict) -> None:
    assert len(idx) == len(model)
    assert sorted(idx.items()) == sorted((k[0], k[1], v) for k, v in model.items())
    for (ino, c), v in model.items():
        assert idx.get(ino, c) == v


def test_set_get_replace_pop() -> None:
    idx = ChunkIndex()
    assert len(idx) == 0
    assert idx.get(1, 0) is None
    assert (1, 0) not in idx
    idx.set(1, 0, loc(1))
    idx.set(1, 1, loc(2))
    idx.set(2, 0, loc(3))
    assert len(idx) == 3
    assert idx.get(1, 0) == loc(1)
    assert idx.get(1, 1) == loc(2)
    assert idx.get(2, 0) == loc(3)
    assert (1, 1) in idx
    assert (2, 1) not in idx
    idx.set(1, 1, loc(20))  # replace keeps the count
    assert len(idx) == 3
    assert idx.get(1, 1) == loc(20)
    assert idx.pop(1, 1) == loc(20)
    assert idx.pop(1, 1) is None
    assert (1, 1) not in idx
    assert idx.get(1, 1) is None
    assert len(idx) == 2
    assert idx.get(1, 0) == loc(1)
    assert idx.get(2, 0) == loc(3)
    assert type(idx.get(1, 0)) is tuple


def test_missing_keys() -> None:
    idx = ChunkIndex(0)
    assert idx.pop(5, 5) is None
    assert idx.get(0, 0) is None
    assert idx.get(U64, U64) is None
    for c in range(100):
        idx.set(7, c, loc(c))
    for c in range(100, 300):
        assert idx.get(7, c) is None
        assert idx.get(8, c - 100) is None
        assert idx.pop(8, c) is None
    assert len(idx) == 100


def test_namedtuple_and_numpy_ints_accepted() -> None:
    np = pytest.importorskip("numpy")
    idx = ChunkIndex()
    idx.set(1, 2, Loc(*loc(9)))
    assert idx.get(1, 2) == loc(9)
    idx.set(np.uint64(3), np.int64(4), tuple(np.int64(x) for x in loc(10)))
    assert idx.get(3, 4) == loc(10)


def test_boundary_values() -> None:
    idx = ChunkIndex()
    hi = (I64_MAX, U32, U64, U32, U32, U32, 255, 255, U64, U64)
    lo = (-1, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    most_negative = (I64_MIN,) + lo[1:]
    idx.set(U64, U64, hi)
    idx.set(0, 0, lo)
    idx.set(U64, 0, most_negative)
    idx.set(0, U64, hi)
    assert idx.get(U64, U64) == hi
    assert idx.get(0, 0) == lo
    assert idx.get(U64, 0) == most_negative
    assert idx.get(0, U64) == hi
    assert idx.chunks_of(U64, 2**64) == [0, U64]
    assert idx.chunks_of(U64, U64) == [0]
    assert sorted(idx.items()) == sorted(
        [(U64, U64, hi), (0, 0, lo), (U64, 0, most_negative), (0, U64, hi)]
    )


GOOD = (5, 1, 4096, 100, 90, 80, 1, 2, 3, 4)

BAD_SETS = [
    # (ino, chunk, loc, exception)
    (-1, 0, GOOD, OverflowError),
    (0, -1, GOOD, OverflowError),
    (2**64, 0, GOOD, OverflowError),
    (0, 2**64, GOOD, OverflowError),
    (1.0, 0, GOOD, TypeError),
    ("1", 0, GOOD, TypeError),
    (None, 0, GOOD, TypeError),
    (1, 0, list(GOOD), TypeError),
    (1, 0, None, TypeError),
    (1, 0, GOOD[:9], ValueError),
    (1, 0, GOOD + (0,), ValueError),
    (1, 0, (), ValueError),
    (1, 0, (I64_MAX + 1,) + GOOD[1:], OverflowError),
    (1, 0, (I64_MIN - 1,) + GOOD[1:], OverflowError),
    (1, 0, GOOD[:1] + (U32 + 1,) + GOOD[2:], OverflowError),
    (1, 0, GOOD[:1] + (-1,) + GOOD[2:], OverflowError),
    (1, 0, GOOD[:2] + (U64 + 1,) + GOOD[3:], OverflowError),
    (1, 0, GOOD[:3] + (U32 + 1,) + GOOD[4:], OverflowError),
    (1, 0, GOOD[:4] + (U32 + 1,) + GOOD[5:], OverflowError),
    (1, 0, GOOD[:5] + (U32 + 1,) + GOOD[6:], OverflowError),
    (1, 0, GOOD[:6] + (256,) + GOOD[7:], OverflowError),
    (1, 0, GOOD[:7] + (-1,) + GOOD[8:], OverflowError),
    (1, 0, GOOD[:8] + (U64 + 1,) + GOOD[9:], OverflowError),
    (1, 0, GOOD[:9] + (-1,), OverflowError),
    (1, 0, GOOD[:9] + (1.5,), TypeError),
    (1, 0, GOOD[:9] + ("4",), TypeError),
    (1, 0, GOOD[:9] + (None,), TypeError),
]


@pytest.mark.parametrize("ino,chunk,bad,exc", BAD_SETS)
def test_bad_input_raises_and_leaves_index_intact(ino, chunk, bad, exc) -> None:
    idx = ChunkIndex()
    for c in range(50):
        idx.set(1, c, loc(c))
    before = sorted(idx.items())
    with pytest.raises(exc):
        idx.set(ino, chunk, bad)
    assert sorted(idx.items()) == before
    assert idx.get(1, 0) == loc(0)  # the existing key (1, 0) was not overwritten
    idx.set(1, 100, GOOD)  # still usable
    assert idx.get(1, 100) == GOOD


@pytest.mark.parametrize(
    "call",
    [
        lambda i: i.get(-1, 0),
        lambda i: i.pop(0, 2**64),
        lambda i: i.get(1.5, 0),
        lambda i: (-1, 0) in i,
        lambda i: (1,) in i,
        lambda i: [1, 0] in i,
        lambda i: 5 in i,
        lambda i: i.chunks_of(-1, 10),
        lambda i: i.chunks_of(1, 2.5),
        lambda i: i.chunks_of(1, None),
    ],
)
def test_bad_keys_raise(call) -> None:
    idx = ChunkIndex()
    idx.set(1, 0, GOOD)
    with pytest.raises((TypeError, OverflowError)):
        call(idx)
    assert idx.items() == [(1, 0, GOOD)]


def test_bad_capacity() -> None:
    with pytest.raises(ValueError):
        ChunkIndex(-1)
    with pytest.raises(TypeError):
        ChunkIndex(1.5)
    with pytest.raises(ValueError):
        ChunkIndex(2**40)
    assert len(ChunkIndex(0)) == 0


def test_reentrant_mutation_from_index_is_safe() -> None:
    """A field whose __index__ mutates the index runs before the tables are touched."""
    idx = ChunkIndex(0)

    class Evil:
        def __index__(self) -> int:
            for c in range(1000):  # forces resizes while set() is converting its input
                idx.set(9, c, GOOD)
            for c in range(0, 1000, 2):
                idx.pop(9, c)
            return 77

    idx.set(1, 1, GOOD[:9] + (Evil(),))
    assert idx.get(1, 1) == GOOD[:9] + (77,)
    assert len(idx) == 501
    assert idx.chunks_of(9, 1000) == list(range(1, 1000, 2))


def test_randomized_against_dict_model() -> None:
    rng = random.Random(0xC0FFEE)
    idx = ChunkIndex(16)
    model: dict[tuple[int, int], tuple] = {}
    inos = [rng.randint(0, U64) for _ in range(200)] + list(range(50))
    n_ops = 600_000
    for step in range(n_ops):
        # mostly inserts early, then a deletion-heavier phase
        p_insert = 0.75 if step < 450_000 else 0.1
        ino = rng.choice(inos)
        c = rng.randrange(4000)
        r = rng.random()
        if r < p_insert:
            v = rand_loc(rng) if step % 10 == 0 else loc(step)
            idx.set(ino, c, v)
            model[ino, c] = v
        elif r < p_insert + 0.2:
            assert idx.pop(ino, c) == model.pop((ino, c), None)
        else:
            assert idx.get(ino, c) == model.get((ino, c))
            assert ((ino, c) in idx) == ((ino, c) in model)
        if step == 450_000:
            assert len(idx) > 200_000  # grew through many resizes
            check_model(idx, model)
            peak = idx.memory_bytes()
    check_model(idx, model)
    # drain completely (in random order), then refill
    keys = list(model)
    rng.shuffle(keys)
    for n, (ino, c) in enumerate(keys):
        assert idx.pop(ino, c) == model.pop((ino, c))
        if n % 50_000 == 0:
            check_model(idx, model)
    assert len(idx) == 0 and idx.items() == []
    assert idx.memory_bytes() < peak / 100  # mass deletion shrank the tables
    for c in range(1000):
        idx.set(3, c, loc(c))
    assert idx.chunks_of(3, 2000) == list(range(1000))


def test_growth_sequential_200k() -> None:
    idx = ChunkIndex(0)
    n = 200_000
    for i in range(n):
        idx.set(i // 64, i % 64, loc(i))
    assert len(idx) == n
    for i in range(0, n, 7):
        assert idx.get(i // 64, i % 64) == loc(i)
    assert idx.get(n // 64 + 1, 0) is None
    # memory stays compact: < 128 bytes per entry including table and growth slack
    assert idx.memory_bytes() / n < 128


def chunks_model(model: dict, ino: int, upto: int) -> list[int]:
    return sorted(c for (i, c) in model if i == ino and 0 <= c < upto)


@pytest.mark.parametrize("method", ["chunks_of", "_chunks_of_probe", "_chunks_of_scan"])
def test_chunks_of_sparse(method: str) -> None:
    rng = random.Random(42)
    idx = ChunkIndex()
    model = {}
    inos = [1, 2, 3, 2**40, U64]
    for ino in inos:
        chunks = set(rng.sample(range(1 << 20), 40)) | {0, 1, 2, (1 << 20) - 1}
        if ino == 2**40:
            chunks |= {2**50, U64 - 1, U64}
        for c in chunks:
            idx.set(ino, c, loc(c))
            model[ino, c] = loc(c)
    for ino in inos:
        for c in list(c for (i, c) in model if i == ino)[:10]:  # holes in the runs
            idx.pop(ino, c)
            del model[ino, c]
    fn = getattr(idx, method)
    for ino in inos + [4, 0]:
        for upto in [-5, 0, 1, 2, 3, 100, 4096, (1 << 20) - 1, 1 << 20]:
            assert fn(ino, upto) == chunks_model(model, ino, upto), (ino, upto)
        if method != "_chunks_of_probe":  # probing 2**64 chunks is not an option
            for upto in [2**50, 2**50 + 1, U64, 2**64, 2**70]:
                assert fn(ino, upto) == chunks_model(model, ino, upto), (ino, upto)


def test_chunks_of_dense_run_and_strategies_agree() -> None:
    idx = ChunkIndex()
    for ino in range(1, 300):
        for c in range(ino * 3):
            idx.set(ino, c, loc(c))
    for ino in (1, 17, 299, 300):
        for upto in (0, 5, 100, 2000):
            want = list(range(min(ino * 3 if ino < 300 else 0, upto)))
            assert idx.chunks_of(ino, upto) == want
            assert idx._chunks_of_probe(ino, upto) == want
            assert idx._chunks_of_scan(ino, upto) == want


def test_chunks_of_is_fast_for_huge_sparse_files() -> None:
    """1 TiB sparse files with 1 MiB chunks: upto = 2**20 and beyond, few chunks present."""
    small = ChunkIndex()
    for c in (0, 5, 2**20 - 1, 2**39):
        small.set(1, c, GOOD)
    big = ChunkIndex()
    for i in range(200_000):
        big.set(10 + i // 100, i % 100, GOOD)
    big.set(1, 3, GOOD)
    big.set(1, 2**20 - 2, GOOD)
    t0 = time.perf_counter()
    for _ in range(20):
        assert small.chunks_of(1, 2**20) == [0, 5, 2**20 - 1]
        assert small.chunks_of(1, 2**64) == [0, 5, 2**20 - 1, 2**39]
        assert big.chunks_of(1, 2**20) == [3, 2**20 - 2]
        assert big.chunks_of(11, 100) == list(range(100))
    assert time.perf_counter() - t0 < 2.0


def test_items() -> None:
    idx = ChunkIndex()
    assert idx.items() == []
    want = set()
    for ino in range(20):
        for c in range(0, 50, 3):
            idx.set(ino, c, loc(ino * 100 + c))
            want.add((ino, c, loc(ino * 100 + c)))
    idx.pop(3, 3)
    want.discard((3, 3, loc(303)))
    got = idx.items()
    assert len(got) == len(idx) == len(want)
    assert set(got) == want
    assert all(type(t) is tuple and len(t) == 3 and type(t[2]) is tuple for t in got)


def test_clear() -> None:
    idx = ChunkIndex(64)
    empty_bytes = idx.memory_bytes()
    for i in range(50_000):
        idx.set(i % 97, i, loc(i))
    assert idx.memory_bytes() > empty_bytes
    idx.clear()
    assert len(idx) == 0
    assert idx.items() == []
    assert idx.get(0, 0) is None
    assert idx.chunks_of(0, 10**6) == []
    assert idx.memory_bytes() == empty_bytes
    idx.clear()  # clearing an empty index is fine
    for i in range(1000):
        idx.set(1, i, loc(i))
    assert idx.chunks_of(1, 10) == list(range(10))
    assert len(idx) == 1000


def test_memory_bytes_and_repr() -> None:
    idx = ChunkIndex(1000)
    m = idx.memory_bytes()
    assert isinstance(m, int) and m > 0
    assert "ChunkIndex(len=0" in repr(idx)
    assert bool(idx) is False
    idx.set(0, 0, GOOD)
    assert bool(idx) is True
