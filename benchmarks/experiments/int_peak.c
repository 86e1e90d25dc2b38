/* The integer dot products' arithmetic peak of each kernels build on this CPU: the AVX2 build's
 * inner loop (vpmaddubsw into int16 sums of 4 quads, widened by vpmaddwd with ones: 72
 * instructions a 1024 multiply-adds, 8 activation rows against one weight vector) and the VNNI
 * build's (vpdpbusd on 512-bit registers, 8 rows), one thread, registers only (no memory
 * traffic): the most a multi-row product can reach, against which a verification step's extra
 * tokens are measured (docs/benchmarks.md, "What verifying T tokens costs").
 *
 *     gcc -O2 -mavx2 -mfma -mavx512f -mavx512bw -mavx512vnni benchmarks/experiments/int_peak.c -o /tmp/int_peak && /tmp/int_peak
 *     gcc -O2 -mavx2 -mfma -DNO_VNNI benchmarks/experiments/int_peak.c -o /tmp/int_peak && /tmp/int_peak   (an AVX2-only CPU)
 */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define ROWS 8
#define ITERS 50000000L

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
  __m256i w0 = _mm256_set1_epi8(3), w1 = _mm256_set1_epi8(5), w2 = _mm256_set1_epi8(7), w3 = _mm256_set1_epi8(9);
  __m256i x[ROWS], acc[ROWS];
  for (int i = 0; i < ROWS; i++) x[i] = _mm256_set1_epi32(0x01020304 + i), acc[i] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  double t0 = now();
  for (long it = 0; it < ITERS; it++) {
#pragma GCC unroll 8
    for (int i = 0; i < ROWS; i++) {
      __m256i p = _mm256_maddubs_epi16(w0, x[i]);
      p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w1, x[i]));
      p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w2, x[i]));
      p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w3, x[i]));
      acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(p, ones));
    }
    __asm__ volatile("" : "+x"(w0), "+x"(w1), "+x"(w2), "+x"(w3));  /* (no hoisting across iterations) */
  }
  double dt = now() - t0;
  int sink = 0;
  for (int i = 0; i < ROWS; i++) sink += _mm256_extract_epi32(acc[i], 0);
  printf("AVX2 vpmaddubsw + vpmaddwd: %.1f G multiply-adds/s, one thread (%d)\n", ITERS * ROWS * 4 * 32.0 / dt / 1e9, sink & 1);
#ifndef NO_VNNI
  __m512i v0 = _mm512_set1_epi8(3), v1 = _mm512_set1_epi8(5), v2 = _mm512_set1_epi8(7), v3 = _mm512_set1_epi8(9);
  __m512i xz[ROWS], az[ROWS], bz[ROWS];  /* (two chains a row: one chain's latency would bound it) */
  for (int i = 0; i < ROWS; i++) xz[i] = _mm512_set1_epi32(0x01020304 + i), az[i] = bz[i] = _mm512_setzero_si512();
  t0 = now();
  for (long it = 0; it < ITERS; it++) {
#pragma GCC unroll 8
    for (int i = 0; i < ROWS; i++) {
      az[i] = _mm512_dpbusd_epi32(az[i], v0, xz[i]);
      bz[i] = _mm512_dpbusd_epi32(bz[i], v1, xz[i]);
      az[i] = _mm512_dpbusd_epi32(az[i], v2, xz[i]);
      bz[i] = _mm512_dpbusd_epi32(bz[i], v3, xz[i]);
    }
    __asm__ volatile("" : "+v"(v0), "+v"(v1), "+v"(v2), "+v"(v3));
  }
  dt = now() - t0;
  for (int i = 0; i < ROWS; i++) sink += _mm512_reduce_add_epi32(_mm512_add_epi32(az[i], bz[i]));
  printf("VNNI vpdpbusd, 512-bit: %.1f G multiply-adds/s, one thread (%d)\n", ITERS * ROWS * 4 * 64.0 / dt / 1e9, sink & 1);
#endif
  return 0;
}
