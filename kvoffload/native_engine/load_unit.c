/* The native engine's load of one unit (the Python engine's LoadLane.read_and_open
 * does the same, slot by slot): one preadv per run of file slots, each slot opened
 * (decrypted and its tag checked) into where its payload goes; engine.c then copies the
 * good slots to the device.
 *
 * What reaches the caller's memory: only a slot that read whole and passed its check.
 * A failed check leaves zeros where its payload went; a failed read into a host block
 * (a direct lane: buf == payload) zeros that block too. Once shutdown began no file call
 * is made, and once it ended the unit's job nothing is written for it (the gate,
 * unit_io.h), even by a call that hung in the kernel and returns later. (On a direct lane
 * such a read itself lands in the block: the kernel's write, of ciphertext under AES-GCM.)
 */
#include <string.h>
#include "unit_runs.h"

static void cancel_from(kvo_slots *s, int j, int n) {
    for (int k = j; k < n; k++)
        if (s->status[k] == KVO_OK)
            s->status[k] = KVO_CANCELLED;
}

static void open_slot(kvo_unit *u, kvo_slots *s, int k) {
    uint8_t *buf = (uint8_t *)(uintptr_t)s->buf[k];
    uint8_t *payload = (uint8_t *)(uintptr_t)s->payload[k];
    if (s->status[k] != KVO_OK) {
        if (payload == buf) /* a failed read may have written part of it */
            memset(payload, 0, (size_t)u->payload_bytes);
        return;
    }
    if (u->seal == KVO_SEAL_AES_GCM) {
        if (kvo_gcm_open((const kvo_gcm_key *)u->key, s->nonce + (size_t)k * KVO_NONCE_BYTES,
                         s->aad + (size_t)k * (size_t)u->aad_bytes, (size_t)u->aad_bytes, buf, payload,
                         (size_t)u->payload_bytes, s->tag + (size_t)k * KVO_TAG_BYTES) != 0) {
            s->status[k] = KVO_INTEGRITY;
            memset(payload, 0, (size_t)u->payload_bytes); /* written before the tag was checked */
        }
    } else if (payload != buf) {
        memcpy(payload, buf, (size_t)u->payload_bytes);
    }
}

void kvo_load_unit(kvo_unit *u, kvo_slots *s) {
    u->io_ns = u->seal_ns = 0;
    /* Run by run: each run's slots are opened right after its read, while they are
     * still in the CPU's caches. */
    for (int j = 0; j < u->n;) {
        if (s->status[j] != KVO_OK) {
            j++;
            continue;
        }
        if (__atomic_load_n(u->gate, __ATOMIC_ACQUIRE) & 1) { /* closing: no new file call */
            cancel_from(s, j, u->n);
            return;
        }
        int j1 = kvo_run_end(u, s, j, u->n);
        kvo_transfer(u, s, j, j1, 0);
        if (!kvo_gate_enter(u->gate)) { /* back from a hang after shutdown ended the job */
            cancel_from(s, j, u->n);
            return;
        }
        int64_t t0 = kvo_now_ns();
        for (int k = j; k < j1; k++)
            open_slot(u, s, k);
        u->seal_ns += kvo_now_ns() - t0;
        kvo_gate_leave(u->gate);
        j = j1;
    }
}
