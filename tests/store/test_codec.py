"""Tests of the chunk codec (kvfs.store.codec) and the byte-shuffle extension (kvfs._shuffle)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kvfs import _huff, _shuffle
from kvfs.store.codec import (
    CODEC_HUF2,
    CODEC_HUF2_ROT1,
    CODEC_HUF4,
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


@pytest.fixture(params=[True, False], ids=["bmi2", "plain"])
def decode_loop(request: pytest.FixtureRequest):
    """The Huffman decoder's fast loop in both builds (the BMI2 one only where the CPU has it)."""
    _huff._use_bmi2(request.param)
    yield request.param
    _huff._use_bmi2(True)


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
    assert codec.choose(fp16[:block], None) == CODEC_HUF2
    assert codec.choose(fp16[:block], "fp16") == CODEC_HUF2
    assert codec.choose(fp16[:block], "2") == CODEC_HUF2
    for cid, want in ((CODEC_HUF2, 1.165), (CODEC_SHUF2, 1.17)):  # ZipNN 0.5.4: 1.163
        raw_total = stored = 0
        for off in range(0, len(fp16), block):
            chunk = fp16[off : off + block]
            used, size = roundtrip(codec, chunk, cid)
            assert used == cid
            raw_total += len(chunk)
            stored += size
        assert raw_total / stored > want


@pytest.mark.parametrize("block", [256 * KIB, 2048 * KIB])
def test_bf16_real_roundtrip_and_ratio(codec: Codec, bf16: bytes, block: int) -> None:
    assert codec.choose(bf16[:block], None) == CODEC_HUF2_ROT1
    assert codec.choose(bf16[:block], "bf16") == CODEC_HUF2_ROT1
    assert codec.choose(bf16[:block], "2") == CODEC_HUF2_ROT1
    for cid in (CODEC_HUF2_ROT1, CODEC_SHUF2_ROT1):
        raw_total = stored = 0
        for off in range(0, len(bf16), block):
            chunk = bf16[off : off + block]
            used, size = roundtrip(codec, chunk, cid)
            assert used == cid
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
    assert used == CODEC_HUF2
    assert bytes(codec.decode(used, payload, arr.nbytes)) == arr.tobytes()


# ---------------------------------------------------------------- synthetic data


def test_float32_roundtrip(codec: Codec) -> None:
    rng = np.random.default_rng(7)
    native = rng.standard_normal(64 * KIB).astype(np.float32).tobytes()
    upcast = rng.standard_normal(64 * KIB).astype(np.float16).astype(np.float32).tobytes()
    for raw in (native, upcast):
        cid = codec.choose(raw, None)
        assert cid == CODEC_HUF4
        assert codec.choose(raw, "4") == CODEC_HUF4
        assert codec.choose(raw, "fp32") == CODEC_HUF4
        for c in (cid, CODEC_SHUF4):
            used, size = roundtrip(codec, raw, c)
            assert used == c
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
    assert codec.choose(raw, None) == CODEC_HUF2  # a zero first chunk must not decide zstd
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
    assert codec.choose(sample, "bf16") == CODEC_HUF2_ROT1  # the hint wins over detection
    assert codec.choose(sample, "1") == CODEC_ZSTD
    assert codec.choose(sample, "8") == CODEC_ZSTD  # no 8-byte shuffle: plain zstd
    assert codec.choose(sample, "no-such-dtype") == CODEC_HUF2  # unknown: detect
    assert codec.choose(sample, "fp16") == CODEC_HUF2
    assert codec.choose(sample[:10], "fp16") == CODEC_HUF2  # too small to judge: the hint
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
    policies = (
        CodecPolicy(level=3),
        CodecPolicy(segment_log2=12),
        CodecPolicy(segment_log2=10),
        CodecPolicy(segment_log2=17),
        CodecPolicy(hash_log=16),
        CodecPolicy(huff_bits=8),
        CodecPolicy(huff_bits=12),
        CodecPolicy(huff_seg_min_saving=0.1),
    )
    cases = [(fp16[: 300 * KIB], CODEC_SHUF2), (bf16[: 300 * KIB], CODEC_SHUF2_ROT1)]
    cases += [(fp16[: 300 * KIB], CODEC_HUF2), (bf16[: 300 * KIB], CODEC_HUF2_ROT1)]
    cases += [(fp16[: 300 * KIB], CODEC_HUF4)]
    for policy in policies:
        enc = Codec(policy)
        for raw, cid in cases:
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
    for cid in (8, 99, 255, -1):
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
        for d, cid in (
            (fp16, CODEC_SHUF2),
            (bf16, CODEC_SHUF2_ROT1),
            (fp16, CODEC_HUF2),
            (bf16, CODEC_HUF2_ROT1),
        )
        for off in range(0, 8 * 256 * KIB, 256 * KIB)
    ]
    seen: set[int] = set()

    def work(item: tuple[bytes, int]) -> bool:
        seen.add(threading.get_ident())
        raw, cid = item
        ok = True
        for _ in range(3):
            used, payload = codec.encode(raw, cid)
            ok &= used == cid
            ok &= bytes(codec.decode(used, payload, len(raw))) == raw
            out = bytearray(len(raw))
            codec.decode_into(used, payload, len(raw), out)
            ok &= out == raw
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


