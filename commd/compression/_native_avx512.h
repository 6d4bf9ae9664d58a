/* The selection's loops with AVX-512 compress instructions, for float32 (16 lanes) and
 * float64 (8 lanes). Each handles whole vectors from ``lo`` and returns where it stopped;
 * the plain loops of _native_typed.h do the tail, and everything where the CPU has no
 * AVX-512 (native_avx512()). A compress into a register and one full store is much faster
 * than a compress-store to memory; the unused lanes land in SLACK elements (candidates) or
 * in the block just read (compaction, kept <= i). */
#ifndef COMMD_NATIVE_AVX512_H
#define COMMD_NATIVE_AVX512_H

#include "_native_common.h"

#if COMMD_X86

/* Keep only the first ties at the threshold while fewer than k were kept (lowest lane =
 * lowest index first). */
#define CAP_TIES(MASK_T, keep, tie, ties, k)                                                  \
    for (MASK_T t = (tie); t; t &= (MASK_T)(t - 1))                                           \
        if ((*(ties))++ >= (k)) (keep) &= (MASK_T) ~(t & -t);

AVX512 static Py_ssize_t scan_avx512_f32(const float *error, Py_ssize_t lo, Py_ssize_t hi,
                                         uint32_t threshold, Py_ssize_t k, Py_ssize_t limit,
                                         int32_t *index, uint32_t *bits, Py_ssize_t *count,
                                         Py_ssize_t *ties) {
    const __m512i off = _mm512_set1_epi32(0x7FFFFFFF), inf = _mm512_set1_epi32(0x7F800000);
    const __m512i level = _mm512_set1_epi32((int)threshold);
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,
                                            15);
    Py_ssize_t found = *count, i = lo;
    for (; i + 16 <= hi; i += 16) {
        __m512i b = _mm512_and_si512(_mm512_loadu_si512(error + i), off);
        __mmask16 keep = _mm512_cmpge_epu32_mask(b, level);
        if (!keep) continue;
        b = _mm512_min_epu32(b, inf);  /* NaN ranks as +inf */
        CAP_TIES(__mmask16, keep, _mm512_cmpeq_epu32_mask(b, level), ties, k)
        Py_ssize_t more = __builtin_popcount(keep);
        if (found + more > limit) { *count = -1; return hi; }
        __m512i at = _mm512_add_epi32(_mm512_set1_epi32((int32_t)i), lanes);
        _mm512_storeu_si512(index + found, _mm512_maskz_compress_epi32(keep, at));
        _mm512_storeu_si512(bits + found, _mm512_maskz_compress_epi32(keep, b));
        found += more;
    }
    *count = found;
    return i;
}

AVX512 static Py_ssize_t scan_avx512_f64(const double *error, Py_ssize_t lo, Py_ssize_t hi,
                                         uint64_t threshold, Py_ssize_t k, Py_ssize_t limit,
                                         int32_t *index, uint64_t *bits, Py_ssize_t *count,
                                         Py_ssize_t *ties) {
    const __m512i off = _mm512_set1_epi64(0x7FFFFFFFFFFFFFFFll);
    const __m512i inf = _mm512_set1_epi64(0x7FF0000000000000ll);
    const __m512i level = _mm512_set1_epi64((long long)threshold);
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 0, 0, 0, 0, 0, 0, 0, 0);
    Py_ssize_t found = *count, i = lo;
    for (; i + 8 <= hi; i += 8) {
        __m512i b = _mm512_and_si512(_mm512_loadu_si512(error + i), off);
        __mmask8 keep = _mm512_cmpge_epu64_mask(b, level);
        if (!keep) continue;
        b = _mm512_min_epu64(b, inf);
        CAP_TIES(__mmask8, keep, _mm512_cmpeq_epu64_mask(b, level), ties, k)
        Py_ssize_t more = __builtin_popcount(keep);
        if (found + more > limit) { *count = -1; return hi; }
        __m512i at = _mm512_add_epi32(_mm512_set1_epi32((int32_t)i), lanes);
        _mm512_storeu_si512(index + found, _mm512_maskz_compress_epi32((__mmask16)keep, at));
        _mm512_storeu_si512(bits + found, _mm512_maskz_compress_epi64(keep, b));
        found += more;
    }
    *count = found;
    return i;
}

/* The radix select's compaction: the elements whose digit at ``shift`` is ``digit``. */
AVX512 static Py_ssize_t compact_avx512_f32(const uint32_t *source, Py_ssize_t length,
                                            int shift, int digit, uint32_t *work,
                                            Py_ssize_t *at) {
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

AVX512 static Py_ssize_t compact_avx512_f64(const uint64_t *source, Py_ssize_t length,
                                            int shift, int digit, uint64_t *work,
                                            Py_ssize_t *at) {
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

/* pick's output: the candidates above kth, and the first *take equal to it. ``out`` has
 * exactly k places, so this one compress-stores to memory (only the kept lanes). */
#define TAKE_TIES(MASK_T, keep, tie, take)                                                    \
    for (MASK_T t = (tie); t && *(take) > 0; t &= (MASK_T)(t - 1), (*(take))--)               \
        (keep) |= (MASK_T)(t & -t);

AVX512 static Py_ssize_t pick_avx512_f32(const int32_t *index, const uint32_t *bits,
                                         Py_ssize_t m, uint32_t kth, Py_ssize_t *take,
                                         int32_t *out, Py_ssize_t *at) {
    const __m512i level = _mm512_set1_epi32((int)kth);
    Py_ssize_t written = 0, i = 0;
    for (; i + 16 <= m; i += 16) {
        __m512i b = _mm512_loadu_si512(bits + i);
        __mmask16 keep = _mm512_cmpgt_epu32_mask(b, level);
        TAKE_TIES(__mmask16, keep, _mm512_cmpeq_epu32_mask(b, level), take)
        if (!keep) continue;
        _mm512_mask_compressstoreu_epi32(out + written, keep, _mm512_loadu_si512(index + i));
        written += __builtin_popcount(keep);
    }
    *at = i;
    return written;
}

AVX512 static Py_ssize_t pick_avx512_f64(const int32_t *index, const uint64_t *bits,
                                         Py_ssize_t m, uint64_t kth, Py_ssize_t *take,
                                         int32_t *out, Py_ssize_t *at) {
    const __m512i level = _mm512_set1_epi64((long long)kth);
    Py_ssize_t written = 0, i = 0;
    for (; i + 8 <= m; i += 8) {
        __m512i b = _mm512_loadu_si512(bits + i);
        __mmask8 keep = _mm512_cmpgt_epu64_mask(b, level);
        TAKE_TIES(__mmask8, keep, _mm512_cmpeq_epu64_mask(b, level), take)
        if (!keep) continue;
        __m512i at8 = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(index + i)));
        _mm512_mask_compressstoreu_epi32(out + written, (__mmask16)keep, at8);
        written += __builtin_popcount(keep);
    }
    *at = i;
    return written;
}

#define IF_AVX512(call) if (native_avx512()) call;
#else
#define IF_AVX512(call)
#endif

#endif
