/* kvhuff.h: a fast canonical Huffman coder for byte planes (header-only, used by native/_huff.pyx).
 *
 * Built for the sign/exponent plane of fp16/bf16 KV-cache tensors: a skewed, slowly drifting byte
 * distribution with no useful repeats, where an order-0 entropy coder is all that pays. A plane is
 * cut into segments (64 KiB by default) with their own code, so the statistics follow the data.
 *
 * Plane section (all integers little-endian):
 *     u32 * nseg            byte length of each segment, nseg = ceil(n / seg)
 *     segments back to back, each starting with a kind byte:
 *       0 RAW    the segment's bytes as is
 *       1 CONST  one byte: every byte of the segment has this value
 *       2 HUF    u8 maxlen (1..KVH_MAX_LOG), u8 first, u8 last: the symbols that may occur;
 *                ceil((last - first + 1) / 2) bytes of 4-bit code lengths of symbols first..last
 *                (low nibble first, 0 = absent; they must form a complete prefix code);
 *                u32 * 3 byte lengths of streams 0..2; streams 0..3 (stream 3 takes the rest).
 *                Stream j codes quarter j of the segment (q = m / 4 symbols each, the last quarter
 *                also the m % 4 left over), so the decoder runs 4 independent dependency chains.
 *                Codes are canonical (shorter codes first, ties by symbol value) and written
 *                least significant bit first, each code's first bit lowest; a stream is padded
 *                with zero bits to a whole byte and must be consumed exactly.
 *
 * The decoder never reads or writes outside the buffers it is given, whatever the input: every
 * length is checked, the code must be complete (so every table entry is a valid symbol), and
 * the fast loop only runs while 8 bytes of input are left. Errors are negative return codes.
 */
#ifndef KVHUFF_H
#define KVHUFF_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvshuffle.h"

#define KVH_MAX_LOG 12 /* longest code the decoder accepts (4-bit lengths could say 15) */
#define KVH_DEFAULT_LOG 11
#define KVH_SLACK 16 /* the encoder may store up to this many bytes past its output */

#define KVH_ERR_CORRUPT (-1)
#define KVH_ERR_SPACE (-2)
#define KVH_ERR_ARG (-3)

enum { KVH_SEG_RAW = 0, KVH_SEG_CONST = 1, KVH_SEG_HUF = 2 };

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define KVH_LE64(x) __builtin_bswap64(x)
#define KVH_LE32(x) __builtin_bswap32(x)
#else
#define KVH_LE64(x) (x)
#define KVH_LE32(x) (x)
#endif

static inline uint64_t kvh_load64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return KVH_LE64(v);
}

static inline void kvh_store64(uint8_t *p, uint64_t v)
{
    v = KVH_LE64(v);
    memcpy(p, &v, 8);
}

static inline uint32_t kvh_load32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return KVH_LE32(v);
}

static inline void kvh_store32(uint8_t *p, uint32_t v)
{
    v = KVH_LE32(v);
    memcpy(p, &v, 4);
}

/* Worst-case section size for a plane of n bytes in segments of seg bytes (every segment raw),
 * plus the slack the encoder may scribble past its end. */
static inline size_t kvh_plane_bound(size_t n, size_t seg)
{
    size_t nseg = seg ? (n + seg - 1) / seg : 0;
    return 5 * nseg + n + KVH_SLACK;
}

/* ------------------------------------------------------------------ code construction */

/* Sort 64-bit keys ascending (n <= 256): bottom-up merge sort, no recursion. */
static inline void kvh_sort64(uint64_t *a, int n)
{
    uint64_t tmp[256];
    uint64_t *src = a, *dst = tmp;
    int width, i;
    for (width = 1; width < n; width *= 2) {
        for (i = 0; i < n; i += 2 * width) {
            int l = i, m = i + width < n ? i + width : n, r = i + 2 * width < n ? i + 2 * width : n;
            int p = l, q = m, k = l;
            while (p < m && q < r) dst[k++] = src[p] <= src[q] ? src[p++] : src[q++];
            while (p < m) dst[k++] = src[p++];
            while (q < r) dst[k++] = src[q++];
        }
        { uint64_t *t = src; src = dst; dst = t; }
    }
    if (src != a) memcpy(a, src, (size_t)n * sizeof *a);
}

/* Code lengths (<= maxbits) of a Huffman code for freq; needs >= 2 used symbols and
 * 2^maxbits >= their number. Returns the longest length. */
static inline int kvh_build_lengths(const uint32_t *freq, int maxbits, uint8_t *len)
{
    uint64_t key[256], weight[512];
    uint16_t parent[512];
    uint8_t depth[512];
    uint32_t cnt[512];
    int n = 0, i, li, ii, next, maxd = 0, d, k;

    memset(len, 0, 256);
    for (i = 0; i < 256; i++)
        if (freq[i]) key[n++] = ((uint64_t)freq[i] << 8) | (uint64_t)i;
    if (n < 2) return 0; /* callers code 1 symbol as CONST */
    kvh_sort64(key, n);
    for (i = 0; i < n; i++) weight[i] = key[i] >> 8;
    /* two-queue Huffman: leaves in ascending order, internal nodes are created in ascending order */
    li = 0;
    ii = n;
    for (next = n; next < 2 * n - 1; next++) {
        int pick[2], t;
        for (t = 0; t < 2; t++) {
            if (li < n && (ii >= next || weight[li] <= weight[ii])) pick[t] = li++;
            else pick[t] = ii++;
        }
        weight[next] = weight[pick[0]] + weight[pick[1]];
        parent[pick[0]] = parent[pick[1]] = (uint16_t)next;
    }
    depth[2 * n - 2] = 0;
    memset(cnt, 0, sizeof cnt);
    for (i = 2 * n - 3; i >= 0; i--) {
        depth[i] = (uint8_t)(depth[parent[i]] + 1);
        if (i < n) {
            cnt[depth[i]]++;
            if (depth[i] > maxd) maxd = depth[i];
        }
    }
    /* limit to maxbits keeping the Kraft sum at exactly 1 (the JPEG Annex K.3 adjustment) */
    for (d = maxd; d > maxbits; d--) {
        while (cnt[d] > 0) {
            int j = d - 2;
            while (cnt[j] == 0) j--;
            cnt[d] -= 2;
            cnt[d - 1] += 1;
            cnt[j + 1] += 2;
            cnt[j] -= 1;
        }
    }
    if (maxd > maxbits) maxd = maxbits;
    /* most frequent symbols (end of the sorted leaves) get the shortest codes */
    k = n - 1;
    for (d = 1; d <= maxd; d++) {
        uint32_t c;
        for (c = 0; c < cnt[d]; c++) len[key[k--] & 0xff] = (uint8_t)d;
    }
    while (maxd > 1 && cnt[maxd] == 0) maxd--;
    return maxd;
}

