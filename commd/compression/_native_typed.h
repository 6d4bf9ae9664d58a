/* The loops for one float type, included once per type by _native.c with these defined:
 * SUFFIX (f32, f64), F (the float), U (the unsigned integer of its bits), V (a vector of F),
 * SIGN_OFF and INF_BITS (masks of U), BITS (U's width). Every function is NAME(function). */
#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define NAME(function) CAT(function, SUFFIX)

/* The candidates of a top-k: every index whose magnitude bits reach ``threshold``, ascending,
 * with those bits (NaN as +inf); ties at the threshold past the first k are left out (never
 * chosen). count: how many so far, -1 once past ``limit`` (the buffers hold limit + SLACK). */
typedef struct {
    U threshold;
    Py_ssize_t k, limit, count, ties;
    int32_t *index;
    U *bits;
} NAME(found_t);

static inline U NAME(magnitude)(F value) {
    U bits;
    memcpy(&bits, &value, sizeof bits);
    bits &= SIGN_OFF;
    return bits > INF_BITS ? INF_BITS : bits; /* NaN ranks as +inf */
}

/* Elements [lo, hi) of ``error`` into the candidates. */
static void NAME(scan)(const F *error, Py_ssize_t lo, Py_ssize_t hi, NAME(found_t) *found) {
    if (found->count < 0) return;
    Py_ssize_t i = lo;
    IF_AVX512(i = NAME(scan_avx512)(error, lo, hi, found->threshold, found->k, found->limit,
                                    found->index, found->bits, &found->count, &found->ties))
    for (; i < hi && found->count >= 0; i++) {
        U b = NAME(magnitude)(error[i]);
        if (b < found->threshold) continue;
        if (b == found->threshold && found->ties++ >= found->k) continue;
        if (found->count == found->limit) {
            found->count = -1;
            return;
        }
        found->index[found->count] = (int32_t)i;
        found->bits[found->count++] = b;
    }
}

/* residual[lo, hi) += (velocity = m·velocity + update), or += update; update = 0 if clear;
 * returns the sum of the new residual's squares (vector lanes of F, then in double). Inlined
 * with constant flags, so each call in add_energy below is its own specialised loop. */
static inline __attribute__((always_inline)) double NAME(add_block)(
        F *restrict residual, F *restrict update, F *restrict velocity, F momentum, int clear,
        Py_ssize_t lo, Py_ssize_t hi) {
    enum { L = sizeof(V) / sizeof(F) };
    V acc = {0}, factor = {0};
    factor += momentum;
    Py_ssize_t i = lo;
    for (; i + L <= hi; i += L) {
        V r, u;
        memcpy(&r, residual + i, sizeof r);
        memcpy(&u, update + i, sizeof u);
        if (velocity) {  /* numpy's order: (velocity·m) + update, then residual + that */
            V v;
            memcpy(&v, velocity + i, sizeof v);
            v = factor * v;
            u = v + u;
            memcpy(velocity + i, &u, sizeof u);
        }
        r = r + u;
        memcpy(residual + i, &r, sizeof r);
        if (clear) memset(update + i, 0, sizeof u);
        acc += r * r;
    }
    double total = 0;
    for (int j = 0; j < L; j++) total += acc[j];
    for (; i < hi; i++) {
        F u = update[i];
        if (velocity) {
            F v = momentum * velocity[i];
            u = v + u;
            velocity[i] = u;
        }
        F r = residual[i] + u;
        residual[i] = r;
        if (clear) update[i] = 0;
        total += (double)r * r;
    }
    return total;
}

/* add_block over the buffer, one energy sum per CHUNK into ``sums``; with ``found``, each
 * block's new residual also goes through the candidate pass while it is in cache. */
CLONES static void NAME(add_energy)(F *residual, F *update, F *velocity, F momentum,
                                    int clear, Py_ssize_t n, double *sums,
                                    NAME(found_t) *found) {
    for (Py_ssize_t lo = 0, chunk = 0; lo < n; lo += CHUNK, chunk++) {
        Py_ssize_t end = lo + CHUNK < n ? lo + CHUNK : n;
        double total = 0;
        for (Py_ssize_t b = lo; b < end; b += BLOCK) {
            Py_ssize_t hi = b + BLOCK < end ? b + BLOCK : end;
            if (velocity && clear)
                total += NAME(add_block)(residual, update, velocity, momentum, 1, b, hi);
            else if (velocity)
                total += NAME(add_block)(residual, update, velocity, momentum, 0, b, hi);
            else if (clear)
                total += NAME(add_block)(residual, update, NULL, 0, 1, b, hi);
            else
                total += NAME(add_block)(residual, update, NULL, 0, 0, b, hi);
            if (found) NAME(scan)(residual, b, hi, found);
        }
        sums[chunk] = total;
    }
}

/* The k-th largest of bits[0, m) by most-significant-digit radix select; *take: how many of
 * the elements equal to it belong to the k largest. ``work`` holds m + SLACK. */
static U NAME(kth)(const U *bits, Py_ssize_t m, Py_ssize_t k, U *work, uint32_t *hist,
                   Py_ssize_t *take) {
    const U *source = bits;
    Py_ssize_t length = m, need = k;
    U prefix = 0;
    for (int shift = BITS - DIGIT_BITS;; shift -= DIGIT_BITS) {
        memset(hist, 0, DIGITS * sizeof *hist);
        for (Py_ssize_t i = 0; i < length; i++) hist[(source[i] >> shift) & (DIGITS - 1)]++;
        Py_ssize_t above = 0;
        int digit = DIGITS - 1;
        for (; digit > 0 && above + (Py_ssize_t)hist[digit] < need; digit--)
            above += hist[digit];
        need -= above;
        prefix |= (U)digit << shift;
        if (shift == 0) break;
        Py_ssize_t kept = 0, i = 0;  /* in place once source is work: kept <= i */
        IF_AVX512(kept = NAME(compact_avx512)(source, length, shift, digit, work, &i))
        for (; i < length; i++) {
            U b = source[i];
            work[kept] = b;
            kept += (Py_ssize_t)((b >> shift) & (DIGITS - 1)) == digit;
        }
        source = work;
        length = kept;
    }
    *take = need;
    return prefix;
}

