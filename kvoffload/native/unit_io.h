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

/* A device copy (kvo_unit.copy). CUDA: one cuMemcpyBatchAsync (12.8 ABI) of the
 * pieces, then cuEventRecord, then (stores) cuEventSynchronize, through the driver's
 * own function pointers. MEMCPY: host memory on both sides (CpuDevice): the pieces are
 * copied by memcpy in the call itself. */
#define KVO_COPY_CUDA 1
#define KVO_COPY_MEMCPY 2

typedef int (*kvo_batch_fn)(void *dsts, void *srcs, void *sizes, size_t count, void *attrs, size_t *attr_idxs,
                            size_t num_attrs, size_t *fail_idx, void *stream);
typedef int (*kvo_record_fn)(void *event, void *stream);
typedef int (*kvo_wait_fn)(void *event);

typedef struct {
    int kind;            /* KVO_COPY_CUDA or KVO_COPY_MEMCPY */
    int wait;            /* nonzero: a unit's call waits for it (a store's, before it seals) */
    kvo_batch_fn batch;  /* CUDA only */
    kvo_record_fn record;
    kvo_wait_fn sync;    /* the event's synchronize (CUDA) */
    uint64_t *dsts;      /* count addresses each */
    uint64_t *srcs;
    uint64_t *sizes;
    size_t count;
    void *attrs;         /* one CUmemcpyAttributes */
    void *stream;
    void *event;
} kvo_copy;

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
    uint8_t *cut;       /* nonzero: no file call continues into this slot from the one before
                         * (where a batch's next unit starts: each unit keeps the calls it would
                         * have made alone, so one fault hits the same slots) */
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
    kvo_copy *copy;        /* NULL, or launched first (a store's is also waited for) */
    int64_t io_ns;         /* out: nanoseconds in file calls */
    int64_t seal_ns;       /* out: nanoseconds sealing or opening */
    int64_t copy_ns;       /* out: nanoseconds launching (and for stores waiting for) the copy */
    int copy_refused;      /* out (loads): the copy was not launched, shutdown had ended its job */
} kvo_unit;

/* Store: make the copy (if any, waited for), then run by run seal each slot's payload
 * into its buffer and write the run. Load: launch the copy (if any: the previous unit's),
 * then run by run read and open each slot into its payload; a slot that fails leaves
 * no unverified byte in a payload that is not its buffer. Both return 0, or the copy's
 * CUresult (> 0: no slot was touched). */
int kvo_store_unit(kvo_unit *u, kvo_slots *s);
int kvo_load_unit(kvo_unit *u, kvo_slots *s);

/* Shutdown's gate, one int per run: bit 0 closing, bit 1 ended, the bits above count the
 * calls writing into the caller's memory right now. A load makes no file call once closing;
 * it writes a run's payloads (and launches a copy) only inside kvo_gate_enter/leave, which
 * refuses once ended; kvo_gate_end sets ended and returns once no write is left under way,
 * so after it nothing is written for any job, even by a call that returns from a hang. */
void kvo_gate_close(int *gate);
int kvo_gate_enter(int *gate);
void kvo_gate_leave(int *gate);
void kvo_gate_end(int *gate);
/* Make `copy` inside the gate and wait for it (a load's copy no unit call came to launch,
 * made when its unit is settled): its CUresult, or -1 where the gate had ended (nothing
 * launched). One call, so the thread gives the GIL up once for the launch and the wait. */
int kvo_copy_gated(kvo_copy *copy, int *gate);

/* What the extension was built from and for (checked by native_io.py at import). */
const char *kvo_build_info(void);
