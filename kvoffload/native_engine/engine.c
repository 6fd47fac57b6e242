/* The native engine: per lane (one slot file, one direction) a queue of units and C worker
 * threads that take them and do all a unit needs without the GIL: its device copy (a
 * store's into staging, waited for; a load's out of staging, launched, and waited for once
 * the worker's next unit is read), its seals or opens and its file calls (store_unit.c,
 * load_unit.c). A job is posted once its last unit is done; Python collects posted jobs
 * in batches (kvoffload/native_engine.py).
 *
 * Why C threads: in vLLM's worker the engine thread holds the GIL most of a step, and a
 * Python thread waits up to the switch interval (5 ms) for it after every call that gave
 * it up, once or more per unit. Units here take the GIL only where the fault seam or the
 * device need Python (the kvo_py_* callbacks: tests, and layouts whose copies need torch).
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "unit_runs.h"

typedef struct {
    int is_store, fd, direct, max_run;
    int64_t slot_bytes, payload_bytes;
    kvo_qunit *head, *tail;
    int64_t depth;
    pthread_cond_t work; /* a unit queued, or stop */
} lane_t;

typedef struct {
    kvo_engine *e;
    int id, lane, rows;
    uint64_t stage[2];       /* staging buffers (0: none, a direct lane) */
    kvo_plan *plan;          /* Python's, set at bind */
    pthread_t thread;
    int made, reaped;
    uint64_t *dsts, *srcs, *sizes; /* rows x tensors: one copy's pieces */
    uint64_t *buf, *payload;       /* rows: the unit's buffers */
    kvo_unit u;
    kvo_slots s;
    kvo_qunit *cur; /* the unit whose file calls run now (for io_through_python) */
    int cur_buf;
    int raised;     /* a Python callback raised during the current unit */
} worker_t;

struct kvo_engine {
    pthread_mutex_t mu;
    pthread_cond_t changed; /* a job posted, a worker bound or ended, a copy done */
    int nlanes, nworkers;
    lane_t *lanes;
    worker_t *workers;
    int seal;
    void *key;
    int *gate;
    void *handle;
    kvo_py_bind_fn bind;
    kvo_py_io_fn io;
    kvo_py_device_fn device;
    kvo_job *done_head, *done_tail;
    int started, bound, bind_failed, alive, copies;
    int stopping, failed;
};

/* -- time ------------------------------------------------------------------------------ */

/* `timeout_ns` from now (negative: for ever, and `ts` is not used). */
static const struct timespec *deadline_of(struct timespec *ts, int64_t timeout_ns) {
    if (timeout_ns < 0)
        return NULL;
    clock_gettime(CLOCK_MONOTONIC, ts);
    int64_t ns = ts->tv_nsec + timeout_ns % 1000000000;
    ts->tv_sec += (time_t)(timeout_ns / 1000000000 + ns / 1000000000);
    ts->tv_nsec = (long)(ns % 1000000000);
    return ts;
}

/* Wait on `cv` until `deadline` (NULL: for ever): 0, or ETIMEDOUT. */
static int wait_until(pthread_cond_t *cv, pthread_mutex_t *mu, const struct timespec *deadline) {
    if (deadline == NULL)
        return pthread_cond_wait(cv, mu);
    return pthread_cond_timedwait(cv, mu, deadline);
}

static void init_cond(pthread_cond_t *cv) {
    pthread_condattr_t a;
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC); /* timeouts immune to the wall clock */
    pthread_cond_init(cv, &a);
    pthread_condattr_destroy(&a);
}

/* -- a unit's life --------------------------------------------------------------------- */

static int64_t io_through_python(void *handle, int j0, int j1, int64_t offset) {
    worker_t *w = handle;
    kvo_engine *e = w->e;
    if (w->raised) /* the seam raised this unit: no more calls (the Python engine's too) */
        return -EIO;
    int64_t got = e->io(e->handle, w->id, w->cur->job->id, w->cur->first, w->cur_buf, j0, j1, offset);
    if (got == KVO_RAISED) {
        w->raised = 1;
        return -EIO;
    }
    return got;
}