# ---------------------------------------------------------------- old records, decode_into


GOLDEN = Path(__file__).resolve().parent / "data" / "codec_golden_v1.npz"


def test_old_payloads_still_decode() -> None:
    # payloads written by the codec before ids 5-7 existed (segment_log2=10, so several frames)
    g = np.load(GOLDEN)
    codec = Codec()
    for name in ("fp16", "bf16"):
        raw = g[f"raw_{name}"].tobytes()
        for cid in (CODEC_ZSTD, CODEC_SHUF2, CODEC_SHUF2_ROT1, CODEC_SHUF4):
            payload = g[f"p_{name}_{cid}"].tobytes()
            assert bytes(codec.decode(cid, payload, len(raw))) == raw
            out = bytearray(len(raw))
            codec.decode_into(cid, payload, len(raw), out)
            assert out == raw
            with pytest.raises(CodecError):
                codec.decode(CODEC_HUF2, payload, len(raw))


# xxh3-64 of payloads the Huffman codecs wrote before their decoder was rewritten (kvfs
# cd039a2): the encoder's output must not change, and such records must still decode. Only
# raw and Huffman planes (modes 0 and 3), so zstd's version does not matter.
HUF_PINNED = {
    "fp16": (CODEC_HUF2, 258163, 0x5C0554BC21A1303A),
    "bf16": (CODEC_HUF2_ROT1, 177327, 0x661E075F1D50009C),
    "fp32": (CODEC_HUF4, 195731, 0x7090BD0B44B2259D),
}


def test_huf_payloads_pinned(fp16: bytes, bf16: bytes, decode_loop: bool) -> None:
    at = 6 << 20
    f32 = np.frombuffer(fp16[at : at + 128 * KIB], np.float16).astype(np.float32)
    raws = {
        "fp16": fp16[at : at + 300_001],
        "bf16": bf16[at : at + 256 * KIB],
        "fp32": (f32 * np.float32(1.0001)).tobytes(),
    }
    codec = Codec()
    for name, (cid, size, digest) in HUF_PINNED.items():
        raw = raws[name]
        used, payload = codec.encode(raw, cid)
        assert (used, len(payload)) == (cid, size)
        assert xxhash.xxh3_64_intdigest(payload) == digest
        assert bytes(codec.decode(cid, payload, len(raw))) == raw


@pytest.mark.parametrize("cid", ALL_CODECS)
def test_decode_into(codec: Codec, fp16: bytes, bf16: bytes, cid: int) -> None:
    for raw in (fp16[: 256 * KIB + 1], bf16[100_000:165_537], bytes(4097), b"\x01"):
        used, payload = codec.encode(raw, cid)
        out = bytearray(b"\xee" * len(raw))
        codec.decode_into(used, payload, len(raw), out)
        assert out == raw
        arr = np.full(len(raw), 0xEE, np.uint8)  # any writable buffer, e.g. a numpy array
        codec.decode_into(used, payload, len(raw), arr)
        assert arr.tobytes() == raw
        for bad_out in (bytearray(len(raw) + 1), bytearray(len(raw) - 1), bytes(len(raw))):
            with pytest.raises(CodecError):
                codec.decode_into(used, payload, len(raw), bad_out)


@pytest.mark.parametrize("cid", [CODEC_HUF2, CODEC_HUF2_ROT1, CODEC_HUF4])
@pytest.mark.parametrize("seg_log2", [10, 16])
def test_huf_segment_boundaries(fp16: bytes, cid: int, seg_log2: int) -> None:
    codec = Codec(CodecPolicy(segment_log2=seg_log2))
    k = 4 if cid == CODEC_HUF4 else 2
    seg = 1 << seg_log2
    base = fp16[1_000_000:]
    for planes in (seg - 1, seg, seg + 1, 2 * seg, 3 * seg + 5):
        for extra in (0, 1, k - 1):
            raw = base[: planes * k + extra]
            used, size = roundtrip(codec, raw, cid)
            assert used == cid


