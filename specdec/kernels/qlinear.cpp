// Matrix products that read a GGUF file's quantised blocks directly: y[M, N] = x[M, K] @ W^T with
// fp32 activations and fp32 sums, W stored as Q4_1 (w = d * q + m, q in 0..15) or Q8_0 (w = d * q,
// q in -128..127), one (d, m) per 32 weights along K. Each weight is rebuilt in fp32 exactly as the
// dequantised copy holds it (d * q is exact in fp32, so fma(q, d, m) rounds once, like d * q + m),
// so these are the same weights as the fp32 model's; only the order of the sums differs from
// oneDNN's. A decode step reads ~6 bits a weight instead of 32.
//
// Two layouts, two kernels (specdec/models/gguf_blocks.py packs both):
//  * K-major, for 1-2 rows (decoding): output rows in groups of G = 4; per group and 32-weight
//    block, Q4_1: float d[4], float m[4], uint8 q[4][16] (ggml's order: byte j holds weight j in
//    its low nibble and weight j + 16 in its high nibble); Q8_0: float d[4], int8 q[4][32]. A
//    vector holds 16 weights of one output; a Q4_1 block's 16 possible values are built once and
//    looked up by nibble. Each output: one 16-lane accumulator over the blocks (weights 0..15, then
//    16..31 of each), then a fixed pairwise reduction.
//  * N-major, for 3-16 rows (verifying drafts, small batches): tiles of TN = 16 outputs; per tile and
//    block, Q4_1: float d[16], float m[16], uint8 q[16][16] (q[i][c]: weight i of output c in the low
//    nibble, weight i + 16 in the high one); Q8_0: float d[16], int8 q[32][16]. A vector holds one
//    weight of 16 outputs, times a broadcast activation: no reduction at the end, and each weight
//    vector serves up to 8 rows. Each output: one sequential sum over k in the order
//    (0, 16, 1, 17, ..., 15, 31) of every block.
// Within a kernel every output is summed in one order whatever the number of rows and however rows
// and columns are split into passes and threads, so a row's result does not depend on the other
// rows in the call. The two kernels sum in different orders (results within ~1e-6 relative).
// Needs AVX-512 (F, BW, VL, DQ), AVX2 and FMA; built on first use by specdec/kernels/__init__.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

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

// f(r0, std::integral_constant<int, c>) for each pass of c rows starting at row r0: M rows in
// balanced passes of at most MAX (9 -> 5 + 4, 12 -> 6 + 6), the row count a compile-time constant
// for the tile kernels. A row's sums do not depend on its pass.
template <int N, class Fn>
inline void with_rows(int64_t c, Fn&& f) {
  if constexpr (N > 1) {
    if (c < N) return with_rows<N - 1>(c, f);
  }
  f(std::integral_constant<int, N>{});
}

template <int MAX, class Fn>
inline void row_passes(int64_t M, Fn&& f) {
  const int64_t passes = (M + MAX - 1) / MAX;
  int64_t r0 = 0;
  for (int64_t p = 0; p < passes; ++p) {
    const int64_t c = (M - r0) / (passes - p);
    with_rows<MAX>(c, [&](auto mt) { f(r0, mt); });
    r0 += c;
  }
}

template <class F>
void group_rows(const float* x, int64_t M, int64_t K, const uint8_t* grp, int64_t nb, float* y, int64_t N) {
  row_passes<MAX_ROWS_PER_PASS>(M, [&](int64_t r0, auto mt) {
    tile<F, decltype(mt)::value>(x + r0 * K, K, grp, nb, y + r0 * N, N);
  });
}

// One product's operands: x made contiguous, y allocated [..., N], the checks both layouts share.
struct Call {
  at::Tensor x, y;
  int64_t K, M, nb;
};

// unit: outputs a group / tile holds; blk: bytes per unit and 32-weight block
inline Call begin_call(const at::Tensor& x_, const at::Tensor& packed, int64_t N, int64_t unit, int64_t blk) {
  TORCH_CHECK(x_.scalar_type() == at::kFloat && x_.device().is_cpu(), "qlinear: x must be a float32 CPU tensor");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "qlinear: packed must be contiguous uint8");
  Call c;
  c.x = x_.contiguous();
  c.K = c.x.size(-1);
  c.M = c.K ? c.x.numel() / c.K : 0;
  c.nb = c.K / 32;
  TORCH_CHECK(c.K % 32 == 0 && N % unit == 0 && packed.numel() == (N / unit) * c.nb * blk,
              "qlinear: shapes do not match the packed weight (K ", c.K, ", N ", N, ")");
  std::vector<int64_t> sizes = c.x.sizes().vec();
  sizes.back() = N;
  c.y = at::empty(sizes, c.x.options());
  return c;
}

template <class F>
at::Tensor qlinear(const at::Tensor& x_, const at::Tensor& packed, int64_t N) {
  Call c = begin_call(x_, packed, N, G, F::BLK);
  const int64_t K = c.K, M = c.M, nb = c.nb;
  if (M == 0) return c.y;
  const float* xp = c.x.data_ptr<float>();
  float* yp = c.y.data_ptr<float>();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  // threads split the output columns only, so no sum is ever split between threads
  at::parallel_for(0, N / G, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) group_rows<F>(xp, M, K, pp + g * nb * F::BLK, nb, yp + g * G, N);
  });
  return c.y;
}

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n) { return qlinear<Q4_1>(x, packed, n); }
at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n) { return qlinear<Q8_0>(x, packed, n); }

