"""Planar bodies of the shuffle codecs (2-7): the byte-plane transforms and their entropy coders.

A planar body splits k-byte elements into k byte planes (for bf16 after a one-bit rotation) and
stores each plane raw, as zstd frames or as Huffman-coded segments (native/kvhuff.h). The bytes
are specified in kvfs/store/codec.py's docstring, the normative description of the payloads,
together with the check word that precedes every body. This module writes and reads bodies only:
it knows element sizes and rotations, not codec ids (kvfs.store.codec maps each id to its layout),
and it raises CorruptBody, which the codec reports as CodecError.

Threading: a ``PlaneCoder`` may be shared by the chunk store's worker threads; zstd contexts and
scratch buffers are per thread (``threading.local``), and the shuffle and Huffman loops run
without the GIL.
"""

from __future__ import annotations

import struct
import threading
from typing import TYPE_CHECKING

import zstandard

from kvfs import _huff, _shuffle

if TYPE_CHECKING:
    from kvfs.store.codec import CodecPolicy

__all__ = ["SEG_LOG2_MAX", "SEG_LOG2_MIN", "CorruptBody", "PlaneCoder"]

# plane modes of the planar body
_MODE_RAW = 0
_MODE_ZSTD = 1
_MODE_ZSTD_SEG = 2
_MODE_HUF = 3
# plane modes each codec family may use (anything else in a header is corruption)
_MODES_HUF = frozenset((_MODE_RAW, _MODE_ZSTD, _MODE_HUF))

_HDR2 = struct.Struct("<BBBII")  # planar header for k = 2
_PROBE_PIECE = 8 * 1024
SEG_LOG2_MIN = 10
SEG_LOG2_MAX = 24

# zstd parameter sets of PlaneCoder (see its __init__); -1 is plain zstd at the policy's level
_ZSTD_PLAIN = -1
_ZSTD_EXPONENT = 0
_ZSTD_HIGH = 1
_ZSTD_LZ = 2


class CorruptBody(ValueError):
    """A planar body (or zstd frame) whose structure contradicts its lengths or modes."""


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


