/* The one interface between kvoffload's Python and its native IO core.
 *
 * This file is both the C header (store_unit.c, load_unit.c and unit_runs.c include it)
 * and, verbatim, the declarations cffi compiles the extension from (build_native.py):
 * Python fills these structures through cffi, which checks every field's type and
 * offset against this very text when the extension is compiled. Nothing is mirrored
 * by hand. It therefore holds only what cffi parses: integer #defines, typedefs,
 * structures and prototypes, with no include guard (each .c includes it once).
 */

/* Outcome of one slot (kvo_slots.status). */
#define KVO_OK 0
#define KVO_IO_ERROR 1  /* its file call failed: err holds the errno */
#define KVO_SHORT 2     /* its file call moved fewer bytes than the slot holds */
#define KVO_INTEGRITY 3 /* read whole, but its tag did not match: never delivered */
#define KVO_CANCELLED 4 /* shutdown began before its bytes were delivered: nothing written */
#define KVO_SKIP 5      /* in (loads): holds no completed store: not read, left as is */

/* The seal (kvo_unit.seal). */
#define KVO_SEAL_OFF 0
#define KVO_SEAL_AES_GCM 1

#define KVO_TAG_BYTES 16
#define KVO_NONCE_BYTES 12

/* How a worker makes its device copies (kvo_plan.kind). CUDA: one cuMemcpyBatchAsync
 * (12.8 ABI) of the unit's pieces on the worker's stream, then cuEventRecord (a store's
 * waited for at once with cuEventSynchronize, a load's once the worker's next unit is
 * read). MEMCPY: host memory on both sides (CpuDevice): memcpy, in the worker. PY: the
 * device's copies need Python (kvo_py_device_fn), taking the GIL for each. */
#define KVO_COPY_PY 0
#define KVO_COPY_CUDA 1
#define KVO_COPY_MEMCPY 2

typedef int (*kvo_batch_fn)(void *dsts, void *srcs, void *sizes, size_t count, void *attrs, size_t *attr_idxs,
                            size_t num_attrs, size_t *fail_idx, void *stream);
typedef int (*kvo_record_fn)(void *event, void *stream);
typedef int (*kvo_wait_fn)(void *event);
typedef int (*kvo_stream_wait_fn)(void *stream, void *event, unsigned int flags);

/* A file call made by Python (a fault seam that is not the plain OsCalls): move slots
 * [j0, j1) of the unit, a run of consecutive file slots, at byte `offset`; returns the
 * bytes moved, or -errno. */
typedef int64_t (*kvo_io_fn)(void *handle, int j0, int j1, int64_t offset);

/* Parallel arrays, one entry per slot of the unit (numpy arrays on the Python side). */
typedef struct {
    int64_t *file_off;  /* the slot's byte offset in the file */
    uint64_t *buf;      /* address of the slot's file bytes in memory (a staging row, or a host block) */
    uint64_t *payload;  /* stores: the plaintext's address; loads: where it goes (== buf: in place) */
    uint8_t *nonce;     /* KVO_NONCE_BYTES per slot: stores seal with it, loads open with it */
    uint8_t *aad;       /* aad_bytes per slot: what the slot is authenticated to */
    uint8_t *tag;       /* KVO_TAG_BYTES per slot: stores write it, loads check it */
    int32_t *status;    /* out: KVO_* (must come in as KVO_OK) */
    int32_t *err;       /* out: errno of the call that failed the slot (0: none) */
} kvo_slots;

/* One call's unit (or batch of units). */
typedef struct {
    int fd;
    int n;                 /* slots */
    int64_t slot_bytes;    /* a slot in the file (the payload, padded for O_DIRECT) */
    int64_t payload_bytes;
    int max_run;           /* most slots one file call moves: the Python path's limit too */
    int seal;              /* KVO_SEAL_* */
    int64_t aad_bytes;
    void *key;             /* kvo_gcm_key of the run's seal (KVO_SEAL_AES_GCM) */
    kvo_io_fn io;          /* NULL: preadv/pwritev straight to the kernel */
    void *io_handle;
    int *gate;             /* shutdown's gate (kvo_gate_*): no file call once closing, no write
                            * into the caller's memory once ended */
    int64_t io_ns;         /* out: nanoseconds in file calls */
    int64_t seal_ns;       /* out: nanoseconds sealing or opening */
} kvo_unit;