// ---- N-major ------------------------------------------------------------------------------------
constexpr int TN = 16;            // outputs per tile (one vector)
constexpr int NV = 4;             // tiles a thread's unit of work covers (fewer for the last unit)
constexpr int MAX_ROWS_N = 8;     // 8 x 4 accumulators of 32 registers; more rows take more passes

struct Q4_1N {
  static constexpr int BLK = 64 + 64 + 256;
  struct Scales { __m512 d, m; };
  static inline Scales scales(const uint8_t* tb) {
    return {_mm512_loadu_ps(reinterpret_cast<const float*>(tb)), _mm512_loadu_ps(reinterpret_cast<const float*>(tb + 64))};
  }
  // weights i and i + 16 of the block, for the tile's 16 outputs
  static inline void weights(const uint8_t* tb, const Scales& s, int i, __m512& lo, __m512& hi) {
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tb + 128 + i * 16)));
    lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15))), s.d, s.m);
    hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), s.d, s.m);
  }
};

struct Q8_0N {
  static constexpr int BLK = 64 + 512;
  struct Scales { __m512 d; };
  static inline Scales scales(const uint8_t* tb) { return {_mm512_loadu_ps(reinterpret_cast<const float*>(tb))}; }
  static inline void weights(const uint8_t* tb, const Scales& s, int i, __m512& lo, __m512& hi) {
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(tb + 64 + i * 16));
    const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(tb + 64 + (i + 16) * 16));
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), s.d);
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), s.d);
  }
};

// rows 0..MT-1 of x against V consecutive tiles (tile stride ts bytes), outputs to y (row stride ldy)
template <class F, int MT, int V>
inline void ntile(const float* __restrict x, int64_t ldx, const uint8_t* __restrict tiles, int64_t nb, int64_t ts,
                  float* __restrict y, int64_t ldy) {
  __m512 acc[MT][V];
#pragma GCC unroll 8
  for (int r = 0; r < MT; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* tb[V];
    typename F::Scales sc[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      tb[v] = tiles + v * ts + b * F::BLK;
      sc[v] = F::scales(tb[v]);
      for (int c = 0; c < F::BLK; c += 64) _mm_prefetch(reinterpret_cast<const char*>(tb[v] + 2 * F::BLK + c), _MM_HINT_T0);
    }
    const float* xb = x + b * 32;
#pragma GCC unroll 2
    for (int i = 0; i < 16; ++i) {
      __m512 lo[V], hi[V];
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) F::weights(tb[v], sc[v], i, lo[v], hi[v]);
#pragma GCC unroll 8
      for (int r = 0; r < MT; ++r) {
        const __m512 xl = _mm512_set1_ps(xb[r * ldx + i]), xh = _mm512_set1_ps(xb[r * ldx + i + 16]);
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(hi[v], xh, _mm512_fmadd_ps(lo[v], xl, acc[r][v]));
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MT; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(y + r * ldy + v * TN, acc[r][v]);
}

template <class F, int V>
void nrows(const float* x, int64_t M, int64_t K, const uint8_t* tiles, int64_t nb, int64_t ts, float* y, int64_t N) {
  row_passes<MAX_ROWS_N>(M, [&](int64_t r0, auto mt) {
    ntile<F, decltype(mt)::value, V>(x + r0 * K, K, tiles, nb, ts, y + r0 * N, N);
  });
}

template <class F>
at::Tensor qlinear_n(const at::Tensor& x_, const at::Tensor& packed, int64_t N) {
  Call c = begin_call(x_, packed, N, TN, F::BLK);
  const int64_t K = c.K, M = c.M, nb = c.nb, T = N / TN;
  if (M == 0) return c.y;
  const float* xp = c.x.data_ptr<float>();
  float* yp = c.y.data_ptr<float>();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const int64_t ts = nb * F::BLK;
  at::parallel_for(0, (T + NV - 1) / NV, 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t t0 = u * NV, t1 = std::min<int64_t>(T, t0 + NV);
      if (t1 - t0 == NV) {
        nrows<F, NV>(xp, M, K, pp + t0 * ts, nb, ts, yp + t0 * TN, N);
      } else {
        for (int64_t t = t0; t < t1; ++t) nrows<F, 1>(xp, M, K, pp + t * ts, nb, ts, yp + t * TN, N);
      }
    }
  });
  return c.y;
}

at::Tensor q4_1_linear_n(const at::Tensor& x, const at::Tensor& packed, int64_t n) { return qlinear_n<Q4_1N>(x, packed, n); }
at::Tensor q8_0_linear_n(const at::Tensor& x, const at::Tensor& packed, int64_t n) { return qlinear_n<Q8_0N>(x, packed, n); }

