# cython: boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""Byte shuffle for 2-byte (and generic k-byte) elements, used by kvfs.store.codec.

Splitting fp16/bf16 values into a plane of low bytes and a plane of high bytes puts the
low-entropy sign/exponent bytes next to each other, which is what lets zstd's entropy coder
compress KV-cache tensors at all. The loops are SSE2 (x86-64 baseline) with an AVX2 path chosen
at run time, fall back to plain C elsewhere, and run without the GIL so the chunk store's worker
threads can shuffle in parallel. All functions write into caller-provided buffers (anything with
the writable buffer protocol: bytearray, memoryview, numpy array) and raise ValueError when a
buffer is too small instead of writing out of bounds. Sources and destinations must not overlap.

Plane convention: plane j holds byte j of every element (little-endian, so for fp16/bf16 plane 0
is the low byte, plane 1 the high byte). ``rot`` rotates each 16-bit element left by ``rot`` bits
before splitting (and right after joining): rot=1 turns bf16 ``s eeeeeeee mmmmmmm`` into
``eeeeeeee mmmmmmm s`` so that the high plane is exactly the exponent.
"""

from libc.stdint cimport uint8_t

cdef extern from *:
    """
    #include <stddef.h>
    #include <stdint.h>
    #include <string.h>
    #include <math.h>

    static void kv_split2_scalar(const uint8_t *src, uint8_t *lo, uint8_t *hi,
                                 size_t n, size_t i, int rot)
    {
        for (; i < n; i++) {
            uint32_t v = (uint32_t)src[2 * i] | ((uint32_t)src[2 * i + 1] << 8);
            v = ((v << rot) | (v >> (16 - rot))) & 0xffffu;
            lo[i] = (uint8_t)v;
            hi[i] = (uint8_t)(v >> 8);
        }
    }

    static void kv_join2_scalar(const uint8_t *lo, const uint8_t *hi, uint8_t *dst,
                                size_t n, size_t i, int rot)
    {
        for (; i < n; i++) {
            uint32_t v = (uint32_t)lo[i] | ((uint32_t)hi[i] << 8);
            v = ((v >> rot) | (v << (16 - rot))) & 0xffffu;
            dst[2 * i] = (uint8_t)v;
            dst[2 * i + 1] = (uint8_t)(v >> 8);
        }
    }

    #if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    #include <immintrin.h>
    #define KV_X86 1

    /* rot == 0 is a no-op: a 16-bit shift by 16 yields 0, so (v << 0) | (v >> 16) == v. */
    static inline __m128i kv_rotl16_128(__m128i v, __m128i l, __m128i r)
    {
        return _mm_or_si128(_mm_sll_epi16(v, l), _mm_srl_epi16(v, r));
    }

    static size_t kv_split2_sse2(const uint8_t *src, uint8_t *lo, uint8_t *hi, size_t n, int rot)
    {
        const __m128i mask = _mm_set1_epi16(0x00ff);
        const __m128i l = _mm_cvtsi32_si128(rot), r = _mm_cvtsi32_si128(16 - rot);
        size_t i = 0;
        for (; i + 16 <= n; i += 16) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + 2 * i));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + 2 * i + 16));
            a = kv_rotl16_128(a, l, r);
            b = kv_rotl16_128(b, l, r);
            _mm_storeu_si128((__m128i *)(lo + i),
                             _mm_packus_epi16(_mm_and_si128(a, mask), _mm_and_si128(b, mask)));
            _mm_storeu_si128((__m128i *)(hi + i),
                             _mm_packus_epi16(_mm_srli_epi16(a, 8), _mm_srli_epi16(b, 8)));
        }
        return i;
    }

    static size_t kv_join2_sse2(const uint8_t *lo, const uint8_t *hi, uint8_t *dst, size_t n, int rot)
    {
        const __m128i l = _mm_cvtsi32_si128(16 - rot), r = _mm_cvtsi32_si128(rot);
        size_t i = 0;
        for (; i + 16 <= n; i += 16) {
            __m128i x = _mm_loadu_si128((const __m128i *)(lo + i));
            __m128i y = _mm_loadu_si128((const __m128i *)(hi + i));
            /* rotate right by rot == rotate left by 16 - rot */
            _mm_storeu_si128((__m128i *)(dst + 2 * i), kv_rotl16_128(_mm_unpacklo_epi8(x, y), l, r));
            _mm_storeu_si128((__m128i *)(dst + 2 * i + 16), kv_rotl16_128(_mm_unpackhi_epi8(x, y), l, r));
        }
        return i;
    }

    __attribute__((target("avx2")))
    static size_t kv_split2_avx2(const uint8_t *src, uint8_t *lo, uint8_t *hi, size_t n, int rot)
    {
        const __m256i mask = _mm256_set1_epi16(0x00ff);
        const __m128i l = _mm_cvtsi32_si128(rot), r = _mm_cvtsi32_si128(16 - rot);
        size_t i = 0;
        for (; i + 32 <= n; i += 32) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(src + 2 * i));
            __m256i b = _mm256_loadu_si256((const __m256i *)(src + 2 * i + 32));
            a = _mm256_or_si256(_mm256_sll_epi16(a, l), _mm256_srl_epi16(a, r));
            b = _mm256_or_si256(_mm256_sll_epi16(b, l), _mm256_srl_epi16(b, r));
            /* packus works per 128-bit lane: quads come out as a0 b0 a1 b1, 0xD8 reorders them */
            __m256i pl = _mm256_packus_epi16(_mm256_and_si256(a, mask), _mm256_and_si256(b, mask));
            __m256i ph = _mm256_packus_epi16(_mm256_srli_epi16(a, 8), _mm256_srli_epi16(b, 8));
            _mm256_storeu_si256((__m256i *)(lo + i), _mm256_permute4x64_epi64(pl, 0xD8));
            _mm256_storeu_si256((__m256i *)(hi + i), _mm256_permute4x64_epi64(ph, 0xD8));
        }
        return i;
    }

    __attribute__((target("avx2")))
    static size_t kv_join2_avx2(const uint8_t *lo, const uint8_t *hi, uint8_t *dst, size_t n, int rot)
    {
        const __m128i l = _mm_cvtsi32_si128(16 - rot), r = _mm_cvtsi32_si128(rot);
        size_t i = 0;
        for (; i + 32 <= n; i += 32) {
            __m256i x = _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i *)(lo + i)), 0xD8);
            __m256i y = _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i *)(hi + i)), 0xD8);
            __m256i a = _mm256_unpacklo_epi8(x, y);
            __m256i b = _mm256_unpackhi_epi8(x, y);
            a = _mm256_or_si256(_mm256_sll_epi16(a, l), _mm256_srl_epi16(a, r));
            b = _mm256_or_si256(_mm256_sll_epi16(b, l), _mm256_srl_epi16(b, r));
            _mm256_storeu_si256((__m256i *)(dst + 2 * i), a);
            _mm256_storeu_si256((__m256i *)(dst + 2 * i + 32), b);
        }
        return i;
    }

    static int kv_have_avx2(void)
    {
        static int cached = -1;
        if (cached < 0) {
            __builtin_cpu_init();
            cached = __builtin_cpu_supports("avx2") ? 1 : 0;
        }
        return cached;
    }
    #else
    #define KV_X86 0
    static int kv_have_avx2(void) { return 0; }
    #endif

    static int kv_simd_level(void)
    {
    #if KV_X86
        return kv_have_avx2() ? 2 : 1;
    #else
        return 0;
    #endif
    }

    /* level: -1 = best available, 0 = scalar, 1 = SSE2, 2 = AVX2 (for tests/benchmarks). */
    static void kv_split2(const uint8_t *src, uint8_t *lo, uint8_t *hi, size_t n, int rot, int level)
    {
        size_t i = 0;
        if (level < 0) level = kv_simd_level();
    #if KV_X86
        if (level >= 2 && kv_have_avx2()) i = kv_split2_avx2(src, lo, hi, n, rot);
        else if (level >= 1) i = kv_split2_sse2(src, lo, hi, n, rot);
    #endif
        kv_split2_scalar(src, lo, hi, n, i, rot);
    }

    static void kv_join2(const uint8_t *lo, const uint8_t *hi, uint8_t *dst, size_t n, int rot, int level)
    {
        size_t i = 0;
        if (level < 0) level = kv_simd_level();
    #if KV_X86
        if (level >= 2 && kv_have_avx2()) i = kv_join2_avx2(lo, hi, dst, n, rot);
        else if (level >= 1) i = kv_join2_sse2(lo, hi, dst, n, rot);
    #endif
        kv_join2_scalar(lo, hi, dst, n, i, rot);
    }

    /* 4-byte shuffle as two rounds of split2 through a small stack buffer (stays in L1):
       bytes -> (b0 b2 ..) and (b1 b3 ..) -> planes 0,2 and 1,3. ~10x the plain strided loop. */
    #define KV_BLK 2048
    static void kv_shuffle4(const uint8_t *src, uint8_t *dst, size_t n)
    {
        uint8_t ev[2 * KV_BLK], od[2 * KV_BLK];
        size_t i, m;
        for (i = 0; i < n; i += m) {
            m = n - i < KV_BLK ? n - i : KV_BLK;
            kv_split2(src + 4 * i, ev, od, 2 * m, 0, -1);
            kv_split2(ev, dst + i, dst + 2 * n + i, m, 0, -1);
            kv_split2(od, dst + n + i, dst + 3 * n + i, m, 0, -1);
        }
    }

    static void kv_unshuffle4(const uint8_t *src, uint8_t *dst, size_t n)
    {
        uint8_t ev[2 * KV_BLK], od[2 * KV_BLK];
        size_t i, m;
        for (i = 0; i < n; i += m) {
            m = n - i < KV_BLK ? n - i : KV_BLK;
            kv_join2(src + i, src + 2 * n + i, ev, m, 0, -1);
            kv_join2(src + n + i, src + 3 * n + i, od, m, 0, -1);
            kv_join2(ev, od, dst + 4 * i, 2 * m, 0, -1);
        }
    }

    /* Generic k-byte shuffle: dst = plane 0 | plane 1 | ... | plane k-1 | tail. */
    static void kv_shuffle_k(const uint8_t *src, uint8_t *dst, size_t len, size_t k)
    {
        size_t n = len / k, j, i;
        if (k == 4) {
            kv_shuffle4(src, dst, n);
            memcpy(dst + n * k, src + n * k, len - n * k);
            return;
        }
        for (j = 0; j < k; j++) {
            uint8_t *out = dst + j * n;
            const uint8_t *in = src + j;
            for (i = 0; i < n; i++) out[i] = in[i * k];
        }
        memcpy(dst + n * k, src + n * k, len - n * k);
    }

    static void kv_unshuffle_k(const uint8_t *src, uint8_t *dst, size_t len, size_t k)
    {
        size_t n = len / k, j, i;
        if (k == 4) {
            kv_unshuffle4(src, dst, n);
            memcpy(dst + n * k, src + n * k, len - n * k);
            return;
        }
        for (j = 0; j < k; j++) {
            const uint8_t *in = src + j * n;
            uint8_t *out = dst + j;
            for (i = 0; i < n; i++) out[i * k] = in[i];
        }
        memcpy(dst + n * k, src + n * k, len - n * k);
    }

    /* The 8-byte loads below read elements in little-endian order; elsewhere bytewise. */
    #define KV_LE (__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__)

    /* x * log2(x) for the small counts that dominate histograms of a few KiB: a table
       instead of up to 256 log2 calls per histogram (~8 ns each, seven histograms per
       profile). Filled once, at module import. */
    #define KV_XLOGX_N 4096
    static double kv_xlogx[KV_XLOGX_N];

    static void kv_init_tables(void)
    {
        int i;
        kv_xlogx[0] = 0.0;
        for (i = 1; i < KV_XLOGX_N; i++) kv_xlogx[i] = (double)i * log2((double)i);
    }

    /* Order-0 entropy (bits per symbol) of a 256-bin histogram:
       H = log2(total) - sum(h * log2(h)) / total. */
    static double kv_entropy(const uint32_t *h, size_t total)
    {
        double acc = 0.0;
        int i;
        if (total == 0) return 0.0;
        for (i = 0; i < 256; i++) {
            uint32_t c = h[i];
            acc += c < KV_XLOGX_N ? kv_xlogx[c] : (double)c * log2((double)c);
        }
        return log2((double)total) - acc / (double)total;
    }

    /* Entropies of the byte planes of src seen as 1-, 2- and 4-byte elements, from one pass:
       out = {H(all), H(plane 0 of 2), H(plane 1 of 2), H(plane 0 of 4) .. H(plane 3 of 4)}.
       Two tables per plane (even/odd elements), fed from 8-byte loads: a run of one value
       (zero pages, exponent planes) would otherwise serialise on one counter. */
    static void kv_entropy_profile(const uint8_t *src, size_t len, double *out)
    {
        uint32_t h[8][256], m[256];
        size_t i, n = len / 4;
        int j;
        memset(h, 0, sizeof h);
        for (i = 0; KV_LE && i + 2 <= n; i += 2) {
            uint64_t w;
            memcpy(&w, src + 4 * i, 8);
            h[0][w & 0xff]++; h[1][(w >> 8) & 0xff]++;
            h[2][(w >> 16) & 0xff]++; h[3][(w >> 24) & 0xff]++;
            h[4][(w >> 32) & 0xff]++; h[5][(w >> 40) & 0xff]++;
            h[6][(w >> 48) & 0xff]++; h[7][w >> 56]++;
        }
        for (; i < n; i++) {
            h[0][src[4 * i]]++; h[1][src[4 * i + 1]]++;
            h[2][src[4 * i + 2]]++; h[3][src[4 * i + 3]]++;
        }
        for (j = 0; j < 4; j++) {
            int s;
            for (s = 0; s < 256; s++) h[j][s] += h[j + 4][s];
        }
        for (j = 0; j < 256; j++) m[j] = h[0][j] + h[1][j] + h[2][j] + h[3][j];
        out[0] = kv_entropy(m, 4 * n);
        for (j = 0; j < 256; j++) m[j] = h[0][j] + h[2][j];
        out[1] = kv_entropy(m, 2 * n);
        for (j = 0; j < 256; j++) m[j] = h[1][j] + h[3][j];
        out[2] = kv_entropy(m, 2 * n);
        for (j = 0; j < 4; j++) out[3 + j] = kv_entropy(h[j], n);
    }

    /* Entropy of ((u16 >> shift) & 0xff) over the little-endian 16-bit elements of src; four
       tables fed from 8-byte loads, as above. */
    static double kv_u16_entropy(const uint8_t *src, size_t n, int shift)
    {
        uint32_t h[4][256];
        size_t i;
        int s;
        memset(h, 0, sizeof h);
        for (i = 0; KV_LE && i + 4 <= n; i += 4) {
            uint64_t w;
            memcpy(&w, src + 2 * i, 8);
            w >>= shift;
            h[0][w & 0xff]++; h[1][(w >> 16) & 0xff]++;
            h[2][(w >> 32) & 0xff]++; h[3][(w >> 48) & 0xff]++;
        }
        for (; i < n; i++) {
            uint32_t v = (uint32_t)src[2 * i] | ((uint32_t)src[2 * i + 1] << 8);
            h[0][(v >> shift) & 0xffu]++;
        }
        for (s = 0; s < 256; s++) h[0][s] += h[1][s] + h[2][s] + h[3][s];
        return kv_entropy(h[0], n);
    }
    """
    void kv_init_tables() nogil
    void kv_entropy_profile(const uint8_t *src, size_t len, double *out) nogil
    double kv_u16_entropy(const uint8_t *src, size_t n, int shift) nogil
    void kv_split2(const uint8_t *src, uint8_t *lo, uint8_t *hi, size_t n, int rot, int level) nogil
    void kv_join2(const uint8_t *lo, const uint8_t *hi, uint8_t *dst, size_t n, int rot, int level) nogil
    void kv_shuffle_k(const uint8_t *src, uint8_t *dst, size_t len, size_t k) nogil
    void kv_unshuffle_k(const uint8_t *src, uint8_t *dst, size_t len, size_t k) nogil

from cpython.bytearray cimport PyByteArray_FromStringAndSize
from libc.string cimport memcpy

kv_init_tables()  # the entropy table, before any function of this module can run


cdef inline int _check_rot(int rot) except -1:
    if rot < 0 or rot > 15:
        raise ValueError(f"rot must be in 0..15, got {rot}")
    return 0


cdef inline int _check_level(int level) except -1:
    if level < -1 or level > 2:
        raise ValueError(f"level must be -1, 0, 1 or 2, got {level}")
    return 0


def split2(const uint8_t[::1] src, uint8_t[::1] lo, uint8_t[::1] hi, int rot=0, int level=-1):
    """Split the len(src) // 2 whole 2-byte elements of src into planes lo (byte 0) and hi (byte 1).

    Writes n = len(src) // 2 bytes to each of lo and hi and returns n. A trailing odd byte of src
    is not touched: it is src[-1], the caller keeps it as is. level forces a code path (tests).
    """
    cdef size_t n = <size_t>src.shape[0] // 2
    _check_rot(rot)
    _check_level(level)
    if <size_t>lo.shape[0] < n or <size_t>hi.shape[0] < n:
        raise ValueError(f"split2: planes need {n} bytes, got {lo.shape[0]} and {hi.shape[0]}")
    if n == 0:
        return 0
    with nogil:
        kv_split2(&src[0], &lo[0], &hi[0], n, rot, level)
    return n


def join2(const uint8_t[::1] lo, const uint8_t[::1] hi, uint8_t[::1] dst, int rot=0, int level=-1):
    """Inverse of split2: interleave n = len(dst) // 2 bytes of lo and hi into dst; returns n.

    If len(dst) is odd, its last byte is not written (the caller puts the trailing byte there).
    """
    cdef size_t n = <size_t>dst.shape[0] // 2
    _check_rot(rot)
    _check_level(level)
    if <size_t>lo.shape[0] < n or <size_t>hi.shape[0] < n:
        raise ValueError(f"join2: planes need {n} bytes, got {lo.shape[0]} and {hi.shape[0]}")
    if n == 0:
        return 0
    with nogil:
        kv_join2(&lo[0], &hi[0], &dst[0], n, rot, level)
    return n


def shuffle2(const uint8_t[::1] src, uint8_t[::1] dst, int rot=0):
    """dst[:len(src)] = low plane | high plane | trailing odd byte (copied as is)."""
    cdef size_t ln = <size_t>src.shape[0]
    cdef size_t n = ln // 2
    _check_rot(rot)
    if <size_t>dst.shape[0] < ln:
        raise ValueError(f"shuffle2: dst needs {ln} bytes, got {dst.shape[0]}")
    if ln == 0:
        return
    with nogil:
        if n:
            kv_split2(&src[0], &dst[0], &dst[n], n, rot, -1)
        if ln & 1:
            dst[2 * n] = src[2 * n]


def unshuffle2(const uint8_t[::1] src, uint8_t[::1] dst, int rot=0):
    """Inverse of shuffle2: dst[:len(src)] = the interleaved elements (+ trailing byte)."""
    cdef size_t ln = <size_t>src.shape[0]
    cdef size_t n = ln // 2
    _check_rot(rot)
    if <size_t>dst.shape[0] < ln:
        raise ValueError(f"unshuffle2: dst needs {ln} bytes, got {dst.shape[0]}")
    if ln == 0:
        return
    with nogil:
        if n:
            kv_join2(&src[0], &src[n], &dst[0], n, rot, -1)
        if ln & 1:
            dst[2 * n] = src[2 * n]


def shuffle(const uint8_t[::1] src, uint8_t[::1] dst, Py_ssize_t elem_size):
    """Generic byte shuffle for elem_size-byte elements: dst = plane 0 | ... | plane k-1 | tail."""
    cdef size_t ln = <size_t>src.shape[0]
    if elem_size < 1:
        raise ValueError("elem_size must be >= 1")
    if <size_t>dst.shape[0] < ln:
        raise ValueError(f"shuffle: dst needs {ln} bytes, got {dst.shape[0]}")
    if ln == 0:
        return
    if elem_size == 2:
        shuffle2(src, dst)
        return
    with nogil:
        if elem_size == 1:
            memcpy(&dst[0], &src[0], ln)
        else:
            kv_shuffle_k(&src[0], &dst[0], ln, <size_t>elem_size)


def unshuffle(const uint8_t[::1] src, uint8_t[::1] dst, Py_ssize_t elem_size):
    """Inverse of shuffle."""
    cdef size_t ln = <size_t>src.shape[0]
    if elem_size < 1:
        raise ValueError("elem_size must be >= 1")
    if <size_t>dst.shape[0] < ln:
        raise ValueError(f"unshuffle: dst needs {ln} bytes, got {dst.shape[0]}")
    if ln == 0:
        return
    if elem_size == 2:
        unshuffle2(src, dst)
        return
    with nogil:
        if elem_size == 1:
            memcpy(&dst[0], &src[0], ln)
        else:
            kv_unshuffle_k(&src[0], &dst[0], ln, <size_t>elem_size)


def entropy_profile(const uint8_t[::1] src) -> tuple:
    """Order-0 entropies (bits/byte) of src's byte planes, for codec detection:
    (all bytes, plane 0 and 1 of 2-byte elements, planes 0..3 of 4-byte elements).
    Only the first len(src) // 4 * 4 bytes are counted."""
    cdef double out[7]
    cdef size_t ln = <size_t>src.shape[0]
    if ln < 4:
        return (0.0,) * 7
    with nogil:
        kv_entropy_profile(&src[0], ln, out)
    return tuple(out[i] for i in range(7))


def u16_entropy(const uint8_t[::1] src, int shift) -> float:
    """Order-0 entropy of ((x >> shift) & 0xff) over src's little-endian 16-bit elements."""
    cdef size_t n = <size_t>src.shape[0] // 2
    cdef double e
    if shift < 0 or shift > 8:
        raise ValueError(f"shift must be in 0..8, got {shift}")
    if n == 0:
        return 0.0
    with nogil:
        e = kv_u16_entropy(&src[0], n, shift)
    return e


def empty_bytearray(Py_ssize_t n) -> bytearray:
    """A bytearray of n bytes left uninitialised (bytearray(n) zero-fills, a wasted pass over
    memory for a buffer that is about to be overwritten entirely)."""
    if n < 0:
        raise ValueError("n must be >= 0")
    return PyByteArray_FromStringAndSize(NULL, n)
