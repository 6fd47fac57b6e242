/* One IO unit's file IO and seals in one call, so Python releases the GIL once per unit.
 *
 * Why: in vLLM's worker the engine thread holds the GIL most of a step, and an IO
 * thread waits up to Python's switch interval (5 ms) for it after every call that
 * released it. The Python path releases it twice per slot (preadv, then the cipher);
 * this file does a whole unit (every run of consecutive slots, the single-slot retries
 * after a failed or short run, every slot's AES-GCM seal or open) under one release.
 * H200, 4 RAM drives, 75% Python per step: one GIL-free call per 16 MiB unit kept
 * 1.0 of the drives' bandwidth where the Python path kept 0.21 (docs/performance.md).
 * On the GPU path the unit's device copy is launched here too (``kvo_copy``): with it
 * out in Python the GPU path kept 0.47-0.56 there, with it here 0.77-0.97.
 *
 * File calls go through the function pointers the caller passes: libc's preadv and
 * pwritev in production, the fault harness's (a Python callback, which takes the GIL)
 * in tests, so every injected fault reaches this code as it reaches the Python path.
 * The semantics are the Python path's (load_path.py, store_path.py, slot_seal.py):
 * a failed or short run of several slots keeps the slots it moved whole and retries
 * the others one by one; AES-128-GCM with a 96-bit little-endian nonce and the slot
 * index (8 bytes, little-endian) as associated data, the tag kept by the caller; a
 * slot that fails its check, or whose read failed, never leaves unverified or partial
 * bytes where its payload goes (they are zeroed).
 *
 * Built and loaded by unit_io.py (ctypes: the call runs without the GIL).
 */
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <openssl/evp.h>

typedef ssize_t (*io_fn)(int fd, const struct iovec *iov, int iovcnt, off_t offset);
/* A device copy the call launches before its own work: CUDA driver functions (their
 * 12.x ABI) and their arguments, filled by cuda_device.py; each returns 0 or a CUresult.
 * A store's is its blocks' copy into staging, waited for before the seal; a load's is
 * the previous unit's copy out of staging (launched here, not after that unit's own
 * call, so the thread needs the GIL once per unit: cuMemcpyBatchAsync of a 16 MiB unit
 * takes about 0.6 ms, too long to hold the GIL for and too short to give it up for). */
typedef int (*batch_fn)(void *dsts, void *srcs, void *sizes, size_t count, void *attrs, size_t *attr_idxs,
                        size_t num_attrs, size_t *fail_idx, void *stream);
typedef int (*record_fn)(void *event, void *stream);
typedef int (*wait_fn)(void *event);
typedef struct {
    batch_fn batch;
    record_fn record;
    wait_fn wait; /* NULL: launched, not waited for */
    void *dsts, *srcs, *sizes;
    size_t count;
    void *attrs;
    void *stream, *event;
} kvo_copy;

static int run_copy(const kvo_copy *c) {
    size_t attr_idx = 0, fail_idx = 0;
    int rc = c->count ? c->batch(c->dsts, c->srcs, c->sizes, c->count, c->attrs, &attr_idx, 1, &fail_idx, c->stream)
                      : 0;
    if (rc == 0)
        rc = c->record(c->event, c->stream);
    if (rc == 0 && c->wait != NULL)
        rc = c->wait(c->event);
    return rc > 0 ? rc : (rc < 0 ? 1 : 0);
}

enum { KVO_OK = 0, KVO_IO_ERROR = 1, KVO_SHORT = 2, KVO_INTEGRITY = 3, KVO_CIPHER = 4 };
enum { KVO_SEAL_OFF = 0, KVO_SEAL_AES_GCM = 1 };
#define KVO_MAX_IOV 64
#define TAG_BYTES 16

/* Parallel arrays, one entry per slot of the unit (the caller's numpy arrays). */
typedef struct {
    const int64_t *file_off;  /* the slot's byte offset in the file */
    uint8_t *const *buf;      /* the slot's file bytes in memory (staging row, or the host row) */
    uint8_t *const *payload;  /* stores: payload source; loads: payload destination (== buf: in place) */
    const uint64_t *nonce;    /* aes-gcm nonce of the slot (stores: the new one; loads: the record's) */
    const uint64_t *aad;      /* the slot index */
    uint8_t *tag;             /* TAG_BYTES per slot: stores write it, loads check it */
    int32_t *status;          /* out: KVO_* */
    int32_t *err;             /* out: errno of the call that failed the slot (0: none) */
    const uint8_t *cut;       /* nonzero: no run of file IO continues into this slot from the one
                               * before (where a batch's next unit starts: each unit keeps the
                               * calls it would have made alone, so one fault hits the same slots) */
} kvo_slots;