// ---- integer dot products (AVX-512 VNNI) ------------------------------------------------------------
// The activations quantised too, as llama.cpp computes with these blocks: per row and 32-value block,
// a = da * qa with da = max |x| / 127 and qa = round(x / da) in -127..127 (float32 scale). Then each
// block's dot product is exact in int32 (vpdpbusd: unsigned weight bytes times signed activation
// bytes), and the float sum over blocks runs in block order:
//   Q4_1: y += float(sum q qa) * (dw * da) + mw * (da * sum qa)
//   Q8_0: y += float(sum (q + 128) qa - 128 sum qa) * (dw * da)
// A row's result depends only on that row (integer sums have no order), for every row count, so
// one kernel serves 1-16 rows and a verified token's projections equal decoding it alone bit for
// bit. Layout (gguf_blocks._pack_*_v), tiles of 16 outputs; per tile and block, Q4_1: float16 d[16],
// float16 m[16], then 4 x 64 bytes, byte 4j + t of vector h holding weight 4h + t of output j in its
// low nibble and weight 16 + 4h + t in its high one; Q8_0: float16 d[16], then 8 x 64 bytes, byte
// 4j + t of vector g = weight 4g + t of output j, plus 128. (The scales are a GGUF's own, exact in
// float16: 320 / 544 bytes a block instead of 384 / 576 with float32 ones, and a decoding step's
// products stream their blocks from memory.)
constexpr int MAX_ROWS_V = 16;  // one accumulator a row: 16 rows + 8 weight vectors fit the 32 registers

struct ActQ {  // one call's quantised activations: per row and block, 32 high (and low) bytes, da, da * sum qa, sum qa
  std::vector<int8_t> hi, lo;
  std::vector<float> d, s;
  std::vector<int32_t> sum;
};

// WIDE = false: qa = round(x * 127 / max|x|), one byte (hi). WIDE = true: qa = round(x * 32512 /
// max|x|) (~15 bits), split qa = 256 hi + lo with hi = floor((qa + 128) / 256) in -127..127 and lo
// in -128..127, so that sum w qa = 256 sum w hi + sum w lo, exactly, from two byte products.
template <bool WIDE>
void quantize_rows(const float* x, int64_t M, int64_t K, ActQ& a) {
  constexpr float QMAX = WIDE ? 32512.0f : 127.0f;
  const int64_t nb = K / 32;
  a.hi.resize(M * K);
  if (WIDE) a.lo.resize(M * K);
  a.d.resize(M * nb);
  a.s.resize(M * nb);
  a.sum.resize(M * nb);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t o = r * K + b * 32;
      const __m512 x0 = _mm512_loadu_ps(x + o), x1 = _mm512_loadu_ps(x + o + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
      const float d = amax / QMAX;
      const __m512 id = _mm512_set1_ps(amax > 0.0f ? QMAX / amax : 0.0f);
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, id));  // round to nearest even
      const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, id));
      if (WIDE) {
        const __m512i h0 = _mm512_srai_epi32(_mm512_add_epi32(q0, _mm512_set1_epi32(128)), 8);
        const __m512i h1 = _mm512_srai_epi32(_mm512_add_epi32(q1, _mm512_set1_epi32(128)), 8);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(&a.hi[o]), _mm512_cvtepi32_epi8(h0));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(&a.hi[o + 16]), _mm512_cvtepi32_epi8(h1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(&a.lo[o]), _mm512_cvtepi32_epi8(_mm512_sub_epi32(q0, _mm512_slli_epi32(h0, 8))));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(&a.lo[o + 16]), _mm512_cvtepi32_epi8(_mm512_sub_epi32(q1, _mm512_slli_epi32(h1, 8))));
      } else {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(&a.hi[o]), _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(&a.hi[o + 16]), _mm512_cvtsepi32_epi8(q1));
      }
      const int32_t sq = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
      a.d[r * nb + b] = d;
      a.sum[r * nb + b] = sq;
      a.s[r * nb + b] = d * static_cast<float>(sq);
    }
}

struct Q4_1V {
  static constexpr int BLK = 32 + 32 + 256;
  static inline void weights(const uint8_t* tb, __m512i* w) {
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
    for (int h = 0; h < 4; ++h) {
      const __m512i p = _mm512_loadu_si512(tb + 64 + 64 * h);
      w[h] = _mm512_and_si512(p, lo4);
      w[h + 4] = _mm512_and_si512(_mm512_srli_epi16(p, 4), lo4);
    }
  }
  static inline __m512 finish(__m512i is, const uint8_t* tb, __m512 acc, float da, float sa, int32_t) {
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tb)));
    const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tb + 32)));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(dw, _mm512_set1_ps(da)), acc);
    return _mm512_fmadd_ps(mw, _mm512_set1_ps(sa), acc);
  }
};

struct Q8_0V {
  static constexpr int BLK = 32 + 512;
  static inline void weights(const uint8_t* tb, __m512i* w) {
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) w[g] = _mm512_loadu_si512(tb + 32 + 64 * g);
  }
  static inline __m512 finish(__m512i is, const uint8_t* tb, __m512 acc, float da, float, int32_t sum) {
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tb)));
    is = _mm512_sub_epi32(is, _mm512_set1_epi32(128 * sum));  // the weights' +128
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(dw, _mm512_set1_ps(da)), acc);
  }
};

