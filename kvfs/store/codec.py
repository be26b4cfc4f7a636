"""Transparent lossless compression of KV-cache chunks.

KV-cache blocks are fp16/bf16 tensors. Their mantissa bits are close to random, so byte-oriented
compressors barely help on the raw bytes (zstd-1: 1.09x fp16, 1.29x bf16). Splitting each element
into byte planes ("byte shuffle") isolates the low-entropy sign/exponent byte, which an order-0
entropy coder packs well, while the mantissa plane is stored as is (fast, and nothing could shrink
it anyway). Codecs 2-4 entropy-code that plane with zstd; codecs 5-7, which choose() picks for new
data, with kvfs's own Huffman coder (native/kvhuff.h: no match finder to run, four interleaved
streams, two symbols per decode lookup). Measured on real SmolLM2 KV data this beats
ZipNN's ratio at a higher speed; see tools/bench_codec.py.

On-disk format
==============
The codec id is stored next to every chunk record by the chunk store; ``raw_len`` (the decoded
length) is stored there too and is not repeated in the payload. Ids are never renumbered; new codecs
get new ids. All integers are little-endian.

``CODEC_RAW = 0``
    payload = the raw bytes. Not checksummed here (the record layer's checksum covers it).

Every other codec starts with a 4-byte check word::

    [0:4]  u32  low 32 bits of xxh3_64(payload[4:], seed=(raw_len << 8) | codec)

so any corruption of the payload, a wrong ``raw_len`` or a wrong codec id raises ``CodecError``
before anything is decoded (probability 2**-32 of a miss). The body follows at offset 4.

``CODEC_ZSTD = 1``: generic bytes (fp8, int8, unknown element size).
    body = one zstd frame of the raw bytes (content size recorded in the frame header).

``CODEC_SHUF2 = 2``: 2-byte elements (fp16, int16). Planar body, k = 2, no bit rotation.

``CODEC_SHUF2_ROT1 = 3``: bf16. Planar body, k = 2; every 16-bit element is rotated left by one
    bit before the split (``s eeeeeeee mmmmmmm`` -> ``eeeeeeee mmmmmmm s``), so plane 1 is exactly
    the 8-bit exponent and the sign joins the near-random mantissa in plane 0 (+0.7% ratio on bf16).

``CODEC_SHUF4 = 4``: 4-byte elements (fp32, int32). Planar body, k = 4, no rotation.

``CODEC_HUF2 = 5``: 2-byte elements (fp16, int16). Planar body, k = 2, no rotation, plane modes
    0, 1, 3 (below): the high plane Huffman-coded, the low plane raw unless LZ (repeats) or Huffman
    saves plane_min_saving.

``CODEC_HUF2_ROT1 = 6``: bf16. As 5, with the rotation of codec 3.

``CODEC_HUF4 = 7``: 4-byte elements (fp32, int32). As 5 with k = 4: each plane raw, LZ or Huffman,
    whichever is smallest (the zero low planes of upcast fp16/bf16 become constant segments).

Planar body (k planes, n = raw_len // k elements, t = raw_len % k trailing bytes)::

    [0]          u8       seg_log2: segment size S = 2**seg_log2 bytes for mode-2/3 planes
                          (codecs 2-4: 0 if no plane uses mode 2; otherwise 10..24)
    [1:1+k]      u8 * k   mode of plane j (plane j = byte j of every element, little-endian)
    [1+k:1+5k]   u32 * k  length in bytes of the section of plane j
    sections of planes 0 .. k-1, back to back
    t trailing bytes of the raw data, as is (the odd byte of an odd-length fp16 chunk)

    plane modes:
      0  RAW:      the n plane bytes as is
      1  ZSTD:     one zstd frame decoding to the n plane bytes
      2  ZSTD_SEG: ceil(n / S) zstd frames, frame i decoding to plane bytes [i*S, min(n, (i+1)*S));
                   the section starts with ceil(n / S) u32 frame lengths, then the frames.
                   Separate frames give each 64 KiB of the exponent plane its own Huffman table,
                   which follows the statistics of the data better than zstd's 128 KiB blocks.
                   Codecs 2-4 only.
      3  HUF:      codecs 5-7 only. The section is a Huffman plane section (native/kvhuff.h):
                   ceil(n / S) u32 segment lengths, then the segments, segment i coding plane bytes
                   [i*S, min(n, (i+1)*S)). Each segment starts with a kind byte:
                     0 RAW    the segment's bytes as is (Huffman would not save 1%)
                     1 CONST  1 byte, the value of every byte of the segment
                     2 HUF    u8 maxlen (1..12), u8 first, u8 last, then ceil((last-first+1)/2)
                              bytes of 4-bit code lengths of symbols first..last (low nibble
                              first, 0 = absent; they must form a complete prefix code), u32 * 3
                              byte lengths of streams 0..2, then streams 0..3 (3 takes the rest).
                              Stream j codes quarter j of the segment (q = m // 4 bytes each, the
                              last one also the m % 4 left over) with the canonical code (shorter
                              codes first, ties by symbol), least significant bit first, zero-
                              padded to a byte; a stream must be consumed exactly.

Decoding never trusts the payload beyond the check word: every length is checked against the
payload and the plane size, Huffman tables must be complete codes, and the native decoder neither
reads nor writes outside its buffers whatever the input (tests fuzz it); any inconsistency raises
``CodecError``.

Code: this module is the framing (codec ids, the check word, the raw fallback) and the choice of a
file's codec; kvfs/store/planes.py writes and reads the planar bodies. A ``Codec`` may be shared by
the chunk store's worker threads (see planes.py on its per-thread state).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import struct
from dataclasses import dataclass

import numpy as np
import xxhash
import zstandard

from kvfs import _huff, _shuffle
from kvfs.store.planes import SEG_LOG2_MAX, SEG_LOG2_MIN, CorruptBody, PlaneCoder

__all__ = [
    "CODEC_HUF2",
    "CODEC_HUF2_ROT1",
    "CODEC_HUF4",
    "CODEC_NAMES",
    "CODEC_RAW",
    "CODEC_SHUF2",
    "CODEC_SHUF2_ROT1",
    "CODEC_SHUF4",
    "CODEC_ZSTD",
    "Codec",
    "CodecError",
    "CodecPolicy",
]

log = logging.getLogger(__name__)

CODEC_RAW = 0
CODEC_ZSTD = 1
CODEC_SHUF2 = 2
CODEC_SHUF2_ROT1 = 3
CODEC_SHUF4 = 4
CODEC_HUF2 = 5
CODEC_HUF2_ROT1 = 6
CODEC_HUF4 = 7

CODEC_NAMES: dict[int, str] = {
    CODEC_RAW: "raw",
    CODEC_ZSTD: "zstd",
    CODEC_SHUF2: "shuf2",
    CODEC_SHUF2_ROT1: "shuf2-rot1",
    CODEC_SHUF4: "shuf4",
    CODEC_HUF2: "huf2",
    CODEC_HUF2_ROT1: "huf2-rot1",
    CODEC_HUF4: "huf4",
}
# planar codecs: id -> (element size k, bit rotation of 16-bit elements)
_ZSTD_PLANAR = {CODEC_SHUF2: (2, 0), CODEC_SHUF2_ROT1: (2, 1), CODEC_SHUF4: (4, 0)}
_HUF_PLANAR = {CODEC_HUF2: (2, 0), CODEC_HUF2_ROT1: (2, 1), CODEC_HUF4: (4, 0)}
# Huffman codec -> the zstd-planar codec it succeeds (same layout)
_PREDECESSOR = {CODEC_HUF2: CODEC_SHUF2, CODEC_HUF2_ROT1: CODEC_SHUF2_ROT1, CODEC_HUF4: CODEC_SHUF4}

_CHECK = struct.Struct("<I")
_ENTROPY_SAMPLE = 32 * 1024  # enough for stable byte histograms, ~10 us
# A random-looking file is recognised from this much of its sample (entropies, ~5 us)
_RANDOM_SAMPLE = 8 * 1024
_MAX_RAW = 1 << 31  # section lengths are u32; chunks are a few MiB

# hint -> codec; element sizes map to the shuffle of that width, '2' is refined by trial
_HINTS: dict[str, int] = {
    "raw": CODEC_RAW,
    "fp16": CODEC_HUF2,
    "float16": CODEC_HUF2,
    "half": CODEC_HUF2,
    "bf16": CODEC_HUF2_ROT1,
    "bfloat16": CODEC_HUF2_ROT1,
    "fp32": CODEC_HUF4,
    "float32": CODEC_HUF4,
    "4": CODEC_HUF4,
    "1": CODEC_ZSTD,
    "fp8": CODEC_ZSTD,
    "int8": CODEC_ZSTD,
}


class CodecError(Exception):
    """A payload that cannot be decoded: corrupt, truncated, or an unknown codec id."""


@dataclass(frozen=True)
class CodecPolicy:
    enabled: bool = True
    # zstd level. Level 1 is the fast strategy; higher levels search harder for matches, which in
    # float planes are mostly coincidences (measured: level 3 makes shuffled bf16 *worse*).
    level: int = 1
    min_saving: float = 0.05  # store raw when saving is under this fraction
    # A plane is stored raw unless zstd saves at least this fraction of it: raw planes cost nothing
    # to decode (they are read in place), and the fp16/bf16 mantissa plane only ever saves ~0.5%.
    plane_min_saving: float = 0.02
    # zstd's longest minimum match. Shorter matches between float bytes are coincidences that cost
    # more to code than the literals they replace (bf16 high-byte plane: 2.70x at 7, 2.43x at 5).
    min_match: int = 7
    # Hash table of the match finder on the bf16/fp32 exponent plane. A tiny table finds fewer
    # coincidental matches: better ratio (2.90x vs 2.83x at 12) at twice the speed.
    exponent_hash_log: int = 6
    # ... and on other planes (fp16 high-byte plane: 1.417x at 12 vs 1.405x at 6, same speed).
    hash_log: int = 12
    # Segment size of the entropy-coded planes (see the module docstring): 64 KiB measured best.
    segment_log2: int = 16
    # Longest Huffman code (codecs 5-7): 11 bits keeps the decode tables in L1.
    huff_bits: int = 11
    # A Huffman segment must save this fraction of its size, else it is stored raw.
    huff_seg_min_saving: float = 0.01
    # choose() looks at no more than this much of the sample.
    sample_bytes: int = 64 * 1024
    # Keep freed MiB-sized buffers in the malloc heap (glibc only; process-wide, set once).
    # By default glibc hands every chunk-sized buffer back to the kernel when it is freed, so
    # each new payload or decoded chunk page-faults all its pages in again: measured, that
    # costs as much as the Huffman decoding of an fp16 chunk. See _keep_freed_memory.
    keep_freed_memory: bool = True
    # Verify the payload checksum on decode. Turn off only if the caller verifies its own checksum
    # of the stored record (the structural checks still guarantee the output length).
    verify: bool = True


def _as_bytes_view(data: bytes | bytearray | memoryview) -> memoryview:
    mv = memoryview(data)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")  # e.g. a numpy float16 array's buffer
    return mv


def _seed(codec: int, raw_len: int) -> int:
    return ((raw_len << 8) | codec) & 0xFFFFFFFFFFFFFFFF


class Codec:
    """Chooses, applies and inverts the chunk codecs. Safe to share between threads."""

    def __init__(self, policy: CodecPolicy = CodecPolicy()) -> None:  # noqa: B008 (frozen)
        self.policy = policy
        if not SEG_LOG2_MIN <= policy.segment_log2 <= SEG_LOG2_MAX:
            raise ValueError(f"segment_log2 must be in {SEG_LOG2_MIN}..{SEG_LOG2_MAX}")
        if not 8 <= policy.huff_bits <= _huff.MAX_LOG:
            raise ValueError(f"huff_bits must be in 8..{_huff.MAX_LOG}")
        if policy.keep_freed_memory:
            _keep_freed_memory()
        self._planes = PlaneCoder(policy)

    # ------------------------------------------------------------------ choose

    def choose(self, sample: bytes | memoryview, hint: str | None) -> int:
        """Pick the codec for a file from a cheap sample of its first chunk (called once per file).

        hint: None (unknown: detect), 'fp16', 'bf16', 'raw' (never compress), or an element size
        like '2', '4', '1'. At most policy.sample_bytes of the sample are looked at. Detection:
        byte histograms say whether the data is random (then only a plain zstd trial runs, to catch
        repeats) and whether 2-byte data looks like bf16; trial encodes of the candidates decide the
        rest. Whatever is chosen must save min_saving on the sample, else CODEC_RAW.
        """
        if not self.policy.enabled:
            return CODEC_RAW
        key = None if hint is None else hint.strip().lower()
        if key is not None and key not in _HINTS and key != "2":
            if key.isdigit():
                key = "1"  # element sizes without a shuffle codec: plain zstd
            else:
                log.warning("codec: unknown hint %r, detecting", hint)
                key = None
        if key == "raw":
            return CODEC_RAW
        mv = _as_bytes_view(sample)[: self.policy.sample_bytes]
        n = len(mv)
        if n < 64:  # too little to judge: trust the hint, else assume fp16-like
            return _HINTS[key] if key is not None and key != "2" else CODEC_HUF2
        limit = n * (1.0 - self.policy.min_saving)
        if key is not None:
            codec = _HINTS[key] if key != "2" else _family2(mv)
            size = self._trial_size(mv, codec)
        elif _looks_random(mv[:_RANDOM_SAMPLE]):
            # no byte plane has order-0 redundancy, so only repeats could pay: an LZ-only pass
            # finds them at ~10 GB/s (a full zstd trial cost ~35 us per file of random data)
            codec = CODEC_ZSTD
            size = len(self._planes.lz(mv)) + _CHECK.size
        else:
            codec = _family2(mv)
            size = self._trial_size(mv, codec)
            # ties go to the 2-byte shuffle (the common KV dtypes); the margins are absolute so
            # that a nearly empty first chunk (all zeros) does not decide the file's codec
            size4 = self._trial_size(mv, CODEC_HUF4)
            if size4 < size - 0.01 * n:
                codec, size = CODEC_HUF4, size4
            size1 = self._trial_size(mv, CODEC_ZSTD)
            if size1 < size - 0.03 * n:
                codec, size = CODEC_ZSTD, size1
        if codec in _PREDECESSOR:
            # the zstd planes of the older codec win only on data with long repeats (its LZ
            # finds them in the high plane too), and only by a clear margin
            old = _PREDECESSOR[codec]
            size_old = self._trial_size(mv, old)
            if size_old < size - 0.02 * n:
                codec, size = old, size_old
        if size > limit:
            codec = CODEC_RAW
        log.debug(
            "codec: chose %s for hint %r (sample %d -> %s)", CODEC_NAMES[codec], hint, n, size
        )
        return codec

    def confirms(self, sample: bytes | memoryview, expected: int) -> bool:
        """Does the sample agree with *expected*, a codec its siblings got (store.choices)? Only
        the random-data probe runs: random for CODEC_RAW, not random for a compressing codec.
        A random sample for a compressing codec (e.g. zstd for repeats) needs a full choice."""
        if not self.policy.enabled:
            return expected == CODEC_RAW
        mv = _as_bytes_view(sample)[: self.policy.sample_bytes]
        if len(mv) < _RANDOM_SAMPLE:
            return False
        return _looks_random(mv[:_RANDOM_SAMPLE]) == (expected == CODEC_RAW)

    def _trial_size(self, mv: memoryview, codec: int) -> float:
        used, payload = self._encode(mv, codec)
        return len(payload) if used != CODEC_RAW else float("inf")

    # ------------------------------------------------------------------ encode

    def encode(
        self, raw: bytes | memoryview, codec: int
    ) -> tuple[int, bytes | bytearray | memoryview]:
        """Compress raw with codec; returns (codec actually used, payload).

        Falls back to (CODEC_RAW, raw) when the saving is < policy.min_saving.
        """
        if codec not in CODEC_NAMES:
            raise ValueError(f"unknown codec id {codec}")
        if codec == CODEC_RAW or not self.policy.enabled or not 0 < len(raw) < _MAX_RAW:
            return CODEC_RAW, raw
        used, payload = self._encode(_as_bytes_view(raw), codec)
        if used == CODEC_RAW:
            return CODEC_RAW, raw
        return used, payload

    def _encode(self, mv: memoryview, codec: int) -> tuple[int, bytes | bytearray | memoryview]:
        raw_len = len(mv)
        planes = self._planes
        if codec in _HUF_PLANAR or codec in _ZSTD_PLANAR:
            k, rot = _HUF_PLANAR.get(codec) or _ZSTD_PLANAR[codec]
            if k == 2:
                # the fp16/bf16 hot paths build the payload in place, check word space first
                if codec in _HUF_PLANAR:
                    out = planes.encode_huf2(mv, rot, _CHECK.size)
                else:
                    out = planes.encode_shuf2(mv, rot, _CHECK.size)
                if out is None:
                    return CODEC_RAW, mv
                check = xxhash.xxh3_64_intdigest(
                    memoryview(out)[_CHECK.size :], seed=_seed(codec, raw_len)
                )
                _CHECK.pack_into(out, 0, check & 0xFFFFFFFF)
                return codec, out
            if codec in _HUF_PLANAR:
                parts, size = planes.encode_huf_planar(mv, k)
            else:
                parts, size = planes.encode_shuf4(mv)
        elif codec == CODEC_ZSTD:
            frame = planes.zstd(mv)
            parts, size = [frame], len(frame)
        else:
            raise ValueError(f"unknown codec id {codec}")
        if size + _CHECK.size > raw_len * (1.0 - self.policy.min_saving):
            return CODEC_RAW, mv
        h = xxhash.xxh3_64(seed=_seed(codec, raw_len))
        for part in parts:
            h.update(part)
        parts.insert(0, _CHECK.pack(h.intdigest() & 0xFFFFFFFF))
        return codec, b"".join(parts)

    # ------------------------------------------------------------------ decode

    def decode(self, codec: int, payload: bytes | memoryview, raw_len: int) -> bytes | bytearray:
        """Inverse of encode.

        Raises CodecError on corrupt/unknown input; never returns data whose length is not raw_len.
        The result is a new object unless codec is CODEC_RAW and payload is bytes/bytearray.
        """
        try:
            pv = _as_bytes_view(payload)
        except (TypeError, ValueError) as e:
            raise CodecError(f"payload is not a contiguous buffer: {e}") from e
        if raw_len < 0:
            raise CodecError(f"negative raw_len {raw_len}")
        if codec == CODEC_RAW:
            if len(pv) != raw_len:
                raise CodecError(f"raw payload is {len(pv)} bytes, expected {raw_len}")
            return payload if isinstance(payload, bytes | bytearray) else pv.tobytes()
        body = self._body(codec, pv, raw_len)
        if codec in _HUF_PLANAR:
            out = _shuffle.empty_bytearray(raw_len)  # every byte is written
            k, rot = _HUF_PLANAR[codec]
            self._guarded(self._planes.decode_huf, body, k, rot, memoryview(out))
            return out
        if codec == CODEC_ZSTD:
            out = self._guarded(self._planes.unzstd, body, raw_len)
        else:
            k, rot = _ZSTD_PLANAR[codec]
            out = self._guarded(self._planes.decode_shuf, body, k, rot, raw_len)
        if len(out) != raw_len:  # cannot happen by construction; never hand back a wrong length
            raise CodecError(f"decoded {len(out)} bytes, expected {raw_len}")
        return out

    def decode_into(self, codec: int, payload: bytes | memoryview, raw_len: int, out) -> None:
        """Decode into *out*, a writable buffer of exactly raw_len bytes (e.g. a DRAM slot).
        Same checks as decode(). The Huffman codecs decode straight into it; the others decode
        and copy (without the GIL). On CodecError the contents of out are undefined."""
        try:
            dst = _as_bytes_view(out)
        except (TypeError, ValueError) as e:
            raise CodecError(f"output is not a contiguous buffer: {e}") from e
        if dst.readonly:
            raise CodecError("output buffer is read-only")
        if len(dst) != raw_len:
            raise CodecError(f"output buffer is {len(dst)} bytes, expected {raw_len}")
        if codec in _HUF_PLANAR:
            try:
                pv = _as_bytes_view(payload)
            except (TypeError, ValueError) as e:
                raise CodecError(f"payload is not a contiguous buffer: {e}") from e
            body = self._body(codec, pv, raw_len)
            k, rot = _HUF_PLANAR[codec]
            self._guarded(self._planes.decode_huf, body, k, rot, dst)
            return
        if codec == CODEC_RAW:  # one copy, not decode()'s bytes and then a second
            try:
                pv = _as_bytes_view(payload)
            except (TypeError, ValueError) as e:
                raise CodecError(f"payload is not a contiguous buffer: {e}") from e
            if len(pv) != raw_len:
                raise CodecError(f"raw payload is {len(pv)} bytes, expected {raw_len}")
            data = pv
        else:
            data = self.decode(codec, payload, raw_len)
        np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(data, np.uint8))

    def _body(self, codec: int, pv: memoryview, raw_len: int) -> memoryview:
        """The body of a checksummed payload, after the check word (verified unless disabled)."""
        if codec not in CODEC_NAMES:
            raise CodecError(f"unknown codec id {codec}")
        if raw_len < 0:
            raise CodecError(f"negative raw_len {raw_len}")
        if len(pv) < _CHECK.size:
            raise CodecError(f"{CODEC_NAMES[codec]} payload truncated ({len(pv)} bytes)")
        body = pv[_CHECK.size :]
        if self.policy.verify:
            (want,) = _CHECK.unpack_from(pv)
            got = xxhash.xxh3_64_intdigest(body, seed=_seed(codec, raw_len)) & 0xFFFFFFFF
            if got != want:
                raise CodecError(
                    f"{CODEC_NAMES[codec]} payload checksum mismatch (corrupt, or wrong raw_len)"
                )
        return body

    @staticmethod
    def _guarded(fn, *args):
        """Run a decoder, turning every structural error into CodecError."""
        try:
            return fn(*args)
        except CorruptBody as e:
            raise CodecError(str(e)) from e
        except (zstandard.ZstdError, ValueError, struct.error, IndexError) as e:
            raise CodecError(f"payload is corrupt: {e}") from e


_MALLOC_TUNED = False


def _keep_freed_memory() -> None:
    """mallopt: serve buffers up to 64 MiB from the heap rather than from fresh mmaps, and only
    trim the heap past 512 MiB free, so that chunk buffers are recycled instead of faulted in anew
    (the daemon allocates and frees a few MiB per chunk). Peak heap use is retained, bounded by
    the number of chunk buffers in flight. A no-op where glibc's mallopt is not available."""
    global _MALLOC_TUNED
    if _MALLOC_TUNED:
        return
    _MALLOC_TUNED = True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's <malloc.h>
    ok = mallopt(m_mmap_threshold, 64 << 20) and mallopt(m_trim_threshold, 512 << 20)
    log.debug("codec: mallopt %s", "set" if ok else "refused")