static void fail(kvo_slots *s, int j, int status, int err) {
    s->status[j] = status;
    s->err[j] = err;
}

/* Move slots [j0, j1) (consecutive in the file) with one call per KVO_MAX_IOV slots;
 * returns how many whole slots moved before the first failure and sets *err. */
static int run_io(io_fn call, int fd, kvo_slots *s, int j0, int j1, int64_t slot_bytes, int *err) {
    struct iovec iov[KVO_MAX_IOV];
    int done = 0;
    *err = 0;
    for (int a = j0; a < j1; a += KVO_MAX_IOV) {
        int b = a + KVO_MAX_IOV < j1 ? a + KVO_MAX_IOV : j1;
        for (int j = a; j < b; j++) {
            iov[j - a].iov_base = s->buf[j];
            iov[j - a].iov_len = (size_t)slot_bytes;
        }
        errno = 0;
        ssize_t got = call(fd, iov, b - a, (off_t)s->file_off[a]);
        if (got < 0) {
            *err = errno ? errno : EIO;
            return done;
        }
        int whole = (int)(got / slot_bytes);
        done += whole;
        if (whole < b - a) {
            *err = -1; /* short */
            return done;
        }
    }
    return done;
}

/* The end of the run of consecutive file slots that starts at ``j``. */
static int run_end(const kvo_slots *s, int j, int n, int64_t slot_bytes) {
    int j1 = j + 1;
    while (j1 < n && s->status[j1] == KVO_OK && !s->cut[j1] && s->file_off[j1] == s->file_off[j1 - 1] + slot_bytes)
        j1++;
    return j1;
}

/* Every run of consecutive file slots in [j, end), then the slots a failed run did not
 * move, one at a time (the Python path's ``Lane.transfer``). */
static void transfer(io_fn call, int fd, kvo_slots *s, int j, int end, int64_t slot_bytes) {
    while (j < end) {
        if (s->status[j] != KVO_OK) {
            j++;
            continue;
        }
        int j1 = run_end(s, j, end, slot_bytes);
        int err;
        int done = run_io(call, fd, s, j, j1, slot_bytes, &err);
        if (done < j1 - j) {
            if (j1 - j == 1) {
                fail(s, j, err < 0 ? KVO_SHORT : KVO_IO_ERROR, err < 0 ? 0 : err);
            } else {
                for (int k = j + done; k < j1; k++) {
                    int one_err;
                    if (run_io(call, fd, s, k, k + 1, slot_bytes, &one_err) != 1)
                        fail(s, k, one_err < 0 ? KVO_SHORT : KVO_IO_ERROR, one_err < 0 ? 0 : one_err);
                }
            }
        }
        j = j1;
    }
}

static void nonce_bytes(uint64_t n, uint8_t out[12]) {
    for (int i = 0; i < 12; i++)
        out[i] = i < 8 ? (uint8_t)(n >> (8 * i)) : 0;
}

static void aad_bytes(uint64_t a, uint8_t out[8]) {
    for (int i = 0; i < 8; i++)
        out[i] = (uint8_t)(a >> (8 * i));
}

/* AES-128-GCM of ``len`` bytes from ``in`` to ``out`` (may be the same buffer). */
static int gcm(EVP_CIPHER_CTX *ctx, int enc, const uint8_t *key, uint64_t nonce, uint64_t aad,
               const uint8_t *in, uint8_t *out, int64_t len, uint8_t *tag) {
    uint8_t iv[12], ad[8];
    int outl = 0;
    nonce_bytes(nonce, iv);
    aad_bytes(aad, ad);
    if (EVP_CipherInit_ex(ctx, EVP_aes_128_gcm(), NULL, NULL, NULL, enc) != 1 ||
        EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_SET_IVLEN, 12, NULL) != 1 ||
        EVP_CipherInit_ex(ctx, NULL, NULL, key, iv, enc) != 1 ||
        EVP_CipherUpdate(ctx, NULL, &outl, ad, 8) != 1)
        return KVO_CIPHER;
    for (int64_t at = 0; at < len;) { /* EVP takes int lengths */
        int step = len - at > (INT_MAX & ~15) ? (INT_MAX & ~15) : (int)(len - at);
        if (EVP_CipherUpdate(ctx, out + at, &outl, in + at, step) != 1)
            return KVO_CIPHER;
        at += step;
    }
    if (!enc && EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_SET_TAG, TAG_BYTES, tag) != 1)
        return KVO_CIPHER;
    if (EVP_CipherFinal_ex(ctx, out + len, &outl) != 1)
        return enc ? KVO_CIPHER : KVO_INTEGRITY;
    if (enc && EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_GET_TAG, TAG_BYTES, tag) != 1)
        return KVO_CIPHER;
    return KVO_OK;
}