// sum over the block of w times the activation bytes qa (8 groups of 4), in two chains
__attribute__((target("avx512vnni"))) inline __m512i dot8(const __m512i* w, const int32_t* qa) {
  __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], _mm512_set1_epi32(qa[0]));
  __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], _mm512_set1_epi32(qa[1]));
  s0 = _mm512_dpbusd_epi32(s0, w[2], _mm512_set1_epi32(qa[2]));
  s1 = _mm512_dpbusd_epi32(s1, w[3], _mm512_set1_epi32(qa[3]));
  s0 = _mm512_dpbusd_epi32(s0, w[4], _mm512_set1_epi32(qa[4]));
  s1 = _mm512_dpbusd_epi32(s1, w[5], _mm512_set1_epi32(qa[5]));
  s0 = _mm512_dpbusd_epi32(s0, w[6], _mm512_set1_epi32(qa[6]));
  s1 = _mm512_dpbusd_epi32(s1, w[7], _mm512_set1_epi32(qa[7]));
  return _mm512_add_epi32(s0, s1);
}

// rows r0..r0+MT-1 of the quantised activations against one tile of nb blocks
template <class F, bool WIDE, int MT>
__attribute__((target("avx512vnni"))) inline void vtile(const ActQ& a, int64_t r0, int64_t K, const uint8_t* __restrict tile,
                                                       int64_t nb, float* __restrict y, int64_t ldy) {
  __m512 acc[MT];
#pragma GCC unroll 16
  for (int r = 0; r < MT; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* tb = tile + b * F::BLK;
    // 12 blocks ahead (~4-6.5 KB, into the next tiles; a prefetch never faults past the end): 4 ahead
    // left multi-row steps waiting on memory (kernel_ab.py products: 2-9-token steps 1.05-1.08x)
    for (int c = 0; c < F::BLK; c += 64) _mm_prefetch(reinterpret_cast<const char*>(tb + 12 * F::BLK + c), _MM_HINT_T0);
    __m512i w[8];
    F::weights(tb, w);
#pragma GCC unroll 16
    for (int r = 0; r < MT; ++r) {
      const int64_t o = (r0 + r) * K + b * 32, i = (r0 + r) * nb + b;
      __m512i is = dot8(w, reinterpret_cast<const int32_t*>(&a.hi[o]));
      if (WIDE) is = _mm512_add_epi32(_mm512_slli_epi32(is, 8), dot8(w, reinterpret_cast<const int32_t*>(&a.lo[o])));
      acc[r] = F::finish(is, tb, acc[r], a.d[i], a.s[i], a.sum[i]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MT; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

template <class F, bool WIDE>
void vrows(const ActQ& a, int64_t M, int64_t K, const uint8_t* tile, int64_t nb, float* y, int64_t N) {
  row_passes<MAX_ROWS_V>(M, [&](int64_t r0, auto mt) {
    vtile<F, WIDE, decltype(mt)::value>(a, r0, K, tile, nb, y + r0 * N, N);
  });
}

template <class F, bool WIDE>
at::Tensor qlinear_v(const at::Tensor& x_, const at::Tensor& packed, int64_t N) {
  Call c = begin_call(x_, packed, N, TN, F::BLK);
  const int64_t K = c.K, M = c.M, nb = c.nb, T = N / TN;
  if (M == 0) return c.y;
  ActQ a;
  quantize_rows<WIDE>(c.x.data_ptr<float>(), M, K, a);
  float* yp = c.y.data_ptr<float>();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const int64_t ts = nb * F::BLK;
  at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) vrows<F, WIDE>(a, M, K, pp + t * ts, nb, yp + t * TN, N);
  });
  return c.y;
}

at::Tensor q4_1_linear_v(const at::Tensor& x, const at::Tensor& packed, int64_t n) { return qlinear_v<Q4_1V, false>(x, packed, n); }
at::Tensor q8_0_linear_v(const at::Tensor& x, const at::Tensor& packed, int64_t n) { return qlinear_v<Q8_0V, false>(x, packed, n); }
at::Tensor q4_1_linear_w(const at::Tensor& x, const at::Tensor& packed, int64_t n) { return qlinear_v<Q4_1V, true>(x, packed, n); }
at::Tensor q8_0_linear_w(const at::Tensor& x, const at::Tensor& packed, int64_t n) { return qlinear_v<Q8_0V, true>(x, packed, n); }

// ---- attention for a few new tokens over a KV cache ----------------------------------------------
// exp(x) for x <= 0 (scores minus their maximum); exactly 0 where x is -inf (a masked key), so masked
// keys add exact zeros to every sum. Cephes' polynomial on [-ln2/2, ln2/2], then scale by 2^n.
inline __m512 exp_nonpos(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

// The dot products of query q (NV vectors) with keys 0..15 of K (rows of 16 NV floats; keys n..15
// count as zero vectors and are not read): lane i of the result is key i's score. Each key's 16
// partial sums (one product, then NV - 1 fused steps, as a lone query's) are added in one fixed
// tree whatever the key's place among the 16 (pairs of lanes 2 apart within each 128-bit lane,
// then 1 apart, then the 128-bit lanes in pairs 0+1 and 2+3, then both halves), so a key's score
// depends only on it and the query: the transposed reduction of 16 keys costs ~3 operations a
// key where a reduction of each key alone costs ~8.
template <int NV>
inline __m512 scores16(const __m512* q, const float* K, int n) {
  constexpr int64_t Dh = 16 * NV;
  auto dot = [&](int i) {
    if (i >= n) return _mm512_setzero_ps();
    const float* k = K + i * Dh;
    __m512 acc = _mm512_mul_ps(q[0], _mm512_loadu_ps(k));
#pragma GCC unroll 8
    for (int d = 1; d < NV; ++d) acc = _mm512_fmadd_ps(q[d], _mm512_loadu_ps(k + 16 * d), acc);
    return acc;
  };
  __m512 s[8];  // s[m]: keys 2m, 2m + 1 as [a0+a2, b0+b2, a1+a3, b1+b3] in each 128-bit lane
#pragma GCC unroll 8
  for (int m = 0; m < 8; ++m) {
    const __m512 a = dot(2 * m), b = dot(2 * m + 1);
    s[m] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  __m512 t[4];  // t[m]: keys 4m..4m+3, one partial sum each per 128-bit lane
#pragma GCC unroll 4
  for (int m = 0; m < 4; ++m)
    t[m] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * m], s[2 * m + 1], 0x44), _mm512_shuffle_ps(s[2 * m], s[2 * m + 1], 0xEE));
  const __m512 e = _mm512_add_ps(_mm512_shuffle_f32x4(t[0], t[1], 0x88), _mm512_shuffle_f32x4(t[0], t[1], 0xDD));
  const __m512 f = _mm512_add_ps(_mm512_shuffle_f32x4(t[2], t[3], 0x88), _mm512_shuffle_f32x4(t[2], t[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e, f, 0x88), _mm512_shuffle_f32x4(e, f, 0xDD));
}

// NQ queries of one K/V head (vectors qv, mask rows mrow or null, outputs dst) over its first S keys
// K and values V: one pass over the keys and one over the values serve them all, and each query runs
// exactly the ops it runs alone (NQ = 1), so its numbers do not depend on the others in the pass.
// Dh = 16 * NV; sc: NQ score rows of S16 floats.
template <int NQ, int NV>
void attend_queries(const float* const* qv, const float* const* mrow, float* const* dst, const float* K, const float* V,
                    int64_t S, int64_t S16, float scale, float* sc) {
  constexpr int64_t Dh = 16 * NV;
  __m512 q[NQ][NV];
#pragma GCC unroll 6
  for (int j = 0; j < NQ; ++j)
#pragma GCC unroll 8
    for (int d = 0; d < NV; ++d) q[j][d] = _mm512_loadu_ps(qv[j] + 16 * d);
  // scores 16 keys at a time (the block's first query reads them from memory, the others from L1)
  for (int64_t s0 = 0; s0 < S; s0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, S - s0));
    const __mmask16 live = static_cast<__mmask16>(n == 16 ? 0xFFFFu : (1u << n) - 1u);
#pragma GCC unroll 6
    for (int j = 0; j < NQ; ++j) {
      const __m512 r = _mm512_mul_ps(scores16<NV>(q[j], K + s0 * Dh, n), _mm512_set1_ps(scale));
      const __m512 m = mrow[j] ? _mm512_maskz_loadu_ps(live, mrow[j] + s0) : _mm512_setzero_ps();
      _mm512_storeu_ps(sc + j * S16 + s0, _mm512_mask_blend_ps(live, _mm512_set1_ps(-INFINITY), _mm512_add_ps(r, m)));
    }
  }
  for (int j = 0; j < NQ; ++j) {
    float* r = sc + j * S16;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t s = 0; s < S16; s += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(r + s));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    for (int64_t s = 0; s < S16; s += 16) _mm512_storeu_ps(r + s, exp_nonpos(_mm512_sub_ps(_mm512_loadu_ps(r + s), m)));
  }
  // one pass over the values: the weighted sums, and the denominators in slot order beside them (a
  // scalar chain the value chains' latency hides). Hidden slots add exact zeros wherever they sit,
  // so a tree node's sums equal the sums over its path compacted into consecutive slots (as decoded
  // alone)
  __m512 o[NQ][NV];
  float l[NQ];