/* The low `bits` (1..16) bits of code in reverse order: all 16 reversed by swaps, then shifted
 * down (a loop over the bits cost 1.6% of fp16 decoding, one call per symbol and segment). */
static inline uint32_t kvh_reverse(uint32_t code, int bits)
{
    uint32_t r = code & 0xffffu;
    r = ((r >> 1) & 0x5555u) | ((r & 0x5555u) << 1);
    r = ((r >> 2) & 0x3333u) | ((r & 0x3333u) << 2);
    r = ((r >> 4) & 0x0f0fu) | ((r & 0x0f0fu) << 4);
    r = ((r >> 8) & 0x00ffu) | ((r & 0x00ffu) << 8);
    return r >> (16 - bits);
}

/* Canonical codes from lengths: ct[s] = bit-reversed code | length << 16 (0 if absent). */
static inline void kvh_canonical(const uint8_t *len, uint32_t *ct)
{
    uint32_t count[KVH_MAX_LOG + 2] = {0}, next[KVH_MAX_LOG + 2];
    uint32_t code = 0;
    int s, l;
    for (s = 0; s < 256; s++) count[len[s]]++;
    count[0] = 0;
    for (l = 1; l <= KVH_MAX_LOG; l++) {
        code = (code + count[l - 1]) << 1;
        next[l] = code;
    }
    for (s = 0; s < 256; s++) {
        l = len[s];
        ct[s] = l ? (kvh_reverse(next[l]++, l) | ((uint32_t)l << 16)) : 0;
    }
}

/* ------------------------------------------------------------------ encoder */

/* Counts of each quarter of a segment of m bytes (quarter 3 also gets the m % 4 left over).
 * Two tables per quarter (even/odd positions): runs of one symbol, common in exponent planes,
 * would otherwise serialise on one counter. */
static inline void kvh_hist4(const uint8_t *src, size_t m, uint32_t h[4][256])
{
    uint32_t g[4][256];
    size_t q = m / 4, i;
    int s;
    const uint8_t *a = src, *b = src + q, *c = src + 2 * q, *d = src + 3 * q;
    memset(h, 0, 4 * 256 * sizeof(uint32_t));
    memset(g, 0, sizeof g);
    for (i = 0; i + 2 <= q; i += 2) {
        h[0][a[i]]++;
        h[1][b[i]]++;
        h[2][c[i]]++;
        h[3][d[i]]++;
        g[0][a[i + 1]]++;
        g[1][b[i + 1]]++;
        g[2][c[i + 1]]++;
        g[3][d[i + 1]]++;
    }
    for (; i < q; i++) {
        h[0][a[i]]++;
        h[1][b[i]]++;
        h[2][c[i]]++;
        h[3][d[i]]++;
    }
    for (i = 4 * q; i < m; i++) h[3][src[i]]++;
    for (s = 0; s < 256; s++) {
        h[0][s] += g[0][s];
        h[1][s] += g[1][s];
        h[2][s] += g[2][s];
        h[3][s] += g[3][s];
    }
}

/* Code m symbols of x into exactly [out, end) (its size computed from the counts). One stream at a
 * time: the encoder is bound by instruction throughput, not latency, so interleaving streams
 * would only add register spills. State lives in locals, which the byte stores cannot alias.
 * Returns 0, or -1 if the stream would not end exactly at end. */
static inline int kvh_encode_stream(const uint8_t *x, size_t m, const uint16_t *code,
                                    const uint8_t *clen, uint8_t *out, uint8_t *end)
{
    uint64_t acc = 0;
    unsigned nb = 0;
    size_t i = 0;
    /* 4 codes (<= 48 bits) + < 8 pending bits fit in the accumulator; the flush stores 8 bytes,
     * so the fast loop stops 8 bytes before the end of this stream */
    for (; i + 4 <= m && out + 8 <= end; i += 4) {
        const uint8_t *y = x + i;
        acc |= (uint64_t)code[y[0]] << nb;
        nb += clen[y[0]];
        acc |= (uint64_t)code[y[1]] << nb;
        nb += clen[y[1]];
        acc |= (uint64_t)code[y[2]] << nb;
        nb += clen[y[2]];
        acc |= (uint64_t)code[y[3]] << nb;
        nb += clen[y[3]];
        kvh_store64(out, acc);
        out += nb >> 3;
        acc >>= nb & ~7u;
        nb &= 7u;
    }
    for (; i < m; i++) {
        acc |= (uint64_t)code[x[i]] << nb;
        nb += clen[x[i]];
        while (nb >= 8) {
            if (out >= end) return -1;
            *out++ = (uint8_t)acc;
            acc >>= 8;
            nb -= 8;
        }
    }
    if (nb) {
        if (out >= end) return -1;
        *out++ = (uint8_t)acc;
    }
    return out == end ? 0 : -1;
}

