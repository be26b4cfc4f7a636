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

Threading: a ``Codec`` may be shared by the chunk store's worker threads; zstd contexts and scratch
buffers are per thread (``threading.local``), and the shuffle and Huffman loops run without the
GIL.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import struct
import threading
from dataclasses import dataclass

import numpy as np
import xxhash
import zstandard

from kvfs import _huff, _shuffle

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
# old zstd-planar codec -> its Huffman successor, and back
_HUF_OF = {CODEC_SHUF2: CODEC_HUF2, CODEC_SHUF2_ROT1: CODEC_HUF2_ROT1, CODEC_SHUF4: CODEC_HUF4}
_HUF_CODECS = frozenset(_HUF_OF.values())

# plane modes of the planar body
_MODE_RAW = 0
_MODE_ZSTD = 1
_MODE_ZSTD_SEG = 2
_MODE_HUF = 3
# plane modes each codec family may use (anything else in a header is corruption)
_MODES_OLD = frozenset((_MODE_RAW, _MODE_ZSTD, _MODE_ZSTD_SEG))
_MODES_HUF = frozenset((_MODE_RAW, _MODE_ZSTD, _MODE_HUF))

_CHECK = struct.Struct("<I")
_HDR2 = struct.Struct("<BBBII")  # planar header for k = 2
_ENTROPY_SAMPLE = 32 * 1024  # enough for stable byte histograms, ~10 us
# A random-looking file is recognised from this much of its sample (entropies, ~5 us)
_RANDOM_SAMPLE = 8 * 1024
_PROBE_PIECE = 8 * 1024
_MAX_RAW = 1 << 31  # section lengths are u32; chunks are a few MiB
_SEG_LOG2_MIN = 10
_SEG_LOG2_MAX = 24

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


@dataclass(frozen=True)
class _PlanePlan:
    segmented: bool  # mode 2 (entropy-coded, per-segment frames) vs mode 1 (one frame)
    params: int  # index into Codec._params


class _Local(threading.local):
    """Per-thread zstd contexts (not thread-safe) and reusable scratch buffers."""

    def __init__(self) -> None:
        self.compressors: dict[int, zstandard.ZstdCompressor] = {}
        self.dctx = zstandard.ZstdDecompressor()
        self.scratch = [bytearray(), bytearray(), bytearray()]

    def scratch_view(self, size: int, idx: int = 0) -> memoryview:
        if len(self.scratch[idx]) < size:
            self.scratch[idx] = _shuffle.empty_bytearray(size)
        return memoryview(self.scratch[idx])[:size]


def _as_bytes_view(data: bytes | bytearray | memoryview) -> memoryview:
    mv = memoryview(data)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")  # e.g. a numpy float16 array's buffer
    return mv


def _seed(codec: int, raw_len: int) -> int:
    return ((raw_len << 8) | codec) & 0xFFFFFFFFFFFFFFFF


