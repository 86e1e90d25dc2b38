// Matrix products that read a GGUF file's quantised blocks directly: y[M, N] = x[M, K] @ W^T with
// fp32 activations and fp32 sums, W stored as Q4_1 (w = d * q + m, q in 0..15) or Q8_0 (w = d * q,
// q in -128..127), one (d, m) per 32 weights along K. Each weight is rebuilt in fp32 exactly as the
// dequantised copy holds it (d * q is exact in fp32, so fma(q, d, m) rounds once, like d * q + m),
// so these are the same weights as the fp32 model's; only the order of the sums differs from
// oneDNN's. A decode step reads ~6 bits a weight instead of 32.
//
// Every output (row r, column n) is summed in the same order whatever the number of rows M and
// however rows and columns are split into passes and threads: one 16-lane accumulator over the
// blocks in order (weights 0..15, then 16..31 of each block), then one fixed pairwise reduction. So a row's result does not depend on the
// other rows, and verifying several tokens gives each token the projections that decoding it
// alone gives, bit for bit.
//
// Packed layout (specdec/models/gguf_blocks.py writes it): output rows in groups of G = 4; per
// group and block of 32 weights, Q4_1: float d[4], float m[4], uint8 q[4][16] (ggml's order:
// byte j holds weight j in its low nibble and weight j + 16 in its high nibble); Q8_0: float d[4],
// int8 q[4][32]. Needs AVX-512 (F, BW); built on first use by specdec/kernels/__init__.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>

namespace {

constexpr int G = 4;  // output rows per group
constexpr int MAX_ROWS_PER_PASS = 5;  // 5 x 4 accumulators + 8 weight vectors + x fit the 32 registers

inline float hsum16(__m512 a) {  // fixed order: 16 -> 8 -> 4 -> 2 -> 1
  __m256 lo = _mm512_castps512_ps256(a);
  __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
  __m256 s8 = _mm256_add_ps(lo, hi);
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
  return _mm_cvtss_f32(s1);
}

struct Q4_1 {
  static constexpr int BLK = G * 8 + G * 16;
  // weights 0..15 (lo) and 16..31 (hi) of column j of this block: the block's 16 possible values
  // fma(v, d, m), v = 0..15 (exact: d * v needs no rounding), looked up by each weight's nibble
  static inline void weights(const uint8_t* blk, int j, __m512& lo, __m512& hi) {
    const float* dm = reinterpret_cast<const float*>(blk);
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 lut = _mm512_fmadd_ps(iota, _mm512_set1_ps(dm[j]), _mm512_set1_ps(dm[G + j]));
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + G * 8 + j * 16)));
    lo = _mm512_permutexvar_ps(q, lut);  // (the permute reads the low 4 bits of each lane: the low nibble)
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), lut);
  }
};

struct Q8_0 {
  static constexpr int BLK = G * 4 + G * 32;
  static inline void weights(const uint8_t* blk, int j, __m512& lo, __m512& hi) {
    const __m512 d = _mm512_set1_ps(reinterpret_cast<const float*>(blk)[j]);
    const uint8_t* q = blk + G * 4 + j * 32;
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)))), d);
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)))), d);
  }
};

// rows 0..MT-1 of x (row stride ldx) against the G columns of one group of nb blocks. One
// accumulator per (row, column): per block, weights 0..15 times x, then weights 16..31 times x
// (the low halves of every column first, then the high halves).
template <class F, int MT>
inline void tile(const float* __restrict x, int64_t ldx, const uint8_t* __restrict grp, int64_t nb,
                 float* __restrict y, int64_t ldy) {
  __m512 acc[MT][G];
#pragma GCC unroll 8
  for (int r = 0; r < MT; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < G; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = grp + b * F::BLK;
    _mm_prefetch(reinterpret_cast<const char*>(blk + 6 * F::BLK), _MM_HINT_T0);
    __m512 lo[G], hi[G];
#pragma GCC unroll 4
    for (int j = 0; j < G; ++j) F::weights(blk, j, lo[j], hi[j]);
#pragma GCC unroll 8
    for (int r = 0; r < MT; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * ldx + b * 32);
#pragma GCC unroll 4
      for (int j = 0; j < G; ++j) acc[r][j] = _mm512_fmadd_ps(lo[j], xv, acc[r][j]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < MT; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * ldx + b * 32 + 16);
#pragma GCC unroll 4
      for (int j = 0; j < G; ++j) acc[r][j] = _mm512_fmadd_ps(hi[j], xv, acc[r][j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MT; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < G; ++j) y[r * ldy + j] = hsum16(acc[r][j]);
}

template <class F>
void group_rows(const float* x, int64_t M, int64_t K, const uint8_t* grp, int64_t nb, float* y, int64_t N) {
  // balanced passes of at most MAX_ROWS_PER_PASS rows (9 -> 5 + 4); a row's sums do not depend on its pass
  const int64_t passes = (M + MAX_ROWS_PER_PASS - 1) / MAX_ROWS_PER_PASS;
  int64_t r0 = 0;
  for (int64_t p = 0; p < passes; ++p) {
    const int64_t c = (M - r0) / (passes - p);
    const float* xr = x + r0 * K;
    float* yr = y + r0 * N;
    switch (c) {
      case 1: tile<F, 1>(xr, K, grp, nb, yr, N); break;
      case 2: tile<F, 2>(xr, K, grp, nb, yr, N); break;
      case 3: tile<F, 3>(xr, K, grp, nb, yr, N); break;
      case 4: tile<F, 4>(xr, K, grp, nb, yr, N); break;
      default: tile<F, 5>(xr, K, grp, nb, yr, N); break;
    }
    r0 += c;
  }
}

template <class F>
at::Tensor qlinear(const at::Tensor& x_, const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(x_.scalar_type() == at::kFloat && x_.device().is_cpu(), "qlinear: x must be a float32 CPU tensor");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "qlinear: packed must be contiguous uint8");
  const at::Tensor x = x_.contiguous();
  const int64_t K = x.size(-1), M = K ? x.numel() / K : 0, nb = K / 32;
  TORCH_CHECK(K % 32 == 0 && N % G == 0 && packed.numel() == (N / G) * nb * F::BLK,
              "qlinear: shapes do not match the packed weight (K ", K, ", N ", N, ")");
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = N;
  at::Tensor y = at::empty(sizes, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  // threads split the output columns only, so no sum is ever split between threads
  at::parallel_for(0, N / G, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) group_rows<F>(xp, M, K, pp + g * nb * F::BLK, nb, yp + g * G, N);
  });
  return y;
}

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n) { return qlinear<Q4_1>(x, packed, n); }
at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n) { return qlinear<Q8_0>(x, packed, n); }

}  // namespace

TORCH_LIBRARY(specdec_q, lib) {
  lib.def("q4_1_linear(Tensor x, Tensor packed, int n) -> Tensor");
  lib.def("q8_0_linear(Tensor x, Tensor packed, int n) -> Tensor");
}
TORCH_LIBRARY_IMPL(specdec_q, CPU, lib) {
  lib.impl("q4_1_linear", &q4_1_linear);
  lib.impl("q8_0_linear", &q8_0_linear);
}