/* The k largest of the m >= k candidates (ascending indices), ties at the k-th to the lower
 * indices, into out; returns how many were written (k). */
static Py_ssize_t NAME(pick)(const int32_t *index, const U *bits, Py_ssize_t m, Py_ssize_t k,
                             U *work, uint32_t *hist, int32_t *out) {
    Py_ssize_t take = 0, written = 0, i = 0;
    U kth = NAME(kth)(bits, m, k, work, hist, &take);
    IF_AVX512(written = NAME(pick_avx512)(index, bits, m, kth, &take, out, &i))
    for (; i < m && written < k; i++) {
        U b = bits[i];
        out[written] = index[i];
        int tie = b == kth;
        int keep = (b > kth) | (tie & (take > 0));
        take -= tie & keep;
        written += keep;
    }
    return written;
}

static double NAME(take_clear)(F *restrict error, const int32_t *restrict index, Py_ssize_t m,
                               F *restrict out) {
    double a0 = 0, a1 = 0;
    Py_ssize_t i = 0;
    for (; i + 2 <= m; i += 2) {
        F v0 = error[index[i]], v1 = error[index[i + 1]];
        out[i] = v0;
        out[i + 1] = v1;
        error[index[i]] = 0;
        error[index[i + 1]] = 0;
        a0 += (double)v0 * v0;
        a1 += (double)v1 * v1;
    }
    for (; i < m; i++) {
        F v = error[index[i]];
        out[i] = v;
        error[index[i]] = 0;
        a0 += (double)v * v;
    }
    return a0 + a1;
}

static void NAME(put)(F *restrict target, const int32_t *restrict index, Py_ssize_t m,
                      const F *restrict values) {
    for (Py_ssize_t i = 0; i < m; i++) target[index[i]] = values[i];
}

/* target = 0 if zero, then target[i] += v for every pair, each element summed in input order
 * as np.add.at does; OUT_OF_RANGE (nothing written) for an index outside [0, n). A few
 * ascending runs (N nodes' top-k): chunk by chunk, each run's pairs in that chunk, so the
 * target is swept once while it is in cache. Otherwise pair by pair. */
static status_t NAME(accumulate)(F *restrict target, Py_ssize_t n,
                                 const int32_t *restrict index, Py_ssize_t m,
                                 const F *restrict values, int zero) {
    Py_ssize_t starts[MAX_RUNS + 1], runs = 0;
    int bad = 0;
    for (Py_ssize_t i = 0; i < m; i++) {  /* the check and the runs in one read */
        bad |= index[i] < 0 || (Py_ssize_t)index[i] >= n;
        if (i == 0 || index[i] <= index[i - 1]) {
            if (runs <= MAX_RUNS) starts[runs] = i;
            runs++;
        }
    }
    if (bad) return OUT_OF_RANGE;
    if (zero) memset(target, 0, (size_t)n * sizeof *target);
    if (runs > MAX_RUNS) {
        for (Py_ssize_t i = 0; i < m; i++) target[index[i]] += values[i];
        return OK;
    }
    starts[runs] = m;
    Py_ssize_t cursor[MAX_RUNS];
    memcpy(cursor, starts, (size_t)runs * sizeof *cursor);
    for (Py_ssize_t lo = 0; lo < n; lo += CHUNK) {
        const int64_t hi = (int64_t)lo + CHUNK;
        for (Py_ssize_t r = 0; r < runs; r++) {
            Py_ssize_t i = cursor[r], end = starts[r + 1];
            for (; i < end && index[i] < hi; i++) target[index[i]] += values[i];
            cursor[r] = i;
        }
    }
    return OK;
}

/* A dense round of a momentum-corrected job (kernels.add_momentum): velocity = m·velocity +
 * total, then total = residual·release + velocity and residual = residual·keep (0 if
 * release_all), or total = velocity without a residual; numpy's operations, in its order. */
CLONES static void NAME(momentum)(F *restrict total, F *restrict residual,
                                  F *restrict velocity, F momentum, F keep, F release,
                                  int release_all, Py_ssize_t n) {
    enum { L = sizeof(V) / sizeof(F) };
    V m = {0}, kept = {0}, released = {0};
    m += momentum;
    kept += keep;
    released += release;
    Py_ssize_t i = 0;
    for (; i + L <= n; i += L) {
        V v, t;
        memcpy(&v, velocity + i, sizeof v);
        memcpy(&t, total + i, sizeof t);
        v = m * v;
        v = v + t;
        memcpy(velocity + i, &v, sizeof v);
        if (residual) {
            V h;
            memcpy(&h, residual + i, sizeof h);
            t = h * released;
            t = t + v;
            h = release_all ? (V){0} : h * kept;
            memcpy(residual + i, &h, sizeof h);
        } else {
            t = v;
        }
        memcpy(total + i, &t, sizeof t);
    }
    for (; i < n; i++) {
        F v = momentum * velocity[i];
        v = v + total[i];
        velocity[i] = v;
        if (residual) {
            F t = residual[i] * release;
            total[i] = t + v;
            residual[i] = release_all ? 0 : residual[i] * keep;
        } else {
            total[i] = v;
        }
    }
}

#undef NAME
#undef CAT
#undef CAT_