class PlaneCoder:
    """Encodes and decodes planar bodies (and plain zstd frames) under a CodecPolicy.

    The in-place encoders (encode_huf2, encode_shuf2: the fp16/bf16 hot paths) return the whole
    payload with `head` bytes left free at its start for the caller's check word, or None when
    the body would not save policy.min_saving (head included): the chunk is then stored raw. The
    others return the body as parts to join, and its size.
    """

    def __init__(self, policy: CodecPolicy) -> None:
        p = self.policy = policy
        self._local = _Local()
        # bytes a Huffman segment must save (else stored raw)
        self._min_gain = int((1 << p.segment_log2) * p.huff_seg_min_saving)
        # Entropy-coding planes: zstd at `level` with the policy's overrides.
        exp = zstandard.ZstdCompressionParameters.from_level(
            p.level, hash_log=p.exponent_hash_log, min_match=p.min_match, write_checksum=False
        )
        high = zstandard.ZstdCompressionParameters.from_level(
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
        self._params = {_ZSTD_EXPONENT: exp, _ZSTD_HIGH: high, _ZSTD_LZ: lz}

    def _compressor(self, idx: int) -> zstandard.ZstdCompressor:
        comps = self._local.compressors
        c = comps.get(idx)
        if c is None:
            if idx == _ZSTD_PLAIN:
                c = zstandard.ZstdCompressor(level=self.policy.level, write_checksum=False)
            else:
                c = zstandard.ZstdCompressor(compression_params=self._params[idx])
            comps[idx] = c
        return c

    # ------------------------------------------------------------------ plain zstd

    def zstd(self, mv: memoryview) -> bytes:
        """One zstd frame of mv at the policy's level (the body of codec 1)."""
        return self._compressor(_ZSTD_PLAIN).compress(mv)

    def lz(self, mv: memoryview) -> bytes:
        """One LZ-only zstd frame of mv (~10 GB/s on random bytes): does mv have repeats?"""
        return self._compressor(_ZSTD_LZ).compress(mv)

    def unzstd(self, frame: memoryview, size: int) -> bytes:
        """Decompress one zstd frame that must hold exactly size bytes."""
        return _unzstd_frame(self._local.dctx, frame, size)

    # ------------------------------------------------------------------ encode

    def encode_shuf2(self, mv: memoryview, rot: int, head: int) -> bytearray | None:
        """Codecs 2/3 (fp16/bf16, zstd planes), built in place.

        Segment by segment, the split writes the low plane straight into the output buffer and the
        high plane into scratch, which zstd compresses while it is still in cache; the only other
        copy is that of the compressed frames into the output.
        """
        raw_len = len(mv)
        n = raw_len // 2
        tail = raw_len - 2 * n
        if _chunk_looks_random(mv):
            return None
        seg_log2 = self.policy.segment_log2
        seg = 1 << seg_log2
        nseg = -(-n // seg)
        keep = n * (1.0 - self.policy.plane_min_saving)
        lo_at = head + _HDR2.size
        # capacity: both planes raw (a mode-2 plane is only kept when smaller than raw)
        out = _shuffle.empty_bytearray(lo_at + raw_len)
        om = memoryview(out)
        lo = om[lo_at : lo_at + n]
        hi = self._local.scratch_view(n)
        # the bf16 exponent plane (rot 1) codes better with a tiny match-finder table
        hi_comp = self._compressor(_ZSTD_EXPONENT if rot else _ZSTD_HIGH)
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
            z = self.lz(lo)
            if len(z) <= keep:
                lo_mode, lo_len = _MODE_ZSTD, len(z)
                om[lo_at : lo_at + lo_len] = z
        size = lo_at + lo_len + hi_len + tail
        if size > raw_len * (1.0 - self.policy.min_saving):
            return None
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
            head,
            seg_log2 if hi_mode == _MODE_ZSTD_SEG else 0,
            lo_mode,
            hi_mode,
            lo_len,
            hi_len,
        )
        lo.release()
        om.release()
        del out[size:]  # no copy: it only shrinks the logical size (or reallocs a tiny payload)
        return out

    def encode_huf2(self, mv: memoryview, rot: int, head: int) -> bytearray | None:
        """The hot path of codecs 5/6 (fp16/bf16), built in place in one output buffer.

        One C pass splits the elements segment by segment: the low plane goes straight to its
        place in the output, the high plane to a 64 KiB scratch from which it is Huffman-coded
        into the output right behind the low plane. Only when the low plane compresses too (LZ on
        repeated rows, or Huffman) is anything copied again.
        """
        p = self.policy
        raw_len = len(mv)
        n = raw_len // 2
        tail = raw_len - 2 * n
        if _chunk_looks_random(mv):
            return None
        seg_log2 = p.segment_log2
        keep = n * (1.0 - p.plane_min_saving)
        lo_at = head + _HDR2.size
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
            return None
        if tail:
            om[size - tail : size] = mv[raw_len - tail :]
        _HDR2.pack_into(out, head, seg_log2, lo_mode, hi_mode, lo_len, hi_len)
        lo.release()
        om.release()
        del out[size:]  # no copy: it only shrinks the logical size (or reallocs a tiny payload)
        return out

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
        lz_probe = self.lz(probe)
        if len(lz_probe) <= 0.99 * len(probe):
            z = self.lz(plane)
            if len(z) <= best_len:
                best_mode, best, best_len = _MODE_ZSTD, z, len(z)
        if best is None:
            return _MODE_RAW, plane
        return best_mode, best

    def encode_huf_planar(self, mv: memoryview, k: int) -> tuple[list[bytes | memoryview], int]:
        """Codec 7 (and any k): shuffle into k planes, then the best of raw/Huffman/LZ each."""
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
        probe = self.lz(sample)
        return len(probe) <= 0.99 * len(sample)

    def encode_shuf4(self, mv: memoryview) -> tuple[list[bytes | memoryview], int]:
        """Codec 4 (fp32, zstd planes). Plane 3 = sign + 7 exponent bits, plane 2 = exponent lsb
        + 7 mantissa bits; the low planes are random for native fp32 but zero for upcast
        fp16/bf16 (LZ gets those)."""
        k = 4
        # (segmented: per-segment frames of mode 2, else one frame of mode 1; zstd parameters)
        plans = [(False, _ZSTD_LZ), (False, _ZSTD_LZ), (True, _ZSTD_HIGH), (True, _ZSTD_EXPONENT)]
        raw_len = len(mv)
        n = raw_len // k
        tail = raw_len - n * k
        buf = self._local.scratch_view(n * k)
        _shuffle.shuffle(mv[: n * k], buf, k)
        seg = 1 << self.policy.segment_log2
        pms = self.policy.plane_min_saving
        modes: list[int] = []
        sections: list[list[bytes | memoryview]] = []
        lengths: list[int] = []
        uses_seg = False
        for j, (segmented, params) in enumerate(plans):
            plane = buf[j * n : (j + 1) * n]
            comp = self._compressor(params)
            mode, section = _MODE_RAW, [plane]
            if n:
                if segmented:
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

    def decode_huf(self, body: memoryview, k: int, rot: int, omv: memoryview) -> None:
        """Decode a codec 5-7 body into omv (its raw_len bytes, every one written)."""
        raw_len = len(omv)
        n = raw_len // k
        tail = raw_len - n * k
        if k == 2:
            hdr = _HDR2
            if len(body) < hdr.size:
                raise CorruptBody("planar header truncated")
            seg_log2, m0, m1, l0, l1 = hdr.unpack_from(body)
            modes, lengths = (m0, m1), (l0, l1)
        else:
            hdr = struct.Struct(f"<B{k}B{k}I")
            if len(body) < hdr.size:
                raise CorruptBody("planar header truncated")
            fields = hdr.unpack_from(body)
            seg_log2, modes, lengths = fields[0], fields[1 : 1 + k], fields[1 + k :]
        if hdr.size + sum(lengths) + tail != len(body):
            raise CorruptBody("planar section lengths do not add up to the payload size")
        if not _MODES_HUF.issuperset(modes):
            raise CorruptBody(f"bad plane modes {modes}")
        if _MODE_HUF in modes and not SEG_LOG2_MIN <= seg_log2 <= SEG_LOG2_MAX:
            raise CorruptBody(f"bad segment size 2**{seg_log2}")
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
                raise CorruptBody(f"raw plane is {len(section)} bytes, expected {n}")
            return section
        if mode == _MODE_ZSTD:
            return self.unzstd(section, n)
        buf = self._local.scratch_view(n, idx)
        _huff.decode_plane(section, buf, seg_log2)
        return buf

    def decode_shuf(self, body: memoryview, k: int, rot: int, raw_len: int) -> bytearray:
        """Decode a codec 2-4 body (zstd planes) into a new buffer of raw_len bytes."""
        n = raw_len // k
        tail = raw_len - n * k
        hdr = struct.Struct(f"<B{k}B{k}I")
        if len(body) < hdr.size:
            raise CorruptBody("planar header truncated")
        fields = hdr.unpack_from(body)
        seg_log2, modes, lengths = fields[0], fields[1 : 1 + k], fields[1 + k :]
        if hdr.size + sum(lengths) + tail != len(body):
            raise CorruptBody("planar section lengths do not add up to the payload size")
        seg = 0
        if _MODE_ZSTD_SEG in modes:
            if not SEG_LOG2_MIN <= seg_log2 <= SEG_LOG2_MAX:
                raise CorruptBody(f"bad segment size 2**{seg_log2}")
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
                    raise CorruptBody(f"raw plane is {length} bytes, expected {n}")
                planes.append(section)
            elif mode == _MODE_ZSTD:
                planes.append(self.unzstd(section, n))
            elif mode == _MODE_ZSTD_SEG:
                planes.append(_frames_of(section, n, seg))
            else:
                raise CorruptBody(f"unknown plane mode {mode}")
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
        raise CorruptBody("segment table truncated")
    sizes = struct.unpack_from(f"<{nseg}I", section)
    if 4 * nseg + sum(sizes) != len(section):
        raise CorruptBody("segment lengths do not add up to the section size")
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
        raise CorruptBody(f"zstd frame declares {declared} bytes, expected {size}")
    out = dctx.decompress(frame)
    if len(out) != size:
        raise CorruptBody(f"zstd frame decoded to {len(out)} bytes, expected {size}")
    return out


def _chunk_looks_random(mv: memoryview) -> bool:
    """An incompressible chunk in a compressible file (random, encrypted): if 8 KiB from its
    middle have a random high byte, it is stored raw at once (~2 us) instead of found out by
    compressing everything. KV data sits far below (fp16 ~5.7 bits, bf16 ~2.8)."""
    if len(mv) < 2 * _PROBE_PIECE:
        return False
    mid = len(mv) // 4 * 2
    return _shuffle.u16_entropy(mv[mid - _PROBE_PIECE // 2 : mid + _PROBE_PIECE // 2], 8) > 7.9


def _probe_sample(plane: memoryview) -> bytes | memoryview:
    """4 spread pieces of a plane, 1/32 of it but 2-8 KiB each (all of a small plane): a cheap
    statistics sample whose cost stays a small fraction of coding the plane."""
    n = len(plane)
    piece = max(2048, min(_PROBE_PIECE, n // 32))
    if n <= 4 * piece:
        return plane
    return b"".join(plane[k * n // 4 : k * n // 4 + piece] for k in range(4))