/* Pair table for the encoder: entry [s1 | s2 << 8] = the codes of s1 then s2 (<= 24 bits) |
 * their total length << 24, filled for the used symbols only (the rest is never read). Halves
 * the work per symbol of the coding loop; filling costs used^2 entries, so it is only used
 * when few symbols occur: the bf16 exponent plane (~20 per 64 KiB segment) codes 15% faster,
 * fp16's high byte (~130) 20% slower (measured). */
#define KVH_PAIR_ENTRIES 65536
#define KVH_PAIR_MAX_USED 64

static inline void kvh_fill_pairs(uint32_t *pt, const uint8_t *used_syms, int used,
                                  const uint16_t *code, const uint8_t *clen)
{
    int a, b;
    for (a = 0; a < used; a++) {
        unsigned s1 = used_syms[a], l1 = clen[s1];
        uint32_t c1 = code[s1];
        for (b = 0; b < used; b++) {
            unsigned s2 = used_syms[b];
            pt[s1 | s2 << 8] = (c1 | (uint32_t)code[s2] << l1) | (l1 + clen[s2]) << 24;
        }
    }
}

/* kvh_encode_stream with the pair table: 2 lookups (<= 48 bits) per flush. */
static inline int kvh_encode_stream2(const uint8_t *x, size_t m, const uint32_t *pt,
                                     const uint16_t *code, const uint8_t *clen, uint8_t *out,
                                     uint8_t *end)
{
    uint64_t acc = 0;
    unsigned nb = 0;
    size_t i = 0;
    for (; i + 4 <= m && out + 8 <= end; i += 4) {
        const uint8_t *y = x + i;
        uint32_t e0 = pt[y[0] | (unsigned)y[1] << 8], e1 = pt[y[2] | (unsigned)y[3] << 8];
        acc |= (uint64_t)(e0 & 0xffffffu) << nb;
        nb += e0 >> 24;
        acc |= (uint64_t)(e1 & 0xffffffu) << nb;
        nb += e1 >> 24;
        kvh_store64(out, acc);
        out += nb >> 3;
        acc >>= nb & ~7u;
        nb &= 7u;
    }
    for (; i < m; i++) {
        acc |= (uint64_t)code[x[i]] << nb;
        nb += clen[x[i]];
        while (nb >= 8) {
            if (out >= end) return -1;
            *out++ = (uint8_t)acc;
            acc >>= 8;
            nb -= 8;
        }
    }
    if (nb) {
        if (out >= end) return -1;
        *out++ = (uint8_t)acc;
    }
    return out == end ? 0 : -1;
}

/* Encode one segment of m bytes into dst (room for cap bytes). A Huffman segment is only written
 * when it is at most m - min_gain bytes, else the segment is stored raw (1 + m bytes).
 * Returns the segment's length, or KVH_ERR_SPACE. */
static inline ptrdiff_t kvh_encode_seg(const uint8_t *src, size_t m, uint8_t *dst, size_t cap,
                                       int maxbits, size_t min_gain, uint32_t *pairs)
{
    uint32_t h[4][256], freq[256], ct[256];
    uint8_t len[256];
    uint64_t qbits[4] = {0, 0, 0, 0};
    size_t qbytes[4], hdr, total, q = m / 4, qn[4];
    int first = -1, last = -1, used = 0, s, j, maxlen;
    uint8_t *p;
    uint8_t *start[4], *end[4];
    const uint8_t *in[4];

    if (m == 0) return 0;
    kvh_hist4(src, m, h);
    for (s = 0; s < 256; s++) {
        freq[s] = h[0][s] + h[1][s] + h[2][s] + h[3][s];
        if (freq[s]) {
            if (first < 0) first = s;
            last = s;
            used++;
        }
    }
    if (used == 1) {
        if (cap < 2) return KVH_ERR_SPACE;
        dst[0] = KVH_SEG_CONST;
        dst[1] = (uint8_t)first;
        return 2;
    }
    maxlen = kvh_build_lengths(freq, maxbits, len);
    kvh_canonical(len, ct);
    total = 0;
    for (j = 0; j < 4; j++) {
        for (s = first; s <= last; s++) qbits[j] += (uint64_t)h[j][s] * len[s];
        qbytes[j] = (size_t)((qbits[j] + 7) / 8);
        total += qbytes[j];
    }
    hdr = 4 + (size_t)(last - first + 2) / 2 + 12;
    if (hdr + total + min_gain > m) {
        if (cap < m + 1) return KVH_ERR_SPACE;
        dst[0] = KVH_SEG_RAW;
        memcpy(dst + 1, src, m);
        return (ptrdiff_t)(m + 1);
    }
    if (cap < hdr + total + KVH_SLACK) return KVH_ERR_SPACE;
    p = dst;
    *p++ = KVH_SEG_HUF;
    *p++ = (uint8_t)maxlen;
    *p++ = (uint8_t)first;
    *p++ = (uint8_t)last;
    for (s = first; s <= last; s += 2) *p++ = (uint8_t)(len[s] | (s + 1 <= last ? len[s + 1] << 4 : 0));
    for (j = 0; j < 3; j++) {
        kvh_store32(p, (uint32_t)qbytes[j]);
        p += 4;
    }
    qn[0] = qn[1] = qn[2] = q;
    qn[3] = m - 3 * q;
    for (j = 0; j < 4; j++) {
        start[j] = p;
        p += qbytes[j];
        end[j] = p;
        in[j] = src + j * q;
    }
    {
        uint16_t code[256];
        uint8_t clen[256];
        for (s = 0; s < 256; s++) {
            code[s] = (uint16_t)ct[s];
            clen[s] = (uint8_t)(ct[s] >> 16);
        }
        if (pairs != NULL && used <= KVH_PAIR_MAX_USED) {
            uint8_t used_syms[256];
            int u = 0;
            for (s = first; s <= last; s++)
                if (freq[s]) used_syms[u++] = (uint8_t)s;
            kvh_fill_pairs(pairs, used_syms, u, code, clen);
            for (j = 0; j < 4; j++)
                if (kvh_encode_stream2(in[j], qn[j], pairs, code, clen, start[j], end[j]) < 0)
                    return KVH_ERR_SPACE;
        } else {
            for (j = 0; j < 4; j++)
                if (kvh_encode_stream(in[j], qn[j], code, clen, start[j], end[j]) < 0)
                    return KVH_ERR_SPACE;
        }
    }
    return (ptrdiff_t)(p - dst);
}

