/* AES-128-GCM (NIST SP 800-38D): 96-bit nonce, 16-byte tag, any AAD length.
 *
 * kvoffload's own implementation on AES-NI/VAES and (V)PCLMULQDQ, chosen at run time
 * by what the CPU offers, so the wheel links no libcrypto and needs no headers of one.
 * Checked against `cryptography` (OpenSSL) byte for byte by tests/test_aes_gcm.py, on
 * every path the CPU can run.
 *
 * Paths, best first: "vaes-avx512" (VAES + VPCLMULQDQ on zmm: AVX-512 F/BW/VL/DQ, BMI2,
 * PREFETCHW; Intel Ice Lake and later, AMD Zen 4 and later), "vaes-avx2" (VAES +
 * VPCLMULQDQ on ymm: AMD Zen 3, Intel parts without AVX-512), "aesni-pclmul" (AES-NI +
 * PCLMULQDQ + SSE4.1: Westmere and later). Elsewhere (or off x86-64) "none":
 * kvo_gcm_supported() is 0 and nothing else may be called.
 *
 * Every function is reentrant: one expanded key may serve any number of threads at
 * once (it is only read), and the path is chosen once, on first use (except
 * kvo_gcm_force_impl, below). Constant time in the key and the data (not in lengths).
 */
#ifndef KVOFFLOAD_AES_GCM_H
#define KVOFFLOAD_AES_GCM_H
#include <stddef.h>
#include <stdint.h>

#define KVO_GCM_KEY_BYTES 1024

/* Round keys and powers of H, made once per key by kvo_gcm_init; secret (wipe it when
 * done). No alignment is needed (cffi's ffi.new gives 16 bytes, not the 64 asked here):
 * the implementation assumes none, for it or for any buffer. */
typedef struct {
    _Alignas(64) uint8_t opaque[KVO_GCM_KEY_BYTES];
} kvo_gcm_key;

/* 1 where this CPU runs the implementation (AES-NI, PCLMULQDQ, SSE4.1 at least), else 0. */
int kvo_gcm_supported(void);
/* The code path seal/open take now: "vaes-avx512", "vaes-avx2", "aesni-pclmul" or "none". */
const char *kvo_gcm_impl(void);
/* Test and bench only: run the path `name` ("vaes-avx512", "vaes-avx2", "aesni-pclmul")
 * from now on, or the CPU's best again for NULL or "auto". 0 when done, -1 when this CPU
 * cannot run that path (or the name is unknown). Process-wide and not synchronised with
 * calls in flight: never call it while another thread seals or opens. */
int kvo_gcm_force_impl(const char *name);
/* Expand `key` into `k` (every byte of `k` is written). Only call where
 * kvo_gcm_supported(). The same expanded key serves every path. */
void kvo_gcm_init(kvo_gcm_key *k, const uint8_t key[16]);
/* Encrypt `len` bytes from `in` to `out` and write the 16-byte tag. `in` == `out` is
 * allowed (in place); other overlaps are not. `aad` may be NULL when `aad_len` is 0,
 * `in`/`out` when `len` is 0. Only out[0..len) and tag[0..16) are written. GCM's limit
 * per (key, nonce), not checked: len <= 2^36 - 32 bytes (the 32-bit block counter). A
 * nonce must never repeat under one key: the caller's part. */
void kvo_gcm_seal(const kvo_gcm_key *k, const uint8_t iv[12], const uint8_t *aad, size_t aad_len,
                  const uint8_t *in, uint8_t *out, size_t len, uint8_t tag[16]);
/* Decrypt `len` bytes from `in` to `out` (same rules as seal) and check `tag` in
 * constant time: 0 when it matches, -1 when not. The plaintext is written to `out`
 * either way, before the check: on -1 `out` holds unverified bytes, which the caller
 * must not use (zero them). */
int kvo_gcm_open(const kvo_gcm_key *k, const uint8_t iv[12], const uint8_t *aad, size_t aad_len,
                 const uint8_t *in, uint8_t *out, size_t len, const uint8_t tag[16]);
#endif
