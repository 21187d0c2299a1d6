/* A decode row's attention over its own sequence, reading each key and value
 * once (llama_model's decode; loaded by decode_attention.py through ctypes).
 *
 * numpy's forms read a KV head's keys once per query head that shares it
 * (SmolLM2: 3), and its probabilities-times-values product again per query
 * head: 24 ms for SmolLM2's 30 layers at 4,000 positions on one core of this
 * project's EPYC, where reading the 184 MB once takes about 10. Here the
 * positions go in chunks small enough for the L1 cache: a chunk's keys meet
 * every query head of their KV head before the next chunk is read, and so
 * do its values (docs/performance.md).
 *
 * A row's bits depend only on its inputs, on any x86-64 or other CPU this
 * compiles for: every sum is 8 lanes accumulated in the order of the inputs,
 * then one fixed tree; no FMA (built with -ffp-contract=off), so the AVX2
 * clone and the baseline one compute the same operations on the same lanes;
 * e^x is our own polynomial (Cephes' expf), not libm's, whose last bits go by
 * its version. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));

#define MAX_REP 16
/* Positions a chunk: 64 positions of 64 floats are 16 KiB, in the L1 cache
 * with their query heads (14.8 ms at 4,000 positions against 15.0 for 32
 * and 15.1 for 128 and 256). */
#define CHUNK 64

static inline __attribute__((always_inline)) v8 load(const float *p) {
    v8 x;
    memcpy(&x, p, sizeof x);
    return x;
}
static inline __attribute__((always_inline)) void store(float *p, v8 x) { memcpy(p, &x, sizeof x); }
static inline __attribute__((always_inline)) v8 splat(float f) { return (v8){f, f, f, f, f, f, f, f}; }
static inline __attribute__((always_inline)) float hsum(v8 a) {
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

/* e^x for x <= 0, 8 lanes (Cephes' expf: x = n ln 2 + r, e^r by a degree-6
 * polynomial, 2^n in the exponent bits); under -87, e^-87. */
static inline __attribute__((always_inline)) v8 exp_neg(v8 x) {
    i8 low = x < splat(-87.0f);
    x = (v8)(((i8)x & ~low) | ((i8)splat(-87.0f) & low));
    i8 ni = __builtin_convertvector(x * splat(1.44269504088896341f) - splat(0.5f), i8);
    v8 n = __builtin_convertvector(ni, v8);
    v8 r = x - n * splat(0.693359375f);
    r = r - n * splat(-2.12194440e-4f);
    v8 p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * r * r + r + splat(1.0f);
    i8 bits = (ni + 127) << 23;
    v8 scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* The lane sums of q times a row of 64 floats (8 vectors), as one fixed tree. */
static inline __attribute__((always_inline)) v8 products_8(const v8 *q, const float *row) {
    v8 a0 = q[0] * load(row), a1 = q[1] * load(row + 8);
    v8 a2 = q[2] * load(row + 16), a3 = q[3] * load(row + 24);
    v8 a4 = q[4] * load(row + 32), a5 = q[5] * load(row + 40);
    v8 a6 = q[6] * load(row + 48), a7 = q[7] * load(row + 56);
    return ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7));
}

/* The same for 128 floats: each half's tree, then their sum. */
static inline __attribute__((always_inline)) v8 products_16(const v8 *q, const float *row) {
    return products_8(q, row) + products_8(q + 8, row + 64);
}

/* One KV head, head_dim B * 8: the scores of its rep query heads into
 * scratch (rep rows of length), their softmax, then out (rep rows of B * 8). */