/* Encode a plane of n bytes in segments of seg bytes into dst (cap >= kvh_plane_bound(n, seg)).
 * Returns the section length (without slack) or a negative error. */
static inline ptrdiff_t kvh_encode_plane(const uint8_t *src, size_t n, size_t seg, uint8_t *dst,
                                         size_t cap, int maxbits, size_t min_gain)
{
    size_t nseg, i, pos;
    uint32_t *pairs;
    if (seg == 0 || maxbits < 8 || maxbits > KVH_MAX_LOG) return KVH_ERR_ARG;
    if (cap < kvh_plane_bound(n, seg)) return KVH_ERR_SPACE;
    nseg = (n + seg - 1) / seg;
    pos = 4 * nseg;
    /* the pair table is an optimisation only: without memory, code symbol by symbol */
    pairs = (uint32_t *)malloc(KVH_PAIR_ENTRIES * sizeof(uint32_t));
    for (i = 0; i < nseg; i++) {
        size_t a = i * seg, m = n - a < seg ? n - a : seg;
        ptrdiff_t r = kvh_encode_seg(src + a, m, dst + pos, cap - pos, maxbits, min_gain, pairs);
        if (r < 0) {
            free(pairs);
            return r;
        }
        kvh_store32(dst + 4 * i, (uint32_t)r);
        pos += (size_t)r;
    }
    free(pairs);
    return (ptrdiff_t)pos;
}

/* ------------------------------------------------------------------ decoder */

/* Decode tables.
 * two[x], x = the next `wlog` bits of a stream: 4 bytes, the first symbol, the second (0 unless
 *   its code also lies inside the window), their total code length, their number (1 or 2). The
 *   fast loop stores all 4 bytes and advances by that number: the bytes past it are overwritten
 *   later. nb[x] is the total length again, a byte of its own so that the shift of the bit
 *   buffer, the loop's dependency chain, does not wait for it to be unpacked.
 * one[x], x = the next `log` bits (log = max(maxlen, 11)): 0, the first symbol, its length, 1;
 *   for the careful tail loop and to build two.
 * For long codes the window is a bit wider than the codes (KVH_MAX_LOG): more pairs fit (fp16
 * KV exponents, ~5.7-bit codes: 1.54 symbols per lookup at 11 bits, 1.71 at 12), worth 4
 * lookups per refill instead of 5; short codes (bf16 exponents, ~3 bits) pair up at 11 bits. */
typedef struct {
    uint32_t two[1 << KVH_MAX_LOG];
    uint8_t nb[1 << KVH_MAX_LOG];
    uint32_t one[1 << KVH_MAX_LOG];
    int log;  /* bits indexing one */
    int wlog; /* bits indexing two: log, or KVH_MAX_LOG for long codes */
} kvh_dtable;

#define KVH_E_SYM(e) (((e) >> 8) & 0xffu)
#define KVH_E_LEN(e) (((e) >> 16) & 0xffu)

/* Parse a HUF segment's code description at p (avail bytes) and build the tables. Returns bytes
 * used or -1. */
static inline ptrdiff_t kvh_read_table(const uint8_t *p, size_t avail, kvh_dtable *dt)
{
    uint8_t len[256];
    uint32_t count[KVH_MAX_LOG + 1] = {0}, next[KVH_MAX_LOG + 1], rev[256];
    /* part[2^w + y], y < 2^w: one[y] if its code fits in w bits, else 0 */
    uint32_t part[1 << KVH_MAX_LOG];
    uint32_t code = 0, kraft = 0;
    int maxlen, first, last, s, l, used = 0, tlog, wlog;
    size_t nb;

    if (avail < 3) return -1;
    maxlen = p[0];
    first = p[1];
    last = p[2];
    if (maxlen < 1 || maxlen > KVH_MAX_LOG || last < first) return -1;
    nb = (size_t)(last - first + 2) / 2;
    if (avail < 3 + nb) return -1;
    memset(len, 0, sizeof len);
    for (s = first; s <= last; s++) {
        uint8_t b = p[3 + (s - first) / 2];
        l = ((s - first) & 1) ? b >> 4 : b & 15;
        if (l > maxlen) return -1;
        len[s] = (uint8_t)l;
        if (l) {
            count[l]++;
            used++;
            kraft += 1u << (maxlen - l);
        }
    }
    /* complete code: every maxlen-bit index is the prefix of exactly one code */
    if (used < 2 || kraft != (1u << maxlen)) return -1;
    for (l = 1; l <= maxlen; l++) {
        code = (code + count[l - 1]) << 1;
        next[l] = code;
    }
    /* count[0] is 0 above, so lengths-1 codes start at 0. The tables are at least
     * KVH_DEFAULT_LOG bits wide so that the fast loop can use a constant mask */
    tlog = maxlen < KVH_DEFAULT_LOG ? KVH_DEFAULT_LOG : maxlen;
    for (s = first; s <= last; s++) {
        uint32_t r, step, k, e;
        l = len[s];
        if (!l) continue;
        r = kvh_reverse(next[l]++, l);
        rev[s] = r;
        step = 1u << l;
        e = (uint32_t)s << 8 | (uint32_t)l << 16 | 1u << 24;
        for (k = r; k < (1u << tlog); k += step) dt->one[k] = e;
    }
    dt->log = tlog;
    /* expected code length if symbol probabilities were 2^-len: sum count[l] * l * 2^-l, in
     * units of 2^-maxlen; a wide pair window pays from ~5 bits on */
    {
        uint64_t e = 0;
        for (l = 1; l <= maxlen; l++) e += (uint64_t)count[l] * (uint64_t)l << (maxlen - l);
        wlog = tlog == KVH_MAX_LOG || e > (uint64_t)5 << maxlen ? KVH_MAX_LOG : tlog;
        dt->wlog = wlog;
    }
    /* two[r | y << l] for the code r of length l: its symbol plus the code y starts with if
     * that fits in the w = wlog - l bits left, i.e. part[2^w + y] added to a one-symbol entry
     * (the second symbol and its length land in bytes 1 and 2, the counts add up to 2). The
     * codes tile the window, so every entry is written; by first code, not by entry, as this
     * costs a load, an add and a store per entry. */
    for (l = 1; l <= maxlen; l++) {
        uint32_t w = (uint32_t)(wlog - l), y, *pw = part + (1u << w);
        if (!count[l]) continue;
        for (y = 0; y < (1u << w); y++) {
            uint32_t e = dt->one[y];
            pw[y] = KVH_E_LEN(e) <= w ? e : 0;
        }
    }
    for (s = first; s <= last; s++) {
        uint32_t x, base;
        const uint32_t *pw;
        l = len[s];
        if (!l) continue;
        pw = part + (1u << (wlog - l));
        base = (uint32_t)s | (uint32_t)l << 16 | 1u << 24;
        for (x = rev[s]; x < (1u << wlog); x += 1u << l) {
            uint32_t e = base + *pw++;
            dt->two[x] = e;
            dt->nb[x] = (uint8_t)(e >> 16);
        }
    }
    return (ptrdiff_t)(3 + nb);
}