@pytest.mark.parametrize("cid", [CODEC_HUF2, CODEC_HUF2_ROT1, CODEC_HUF4])
def test_huf_big_and_constant(codec: Codec, fp16: bytes, cid: int) -> None:
    big = fp16[: 4 * 1024 * KIB]
    used, size = roundtrip(codec, big, cid)
    assert used == cid and size < 0.9 * len(big)
    for const in (bytes(1024 * KIB), b"\x3c" * (1024 * KIB + 3), b"\x12\x34" * 40_000):
        used, size = roundtrip(codec, const, cid)
        assert used == cid and size < 1024
    # the constant mode switching on and off between segments
    mixed = bytes(64 * KIB) + fp16[: 128 * KIB] + b"\x55" * (200 * KIB) + fp16[-70_001:]
    used, _ = roundtrip(codec, mixed, cid)
    assert used == cid


def test_huf_low_plane_modes(codec: Codec) -> None:
    # a skewed low plane is Huffman-coded too, a repetitive one LZ-coded
    rng = np.random.default_rng(1)
    hi = rng.geometric(0.3, 300_000).clip(0, 255).astype(np.uint16) << 8
    lo_skewed = rng.geometric(0.2, 300_000).clip(0, 255).astype(np.uint16)
    lo_rep = np.tile(rng.integers(0, 256, 1000, dtype=np.uint16), 300)
    for lo in (lo_skewed, lo_rep):
        raw = (hi | lo).astype("<u2").tobytes()
        used, size = roundtrip(codec, raw, CODEC_HUF2)
        assert used == CODEC_HUF2
        assert size < 0.6 * len(raw)


