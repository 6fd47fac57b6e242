/* AES-128-GCM on AES-NI/VAES and (V)PCLMULQDQ, picked at run time (see aes_gcm.h).
 *
 * Built by plain `gcc -O3 -fPIC` with no -m flag: every function that uses an
 * instruction set extension names it in __attribute__((target)), and kvo_gcm_seal/open
 * dispatch on what CPUID (and XGETBV, for the OS's register state) reports. Paths:
 *
 *   "vaes-avx512"  VAES + VPCLMULQDQ on zmm (4 blocks a register), 32 blocks a step
 *   "vaes-avx2"    VAES + VPCLMULQDQ on ymm (2 blocks a register), 16 blocks a step
 *   "aesni-pclmul" AES-NI + PCLMULQDQ on xmm (SSE encoding, Westmere on), 8 a step
 *
 * How it is fast: CTR mode runs a whole step of counter blocks through the rounds at
 * once (independent chains that keep the AES unit busy); a step's first counter is a
 * multiple of its block count, so counter + j is counter ^ j and each counter block is
 * one XOR of a per-step base that already holds the first round key. GHASH multiplies
 * block j of a step of n by H^(n-j) (kvo_gcm_init makes H^1..H^32) and adds the
 * partial products unreduced: one reduction a step. The GHASH of a step is written
 * between the AES rounds of the same step (open: the input is the ciphertext) or of the
 * next one (seal: its own output, one step behind), so the carry-less multiplies run on
 * another port while the AES unit is busy. Bytes before the first aligned step and
 * after the last go through a short path (masked zmm loads and stores, or a 256-byte
 * stack copy); the AAD goes through the same GHASH, any length.
 *
 * GHASH arithmetic (as Intel's and the Linux kernel's implementations): blocks are
 * byte-reflected (pshufb) so that a 128-bit integer holds GCM's bit-reversed polynomial;
 * the 256-bit carry-less product (4 multiplies, schoolbook) is reduced by two folds with
 * the constant 0xc2 << 56 (a Montgomery reduction, which leaves a constant factor);
 * kvo_gcm_init cancels that factor once by storing H << 1 mod P (H times x^-1) and its
 * powers. Constant time: no branch or memory address depends on the key or the data
 * (only on lengths and counters), AES only through the AES instructions, and the tag
 * compare is one vector test.
 */
#include <stdint.h>
#include <string.h>
#include "aes_gcm.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#include <cpuid.h>

/* ---- The expanded key (kvo_gcm_key.opaque). Every access goes through key_bytes(),
 * a pointer whose alignment the compiler cannot see, and unaligned loads and stores:
 * the type says 64, but cffi's ffi.new gives 16 (and malloc 16), and an access the
 * compiler believes aligned may become an instruction that faults when it is not. ---- */
#define RK_OFF 0          /* 11 round keys, 16 bytes each */
#define HP_OFF 192        /* H^32, H^31, ..., H^1, each as stored for the multiply */
#define NPOW 32
#define PAD_END (HP_OFF + NPOW * 16 + 64) /* zeros after H^1: loads of 4 powers may run past it */
_Static_assert(PAD_END <= KVO_GCM_KEY_BYTES, "kvo_gcm_key too small");

enum { IMPL_NONE = 0, IMPL_AESNI = 1, IMPL_VAES2 = 2, IMPL_VAES512 = 3, IMPL_COUNT = 4 };
static const char *const impl_names[IMPL_COUNT] = {"none", "aesni-pclmul", "vaes-avx2", "vaes-avx512"};

#define INL static inline __attribute__((always_inline))
#define TGT_NI __attribute__((target("aes,pclmul,ssse3,sse4.1")))
#define TGT_Y __attribute__((target("aes,pclmul,ssse3,sse4.1,avx,avx2,vaes,vpclmulqdq")))
#define TGT_Z __attribute__((target("aes,pclmul,ssse3,sse4.1,avx,avx2,bmi2,prfchw,vaes,vpclmulqdq,avx512f,avx512bw,avx512vl,avx512dq")))

#define BSWAP_BYTES 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0
#define GF_POLY_HI ((long long)0xc200000000000000ULL)

/* ==== 128-bit helpers. TGT_NI is a subset of every path's target, so these inline into
 * each path and are compiled there in its encoding (SSE or VEX). ==== */

TGT_NI INL __m128i ld(const void *p) { return _mm_loadu_si128((const __m128i *)p); }
TGT_NI INL void st(void *p, __m128i v) { _mm_storeu_si128((__m128i *)p, v); }
TGT_NI INL __m128i bswap128(__m128i v) { return _mm_shuffle_epi8(v, _mm_setr_epi8(BSWAP_BYTES)); }
INL const uint8_t *key_bytes(const kvo_gcm_key *k) {
    const uint8_t *p = (const uint8_t *)(const void *)k; /* opaque is at offset 0; no member
                                                            access on a misaligned struct */
    __asm__("" : "+r"(p)); /* hides the type's alignment */
    return p;
}
TGT_NI INL __m128i rk_at(const kvo_gcm_key *k, int r) { return ld(key_bytes(k) + RK_OFF + 16 * r); }
/* Power H^n (1 <= n <= NPOW) as stored. */
TGT_NI INL const uint8_t *pow_ptr(const kvo_gcm_key *k, int n) { return key_bytes(k) + HP_OFF + 16 * (NPOW - n); }

TGT_NI INL __m128i aes_block(const kvo_gcm_key *k, __m128i b) {
    b = _mm_xor_si128(b, rk_at(k, 0));
    for (int r = 1; r < 10; r++)
        b = _mm_aesenc_si128(b, rk_at(k, r));
    return _mm_aesenclast_si128(b, rk_at(k, 10));
}

/* The 256-bit carry-less product lo + mi*x^64 + hi*x^128 of a byte-reflected block and
 * a power as kvo_gcm_init stores it, reduced to 128 bits: the GCM product (see top). */
TGT_NI INL __m128i gf_reduce(__m128i lo, __m128i mi, __m128i hi) {
    const __m128i poly = _mm_set_epi64x(GF_POLY_HI, 1);
    __m128i t = _mm_clmulepi64_si128(poly, lo, 0x01);
    mi = _mm_xor_si128(mi, _mm_xor_si128(_mm_shuffle_epi32(lo, 0x4e), t));
    t = _mm_clmulepi64_si128(poly, mi, 0x01);
    return _mm_xor_si128(hi, _mm_xor_si128(_mm_shuffle_epi32(mi, 0x4e), t));
}

TGT_NI INL void gf_mul_acc(__m128i a, __m128i h, __m128i *lo, __m128i *mi, __m128i *hi) {
    *lo = _mm_xor_si128(*lo, _mm_clmulepi64_si128(a, h, 0x00));
    *hi = _mm_xor_si128(*hi, _mm_clmulepi64_si128(a, h, 0x11));
    *mi = _mm_xor_si128(*mi, _mm_xor_si128(_mm_clmulepi64_si128(a, h, 0x01), _mm_clmulepi64_si128(a, h, 0x10)));
}

TGT_NI INL __m128i gf_mul(__m128i a, __m128i h) {
    __m128i lo = _mm_setzero_si128(), mi = lo, hi = lo;
    gf_mul_acc(a, h, &lo, &mi, &hi);
    return gf_reduce(lo, mi, hi);
}

