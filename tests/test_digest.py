"""kvfs._digest: the chunk checksum hashed without the GIL is python-xxhash's xxh3_64."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import xxhash

from kvfs import _digest

pytestmark = pytest.mark.skipif(not _digest.fast(),
                                reason="this CPU has no AVX2: the store uses python-xxhash")


def test_same_as_xxh3_on_every_length_class():
    rng = np.random.default_rng(7)
    for n in (0, 1, 3, 16, 17, 128, 129, 240, 241, 1000, 65535, 65536, 65537, 1 << 20):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert _digest.xxh3(data) == xxhash.xxh3_64_intdigest(data), n
    assert _digest.xxh3(memoryview(bytearray(b"xabc"))[1:]) == xxhash.xxh3_64_intdigest(b"abc")


def test_threads_hash_at_once():
    data = np.random.default_rng(8).integers(0, 256, 8 << 20, dtype=np.uint8).tobytes()
    want = xxhash.xxh3_64_intdigest(data)
    got = []
    threads = [threading.Thread(target=lambda: got.append(_digest.xxh3(data))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [want] * 4
