/* What store_unit.c and load_unit.c share: runs of consecutive file slots, their file
 * calls and the single-slot retries after a failed or short one. */
#ifndef KVOFFLOAD_UNIT_RUNS_H
#define KVOFFLOAD_UNIT_RUNS_H
#include <stddef.h>
#include <stdint.h>
#include "unit_io.h"
#include "aes_gcm.h"

int64_t kvo_now_ns(void);
/* The end of the run of consecutive file slots that starts at j (at most u->max_run slots,
 * never across a cut or a slot already failed). */
int kvo_run_end(const kvo_unit *u, const kvo_slots *s, int j, int end);
/* Write (store) or read (load) slots [j, j1), one run: one file call, then the slots a
 * failed or short call did not move whole, one call each; failed slots get their status. */
void kvo_transfer(kvo_unit *u, kvo_slots *s, int j, int j1, int is_store);
#endif
