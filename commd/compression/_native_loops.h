/* The loops of _native.c, one set per float type (see that file). No Python here.
 *
 * Each loop is one pass over memory, which is what bounds it: a buffer of ResNet-50's size
 * (100 MB) takes about 10 ms to read on our machine, so every pass saved counts. The
 * candidate pass uses AVX-512 compress-stores where the CPU has them (checked at run time),
 * and plain C elsewhere; the dense loops use GCC's vector types, cloned for AVX2.
 */
#ifndef COMMD_NATIVE_LOOPS_H
#define COMMD_NATIVE_LOOPS_H

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define COMMD_X86 1
#define CLONES __attribute__((target_clones("avx2", "default")))
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

#define LOOPS(S, F, U, SIGN_OFF, INF_BITS, BITS)                                              \
/* residual += (velocity = m·velocity + update), or += update; update = 0 if clear; the      \
 * squares of the new residual summed per chunk into sums (vector lanes of the dtype per     \
 * BLOCK, then in double). Constant flags: the compiler specialises each call below. */      \
static inline __attribute__((always_inline)) double add_block_##S(                           \
        F *residual, F *update, F *velocity, F momentum, int clear, Py_ssize_t lo,           \
        Py_ssize_t hi) {                                                                      \
    enum { L = 32 / sizeof(F) };                                                              \
    S##v acc = {0}, mv = {0};                                                                 \
    mv += momentum;                                                                           \
    Py_ssize_t i = lo;                                                                        \
    for (; i + L <= hi; i += L) {                                                             \
        S##v r, u;                                                                            \
        memcpy(&r, residual + i, sizeof r);                                                   \
        memcpy(&u, update + i, sizeof u);                                                     \
        if (velocity) {                                                                       \
            S##v v;                                                                           \
            memcpy(&v, velocity + i, sizeof v);                                               \
            v = mv * v;                                                                       \
            u = v + u;                                                                        \
            memcpy(velocity + i, &u, sizeof u);                                               \
        }                                                                                     \
        r = r + u;                                                                            \
        memcpy(residual + i, &r, sizeof r);                                                   \
        if (clear) memset(update + i, 0, sizeof u);                                           \
        acc += r * r;                                                                         \
    }                                                                                         \
    double total = 0;                                                                         \
    for (int j = 0; j < L; j++) total += acc[j];                                              \
    for (; i < hi; i++) {                                                                     \
        F u = update[i];                                                                      \
        if (velocity) { F v = momentum * velocity[i]; u = v + u; velocity[i] = u; }          \
        F r = residual[i] + u;                                                                \
        residual[i] = r;                                                                      \
        if (clear) update[i] = 0;                                                             \
        total += (double)r * r;                                                               \
    }                                                                                         \
    return total;                                                                             \
}                                                                                             \
                                                                                              \
CLONES static void add_energy_##S(F *residual, F *update, F *velocity, F momentum,           \
                                  int clear, Py_ssize_t n, double *sums) {                    \
    for (Py_ssize_t lo = 0, chunk = 0; lo < n; lo += CHUNK, chunk++) {                        \
        Py_ssize_t end = lo + CHUNK < n ? lo + CHUNK : n;                                     \
        double total = 0;                                                                     \
        for (Py_ssize_t b = lo; b < end; b += BLOCK) {                                        \
            Py_ssize_t hi = b + BLOCK < end ? b + BLOCK : end;                                \
            if (velocity && clear)                                                            \
                total += add_block_##S(residual, update, velocity, momentum, 1, b, hi);      \
            else if (velocity)                                                                \
                total += add_block_##S(residual, update, velocity, momentum, 0, b, hi);      \
            else if (clear)                                                                   \
                total += add_block_##S(residual, update, NULL, 0, 1, b, hi);                 \
            else                                                                              \
                total += add_block_##S(residual, update, NULL, 0, 0, b, hi);                 \
        }                                                                                     \
        sums[chunk] = total;                                                                  \
    }                                                                                         \
}                                                                                             \
                                                                                              \
static inline U magnitude_##S(F value) {                                                      \
    U bits;                                                                                   \
    memcpy(&bits, &value, sizeof bits);                                                       \
    bits &= SIGN_OFF;                                                                         \
    return bits > INF_BITS ? INF_BITS : bits; /* NaN ranks as +inf */                         \
}                                                                                             \
                                                                                              \
