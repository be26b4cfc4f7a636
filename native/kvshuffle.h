/* kvshuffle.h: split 16-bit elements into a low and a high byte plane and back, with an optional
 * rotate-left of each element first (rot = 1 makes the bf16 high plane exactly the exponent).
 * Header-only, SSE2 on x86-64 (its baseline, so safe on any x86-64 CPU), plain C elsewhere.
 * Used by native/_huff.pyx to fuse the split with Huffman coding segment by segment, so a segment
 * is coded while it is still in L1/L2. Same convention as native/_shuffle.pyx. */
#ifndef KVSHUFFLE_H
#define KVSHUFFLE_H

#include <stddef.h>
#include <stdint.h>

#if defined(__SSE2__) && (defined(__x86_64__) || defined(_M_X64))
#include <emmintrin.h>
#define KVS_SSE2 1
#else
#define KVS_SSE2 0
#endif

static inline void kvs_split2(const uint8_t *src, uint8_t *lo, uint8_t *hi, size_t n, int rot)
{
    size_t i = 0;
#if KVS_SSE2
    const __m128i mask = _mm_set1_epi16(0x00ff);
    const __m128i l = _mm_cvtsi32_si128(rot), r = _mm_cvtsi32_si128(16 - rot);
    for (; i + 16 <= n; i += 16) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + 2 * i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 2 * i + 16));
        /* a 16-bit shift by 16 gives 0, so rot = 0 leaves the element as is */
        a = _mm_or_si128(_mm_sll_epi16(a, l), _mm_srl_epi16(a, r));
        b = _mm_or_si128(_mm_sll_epi16(b, l), _mm_srl_epi16(b, r));
        _mm_storeu_si128((__m128i *)(lo + i),
                         _mm_packus_epi16(_mm_and_si128(a, mask), _mm_and_si128(b, mask)));
        _mm_storeu_si128((__m128i *)(hi + i),
                         _mm_packus_epi16(_mm_srli_epi16(a, 8), _mm_srli_epi16(b, 8)));
    }
#endif
    for (; i < n; i++) {
        uint32_t v = (uint32_t)src[2 * i] | ((uint32_t)src[2 * i + 1] << 8);
        v = ((v << rot) | (v >> (16 - rot))) & 0xffffu;
        lo[i] = (uint8_t)v;
        hi[i] = (uint8_t)(v >> 8);
    }
}

static inline void kvs_join2(const uint8_t *lo, const uint8_t *hi, uint8_t *dst, size_t n, int rot)
{
    size_t i = 0;
#if KVS_SSE2
    const __m128i l = _mm_cvtsi32_si128(16 - rot), r = _mm_cvtsi32_si128(rot);
    for (; i + 16 <= n; i += 16) {
        __m128i x = _mm_loadu_si128((const __m128i *)(lo + i));
        __m128i y = _mm_loadu_si128((const __m128i *)(hi + i));
        __m128i a = _mm_unpacklo_epi8(x, y), b = _mm_unpackhi_epi8(x, y);
        /* rotate right by rot = rotate left by 16 - rot */
        _mm_storeu_si128((__m128i *)(dst + 2 * i), _mm_or_si128(_mm_sll_epi16(a, l), _mm_srl_epi16(a, r)));
        _mm_storeu_si128((__m128i *)(dst + 2 * i + 16), _mm_or_si128(_mm_sll_epi16(b, l), _mm_srl_epi16(b, r)));
    }
#endif
    for (; i < n; i++) {
        uint32_t v = (uint32_t)lo[i] | ((uint32_t)hi[i] << 8);
        v = ((v >> rot) | (v << (16 - rot))) & 0xffffu;
        dst[2 * i] = (uint8_t)v;
        dst[2 * i + 1] = (uint8_t)(v >> 8);
    }
}

#if defined(__GNUC__) || defined(__clang__)
#define KVS_INLINE static inline __attribute__((always_inline))
#else
#define KVS_INLINE static inline
#endif

#if KVS_SSE2
/* 16 elements of kvs_join2_nt at element i (dst + 2 * i 16-byte aligned). Meant to be called with
 * a constant rot, which leaves fp16 (0) without shifts and bf16 (1) with immediate ones; l and r
 * (16 - rot and rot as shift counts) serve any other rot. */
KVS_INLINE void kvs_join16_nt(const uint8_t *lo, const uint8_t *hi, uint8_t *dst, size_t i,
                              int rot, __m128i l, __m128i r)
{
    __m128i x = _mm_loadu_si128((const __m128i *)(lo + i));
    __m128i y = _mm_loadu_si128((const __m128i *)(hi + i));
    __m128i a = _mm_unpacklo_epi8(x, y), b = _mm_unpackhi_epi8(x, y);
    if (rot == 1) {
        a = _mm_or_si128(_mm_slli_epi16(a, 15), _mm_srli_epi16(a, 1));
        b = _mm_or_si128(_mm_slli_epi16(b, 15), _mm_srli_epi16(b, 1));
    } else if (rot != 0) {
        a = _mm_or_si128(_mm_sll_epi16(a, l), _mm_srl_epi16(a, r));
        b = _mm_or_si128(_mm_sll_epi16(b, l), _mm_srl_epi16(b, r));
    }
    _mm_stream_si128((__m128i *)(dst + 2 * i), a);
    _mm_stream_si128((__m128i *)(dst + 2 * i + 16), b);
}
#endif

/* kvs_join2 with non-temporal stores where dst allows (16-byte aligned after an even prefix):
 * for decoding into a buffer that is not in cache (a fresh chunk buffer, a DRAM slot), where
 * ordinary stores would first read every line in from memory. Call kvs_sfence() when done. */
static inline void kvs_join2_nt(const uint8_t *lo, const uint8_t *hi, uint8_t *dst, size_t n, int rot)
{
#if KVS_SSE2
    size_t i = 0, pre;
    const __m128i l = _mm_cvtsi32_si128(16 - rot), r = _mm_cvtsi32_si128(rot);
    if (((uintptr_t)dst & 1) != 0) {
        kvs_join2(lo, hi, dst, n, rot);
        return;
    }
    pre = ((16 - ((uintptr_t)dst & 15)) & 15) / 2;
    if (pre > n) pre = n;
    kvs_join2(lo, hi, dst, pre, rot);
    i = pre;
    if (rot == 0)
        for (; i + 16 <= n; i += 16) kvs_join16_nt(lo, hi, dst, i, 0, l, r);
    else if (rot == 1)
        for (; i + 16 <= n; i += 16) kvs_join16_nt(lo, hi, dst, i, 1, l, r);
    else
        for (; i + 16 <= n; i += 16) kvs_join16_nt(lo, hi, dst, i, rot, l, r);
    kvs_join2(lo + i, hi + i, dst + 2 * i, n - i, rot);
#else
    kvs_join2(lo, hi, dst, n, rot);
#endif
}

static inline void kvs_sfence(void)
{
#if KVS_SSE2
    _mm_sfence();
#endif
}

#endif /* KVSHUFFLE_H */
