/* The switch of the AMX-BF16 tile path (amx_tiles.h), one per process: every library that includes
 * amx_tiles.h is bound to tidal_amx_rows here (tidal.ops.cpu_kernels), so one call turns the path
 * on, off or off for one thread in every library, whichever loaded first.
 *
 * tidal_amx_rows is the least number of rows a product takes the tiles at, 0 for never: 0 where
 * tidal_amx_set_rows was given 0 (TIDAL_CPU_AMX=0) or Linux refused the tile state's permission, and
 * 0 on a thread that set tidal_amx_thread_off (deterministic inference, whose products must be
 * row-invariant at every row count: the tiles' order differs from the FMA tiles').
 */
#include <stdatomic.h>
#include <stdint.h>

extern long syscall(long number, ...);

#define SYS_ARCH_PRCTL 158
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static atomic_int least_rows; /* set by any thread, read by all */
static _Thread_local int thread_off;

/* rows > 0: ask Linux (once per process is enough; asking again is harmless) for the tile state.
 * Returns the threshold now in force: rows, or 0 (off, or the permission refused). */
int tidal_amx_set_rows(int rows) {
#if defined(__x86_64__) && defined(__linux__)
    if (rows > 0 && syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) rows = 0;
#else
    rows = 0;
#endif
    least_rows = rows > 0 ? rows : 0;
    return least_rows;
}

/* the threshold set, whatever the calling thread's switch */
int tidal_amx_least_rows(void) { return least_rows; }

void tidal_amx_thread_off(int off) { thread_off = off != 0; }

int tidal_amx_rows(void) { return thread_off ? 0 : least_rows; }