#define HEAD(B)                                                                              \
    static inline __attribute__((always_inline)) void head_##B(const float *q, const float *k, const float *v,              \
                                ptrdiff_t length, int rep, float *scratch, float *out) {     \
        enum { D = (B) * 8 };                                                                \
        float best[MAX_REP], total[MAX_REP];                                                 \
        for (int r = 0; r < rep; r++) best[r] = -INFINITY;                                   \
        for (ptrdiff_t c = 0; c < length; c += CHUNK) {                                      \
            ptrdiff_t end = c + CHUNK < length ? c + CHUNK : length;                         \
            for (int r = 0; r < rep; r++) {                                                  \
                v8 qv[B];                                                                    \
                for (int j = 0; j < (B); j++) qv[j] = load(q + r * D + 8 * j);               \
                float *s = scratch + r * length, m = best[r];                                \
                for (ptrdiff_t p = c; p < end; p++) {                                        \
                    const float *row = k + p * D;                                            \
                    float dot = hsum(products_##B(qv, row));                                 \
                    s[p] = dot;                                                              \
                    m = dot > m ? dot : m;                                                   \
                }                                                                            \
                best[r] = m;                                                                 \
            }                                                                                \
        }                                                                                    \
        for (int r = 0; r < rep; r++) {                                                      \
            float *s = scratch + r * length;                                                 \
            v8 acc = splat(0.0f), m = splat(best[r]);                                        \
            ptrdiff_t p = 0;                                                                 \
            for (; p + 8 <= length; p += 8) {                                                \
                v8 e = exp_neg(load(s + p) - m);                                             \
                store(s + p, e);                                                             \
                acc += e;                                                                    \
            }                                                                                \
            if (p < length) {                                                                \
                float tail[8] = {0};                                                         \
                for (ptrdiff_t i = p; i < length; i++) tail[i - p] = s[i] - best[r];         \
                v8 e = exp_neg(load(tail));                                                  \
                for (ptrdiff_t i = p; i < length; i++) {                                     \
                    s[i] = e[i - p];                                                         \
                    acc[i - p] += e[i - p];                                                  \
                }                                                                            \
            }                                                                                \
            total[r] = hsum(acc);                                                            \
        }                                                                                    \
        v8 o[MAX_REP][B];                                                                    \
        for (int r = 0; r < rep; r++)                                                        \
            for (int j = 0; j < (B); j++) o[r][j] = splat(0.0f);                             \
        for (ptrdiff_t c = 0; c < length; c += CHUNK) {                                      \
            ptrdiff_t end = c + CHUNK < length ? c + CHUNK : length;                         \
            for (int r = 0; r < rep; r++) {                                                  \
                const float *s = scratch + r * length;                                       \
                v8 a[B];                                                                     \
                for (int j = 0; j < (B); j++) a[j] = o[r][j];                                \
                for (ptrdiff_t p = c; p < end; p++) {                                        \
                    const float *row = v + p * D;                                            \
                    v8 w = splat(s[p]);                                                      \
                    for (int j = 0; j < (B); j++) a[j] += w * load(row + 8 * j);             \
                }                                                                            \
                for (int j = 0; j < (B); j++) o[r][j] = a[j];                                \
            }                                                                                \
        }                                                                                    \
        for (int r = 0; r < rep; r++) {                                                      \
            v8 inv = splat(1.0f / total[r]);                                                 \
            for (int j = 0; j < (B); j++) store(out + r * D + 8 * j, o[r][j] * inv);         \
        }                                                                                    \
    }

HEAD(8)
HEAD(16)

/* q: kv_heads x rep x head_dim; k, v: kv_heads heads head_stride floats
 * apart, each length x head_dim; out like q. Returns 0, or -1 for a shape
 * this kernel does not take (head_dim other than 64 or 128, rep over 16, no
 * positions) or no memory for its scratch: the caller's numpy form then. */
CLONES int understudy_decode_attention(const float *q, const float *k, const float *v,
                                       ptrdiff_t head_stride, ptrdiff_t length, int kv_heads,
                                       int rep, int head_dim, float *out) {
    if ((head_dim != 64 && head_dim != 128) || rep < 1 || rep > MAX_REP || length < 1 ||
        kv_heads < 1)
        return -1;
    float *scratch = malloc(sizeof(float) * (size_t)rep * (size_t)length);
    if (scratch == NULL) return -1;
    for (int h = 0; h < kv_heads; h++) {
        const float *qh = q + (ptrdiff_t)h * rep * head_dim;
        const float *kh = k + h * head_stride, *vh = v + h * head_stride;
        float *oh = out + (ptrdiff_t)h * rep * head_dim;
        if (head_dim == 64)
            head_8(qh, kh, vh, length, rep, scratch, oh);
        else
            head_16(qh, kh, vh, length, rep, scratch, oh);
    }
    free(scratch);
    return 0;
}