/* x (byte-reflected GHASH state) absorbs nb (1..16) raw 16-byte blocks: block j times
 * H^(nb-j), one reduction. */
TGT_NI INL __m128i ghash_nblocks(const kvo_gcm_key *k, __m128i x, const uint8_t *p, int nb) {
    __m128i lo = _mm_setzero_si128(), mi = lo, hi = lo;
    const uint8_t *pw = pow_ptr(k, nb);
    for (int j = 0; j < nb; j++) {
        __m128i a = bswap128(ld(p + 16 * j));
        if (j == 0)
            a = _mm_xor_si128(a, x);
        gf_mul_acc(a, ld(pw + 16 * j), &lo, &mi, &hi);
    }
    return gf_reduce(lo, mi, hi);
}

/* x absorbs n bytes, the last block zero-padded (GCM's AAD, and the data tails). */
TGT_NI INL __m128i ghash_bytes(const kvo_gcm_key *k, __m128i x, const uint8_t *p, size_t n) {
    for (; n >= 256; p += 256, n -= 256)
        x = ghash_nblocks(k, x, p, 16);
    if (n) {
        uint8_t buf[256];
        memcpy(buf, p, n);
        memset(buf + n, 0, (16 - (n & 15)) & 15);
        x = ghash_nblocks(k, x, buf, (int)((n + 15) >> 4));
    }
    return x;
}

/* n (0..256) bytes: CTR from the byte-reflected counter `le` (its low dword is the first
 * block's counter), out = in ^ keystream through a stack copy (so nothing outside
 * in[0..n) and out[0..n) is touched), and x absorbs the ciphertext. */
TGT_NI INL __m128i ctr_tail(const kvo_gcm_key *k, __m128i x, __m128i le, const uint8_t *in, uint8_t *out, size_t n,
                            int enc) {
    if (!n)
        return x;
    uint8_t buf[256];
    int nb = (int)((n + 15) >> 4);
    memcpy(buf, in, n);
    memset(buf + n, 0, (size_t)nb * 16 - n);
    if (!enc)
        x = ghash_nblocks(k, x, buf, nb);
    for (int j = 0; j < nb; j++) {
        __m128i ks = aes_block(k, bswap128(_mm_add_epi32(le, _mm_setr_epi32(j, 0, 0, 0))));
        st(buf + 16 * j, _mm_xor_si128(ld(buf + 16 * j), ks));
    }
    memcpy(out, buf, n);
    if (enc) {
        memset(buf + n, 0, (size_t)nb * 16 - n);
        x = ghash_nblocks(k, x, buf, nb);
    }
    /* The tail's plaintext or keystream is not left on the stack. */
    __asm__ __volatile__("" : : "r"(buf) : "memory");
    memset(buf, 0, sizeof buf);
    __asm__ __volatile__("" : : "r"(buf) : "memory");
    return x;
}

/* The byte-reflected J0 = IV || 1 (its low dword is the counter). */
TGT_NI INL __m128i j0_le(const uint8_t iv[12]) {
    uint8_t b[16];
    memcpy(b, iv, 12);
    b[12] = b[13] = b[14] = 0;
    b[15] = 1;
    return bswap128(ld(b));
}

/* GHASH's last block (the bit lengths), then tag = E(J0) ^ GHASH. */
TGT_NI INL __m128i gcm_tag(const kvo_gcm_key *k, __m128i x, __m128i le0, size_t aad_len, size_t len) {
    __m128i lens = _mm_set_epi64x((long long)((uint64_t)aad_len * 8), (long long)((uint64_t)len * 8));
    x = gf_mul(_mm_xor_si128(x, lens), ld(pow_ptr(k, 1)));
    return _mm_xor_si128(bswap128(x), aes_block(k, bswap128(le0)));
}

/* 0 when equal, else -1; one vector test, no data-dependent branch or early exit. */
TGT_NI INL int tag_check(__m128i mine, const uint8_t tag[16]) {
    __m128i d = _mm_xor_si128(mine, ld(tag));
    return _mm_testz_si128(d, d) - 1;
}

/* ==== Key setup (shared by every path). ==== */

TGT_NI INL __m128i key_step(__m128i k, __m128i g) {
    g = _mm_shuffle_epi32(g, 0xff);
    k = _mm_xor_si128(k, _mm_slli_si128(k, 4));
    k = _mm_xor_si128(k, _mm_slli_si128(k, 4));
    k = _mm_xor_si128(k, _mm_slli_si128(k, 4));
    return _mm_xor_si128(k, g);
}

TGT_NI static void init_ni(kvo_gcm_key *k, const uint8_t key[16]) {
    __m128i rk[11];
    rk[0] = ld(key);
#define KEY_STEP(i, rcon) rk[i] = key_step(rk[i - 1], _mm_aeskeygenassist_si128(rk[i - 1], rcon))
    KEY_STEP(1, 0x01); KEY_STEP(2, 0x02); KEY_STEP(3, 0x04); KEY_STEP(4, 0x08); KEY_STEP(5, 0x10);
    KEY_STEP(6, 0x20); KEY_STEP(7, 0x40); KEY_STEP(8, 0x80); KEY_STEP(9, 0x1b); KEY_STEP(10, 0x36);
#undef KEY_STEP
    uint8_t *kb = (uint8_t *)(uintptr_t)key_bytes(k);
    memset(kb, 0, sizeof k->opaque);
    for (int r = 0; r < 11; r++)
        st(kb + RK_OFF + 16 * r, rk[r]);
    /* H = E(0), byte-reflected, times x^-1: a 1-bit left shift of the 128-bit value with
     * P's reflected bits (0xc2..01) folded in where a bit comes out; branch-free. */
    __m128i h = bswap128(aes_block(k, _mm_setzero_si128()));
    uint64_t lo = (uint64_t)_mm_cvtsi128_si64(h), hi = (uint64_t)_mm_extract_epi64(h, 1);
    uint64_t carry = 0 - (hi >> 63);
    hi = (hi << 1) | (lo >> 63);
    lo <<= 1;
    lo ^= carry & 1;
    hi ^= carry & 0xc200000000000000ULL;
    __m128i h1 = _mm_set_epi64x((long long)hi, (long long)lo), p = h1;
    st(kb + HP_OFF + 16 * (NPOW - 1), h1);
    for (int n = 2; n <= NPOW; n++) {
        p = gf_mul(p, h1); /* the stored forms multiply to the stored form of the product */
        st(kb + HP_OFF + 16 * (NPOW - n), p);
    }
    __asm__ __volatile__("" : : "r"(rk) : "memory");
    memset(rk, 0, sizeof rk);
    __asm__ __volatile__("" : : "r"(rk) : "memory");
}

/* ==== Paths "aesni-pclmul" (xmm, 8 blocks a step) and "vaes-avx2" (ymm, 2 blocks a
 * register, 16 blocks a step). Both: counter blocks by one XOR each from a step base
 * (IV || counter) ^ rk0, the step's first counter being a multiple of the step's
 * blocks (the blocks before, counters 2.., and the tail go through ctr_tail); GHASH
 * reads its blocks from memory (open: this step's input; seal: the previous step's
 * output, still in L1), one reduction a step. ==== */

