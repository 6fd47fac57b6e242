/* The native engine's store of one unit, once its blocks are in the buffers the unit's
 * slots are sealed from (engine.c made the device copy): seal -> one pwritev per run of
 * file slots. The Python engine's StoreLane.store does the same, slot by slot.
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

void kvo_store_unit(kvo_unit *u, kvo_slots *s) {
    u->io_ns = u->seal_ns = 0;
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
}