/* Elements [lo, hi) into the candidates, one at a time (the tail, or no AVX-512). */        \
static inline Py_ssize_t scan_plain_##S(const F *error, Py_ssize_t lo, Py_ssize_t hi,         \
        U threshold, Py_ssize_t k, Py_ssize_t limit, int32_t *index, U *bits,                 \
        Py_ssize_t count, Py_ssize_t *ties) {                                                 \
    for (Py_ssize_t i = lo; i < hi; i++) {                                                    \
        U b = magnitude_##S(error[i]);                                                        \
        if (b < threshold) continue;                                                          \
        if (b == threshold && (*ties)++ >= k) continue;                                       \
        if (count == limit) return -1;                                                        \
        index[count] = (int32_t)i;                                                            \
        bits[count++] = b;                                                                    \
    }                                                                                         \
    return count;                                                                             \
}                                                                                             \
                                                                                              \
/* The k-th largest of bits[0..m) by most-significant-digit radix select; *take: how many of \
 * the elements equal to it belong to the k largest. ``work`` holds m. */                    \
static U kth_##S(const U *bits, Py_ssize_t m, Py_ssize_t k, U *work, uint32_t *hist,          \
                 Py_ssize_t *take) {                                                          \
    const U *source = bits;                                                                   \
    Py_ssize_t length = m, need = k;                                                          \
    U prefix = 0;                                                                             \
    for (int shift = BITS - DIGIT_BITS;; shift -= DIGIT_BITS) {                               \
        memset(hist, 0, DIGITS * sizeof *hist);                                               \
        for (Py_ssize_t i = 0; i < length; i++) hist[(source[i] >> shift) & (DIGITS - 1)]++;  \
        Py_ssize_t above = 0;                                                                 \
        int digit = DIGITS - 1;                                                               \
        for (; digit > 0 && above + (Py_ssize_t)hist[digit] < need; digit--)                  \
            above += hist[digit];                                                             \
        need -= above;                                                                        \
        prefix |= (U)digit << shift;                                                          \
        if (shift == 0) break;                                                                \
        Py_ssize_t kept = 0, i = 0; /* in place once source is work: kept <= i */             \
        AVX512_COMPACT(S)                                                                     \
        for (; i < length; i++) {                                                             \
            U b = source[i];                                                                  \
            work[kept] = b;                                                                    \
            kept += (Py_ssize_t)((b >> shift) & (DIGITS - 1)) == digit;                       \
        }                                                                                     \
        source = work;                                                                        \
        length = kept;                                                                        \
    }                                                                                         \
    *take = need;                                                                             \
    return prefix;                                                                            \
}                                                                                             \
                                                                                              \
/* The k largest of the m candidates (ascending indices), ties at the k-th to the lower      \
 * indices; returns how many were written (k). */                                           \
static Py_ssize_t pick_##S(const int32_t *index, const U *bits, Py_ssize_t m, Py_ssize_t k,   \
                           U *work, uint32_t *hist, int32_t *out) {                           \
    Py_ssize_t take = 0, written = 0, i = 0;                                                  \
    U kth = kth_##S(bits, m, k, work, hist, &take);                                           \
    AVX512_PICK(S)                                                                            \
    for (; i < m && written < k; i++) {                                                       \
        U b = bits[i];                                                                        \
        out[written] = index[i];                                                              \
        int tie = b == kth;                                                                   \
        int keep = (b > kth) | (tie & (take > 0));                                            \
        take -= tie & keep;                                                                   \
        written += keep;                                                                      \
    }                                                                                         \
    return written;                                                                           \
}                                                                                             \
                                                                                              \
static double take_clear_##S(F *restrict error, const int32_t *restrict index, Py_ssize_t m,    \
                             F *restrict out) {                                               \
    double a0 = 0, a1 = 0;                                                                    \
    Py_ssize_t i = 0;                                                                         \
    for (; i + 2 <= m; i += 2) {                                                              \
        F v0 = error[index[i]], v1 = error[index[i + 1]];                                     \
        out[i] = v0; out[i + 1] = v1;                                                         \
        error[index[i]] = 0; error[index[i + 1]] = 0;                                         \
        a0 += (double)v0 * v0; a1 += (double)v1 * v1;                                        \
    }                                                                                         \
    for (; i < m; i++) {                                                                      \
        F v = error[index[i]];                                                                \
        out[i] = v; error[index[i]] = 0; a0 += (double)v * v;                                 \
    }                                                                                         \
    return a0 + a1;                                                                           \
}                                                                                             \
                                                                                              \