static void prepare(worker_t *w, kvo_qunit *q, int b) {
    kvo_engine *e = w->e;
    lane_t *l = &e->lanes[q->lane];
    kvo_job *j = q->job;
    int f = q->first;
    for (int k = 0; k < q->n; k++) {
        uint64_t host = j->host != NULL ? j->host[f + k] : 0;
        w->buf[k] = l->direct ? host : w->stage[b] + (uint64_t)k * (uint64_t)l->slot_bytes;
        w->payload[k] = host != 0 ? host : w->buf[k];
    }
    kvo_slots *s = &w->s;
    s->file_off = j->file_off + f;
    s->buf = w->buf;
    s->payload = w->payload;
    s->nonce = j->nonce + (size_t)f * KVO_NONCE_BYTES;
    s->aad = j->aad + (size_t)f * (size_t)j->aad_bytes;
    s->tag = j->tag + (size_t)f * KVO_TAG_BYTES;
    s->status = j->status + f;
    s->err = j->err + f;
    kvo_unit *u = &w->u;
    u->fd = l->fd;
    u->n = q->n;
    u->slot_bytes = l->slot_bytes;
    u->payload_bytes = l->payload_bytes;
    u->max_run = l->max_run;
    u->seal = e->seal;
    u->aad_bytes = j->aad_bytes;
    u->key = e->key;
    u->io = j->py_io ? io_through_python : NULL;
    u->io_handle = w;
    u->gate = e->gate;
    w->cur = q;
    w->cur_buf = b;
    w->raised = 0;
}

static void set_rows(kvo_qunit *q, int32_t from, int32_t to) {
    int32_t *st = q->job->status + q->first;
    for (int k = 0; k < q->n; k++)
        if (from < 0 || st[k] == from)
            st[k] = to;
}

static void fail_job(kvo_engine *e, kvo_job *j, int failure) {
    __atomic_store_n(&j->failure, failure, __ATOMIC_RELEASE);
    __atomic_store_n(&e->failed, 1, __ATOMIC_RELEASE);
}

/* The unit is over: the last of its job posts the job. */
static void finish(worker_t *w, kvo_qunit *q) {
    kvo_engine *e = w->e;
    kvo_job *j = q->job;
    if (__atomic_sub_fetch(&j->pending, 1, __ATOMIC_ACQ_REL) != 0)
        return;
    pthread_mutex_lock(&e->mu);
    j->next_done = NULL;
    if (e->done_tail != NULL)
        e->done_tail->next_done = j;
    else
        e->done_head = j;
    e->done_tail = j;
    pthread_cond_broadcast(&e->changed);
    pthread_mutex_unlock(&e->mu);
}

/* A unit taken once the engine stopped, or after a failure: every row ends without IO. */
static int refused(worker_t *w, kvo_qunit *q) {
    kvo_engine *e = w->e;
    int failed = __atomic_load_n(&e->failed, __ATOMIC_ACQUIRE);
    if (!failed && !__atomic_load_n(&e->stopping, __ATOMIC_ACQUIRE))
        return 0;
    set_rows(q, -1, failed ? KVO_DEVICE : KVO_CANCELLED);
    finish(w, q);
    return 1;
}

static void account(worker_t *w, kvo_qunit *q) {
    kvo_job *j = q->job;
    j->unit_io_ns[q->index] = w->u.io_ns;
    __atomic_add_fetch(&j->seal_ns, w->u.seal_ns, __ATOMIC_RELAXED);
    if (w->raised)
        fail_job(w->e, j, -1);
}

/* The unit's pieces between its blocks and staging buffer `b` (loads: its good rows only). */
static size_t pieces(worker_t *w, kvo_qunit *q, int b, int to_host) {
    kvo_plan *p = w->plan;
    kvo_job *j = q->job;
    int64_t slot = w->e->lanes[q->lane].slot_bytes;
    size_t c = 0;
    for (int t = 0; t < p->tensors; t++) {
        for (int k = 0; k < q->n; k++) {
            if (!to_host && j->status[q->first + k] != KVO_OK)
                continue;
            uint64_t dev = p->base[t] + (uint64_t)j->block[q->first + k] * p->bpb[t];
            uint64_t hst = w->stage[b] + (uint64_t)k * (uint64_t)slot + p->offset[t];
            w->dsts[c] = to_host ? hst : dev;
            w->srcs[c] = to_host ? dev : hst;
            w->sizes[c] = p->bpb[t];
            c++;
        }
    }
    return c;
}