/* Store: run by run, seal each slot's payload into its buffer and write the run. Load:
 * run by run, read and open each slot into its payload; a slot that fails leaves no
 * unverified byte in a payload that is not its buffer. The engine's workers call these
 * (engine.c); tests drive them directly. */
void kvo_store_unit(kvo_unit *u, kvo_slots *s);
void kvo_load_unit(kvo_unit *u, kvo_slots *s);

/* Shutdown's gate, one int per engine: bit 0 closing, bit 1 ended, the bits above count the
 * calls writing into the caller's memory right now. A load makes no file call once closing;
 * it writes a run's payloads (and launches a copy) only inside kvo_gate_enter/leave, which
 * refuses once ended; kvo_gate_end sets ended and returns once no write is left under way,
 * so after it nothing is written for any job, even by a call that returns from a hang. */
void kvo_gate_close(int *gate);
int kvo_gate_enter(int *gate);
void kvo_gate_leave(int *gate);
void kvo_gate_end(int *gate);
/* -- The engine (engine.c) ---------------------------------------------------------------
 * Per lane (one slot file, one direction) a queue of units and C threads that take them:
 * a unit's device copy, seals or opens and file calls, with no GIL. A job is posted to the
 * completion list once its last unit is done; Python submits jobs and collects finished
 * ones (kvo_engine_collect), touching a job twice and a unit never, except where the fault
 * seam or the device need Python (the kvo_py_* callbacks, made by Python at the engine's
 * creation: each takes the GIL). */

#define KVO_DEVICE 6        /* not run: the device failed (this unit's copy, or an earlier one) */
#define KVO_RAISED -1000000 /* kvo_py_io_fn: the seam raised (Python keeps it): no more calls this unit */

/* Device copies one worker makes (a plan from the device seam, built by Python at bind). */
typedef struct {
    int kind;                      /* KVO_COPY_* */
    kvo_batch_fn batch;            /* CUDA: cuMemcpyBatchAsync */
    kvo_record_fn record;          /* CUDA: cuEventRecord */
    kvo_wait_fn sync;              /* CUDA: cuEventSynchronize */
    kvo_stream_wait_fn stream_wait; /* CUDA: cuStreamWaitEvent (a store's wait event) */
    void *attrs;                   /* CUDA: one CUmemcpyAttributes for this worker's direction */
    void *stream;                  /* CUDA: the worker's stream */
    void *event[2];                /* CUDA: one per staging buffer */
    int tensors;                   /* cache tensors: a block is one piece of each */
    uint64_t *base;                /* per tensor: address of block 0 */
    uint64_t *bpb;                 /* per tensor: bytes per block */
    uint64_t *offset;              /* per tensor: its offset inside a slot */
} kvo_plan;

/* One job: arrays over its slots, grouped lane by lane and unit by unit (Python fills them at
 * submit and reads them once the job is collected). */
typedef struct kvo_job kvo_job;
struct kvo_job {
    int64_t id;            /* Python's job id */
    int n;                 /* slots */
    int64_t *block;        /* device block id */
    int64_t *file_off;     /* the slot's byte offset in its lane's file */
    uint64_t *host;        /* host block address (blocks in host memory), or NULL: device blocks */
    uint8_t *nonce;        /* KVO_NONCE_BYTES per slot */
    uint8_t *aad;          /* aad_bytes per slot */
    int64_t aad_bytes;
    uint8_t *tag;          /* KVO_TAG_BYTES per slot: stores write it, loads check it */
    int32_t *status;       /* in: KVO_OK, or KVO_SKIP (a load of a slot holding no store); out: KVO_* */
    int32_t *err;          /* out: errno of the call that failed the slot (0: none) */
    int64_t *unit_io_ns;   /* out: per unit of the job, nanoseconds in its file calls */
    int py_io;             /* file calls through Python's seam (kvo_py_io_fn), not the kernel's */
    void *wait_event;      /* stores on CUDA: an event the copy waits for, or NULL */
    int wait_py;           /* stores: Python waits for the job's wait event first (kvo_py_device_fn) */
    int pending;           /* units not done yet (the engine's count) */
    int failure;           /* out: 0; a device copy's CUresult (> 0); -1: a Python callback raised */
    int64_t seal_ns;       /* out: summed over its units */
    int64_t copy_ns;
    kvo_job *next_done;    /* the engine's completion list */
};