/* Peek 64 bits at bit position bp of a stream of sl bytes, zero past its end. */
static inline uint64_t kvh_peek_safe(const uint8_t *s, size_t sl, size_t bp)
{
    size_t byte = bp >> 3;
    uint8_t tmp[8] = {0};
    if (byte + 8 <= sl) return kvh_load64(s + byte) >> (bp & 7);
    if (byte < sl) memcpy(tmp, s + byte, sl - byte);
    return kvh_load64(tmp) >> (bp & 7);
}

/* Decode m symbols of one stream from position *bp (careful path, one symbol at a time). */
static inline int kvh_decode_tail(const kvh_dtable *dt, const uint8_t *s, size_t sl, size_t *bp,
                                  uint8_t *o, size_t m)
{
    const uint64_t mask = (1u << dt->log) - 1;
    size_t i, pos = *bp;
    for (i = 0; i < m; i++) {
        uint32_t e = dt->one[kvh_peek_safe(s, sl, pos) & mask];
        o[i] = (uint8_t)KVH_E_SYM(e);
        pos += KVH_E_LEN(e);
        if (pos > 8 * sl) return -1;
    }
    *bp = pos;
    return 0;
}

/* The state of a segment's 4 streams: p[j], the next bit of stream j counted from the start of
 * the segment's data (one base register for all 4); lim[j], the last p at which 8 bytes can be
 * loaded from there inside the stream; o[j] and oe[j], the next output byte and the end of its
 * quarter. */
typedef struct {
    size_t p[4], lim[4];
    uint8_t *o[4], *oe[4];
} kvh_streams;

/* The join of the previous segment (its high plane with the low plane, into the output), done
 * a few elements per fast-loop round while this segment decodes: its memory traffic (the low
 * plane read, the output written with non-temporal stores) then overlaps the decoding, where it
 * took ~20% of decode2's time on its own. The rounds join elements [next, end) in steps, the
 * caller the rest; dst + 2 * next is 16-byte aligned. */
typedef struct {
    const uint8_t *lo, *hi;
    uint8_t *dst;
    size_t next, end;
} kvh_job;

#if KVS_SSE2
/* A round's share of the job: 16 * (K - 2) elements (64 or 96 output bytes), so that it is done
 * before the segment's rounds are (a round decodes ~27 fp16 or ~40 bf16 symbols). */
#define KVH_JOIN_STEP(K, JROT) \
    do { \
        if ((JROT) >= 0 && jn_ + 16 * ((K) - 2) <= je_) { \
            int s_; \
            for (s_ = 0; s_ < (K) - 2; s_++) \
                kvs_join16_nt(jlo_, jhi_, jdst_, jn_ + 16 * (size_t)s_, (JROT), jz_, jz_); \
            jn_ += 16 * ((K) - 2); \
        } \
    } while (0)
#else
#define KVH_JOIN_STEP(K, JROT) do { } while (0)
#endif

/* The fast loop, K lookups of W bits per stream and round: one 64-bit load (>= 57 bits valid)
 * per stream feeds K <= 57 / W lookups, each storing the 4 bytes of its entry and advancing by 1
 * or 2 symbols. Rounds run in batches that no stream can overrun (its 8-byte loads stay inside
 * it, its stores inside its quarter), so the loop itself has no checks; the streams are
 * interleaved lookup by lookup, so that independent work sits close together in program order.
 * Each round then does its share of the job (JROT its rotation, -1 no job; after the lookups
 * measured 1-6% faster than before them on fp16). State in locals, which the byte stores cannot
 * alias. */