static void memcpy_pieces(worker_t *w, size_t count) {
    for (size_t i = 0; i < count; i++)
        memcpy((void *)(uintptr_t)w->dsts[i], (const void *)(uintptr_t)w->srcs[i], (size_t)w->sizes[i]);
}

/* CUDA: queue the pieces and record event `b`: 0, or a CUresult. */
static int cuda_launch(worker_t *w, size_t count, int b) {
    kvo_plan *p = w->plan;
    size_t attr_idx = 0, fail_idx = 0;
    int rc = 0;
    if (count)
        rc = p->batch(w->dsts, w->srcs, w->sizes, count, p->attrs, &attr_idx, 1, &fail_idx, p->stream);
    if (rc == 0)
        rc = p->record(p->event[b], p->stream);
    return rc;
}

static int cu_result(int rc) {
    return rc > 0 ? rc : (rc < 0 ? 1 : 0);
}

/* A store's blocks into staging buffer 0, waited for: 0, a CUresult, or -1 (Python raised). */
static int store_copy(worker_t *w, kvo_qunit *q) {
    kvo_engine *e = w->e;
    kvo_job *j = q->job;
    kvo_plan *p = w->plan;
    if (p->kind == KVO_COPY_PY) /* Python's copy waits for the job's wait event itself */
        return e->device(e->handle, w->id, j->id, q->first, q->n, 0, 0) != 0 ? -1 : 0;
    if (j->wait_py && e->device(e->handle, w->id, j->id, q->first, q->n, 0, 3) != 0)
        return -1;
    size_t count = pieces(w, q, 0, 1);
    if (p->kind == KVO_COPY_MEMCPY) {
        memcpy_pieces(w, count);
        return 0;
    }
    int rc = j->wait_event != NULL ? p->stream_wait(p->stream, j->wait_event, 0) : 0;
    if (rc == 0)
        rc = cuda_launch(w, count, 0);
    if (rc == 0)
        rc = p->sync(p->event[0]);
    return cu_result(rc);
}

static void store(worker_t *w, kvo_qunit *q) {
    if (refused(w, q))
        return;
    kvo_job *j = q->job;
    prepare(w, q, 0);
    if (j->host == NULL) { /* device blocks: into staging first */
        int64_t t0 = kvo_now_ns();
        int rc = store_copy(w, q);
        __atomic_add_fetch(&j->copy_ns, kvo_now_ns() - t0, __ATOMIC_RELAXED);
        if (rc != 0) { /* nothing of the unit is written */
            set_rows(q, -1, KVO_DEVICE);
            fail_job(w->e, j, rc);
            finish(w, q);
            return;
        }
    } else if (j->wait_py && w->e->device(w->e->handle, w->id, j->id, q->first, q->n, 0, 3) != 0) {
        set_rows(q, -1, KVO_DEVICE);
        fail_job(w->e, j, -1);
        finish(w, q);
        return;
    }
    kvo_store_unit(&w->u, &w->s);
    account(w, q);
    finish(w, q);
}

/* Counted in as a copy that writes the caller's device blocks, unless the engine stopped. */
static int enter_copy(kvo_engine *e) {
    pthread_mutex_lock(&e->mu);
    int ok = !e->stopping;
    if (ok)
        e->copies++;
    pthread_mutex_unlock(&e->mu);
    return ok;
}

static void leave_copy(kvo_engine *e) {
    pthread_mutex_lock(&e->mu);
    e->copies--;
    pthread_cond_broadcast(&e->changed);
    pthread_mutex_unlock(&e->mu);
}

static int any_ok(kvo_qunit *q) {
    for (int k = 0; k < q->n; k++)
        if (q->job->status[q->first + k] == KVO_OK)
            return 1;
    return 0;
}

/* Read and open the unit into staging buffer `b` (or its host blocks), then launch the copy
 * of its good rows to the device: the unit, where that copy runs on (settle waits for it),
 * else NULL (the unit is over). */