/* The shared byte-reflected counter for ctr_tail: IV and counter `ctr`. */
TGT_NI INL __m128i le_at(__m128i iv_le, uint32_t ctr) { return _mm_insert_epi32(iv_le, (int)ctr, 0); }

/* Bytes through ctr_tail, 256 at a time, from counter *ctr (advanced). */
TGT_NI INL __m128i ctr_tails(const kvo_gcm_key *k, __m128i x, __m128i iv_le, uint32_t *ctr, const uint8_t *in,
                             uint8_t *out, size_t n, int enc) {
    for (size_t pos = 0; pos < n; pos += 256, *ctr += 16)
        x = ctr_tail(k, x, le_at(iv_le, *ctr), in + pos, out + pos, n - pos < 256 ? n - pos : 256, enc);
    return x;
}

#define X_NB 8
#define X_STEP (16 * X_NB)
#define XENC8(r)                                                                          \
    do {                                                                                  \
        const __m128i k_ = (r);                                                           \
        s0 = _mm_aesenc_si128(s0, k_); s1 = _mm_aesenc_si128(s1, k_);                     \
        s2 = _mm_aesenc_si128(s2, k_); s3 = _mm_aesenc_si128(s3, k_);                     \
        s4 = _mm_aesenc_si128(s4, k_); s5 = _mm_aesenc_si128(s5, k_);                     \
        s6 = _mm_aesenc_si128(s6, k_); s7 = _mm_aesenc_si128(s7, k_);                     \
    } while (0)
/* GHASH block j of the step (at gp), times hp[j]. */
#define XGH(j)                                                                            \
    do {                                                                                  \
        __m128i a_ = bswap128(ld(gp + 16 * (j)));                                         \
        if ((j) == 0)                                                                     \
            a_ = _mm_xor_si128(a_, x);                                                    \
        lo = _mm_xor_si128(lo, _mm_clmulepi64_si128(a_, hp[j], 0x00));                    \
        hi = _mm_xor_si128(hi, _mm_clmulepi64_si128(a_, hp[j], 0x11));                    \
        mi = _mm_xor_si128(mi, _mm_xor_si128(_mm_clmulepi64_si128(a_, hp[j], 0x01),       \
                                             _mm_clmulepi64_si128(a_, hp[j], 0x10)));     \
    } while (0)
#define XLAST(j, s) st(op + 16 * (j), _mm_xor_si128(_mm_aesenclast_si128(s, rk[10]), ld(ip + 16 * (j))))

/* One step: the GHASH of the 8 blocks at gp (open: this step's input; seal: the previous
 * step's output), then 8 blocks of CTR from ip to op (counter ctr, a multiple of 8).
 * Not interleaved in the source: with 16 xmm registers that only makes the compiler
 * spill; the out-of-order core overlaps the two halves itself. */
TGT_NI INL __m128i x_step(const __m128i *rk, const __m128i *hp, __m128i ivk, uint32_t d3k, uint32_t ctr,
                          const uint8_t *ip, uint8_t *op, const uint8_t *gp, __m128i x) {
    if (gp) {
        __m128i lo = _mm_setzero_si128(), mi = lo, hi = lo;
        XGH(0); XGH(1); XGH(2); XGH(3); XGH(4); XGH(5); XGH(6); XGH(7);
        x = gf_reduce(lo, mi, hi);
    }
    const __m128i bx = _mm_insert_epi32(ivk, (int)(d3k ^ __builtin_bswap32(ctr)), 3);
#define XJ(j) _mm_xor_si128(bx, _mm_setr_epi32(0, 0, 0, (j) << 24))
    __m128i s0 = XJ(0), s1 = XJ(1), s2 = XJ(2), s3 = XJ(3), s4 = XJ(4), s5 = XJ(5), s6 = XJ(6), s7 = XJ(7);
#undef XJ
    XENC8(rk[1]); XENC8(rk[2]); XENC8(rk[3]); XENC8(rk[4]); XENC8(rk[5]);
    XENC8(rk[6]); XENC8(rk[7]); XENC8(rk[8]); XENC8(rk[9]);
    XLAST(0, s0); XLAST(1, s1); XLAST(2, s2); XLAST(3, s3);
    XLAST(4, s4); XLAST(5, s5); XLAST(6, s6); XLAST(7, s7);
    return x;
}

TGT_NI INL __m128i x_crypt(const kvo_gcm_key *k, const uint8_t iv[12], const uint8_t *aad, size_t aad_len,
                           const uint8_t *in, uint8_t *out, size_t len, int enc) {
    __m128i x = ghash_bytes(k, _mm_setzero_si128(), aad, aad_len);
    const __m128i le0 = j0_le(iv), iv_le = _mm_insert_epi32(le0, 0, 0);
    uint32_t ctr = 2;
    size_t pos = 0;
    const size_t pre = 16 * (X_NB - 2); /* counters 2..7 */
    if (len >= pre + 2 * X_STEP) {
        x = ctr_tails(k, x, iv_le, &ctr, in, out, pre, enc);
        ctr = X_NB;
        pos = pre;
        __m128i rk[11], hp[X_NB];
        for (int r = 0; r < 11; r++)
            rk[r] = rk_at(k, r);
        for (int j = 0; j < X_NB; j++)
            hp[j] = ld(pow_ptr(k, X_NB - j));
        const __m128i ivk = _mm_xor_si128(bswap128(iv_le), rk[0]);
        const uint32_t d3k = (uint32_t)_mm_extract_epi32(ivk, 3);
        size_t nsteps = (len - pos) / X_STEP;
        for (size_t i = 0; i < nsteps; i++, ctr += X_NB, pos += X_STEP)
            x = x_step(rk, hp, ivk, d3k, ctr, in + pos, out + pos, enc ? (i ? out + pos - X_STEP : NULL) : in + pos, x);
        if (enc)
            x = ghash_nblocks(k, x, out + pos - X_STEP, X_NB);
    }
    x = ctr_tails(k, x, iv_le, &ctr, in + pos, out + pos, len - pos, enc);
    return gcm_tag(k, x, le0, aad_len, len);
}

TGT_NI static void x_seal(const kvo_gcm_key *k, const uint8_t iv[12], const uint8_t *aad, size_t aad_len,
                          const uint8_t *in, uint8_t *out, size_t len, uint8_t tag[16]) {
    st(tag, x_crypt(k, iv, aad, aad_len, in, out, len, 1));
}

TGT_NI static int x_open(const kvo_gcm_key *k, const uint8_t iv[12], const uint8_t *aad, size_t aad_len,
                         const uint8_t *in, uint8_t *out, size_t len, const uint8_t tag[16]) {
    return tag_check(x_crypt(k, iv, aad, aad_len, in, out, len, 0), tag);
}

/* -- "vaes-avx2": 8 ymm registers of 2 blocks, 256 bytes a step (16 ymm registers in
 * all without AVX-512, so the round keys and powers are memory operands). -- */

