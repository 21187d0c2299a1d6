/* The llama engine's decode kernels (llama_model's decode; loaded by
 * decode_kernels.py through ctypes): a row's attention over its own
 * sequence, here, with the KV pool's block checksums of what it reads when
 * asked (a failover's first step), and a step's products; at the end of the
 * file, the vllm engine's moves between the KV pool and vLLM-CPU's cache
 * (vllm_kvmove.py), which share the checksums' code.
 *
 * The attention reads each key and value once, where numpy's forms read a
 * KV head's keys once per query head that shares it
 * (SmolLM2: 3), and its probabilities-times-values product again per query
 * head: 24 ms for SmolLM2's 30 layers at 4,000 positions on one core of this
 * project's EPYC, where reading the 184 MB once takes about 10. Here the
 * positions go in chunks small enough for the L1 cache: a chunk's keys meet
 * every query head of their KV head before the next chunk is read, and so
 * do its values (docs/performance.md). Past PART positions a row goes in parts,
 * on more than one core where the engine has them (below, "a row's attention
 * in parts").
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

/* A store past the caches, p 32-byte aligned (the KV moves' loads; fence()
 * before another thread reads what they wrote). Where x86's streaming
 * stores exist, the SSE ones, which every clone has: a line a store fills
 * is written to memory whole, without first being read into the cache, as
 * a plain store's line is. */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