#pragma GCC unroll 6
  for (int j = 0; j < NQ; ++j) {
    l[j] = 0.0f;
#pragma GCC unroll 8
    for (int d = 0; d < NV; ++d) o[j][d] = _mm512_setzero_ps();
  }
  for (int64_t s = 0; s < S; ++s) {
    __m512 v[NV];
#pragma GCC unroll 8
    for (int d = 0; d < NV; ++d) v[d] = _mm512_loadu_ps(V + s * Dh + 16 * d);
#pragma GCC unroll 6
    for (int j = 0; j < NQ; ++j) {
      const float w = sc[j * S16 + s];
      l[j] += w;
      const __m512 p = _mm512_set1_ps(w);
#pragma GCC unroll 8
      for (int d = 0; d < NV; ++d) o[j][d] = _mm512_fmadd_ps(p, v[d], o[j][d]);
    }
  }
#pragma GCC unroll 6
  for (int j = 0; j < NQ; ++j) {
    const __m512 iv = _mm512_set1_ps(1.0f / l[j]);
#pragma GCC unroll 8
    for (int d = 0; d < NV; ++d) _mm512_storeu_ps(dst[j] + 16 * d, _mm512_mul_ps(o[j][d], iv));
  }
}

template <int NV>
void attend_chunk(int64_t nq, const float* const* qv, const float* const* mrow, float* const* dst, const float* K,
                  const float* V, int64_t S, int64_t S16, float scale, float* sc) {
  switch (nq) {
    case 1: attend_queries<1, NV>(qv, mrow, dst, K, V, S, S16, scale, sc); break;
    case 2: attend_queries<2, NV>(qv, mrow, dst, K, V, S, S16, scale, sc); break;
    case 3: attend_queries<3, NV>(qv, mrow, dst, K, V, S, S16, scale, sc); break;
    case 4: attend_queries<4, NV>(qv, mrow, dst, K, V, S, S16, scale, sc); break;
    case 5: attend_queries<5, NV>(qv, mrow, dst, K, V, S, S16, scale, sc); break;
    default: attend_queries<6, NV>(qv, mrow, dst, K, V, S, S16, scale, sc); break;
  }
}