#define KVH_FAST(K, W, LOW, JROT, MARK) \
    do { \
        const uint8_t *const jlo_ = job->lo, *const jhi_ = job->hi; \
        uint8_t *const jdst_ = job->dst; \
        const size_t je_ = job->end; \
        size_t jn_ = job->next; \
        KVH_JOIN_ZERO; \
        for (;;) { \
            ptrdiff_t k_ = PTRDIFF_MAX; \
            int j_; \
            for (j_ = 0; j_ < 4; j_++) { \
                ptrdiff_t ri_ = (ptrdiff_t)st->lim[j_] - (ptrdiff_t)st->p[j_]; \
                ptrdiff_t ro_ = (st->oe[j_] - st->o[j_]) - (2 * (K) + 2), t_; \
                if (ri_ < 0 || ro_ < 0) return; \
                t_ = ri_ / ((K) * (W)); \
                if (ro_ / (2 * (K)) < t_) t_ = ro_ / (2 * (K)); \
                if (t_ + 1 < k_) k_ = t_ + 1; \
            } \
            { \
                size_t p0 = st->p[0], p1 = st->p[1], p2 = st->p[2], p3 = st->p[3]; \
                uint8_t *o0 = st->o[0], *o1 = st->o[1], *o2 = st->o[2], *o3 = st->o[3]; \
                do { \
                    uint64_t b0 = (kvh_load64(src + (p0 >> 3)) | (MARK)) >> (p0 & 7); \
                    uint64_t b1 = (kvh_load64(src + (p1 >> 3)) | (MARK)) >> (p1 & 7); \
                    uint64_t b2 = (kvh_load64(src + (p2 >> 3)) | (MARK)) >> (p2 & 7); \
                    uint64_t b3 = (kvh_load64(src + (p3 >> 3)) | (MARK)) >> (p3 & 7); \
                    int r_; \
                    for (r_ = 0; r_ < (K); r_++) { \
                        KVH_LOOKUP(b0, p0, o0, W, LOW, MARK); \
                        KVH_LOOKUP(b1, p1, o1, W, LOW, MARK); \
                        KVH_LOOKUP(b2, p2, o2, W, LOW, MARK); \
                        KVH_LOOKUP(b3, p3, o3, W, LOW, MARK); \
                    } \
                    KVH_JOIN_STEP(K, JROT); \
                    if (MARK) { \
                        p0 = (p0 & ~(size_t)7) + KVH_CLZ64(b0); \
                        p1 = (p1 & ~(size_t)7) + KVH_CLZ64(b1); \
                        p2 = (p2 & ~(size_t)7) + KVH_CLZ64(b2); \
                        p3 = (p3 & ~(size_t)7) + KVH_CLZ64(b3); \
                    } \
                } while (--k_); \
                st->p[0] = p0; st->p[1] = p1; st->p[2] = p2; st->p[3] = p3; \
                st->o[0] = o0; st->o[1] = o1; st->o[2] = o2; st->o[3] = o3; \
                job->next = jn_; \
            } \
        } \
    } while (0)
#define KVH_LOOKUP(b, pos, out, W, LOW, MARK) \
    do { \
        size_t x_ = (size_t)LOW((b), (W)); \
        unsigned n_ = dt->nb[x_]; \
        uint32_t e_ = dt->two[x_]; \
        kvh_store32((out), e_); \
        (out) += e_ >> 24; \
        (b) >>= n_; \
        if (!(MARK)) (pos) += n_; \
    } while (0)
#define KVH_AND(b, W) ((b) & ((1u << (W)) - 1))
#if defined(__GNUC__) || defined(__clang__)
#define KVH_CLZ64(x) ((size_t)__builtin_clzll(x)) /* lzcnt where the target has it */
#else
#define KVH_CLZ64(x) ((size_t)0) /* only the marker loop (MARK != 0, GCC/clang) counts this way */
#endif

#if KVS_SSE2
#define KVH_JOIN_ZERO const __m128i jz_ = _mm_setzero_si128(); (void)jz_
#else
#define KVH_JOIN_ZERO (void)jlo_; (void)jhi_; (void)jdst_; (void)je_
#endif
/* The loop for this segment's code (K, W) and the job's rotation (bf16 1, fp16 0, none -1). */
#define KVH_ROUNDS_BODY(LOW, MARK) \
    do { \
        kvh_job none_ = {NULL, NULL, NULL, 0, 0}; \
        if (job == NULL || job->next >= job->end) jrot = -1; \
        if (jrot < 0) job = &none_; \
        if (dt->wlog == KVH_DEFAULT_LOG) { \
            if (jrot == 0) KVH_FAST(5, KVH_DEFAULT_LOG, LOW, 0, MARK); \
            else if (jrot == 1) KVH_FAST(5, KVH_DEFAULT_LOG, LOW, 1, MARK); \
            else KVH_FAST(5, KVH_DEFAULT_LOG, LOW, -1, MARK); \
        } else { \
            if (jrot == 0) KVH_FAST(4, KVH_MAX_LOG, LOW, 0, MARK); \
            else if (jrot == 1) KVH_FAST(4, KVH_MAX_LOG, LOW, 1, MARK); \
            else KVH_FAST(4, KVH_MAX_LOG, LOW, -1, MARK); \
        } \
    } while (0)

static void kvh_rounds(const uint8_t *src, const kvh_dtable *dt, kvh_streams *st, kvh_job *job,
                       int jrot)
{
    KVH_ROUNDS_BODY(KVH_AND, 0);
}

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
/* The same loop for CPUs with BMI2 and LZCNT (x86-64 since 2013), chosen at run time: shrx
 * shifts by a register without tying up cl (one uop, not two), bzhi masks without a copy, and
 * the bit positions move once per round: the round's load sets bit 63, a marker past the
 * 7 + K * W <= 62 bits the lookups may look at, and its leading zeros after the lookups are
 * (p & 7) + the bits consumed (one lzcnt instead of K adds, p not live during the lookups). */
#include <immintrin.h>
#define KVH_BZHI(b, W) _bzhi_u64((b), (W))

__attribute__((target("bmi2,lzcnt"))) static void kvh_rounds_bmi2(const uint8_t *src,
                                                                  const kvh_dtable *dt,
                                                                  kvh_streams *st, kvh_job *job,
                                                                  int jrot)
{
    KVH_ROUNDS_BODY(KVH_BZHI, (uint64_t)1 << 63);
}
#undef KVH_BZHI