static inline __attribute__((always_inline)) void stream(float *p, v8 x) {
    __m128 lo, hi;
    memcpy(&lo, &x, sizeof lo);
    memcpy(&hi, (const char *)&x + sizeof lo, sizeof hi);
    _mm_stream_ps(p, lo);
    _mm_stream_ps(p + 4, hi);
}
static inline __attribute__((always_inline)) void fence(void) { _mm_sfence(); }
#else
static inline __attribute__((always_inline)) void stream(float *p, v8 x) { store(p, x); }
static inline __attribute__((always_inline)) void fence(void) {}
#endif
static inline __attribute__((always_inline)) v8 splat(float f) { return (v8){f, f, f, f, f, f, f, f}; }
static inline __attribute__((always_inline)) float hsum(v8 a) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* The lane sums of 8 vectors at once, each by hsum's own tree (so a position's
 * score has the same bits in a group of 8 or alone, at a sequence's end):
 * three levels of adding lanes l and l + 4, then l and l + 2, then l and
 * l + 1 of each pair's halves, instead of 8 horizontal sums one lane at a time
 * (SmolLM2's attention at 4,000 positions: 14.6-14.8 ms from 15.3). */
static inline __attribute__((always_inline)) v8 fold(v8 a, v8 b, i8 lo, i8 hi) {
    return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}
#define HALVES(a, b) fold(a, b, (i8){0, 1, 2, 3, 8, 9, 10, 11}, (i8){4, 5, 6, 7, 12, 13, 14, 15})
#define QUARTERS(a, b) fold(a, b, (i8){0, 1, 8, 9, 4, 5, 12, 13}, (i8){2, 3, 10, 11, 6, 7, 14, 15})
#define EIGHTHS(a, b) fold(a, b, (i8){0, 2, 8, 10, 4, 6, 12, 14}, (i8){1, 3, 9, 11, 5, 7, 13, 15})
/* EIGHTHS leaves the sums of vectors 0, 2, 4, 6, 1, 3, 5, 7 in that lane order. */
#define IN_ORDER(x) __builtin_shuffle(x, (i8){0, 4, 1, 5, 2, 6, 3, 7})

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

/* --- a claim's checksums, summed as the attention reads the blocks ------------
 *
 * A failover's first step reads every position the new engine adopted from
 * the dead one; the claim must check those positions' blocks against their
 * seals before the step's results count (kvpool's `claim`, `defer`). Summing
 * them here, from the L1 cache right after a chunk's attention, spares the
 * 184 MB second read of 4,000 positions of SmolLM2 that a thread beside the
 * step made (docs/performance.md). The sums are kvlog's `block_checksum`
 * (format version 2), a head's share of them: each position's row read as
 * 64-bit words; the row's sum times its weight, plus each word's column sum
 * over the block's positions times the column's weight, mod 2^64 (unsigned
 * arithmetic wraps, as numpy's uint64 does), added into the block's total. */
#define BLOCK 16
#define MAX_WORDS 64

struct sums {
    ptrdiff_t blocks;                   /* whole blocks from position 0; 0: none */
    uint64_t *total;                    /* blocks of them, added to */
    const uint64_t *key_rows, *key_cols; /* this layer's: kv_heads x BLOCK, kv_heads x words */
    const uint64_t *value_rows, *value_cols;
};

typedef uint64_t u4 __attribute__((vector_size(32)));

/* Inlined into each clone of the attention (AVX2's adds 4 words at once), and
 * with its head's width a constant there: a block's column sums stay in
 * registers, and a row's sum is its 4-word lanes' sum. */
static inline __attribute__((always_inline)) void block_sums(const float *rows, ptrdiff_t blocks,
                                                             int words, const uint64_t *row_w,
                                                             const uint64_t *col_w,
                                                             uint64_t *total) {
    for (ptrdiff_t b = 0; b < blocks; b++) {
        const unsigned char *at = (const unsigned char *)(rows + b * BLOCK * 2 * words);
        u4 cols[MAX_WORDS / 4];
        for (int j = 0; j < words / 4; j++) cols[j] = (u4){0, 0, 0, 0};
        uint64_t sum = 0;
        for (int p = 0; p < BLOCK; p++, at += (size_t)words * 8) {
            u4 even = {0, 0, 0, 0}, odd = {0, 0, 0, 0};
            for (int j = 0; j < words / 4; j += 2) {
                u4 x, y;
                memcpy(&x, at + 32 * j, sizeof x);
                memcpy(&y, at + 32 * j + 32, sizeof y);
                even += x;
                odd += y;
                cols[j] += x;
                cols[j + 1] += y;
            }
            u4 row = even + odd;
            sum += row_w[p] * (row[0] + row[1] + row[2] + row[3]);
        }
        for (int j = 0; j < words / 4; j++)
            for (int l = 0; l < 4; l++) sum += col_w[4 * j + l] * cols[j][l];
        total[b] += sum;
    }
}

/* A chunk's share of the sums (chunks start at multiples of BLOCK). */
static inline __attribute__((always_inline)) void chunk_sums(const float *rows, ptrdiff_t c,
                                                             ptrdiff_t end, int d,
                                                             const struct sums *ck,
                                                             const uint64_t *row_w,
                                                             const uint64_t *col_w) {
    ptrdiff_t upto = ck->blocks * BLOCK < end ? ck->blocks * BLOCK : end;
    if (c < upto) block_sums(rows + c * d, (upto - c) / BLOCK, d / 2, row_w, col_w, ck->total + c / BLOCK);
}

/* The rows AHEAD positions on are prefetched as a chunk is computed, a share
 * of their cache lines in each query head's pass (`ahead`): the hardware's
 * prefetcher alone left a chunk's first pass waiting on memory, and one
 * burst of a chunk's lines in the first pass only filled the core's line
 * buffers. A step of SmolLM2 at 4,000 positions, its worker awake (below):
 * 58.5 ms against 60.5 (docs/performance.md). A prefetch changes no
 * result. */
#define AHEAD 64
static inline __attribute__((always_inline)) void ahead(const float *p, int floats, int r, int rep) {
    int lines = floats / 16, from = lines * r / rep, to = lines * (r + 1) / rep;
    for (int i = from; i < to; i++) __builtin_prefetch(p + 16 * i, 0, 3);
}

/* One KV head, head_dim B * 8, over positions c0..c1-1 (a part): the scores of
 * its rep query heads into scratch (rep rows of c1 - c0), their softmax
 * against the part's own maximum, then into st, per query head, the part's
 * weighted values (B * 8 floats), its maximum and its sum of e^x. */
#define SPAN(B)                                                                              \
    static inline __attribute__((always_inline)) void span_##B(const float *q, const float *k, const float *v, \
                                ptrdiff_t c0, ptrdiff_t c1, int rep, float *scratch,         \
                                float *st, const struct sums *ck, int h) {                   \
        enum { D = (B) * 8 };                                                                \
        ptrdiff_t n = c1 - c0;                                                               \
        float best[MAX_REP];                                                                 \
        for (int r = 0; r < rep; r++) best[r] = -INFINITY;                                   \
        for (ptrdiff_t c = c0; c < c1; c += CHUNK) {                                         \
            ptrdiff_t end = c + CHUNK < c1 ? c + CHUNK : c1;                                 \
            for (int r = 0; r < rep; r++) {                                                  \
                v8 qv[B];                                                                    \
                for (int j = 0; j < (B); j++) qv[j] = load(q + r * D + 8 * j);               \
                float *s = scratch + r * n, m = best[r];                                     \
                v8 top = splat(m);                                                           \
                ptrdiff_t p = c;                                                             \
                for (; p + 8 <= end; p += 8) {                                               \
                    const float *row = k + p * D;                                            \
                    ahead(row + AHEAD * D, 8 * D, r, rep);                                    \
                    v8 x01 = HALVES(products_##B(qv, row), products_##B(qv, row + D));       \
                    v8 x23 = HALVES(products_##B(qv, row + 2 * D), products_##B(qv, row + 3 * D)); \
                    v8 x45 = HALVES(products_##B(qv, row + 4 * D), products_##B(qv, row + 5 * D)); \
                    v8 x67 = HALVES(products_##B(qv, row + 6 * D), products_##B(qv, row + 7 * D)); \
                    v8 dots = IN_ORDER(EIGHTHS(QUARTERS(x01, x23), QUARTERS(x45, x67)));      \
                    store(s + p - c0, dots);                                                  \
                    i8 more = dots > top;                                                    \
                    top = (v8)(((i8)dots & more) | ((i8)top & ~more));                       \
                }                                                                            \
                for (int i = 0; i < 8; i++) m = top[i] > m ? top[i] : m;                     \
                for (; p < end; p++) {                                                       \
                    float dot = hsum(products_##B(qv, k + p * D));                           \
                    s[p - c0] = dot;                                                         \
                    m = dot > m ? dot : m;                                                   \
                }                                                                            \
                best[r] = m;                                                                 \
            }                                                                                \
            if (ck != NULL)                                                                  \
                chunk_sums(k, c, end, D, ck, ck->key_rows + h * BLOCK, ck->key_cols + h * (D / 2)); \
        }                                                                                    \
        for (int r = 0; r < rep; r++) {                                                      \
            float *s = scratch + r * n;                                                      \
            v8 acc = splat(0.0f), m = splat(best[r]);                                        \
            ptrdiff_t p = 0;                                                                 \
            for (; p + 8 <= n; p += 8) {                                                     \
                v8 e = exp_neg(load(s + p) - m);                                             \
                store(s + p, e);                                                             \
                acc += e;                                                                    \
            }                                                                                \
            if (p < n) {                                                                     \
                float tail[8] = {0};                                                         \
                for (ptrdiff_t i = p; i < n; i++) tail[i - p] = s[i] - best[r];              \
                v8 e = exp_neg(load(tail));                                                  \
                for (ptrdiff_t i = p; i < n; i++) {                                          \
                    s[i] = e[i - p];                                                         \
                    acc[i - p] += e[i - p];                                                  \
                }                                                                            \
            }                                                                                \
            st[r * (D + 2) + D] = best[r];                                                   \
            st[r * (D + 2) + D + 1] = hsum(acc);                                             \
        }                                                                                    \
        v8 o[MAX_REP][B];                                                                    \
        for (int r = 0; r < rep; r++)                                                        \
            for (int j = 0; j < (B); j++) o[r][j] = splat(0.0f);                             \
        for (ptrdiff_t c = c0; c < c1; c += CHUNK) {                                         \
            ptrdiff_t end = c + CHUNK < c1 ? c + CHUNK : c1;                                 \
            for (int r = 0; r < rep; r++) {                                                  \
                const float *s = scratch + r * n;                                            \
                v8 a[B];                                                                     \
                for (int j = 0; j < (B); j++) a[j] = o[r][j];                                \
                for (ptrdiff_t p = c; p < end; p++) {                                        \
                    const float *row = v + p * D;                                            \
                    ahead(row + AHEAD * D, D, r, rep);                                        \
                    v8 w = splat(s[p - c0]);                                                 \
                    for (int j = 0; j < (B); j++) a[j] += w * load(row + 8 * j);             \
                }                                                                            \
                for (int j = 0; j < (B); j++) o[r][j] = a[j];                                \
            }                                                                                \
            if (ck != NULL)                                                                  \
                chunk_sums(v, c, end, D, ck, ck->value_rows + h * BLOCK, ck->value_cols + h * (D / 2)); \
        }                                                                                    \
        for (int r = 0; r < rep; r++)                                                        \
            for (int j = 0; j < (B); j++) store(st + r * (D + 2) + 8 * j, o[r][j]);          \
    }

SPAN(8)
SPAN(16)

/* --- a row's attention in parts, on more than one core --------------------------
 *
 * At 4,000 positions SmolLM2's 30 layers read 184 MB of keys and values a
 * step, and one core of this project's Intel machine reads memory at about
 * 10 GB/s where two read at 20 (docs/performance.md): the attention was 25 of
 * a step's 80 ms there, the weights' products the other 55 whatever the
 * context. So a row's positions go in parts of PART, each part's softmax
 * against its own maximum, and the parts are summed at the end, rescaled to
 * the row's maximum (split-K, as FlashDecoding does on a GPU). The parts are
 * a function of the length alone and are summed in their own order, so a
 * row's bits do not depend on how many threads computed them, or which part
 * each took: a failover's next engine continues a stream with the same bits
 * on one thread or two. A row of one part (up to PART positions) is the
 * plain softmax, as before the parts.
 *
 * Threads: the caller and `wanted` - 1 workers of this library's own, asleep
 * until a row of more than one part is posted (and awake for spin_ns after
 * one: `spin`, below); each takes the next part left
 * (one atomic word: the job's generation, its parts and the next part), so
 * a worker that wakes late or not at all only leaves the caller more parts,
 * and never touches another job's. A second caller at the same time (another
 * Python thread) computes its row alone. The parts' checksum sums touch
 * disjoint blocks (PART is whole blocks), so no two threads add to one. */
#define PART 512
#define MAX_THREADS 8

struct job {
    const float *q, *k, *v;
    ptrdiff_t head_stride, length, parts;
    int kv_heads, rep, head_dim;
    const struct sums *ck;
    float *scratch; /* parts x rep x PART */
    float *state;   /* parts x kv_heads x rep x (head_dim + 2): span's st */
};

CLONES static void run_part(const struct job *j, ptrdiff_t part) {
    ptrdiff_t c0 = part * PART, c1 = c0 + PART < j->length ? c0 + PART : j->length;
    float *scratch = j->scratch + part * j->rep * PART;
    for (int h = 0; h < j->kv_heads; h++) {
        const float *qh = j->q + (ptrdiff_t)h * j->rep * j->head_dim;
        const float *kh = j->k + h * j->head_stride, *vh = j->v + h * j->head_stride;
        float *st = j->state + (part * j->kv_heads + h) * j->rep * (j->head_dim + 2);
        if (j->head_dim == 64)
            span_8(qh, kh, vh, c0, c1, j->rep, scratch, st, j->ck, h);
        else
            span_16(qh, kh, vh, c0, c1, j->rep, scratch, st, j->ck, h);
    }
}

/* out = the parts' weighted values over their sums, each part's rescaled by
 * e^(its maximum - the row's), summed in the parts' order. */
static void combine(const struct job *j, float *out) {
    int d = j->head_dim, width = d + 2, rows = j->kv_heads * j->rep;
    for (int i = 0; i < rows; i++) {
        const float *first = j->state + (ptrdiff_t)i * width;
        if (j->parts == 1) {
            float inv = 1.0f / first[d + 1];
            for (int x = 0; x < d; x++) out[(ptrdiff_t)i * d + x] = first[x] * inv;
            continue;
        }
        float top = -INFINITY, total = 0.0f;
        for (ptrdiff_t p = 0; p < j->parts; p++) {
            float m = j->state[(p * rows + i) * width + d];
            top = m > top ? m : top;
        }
        float *o = out + (ptrdiff_t)i * d;
        for (int x = 0; x < d; x++) o[x] = 0.0f;
        for (ptrdiff_t p = 0; p < j->parts; p++) {
            const float *st = j->state + (p * rows + i) * width;
            float scale = exp_neg(splat(st[d] - top))[0];
            total += st[d + 1] * scale;
            for (int x = 0; x < d; x++) o[x] += st[x] * scale;
        }
        float inv = 1.0f / total;
        for (int x = 0; x < d; x++) o[x] *= inv;
    }
}

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#define PAUSE() __builtin_ia32_pause()
#else
#define PAUSE() ((void)0)
#endif

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t posted_cv = PTHREAD_COND_INITIALIZER;
static int wanted = 1, started = 0, atfork = 0; /* under mu */
static uint64_t posted = 0; /* the last job's generation: written under mu, read atomically too */
static const struct job *current = NULL;         /* that job, under mu */
static _Atomic uint64_t claim = 0;               /* generation << 32 | parts << 16 | next */
static _Atomic ptrdiff_t done = 0;               /* the current job's parts finished */
static atomic_flag busy = ATOMIC_FLAG_INIT;      /* a caller is using the workers */

/* The next part of job `gen`, or 0 where it has none left (or is over). */
static int take(uint32_t gen, ptrdiff_t *part) {
    uint64_t w = atomic_load(&claim);
    for (;;) {
        if ((uint32_t)(w >> 32) != gen || (w & 0xffff) >= ((w >> 16) & 0xffff)) return 0;
        if (atomic_compare_exchange_weak(&claim, &w, w + 1)) {
            *part = (ptrdiff_t)(w & 0xffff);
            return 1;
        }
    }
}

static void work(const struct job *j, uint32_t gen) {
    ptrdiff_t part;
    while (take(gen, &part)) {
        run_part(j, part);
        atomic_fetch_add(&done, 1);
    }
}

/* A worker that has taken parts waits for the next row awake, for spin_ns
 * (2 ms unless set: UNDERSTUDY_DECODE_SPIN_US), before it sleeps: as
 * OpenMP's runtimes do (libgomp's GOMP_SPINCOUNT,
 * Intel's KMP_BLOCKTIME of 200 ms). A step posts a row at each of its 30
 * layers, a layer's products apart (1.5-2 ms at SmolLM2's size), and a
 * worker woken from its sleep came late on this project's machines (a VM's
 * idle CPU), when the caller had done most of the parts: a step at 4,000
 * positions took 62.0 ms where it sleeps between rows and 58.5 where it
 * waits 2 ms awake (1.3x and 1.23x the step at 16 tokens; 60.5 without the
 * prefetch above). The price: the other CPU stays busy through a step whose
 * rows go in parts, 109 ms of CPU a 58.5 ms step against 73; a row of one
 * part (512 positions or fewer) never wakes a worker (docs/performance.md). */
static _Atomic uint64_t spin_ns = 2000000; /* `understudy_decode_spin_us` sets it */

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* Until a job past `seen` is posted, or spin_ns. */
static void spin(uint64_t seen) {
    uint64_t budget = atomic_load(&spin_ns);
    if (budget == 0) return;
    uint64_t until = now_ns() + budget;
    for (unsigned i = 0; __atomic_load_n(&posted, __ATOMIC_ACQUIRE) == seen; i++) {
        if (i % 64 == 0 && now_ns() > until) return;
        PAUSE();
    }
}

/* Sets spin_ns in microseconds, where us >= 0 (0: a worker sleeps as soon
 * as it has no part left, as OMP_WAIT_POLICY=passive has OpenMP's do);
 * returns the microseconds in force. */
long understudy_decode_spin_us(long us) {
    if (us >= 0) atomic_store(&spin_ns, (uint64_t)us * 1000u);
    return (long)(atomic_load(&spin_ns) / 1000u);
}

/* Worker `index` (from 0) takes parts while index < wanted - 1. */
static void *worker(void *arg) {
    int index = (int)(intptr_t)arg;
    uint64_t seen = 0;
    int mine = 0;
    for (;;) {
        if (mine) spin(seen);
        pthread_mutex_lock(&mu);
        while (posted == seen) pthread_cond_wait(&posted_cv, &mu);
        seen = posted;
        const struct job *j = current; /* dereferenced only for a part `take` gave */
        mine = index < wanted - 1;
        pthread_mutex_unlock(&mu);
        if (mine) work(j, (uint32_t)seen);
    }
    return NULL;
}

/* A forked child has none of its parent's workers: it starts its own. */
static void forked(void) {
    pthread_mutex_init(&mu, NULL);
    pthread_cond_init(&posted_cv, NULL);
    started = 0;
    atomic_flag_clear(&busy);
}

/* Under mu: workers up to wanted - 1; 1 where at least one runs. Workers take
 * no signals (Python's go to its main thread). */
static int start_workers(void) {
    if (!atfork) atfork = pthread_atfork(NULL, NULL, forked) == 0;
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    while (started < wanted - 1) {
        pthread_t t;
        if (pthread_create(&t, NULL, worker, (void *)(intptr_t)started) != 0) break;
        pthread_detach(t);
        started++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return started > 0;
}

/* Sets the threads a row's attention may use, the caller's among them (1:
 * the caller alone), clamped to 1..MAX_THREADS, where threads > 0; returns
 * the number in force. Workers are started by `understudy_decode_start`, or
 * else at the first row that uses them. */
int understudy_decode_threads(int threads) {
    pthread_mutex_lock(&mu);
    if (threads > 0) wanted = threads > MAX_THREADS ? MAX_THREADS : threads;
    int set = wanted;
    pthread_mutex_unlock(&mu);
    return set;
}

/* Starts the workers now (the llama engine's model, at start-up), not at the
 * first row of more than one part: a thread starts on its creator's CPU,
 * and one that a failover's first step created (a new Active's first long
 * row) often stayed on the step's CPU, the other being taken at that moment
 * (the dead engine's teardown), and the step yielded to it part by part:
 * 4-21 ms of 7 of 9 first steps at 4,000 positions, traced with perf. A
 * worker started here and woken by that row ran beside it in 4 of 4 (0-0.8
 * ms serialized; docs/performance.md). Returns the workers running (a
 * forked child starts its own at its first such row). */
int understudy_decode_start(void) {
    pthread_mutex_lock(&mu);
    if (wanted > 1) start_workers();
    int running = started;
    pthread_mutex_unlock(&mu);
    return running;
}

/* Every part of j, on the workers too where a row has more than one part and
 * no other caller has them. The caller waits at most for the parts the
 * workers took, not for a worker to wake. */
static void run(const struct job *j) {
    int shared = j->parts > 1 && j->parts <= 0xffff && !atomic_flag_test_and_set(&busy);
    uint32_t gen = 0;
    if (shared) {
        pthread_mutex_lock(&mu);
        shared = wanted > 1 && (started >= wanted - 1 || start_workers());
        if (shared) {
            gen = (uint32_t)(posted + 1);
            current = j;
            atomic_store(&done, 0);
            atomic_store(&claim, (uint64_t)gen << 32 | (uint64_t)j->parts << 16);
            __atomic_store_n(&posted, posted + 1, __ATOMIC_RELEASE); /* a spinning worker's cue */
            pthread_cond_broadcast(&posted_cv);
        }
        pthread_mutex_unlock(&mu);
        if (!shared) atomic_flag_clear(&busy);
    }
    if (!shared) {
        for (ptrdiff_t p = 0; p < j->parts; p++) run_part(j, p);
        return;
    }
    work(j, gen);
    for (int spins = 0; atomic_load(&done) < j->parts; spins++) {
        if (spins < 4096)
            PAUSE();
        else
            sched_yield();
    }
    atomic_flag_clear(&busy);
}

/* q: kv_heads x rep x head_dim; k, v: kv_heads heads head_stride floats
 * apart, each length x head_dim; out like q; ck: NULL, or the checksums to
 * add the first ck->blocks blocks' words to (each head's keys and values).
 * Returns 0, or -1 for a shape this kernel does not take (head_dim other than
 * 64 or 128, rep over 16, no positions, sums past the length) or no memory
 * for its scratch: the caller's numpy form then. */
int understudy_decode_attention(const float *q, const float *k, const float *v,
                                ptrdiff_t head_stride, ptrdiff_t length, int kv_heads, int rep,
                                int head_dim, float *out, const struct sums *ck) {
    if ((head_dim != 64 && head_dim != 128) || rep < 1 || rep > MAX_REP || length < 1 ||
        kv_heads < 1)
        return -1;
    if (ck != NULL && (ck->blocks < 0 || ck->blocks * BLOCK > length)) return -1;
    ptrdiff_t parts = (length + PART - 1) / PART;
    size_t scratch = (size_t)(parts * rep * PART);
    size_t state = (size_t)(parts * kv_heads * rep * (head_dim + 2));
    float *mem = malloc(sizeof(float) * (scratch + state));
    if (mem == NULL) return -1;
    struct job j = {q, k, v, head_stride, length, parts, kv_heads, rep, head_dim, ck, mem, mem + scratch};
    run(&j);
    combine(&j, out);
    free(mem);
    return 0;
}

/* --- a decode's products ------------------------------------------------------
 *
 * y[m, o] = dot(x[m, :], w[o, :]) for m < rows, o < outs; x (rows, n) and w
 * (outs, n) row-major, n a multiple of 8: every product of a decode step
 * (llama_model's `_decode_product`), the weights read from memory once for
 * all the step's rows. numpy's form hands BLAS one small product per group
 * of 8 weight rows (204,672 calls a step for SmolLM2 in the form before it,
 * 25,584 in this one) and pads the step's rows to 8.
 *
 * A row's bits by construction: every element is 8 lanes, each accumulated
 * by FMA over its inputs in order, then one fixed horizontal sum; the same
 * operations whatever the other rows, the row's place or the tile it falls
 * in. Tiles of 4 rows x 3 weight rows keep 12 accumulators in AVX2
 * registers, and the weight rows PREFETCH rows ahead are prefetched so that
 * the arithmetic overlaps the weights' stream from memory. AVX2 and FMA
 * only: elsewhere (`understudy_products_supported`) numpy's form. (The
 * prototype, measured first as bench/decode_kernel.c: docs/performance.md.) */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define PREFETCH 6
#define AVX2 __attribute__((target("avx2,fma")))

AVX2 static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#define TILE(R, O)                                                                         \
    AVX2 static void tile_##R##_##O(const float *x, const float *w, float *y, size_t n,    \
                                    size_t ldy) {                                          \
        __m256 acc[R][O];                                                                  \
        for (int r = 0; r < R; r++)                                                        \
            for (int o = 0; o < O; o++) acc[r][o] = _mm256_setzero_ps();                   \
        for (size_t k = 0; k < n; k += 8) {                                                \
            __m256 wv[O];                                                                  \
            for (int o = 0; o < O; o++) wv[o] = _mm256_loadu_ps(w + o * n + k);            \
            if ((k & 15) == 0)                                                             \
                for (int o = 0; o < O; o++)                                                \
                    _mm_prefetch((const char *)(w + (o + PREFETCH) * n + k), _MM_HINT_T0); \
            for (int r = 0; r < R; r++) {                                                  \
                __m256 xv = _mm256_loadu_ps(x + r * n + k);                                \
                for (int o = 0; o < O; o++) acc[r][o] = _mm256_fmadd_ps(xv, wv[o], acc[r][o]); \
            }                                                                              \
        }                                                                                  \
        for (int r = 0; r < R; r++)                                                        \
            for (int o = 0; o < O; o++) y[r * ldy + o] = hsum256(acc[r][o]);               \
    }

TILE(4, 3)
TILE(2, 3)
TILE(1, 3)
TILE(4, 1)
TILE(2, 1)
TILE(1, 1)

#define ROWS(O)                                                                            \
    do {                                                                                   \
        size_t r = 0;                                                                      \
        for (; r + 4 <= rows; r += 4)                                                      \
            tile_4_##O(x + r * n, w + o * n, y + r * outs + o, n, outs);                   \
        for (; r + 2 <= rows; r += 2)                                                      \
            tile_2_##O(x + r * n, w + o * n, y + r * outs + o, n, outs);                   \
        for (; r < rows; r++) tile_1_##O(x + r * n, w + o * n, y + r * outs + o, n, outs); \
    } while (0)

int understudy_products_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

AVX2 int understudy_products(const float *x, const float *w, float *y, size_t rows, size_t outs,
                             size_t n) {
    if (n % 8 || rows < 1) return -1;
    size_t o = 0;
    for (; o + 3 <= outs; o += 3) ROWS(3);
    for (; o < outs; o++) ROWS(1);
    return 0;
}
#else
int understudy_products_supported(void) { return 0; }
int understudy_products(const float *x, const float *w, float *y, size_t rows, size_t outs,
                        size_t n) {
    (void)x, (void)w, (void)y, (void)rows, (void)outs, (void)n;
    return -1;
}
#endif

/* --- the vllm engine's KV moves -----------------------------------------------
 *
 * Between the KV pool's slots and vLLM-CPU's paged cache (vllm_kvmove.py;
 * vllm_kvconn's copier). vLLM-CPU keeps each layer's cache as [blocks,
 * kv_heads, block_size, 2 * head_dim] whose memory, per block and head, is
 * the keys transposed (head_dim rows of block_size positions), then the
 * values row by row (vllm_kvconn's `kv_views`); the pool holds rows of
 * head_dim. So a move copies the values as they are and transposes the
 * keys, in tiles of 8 x 8 in registers: torch's strided copy took 25 ms for
 * the keys of 4,000 positions of SmolLM2 on one core of this project's EPYC,
 * against 12 for the values (as many bytes); these tiles, 14-15. Only
 * copies: every float arrives with its bits. A failover's load sums the
 * pool's block checksums of what it copies, from the L1 cache (`block_sums`,
 * as the attention does): the claim's checksums need no read of their own
 * (docs/performance.md). */

/* An 8 x 8 tile: dst[c * cs + r] = src[r * rs + c]. Three levels of
 * interleaving pairs of rows: elements, then pairs, then halves. */
static inline __attribute__((always_inline)) void tile(const float *src, ptrdiff_t rs, float *dst,
                                                       ptrdiff_t cs) {
    v8 r[8], t[8], u[8];
    for (int i = 0; i < 8; i++) r[i] = load(src + i * rs);
    for (int i = 0; i < 8; i += 2) {
        t[i] = __builtin_shuffle(r[i], r[i + 1], (i8){0, 8, 1, 9, 4, 12, 5, 13});
        t[i + 1] = __builtin_shuffle(r[i], r[i + 1], (i8){2, 10, 3, 11, 6, 14, 7, 15});
    }
    for (int i = 0; i < 8; i += 4)
        for (int j = 0; j < 2; j++) {
            u[i + j] = __builtin_shuffle(t[i + j], t[i + j + 2], (i8){0, 1, 8, 9, 4, 5, 12, 13});
            u[i + j + 2] = __builtin_shuffle(t[i + j], t[i + j + 2], (i8){2, 3, 10, 11, 6, 7, 14, 15});
        }
    static const int column[4] = {0, 2, 1, 3}; /* u[j] holds columns column[j] and column[j] + 4 */
    for (int j = 0; j < 4; j++) {
        store(dst + column[j] * cs, __builtin_shuffle(u[j], u[j + 4], (i8){0, 1, 2, 3, 8, 9, 10, 11}));
        store(dst + (column[j] + 4) * cs,
              __builtin_shuffle(u[j], u[j + 4], (i8){4, 5, 6, 7, 12, 13, 14, 15}));
    }
}

/* n floats from src to dst; nt: streamed (dst 32-byte aligned). */
static inline __attribute__((always_inline)) void copy(float *dst, const float *src, ptrdiff_t n,
                                                       int nt) {
    ptrdiff_t i = 0;
    if (nt)
        for (; i + 8 <= n; i += 8) stream(dst + i, load(src + i));
    memcpy(dst + i, src + i, sizeof(float) * (size_t)(n - i));
}

/* Positions a streamed transpose stages (vLLM-CPU's blocks are 128 here). */
#define STAGE 256

/* dst[c * cs + r] = src[r * rs + c] for r < rows, c < cols. nt: streamed
 * (dst and cs then whole multiples of 8 floats), where up to STAGE rows:
 * eight rows of dst at a time are transposed into a stage in the L1 cache,
 * then streamed out row after row. The tiles' own stores streamed, which go
 * from row to row of dst, were slower than plain ones where dst's rows are
 * long (the keys of 4,000 positions of SmolLM2 in vLLM's blocks of 128:
 * 42-57 ms against 34; staged, 17). */
static inline __attribute__((always_inline)) void transpose(const float *src, ptrdiff_t rs,
                                                            float *dst, ptrdiff_t cs,
                                                            ptrdiff_t rows, ptrdiff_t cols, int nt) {
    ptrdiff_t whole_rows = rows - rows % 8, whole_cols = cols - cols % 8;
    if (nt && whole_rows <= STAGE) {
        float stage[8 * STAGE];
        for (ptrdiff_t c = 0; c < whole_cols; c += 8) {
            for (ptrdiff_t r = 0; r < whole_rows; r += 8)
                tile(src + r * rs + c, rs, stage + r, whole_rows);
            for (ptrdiff_t j = 0; j < 8; j++)
                copy(dst + (c + j) * cs, stage + j * whole_rows, whole_rows, 1);
        }
    } else {
        for (ptrdiff_t r = 0; r < whole_rows; r += 8)
            for (ptrdiff_t c = 0; c < whole_cols; c += 8)
                tile(src + r * rs + c, rs, dst + c * cs + r, cs);
    }
    for (ptrdiff_t r = 0; r < rows; r++)
        for (ptrdiff_t c = r < whole_rows ? whole_cols : 0; c < cols; c++)
            dst[c * cs + r] = src[r * rs + c];
}

/* Positions start..end-1 of one sequence, every layer and head, between the
 * pool's slot and vLLM-CPU's cache. keys, values: the slot's position 0 of
 * layer 0, head 0 (rows of dim floats; layer_stride and head_stride floats
 * apart); caches: `layers` pointers to each layer's cache, cache_blocks
 * blocks of [heads, bs, 2 * dim]; table: the sequence's block ids (position
 * p in table[p / bs]), table_len of them. into_pool: 1 the cache's positions
 * into the pool (a save), 0 the other way (a load). ck (a load's only, or
 * NULL): the checksums to add the pool's blocks start / BLOCK .. ck->blocks
 * - 1 to, its weights layer 0's with the others' after them. Returns 0, or
 * -1 for a position, block id or sum out of range, before anything is
 * written. */
CLONES int understudy_kv_move(float *keys, float *values, ptrdiff_t layer_stride,
                              ptrdiff_t head_stride, float *const *caches,
                              ptrdiff_t cache_blocks, int layers, int heads, int dim, int bs,
                              const int64_t *table, ptrdiff_t table_len, ptrdiff_t start,
                              ptrdiff_t end, int into_pool, const struct sums *ck) {
    if (layers < 1 || heads < 1 || dim < 1 || bs < 1 || start < 0 || end < start ||
        end > table_len * bs)
        return -1;
    if (ck != NULL && (into_pool || start % BLOCK || bs % BLOCK || dim % 16 || dim / 2 > MAX_WORDS ||
                       ck->blocks < 0 || ck->blocks * BLOCK > end))
        return -1;
    for (ptrdiff_t j = start / bs; j < (end + bs - 1) / bs; j++)
        if (table[j] < 0 || table[j] >= cache_blocks) return -1;
    ptrdiff_t block = (ptrdiff_t)heads * 2 * bs * dim, half = (ptrdiff_t)bs * dim;
    /* A load streams what it writes into the cache: the first step reads it
     * from memory anyway (4,000 positions of SmolLM2 are 184 MB), and a
     * plain store first reads each line it writes (a copy of 184 MB in
     * pieces of 4 KiB, one core of this project's Xeon: 33 ms, streamed 24;
     * docs/performance.md). A save's positions are read again at once, by
     * the seal's checksum: it stores them plainly. */
    int nt = !into_pool && bs % 8 == 0 && dim % 8 == 0;
    for (int l = 0; l < layers && nt; l++) nt = (uintptr_t)caches[l] % 32 == 0;
    for (int l = 0; l < layers; l++)
        for (int h = 0; h < heads; h++) {
            float *k = keys + l * layer_stride + h * head_stride;
            float *v = values + l * layer_stride + h * head_stride;
            for (ptrdiff_t p = start; p < end;) {
                ptrdiff_t off = p % bs, n = bs - off < end - p ? bs - off : end - p;
                float *kc = caches[l] + table[p / bs] * block + h * 2 * half; /* its keys, then values */
                float *vc = kc + half + off * dim;
                if (into_pool) {
                    transpose(kc + off, bs, k + p * dim, dim, dim, n, 0);
                    copy(v + p * dim, vc, n * dim, 0);
                } else {
                    transpose(k + p * dim, dim, kc + off, bs, n, dim, nt && off % 8 == 0);
                    copy(vc, v + p * dim, n * dim, nt);
                }
                ptrdiff_t upto = ck == NULL ? 0 : ck->blocks * BLOCK < p + n ? ck->blocks * BLOCK : p + n;
                if (p < upto) { /* p is a block's first position: start and bs are whole blocks */
                    ptrdiff_t lh = (ptrdiff_t)l * heads + h, w = dim / 2;
                    block_sums(k + p * dim, (upto - p) / BLOCK, w, ck->key_rows + lh * BLOCK,
                               ck->key_cols + lh * w, ck->total + p / BLOCK);
                    block_sums(v + p * dim, (upto - p) / BLOCK, w, ck->value_rows + lh * BLOCK,
                               ck->value_cols + lh * w, ck->total + p / BLOCK);
                }
                p += n;
            }
        }
    if (nt) fence();
    return 0;
}