// out[b, G h + g, t] = softmax(q . k / sqrt(Dh) + mask) @ v over the first S cache slots, for every
// query head of a K/V head (grouped-query attention). mask: None (every slot visible) or additive
// [B, 1, G * T, S] (row g * T + t: token t of query head g; -inf = hidden), the layout
// models/llama.py builds. A query's result depends only on its own vector and the visible keys and
// values in slot order: each score is one fixed-order dot product, the maximum is exact, and every
// sum runs over the slots in order, hidden slots adding exact zeros. So a token verified among
// others (a chain or a tree node) attends exactly as it does decoded alone. Head sizes 16, 32, 64
// and 128 (ATTEND_HEAD_SIZES in models/llama.py; others: an error).
// The attention core: q [B, H, T, Dh] contiguous; out written at out + ((b * so_b + t * so_t + qh * so_h) * Dh)
void attention_core(const float* qp, int64_t B, int64_t H, int64_t T, int64_t Dh, const float* kp, const float* vp,
                    int64_t Hkv, int64_t Smax, int64_t S, const float* mp, float* op, int64_t so_b, int64_t so_t,
                    int64_t so_h) {
  constexpr int64_t QC = 6;  // queries of one K/V head that share a pass over its keys and values
  TORCH_CHECK(Dh == 16 || Dh == 32 || Dh == 64 || Dh == 128, "attend: head size ", Dh, " (the kernel takes 16, 32, 64, 128)");
  const int64_t G = H / Hkv, GT = G * T;
  const float scale = 1.0f / std::sqrt(static_cast<float>(Dh));
  const int64_t S16 = (S + 15) / 16 * 16;
  // work items: (row, K/V head, chunk of its G * T queries): chunks as large as leave every thread
  // about two items (a chunk's queries share each read of its head's keys and values; a one-token
  // step of a 3-query head on two threads: 3 items, 13-35% less time than one query an item)
  const int64_t want = 2 * at::get_num_threads();
  const int64_t most = std::max<int64_t>(1, std::min<int64_t>(QC, (B * Hkv * GT + want - 1) / want));
  const int64_t chunks = (GT + most - 1) / most;
  const int64_t qc = (GT + chunks - 1) / chunks;  // the same chunks, their sizes balanced (6 queries: 3 + 3, not 5 + 1)
  at::parallel_for(0, B * Hkv * chunks, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> scv(QC * S16);
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t c = w % chunks, bh = w / chunks, b = bh / Hkv, h = bh % Hkv;
      const int64_t i0 = c * qc, nq = std::min(qc, GT - i0);
      const float* qv[QC];
      const float* mrow[QC];
      float* dst[QC];
      for (int64_t j = 0; j < nq; ++j) {
        const int64_t i = i0 + j, g = i / T, t = i % T;
        qv[j] = qp + ((b * H + h * G + g) * T + t) * Dh;
        mrow[j] = mp ? mp + (b * G * T + i) * S : nullptr;
        dst[j] = op + (b * so_b + t * so_t + (h * G + g) * so_h) * Dh;
      }
      const float* K = kp + (b * Hkv + h) * Smax * Dh;
      const float* V = vp + (b * Hkv + h) * Smax * Dh;
      if (Dh == 64) attend_chunk<4>(nq, qv, mrow, dst, K, V, S, S16, scale, scv.data());
      else if (Dh == 128) attend_chunk<8>(nq, qv, mrow, dst, K, V, S, S16, scale, scv.data());
      else if (Dh == 32) attend_chunk<2>(nq, qv, mrow, dst, K, V, S, S16, scale, scv.data());
      else attend_chunk<1>(nq, qv, mrow, dst, K, V, S, S16, scale, scv.data());
    }
  });
}

const float* mask_ptr(const c10::optional<at::Tensor>& mask, int64_t B, int64_t rows, int64_t S) {
  if (!mask.has_value()) return nullptr;
  const at::Tensor& m = *mask;
  TORCH_CHECK(m.scalar_type() == at::kFloat && m.is_contiguous() && m.size(0) == B && m.size(2) == rows && m.size(3) == S,
              "attend: the mask must be [B, 1, G*T, S] float32");
  return m.data_ptr<float>();
}

