# cython: boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""Huffman coding of byte planes (native/kvhuff.h), used by kvfs.store.codec for codecs 5-7.

Everything runs without the GIL, so the chunk store's worker threads code in parallel. All
functions work on caller-provided buffers (anything with the buffer protocol; outputs writable)
and check their sizes; the decoders raise HuffError (a ValueError) on any corrupt input and never
read or write outside the buffers. The section layout is described in native/kvhuff.h.

encode2/decode2 fuse the 2-byte plane split (native/kvshuffle.h, rot as in kvfs._shuffle) with
the coding of the high plane, one segment at a time, so each segment is split and coded (or
decoded and joined) while it is in cache; the low plane goes straight to/from the caller's buffer.
"""

from libc.stdint cimport uint8_t

cdef extern from *:
    """
    #include "kvhuff.h"
    """
    int KVH_MAX_LOG
    int KVH_DEFAULT_LOG
    size_t kvh_plane_bound(size_t n, size_t seg) nogil
    ptrdiff_t kvh_encode_plane(const uint8_t *src, size_t n, size_t seg, uint8_t *dst, size_t cap,
                               int maxbits, size_t min_gain) nogil
    int kvh_decode_plane(const uint8_t *src, size_t len, uint8_t *dst, size_t n, size_t seg) nogil
    ptrdiff_t kvh_encode2(const uint8_t *src, size_t n, int rot, uint8_t *lo, uint8_t *dst,
                          size_t cap, uint8_t *scratch, size_t seg, int maxbits,
                          size_t min_gain) nogil
    int kvh_decode2(const uint8_t *src, size_t len, const uint8_t *lo, uint8_t *dst, size_t n,
                    int rot, uint8_t *scratch, size_t scratch_len, size_t seg) nogil
    size_t kvh_estimate(const uint8_t *src, size_t m, int maxbits) nogil
    int kvh_set_bmi2(int use) nogil

MAX_LOG = KVH_MAX_LOG
DEFAULT_LOG = KVH_DEFAULT_LOG
SEG_LOG2_MIN = 10
SEG_LOG2_MAX = 24

cdef uint8_t _EMPTY[1]

# pick the decoder's fast loop (BMI2+LZCNT or plain) now, before worker threads decode
kvh_set_bmi2(1)


class HuffError(ValueError):
    """A plane section that cannot be decoded (corrupt or truncated)."""


cdef inline size_t _seg(int seg_log2) except 0:
    if seg_log2 < SEG_LOG2_MIN or seg_log2 > SEG_LOG2_MAX:
        raise ValueError(f"seg_log2 must be in {SEG_LOG2_MIN}..{SEG_LOG2_MAX}, got {seg_log2}")
    return (<size_t>1) << seg_log2


cdef inline int _check(Py_ssize_t r, str what) except -1:
    if r == -1:
        raise HuffError(f"{what}: corrupt Huffman section")
    if r == -2:
        raise ValueError(f"{what}: output buffer too small")
    if r < 0:
        raise ValueError(f"{what}: bad arguments")
    return 0


cdef inline int _check_rot(int rot) except -1:
    if rot < 0 or rot > 15:
        raise ValueError(f"rot must be in 0..15, got {rot}")
    return 0


cdef inline int _check_bits(int maxbits) except -1:
    if maxbits < 8 or maxbits > KVH_MAX_LOG:
        raise ValueError(f"maxbits must be in 8..{KVH_MAX_LOG}, got {maxbits}")
    return 0


def plane_bound(Py_ssize_t n, int seg_log2) -> int:
    """Output buffer size encode_plane/encode2 need for a plane of n bytes (includes slack)."""
    if n < 0:
        raise ValueError("n must be >= 0")
    return kvh_plane_bound(<size_t>n, _seg(seg_log2))


def encode_plane(const uint8_t[::1] src, uint8_t[::1] dst, int seg_log2,
                 int maxbits=KVH_DEFAULT_LOG, Py_ssize_t min_gain=0) -> int:
    """Code the plane src into dst (len >= plane_bound(len(src))); returns the section length.
    A segment is Huffman-coded only if that saves >= min_gain bytes, else stored raw."""
    cdef size_t seg = _seg(seg_log2)
    cdef size_t n = <size_t>src.shape[0]
    cdef ptrdiff_t r
    _check_bits(maxbits)
    if min_gain < 0:
        raise ValueError("min_gain must be >= 0")
    if <size_t>dst.shape[0] < kvh_plane_bound(n, seg):
        raise ValueError(f"encode_plane: dst needs {kvh_plane_bound(n, seg)} bytes")
    if n == 0:
        return 0
    with nogil:
        r = kvh_encode_plane(&src[0], n, seg, &dst[0], <size_t>dst.shape[0], maxbits,
                             <size_t>min_gain)
    _check(r, "encode_plane")
    return r


def decode_plane(const uint8_t[::1] src, uint8_t[::1] dst, int seg_log2) -> None:
    """Decode the section src into exactly len(dst) plane bytes; HuffError if corrupt."""
    cdef size_t seg = _seg(seg_log2)
    cdef size_t n = <size_t>dst.shape[0]
    cdef size_t ln = <size_t>src.shape[0]
    cdef const uint8_t *sp = &src[0] if ln else _EMPTY
    cdef int r
    if n == 0:
        if ln:
            raise HuffError("decode_plane: section for an empty plane is not empty")
        return
    with nogil:
        r = kvh_decode_plane(sp, ln, &dst[0], n, seg)
    _check(r, "decode_plane")


def encode2(const uint8_t[::1] src, uint8_t[::1] lo, uint8_t[::1] dst, uint8_t[::1] scratch,
            int rot, int seg_log2, int maxbits=KVH_DEFAULT_LOG, Py_ssize_t min_gain=0) -> int:
    """Split the n = len(src) // 2 elements of src: the low plane into lo[:n], the high plane
    coded into dst (len >= plane_bound(n)); scratch needs 2**seg_log2 bytes. Returns the section
    length. A trailing odd byte of src is not touched."""
    cdef size_t seg = _seg(seg_log2)
    cdef size_t n = <size_t>src.shape[0] // 2
    cdef ptrdiff_t r
    _check_rot(rot)
    _check_bits(maxbits)
    if min_gain < 0:
        raise ValueError("min_gain must be >= 0")
    if <size_t>lo.shape[0] < n:
        raise ValueError(f"encode2: lo needs {n} bytes, got {lo.shape[0]}")
    if <size_t>dst.shape[0] < kvh_plane_bound(n, seg):
        raise ValueError(f"encode2: dst needs {kvh_plane_bound(n, seg)} bytes")
    if <size_t>scratch.shape[0] < seg:
        raise ValueError(f"encode2: scratch needs {seg} bytes")
    if n == 0:
        return 0
    with nogil:
        r = kvh_encode2(&src[0], n, rot, &lo[0], &dst[0], <size_t>dst.shape[0], &scratch[0],
                        seg, maxbits, <size_t>min_gain)
    _check(r, "encode2")
    return r


def decode2(const uint8_t[::1] src, const uint8_t[::1] lo, uint8_t[::1] dst,
            uint8_t[::1] scratch, int rot, int seg_log2) -> None:
    """Inverse of encode2: decode the high-plane section src and join it with lo[:n] into
    dst[:2n], n = len(dst) // 2 (an odd last byte of dst is not written). HuffError if corrupt.
    scratch needs 2**seg_log2 bytes; with twice that (and rot 0 or 1) each segment's join
    overlaps the decoding of the next one."""
    cdef size_t seg = _seg(seg_log2)
    cdef size_t n = <size_t>dst.shape[0] // 2
    cdef size_t ln = <size_t>src.shape[0]
    cdef const uint8_t *sp = &src[0] if ln else _EMPTY
    cdef int r
    _check_rot(rot)
    if <size_t>lo.shape[0] < n:
        raise ValueError(f"decode2: lo needs {n} bytes, got {lo.shape[0]}")
    if <size_t>scratch.shape[0] < seg:
        raise ValueError(f"decode2: scratch needs {seg} bytes")
    if n == 0:
        if ln:
            raise HuffError("decode2: section for an empty plane is not empty")
        return
    with nogil:
        r = kvh_decode2(sp, ln, &lo[0], &dst[0], n, rot, &scratch[0],
                        <size_t>scratch.shape[0], seg)
    _check(r, "decode2")


def estimate(const uint8_t[::1] src, int maxbits=KVH_DEFAULT_LOG) -> int:
    """Bytes src would take as one Huffman segment (a cheap probe: a histogram, no coding)."""
    cdef size_t n = <size_t>src.shape[0]
    cdef size_t r
    _check_bits(maxbits)
    if n == 0:
        return 0
    with nogil:
        r = kvh_estimate(&src[0], n, maxbits)
    return r


def _use_bmi2(bint use) -> bool:
    """Tests only: decode with the BMI2+LZCNT loop (if the CPU has both; the default) or the
    plain one. Process-wide; returns whether the BMI2+LZCNT loop is in use."""
    return bool(kvh_set_bmi2(1 if use else 0))
