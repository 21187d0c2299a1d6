/* A prototype of a decode product that keeps a row's bits by construction,
 * for bench/decode_products.py only (no component builds or loads it).
 *
 * y[m, o] = dot(x[m, :], w[o, :]) for m < rows, o < outs; x (rows, n) and
 * w (outs, n) row-major, n a multiple of 8. Every element is 8 lanes, each
 * accumulated by FMA over its inputs in order, then one fixed horizontal
 * sum: the same operations whatever the other rows, the row's place or the
 * tile it falls in. Tiles of 4 rows x 3 weight rows keep 12 accumulators in
 * AVX2 registers; the weight rows PREFETCH rows ahead are prefetched, so
 * that the arithmetic overlaps the stream of weights from memory. */
#include <immintrin.h>
#include <stddef.h>

#define PREFETCH 6

__attribute__((target("avx2,fma"))) static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#define TILE(R, O)                                                                       \
    __attribute__((target("avx2,fma"))) static void tile_##R##_##O(                      \
        const float *x, const float *w, float *y, size_t n, size_t ldy) {                \
        __m256 acc[R][O];                                                                \
        for (int r = 0; r < R; r++)                                                      \
            for (int o = 0; o < O; o++) acc[r][o] = _mm256_setzero_ps();                 \
        for (size_t k = 0; k < n; k += 8) {                                              \
            __m256 wv[O];                                                                \
            for (int o = 0; o < O; o++) wv[o] = _mm256_loadu_ps(w + o * n + k);          \
            if ((k & 15) == 0)                                                           \
                for (int o = 0; o < O; o++)                                              \
                    _mm_prefetch((const char *)(w + (o + PREFETCH) * n + k), _MM_HINT_T0); \
            for (int r = 0; r < R; r++) {                                                \
                __m256 xv = _mm256_loadu_ps(x + r * n + k);                              \
                for (int o = 0; o < O; o++) acc[r][o] = _mm256_fmadd_ps(xv, wv[o], acc[r][o]); \
            }                                                                            \
        }                                                                                \
        for (int r = 0; r < R; r++)                                                      \
            for (int o = 0; o < O; o++) y[r * ldy + o] = hsum(acc[r][o]);                \
    }

TILE(4, 3) TILE(2, 3) TILE(1, 3) TILE(4, 1) TILE(2, 1) TILE(1, 1)

#define ROWS(O)                                                                          \
    do {                                                                                 \
        size_t r = 0;                                                                    \
        for (; r + 4 <= rows; r += 4) tile_4_##O(x + r * n, w + o * n, y + r * outs + o, n, outs); \
        for (; r + 2 <= rows; r += 2) tile_2_##O(x + r * n, w + o * n, y + r * outs + o, n, outs); \
        for (; r < rows; r++) tile_1_##O(x + r * n, w + o * n, y + r * outs + o, n, outs); \
    } while (0)

/* Whether this CPU runs the kernel (AVX2 and FMA). */
int rows_dot_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

void rows_dot(const float *x, const float *w, float *y, size_t rows, size_t outs, size_t n) {
    size_t o = 0;
    for (; o + 3 <= outs; o += 3) ROWS(3);
    for (; o < outs; o++) ROWS(1);
}