#define Y_NB 16
#define Y_STEP (16 * Y_NB)
#define YENC8(r)                                                                          \
    do {                                                                                  \
        const __m256i k_ = (r);                                                           \
        s0 = _mm256_aesenc_epi128(s0, k_); s1 = _mm256_aesenc_epi128(s1, k_);             \
        s2 = _mm256_aesenc_epi128(s2, k_); s3 = _mm256_aesenc_epi128(s3, k_);             \
        s4 = _mm256_aesenc_epi128(s4, k_); s5 = _mm256_aesenc_epi128(s5, k_);             \
        s6 = _mm256_aesenc_epi128(s6, k_); s7 = _mm256_aesenc_epi128(s7, k_);             \
    } while (0)
#define YCL(a, b, i) _mm256_clmulepi64_epi128(a, b, i)
/* GHASH register j of the step (blocks 2j, 2j+1 at gp), times powers hp[j]. */
#define YGH(j)                                                                            \
    do {                                                                                  \
        __m256i a_ = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(gp + 32 * (j))), bs); \
        if ((j) == 0)                                                                     \
            a_ = _mm256_xor_si256(a_, _mm256_zextsi128_si256(x));                         \
        const __m256i h_ = hp[j];                                                         \
        lo = _mm256_xor_si256(lo, YCL(a_, h_, 0x00));                                     \
        hi = _mm256_xor_si256(hi, YCL(a_, h_, 0x11));                                     \
        mi = _mm256_xor_si256(mi, _mm256_xor_si256(YCL(a_, h_, 0x01), YCL(a_, h_, 0x10))); \
    } while (0)
#define YLAST(j, s)                                                                       \
    _mm256_storeu_si256((__m256i *)(op + 32 * (j)),                                       \
                        _mm256_aesenclast_epi128(s, _mm256_xor_si256(rk[10], _mm256_loadu_si256((const __m256i *)(ip + 32 * (j))))))

TGT_Y INL __m128i y_reduce(__m256i lo, __m256i mi, __m256i hi) {
    const __m256i poly = _mm256_broadcastsi128_si256(_mm_set_epi64x(GF_POLY_HI, 1));
    mi = _mm256_xor_si256(mi, _mm256_xor_si256(_mm256_shuffle_epi32(lo, 0x4e), YCL(poly, lo, 0x01)));
    hi = _mm256_xor_si256(hi, _mm256_xor_si256(_mm256_shuffle_epi32(mi, 0x4e), YCL(poly, mi, 0x01)));
    return _mm_xor_si128(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
}

TGT_Y INL __m128i y_step(const __m256i *rk, const __m256i *hp, __m256i ivk, uint32_t d3k, uint32_t ctr,
                         const uint8_t *ip, uint8_t *op, const uint8_t *gp, __m128i x) {
    const __m256i bs = _mm256_broadcastsi128_si256(_mm_setr_epi8(BSWAP_BYTES));
    const __m256i bx = _mm256_blend_epi32(ivk, _mm256_set1_epi32((int)(d3k ^ __builtin_bswap32(ctr))), 0x88);
#define YJ(j) _mm256_xor_si256(bx, _mm256_setr_epi32(0, 0, 0, (2 * (j)) << 24, 0, 0, 0, (2 * (j) + 1) << 24))
    __m256i s0 = YJ(0), s1 = YJ(1), s2 = YJ(2), s3 = YJ(3), s4 = YJ(4), s5 = YJ(5), s6 = YJ(6), s7 = YJ(7);
#undef YJ
    __m256i lo = _mm256_setzero_si256(), mi = lo, hi = lo;
    YENC8(rk[1]);
    if (gp) YGH(0);
    YENC8(rk[2]);
    if (gp) YGH(1);
    YENC8(rk[3]);
    if (gp) YGH(2);
    YENC8(rk[4]);
    if (gp) YGH(3);
    YENC8(rk[5]);
    if (gp) YGH(4);
    YENC8(rk[6]);
    if (gp) YGH(5);
    YENC8(rk[7]);
    if (gp) YGH(6);
    YENC8(rk[8]);
    if (gp) YGH(7);
    YENC8(rk[9]);
    /* The next step's output lines: without this the seal runs 15-25% slower here
     * (measured; prefetcht0, so no PREFETCHW check). */
    _mm_prefetch((const char *)op + Y_STEP, _MM_HINT_T0);
    _mm_prefetch((const char *)op + Y_STEP + 64, _MM_HINT_T0);
    _mm_prefetch((const char *)op + Y_STEP + 128, _MM_HINT_T0);
    _mm_prefetch((const char *)op + Y_STEP + 192, _MM_HINT_T0);
    YLAST(0, s0); YLAST(1, s1); YLAST(2, s2); YLAST(3, s3);
    YLAST(4, s4); YLAST(5, s5); YLAST(6, s6); YLAST(7, s7);
    return gp ? y_reduce(lo, mi, hi) : x;
}

TGT_Y INL __m128i y_crypt(const kvo_gcm_key *k, const uint8_t iv[12], const uint8_t *aad, size_t aad_len,
                          const uint8_t *in, uint8_t *out, size_t len, int enc) {
    __m128i x = ghash_bytes(k, _mm_setzero_si128(), aad, aad_len);
    const __m128i le0 = j0_le(iv), iv_le = _mm_insert_epi32(le0, 0, 0);
    uint32_t ctr = 2;
    size_t pos = 0;
    const size_t pre = 16 * (Y_NB - 2); /* counters 2..15 */
    if (len >= pre + 2 * Y_STEP) {
        x = ctr_tails(k, x, iv_le, &ctr, in, out, pre, enc);
        ctr = Y_NB;
        pos = pre;
        __m256i rk[11], hp[Y_NB / 2];
        for (int r = 0; r < 11; r++)
            rk[r] = _mm256_broadcastsi128_si256(rk_at(k, r));
        for (int j = 0; j < Y_NB / 2; j++)
            hp[j] = _mm256_loadu_si256((const __m256i *)pow_ptr(k, Y_NB - 2 * j));
        const __m128i ivk128 = _mm_xor_si128(bswap128(iv_le), rk_at(k, 0));
        const __m256i ivk = _mm256_broadcastsi128_si256(ivk128);
        const uint32_t d3k = (uint32_t)_mm_extract_epi32(ivk128, 3);
        size_t nsteps = (len - pos) / Y_STEP;
        if (enc) {
            y_step(rk, hp, ivk, d3k, ctr, in + pos, out + pos, NULL, x);
            for (size_t i = 1; i < nsteps; i++) {
                ctr += Y_NB;
                pos += Y_STEP;
                x = y_step(rk, hp, ivk, d3k, ctr, in + pos, out + pos, out + pos - Y_STEP, x);
            }
            x = ghash_nblocks(k, x, out + pos, Y_NB);
        } else {
            x = y_step(rk, hp, ivk, d3k, ctr, in + pos, out + pos, in + pos, x);
            for (size_t i = 1; i < nsteps; i++) {
                ctr += Y_NB;
                pos += Y_STEP;
                x = y_step(rk, hp, ivk, d3k, ctr, in + pos, out + pos, in + pos, x);
            }
        }
        ctr += Y_NB;
        pos += Y_STEP;
    }
    x = ctr_tails(k, x, iv_le, &ctr, in + pos, out + pos, len - pos, enc);
    return gcm_tag(k, x, le0, aad_len, len);
}

TGT_Y static void y_seal(const kvo_gcm_key *k, const uint8_t iv[12], const uint8_t *aad, size_t aad_len,
                         const uint8_t *in, uint8_t *out, size_t len, uint8_t tag[16]) {
    st(tag, y_crypt(k, iv, aad, aad_len, in, out, len, 1));
}

TGT_Y static int y_open(const kvo_gcm_key *k, const uint8_t iv[12], const uint8_t *aad, size_t aad_len,
                        const uint8_t *in, uint8_t *out, size_t len, const uint8_t tag[16]) {
    return tag_check(y_crypt(k, iv, aad, aad_len, in, out, len, 0), tag);
}

/* ==== Path "vaes-avx512": zmm (4 blocks a register). The main loop takes 512 bytes
 * (32 blocks, 8 registers) a step: one GHASH reduction for the 32 (powers H^32..H^1),
 * and counter blocks made by one XOR each: the loop's first counter is a multiple of
 * 32, so counter + j (j < 32) is counter ^ j, and the whole first round key is folded
 * into a per-step base (IV || counter) ^ rk0. The bytes before the loop (counters
 * 2..31) and after it go through z_partial, 256 bytes or fewer at a time. ==== */

#define Z_STEP 512
#define Z_PRE (30 * 16) /* counters 2..31 */
#define ZCL(a, b, i) _mm512_clmulepi64_epi128(a, b, i)
#define ZX3(a, b, c) _mm512_ternarylogic_epi32(a, b, c, 0x96)
#define ZSWAP(v) _mm512_shuffle_epi32(v, (_MM_PERM_ENUM)0x4e)

TGT_Z INL __m512i z_bcast(const uint8_t *p) { return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)p)); }
TGT_Z INL __m512i z_bswap(__m512i v) { return _mm512_shuffle_epi8(v, _mm512_broadcast_i32x4(_mm_setr_epi8(BSWAP_BYTES))); }
TGT_Z INL __m512i z_poly(void) { return _mm512_broadcast_i32x4(_mm_set_epi64x(GF_POLY_HI, 1)); }

