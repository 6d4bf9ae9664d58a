/* What every part of _native.c shares: limits, the status codes, the AVX-512 switch. */
#ifndef COMMD_NATIVE_COMMON_H
#define COMMD_NATIVE_COMMON_H

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define COMMD_X86 1
/* the dense loops, compiled twice; the loader picks by the CPU */
#define CLONES __attribute__((target_clones("avx2", "default")))
#define AVX512 __attribute__((target("avx512f,popcnt")))
#else
#define COMMD_X86 0
#define CLONES
#endif

#define CHUNK 131072   /* elements per energy partial sum: kernels.CHUNK */
#define BLOCK 1024     /* elements summed in the buffer's dtype before the double total */
#define DIGIT_BITS 16  /* the radix select's digit */
#define DIGITS (1 << DIGIT_BITS)
#define SLACK 16       /* elements past limit in the candidate buffers: full vector stores */
#define MAX_RUNS 1024  /* ascending runs accumulate merges chunk by chunk; more: input order */

typedef enum { OK = 0, BAD_ORDER = 1, OUT_OF_RANGE = 2 } status_t;

typedef float f32v __attribute__((vector_size(32)));
typedef double f64v __attribute__((vector_size(32)));

static int avx512_known = -1;  /* a race here only repeats the same check */

/* Whether the AVX-512 loops run (the CPU has them, and use_avx512 did not turn them off). */
static int native_avx512(void) {
#if COMMD_X86
    if (avx512_known < 0) avx512_known = __builtin_cpu_supports("avx512f") ? 1 : 0;
    return avx512_known;
#else
    return 0;
#endif
}

#endif