def _chunk_looks_random(mv: memoryview) -> bool:
    """An incompressible chunk in a compressible file (random, encrypted): if 8 KiB from its
    middle have a random high byte, it is stored raw at once (~2 us) instead of found out by
    compressing everything. KV data sits far below (fp16 ~5.7 bits, bf16 ~2.8)."""
    if len(mv) < 2 * _PROBE_PIECE:
        return False
    mid = len(mv) // 4 * 2
    return _shuffle.u16_entropy(mv[mid - _PROBE_PIECE // 2 : mid + _PROBE_PIECE // 2], 8) > 7.9


class Codec:
    """Chooses, applies and inverts the chunk codecs. Safe to share between threads."""

    def __init__(self, policy: CodecPolicy = CodecPolicy()) -> None:  # noqa: B008 (frozen)
        self.policy = policy
        if not _SEG_LOG2_MIN <= policy.segment_log2 <= _SEG_LOG2_MAX:
            raise ValueError(f"segment_log2 must be in {_SEG_LOG2_MIN}..{_SEG_LOG2_MAX}")
        if not 8 <= policy.huff_bits <= _huff.MAX_LOG:
            raise ValueError(f"huff_bits must be in 8..{_huff.MAX_LOG}")
        self._local = _Local()
        p = policy
        if p.keep_freed_memory:
            _keep_freed_memory()
        # bytes a Huffman segment must save (else stored raw)
        self._min_gain = int((1 << p.segment_log2) * p.huff_seg_min_saving)
        # Entropy-coding planes: zstd at `level` with the overrides above.
        exp = zstandard.ZstdCompressionParameters.from_level(
            p.level, hash_log=p.exponent_hash_log, min_match=p.min_match, write_checksum=False
        )
        mid = zstandard.ZstdCompressionParameters.from_level(
            p.level, hash_log=p.hash_log, min_match=p.min_match, write_checksum=False
        )
        # Mantissa planes: LZ only. With the fast strategy, target_length > 0 switches off zstd's
        # literal Huffman coding: random mantissas are skipped at ~10 GB/s (4x faster than with
        # Huffman, same size), and repeats (zero pages, layer-0 V rows) still shrink as matches.
        lz = zstandard.ZstdCompressionParameters(
            strategy=zstandard.STRATEGY_FAST,
            window_log=20,
            hash_log=p.hash_log,
            chain_log=p.hash_log,
            search_log=1,
            min_match=p.min_match,
            target_length=1,
            write_checksum=False,
        )
        self._params = [exp, mid, lz]
        seg_exp = _PlanePlan(True, 0)
        seg_mid = _PlanePlan(True, 1)
        one_lz = _PlanePlan(False, 2)
        self._plans: dict[int, tuple[int, int, list[_PlanePlan]]] = {
            # codec: (element size, rotation, plan of plane 0 .. k-1)
            CODEC_SHUF2: (2, 0, [one_lz, seg_mid]),
            CODEC_SHUF2_ROT1: (2, 1, [one_lz, seg_exp]),
            # fp32: plane 3 = sign + 7 exponent bits, plane 2 = exponent lsb + 7 mantissa bits; the
            # low planes are random for native fp32 but zero for upcast fp16/bf16 (LZ gets those).
            CODEC_SHUF4: (4, 0, [one_lz, one_lz, seg_mid, seg_exp]),
        }
        # Huffman codecs: (element size, rotation); every plane is tried with Huffman and LZ
        self._huf: dict[int, tuple[int, int]] = {
            CODEC_HUF2: (2, 0),
            CODEC_HUF2_ROT1: (2, 1),
            CODEC_HUF4: (4, 0),
        }

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
            size = len(self._compressor(2).compress(mv)) + _CHECK.size
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
        if codec in _HUF_CODECS:
            # the zstd planes of the older codec win only on data with long repeats (its LZ
            # finds them in the high plane too), and only by a clear margin
            old = next(c for c, h in _HUF_OF.items() if h == codec)
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
        limit = raw_len * (1.0 - self.policy.min_saving)
        if codec == CODEC_ZSTD:
            frame = self._compressor(-1).compress(mv)
            parts: list[bytes | memoryview] = [frame]
            size = len(frame)
        elif codec in (CODEC_HUF2, CODEC_HUF2_ROT1):
            return self._encode_huf2(mv, codec)
        elif codec == CODEC_HUF4:
            parts, size = self._encode_huf_planar(mv, codec)
        elif codec in (CODEC_SHUF2, CODEC_SHUF2_ROT1):
            return self._encode_shuf2(mv, codec)
        elif codec in self._plans:
            parts, size = self._encode_planar(mv, codec)
        else:
            raise ValueError(f"unknown codec id {codec}")
        if size + _CHECK.size > limit:
            return CODEC_RAW, mv
        h = xxhash.xxh3_64(seed=_seed(codec, raw_len))
        for part in parts:
            h.update(part)
        parts.insert(0, _CHECK.pack(h.intdigest() & 0xFFFFFFFF))
        return codec, b"".join(parts)

    def _compressor(self, idx: int) -> zstandard.ZstdCompressor:
        comps = self._local.compressors
        c = comps.get(idx)
        if c is None:
            if idx < 0:
                c = zstandard.ZstdCompressor(level=self.policy.level, write_checksum=False)
            else:
                c = zstandard.ZstdCompressor(compression_params=self._params[idx])
            comps[idx] = c
        return c

    def _encode_shuf2(
        self, mv: memoryview, codec: int
    ) -> tuple[int, bytes | bytearray | memoryview]:
        """The hot path (fp16/bf16), same layout as _encode_planar with k = 2, built in place.

        Segment by segment, the split writes the low plane straight into the output buffer and the
        high plane into scratch, which zstd compresses while it is still in cache; the only other
        copy is that of the compressed frames into the output.
        """
        _, rot, plans = self._plans[codec]
        raw_len = len(mv)
        n = raw_len // 2
        tail = raw_len - 2 * n
        if _chunk_looks_random(mv):
            return CODEC_RAW, mv
        seg_log2 = self.policy.segment_log2
        seg = 1 << seg_log2
        nseg = -(-n // seg)
        keep = n * (1.0 - self.policy.plane_min_saving)
        lo_at = _CHECK.size + _HDR2.size
        # capacity: both planes raw (a mode-2 plane is only kept when smaller than raw)
        out = _shuffle.empty_bytearray(lo_at + raw_len)
        om = memoryview(out)
        lo = om[lo_at : lo_at + n]
        hi = self._local.scratch_view(n)
        hi_comp = self._compressor(plans[1].params)
        frames = []
        for a in range(0, n, seg):
            b = min(n, a + seg)
            _shuffle.split2(mv[2 * a : 2 * b], lo[a:b], hi[a:b], rot)
            frames.append(hi_comp.compress(hi[a:b]))
        hi_len = 4 * nseg + sum(map(len, frames))
        hi_mode = _MODE_ZSTD_SEG if n and hi_len <= keep else _MODE_RAW
        if hi_mode == _MODE_RAW:
            hi_len = n
        lo_mode, lo_len = _MODE_RAW, n
        if hi_mode != _MODE_RAW and self._worth_lz(lo):
            z = self._compressor(plans[0].params).compress(lo)
            if len(z) <= keep:
                lo_mode, lo_len = _MODE_ZSTD, len(z)
                om[lo_at : lo_at + lo_len] = z
        size = lo_at + lo_len + hi_len + tail
        if size > raw_len * (1.0 - self.policy.min_saving):
            return CODEC_RAW, mv
        pos = lo_at + lo_len
        if hi_mode == _MODE_ZSTD_SEG:
            struct.pack_into(f"<{nseg}I", out, pos, *map(len, frames))
            pos += 4 * nseg
            for f in frames:
                om[pos : pos + len(f)] = f
                pos += len(f)
        else:
            om[pos : pos + n] = hi
            pos += n
        if tail:
            om[pos:size] = mv[raw_len - tail :]
        _HDR2.pack_into(
            out,
            _CHECK.size,
            seg_log2 if hi_mode == _MODE_ZSTD_SEG else 0,
            lo_mode,
            hi_mode,
            lo_len,
            hi_len,
        )
        check = xxhash.xxh3_64_intdigest(om[_CHECK.size : size], seed=_seed(codec, raw_len))
        _CHECK.pack_into(out, 0, check & 0xFFFFFFFF)
        lo.release()
        om.release()
        del out[size:]  # no copy: it only shrinks the logical size (or reallocs a tiny payload)
        return codec, out

    def _encode_huf2(
        self, mv: memoryview, codec: int
    ) -> tuple[int, bytes | bytearray | memoryview]:
        """The hot path of codecs 5/6 (fp16/bf16), built in place in one output buffer.

        One C pass splits the elements segment by segment: the low plane goes straight to its
        place in the output, the high plane to a 64 KiB scratch from which it is Huffman-coded
        into the output right behind the low plane. Only when the low plane compresses too (LZ on
        repeated rows, or Huffman) is anything copied again.
        """
        _, rot = self._huf[codec]
        p = self.policy
        raw_len = len(mv)
        n = raw_len // 2
        tail = raw_len - 2 * n
        if _chunk_looks_random(mv):
            return CODEC_RAW, mv
        seg_log2 = p.segment_log2
        keep = n * (1.0 - p.plane_min_saving)
        lo_at = _CHECK.size + _HDR2.size
        hi_at = lo_at + n
        out = _shuffle.empty_bytearray(hi_at + _huff.plane_bound(n, seg_log2) + tail)
        om = memoryview(out)
        lo = om[lo_at:hi_at]
        scratch = self._local.scratch_view(1 << seg_log2)
        hi_len = _huff.encode2(
            mv, lo, om[hi_at:], scratch, rot, seg_log2, p.huff_bits, self._min_gain
        )
        hi_mode = _MODE_HUF if n and hi_len <= keep else _MODE_RAW
        lo_mode, lo_len = _MODE_RAW, n
        if hi_mode == _MODE_RAW:
            # rare (the high plane of float data always compresses): split again, both raw
            hi_len = n
            _shuffle.split2(mv, lo, om[hi_at : hi_at + n], rot)
        else:
            lo_mode, lo_sec = self._pack_plane(lo, keep, seg_log2)
            if lo_mode != _MODE_RAW:
                lo_len = len(lo_sec)
                hi_sec = bytes(om[hi_at : hi_at + hi_len])
                om[lo_at : lo_at + lo_len] = lo_sec
                om[lo_at + lo_len : lo_at + lo_len + hi_len] = hi_sec
        size = lo_at + lo_len + hi_len + tail
        if size > raw_len * (1.0 - p.min_saving):
            return CODEC_RAW, mv
        if tail:
            om[size - tail : size] = mv[raw_len - tail :]
        _HDR2.pack_into(out, _CHECK.size, seg_log2, lo_mode, hi_mode, lo_len, hi_len)
        check = xxhash.xxh3_64_intdigest(om[_CHECK.size : size], seed=_seed(codec, raw_len))
        _CHECK.pack_into(out, 0, check & 0xFFFFFFFF)
        lo.release()
        om.release()
        del out[size:]  # no copy: it only shrinks the logical size (or reallocs a tiny payload)
        return codec, out

    def _pack_plane(
        self, plane: memoryview, keep: float, seg_log2: int
    ) -> tuple[int, bytes | memoryview]:
        """Best encoding of one plane of a Huffman codec: (mode, section). Cheap probes decide
        which coders run at all: LZ (repeats: zero pages, repeated rows) and Huffman (a skewed
        byte distribution); the plane stays raw unless one of them gets it under keep bytes."""
        n = len(plane)
        best_mode, best = _MODE_RAW, None
        best_len = keep
        if n == 0:
            return _MODE_RAW, plane
        probe = _probe_sample(plane)
        # the probe must show most of the saving asked of the plane (its table costs more)
        pms = self.policy.plane_min_saving
        if _huff.estimate(probe, self.policy.huff_bits) <= len(probe) * (1.0 - pms / 2):
            sec = self._local.scratch_view(_huff.plane_bound(n, seg_log2), 1)
            ln = _huff.encode_plane(plane, sec, seg_log2, self.policy.huff_bits, self._min_gain)
            if ln <= best_len:
                best_mode, best, best_len = _MODE_HUF, sec[:ln], ln
        # LZ probe on the same sample (see _worth_lz)
        lz_probe = self._compressor(2).compress(probe)
        if len(lz_probe) <= 0.99 * len(probe):
            z = self._compressor(2).compress(plane)
            if len(z) <= best_len:
                best_mode, best, best_len = _MODE_ZSTD, z, len(z)
        if best is None:
            return _MODE_RAW, plane
        return best_mode, best

    def _encode_huf_planar(
        self, mv: memoryview, codec: int
    ) -> tuple[list[bytes | memoryview], int]:
        """Codec 7 (and any k): shuffle into k planes, then the best of raw/Huffman/LZ each."""
        k, _ = self._huf[codec]
        raw_len = len(mv)
        n = raw_len // k
        tail = raw_len - n * k
        buf = self._local.scratch_view(n * k, 2)
        _shuffle.shuffle(mv[: n * k], buf, k)
        keep = n * (1.0 - self.policy.plane_min_saving)
        seg_log2 = self.policy.segment_log2
        modes: list[int] = []
        sections: list[bytes | memoryview] = []
        for j in range(k):
            mode, sec = self._pack_plane(buf[j * n : (j + 1) * n], keep, seg_log2)
            if mode == _MODE_HUF:
                sec = bytes(sec)  # the scratch it is in is reused for the next plane
            modes.append(mode)
            sections.append(sec)
        lengths = [len(sec) for sec in sections]
        header = struct.pack(f"<B{k}B{k}I", seg_log2, *modes, *lengths)
        parts: list[bytes | memoryview] = [header, *sections]
        if tail:
            parts.append(mv[n * k :])
        return parts, len(header) + sum(lengths) + tail

    def _worth_lz(self, plane: memoryview) -> bool:
        """Cheap probe before the LZ pass over a mantissa plane: LZ-compress 4 spread pieces of
        8 KiB and go on only if they shrink by 1%. Mantissas are random except in zero pages and
        repeated rows (layer-0 V: the full plane shrinks 1.1-2x where the probe shows 1.02-1.5x);
        skipping the pass elsewhere saves ~7% of the encode time."""
        n = len(plane)
        if n <= 4 * _PROBE_PIECE:
            return n > 0
        sample = b"".join(plane[k * n // 4 : k * n // 4 + _PROBE_PIECE] for k in range(4))
        probe = self._compressor(2).compress(sample)
        return len(probe) <= 0.99 * len(sample)

    def _encode_planar(self, mv: memoryview, codec: int) -> tuple[list[bytes | memoryview], int]:
        k, rot, plans = self._plans[codec]
        raw_len = len(mv)
        n = raw_len // k
        tail = raw_len - n * k
        buf = self._local.scratch_view(n * k)
        if k == 2:
            _shuffle.split2(mv, buf[:n], buf[n:], rot)
        else:
            _shuffle.shuffle(mv[: n * k], buf, k)
        seg = 1 << self.policy.segment_log2
        pms = self.policy.plane_min_saving
        modes: list[int] = []
        sections: list[list[bytes | memoryview]] = []
        lengths: list[int] = []
        uses_seg = False
        for j, plan in enumerate(plans):
            plane = buf[j * n : (j + 1) * n]
            comp = self._compressor(plan.params)
            mode, section = _MODE_RAW, [plane]
            if n:
                if plan.segmented:
                    frames = [comp.compress(plane[a : a + seg]) for a in range(0, n, seg)]
                    table = struct.pack(f"<{len(frames)}I", *map(len, frames))
                    cand: list[bytes | memoryview] = [table, *frames]
                    cand_mode = _MODE_ZSTD_SEG
                else:
                    cand = [comp.compress(plane)]
                    cand_mode = _MODE_ZSTD
                if sum(map(len, cand)) <= n * (1.0 - pms):
                    mode, section = cand_mode, cand
                    uses_seg |= cand_mode == _MODE_ZSTD_SEG
            modes.append(mode)
            sections.append(section)
            lengths.append(sum(map(len, section)))
        header = struct.pack(
            f"<B{k}B{k}I", self.policy.segment_log2 if uses_seg else 0, *modes, *lengths
        )
        parts: list[bytes | memoryview] = [header]
        for section in sections:
            parts.extend(section)
        if tail:
            parts.append(mv[n * k :])
        return parts, len(header) + sum(lengths) + tail

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
        if codec in _HUF_CODECS:
            out = _shuffle.empty_bytearray(raw_len)  # every byte is written
            self._guarded(self._decode_huf, codec, body, raw_len, memoryview(out))
            return out
        if codec == CODEC_ZSTD:
            out = self._guarded(self._unzstd, body, raw_len)
        else:
            out = self._guarded(self._decode_planar, codec, body, raw_len)
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
        if codec in _HUF_CODECS:
            try:
                pv = _as_bytes_view(payload)
            except (TypeError, ValueError) as e:
                raise CodecError(f"payload is not a contiguous buffer: {e}") from e
            body = self._body(codec, pv, raw_len)
            self._guarded(self._decode_huf, codec, body, raw_len, dst)
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
        except CodecError:
            raise
        except (zstandard.ZstdError, ValueError, struct.error, IndexError) as e:
            raise CodecError(f"payload is corrupt: {e}") from e

    def _decode_huf(self, codec: int, body: memoryview, raw_len: int, omv: memoryview) -> None:
        """Decode a codec 5-7 body into omv (raw_len bytes, every one written)."""
        k, rot = self._huf[codec]
        n = raw_len // k
        tail = raw_len - n * k
        if k == 2:
            hdr = _HDR2
            if len(body) < hdr.size:
                raise CodecError("planar header truncated")
            seg_log2, m0, m1, l0, l1 = hdr.unpack_from(body)
            modes, lengths = (m0, m1), (l0, l1)
        else:
            hdr = struct.Struct(f"<B{k}B{k}I")
            if len(body) < hdr.size:
                raise CodecError("planar header truncated")
            fields = hdr.unpack_from(body)
            seg_log2, modes, lengths = fields[0], fields[1 : 1 + k], fields[1 + k :]
        if hdr.size + sum(lengths) + tail != len(body):
            raise CodecError("planar section lengths do not add up to the payload size")
        if not _MODES_HUF.issuperset(modes):
            raise CodecError(f"bad plane modes {modes}")
        if _MODE_HUF in modes and not _SEG_LOG2_MIN <= seg_log2 <= _SEG_LOG2_MAX:
            raise CodecError(f"bad segment size 2**{seg_log2}")
        sections = []
        off = hdr.size
        for length in lengths:
            sections.append(body[off : off + length])
            off += length
        if k == 2 and modes[1] == _MODE_HUF:
            # hot path: the high plane is decoded segment by segment and joined with the low
            # plane (read in place when raw) straight into the output
            lo = self._plane(modes[0], sections[0], n, seg_log2, 1)
            # two segments' room: each segment's join then overlaps the next one's decoding
            scratch = self._local.scratch_view(2 << seg_log2)
            _huff.decode2(sections[1], lo, omv[: 2 * n], scratch, rot, seg_log2)
        elif k == 2:
            lo = self._plane(modes[0], sections[0], n, seg_log2, 1)
            hi = self._plane(modes[1], sections[1], n, seg_log2, 2)
            _shuffle.join2(lo, hi, omv[: 2 * n], rot)
        else:
            buf = self._local.scratch_view(n * k, 2)
            for j in range(k):
                plane = self._plane(modes[j], sections[j], n, seg_log2, 1)
                buf[j * n : (j + 1) * n] = plane
            _shuffle.unshuffle(buf, omv[: n * k], k)
        if tail:
            omv[n * k :] = body[len(body) - tail :]

    def _plane(
        self, mode: int, section: memoryview, n: int, seg_log2: int, idx: int
    ) -> memoryview | bytes:
        """One decoded plane of n bytes: raw in place, or decoded (Huffman into scratch idx)."""
        if mode == _MODE_RAW:
            if len(section) != n:
                raise CodecError(f"raw plane is {len(section)} bytes, expected {n}")
            return section
        if mode == _MODE_ZSTD:
            return self._unzstd(section, n)
        buf = self._local.scratch_view(n, idx)
        _huff.decode_plane(section, buf, seg_log2)
        return buf

    def _unzstd(self, frame: memoryview, size: int) -> bytes:
        return _unzstd_frame(self._local.dctx, frame, size)

    def _decode_planar(self, codec: int, body: memoryview, raw_len: int) -> bytearray:
        k, rot, _ = self._plans[codec]
        n = raw_len // k
        tail = raw_len - n * k
        hdr = struct.Struct(f"<B{k}B{k}I")
        if len(body) < hdr.size:
            raise CodecError("planar header truncated")
        fields = hdr.unpack_from(body)
        seg_log2, modes, lengths = fields[0], fields[1 : 1 + k], fields[1 + k :]
        if hdr.size + sum(lengths) + tail != len(body):
            raise CodecError("planar section lengths do not add up to the payload size")
        seg = 0
        if _MODE_ZSTD_SEG in modes:
            if not _SEG_LOG2_MIN <= seg_log2 <= _SEG_LOG2_MAX:
                raise CodecError(f"bad segment size 2**{seg_log2}")
            seg = 1 << seg_log2
        # each plane: a contiguous buffer (raw: read in place; mode 1: decompressed), or for mode 2
        # the list of its compressed frames, decompressed one at a time below while being joined
        planes: list[memoryview | bytes | list[memoryview]] = []
        off = hdr.size
        for mode, length in zip(modes, lengths, strict=True):
            section = body[off : off + length]
            off += length
            if mode == _MODE_RAW:
                if length != n:
                    raise CodecError(f"raw plane is {length} bytes, expected {n}")
                planes.append(section)
            elif mode == _MODE_ZSTD:
                planes.append(self._unzstd(section, n))
            elif mode == _MODE_ZSTD_SEG:
                planes.append(_frames_of(section, n, seg))
            else:
                raise CodecError(f"unknown plane mode {mode}")
        out = _shuffle.empty_bytearray(raw_len)  # every byte is written below
        omv = memoryview(out)
        if k == 2 and seg:
            # segment by segment: the 64 KiB just decompressed is joined while still in cache
            lo, hi = planes
            dctx = self._local.dctx
            for i, a in enumerate(range(0, n, seg)):
                b = min(n, a + seg)
                if isinstance(lo, list):
                    lo_i = _unzstd_frame(dctx, lo[i], b - a)
                else:
                    lo_i = memoryview(lo)[a:b]
                if isinstance(hi, list):
                    hi_i = _unzstd_frame(dctx, hi[i], b - a)
                else:
                    hi_i = memoryview(hi)[a:b]
                _shuffle.join2(lo_i, hi_i, omv[2 * a : 2 * b], rot)
        elif k == 2:
            _shuffle.join2(planes[0], planes[1], omv[: 2 * n], rot)
        else:
            buf = self._local.scratch_view(n * k)
            for j, p in enumerate(planes):
                if isinstance(p, list):
                    dctx = self._local.dctx
                    p = b"".join(
                        _unzstd_frame(dctx, f, min(seg, n - i * seg)) for i, f in enumerate(p)
                    )
                buf[j * n : (j + 1) * n] = p
            _shuffle.unshuffle(buf, omv[: n * k], k)
        if tail:
            omv[n * k :] = body[len(body) - tail :]
        return out


def _frames_of(section: memoryview, n: int, seg: int) -> list[memoryview]:
    """The compressed frames of a mode-2 section (checked to fill it exactly)."""
    nseg = -(-n // seg)
    if len(section) < 4 * nseg:
        raise CodecError("segment table truncated")
    sizes = struct.unpack_from(f"<{nseg}I", section)
    if 4 * nseg + sum(sizes) != len(section):
        raise CodecError("segment lengths do not add up to the section size")
    frames = []
    off = 4 * nseg
    for size in sizes:
        frames.append(section[off : off + size])
        off += size
    return frames


def _unzstd_frame(dctx: zstandard.ZstdDecompressor, frame: memoryview, size: int) -> bytes:
    """Decompress one zstd frame that must hold exactly size bytes."""
    # we always record the content size; checking it first also keeps a corrupt header from
    # making zstd allocate a huge buffer when verify is off
    declared = zstandard.frame_content_size(frame)
    if declared != size or size == 0:
        raise CodecError(f"zstd frame declares {declared} bytes, expected {size}")
    out = dctx.decompress(frame)
    if len(out) != size:
        raise CodecError(f"zstd frame decoded to {len(out)} bytes, expected {size}")
    return out


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


def _probe_sample(plane: memoryview) -> bytes | memoryview:
    """4 spread pieces of a plane, 1/32 of it but 2-8 KiB each (all of a small plane): a cheap
    statistics sample whose cost stays a small fraction of coding the plane."""
    n = len(plane)
    piece = max(2048, min(_PROBE_PIECE, n // 32))
    if n <= 4 * piece:
        return plane
    return b"".join(plane[k * n // 4 : k * n // 4 + piece] for k in range(4))


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
