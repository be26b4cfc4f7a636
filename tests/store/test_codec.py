"""Tests of the chunk codec (kvfs.store.codec) and the byte-shuffle extension (kvfs._shuffle)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from kvfs import _shuffle
from kvfs.store.codec import (
    CODEC_NAMES,
    CODEC_RAW,
    CODEC_SHUF2,
    CODEC_SHUF2_ROT1,
    CODEC_SHUF4,
    CODEC_ZSTD,
    Codec,
    CodecError,
    CodecPolicy,
)

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "kv"
KIB = 1024
ALL_CODECS = sorted(CODEC_NAMES)
COMPRESSING = [c for c in ALL_CODECS if c != CODEC_RAW]


def _kv(kind: str) -> bytes:
    path = DATA / f"smollm2_kv_{kind}.npy"
    if not path.exists():
        pytest.skip(f"{path} not available")
    return np.load(path).tobytes()


@pytest.fixture(scope="module")
def fp16() -> bytes:
    return _kv("fp16")


@pytest.fixture(scope="module")
def bf16() -> bytes:
    return _kv("bf16")


@pytest.fixture(scope="module")
def codec() -> Codec:
    return Codec()


def roundtrip(codec: Codec, raw: bytes, cid: int) -> tuple[int, int]:
    used, payload = codec.encode(raw, cid)
    assert used in (cid, CODEC_RAW)
    back = codec.decode(used, payload, len(raw))
    assert isinstance(back, bytes | bytearray)
    assert bytes(back) == raw
    return used, len(payload)


# ---------------------------------------------------------------- real KV data


@pytest.mark.parametrize("block", [256 * KIB, 2048 * KIB])
def test_fp16_real_roundtrip_and_ratio(codec: Codec, fp16: bytes, block: int) -> None:
    assert codec.choose(fp16[:block], None) == CODEC_SHUF2
    assert codec.choose(fp16[:block], "fp16") == CODEC_SHUF2
    assert codec.choose(fp16[:block], "2") == CODEC_SHUF2
    raw_total = stored = 0
    for off in range(0, len(fp16), block):
        chunk = fp16[off : off + block]
        used, size = roundtrip(codec, chunk, CODEC_SHUF2)
        assert used == CODEC_SHUF2
        raw_total += len(chunk)
        stored += size
    assert raw_total / stored > 1.17  # ZipNN 0.5.4: 1.163


@pytest.mark.parametrize("block", [256 * KIB, 2048 * KIB])
def test_bf16_real_roundtrip_and_ratio(codec: Codec, bf16: bytes, block: int) -> None:
    assert codec.choose(bf16[:block], None) == CODEC_SHUF2_ROT1
    assert codec.choose(bf16[:block], "bf16") == CODEC_SHUF2_ROT1
    assert codec.choose(bf16[:block], "2") == CODEC_SHUF2_ROT1
    raw_total = stored = 0
    for off in range(0, len(bf16), block):
        chunk = bf16[off : off + block]
        used, size = roundtrip(codec, chunk, CODEC_SHUF2_ROT1)
        assert used == CODEC_SHUF2_ROT1
        raw_total += len(chunk)
        stored += size
    assert raw_total / stored > 1.48  # ZipNN 0.5.4: 1.480


@pytest.mark.parametrize("cid", COMPRESSING)
def test_every_codec_on_real_slices(codec: Codec, fp16: bytes, bf16: bytes, cid: int) -> None:
    for data in (fp16, bf16):
        # layer 0 K, layer 0 V (repetitive), a middle layer; odd and unaligned lengths
        for off, ln in ((0, 256 * KIB), (384 * KIB, 300_001), (10 * 786_432 + 3, 65_537)):
            roundtrip(codec, data[off : off + ln], cid)


def test_numpy_buffers_accepted(codec: Codec, fp16: bytes) -> None:
    arr = np.frombuffer(fp16[: 256 * KIB], dtype=np.float16).reshape(-1, 64)
    cid = codec.choose(memoryview(arr), None)
    used, payload = codec.encode(memoryview(arr), cid)
    assert used == CODEC_SHUF2
    assert bytes(codec.decode(used, payload, arr.nbytes)) == arr.tobytes()


# ---------------------------------------------------------------- synthetic data


def test_float32_roundtrip(codec: Codec) -> None:
    rng = np.random.default_rng(7)
    native = rng.standard_normal(64 * KIB).astype(np.float32).tobytes()
    upcast = rng.standard_normal(64 * KIB).astype(np.float16).astype(np.float32).tobytes()
    for raw in (native, upcast):
        cid = codec.choose(raw, None)
        assert cid == CODEC_SHUF4
        assert codec.choose(raw, "4") == CODEC_SHUF4
        used, size = roundtrip(codec, raw, cid)
        assert used == CODEC_SHUF4
        assert size < 0.9 * len(raw)
    for cid in ALL_CODECS:
        roundtrip(codec, native[:100_003], cid)


def test_random_is_raw_cheaply(codec: Codec) -> None:
    raw = os.urandom(256 * KIB)
    for hint in (None, "2", "4", "1", "fp16", "bf16"):
        assert codec.choose(raw, hint) == CODEC_RAW
    for cid in ALL_CODECS:  # a forced codec falls back per chunk, returning the input itself
        used, payload = codec.encode(raw, cid)
        assert used == CODEC_RAW
        assert payload is raw
        assert codec.decode(CODEC_RAW, payload, len(raw)) == raw


def test_zeros(codec: Codec) -> None:
    raw = bytes(2048 * KIB)
    assert codec.choose(raw, None) == CODEC_SHUF2  # a zero first chunk must not decide zstd
    for cid in COMPRESSING:
        used, size = roundtrip(codec, raw, cid)
        assert used == cid
        assert size < 2 * KIB


@pytest.mark.parametrize("length", [0, 1, 2, 3, 4, 5, 7, 63, 64, 65, 4097, 65_537, 131_073])
@pytest.mark.parametrize("cid", ALL_CODECS)
def test_odd_lengths(codec: Codec, cid: int, length: int) -> None:
    rng = np.random.default_rng(length)
    compressible = rng.integers(0, 4, length, dtype=np.uint8).tobytes()
    for raw in (compressible, os.urandom(length), bytes(length)):
        roundtrip(codec, raw, cid)


def test_empty(codec: Codec) -> None:
    for cid in ALL_CODECS:
        assert codec.encode(b"", cid) == (CODEC_RAW, b"")
    assert codec.decode(CODEC_RAW, b"", 0) == b""
    assert codec.choose(b"", None) in CODEC_NAMES
    assert codec.choose(b"", "raw") == CODEC_RAW


@pytest.mark.parametrize("cid", COMPRESSING)
def test_every_codec_is_used_and_decodes(codec: Codec, cid: int) -> None:
    # small integers in 16-bit lanes compress under every codec
    raw = (np.arange(200_001, dtype=np.uint32) % 97).astype(np.uint16).tobytes()[:400_001]
    used, _ = roundtrip(codec, raw, cid)
    assert used == cid


def test_hints(codec: Codec, fp16: bytes) -> None:
    sample = fp16[: 64 * KIB]
    assert codec.choose(sample, "raw") == CODEC_RAW
    assert codec.choose(sample, "RAW") == CODEC_RAW
    assert codec.choose(sample, "bf16") == CODEC_SHUF2_ROT1  # the hint wins over detection
    assert codec.choose(sample, "1") == CODEC_ZSTD
    assert codec.choose(sample, "8") == CODEC_ZSTD  # no 8-byte shuffle: plain zstd
    assert codec.choose(sample, "no-such-dtype") == CODEC_SHUF2  # unknown: detect
    assert Codec(CodecPolicy(enabled=False)).choose(sample, "fp16") == CODEC_RAW


def test_min_saving_fallback(fp16: bytes) -> None:
    chunk = fp16[: 256 * KIB]
    strict = Codec(CodecPolicy(min_saving=0.5))  # fp16 saves ~15%
    assert strict.choose(chunk, "fp16") == CODEC_RAW
    used, payload = strict.encode(chunk, CODEC_SHUF2)
    assert used == CODEC_RAW and payload is chunk
    off = Codec(CodecPolicy(enabled=False))
    assert off.encode(chunk, CODEC_SHUF2) == (CODEC_RAW, chunk)
    # decoding never depends on the policy
    used, payload = Codec().encode(chunk, CODEC_SHUF2)
    assert bytes(off.decode(used, payload, len(chunk))) == chunk


def test_policy_variants_decode_with_default(fp16: bytes, bf16: bytes) -> None:
    for policy in (CodecPolicy(level=3), CodecPolicy(segment_log2=12), CodecPolicy(hash_log=16)):
        enc = Codec(policy)
        for raw, cid in ((fp16[: 300 * KIB], CODEC_SHUF2), (bf16[: 300 * KIB], CODEC_SHUF2_ROT1)):
            used, payload = enc.encode(raw, cid)
            assert used == cid
            assert bytes(Codec().decode(used, payload, len(raw))) == raw


def test_encode_unknown_codec(codec: Codec) -> None:
    with pytest.raises(ValueError):
        codec.encode(b"x" * 1000, 99)


# ---------------------------------------------------------------- corruption


def _payloads(codec: Codec, fp16: bytes) -> list[tuple[int, bytes, bytes]]:
    raw = fp16[384 * KIB : 384 * KIB + 200_001]  # layer-0 V: both planes compressed, odd tail
    out = []
    for cid in COMPRESSING:
        used, payload = codec.encode(raw, cid)
        assert used == cid
        out.append((cid, bytes(payload), raw))
    return out


def test_corrupt_payload_raises(codec: Codec, fp16: bytes) -> None:
    rng = np.random.default_rng(3)
    for cid, payload, raw in _payloads(codec, fp16):
        n = len(payload)
        positions = {0, 4, 5, 6, 8, 12, n // 3, n // 2, n - 2, n - 1}
        positions |= set(rng.integers(0, n, 40).tolist())
        for pos in positions:
            bad = bytearray(payload)
            bad[pos] ^= 1 << int(rng.integers(0, 8))
            with pytest.raises(CodecError):
                codec.decode(cid, bytes(bad), len(raw))
        for bad in (payload[:-1], payload[: n // 2], payload[:3], b"", payload + b"\0"):
            with pytest.raises(CodecError):
                codec.decode(cid, bad, len(raw))
        for wrong_len in (len(raw) - 1, len(raw) + 1, 0):
            with pytest.raises(CodecError):
                codec.decode(cid, payload, wrong_len)
        others = [c for c in ALL_CODECS if c != cid]
        for other in others:
            with pytest.raises(CodecError):
                codec.decode(other, payload, len(raw))


def test_unknown_codec_id_raises(codec: Codec) -> None:
    for cid in (5, 99, 255, -1):
        with pytest.raises(CodecError):
            codec.decode(cid, b"\0" * 64, 64)
    with pytest.raises(CodecError):
        codec.decode(CODEC_RAW, b"abc", 4)


def test_corrupt_without_verify_still_never_wrong_length(codec: Codec, fp16: bytes) -> None:
    # With verify off only the structure protects us: every outcome is the right length or an error.
    lax = Codec(CodecPolicy(verify=False))
    rng = np.random.default_rng(5)
    for cid, payload, raw in _payloads(codec, fp16):
        for _ in range(60):
            bad = bytearray(payload)
            for pos in rng.integers(0, len(bad), 3):
                bad[pos] = int(rng.integers(0, 256))
            try:
                out = lax.decode(cid, bytes(bad), len(raw))
            except CodecError:
                continue
            assert len(out) == len(raw)
        for cut in (1, 7, len(payload) // 2):
            with pytest.raises(CodecError):
                lax.decode(cid, payload[:-cut], len(raw))


# ---------------------------------------------------------------- threads


def test_thread_safety(fp16: bytes, bf16: bytes) -> None:
    codec = Codec()
    chunks = [
        (d[off : off + 256 * KIB], cid)
        for d, cid in ((fp16, CODEC_SHUF2), (bf16, CODEC_SHUF2_ROT1))
        for off in range(0, 8 * 256 * KIB, 256 * KIB)
    ]
    seen: set[int] = set()

    def work(item: tuple[bytes, int]) -> bool:
        seen.add(threading.get_ident())
        raw, cid = item
        ok = True
        for _ in range(3):
            used, payload = codec.encode(raw, cid)
            ok &= bytes(codec.decode(used, payload, len(raw))) == raw
        return ok

    with ThreadPoolExecutor(max_workers=4) as pool:
        assert all(pool.map(work, chunks * 2))


# ---------------------------------------------------------------- the shuffle extension


def _rot16(a: np.ndarray, r: int) -> np.ndarray:
    a = a.astype(np.uint32)
    return (((a << r) | (a >> (16 - r))) & 0xFFFF).astype(np.uint16)


@pytest.mark.parametrize("length", [0, 1, 2, 3, 31, 32, 33, 63, 64, 65, 4097, 100_001])
@pytest.mark.parametrize("rot", [0, 1, 7])
def test_split_join_against_numpy(length: int, rot: int) -> None:
    src = os.urandom(length)
    n = length // 2
    ref = _rot16(np.frombuffer(src[: 2 * n], dtype="<u2"), rot)
    for level in (0, 1, 2, -1):  # scalar, SSE2, AVX2, best
        lo, hi = bytearray(n), bytearray(n)
        assert _shuffle.split2(src, lo, hi, rot, level) == n
        assert bytes(lo) == (ref & 0xFF).astype(np.uint8).tobytes()
        assert bytes(hi) == (ref >> 8).astype(np.uint8).tobytes()
        out = bytearray(b"\xaa" * length)
        assert _shuffle.join2(lo, hi, out, rot, level) == n
        assert bytes(out[: 2 * n]) == src[: 2 * n]
        assert out[2 * n :] == b"\xaa" * (length - 2 * n)  # the odd byte is left to the caller


@pytest.mark.parametrize("length", [0, 1, 2, 3, 4, 5, 4097, 65_537])
def test_shuffle2_odd_tail(length: int) -> None:
    src = os.urandom(length)
    n = length // 2
    for rot in (0, 1):
        dst = bytearray(length)
        _shuffle.shuffle2(src, dst, rot)
        if rot == 0:
            assert bytes(dst[:n]) == src[0 : 2 * n : 2]
            assert bytes(dst[n : 2 * n]) == src[1 : 2 * n : 2]
        if length % 2:
            assert dst[-1] == src[-1]  # copied as is
        back = bytearray(length)
        _shuffle.unshuffle2(dst, back, rot)
        assert bytes(back) == src


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("length", [0, 1, 3, 4, 7, 4097, 100_003])
def test_generic_shuffle(k: int, length: int) -> None:
    src = os.urandom(length)
    dst = bytearray(length)
    _shuffle.shuffle(src, dst, k)
    n = length // k
    for j in range(k):
        assert bytes(dst[j * n : (j + 1) * n]) == src[j : n * k : k]
    assert bytes(dst[n * k :]) == src[n * k :]
    back = bytearray(length)
    _shuffle.unshuffle(dst, back, k)
    assert bytes(back) == src


def test_shuffle_bad_buffers() -> None:
    src = os.urandom(101)
    with pytest.raises(ValueError):
        _shuffle.split2(src, bytearray(49), bytearray(50))
    with pytest.raises(ValueError):
        _shuffle.split2(src, bytearray(50), bytearray(49))
    with pytest.raises(ValueError):
        _shuffle.join2(bytearray(49), bytearray(50), bytearray(100))
    with pytest.raises(ValueError):
        _shuffle.shuffle2(src, bytearray(100))
    with pytest.raises(ValueError):
        _shuffle.unshuffle2(src, bytearray(100))
    with pytest.raises(ValueError):
        _shuffle.shuffle(src, bytearray(100), 4)
    with pytest.raises(ValueError):
        _shuffle.unshuffle(src, bytearray(100), 4)
    with pytest.raises(ValueError):
        _shuffle.shuffle(src, bytearray(101), 0)
    with pytest.raises(ValueError):
        _shuffle.split2(src, bytearray(50), bytearray(50), rot=16)
    with pytest.raises(ValueError):
        _shuffle.split2(src, bytearray(50), bytearray(50), level=3)
    with pytest.raises((ValueError, BufferError, TypeError)):
        _shuffle.shuffle2(src, bytes(101))  # read-only destination
    with pytest.raises(TypeError):
        _shuffle.shuffle2("not a buffer", bytearray(101))  # type: ignore[arg-type]
    # larger destinations are fine; only len(src) bytes are written
    dst = bytearray(b"\xee" * 120)
    _shuffle.shuffle2(src, dst)
    assert dst[101:] == b"\xee" * 19


def test_shuffle_strided_buffer_rejected() -> None:
    arr = np.zeros(100, dtype=np.uint8)[::2]
    with pytest.raises(ValueError):
        _shuffle.shuffle2(arr, bytearray(50))


def test_entropy_helpers() -> None:
    assert _shuffle.entropy_profile(b"") == (0.0,) * 7
    prof = _shuffle.entropy_profile(os.urandom(32 * KIB))
    assert len(prof) == 7 and min(prof) > 7.9
    prof = _shuffle.entropy_profile(bytes(32 * KIB))
    assert max(prof) == 0.0
    assert _shuffle.u16_entropy(b"", 8) == 0.0
    assert _shuffle.u16_entropy(bytes(range(256)) * 8, 0) == pytest.approx(7.0)
    with pytest.raises(ValueError):
        _shuffle.u16_entropy(b"ab", 9)


def test_empty_bytearray() -> None:
    assert len(_shuffle.empty_bytearray(0)) == 0
    assert len(_shuffle.empty_bytearray(12345)) == 12345
    with pytest.raises(ValueError):
        _shuffle.empty_bytearray(-1)