static void put_##S(F *restrict target, const int32_t *restrict index, Py_ssize_t m,           \
                    const F *restrict values) {                                               \
    for (Py_ssize_t i = 0; i < m; i++) target[index[i]] = values[i];                          \
}                                                                                             \
                                                                                              \
/* target = 0 if zero, then target[i] += v for every pair, each element summed in input     \
 * order as np.add.at does; OUT_OF_RANGE (nothing written) for an index outside [0, n). A   \
 * few ascending runs (N nodes' top-k): chunk by chunk, each run's pairs in that chunk, so   \
 * the target is swept once while it is in cache. Otherwise pair by pair. */                 \
static status_t accumulate_##S(F *restrict target, Py_ssize_t n,                              \
                               const int32_t *restrict index, Py_ssize_t m,                   \
                               const F *restrict values, int zero) {                          \
    Py_ssize_t starts[MAX_RUNS + 1], runs = 0;                                                \
    int bad = 0;                                                                              \
    for (Py_ssize_t i = 0; i < m; i++) { /* the check and the runs in one read */             \
        bad |= index[i] < 0 || (Py_ssize_t)index[i] >= n;                                     \
        if (i == 0 || index[i] <= index[i - 1]) {                                             \
            if (runs <= MAX_RUNS) starts[runs] = i;                                           \
            runs++;                                                                           \
        }                                                                                     \
    }                                                                                         \
    if (bad) return OUT_OF_RANGE;                                                             \
    if (zero) memset(target, 0, (size_t)n * sizeof *target);                                  \
    if (runs > MAX_RUNS) {                                                                    \
        for (Py_ssize_t i = 0; i < m; i++) target[index[i]] += values[i];                     \
        return OK;                                                                            \
    }                                                                                         \
    starts[runs] = m;                                                                         \
    Py_ssize_t cursor[MAX_RUNS];                                                              \
    memcpy(cursor, starts, (size_t)runs * sizeof *cursor);                                    \
    for (Py_ssize_t lo = 0; lo < n; lo += CHUNK) {                                            \
        const int64_t hi = (int64_t)lo + CHUNK;                                               \
        for (Py_ssize_t r = 0; r < runs; r++) {                                               \
            Py_ssize_t i = cursor[r], end = starts[r + 1];                                    \
            for (; i < end && index[i] < hi; i++) target[index[i]] += values[i];              \
            cursor[r] = i;                                                                    \
        }                                                                                     \
    }                                                                                         \
    return OK;                                                                                \
}

static int avx512_known = -1;  /* a race here only repeats the same check */

static int native_avx512(void) {
#if COMMD_X86
    if (avx512_known < 0) avx512_known = __builtin_cpu_supports("avx512f") ? 1 : 0;
    return avx512_known;
#else
    return 0;
#endif
}

/* The output pass of pick: the candidates above kth, and the first *take equal to it, 16 or
 * 8 at a time; returns how many were written and, in *at, where it stopped. */
#if COMMD_X86
__attribute__((target("avx512f,popcnt")))
static Py_ssize_t pick_avx512_f32(const int32_t *index, const uint32_t *bits, Py_ssize_t m,
                                  uint32_t kth, Py_ssize_t *take, int32_t *out,
                                  Py_ssize_t *at) {
    const __m512i level = _mm512_set1_epi32((int)kth);
    Py_ssize_t written = 0, i = 0;
    for (; i + 16 <= m; i += 16) {
        __m512i b = _mm512_loadu_si512(bits + i);
        __mmask16 keep = _mm512_cmpgt_epu32_mask(b, level);
        for (__mmask16 t = _mm512_cmpeq_epu32_mask(b, level); t && *take > 0;
             t &= (__mmask16)(t - 1), (*take)--)
            keep |= (__mmask16)(t & -t);
        if (!keep) continue;
        _mm512_mask_compressstoreu_epi32(out + written, keep, _mm512_loadu_si512(index + i));
        written += __builtin_popcount(keep);
    }
    *at = i;
    return written;
}