/* lo/mi/hi of 4 lanes reduced, then the lanes added: the new x. */
TGT_Z INL __m128i z_reduce(__m512i lo, __m512i mi, __m512i hi) {
    const __m512i poly = z_poly();
    mi = ZX3(mi, ZSWAP(lo), ZCL(poly, lo, 0x01));
    hi = ZX3(hi, ZSWAP(mi), ZCL(poly, mi, 0x01));
    __m256i y = _mm256_xor_si256(_mm512_castsi512_si256(hi), _mm512_extracti64x4_epi64(hi, 1));
    return _mm_xor_si128(_mm256_castsi256_si128(y), _mm256_extracti128_si256(y, 1));
}

TGT_Z INL void z_mul_acc(__m512i a, __m512i h, __m512i *lo, __m512i *mi, __m512i *hi) {
    *lo = _mm512_xor_si512(*lo, ZCL(a, h, 0x00));
    *hi = _mm512_xor_si512(*hi, ZCL(a, h, 0x11));
    *mi = ZX3(*mi, ZCL(a, h, 0x01), ZCL(a, h, 0x10));
}

TGT_Z INL __mmask64 z_mask(size_t n, int i) {
    size_t r = n - 64 * (size_t)i; /* caller: n > 64 * i */
    return r >= 64 ? ~(__mmask64)0 : (__mmask64)_bzhi_u64(~0ULL, (unsigned)r);
}

TGT_Z INL __m512i z_aes(const __m512i *rk, __m512i s) {
    s = _mm512_xor_si512(s, rk[0]);
    for (int r = 1; r < 10; r++)
        s = _mm512_aesenc_epi128(s, rk[r]);
    return _mm512_aesenclast_epi128(s, rk[10]);
}

/* n (1..256) bytes: CTR from counter `ctr` (blocks ctr, ctr+1, ...) and GHASH of the
 * ciphertext, with masked loads and stores (nothing outside in[0..n) / out[0..n) is
 * touched). `iv_le` is the byte-reflected IV || 0. enc: GHASH the output, else the input. */
TGT_Z INL __m128i z_partial(const kvo_gcm_key *k, const __m512i *rk, __m128i x, __m128i iv_le, uint32_t ctr,
                            const uint8_t *in, uint8_t *out, size_t n, int enc) {
    int nb = (int)((n + 15) >> 4);
    const uint8_t *pw = pow_ptr(k, nb); /* H^nb first; the 4-block loads past H^1 read zeros */
    __m512i le = _mm512_add_epi32(_mm512_broadcast_i32x4(_mm_insert_epi32(iv_le, (int)ctr, 0)),
                                  _mm512_set_epi32(0, 0, 0, 3, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 0));
    const __m512i inc4 = _mm512_broadcast_i32x4(_mm_setr_epi32(4, 0, 0, 0));
    __m512i lo = _mm512_setzero_si512(), mi = lo, hi = lo;
    for (int i = 0; 64 * (size_t)i < n; i++) {
        __mmask64 m = z_mask(n, i);
        __m512i d = _mm512_maskz_loadu_epi8(m, in + 64 * i);
        __m512i c = _mm512_xor_si512(z_aes(rk, z_bswap(le)), d);
        le = _mm512_add_epi32(le, inc4);
        _mm512_mask_storeu_epi8(out + 64 * i, m, c);
        __m512i a = z_bswap(enc ? _mm512_maskz_mov_epi8(m, c) : d);
        if (i == 0)
            a = _mm512_xor_si512(a, _mm512_zextsi128_si512(x));
        z_mul_acc(a, _mm512_loadu_si512(pw + 64 * i), &lo, &mi, &hi);
    }
    return z_reduce(lo, mi, hi);
}

/* GHASH of n bytes (the AAD), the last block zero-padded, masked loads. */
TGT_Z INL __m128i z_ghash_bytes(const kvo_gcm_key *k, __m128i x, const uint8_t *p, size_t n) {
    for (; n; ) {
        size_t c = n < 256 ? n : 256;
        const uint8_t *pw = pow_ptr(k, (int)((c + 15) >> 4));
        __m512i lo = _mm512_setzero_si512(), mi = lo, hi = lo;
        for (int i = 0; 64 * (size_t)i < c; i++) {
            __m512i a = z_bswap(_mm512_maskz_loadu_epi8(z_mask(c, i), p + 64 * i));
            if (i == 0)
                a = _mm512_xor_si512(a, _mm512_zextsi128_si512(x));
            z_mul_acc(a, _mm512_loadu_si512(pw + 64 * i), &lo, &mi, &hi);
        }
        x = z_reduce(lo, mi, hi);
        p += c;
        n -= c;
    }
    return x;
}

#define ZENC8(r)                                                                          \
    do {                                                                                  \
        const __m512i k_ = (r);                                                           \
        s0 = _mm512_aesenc_epi128(s0, k_); s1 = _mm512_aesenc_epi128(s1, k_);             \
        s2 = _mm512_aesenc_epi128(s2, k_); s3 = _mm512_aesenc_epi128(s3, k_);             \
        s4 = _mm512_aesenc_epi128(s4, k_); s5 = _mm512_aesenc_epi128(s5, k_);             \
        s6 = _mm512_aesenc_epi128(s6, k_); s7 = _mm512_aesenc_epi128(s7, k_);             \
    } while (0)