static kvo_qunit *load(worker_t *w, kvo_qunit *q, int b) {
    if (refused(w, q))
        return NULL;
    kvo_engine *e = w->e;
    kvo_job *j = q->job;
    kvo_plan *p = w->plan;
    prepare(w, q, b);
    kvo_load_unit(&w->u, &w->s);
    account(w, q);
    if (j->host != NULL || !any_ok(q)) { /* host blocks: opening into them was the copy */
        finish(w, q);
        return NULL;
    }
    if (!enter_copy(e)) { /* shutdown began: the blocks are not ours to write */
        set_rows(q, KVO_OK, KVO_CANCELLED);
        finish(w, q);
        return NULL;
    }
    int64_t t0 = kvo_now_ns();
    int rc;
    if (!kvo_gate_enter(e->gate)) { /* shutdown ended the job meanwhile */
        leave_copy(e);
        set_rows(q, KVO_OK, KVO_CANCELLED);
        finish(w, q);
        return NULL;
    }
    if (p->kind == KVO_COPY_PY) {
        rc = e->device(e->handle, w->id, j->id, q->first, q->n, b, 1) != 0 ? -1 : 0;
    } else {
        size_t count = pieces(w, q, b, 0);
        if (p->kind == KVO_COPY_MEMCPY) {
            memcpy_pieces(w, count);
            rc = 0;
        } else {
            rc = cu_result(cuda_launch(w, count, b));
        }
    }
    kvo_gate_leave(e->gate);
    __atomic_add_fetch(&j->copy_ns, kvo_now_ns() - t0, __ATOMIC_RELAXED);
    if (rc != 0 || p->kind == KVO_COPY_MEMCPY) {
        leave_copy(e);
        if (rc != 0) {
            set_rows(q, -1, KVO_DEVICE);
            fail_job(e, j, rc);
        }
        finish(w, q);
        return NULL;
    }
    return q;
}

/* Wait for a load's copy out of staging buffer `b`, then end its unit. */
static void settle(worker_t *w, kvo_qunit *q, int b) {
    kvo_engine *e = w->e;
    kvo_plan *p = w->plan;
    int64_t t0 = kvo_now_ns();
    int rc = p->kind == KVO_COPY_PY ? (e->device(e->handle, w->id, q->job->id, q->first, q->n, b, 2) != 0 ? -1 : 0)
                                    : cu_result(p->sync(p->event[b]));
    __atomic_add_fetch(&q->job->copy_ns, kvo_now_ns() - t0, __ATOMIC_RELAXED);
    leave_copy(e);
    if (rc != 0) {
        set_rows(q, -1, KVO_DEVICE);
        fail_job(e, q->job, rc);
    }
    finish(w, q);
}

/* The next unit of the worker's lane: waits for one if `wait`; NULL once stopped and empty
 * (or, not waiting, where none is queued). */
static kvo_qunit *take(kvo_engine *e, int lane, int wait) {
    lane_t *l = &e->lanes[lane];
    pthread_mutex_lock(&e->mu);
    while (wait && l->head == NULL && !e->stopping)
        pthread_cond_wait(&l->work, &e->mu);
    kvo_qunit *q = l->head;
    if (q != NULL) {
        l->head = q->next;
        if (l->head == NULL)
            l->tail = NULL;
        l->depth--;
    }
    pthread_mutex_unlock(&e->mu);
    return q;
}

static void serve(worker_t *w) {
    kvo_engine *e = w->e;
    int is_store = e->lanes[w->lane].is_store;
    kvo_qunit *pending = NULL; /* a load whose copy runs, out of buffer pending_buf */
    int pending_buf = 0, turn = 0;
    for (;;) {
        /* With a copy in flight, only a unit already queued is worth starting: its reads
         * overlap the copy. Otherwise the copy is waited for first. */
        kvo_qunit *q = take(e, w->lane, pending == NULL);
        if (q == NULL) {
            if (pending == NULL)
                return;
            settle(w, pending, pending_buf);
            pending = NULL;
            continue;
        }
        if (is_store) {
            store(w, q);
            continue;
        }
        int b = turn;
        turn = w->stage[1] != 0 ? turn ^ 1 : 0;
        kvo_qunit *launched = load(w, q, b);
        if (pending != NULL) /* its buffer is the next one read into */
            settle(w, pending, pending_buf);
        pending = launched;
        pending_buf = b;
    }
}

