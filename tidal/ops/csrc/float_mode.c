/* The floating-point mode of every thread that runs tidal's arithmetic: the calling thread and the
 * OpenMP pool that torch's ops and the C kernels share (one libgomp). MXCSR is per thread, and a
 * thread created later copies its creator's, so setting it here on the caller and on each pool
 * thread covers the pool as it stands and the threads it adds.
 *
 * flush: flush-to-zero (results below the smallest normal float become 0) and denormals-are-zero
 * (such inputs read as 0). Decaying recurrent states (KDA's exp(G) over a chunk, a state decayed
 * step after step) produce such values; on x86 every operation touching one takes a microcode
 * assist of ~100 cycles, so a product full of them runs an order of magnitude slower. Values below
 * 1.2e-38 carry nothing a model's output can show. Returns the number of threads set, or -1 where
 * the CPU has no MXCSR (the mode is then left as it is). */
#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#define MXCSR_FLUSH 0x8040 /* FTZ (bit 15) | DAZ (bit 6) */
#endif

int tidal_flush_denormals(int flush, int num_threads) {
#ifdef MXCSR_FLUSH
    int set = 0;
#pragma omp parallel num_threads(num_threads) reduction(+ : set)
    {
        const unsigned int csr = _mm_getcsr();
        _mm_setcsr(flush ? (csr | MXCSR_FLUSH) : (csr & ~(unsigned int)MXCSR_FLUSH));
        set += 1;
    }
    const unsigned int csr = _mm_getcsr();  /* the caller (also thread 0 of the region) */
    _mm_setcsr(flush ? (csr | MXCSR_FLUSH) : (csr & ~(unsigned int)MXCSR_FLUSH));
    return set;
#else
    (void)flush, (void)num_threads;
    return -1;
#endif
}

/* 1 when the calling thread flushes denormals, 0 when not, -1 without MXCSR */
int tidal_flushing_denormals(void) {
#ifdef MXCSR_FLUSH
    return (_mm_getcsr() & MXCSR_FLUSH) == MXCSR_FLUSH;
#else
    return -1;
#endif
}