/* Counter blocks ctr..ctr+31 (ctr a multiple of 32), already xored with rk0. */
#define Z_CTR8()                                                                          \
    const __m512i bx_ = _mm512_mask_set1_epi32(ivk, 0x8888, (int)(d3k ^ __builtin_bswap32(ctr))); \
    ctr += 32;                                                                            \
    __m512i s0 = _mm512_xor_si512(bx_, J[0]), s1 = _mm512_xor_si512(bx_, J[1]);           \
    __m512i s2 = _mm512_xor_si512(bx_, J[2]), s3 = _mm512_xor_si512(bx_, J[3]);           \
    __m512i s4 = _mm512_xor_si512(bx_, J[4]), s5 = _mm512_xor_si512(bx_, J[5]);           \
    __m512i s6 = _mm512_xor_si512(bx_, J[6]), s7 = _mm512_xor_si512(bx_, J[7])

/* GHASH products of two ciphertext registers (raw) against powers pa, pb, added into
 * lo/mi/hi (first: started). addz: the running state z is added into ga's lanes. */
#define Z_GH2(ga, gb, pa, pb, first, addz)                                                 \
    do {                                                                                   \
        __m512i a_ = _mm512_shuffle_epi8(ga, bs), b_ = _mm512_shuffle_epi8(gb, bs);        \
        if (addz)                                                                          \
            a_ = _mm512_xor_si512(a_, z);                                                  \
        if (first) {                                                                       \
            lo = _mm512_xor_si512(ZCL(a_, pa, 0x00), ZCL(b_, pb, 0x00));                   \
            hi = _mm512_xor_si512(ZCL(a_, pa, 0x11), ZCL(b_, pb, 0x11));                   \
            mi = _mm512_xor_si512(ZX3(ZCL(a_, pa, 0x01), ZCL(a_, pa, 0x10), ZCL(b_, pb, 0x01)), ZCL(b_, pb, 0x10)); \
        } else {                                                                           \
            lo = ZX3(lo, ZCL(a_, pa, 0x00), ZCL(b_, pb, 0x00));                            \
            hi = ZX3(hi, ZCL(a_, pa, 0x11), ZCL(b_, pb, 0x11));                            \
            mi = ZX3(mi, ZCL(a_, pa, 0x01), ZCL(a_, pa, 0x10));                            \
            mi = ZX3(mi, ZCL(b_, pb, 0x01), ZCL(b_, pb, 0x10));                            \
        }                                                                                  \
    } while (0)

#define Z_RED1() mi = ZX3(mi, ZSWAP(lo), ZCL(poly, lo, 0x01))
#define Z_RED2() hi = ZX3(hi, ZSWAP(mi), ZCL(poly, mi, 0x01))
#define Z_FOLD()                                                                                 \
    do {                                                                                         \
        __m256i y_ = _mm256_xor_si256(_mm512_castsi512_si256(hi), _mm512_extracti64x4_epi64(hi, 1)); \
        x = _mm_xor_si128(_mm256_castsi256_si128(y_), _mm256_extracti128_si256(y_, 1));          \
    } while (0)

/* GHASH of 32 blocks g0..g7 (register i holds blocks 4i..4i+3, one a lane). In the loop
 * the state is never folded to one lane: z holds 4 lanes z_l whose GHASH value is
 * sum_l z_l * H^-l (at the start, z = x in lane 0). A step multiplies register i by the
 * broadcast power B_i = H^(32-4i) in every lane, which keeps that form: block 4i+l
 * should get H^(32-4i-l) = H^(32-4i) * H^-l, and the old state should get H^32, which
 * z_l * H^-l does when z is added into register 0 (times B_0 = H^32). The last step uses
 * the plain powers P_i (lane l: H^(32-4i-l)), so every lane comes out with its true
 * weight, and folds the lanes into x. This saves a fold (2 extracts, 2 XORs) a step and
 * takes it off z's dependency chain. Register 0 (which takes z) comes last, so the
 * previous step's z is needed as late as possible. */