static void *worker_main(void *arg) {
    worker_t *w = arg;
    kvo_engine *e = w->e;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL); /* signals are for Python's main thread */
    char name[16]; /* what top and /proc/self/task/<tid>/comm show */
    snprintf(name, sizeof name, "kvo-%s-%d", e->lanes[w->lane].is_store ? "store" : "load", w->id);
    pthread_setname_np(pthread_self(), name);
    int ok = e->bind(e->handle, w->id) == 0 && w->plan != NULL;
    pthread_mutex_lock(&e->mu);
    if (ok)
        e->bound++;
    else
        e->bind_failed++;
    pthread_cond_broadcast(&e->changed);
    pthread_mutex_unlock(&e->mu);
    if (ok)
        serve(w);
    pthread_mutex_lock(&e->mu);
    e->alive--;
    pthread_cond_broadcast(&e->changed);
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

/* -- Python's side ------------------------------------------------------------------------- */

kvo_engine *kvo_engine_new(int lanes, int workers, int seal, void *key, int *gate, void *handle,
                           kvo_py_bind_fn bind, kvo_py_io_fn io, kvo_py_device_fn device) {
    kvo_engine *e = calloc(1, sizeof *e);
    if (e == NULL)
        return NULL;
    e->lanes = calloc((size_t)lanes, sizeof *e->lanes);
    e->workers = calloc((size_t)workers, sizeof *e->workers);
    if (e->lanes == NULL || e->workers == NULL) {
        free(e->lanes);
        free(e->workers);
        free(e);
        return NULL;
    }
    pthread_mutex_init(&e->mu, NULL);
    init_cond(&e->changed);
    for (int i = 0; i < lanes; i++)
        init_cond(&e->lanes[i].work);
    e->nlanes = lanes;
    e->nworkers = workers;
    e->seal = seal;
    e->key = key;
    e->gate = gate;
    e->handle = handle;
    e->bind = bind;
    e->io = io;
    e->device = device;
    return e;
}

void kvo_engine_lane(kvo_engine *e, int lane, int is_store, int fd, int64_t slot_bytes, int64_t payload_bytes,
                     int direct, int max_run) {
    lane_t *l = &e->lanes[lane];
    l->is_store = is_store;
    l->fd = fd;
    l->slot_bytes = slot_bytes;
    l->payload_bytes = payload_bytes;
    l->direct = direct;
    l->max_run = max_run;
}

int kvo_engine_worker(kvo_engine *e, int worker, int lane, uint64_t stage0, uint64_t stage1, int rows) {
    worker_t *w = &e->workers[worker];
    w->e = e;
    w->id = worker;
    w->lane = lane;
    w->rows = rows;
    w->stage[0] = stage0;
    w->stage[1] = stage1;
    w->buf = calloc((size_t)rows, sizeof *w->buf);
    w->payload = calloc((size_t)rows, sizeof *w->payload);
    return w->buf != NULL && w->payload != NULL ? 0 : ENOMEM;
}

void kvo_engine_plan(kvo_engine *e, int worker, kvo_plan *plan) {
    worker_t *w = &e->workers[worker];
    size_t n = (size_t)w->rows * (size_t)(plan->tensors > 0 ? plan->tensors : 1);
    free(w->dsts);
    free(w->srcs);
    free(w->sizes);
    w->dsts = malloc(n * sizeof *w->dsts);
    w->srcs = malloc(n * sizeof *w->srcs);
    w->sizes = malloc(n * sizeof *w->sizes);
    w->plan = w->dsts != NULL && w->srcs != NULL && w->sizes != NULL ? plan : NULL;
}

int kvo_engine_start(kvo_engine *e) {
    for (int i = 0; i < e->nworkers; i++) {
        worker_t *w = &e->workers[i];
        if (w->made || w->buf == NULL)
            continue;
        pthread_mutex_lock(&e->mu);
        e->alive++;
        e->started++;
        pthread_mutex_unlock(&e->mu);
        int rc = pthread_create(&w->thread, NULL, worker_main, w);
        if (rc != 0) {
            pthread_mutex_lock(&e->mu);
            e->alive--;
            e->started--;
            pthread_mutex_unlock(&e->mu);
            return rc;
        }
        w->made = 1;
    }
    return 0;
}