def test_choose_prefers_huffman_but_keeps_old_where_it_wins(codec: Codec) -> None:
    # long repeats of high bytes: only LZ (the zstd planes of codec 2) finds them
    rng = np.random.default_rng(2)
    rows = rng.standard_normal(4096).astype(np.float16).tobytes() * 16
    cid = codec.choose(rows, None)
    assert cid not in (CODEC_HUF2, CODEC_RAW)
    _, huf_size = roundtrip(codec, rows, CODEC_HUF2)
    used, size = roundtrip(codec, rows, cid)
    assert used == cid and size < 0.5 * huf_size
    noisy = rng.standard_normal(64 * KIB // 2).astype(np.float16).tobytes()
    assert codec.choose(noisy, None) == CODEC_HUF2


# ---------------------------------------------------------------- the Huffman extension


def _hplanes() -> list[bytes]:
    rng = np.random.default_rng(9)
    fib = [1, 1]
    while sum(fib) < 60_000:
        fib.append(fib[-1] + fib[-2])
    deep = np.repeat(np.arange(len(fib), dtype=np.uint8), fib)  # depth > 11: length limiting
    rng.shuffle(deep)
    return [
        b"",
        b"\x07",
        b"\x00\x01",
        b"ab" * 5,
        bytes(range(256)) * 300,  # all symbols, flat
        rng.geometric(0.05, 200_000).clip(0, 255).astype(np.uint8).tobytes(),
        rng.integers(0, 2, 70_000, dtype=np.uint8).tobytes(),  # two symbols
        deep.tobytes(),
        os.urandom(100_000),  # raw segments
        bytes(65_536) + b"\x01" + bytes(65_535),  # constant, then two symbols
    ]


@pytest.mark.parametrize("seg_log2", [10, 16])
@pytest.mark.parametrize("bits", [8, 11, 12])
def test_huff_plane_roundtrip(seg_log2: int, bits: int, decode_loop: bool) -> None:
    for plane in _hplanes():
        dst = bytearray(_huff.plane_bound(len(plane), seg_log2))
        ln = _huff.encode_plane(plane, dst, seg_log2, bits, 0)
        assert ln <= len(dst)
        back = bytearray(len(plane))
        _huff.decode_plane(memoryview(dst)[:ln], back, seg_log2)
        assert back == plane
        if len(plane) > 1000 and len(set(plane[:1000])) < 200:
            assert ln < len(plane)
        est = _huff.estimate(plane[: 1 << seg_log2], bits)
        assert est >= 0


@pytest.mark.parametrize("rot", [0, 1, 7])
@pytest.mark.parametrize("length", [0, 1, 2, 3, 1023 * 2, 1024 * 2, 1025 * 2 + 1, 300_001])
def test_huff_encode2_decode2(fp16: bytes, rot: int, length: int, decode_loop: bool) -> None:
    src = fp16[500_000 : 500_000 + length]
    n = length // 2
    lo = bytearray(n)
    dst = bytearray(_huff.plane_bound(n, 10))
    scratch = bytearray(1024)
    ln = _huff.encode2(src, lo, dst, scratch, rot, 10, 11, 0)
    ref = _rot16(np.frombuffer(src[: 2 * n], dtype="<u2"), rot)
    assert bytes(lo) == (ref & 0xFF).astype(np.uint8).tobytes()
    hi = bytearray(n)
    _huff.decode_plane(memoryview(dst)[:ln], hi, 10)
    assert bytes(hi) == (ref >> 8).astype(np.uint8).tobytes()
    # one segment of scratch joins each segment after decoding it; two overlap the join with
    # the next segment's decoding (from the first 16-byte aligned output element)
    for room, shift in ((1024, 0), (2048, 0), (2048, 1), (2048, 6), (4096, 10)):
        buf = bytearray(b"\xaa" * (length + 16))
        out = memoryview(buf)[shift : shift + length]
        _huff.decode2(memoryview(dst)[:ln], lo, out, bytearray(room), rot, 10)
        assert bytes(out[: 2 * n]) == src[: 2 * n]
        assert buf[:shift] == b"\xaa" * shift
        assert buf[shift + 2 * n :] == b"\xaa" * (length + 16 - shift - 2 * n)


def test_huff_many_small_planes(decode_loop: bool) -> None:
    """Planes of every small size and skew: the fast loop's batches end anywhere in a stream,
    and short streams take the careful path only."""
    rng = np.random.default_rng(11)
    for trial in range(400):
        n = int(rng.integers(0, 5000))
        p = float(rng.choice([0.02, 0.1, 0.3, 0.6]))
        plane = rng.geometric(p, n).clip(0, 255).astype(np.uint8)
        if trial % 3 == 0:
            plane = (plane * 37).astype(np.uint8)  # spread symbols apart
        plane = plane.tobytes()
        bits = int(rng.choice([8, 11, 12]))
        dst = bytearray(_huff.plane_bound(n, 10))
        ln = _huff.encode_plane(plane, dst, 10, bits, 0)
        back = bytearray(n)
        _huff.decode_plane(memoryview(dst)[:ln], back, 10)
        assert back == plane


def test_huff_bad_arguments() -> None:
    with pytest.raises(ValueError):
        _huff.encode_plane(b"abc", bytearray(3), 10)  # dst too small
    with pytest.raises(ValueError):
        _huff.encode_plane(b"abc", bytearray(100), 9)  # segment too small
    with pytest.raises(ValueError):
        _huff.encode_plane(b"abc", bytearray(100), 10, 13)  # codes too long
    with pytest.raises(ValueError):
        _huff.encode2(b"abcd", bytearray(2), bytearray(100), bytearray(10), 0, 10)  # scratch
    with pytest.raises(ValueError):
        _huff.decode2(b"", bytearray(1), bytearray(4), bytearray(1024), 0, 10)  # lo too small
    with pytest.raises((ValueError, BufferError)):
        _huff.encode_plane(b"abc", bytes(100), 10)  # read-only output
    with pytest.raises(_huff.HuffError):
        _huff.decode_plane(b"x", bytearray(0), 10)
    with pytest.raises(_huff.HuffError):
        _huff.decode_plane(b"", bytearray(10), 10)


def test_huff_decoder_survives_garbage(fp16: bytes, decode_loop: bool) -> None:
    """Corrupt sections (no checksum at this level): an error or some output, never a crash and
    never a write outside the buffer (the guard bytes around the output stay intact)."""
    rng = np.random.default_rng(4)
    sections = []
    for plane in _hplanes()[4:] + [fp16[1::2][:150_000]]:
        dst = bytearray(_huff.plane_bound(len(plane), 10))
        ln = _huff.encode_plane(plane, dst, 10, 11, 0)
        sections.append((bytes(dst[:ln]), len(plane)))
    guard = b"\x5a" * 64
    errors = 0
    for sec, n in sections:
        trials = []
        for _ in range(150):
            bad = bytearray(sec)
            for pos in rng.integers(0, len(bad), int(rng.integers(1, 4))):
                bad[pos] = int(rng.integers(0, 256))
            trials.append(bytes(bad))
        trials += [sec[:cut] for cut in (0, 1, 4, 5, len(sec) // 2, len(sec) - 1)]
        trials += [sec + b"\0", rng.bytes(len(sec)), bytes(len(sec))]
        for bad in trials:
            for out_n in (n, n - 1, n + 1):
                buf = bytearray(guard + bytes(out_n) + guard)
                view = memoryview(buf)[64 : 64 + out_n]
                try:
                    _huff.decode_plane(bad, view, 10)
                except _huff.HuffError:
                    errors += 1
                assert buf[:64] == guard and buf[-64:] == guard
    assert errors > 0