__attribute__((target("avx512f,popcnt")))
static Py_ssize_t pick_avx512_f64(const int32_t *index, const uint64_t *bits, Py_ssize_t m,
                                  uint64_t kth, Py_ssize_t *take, int32_t *out,
                                  Py_ssize_t *at) {
    const __m512i level = _mm512_set1_epi64((long long)kth);
    Py_ssize_t written = 0, i = 0;
    for (; i + 8 <= m; i += 8) {
        __m512i b = _mm512_loadu_si512(bits + i);
        __mmask8 keep = _mm512_cmpgt_epu64_mask(b, level);
        for (__mmask8 t = _mm512_cmpeq_epu64_mask(b, level); t && *take > 0;
             t &= (__mmask8)(t - 1), (*take)--)
            keep |= (__mmask8)(t & -t);
        if (!keep) continue;
        __m512i at8 = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(index + i)));
        _mm512_mask_compressstoreu_epi32(out + written, (__mmask16)keep, at8);
        written += __builtin_popcount(keep);
    }
    *at = i;
    return written;
}
#define AVX512_PICK(S)                                                                        \
    if (native_avx512()) written = pick_avx512_##S(index, bits, m, kth, &take, out, &i);
#else
#define AVX512_PICK(S)
#endif

/* The compaction step of the radix select: the elements whose digit at ``shift`` is
 * ``digit``, 16 or 8 at a time; whole-vector stores stay inside the block just read (kept <=
 * i), so ``work`` may be ``source``. Returns the count kept; *at: where it stopped. */
#if COMMD_X86
__attribute__((target("avx512f,popcnt")))
static Py_ssize_t compact_avx512_f32(const uint32_t *source, Py_ssize_t length, int shift,
                                     int digit, uint32_t *work, Py_ssize_t *at) {
    const __m512i mask = _mm512_set1_epi32(DIGITS - 1), want = _mm512_set1_epi32(digit);
    Py_ssize_t kept = 0, i = 0;
    for (; i + 16 <= length; i += 16) {
        __m512i b = _mm512_loadu_si512(source + i);
        __m512i d = _mm512_and_si512(_mm512_srli_epi32(b, (unsigned)shift), mask);
        __mmask16 keep = _mm512_cmpeq_epi32_mask(d, want);
        _mm512_storeu_si512(work + kept, _mm512_maskz_compress_epi32(keep, b));
        kept += __builtin_popcount(keep);
    }
    *at = i;
    return kept;
}

__attribute__((target("avx512f,popcnt")))
static Py_ssize_t compact_avx512_f64(const uint64_t *source, Py_ssize_t length, int shift,
                                     int digit, uint64_t *work, Py_ssize_t *at) {
    const __m512i mask = _mm512_set1_epi64(DIGITS - 1), want = _mm512_set1_epi64(digit);
    Py_ssize_t kept = 0, i = 0;
    for (; i + 8 <= length; i += 8) {
        __m512i b = _mm512_loadu_si512(source + i);
        __m512i d = _mm512_and_si512(_mm512_srli_epi64(b, (unsigned)shift), mask);
        __mmask8 keep = _mm512_cmpeq_epi64_mask(d, want);
        _mm512_storeu_si512(work + kept, _mm512_maskz_compress_epi64(keep, b));
        kept += __builtin_popcount(keep);
    }
    *at = i;
    return kept;
}
#define AVX512_COMPACT(S)                                                                     \
    if (native_avx512()) kept = compact_avx512_##S(source, length, shift, digit, work, &i);
#else
#define AVX512_COMPACT(S)
#endif

LOOPS(f32, float, uint32_t, 0x7FFFFFFFu, 0x7F800000u, 32)
LOOPS(f64, double, uint64_t, 0x7FFFFFFFFFFFFFFFull, 0x7FF0000000000000ull, 64)

/* The candidate pass: every index whose magnitude reaches ``threshold``, ascending, with its
 * magnitude bits (NaN as +inf); ties at the threshold beyond the first k are left out (never
 * chosen). Returns the count, or -1 past ``limit``. */