/* 1: the BMI2+LZCNT loop, 0: the plain one, -1: not yet detected (see kvh_set_bmi2) */
static int kvh_bmi2 = -1;

static inline int kvh_have_bmi2(void)
{
    if (kvh_bmi2 < 0) {
        __builtin_cpu_init();
        kvh_bmi2 = __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("lzcnt") ? 1 : 0;
    }
    return kvh_bmi2;
}
#define KVH_ROUNDS(src, dt, st, job, jrot) \
    (kvh_have_bmi2() ? kvh_rounds_bmi2((src), (dt), (st), (job), (jrot)) \
                     : kvh_rounds((src), (dt), (st), (job), (jrot)))
#else
#define KVH_ROUNDS(src, dt, st, job, jrot) kvh_rounds((src), (dt), (st), (job), (jrot))
#endif

/* 0: use the plain loop from now on; otherwise detect (the BMI2+LZCNT loop if the CPU has both).
 * Returns whether that loop is in use. _huff calls it at import; tests switch loops with it. */
static inline int kvh_set_bmi2(int use)
{
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
    kvh_bmi2 = -1;
    if (use == 0 || !kvh_have_bmi2()) kvh_bmi2 = 0;
    return kvh_bmi2;
#else
    (void)use;
    return 0;
#endif
}

/* Decode a HUF segment's body into m bytes at dst; the rounds do some of job's join (may be
 * NULL) on the way, with rotation jrot. */
static inline int kvh_decode_huf(const uint8_t *src, size_t len, uint8_t *dst, size_t m,
                                 kvh_job *job, int jrot)
{
    kvh_dtable dt;
    kvh_streams st;
    ptrdiff_t tl = kvh_read_table(src, len, &dt);
    size_t sl[4], start[4], qn[4], q = m / 4, pos, rest;
    int j, fast = 1;

    if (tl < 0) return KVH_ERR_CORRUPT;
    pos = (size_t)tl;
    if (len - pos < 12) return KVH_ERR_CORRUPT;
    rest = len - pos - 12;
    for (j = 0; j < 3; j++) {
        sl[j] = kvh_load32(src + pos + 4 * j);
        if (sl[j] > rest) return KVH_ERR_CORRUPT;
        rest -= sl[j];
    }
    sl[3] = rest;
    pos += 12;
    qn[0] = qn[1] = qn[2] = q;
    qn[3] = m - 3 * q;
    for (j = 0; j < 4; j++) {
        start[j] = pos;
        st.p[j] = pos * 8;
        pos += sl[j];
        st.lim[j] = sl[j] < 8 ? 0 : (pos - 8) * 8;
        fast &= sl[j] >= 8;
        st.o[j] = dst + j * q;
        st.oe[j] = st.o[j] + qn[j];
    }
    if (fast) KVH_ROUNDS(src, &dt, &st, job, jrot);
    for (j = 0; j < 4; j++) {
        size_t done = (size_t)(st.o[j] - (dst + j * q)), bp = st.p[j] - 8 * start[j];
        if (kvh_decode_tail(&dt, src + start[j], sl[j], &bp, st.o[j], qn[j] - done) < 0)
            return KVH_ERR_CORRUPT;
        /* the stream must end exactly where its last code ends */
        if ((bp + 7) / 8 != sl[j]) return KVH_ERR_CORRUPT;
    }
    return 0;
}
#undef KVH_FAST
#undef KVH_LOOKUP
#undef KVH_AND
#undef KVH_CLZ64
#undef KVH_JOIN_STEP
#undef KVH_JOIN_ZERO
#undef KVH_ROUNDS_BODY
#undef KVH_ROUNDS

/* Decode one segment (len bytes at src) into m bytes at dst (a HUF one doing part of job). */
static inline int kvh_decode_seg(const uint8_t *src, size_t len, uint8_t *dst, size_t m,
                                 kvh_job *job, int jrot)
{
    if (len < 1) return KVH_ERR_CORRUPT;
    switch (src[0]) {
    case KVH_SEG_RAW:
        if (len != m + 1) return KVH_ERR_CORRUPT;
        memcpy(dst, src + 1, m);
        return 0;
    case KVH_SEG_CONST:
        if (len != 2) return KVH_ERR_CORRUPT;
        memset(dst, src[1], m);
        return 0;
    case KVH_SEG_HUF:
        return kvh_decode_huf(src + 1, len - 1, dst, m, job, jrot);
    default:
        return KVH_ERR_CORRUPT;
    }
}

/* Segment i of a plane section: sets p and sl, checking the length table. The offsets are
 * accumulated by the caller in *off (start with 4 * nseg). */
static inline int kvh_segment(const uint8_t *src, size_t len, size_t nseg, size_t i, size_t *off,
                              const uint8_t **p, size_t *sl)
{
    size_t l = kvh_load32(src + 4 * i);
    if (l > len - *off) return KVH_ERR_CORRUPT;
    *p = src + *off;
    *sl = l;
    *off += l;
    if (i + 1 == nseg && *off != len) return KVH_ERR_CORRUPT;
    return 0;
}

/* Decode a whole plane section (len bytes) into n bytes at dst. */
static inline int kvh_decode_plane(const uint8_t *src, size_t len, uint8_t *dst, size_t n, size_t seg)
{
    size_t nseg, i, off;
    if (seg == 0) return KVH_ERR_ARG;
    nseg = (n + seg - 1) / seg;
    if (nseg == 0) return len == 0 ? 0 : KVH_ERR_CORRUPT;
    if (len < 4 * nseg) return KVH_ERR_CORRUPT;
    off = 4 * nseg;
    for (i = 0; i < nseg; i++) {
        const uint8_t *p;
        size_t sl, a = i * seg, m = n - a < seg ? n - a : seg;
        int r = kvh_segment(src, len, nseg, i, &off, &p, &sl);
        if (r < 0) return r;
        r = kvh_decode_seg(p, sl, dst + a, m, NULL, -1);
        if (r < 0) return r;
    }
    return 0;
}