/* One unit: `n` slots of the job's arrays from `first`, all of lane `lane`. */
typedef struct kvo_qunit kvo_qunit;
struct kvo_qunit {
    kvo_job *job;
    int lane;
    int first;
    int n;
    int index;             /* which unit of its job (unit_io_ns) */
    kvo_qunit *next;       /* the lane's queue */
};

/* Python's part. bind: set up worker `worker` on its own thread (device, stream, events)
 * and hand the engine its plan (kvo_engine_plan); 0, or nonzero where it could not. io:
 * the seam's file call for slots [j0, j1) of the unit of `job` from `first`, the worker's
 * staging buffer `buf`: bytes moved, -errno, or KVO_RAISED. device: a copy Python makes
 * (phase 0: a store's, waited for; 1: a load's, launched; 2: wait for the load's; 3: wait
 * for a store job's wait event): 0, or nonzero where it raised (fatal for the run). */
typedef int (*kvo_py_bind_fn)(void *handle, int worker);
typedef int64_t (*kvo_py_io_fn)(void *handle, int worker, int64_t job, int first, int buf, int j0, int j1,
                                int64_t offset);
typedef int (*kvo_py_device_fn)(void *handle, int worker, int64_t job, int first, int n, int buf, int phase);

typedef struct kvo_engine kvo_engine;
/* An engine of `lanes` lanes and `workers` workers (none started), sealing with `seal` under
 * `key`, behind shutdown's `gate`; the callbacks get `handle`. NULL: out of memory. */
kvo_engine *kvo_engine_new(int lanes, int workers, int seal, void *key, int *gate, void *handle,
                           kvo_py_bind_fn bind, kvo_py_io_fn io, kvo_py_device_fn device);
void kvo_engine_lane(kvo_engine *e, int lane, int is_store, int fd, int64_t slot_bytes, int64_t payload_bytes,
                     int direct, int max_run);
/* Worker `worker` serves lane `lane` with staging buffers stage0 (and stage1, loads) of
 * `rows` slots each (0: a direct lane reads and writes the host blocks themselves). */
int kvo_engine_worker(kvo_engine *e, int worker, int lane, uint64_t stage0, uint64_t stage1, int rows);
/* From the bind callback: the worker's copies (the plan is Python's, kept while it runs). */
void kvo_engine_plan(kvo_engine *e, int worker, kvo_plan *plan);
/* Start every worker: 0, or the errno of the thread that could not be made (those made run). */
int kvo_engine_start(kvo_engine *e);
/* Wait until every worker started has bound: 1 all did, 0 one failed, -1 timed out. */
int kvo_engine_ready(kvo_engine *e, int64_t timeout_ns);
/* Queue `count` units (each to its lane, in order); never blocks for long. */
void kvo_engine_submit(kvo_engine *e, kvo_qunit *units, int count);
/* Up to `max` finished jobs' ids into `ids`, waiting up to `timeout_ns` for one: how many; -1
 * once stopped with every worker gone and nothing left to collect. */
int kvo_engine_collect(kvo_engine *e, int64_t *ids, int max, int64_t timeout_ns);
int64_t kvo_engine_queued(kvo_engine *e, int lane);
/* Stop: units dequeued from now on end without IO (KVO_CANCELLED; KVO_DEVICE after a device
 * failure); each worker ends once its queue is empty. */
void kvo_engine_stop(kvo_engine *e);
/* A failure outside the engine (Python's): units dequeued from now on end as KVO_DEVICE. */
void kvo_engine_fail(kvo_engine *e);
/* Wait up to `timeout_ns` for every device copy a worker launched to be done: how many are not. */
int kvo_engine_wait_copies(kvo_engine *e, int64_t timeout_ns);
/* Wait up to `timeout_ns` for every worker to end (then reap them): how many are alive. */
int kvo_engine_join(kvo_engine *e, int64_t timeout_ns);
/* Free the engine: only once kvo_engine_join returned 0. */
void kvo_engine_free(kvo_engine *e);

/* What the extension was built from and for (checked by native_io.py at import). */
const char *kvo_build_info(void);