at::Tensor attend(const at::Tensor& q_, const at::Tensor& kc, const at::Tensor& vc, int64_t S,
                  const c10::optional<at::Tensor>& mask_) {
  TORCH_CHECK(q_.scalar_type() == at::kFloat && kc.scalar_type() == at::kFloat && vc.scalar_type() == at::kFloat,
              "attend: float32 only");
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous(), "attend: the cache must be contiguous");
  const at::Tensor q = q_.contiguous();
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), Dh = q.size(3);
  const int64_t Hkv = kc.size(1), Smax = kc.size(2);
  TORCH_CHECK(Dh % 16 == 0 && H % Hkv == 0 && S >= 1 && S <= Smax && kc.size(3) == Dh, "attend: bad shapes");
  const float* mp = mask_ptr(mask_, B, (H / Hkv) * T, S);
  at::Tensor out = at::empty({B, H, T, Dh}, q.options());
  attention_core(q.data_ptr<float>(), B, H, T, Dh, kc.data_ptr<float>(), vc.data_ptr<float>(), Hkv, Smax, S, mp,
                 out.data_ptr<float>(), H * T, 1, T);
  return out;
}

// One decoding step's attention from the fused projection qkv [B, T, (H + 2 Hkv) Dh]: rotate q and k
// (x * cos + roll(x, Dh / 2) * sin, a product, a product and a sum as models/llama.py computes it,
// with its signed sin [B, T, 1, Dh]), write k and v to the cache at slots start[b] + t, attend over
// the first S slots (attention_core) and return [B, T, H Dh], the layout the output projection reads.
// The same numbers as that Python path, in one call instead of a dozen.
at::Tensor rope_attend(const at::Tensor& qkv_, const at::Tensor& cos_, const at::Tensor& sin_, at::Tensor kc, at::Tensor vc,
                       const at::Tensor& start_, int64_t H, int64_t S, const c10::optional<at::Tensor>& mask_) {
  TORCH_CHECK(qkv_.scalar_type() == at::kFloat && kc.scalar_type() == at::kFloat && cos_.scalar_type() == at::kFloat,
              "rope_attend: float32 only");
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous(), "rope_attend: the cache must be contiguous");
  const at::Tensor qkv = qkv_.contiguous(), cs = cos_.contiguous(), sn = sin_.contiguous();
  const at::Tensor start = start_.to(at::kLong).contiguous();
  const int64_t B = qkv.size(0), T = qkv.size(1), Hkv = kc.size(1), Smax = kc.size(2), Dh = kc.size(3);
  TORCH_CHECK(Dh % 32 == 0 && H % Hkv == 0 && qkv.size(2) == (H + 2 * Hkv) * Dh && cs.numel() == B * T * Dh &&
              start.numel() == B && S >= 1 && S <= Smax, "rope_attend: bad shapes");
  const float* mp = mask_ptr(mask_, B, (H / Hkv) * T, S);
  at::Tensor q = at::empty({B, H, T, Dh}, qkv.options());
  const float* xp = qkv.data_ptr<float>();
  const float* cp = cs.data_ptr<float>();
  const float* sp = sn.data_ptr<float>();
  const int64_t* st = start.data_ptr<int64_t>();
  float* qp = q.data_ptr<float>();
  float* kp = kc.data_ptr<float>();
  float* vp = vc.data_ptr<float>();
  const int64_t half = Dh / 2, W = (H + 2 * Hkv) * Dh;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const float* row = xp + (b * T + t) * W;
      const float* c = cp + (b * T + t) * Dh;
      const float* sg = sp + (b * T + t) * Dh;
      const int64_t slot = st[b] + t;
      TORCH_CHECK(slot < Smax, "rope_attend: the cache is full");
      for (int64_t j = 0; j < H + Hkv; ++j) {
        const float* x = row + j * Dh;
        float* dst = j < H ? qp + ((b * H + j) * T + t) * Dh : kp + ((b * Hkv + (j - H)) * Smax + slot) * Dh;
        for (int64_t d = 0; d < Dh; d += 16) {
          const int64_t dr = (d + half) % Dh;  // roll by Dh / 2: element d takes x[(d + Dh / 2) mod Dh]
          const __m512 a = _mm512_mul_ps(_mm512_loadu_ps(x + d), _mm512_loadu_ps(c + d));
          const __m512 r = _mm512_mul_ps(_mm512_loadu_ps(x + dr), _mm512_loadu_ps(sg + d));
          _mm512_storeu_ps(dst + d, _mm512_add_ps(a, r));
        }
      }
      for (int64_t j = 0; j < Hkv; ++j)
        std::memcpy(vp + ((b * Hkv + j) * Smax + slot) * Dh, row + (H + Hkv + j) * Dh, Dh * sizeof(float));
    }
  at::Tensor out = at::empty({B, T, H * Dh}, qkv.options());
  attention_core(qp, B, H, T, Dh, kp, vp, Hkv, Smax, S, mp, out.data_ptr<float>(), T * H, H, 1);
  return out;
}

// silu(gate) * up of the fused projection gu [..., 2 I] (torch's silu, so the numbers the Python path
// gives), in one call
at::Tensor silu_mul(const at::Tensor& gu) {
  const int64_t I = gu.size(-1) / 2;
  return at::silu(gu.narrow(-1, 0, I)).mul_(gu.narrow(-1, I, I));
}