/* ------------------------------------------------------------------ fused with the 2-byte split */

/* Split n 2-byte elements of src (rotated left by rot): low plane into lo, high plane coded
 * into a plane section at dst (cap >= kvh_plane_bound(n, seg)); scratch holds seg bytes. */
static inline ptrdiff_t kvh_encode2(const uint8_t *src, size_t n, int rot, uint8_t *lo,
                                    uint8_t *dst, size_t cap, uint8_t *scratch, size_t seg,
                                    int maxbits, size_t min_gain)
{
    size_t nseg, i, pos;
    uint32_t *pairs;
    if (seg == 0 || maxbits < 8 || maxbits > KVH_MAX_LOG) return KVH_ERR_ARG;
    if (cap < kvh_plane_bound(n, seg)) return KVH_ERR_SPACE;
    nseg = (n + seg - 1) / seg;
    pos = 4 * nseg;
    pairs = (uint32_t *)malloc(KVH_PAIR_ENTRIES * sizeof(uint32_t)); /* may be NULL: see above */
    for (i = 0; i < nseg; i++) {
        size_t a = i * seg, m = n - a < seg ? n - a : seg;
        ptrdiff_t r;
        kvs_split2(src + 2 * a, lo + a, scratch, m, rot);
        r = kvh_encode_seg(scratch, m, dst + pos, cap - pos, maxbits, min_gain, pairs);
        if (r < 0) {
            free(pairs);
            return r;
        }
        kvh_store32(dst + 4 * i, (uint32_t)r);
        pos += (size_t)r;
    }
    free(pairs);
    return (ptrdiff_t)pos;
}

/* Inverse: decode the high-plane section (len bytes) segment by segment into scratch (raw
 * segments are read in place) and join it with lo into dst (2 * n bytes). With scratch_len >=
 * 2 * seg and rot 0 or 1 (fp16, bf16), segments alternate between two scratch halves and each
 * one's join is mostly done by the next one's decoding loop (kvh_job); with seg bytes, each
 * segment is joined after it is decoded. */
static inline int kvh_decode2(const uint8_t *src, size_t len, const uint8_t *lo, uint8_t *dst,
                              size_t n, int rot, uint8_t *scratch, size_t scratch_len, size_t seg)
{
    size_t nseg, i, off, prev = 0;
    kvh_job job = {NULL, NULL, NULL, 0, 0};
    int overlap = KVS_SSE2 && scratch_len / 2 >= seg && (rot == 0 || rot == 1);
    if (seg == 0 || scratch_len < seg) return KVH_ERR_ARG;
    nseg = (n + seg - 1) / seg;
    if (nseg == 0) return len == 0 ? 0 : KVH_ERR_CORRUPT;
    if (len < 4 * nseg) return KVH_ERR_CORRUPT;
    off = 4 * nseg;
    for (i = 0; i < nseg; i++) {
        uint8_t *buf = scratch + (overlap && (i & 1) ? seg : 0);
        const uint8_t *p, *hi = buf;
        size_t sl, a = i * seg, m = n - a < seg ? n - a : seg;
        int r = kvh_segment(src, len, nseg, i, &off, &p, &sl);
        if (r == 0) {
            if (sl == m + 1 && p[0] == KVH_SEG_RAW) hi = p + 1;
            else r = kvh_decode_seg(p, sl, buf, m, prev ? &job : NULL, rot);
        }
        if (r < 0) {
            kvs_sfence();
            return r;
        }
        /* the output is typically a fresh chunk buffer or a DRAM slot, not in cache:
         * non-temporal stores skip reading its lines in first */
        if (prev)
            kvs_join2_nt(job.lo + job.next, job.hi + job.next, job.dst + 2 * job.next,
                         prev - job.next, rot);
        if (overlap && ((uintptr_t)dst & 1) == 0) {
            /* this segment's join is the next one's job, from its first aligned element */
            size_t pre = ((16 - ((uintptr_t)(dst + 2 * a) & 15)) & 15) / 2;
            if (pre > m) pre = m;
            kvs_join2(lo + a, hi, dst + 2 * a, pre, rot);
            job.lo = lo + a;
            job.hi = hi;
            job.dst = dst + 2 * a;
            job.next = pre;
            job.end = m;
            prev = m;
        } else {
            kvs_join2_nt(lo + a, hi, dst + 2 * a, m, rot);
        }
    }
    if (prev)
        kvs_join2_nt(job.lo + job.next, job.hi + job.next, job.dst + 2 * job.next,
                     prev - job.next, rot);
    kvs_sfence();
    return 0;
}

/* Size a single HUF segment would take for src (header included), or m + 1 if raw. */
static inline size_t kvh_estimate(const uint8_t *src, size_t m, int maxbits)
{
    uint32_t h[4][256], freq[256];
    uint8_t len[256];
    uint64_t bits = 0;
    int s, used = 0, first = -1, last = -1;
    if (m == 0) return 0;
    kvh_hist4(src, m, h);
    for (s = 0; s < 256; s++) {
        freq[s] = h[0][s] + h[1][s] + h[2][s] + h[3][s];
        if (freq[s]) { used++; if (first < 0) first = s; last = s; }
    }
    if (used == 1) return 2;
    kvh_build_lengths(freq, maxbits, len);
    for (s = 0; s < 256; s++) bits += (uint64_t)freq[s] * len[s];
    return (size_t)(bits / 8) + 4 + 4 + (size_t)(last - first + 2) / 2 + 12;
}

#endif /* KVHUFF_H */