#if COMMD_X86
__attribute__((target("avx512f,popcnt")))
static Py_ssize_t scan_avx512_f32(const float *error, Py_ssize_t n, uint32_t threshold,
                                  Py_ssize_t k, Py_ssize_t limit, int32_t *index,
                                  uint32_t *bits) {
    const __m512i off = _mm512_set1_epi32(0x7FFFFFFF), inf = _mm512_set1_epi32(0x7F800000);
    const __m512i level = _mm512_set1_epi32((int)threshold);
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,
                                            15);
    Py_ssize_t count = 0, ties = 0, i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i b = _mm512_and_si512(_mm512_loadu_si512(error + i), off);
        __mmask16 keep = _mm512_cmpge_epu32_mask(b, level);
        if (!keep) continue;
        b = _mm512_min_epu32(b, inf);
        __mmask16 tie = _mm512_cmpeq_epu32_mask(b, level);
        for (__mmask16 t = tie; t; t &= (__mmask16)(t - 1))  /* rare: ties at the threshold */
            if (ties++ >= k) keep &= (__mmask16)~(t & -t);
        Py_ssize_t found = __builtin_popcount(keep);
        if (count + found > limit) return -1;
        __m512i at = _mm512_add_epi32(_mm512_set1_epi32((int32_t)i), lanes);
        /* compress in a register, then one full store: much faster than a compress-store
         * to memory; the buffers have SLACK elements past limit for the unused lanes */
        _mm512_storeu_si512(index + count, _mm512_maskz_compress_epi32(keep, at));
        _mm512_storeu_si512(bits + count, _mm512_maskz_compress_epi32(keep, b));
        count += found;
    }
    return scan_plain_f32(error, i, n, threshold, k, limit, index, bits, count, &ties);
}

__attribute__((target("avx512f,popcnt")))
static Py_ssize_t scan_avx512_f64(const double *error, Py_ssize_t n, uint64_t threshold,
                                  Py_ssize_t k, Py_ssize_t limit, int32_t *index,
                                  uint64_t *bits) {
    const __m512i off = _mm512_set1_epi64(0x7FFFFFFFFFFFFFFFll);
    const __m512i inf = _mm512_set1_epi64(0x7FF0000000000000ll);
    const __m512i level = _mm512_set1_epi64((long long)threshold);
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 0, 0, 0, 0, 0, 0, 0, 0);
    Py_ssize_t count = 0, ties = 0, i = 0;
    for (; i + 8 <= n; i += 8) {
        __m512i b = _mm512_and_si512(_mm512_loadu_si512(error + i), off);
        __mmask8 keep = _mm512_cmpge_epu64_mask(b, level);
        if (!keep) continue;
        b = _mm512_min_epu64(b, inf);
        __mmask8 tie = _mm512_cmpeq_epu64_mask(b, level);
        for (__mmask8 t = tie; t; t &= (__mmask8)(t - 1))
            if (ties++ >= k) keep &= (__mmask8)~(t & -t);
        Py_ssize_t found = __builtin_popcount(keep);
        if (count + found > limit) return -1;
        __m512i at = _mm512_add_epi32(_mm512_set1_epi32((int32_t)i), lanes);
        _mm512_storeu_si512(index + count, _mm512_maskz_compress_epi32((__mmask16)keep, at));
        _mm512_storeu_si512(bits + count, _mm512_maskz_compress_epi64(keep, b));
        count += found;
    }
    return scan_plain_f64(error, i, n, threshold, k, limit, index, bits, count, &ties);
}
#endif

#define SCAN(S, U)                                                                            \
static Py_ssize_t scan_##S(const void *error, Py_ssize_t n, U threshold, Py_ssize_t k,        \
                           Py_ssize_t limit, int32_t *index, U *bits) {                       \
    Py_ssize_t ties = 0;                                                                      \
    AVX512_SCAN(S)                                                                            \
    return scan_plain_##S(error, 0, n, threshold, k, limit, index, bits, 0, &ties);           \
}

#if COMMD_X86
#define AVX512_SCAN(S)                                                                        \
    if (native_avx512()) return scan_avx512_##S(error, n, threshold, k, limit, index, bits);
#else
#define AVX512_SCAN(S)
#endif

SCAN(f32, uint32_t)
SCAN(f64, uint64_t)

#endif