#define Z_GH8(g0, g1, g2, g3, g4, g5, g6, g7, Q)                                          \
    Z_GH2(g6, g7, Q##6, Q##7, 1, 0);                                                      \
    Z_GH2(g4, g5, Q##4, Q##5, 0, 0);                                                      \
    Z_GH2(g2, g3, Q##2, Q##3, 0, 0);                                                      \
    Z_GH2(g0, g1, Q##0, Q##1, 0, 1)

/* One step's AES rounds with the GHASH of g0..g7 (32 blocks, powers Q0..Q7) between
 * them; z becomes the new unfolded state. */
#define Z_STEP_BODY(g0, g1, g2, g3, g4, g5, g6, g7, Q)                                    \
    do {                                                                                  \
        __m512i lo, mi, hi;                                                               \
        ZENC8(rk[1]);                                                                     \
        Z_GH2(g6, g7, Q##6, Q##7, 1, 0);                                                  \
        ZENC8(rk[2]);                                                                     \
        ZENC8(rk[3]);                                                                     \
        Z_GH2(g4, g5, Q##4, Q##5, 0, 0);                                                  \
        ZENC8(rk[4]);                                                                     \
        Z_GH2(g2, g3, Q##2, Q##3, 0, 0);                                                  \
        ZENC8(rk[5]);                                                                     \
        Z_GH2(g0, g1, Q##0, Q##1, 0, 1);                                                  \
        ZENC8(rk[6]);                                                                     \
        Z_RED1();                                                                         \
        ZENC8(rk[7]);                                                                     \
        Z_RED2();                                                                         \
        z = hi;                                                                           \
        ZENC8(rk[8]);                                                                     \
        ZENC8(rk[9]);                                                                     \
    } while (0)

#define Z_LOAD8(p, v) __m512i v##0 = _mm512_loadu_si512(p), v##1 = _mm512_loadu_si512((p) + 64), \
    v##2 = _mm512_loadu_si512((p) + 128), v##3 = _mm512_loadu_si512((p) + 192),                  \
    v##4 = _mm512_loadu_si512((p) + 256), v##5 = _mm512_loadu_si512((p) + 320),                  \
    v##6 = _mm512_loadu_si512((p) + 384), v##7 = _mm512_loadu_si512((p) + 448)

/* Software prefetch. Before each step's stores the output lines ahead are fetched for
 * writing (prefetchw): one step ahead, or two when `far` (out of place and 1 MiB or
 * more, so input and output together outgrow L2); without it the stores wait on their
 * read-for-ownership (2 MiB out of place: ~10% faster here, no change in cache). With
 * `far` the input two steps ahead is fetched too (another ~5% there; in cache it costs
 * ~5%, hence only then). Prefetches never fault past a buffer's end. */
#define Z_PF_FAR_MIN ((size_t)1 << 20)
#define Z_PREFETCH8(p, hint)                                                              \
    do {                                                                                  \
        _mm_prefetch((const char *)(p), hint); _mm_prefetch((const char *)(p) + 64, hint); \
        _mm_prefetch((const char *)(p) + 128, hint); _mm_prefetch((const char *)(p) + 192, hint); \
        _mm_prefetch((const char *)(p) + 256, hint); _mm_prefetch((const char *)(p) + 320, hint); \
        _mm_prefetch((const char *)(p) + 384, hint); _mm_prefetch((const char *)(p) + 448, hint); \
    } while (0)
#define Z_PREFETCH_IN(p)                                                                  \
    do {                                                                                  \
        if (far)                                                                          \
            Z_PREFETCH8((p) + 2 * Z_STEP, _MM_HINT_T0);                                   \
    } while (0)

/* e_i = last round of s_i, xored with d_i; stored to op. */
#define Z_LAST8(op, d0, d1, d2, d3, d4, d5, d6, d7, e0, e1, e2, e3, e4, e5, e6, e7)                    \
    do {                                                                                         \
        Z_PREFETCH8((op) + (far ? 2 : 1) * Z_STEP, _MM_HINT_ET0);                                \
        e0 = _mm512_aesenclast_epi128(s0, _mm512_xor_si512(rk[10], d0));                         \
        e1 = _mm512_aesenclast_epi128(s1, _mm512_xor_si512(rk[10], d1));                         \
        e2 = _mm512_aesenclast_epi128(s2, _mm512_xor_si512(rk[10], d2));                         \
        e3 = _mm512_aesenclast_epi128(s3, _mm512_xor_si512(rk[10], d3));                         \
        e4 = _mm512_aesenclast_epi128(s4, _mm512_xor_si512(rk[10], d4));                         \
        e5 = _mm512_aesenclast_epi128(s5, _mm512_xor_si512(rk[10], d5));                         \
        e6 = _mm512_aesenclast_epi128(s6, _mm512_xor_si512(rk[10], d6));                         \
        e7 = _mm512_aesenclast_epi128(s7, _mm512_xor_si512(rk[10], d7));                         \
        _mm512_storeu_si512(op, e0); _mm512_storeu_si512((op) + 64, e1);                         \
        _mm512_storeu_si512((op) + 128, e2); _mm512_storeu_si512((op) + 192, e3);                \
        _mm512_storeu_si512((op) + 256, e4); _mm512_storeu_si512((op) + 320, e5);                \
        _mm512_storeu_si512((op) + 384, e6); _mm512_storeu_si512((op) + 448, e7);                \
    } while (0)

TGT_Z INL __m128i z_crypt(const kvo_gcm_key *k, const uint8_t iv[12], const uint8_t *aad, size_t aad_len,
                          const uint8_t *in, uint8_t *out, size_t len, int enc, int far) {
    __m512i rk[11];
    for (int r = 0; r < 11; r++)
        rk[r] = z_bcast(key_bytes(k) + RK_OFF + 16 * r);
    __m128i x = aad_len ? z_ghash_bytes(k, _mm_setzero_si128(), aad, aad_len) : _mm_setzero_si128();
    const __m128i le0 = j0_le(iv), iv_le = _mm_insert_epi32(le0, 0, 0);
    uint32_t ctr = 2;
    size_t pos = 0;
    if (len >= Z_PRE + Z_STEP) {
        x = z_partial(k, rk, x, iv_le, 2, in, out, 256, enc);
        x = z_partial(k, rk, x, iv_le, 18, in + 256, out + 256, Z_PRE - 256, enc);
        ctr = 32;
        pos = Z_PRE;
        const __m512i bs = _mm512_broadcast_i32x4(_mm_setr_epi8(BSWAP_BYTES)), poly = z_poly();
        /* (IV || 0) ^ rk0 in every lane; dword 3 (the counter's bytes) gets rk0's dword 3
         * xored with the big-endian counter each step. */
        const __m128i ivk128 = _mm_xor_si128(bswap128(iv_le), rk_at(k, 0));
        const __m512i ivk = _mm512_broadcast_i32x4(ivk128);
        const uint32_t d3k = (uint32_t)_mm_extract_epi32(ivk128, 3);
        __m512i J[8]; /* lane j of J[i]: 4i + j in the counter's last byte */
        for (int i = 0; i < 8; i++)
            J[i] = _mm512_set_epi32((4 * i + 3) << 24, 0, 0, 0, (4 * i + 2) << 24, 0, 0, 0, (4 * i + 1) << 24, 0, 0, 0,
                                    (4 * i) << 24, 0, 0, 0);
        const uint8_t *hp = pow_ptr(k, 32);
        const __m512i P0 = _mm512_loadu_si512(hp), P1 = _mm512_loadu_si512(hp + 64);
        const __m512i P2 = _mm512_loadu_si512(hp + 128), P3 = _mm512_loadu_si512(hp + 192);
        const __m512i P4 = _mm512_loadu_si512(hp + 256), P5 = _mm512_loadu_si512(hp + 320);
        const __m512i P6 = _mm512_loadu_si512(hp + 384), P7 = _mm512_loadu_si512(hp + 448);
        const __m512i B0 = z_bcast(hp), B1 = z_bcast(hp + 64), B2 = z_bcast(hp + 128), B3 = z_bcast(hp + 192);
        const __m512i B4 = z_bcast(hp + 256), B5 = z_bcast(hp + 320), B6 = z_bcast(hp + 384), B7 = z_bcast(hp + 448);
        __m512i z = _mm512_zextsi128_si512(x);
        size_t nsteps = (len - pos) / Z_STEP;
        if (enc) {
            __m512i e0, e1, e2, e3, e4, e5, e6, e7;
            {
                Z_CTR8();
                for (int r = 1; r < 10; r++)
                    ZENC8(rk[r]);
                Z_LOAD8(in + pos, d);
                Z_LAST8(out + pos, d0, d1, d2, d3, d4, d5, d6, d7, e0, e1, e2, e3, e4, e5, e6, e7);
                pos += Z_STEP;
            }
            for (size_t i = 1; i < nsteps; i++, pos += Z_STEP) {
                Z_CTR8();
                Z_STEP_BODY(e0, e1, e2, e3, e4, e5, e6, e7, B);
                Z_PREFETCH_IN(in + pos);
                Z_LOAD8(in + pos, d);
                Z_LAST8(out + pos, d0, d1, d2, d3, d4, d5, d6, d7, e0, e1, e2, e3, e4, e5, e6, e7);
            }
            {
                __m512i lo, mi, hi;
                Z_GH8(e0, e1, e2, e3, e4, e5, e6, e7, P);
                Z_RED1();
                Z_RED2();
                Z_FOLD();
            }
        } else {
            for (size_t i = 0; i + 1 < nsteps; i++, pos += Z_STEP) {
                Z_PREFETCH_IN(in + pos);
                Z_LOAD8(in + pos, c);
                Z_CTR8();
                Z_STEP_BODY(c0, c1, c2, c3, c4, c5, c6, c7, B);
                Z_LAST8(out + pos, c0, c1, c2, c3, c4, c5, c6, c7, c0, c1, c2, c3, c4, c5, c6, c7);
            }
            {
                Z_LOAD8(in + pos, c);
                Z_CTR8();
                Z_STEP_BODY(c0, c1, c2, c3, c4, c5, c6, c7, P);
                Z_LAST8(out + pos, c0, c1, c2, c3, c4, c5, c6, c7, c0, c1, c2, c3, c4, c5, c6, c7);
                pos += Z_STEP;
                __m512i hi = z;
                Z_FOLD();
            }
        }
    }
    while (pos < len) {
        size_t n = len - pos < 256 ? len - pos : 256;
        x = z_partial(k, rk, x, iv_le, ctr, in + pos, out + pos, n, enc);
        ctr += 16;
        pos += n;
    }
    return gcm_tag(k, x, le0, aad_len, len);
}

TGT_Z static void z_seal(const kvo_gcm_key *k, const uint8_t iv[12], const uint8_t *aad, size_t aad_len,
                         const uint8_t *in, uint8_t *out, size_t len, uint8_t tag[16]) {
    if (in != out && len >= Z_PF_FAR_MIN) /* two copies of the loop: `far` is a constant in each */
        st(tag, z_crypt(k, iv, aad, aad_len, in, out, len, 1, 1));
    else
        st(tag, z_crypt(k, iv, aad, aad_len, in, out, len, 1, 0));
}

TGT_Z static int z_open(const kvo_gcm_key *k, const uint8_t iv[12], const uint8_t *aad, size_t aad_len,
                        const uint8_t *in, uint8_t *out, size_t len, const uint8_t tag[16]) {
    if (in != out && len >= Z_PF_FAR_MIN)
        return tag_check(z_crypt(k, iv, aad, aad_len, in, out, len, 0, 1), tag);
    return tag_check(z_crypt(k, iv, aad, aad_len, in, out, len, 0, 0), tag);
}

/* ==== Dispatch. ==== */

static int cpu_best(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return IMPL_NONE;
    unsigned aes = (c >> 25) & 1, pclmul = (c >> 1) & 1, ssse3 = (c >> 9) & 1, sse41 = (c >> 19) & 1;
    unsigned osxsave = (c >> 27) & 1, avx = (c >> 28) & 1;
    if (!(aes && pclmul && ssse3 && sse41))
        return IMPL_NONE;
    uint64_t xcr0 = 0;
    if (osxsave) {
        unsigned lo, hi;
        __asm__ __volatile__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        xcr0 = ((uint64_t)hi << 32) | lo;
    }
    /* The OS saves ymm (XCR0 bits 1-2) and zmm (bits 5-7: opmask, upper halves, 16-31). */
    int os_ymm = (xcr0 & 0x6) == 0x6, os_zmm = (xcr0 & 0xe6) == 0xe6;
    unsigned a7 = 0, b7 = 0, c7 = 0, d7 = 0;
    if (__get_cpuid_max(0, NULL) >= 7)
        __cpuid_count(7, 0, a7, b7, c7, d7);
    unsigned avx2 = (b7 >> 5) & 1, bmi2 = (b7 >> 8) & 1, avx512f = (b7 >> 16) & 1, avx512dq = (b7 >> 17) & 1;
    unsigned avx512bw = (b7 >> 30) & 1, avx512vl = (b7 >> 31) & 1, vaes = (c7 >> 9) & 1, vpclmul = (c7 >> 10) & 1;
    unsigned ae = 0, be = 0, ce = 0, de = 0;
    unsigned prfchw = __get_cpuid(0x80000001, &ae, &be, &ce, &de) ? (ce >> 8) & 1 : 0;
    if (avx && os_ymm && os_zmm && avx2 && bmi2 && prfchw && avx512f && avx512dq && avx512bw && avx512vl && vaes &&
        vpclmul)
        return IMPL_VAES512;
    if (avx && os_ymm && avx2 && vaes && vpclmul)
        return IMPL_VAES2;
    return IMPL_AESNI;
}

static int g_best = -1, g_impl = -1; /* -1: not yet read */

static int impl_best(void) {
    int v = __atomic_load_n(&g_best, __ATOMIC_RELAXED);
    if (v < 0) {
        v = cpu_best();
        __atomic_store_n(&g_best, v, __ATOMIC_RELAXED);
    }
    return v;
}

static int impl_now(void) {
    int v = __atomic_load_n(&g_impl, __ATOMIC_RELAXED);
    return v < 0 ? impl_best() : v;
}

int kvo_gcm_supported(void) { return impl_best() != IMPL_NONE; }

const char *kvo_gcm_impl(void) { return impl_names[impl_now()]; }

int kvo_gcm_force_impl(const char *name) {
    int best = impl_best();
    if (name == NULL || strcmp(name, "auto") == 0) {
        __atomic_store_n(&g_impl, -1, __ATOMIC_RELAXED);
        return 0;
    }
    for (int i = IMPL_AESNI; i < IMPL_COUNT; i++) {
        if (strcmp(name, impl_names[i]) != 0)
            continue;
        /* A path runs where the best one is at least it (the paths nest: each needs
         * all the previous one does), except vaes-avx2 needs no AVX-512. */
        if (i > best)
            return -1;
        __atomic_store_n(&g_impl, i, __ATOMIC_RELAXED);
        return 0;
    }
    return -1;
}

void kvo_gcm_init(kvo_gcm_key *k, const uint8_t key[16]) { init_ni(k, key); }

void kvo_gcm_seal(const kvo_gcm_key *k, const uint8_t iv[12], const uint8_t *aad, size_t aad_len,
                  const uint8_t *in, uint8_t *out, size_t len, uint8_t tag[16]) {
    switch (impl_now()) {
    case IMPL_VAES512: z_seal(k, iv, aad, aad_len, in, out, len, tag); return;
    case IMPL_VAES2: y_seal(k, iv, aad, aad_len, in, out, len, tag); return;
    default: x_seal(k, iv, aad, aad_len, in, out, len, tag); return;
    }
}

int kvo_gcm_open(const kvo_gcm_key *k, const uint8_t iv[12], const uint8_t *aad, size_t aad_len,
                 const uint8_t *in, uint8_t *out, size_t len, const uint8_t tag[16]) {
    switch (impl_now()) {
    case IMPL_VAES512: return z_open(k, iv, aad, aad_len, in, out, len, tag);
    case IMPL_VAES2: return y_open(k, iv, aad, aad_len, in, out, len, tag);
    default: return x_open(k, iv, aad, aad_len, in, out, len, tag);
    }
}

#else /* not x86-64: no implementation; kvo_gcm_supported() says so and nothing else is called */

int kvo_gcm_supported(void) { return 0; }
const char *kvo_gcm_impl(void) { return "none"; }
int kvo_gcm_force_impl(const char *name) { (void)name; return -1; }
void kvo_gcm_init(kvo_gcm_key *k, const uint8_t key[16]) { (void)key; memset(k->opaque, 0, sizeof k->opaque); }
void kvo_gcm_seal(const kvo_gcm_key *k, const uint8_t iv[12], const uint8_t *aad, size_t aad_len,
                  const uint8_t *in, uint8_t *out, size_t len, uint8_t tag[16]) {
    (void)k; (void)iv; (void)aad; (void)aad_len; (void)in; (void)out; (void)len;
    memset(tag, 0, 16);
}
int kvo_gcm_open(const kvo_gcm_key *k, const uint8_t iv[12], const uint8_t *aad, size_t aad_len,
                 const uint8_t *in, uint8_t *out, size_t len, const uint8_t tag[16]) {
    (void)k; (void)iv; (void)aad; (void)aad_len; (void)in; (void)out; (void)len; (void)tag;
    return -1;
}
#endif
