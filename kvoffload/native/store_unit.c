/* The store path's native unit (store_path.py's StoreLane.store_native): device blocks
 * -> staging (the copy, waited for) -> sealed -> one pwritev per run of file slots.
 *
 * Why one call per unit: in vLLM's worker the engine thread holds the GIL most of a
 * step, and an IO thread waits up to Python's switch interval (5 ms) for it after every
 * call that released it. The Python path releases it per run and per slot; this call
 * releases it once per unit (H200, 4 RAM drives, 75% Python per step: 1.0 of the drives'
 * bandwidth kept against 0.21, docs/performance.md).
 */
#include <string.h>
#include "unit_runs.h"

static void seal_slot(kvo_unit *u, kvo_slots *s, int k) {
    uint8_t *buf = (uint8_t *)(uintptr_t)s->buf[k];
    const uint8_t *payload = (const uint8_t *)(uintptr_t)s->payload[k];
    if (u->seal == KVO_SEAL_AES_GCM)
        kvo_gcm_seal((const kvo_gcm_key *)u->key, s->nonce + (size_t)k * KVO_NONCE_BYTES,
                     s->aad + (size_t)k * (size_t)u->aad_bytes, (size_t)u->aad_bytes, payload, buf,
                     (size_t)u->payload_bytes, s->tag + (size_t)k * KVO_TAG_BYTES);
    else if (payload != buf)
        memcpy(buf, payload, (size_t)u->payload_bytes);
}

int kvo_store_unit(kvo_unit *u, kvo_slots *s) {
    u->io_ns = u->seal_ns = u->copy_ns = 0;
    int rc = kvo_run_copy(u);
    if (rc != 0)
        return rc;
    /* Run by run: each run's slots are sealed right before its write, while they are
     * still in the CPU's caches (a batch of units is more than the caches hold). */
    for (int j = 0; j < u->n;) {
        int j1 = kvo_run_end(u, s, j, u->n);
        int64_t t0 = kvo_now_ns();
        for (int k = j; k < j1; k++)
            seal_slot(u, s, k);
        u->seal_ns += kvo_now_ns() - t0;
        kvo_transfer(u, s, j, j1, 1);
        j = j1;
    }
    return 0;
}