int kvo_engine_ready(kvo_engine *e, int64_t timeout_ns) {
    struct timespec ts;
    const struct timespec *dl = deadline_of(&ts, timeout_ns);
    pthread_mutex_lock(&e->mu);
    int rc = 0;
    while (e->bound + e->bind_failed < e->started && rc == 0)
        rc = wait_until(&e->changed, &e->mu, dl);
    int out = e->bound + e->bind_failed < e->started ? -1 : (e->bind_failed ? 0 : 1);
    pthread_mutex_unlock(&e->mu);
    return out;
}

void kvo_engine_submit(kvo_engine *e, kvo_qunit *units, int count) {
    pthread_mutex_lock(&e->mu);
    for (int i = 0; i < count; i++) {
        kvo_qunit *q = &units[i];
        lane_t *l = &e->lanes[q->lane];
        q->next = NULL;
        if (l->tail != NULL)
            l->tail->next = q;
        else
            l->head = q;
        l->tail = q;
        l->depth++;
        pthread_cond_signal(&l->work);
    }
    pthread_mutex_unlock(&e->mu);
}

int kvo_engine_collect(kvo_engine *e, int64_t *ids, int max, int64_t timeout_ns) {
    struct timespec ts;
    const struct timespec *dl = deadline_of(&ts, timeout_ns);
    pthread_mutex_lock(&e->mu);
    int rc = 0;
    while (e->done_head == NULL && rc == 0 && !(e->stopping && e->alive == 0))
        rc = wait_until(&e->changed, &e->mu, dl);
    int n = 0;
    while (n < max && e->done_head != NULL) {
        kvo_job *j = e->done_head;
        e->done_head = j->next_done;
        if (e->done_head == NULL)
            e->done_tail = NULL;
        ids[n++] = j->id;
    }
    if (n == 0 && e->stopping && e->alive == 0)
        n = -1;
    pthread_mutex_unlock(&e->mu);
    return n;
}

int64_t kvo_engine_queued(kvo_engine *e, int lane) {
    pthread_mutex_lock(&e->mu);
    int64_t n = e->lanes[lane].depth;
    pthread_mutex_unlock(&e->mu);
    return n;
}

void kvo_engine_stop(kvo_engine *e) {
    pthread_mutex_lock(&e->mu);
    __atomic_store_n(&e->stopping, 1, __ATOMIC_RELEASE);
    for (int i = 0; i < e->nlanes; i++)
        pthread_cond_broadcast(&e->lanes[i].work);
    pthread_cond_broadcast(&e->changed);
    pthread_mutex_unlock(&e->mu);
}

void kvo_engine_fail(kvo_engine *e) {
    __atomic_store_n(&e->failed, 1, __ATOMIC_RELEASE);
}

/* Wait until the counter `count` of `e` (guarded by e->mu) is 0, or `timeout_ns` passed: its value then. */
static int wait_zero(kvo_engine *e, const int *count, int64_t timeout_ns) {
    struct timespec ts;
    const struct timespec *dl = deadline_of(&ts, timeout_ns);
    pthread_mutex_lock(&e->mu);
    int rc = 0;
    while (*count > 0 && rc == 0)
        rc = wait_until(&e->changed, &e->mu, dl);
    int n = *count;
    pthread_mutex_unlock(&e->mu);
    return n;
}

int kvo_engine_wait_copies(kvo_engine *e, int64_t timeout_ns) {
    return wait_zero(e, &e->copies, timeout_ns);
}

int kvo_engine_join(kvo_engine *e, int64_t timeout_ns) {
    int alive = wait_zero(e, &e->alive, timeout_ns);
    if (alive == 0) { /* every worker is past its last touch of the engine */
        for (int i = 0; i < e->nworkers; i++) {
            worker_t *w = &e->workers[i];
            if (w->made && !w->reaped) {
                pthread_join(w->thread, NULL);
                w->reaped = 1;
            }
        }
    }
    return alive;
}

void kvo_engine_free(kvo_engine *e) {
    for (int i = 0; i < e->nworkers; i++) {
        worker_t *w = &e->workers[i];
        free(w->dsts);
        free(w->srcs);
        free(w->sizes);
        free(w->buf);
        free(w->payload);
    }
    for (int i = 0; i < e->nlanes; i++)
        pthread_cond_destroy(&e->lanes[i].work);
    pthread_cond_destroy(&e->changed);
    pthread_mutex_destroy(&e->mu);
    free(e->lanes);
    free(e->workers);
    free(e);
}
