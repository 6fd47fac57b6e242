/* Runs, file calls and retries for both directions (the Python path's Lane.transfer).
 *
 * A run's file call is the one the Python path makes for the same run: one
 * preadv/pwritev of the run's bytes at the first slot's offset, buffers merged where
 * they are contiguous in memory (staging rows always are). Through a fault seam the
 * call is the seam's own method, made by Python with the same buffers (kvo_io_fn), so
 * failing the Nth call of the seam hits the same slots on both paths.
 */
#include <errno.h>
#include <limits.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>
#include "unit_runs.h"

int64_t kvo_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int kvo_run_end(const kvo_unit *u, const kvo_slots *s, int j, int end) {
    int j1 = j + 1;
    while (j1 < end && j1 - j < u->max_run && s->status[j1] == KVO_OK &&
           s->file_off[j1] == s->file_off[j1 - 1] + u->slot_bytes)
        j1++;
    return j1;
}

/* One file call for slots [a, b): bytes moved, or -errno. */
static int64_t file_call(kvo_unit *u, kvo_slots *s, int a, int b, int is_store) {
    int64_t t0 = kvo_now_ns(), got;
    if (u->io != NULL) {
        got = u->io(u->io_handle, a, b, s->file_off[a]);
    } else {
        /* b - a <= max_run <= IOV_MAX iovecs; fewer where buffers are contiguous. */
        struct iovec iov[b - a];
        int n = 0;
        for (int j = a; j < b; j++) {
            uint8_t *p = (uint8_t *)(uintptr_t)s->buf[j];
            if (n && (uint8_t *)iov[n - 1].iov_base + iov[n - 1].iov_len == p) {
                iov[n - 1].iov_len += (size_t)u->slot_bytes;
            } else {
                iov[n].iov_base = p;
                iov[n].iov_len = (size_t)u->slot_bytes;
                n++;
            }
        }
        ssize_t r = is_store ? pwritev(u->fd, iov, n, (off_t)s->file_off[a]) : preadv(u->fd, iov, n, (off_t)s->file_off[a]);
        got = r < 0 ? -(int64_t)(errno ? errno : EIO) : (int64_t)r;
    }
    u->io_ns += kvo_now_ns() - t0;
    return got;
}

static void fail_slot(kvo_slots *s, int j, int64_t got) {
    s->status[j] = got < 0 ? KVO_IO_ERROR : KVO_SHORT;
    s->err[j] = got < 0 ? (int32_t)-got : 0;
}

void kvo_transfer(kvo_unit *u, kvo_slots *s, int j, int j1, int is_store) {
    int64_t size = u->slot_bytes;
    int64_t got = file_call(u, s, j, j1, is_store);
    if (got == (int64_t)(j1 - j) * size)
        return;
    if (j1 - j == 1) {
        fail_slot(s, j, got);
        return;
    }
    /* A short call still moved the slots before it whole; the others go one by one. */
    for (int k = j + (got > 0 ? (int)(got / size) : 0); k < j1; k++) {
        int64_t one = file_call(u, s, k, k + 1, is_store);
        if (one != size)
            fail_slot(s, k, one);
    }
}

void kvo_gate_close(int *gate) {
    __atomic_fetch_or(gate, 1, __ATOMIC_ACQ_REL);
}

int kvo_gate_enter(int *gate) {
    int v = __atomic_load_n(gate, __ATOMIC_ACQUIRE);
    do {
        if (v & 2)
            return 0;
    } while (!__atomic_compare_exchange_n(gate, &v, v + 4, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE));
    return 1;
}

void kvo_gate_leave(int *gate) {
    __atomic_fetch_sub(gate, 4, __ATOMIC_ACQ_REL);
}

void kvo_gate_end(int *gate) {
    __atomic_fetch_or(gate, 3, __ATOMIC_ACQ_REL);
    /* A write under way is one run's memcpy or cipher pass: microseconds to milliseconds. */
    while (__atomic_load_n(gate, __ATOMIC_ACQUIRE) >> 2) {
        struct timespec pause = {0, 50000};
        nanosleep(&pause, NULL);
    }
}

const char *kvo_build_info(void) {
    return "unit_io " KVO_SOURCE_HASH;
}