// ---- RMS norm of a few rows ------------------------------------------------------------------
// y = x / sqrt(mean(x^2) + eps) * w per row of x [..., D]: the sum of squares in 16 lanes then a fixed
// reduction, so a row's result does not depend on the other rows. For decoding steps, where torch's
// composite rms_norm costs ~15 us a call.
at::Tensor rms_norm(const at::Tensor& x_, const at::Tensor& w, double eps) {
  TORCH_CHECK(x_.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && w.is_contiguous(), "rms_norm: float32 only");
  const at::Tensor x = x_.contiguous();
  const int64_t D = x.size(-1), M = D ? x.numel() / D : 0;
  TORCH_CHECK(D % 16 == 0 && w.numel() == D, "rms_norm: the width must be a multiple of 16 and match the weight");
  at::Tensor y = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t r = 0; r < M; ++r) {
    const float* xr = xp + r * D;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 v = _mm512_loadu_ps(xr + d);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(hsum16(acc) / static_cast<float>(D) + static_cast<float>(eps)));
    for (int64_t d = 0; d < D; d += 16)
      _mm512_storeu_ps(yp + r * D + d, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(xr + d), inv), _mm512_loadu_ps(wp + d)));
  }
  return y;
}

// The index of a row's maximum as torch.argmax gives it: the first maximum; the first NaN if the
// row holds one (NaN counts as the largest); 0 for a row of -inf. Per lane the first index of that
// lane's maximum (a strict > only ever moves it forward), then the least index among the lanes
// holding the row's maximum.
int64_t row_argmax(const float* p, int64_t V) {
  __m512 best = _mm512_set1_ps(-INFINITY);
  __m512i at = _mm512_setzero_si512();
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = 0;
  for (int64_t i = 0; i < V; i += 16) {
    const __mmask16 live = V - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (V - i)) - 1u);
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, p + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, gt, v);
    at = _mm512_mask_mov_epi32(at, gt, idx);
    idx = _mm512_add_epi32(idx, step);
  }
  if (nan) {
    for (int64_t i = 0; i < V; ++i)
      if (std::isnan(p[i])) return i;
  }
  const float m = _mm512_reduce_max_ps(best);
  const __mmask16 top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ);
  return _mm512_mask_reduce_min_epi32(top, at);
}

// argmax over the last dimension of float32 x [..., V] (int64 [...]), row_argmax per row; rows
// split over threads. For greedy decoding and verification: over the default model's 49152-token
// vocabulary torch's argmax took 29 / 86 / 143 us for 1 / 5 / 9 rows here, this 7.5 / 21 / 34 us.
at::Tensor argmax_rows(const at::Tensor& x_) {
  TORCH_CHECK(x_.scalar_type() == at::kFloat && x_.dim() >= 1 && x_.size(-1) > 0 && x_.size(-1) < (1LL << 31),
              "argmax_rows: float32 rows of 1 .. 2^31 - 1 values");
  const at::Tensor x = x_.contiguous();
  const int64_t V = x.size(-1), R = x.numel() / V;
  at::Tensor out = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kLong));
  const float* p = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) o[r] = row_argmax(p + r * V, V);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(specdec_q, lib) {
  lib.def("q4_1_linear(Tensor x, Tensor packed, int n) -> Tensor");
  lib.def("q8_0_linear(Tensor x, Tensor packed, int n) -> Tensor");
  lib.def("q4_1_linear_n(Tensor x, Tensor packed, int n) -> Tensor");
  lib.def("q8_0_linear_n(Tensor x, Tensor packed, int n) -> Tensor");
  lib.def("q4_1_linear_v(Tensor x, Tensor packed, int n) -> Tensor");
  lib.def("q8_0_linear_v(Tensor x, Tensor packed, int n) -> Tensor");
  lib.def("q4_1_linear_w(Tensor x, Tensor packed, int n) -> Tensor");
  lib.def("q8_0_linear_w(Tensor x, Tensor packed, int n) -> Tensor");
  lib.def("attend(Tensor q, Tensor k_cache, Tensor v_cache, int n_keys, Tensor? mask) -> Tensor");
  lib.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  lib.def("rope_attend(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor start, int heads, "
          "int n_keys, Tensor? mask) -> Tensor");
  lib.def("silu_mul(Tensor gu) -> Tensor");
  lib.def("argmax_rows(Tensor x) -> Tensor");
}
TORCH_LIBRARY_IMPL(specdec_q, CPU, lib) {
  lib.impl("q4_1_linear", &q4_1_linear);
  lib.impl("q8_0_linear", &q8_0_linear);
  lib.impl("q4_1_linear_n", &q4_1_linear_n);
  lib.impl("q8_0_linear_n", &q8_0_linear_n);
  lib.impl("q4_1_linear_v", &q4_1_linear_v);
  lib.impl("q8_0_linear_v", &q8_0_linear_v);
  lib.impl("q4_1_linear_w", &q4_1_linear_w);
  lib.impl("q8_0_linear_w", &q8_0_linear_w);
  lib.impl("attend", &attend);
  lib.impl("rms_norm", &rms_norm);
  lib.impl("rope_attend", &rope_attend);
  lib.impl("silu_mul", &silu_mul);
  lib.impl("argmax_rows", &argmax_rows);
}