/* Store ``n`` slots: run ``copy`` (if given: the blocks into staging, waited for), then,
 * run by run, seal each payload into its buffer and write the run. ``status`` must come in as KVO_OK for
 * every slot. Returns 0, -1 (no memory), or the copy's CUresult (> 0: nothing was
 * sealed or written). */
int kvo_store_unit(io_fn call, int fd, int n, kvo_slots *s, int64_t slot_bytes, int64_t payload_bytes,
                   int seal, const uint8_t *key, const kvo_copy *copy) {
    if (copy != NULL) {
        int rc = run_copy(copy);
        if (rc != 0)
            return rc;
    }
    EVP_CIPHER_CTX *ctx = seal == KVO_SEAL_AES_GCM ? EVP_CIPHER_CTX_new() : NULL;
    if (seal == KVO_SEAL_AES_GCM && ctx == NULL)
        return -1;
    /* Run by run: each run's slots are sealed right before its write, while they are still
     * in the CPU's caches (a batch of units is more than the caches hold). */
    for (int j = 0; j < n;) {
        int j1 = run_end(s, j, n, slot_bytes);
        for (int k = j; k < j1; k++) {
            if (seal == KVO_SEAL_AES_GCM) {
                int st = gcm(ctx, 1, key, s->nonce[k], s->aad[k], s->payload[k], s->buf[k], payload_bytes,
                             s->tag + (size_t)k * TAG_BYTES);
                if (st != KVO_OK)
                    fail(s, k, st, 0);
            } else if (s->payload[k] != s->buf[k]) {
                memcpy(s->buf[k], s->payload[k], (size_t)payload_bytes);
            }
        }
        transfer(call, fd, s, j, j1, slot_bytes);
        j = j1;
    }
    if (ctx)
        EVP_CIPHER_CTX_free(ctx);
    return 0;
}

/* Load ``n`` slots: launch ``copy`` (if given: the previous unit's), then, run by run, read
 * the run and open each slot that read whole into its payload destination. A slot that fails (IO, short,
 * check) leaves zeros there, and in its buffer too when the buffer is a host row
 * (buf == payload). Returns 0, -1 (no memory), or the copy's CUresult (> 0: no IO done). */
int kvo_load_unit(io_fn call, int fd, int n, kvo_slots *s, int64_t slot_bytes, int64_t payload_bytes,
                  int seal, const uint8_t *key, const kvo_copy *copy) {
    if (copy != NULL) {
        int rc = run_copy(copy);
        if (rc != 0)
            return rc;
    }
    EVP_CIPHER_CTX *ctx = seal == KVO_SEAL_AES_GCM ? EVP_CIPHER_CTX_new() : NULL;
    if (seal == KVO_SEAL_AES_GCM && ctx == NULL)
        return -1;
    /* Run by run: each run's slots are opened right after its read, while they are still in
     * the CPU's caches (a batch of units is more than the caches hold). */
    for (int j = 0; j < n;) {
        int j1 = s->status[j] == KVO_OK ? run_end(s, j, n, slot_bytes) : j + 1;
        transfer(call, fd, s, j, j1, slot_bytes);
        for (int k = j; k < j1; k++) {
            if (s->status[k] == KVO_OK) {
                if (seal == KVO_SEAL_AES_GCM) {
                    int st = gcm(ctx, 0, key, s->nonce[k], s->aad[k], s->buf[k], s->payload[k], payload_bytes,
                                 s->tag + (size_t)k * TAG_BYTES);
                    if (st != KVO_OK)
                        fail(s, k, st, 0);
                } else if (s->payload[k] != s->buf[k]) {
                    memcpy(s->payload[k], s->buf[k], (size_t)payload_bytes);
                }
            }
            if (s->status[k] != KVO_OK)
                memset(s->payload[k], 0, (size_t)payload_bytes);
        }
        j = j1;
    }
    if (ctx)
        EVP_CIPHER_CTX_free(ctx);
    return 0;
}