def _looks_random(mv: memoryview) -> bool:
    """True if no byte plane of 1-, 2- or 4-byte elements of mv has order-0 redundancy worth
    having. The plug-in entropy of m truly random bytes is ~8 - 255 / (2 m ln 2) (7.91 bits on
    the 2,048 bytes of a 4-byte plane of 8 KiB); 0.05 bits below that, order-0 coding could
    save under 2%, less than min_saving."""
    m = len(mv) // 4
    if m < 256:
        return False
    limit = 8.0 - 255.0 / (2.0 * m * math.log(2.0)) - 0.05
    return min(_shuffle.entropy_profile(mv)) > limit


def _family2(mv: memoryview) -> int:
    """fp16 or bf16? Rotating bf16 by one bit makes the high byte the 8-bit exponent, whose entropy
    is lower than that of sign + 7 exponent bits (by 0.05-0.15 bits on real KV data); for fp16 the
    rotation just trades the sign for a mantissa bit (difference < 0.015 bits)."""
    mv = mv[:_ENTROPY_SAMPLE]
    h_plain = _shuffle.u16_entropy(mv, 8)
    h_rot = _shuffle.u16_entropy(mv, 7)
    return CODEC_HUF2_ROT1 if h_rot < h_plain - 0.025 else CODEC_HUF2
