// Row-stable float32 kernels for x86 CPUs with AVX2 and FMA, where every model computes its decoding
// steps: matrix products (over fp32 weights, over Q4_1 / Q8_0 blocks repacked K-major with the same
// numbers, or straight over a GGUF tensor's own bytes), RMS norm, attention, and rotation + cache
// write + attention.
//
// Why: speculative greedy text must equal plain greedy text. A verification computes a guessed
// token as one row among several (a chain, a tree, a batch), plain decoding computes it alone.
// oneDNN and torch's reductions pick their kernels and blockings by the number of rows, so a
// token's sums run in another order in the two (within ~2.5e-4 on the default model's logits),
// and a near-tie between two tokens can then part the texts. Here every output number is computed
// by one fixed sequence of operations that depends only on its own row's inputs and the shapes of
// the weights, never on how many other rows share the call or on how the threads split the work:
// - linear: out[m, n] = one 8-lane FMA chain over k in order (x[m, k:k+8] * w[n, k:k+8]), then a
//   fixed horizontal sum (hsum8), then the k % 8 tail in order;
// - rms_norm: the same 8-lane sum of squares per row;
// - attention: per query, scores as 8-lane dot products in slot order, an exact maximum, exp by one
//   polynomial (exactly 0 for hidden slots), and the weighted sum of values over the slots in order.
//   Hidden slots add exact zeros, so a tree node or chain token attends exactly as it does decoded
//   alone, and a row may stop at its own last visible slot (row_keys) with the same result.
// The numbers are not those of oneDNN or torch: a model computes its decoding steps here and its
// long prefills (shared by every decoding method) through oneDNN (models/llama.py decides).
//
// Built with -mavx2 -mfma -ffp-contract=off: a product and a sum written as two operations stay two
// roundings, so the rotation gives the numbers of the torch expression models/llama.py uses. On CPUs
// with AVX-512 VNNI, VL and BW it is built a second way, with those flags too (kernels/__init__.py,
// rowstable_ops): the 8-bit-activation integer dot products then take _mm256_dpbusd_epi32 (ROWSTABLE_VNNI)
// where the AVX2 build takes _mm256_maddubs_epi16 + _mm256_madd_epi16, and every int32 lane that
// reaches the float arithmetic holds the same exact integer in both, so the two builds give the same
// numbers bit for bit (tests/unit/test_vnni.py). The VNNI build (AVX-512F) also multiplies steps of
// several tokens by two weight rows at a time on 512-bit registers (kz_pass for the K-quants, iz_tile
// for the 32-weight block types, bz_tile for the repacked Q4_1 / Q8_0 blocks): each weight block is
// decoded once for up to 6-8 activation rows, and every lane runs the operations of the 256-bit code
// on the same numbers, so those tiles too give each row its numbers alone (tests/unit/test_multirow.py);
// everything else is the same source. q4_1_linear_q8 / q8_0_linear_q8 (at the end of this file) take
// the 32-weight block types repacked in groups of 16 outputs on 8-bit activations: lane n is output n
// in both builds (16 a register on VNNI, 8 on AVX2), with the same integer and float operations;
// kq_linear_q8 (after them) takes Q4_K / Q5_K / Q6_K blocks repacked the same way, a sub-block's scale one
// float operation for 16 outputs.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <pthread.h>
#include <sched.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define ROWSTABLE_VNNI 1
#else
#define ROWSTABLE_VNNI 0
#endif

namespace {

// ---------------------------------------------------------------------------------------------
// The kernels' threads: a pool whose caller never waits for a thread that has not started.
//
// An OpenMP region (at::parallel_for) ends when every thread of its team has arrived, so a thread
// that the OS has not run yet (its core busy with another process) stalls the call until it runs,
// even where the caller has already done all the work. A decode step is a few hundred such calls.
// Here the calling thread is participant 0 of every call; the pool's workers join a call while it
// is open and take tasks as the call's own rules give them (shared_tasks: each its share, then the
// others'). When the caller runs out of tasks it closes the call: a worker that had not joined by
// then never does, and the caller waits only for those that joined (each finishing its current
// task). Beside busy processes both threads then work whenever the OS runs them, where OpenMP's
// team ran at the pace of its slowest thread (benchmarks.md, "Threads beside other work").
//
// Workers spin a while after a call (work(): the next one of a step comes within microseconds), then
// sleep on a condition variable. One call at a time: a call made while another runs (another
// Python thread, or a task's own nested call) runs on its caller alone. Idle, OpenMP's team is a
// little faster (its threads spin ~10 ms and torch's own parallel ops share them; the pool took 2-5%
// more per step of the Qwen 1.5B), so the pool is off by default and the thread governor switches
// it on while other processes hold cores. Which thread computes a task changes none of its
// numbers: every output is computed by one task alone.
class KernelPool {
 public:
  using Fn = void (*)(void*, int64_t);

  // The process's pool, made on first use; null while the pool is off (the default: see Settings).
  static KernelPool* get() {
    if (!settings().enabled.load(std::memory_order_relaxed)) return nullptr;
    KernelPool* pool = instance().load(std::memory_order_acquire);
    if (pool) return pool;
    KernelPool* made = new KernelPool();
    if (instance().compare_exchange_strong(pool, made)) return made;
    delete made;  // another thread's won (no worker started yet)
    return pool;
  }

  // Whether calls take the pool (else OpenMP regions), how long a worker spins for the next call
  // before it sleeps (microseconds; negative: SHORT_SPIN_US or LONG_SPIN_US as the worker finds its
  // core shared or not), and how many threads a call takes (0: torch's count): off unless
  // SPECDEC_KERNEL_POOL=1 at start; set_kernel_pool later (the thread governor switches it on while
  // other processes hold cores: specdec/threads.py).
  struct Settings {
    std::atomic<bool> enabled;
    std::atomic<int64_t> spin_us;
    std::atomic<int64_t> threads;
  };
  static Settings& settings() {
    static Settings s = [] {
      pthread_atfork(nullptr, nullptr, [] { instance().store(nullptr); });  // a child has none of the threads
      const char* on = std::getenv("SPECDEC_KERNEL_POOL");
      const char* spin = std::getenv("SPECDEC_KERNEL_POOL_SPIN_US");
      return Settings{on && std::string(on) == "1", spin ? std::max<int64_t>(0, std::atoll(spin)) : -1, 0};
    }();
    return s;
  }

  // fn(ctx, 0) on the calling thread and fn(ctx, p), p = 1..n - 1, on each worker that joins in
  // time; returns once every participant has returned. Rethrows the first exception a participant
  // raised. The caller must hold `calls`.
  void run(int64_t n, Fn fn, void* ctx) {
    add_workers(n - 1);
    finished_.store(0, std::memory_order_relaxed);
    fn_.store(fn, std::memory_order_relaxed);
    ctx_.store(ctx, std::memory_order_relaxed);
    error_ = nullptr;
    const uint64_t gen = (word_.load(std::memory_order_relaxed) >> 32) + 1;
    word_.store(gen << 32 | static_cast<uint64_t>(n - 1) << 16);  // open (sequentially consistent: see worker)
    if (sleepers_.load() > 0) {
      { std::lock_guard<std::mutex> hold(sleep_); }
      wake_.notify_all();
    }
    in_call() = true;
    std::exception_ptr own;
    try {
      fn(ctx, 0);
    } catch (...) {
      own = std::current_exception();
    }
    in_call() = false;
    const int64_t joined = static_cast<int64_t>(word_.fetch_or(CLOSED, std::memory_order_acq_rel) & 0xFFFF);
    for (int spins = 0; finished_.load(std::memory_order_acquire) < joined; ++spins) {
      if (spins < 4096) _mm_pause();
      else sched_yield();  // a joined worker the OS has descheduled mid-task
    }
    if (own) std::rethrow_exception(own);
    if (error_) std::rethrow_exception(error_);
  }

  // true on the pool's workers, and on a caller while it runs its own part of a call
  static bool& in_call() {
    static thread_local bool inside = false;
    return inside;
  }

  std::mutex calls;

 private:
  static constexpr uint64_t CLOSED = uint64_t{1} << 31;

  static std::atomic<KernelPool*>& instance() {
    static std::atomic<KernelPool*> pool{nullptr};
    return pool;
  }

  void add_workers(int64_t n) {
    try {
      for (; workers_ < n; ++workers_) std::thread([this] { work(); }).detach();
    } catch (const std::system_error&) {
      // no more threads to be had: the calls run on those there are (the caller takes what no worker does)
    }
  }

  // How long a worker spins for the next call before it sleeps. A step's calls come microseconds
  // apart on a small model and up to a few hundred on the Qwen 1.5B, and a sleeping worker joins the
  // next call only after the OS has woken it (tens of microseconds): on a core of its own it spins
  // LONG_SPIN_US (the speed of OpenMP's team, whose threads spin ~10 ms). Where the worker's core is
  // shared (it ran under CROWDED of the wall time while it spun or worked: other processes), every
  // microsecond it spins is taken from the caller, and it spins SHORT_SPIN_US. Xeon, 2 cores:
  // plain decoding of the default model beside two busy loops at a fixed spin of 0 / 20 / 100 /
  // 1000 us: 83 / 91 / 66 / 57 tokens/s (idle 161 / 204 / 205 / 208); a verification of 8 tokens of
  // the Qwen 1.5B at 20 / 200 / 2000 us: 83 / 75 / 62 ms.
  static constexpr int64_t SHORT_SPIN_US = 20, LONG_SPIN_US = 2000;
  static constexpr double CROWDED = 0.9;

  static int64_t thread_cpu_ns() {
    timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return int64_t{t.tv_sec} * 1000000000 + t.tv_nsec;
  }

  void work() {
    in_call() = true;
    uint32_t seen = static_cast<uint32_t>(word_.load() >> 32);
    bool crowded = false;
    int64_t wall_ns = 0, cpu_ns = 0;  // while spinning or running tasks, since the last judgement
    auto now = [] { return std::chrono::steady_clock::now(); };
    auto count = [&](std::chrono::steady_clock::time_point t0, int64_t c0) {
      cpu_ns += thread_cpu_ns() - c0;
      wall_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(now() - t0).count();
      if (wall_ns >= 2000000) {  // judged every 2 ms of wanting the core
        crowded = cpu_ns < CROWDED * wall_ns;
        wall_ns = cpu_ns = 0;
      }
    };
    for (;;) {
      // wait for the next call: spin, then sleep
      const int64_t fixed = settings().spin_us.load(std::memory_order_relaxed);
      const auto spin = std::chrono::microseconds(fixed >= 0 ? fixed : crowded ? SHORT_SPIN_US : LONG_SPIN_US);
      auto since = now();
      int64_t c0 = thread_cpu_ns();
      for (int i = 1; static_cast<uint32_t>(word_.load(std::memory_order_acquire) >> 32) == seen; ++i) {
        _mm_pause();
        if (i % 64 == 0 && now() - since > spin) {
          count(since, c0);
          std::unique_lock<std::mutex> hold(sleep_);
          sleepers_.fetch_add(1);
          wake_.wait(hold, [&] { return static_cast<uint32_t>(word_.load() >> 32) != seen; });
          sleepers_.fetch_sub(1);
          since = now();
          c0 = thread_cpu_ns();
        }
      }
      // join it while it is open and wants more threads
      uint64_t w = word_.load(std::memory_order_acquire);
      seen = static_cast<uint32_t>(w >> 32);
      while (!(w & CLOSED) && (w & 0xFFFF) < ((w >> 16) & 0x7FFF)) {
        if (word_.compare_exchange_weak(w, w + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
          try {
            fn_.load(std::memory_order_relaxed)(ctx_.load(std::memory_order_relaxed), static_cast<int64_t>(w & 0xFFFF) + 1);
          } catch (...) {
            std::lock_guard<std::mutex> hold(sleep_);
            if (!error_) error_ = std::current_exception();
          }
          finished_.fetch_add(1, std::memory_order_release);
          break;
        }
        seen = static_cast<uint32_t>(w >> 32);  // (a newer call: try that one)
      }
      count(since, c0);  // (the spin since waking and the call's tasks)
    }
  }

  // the call: generation (high 32 bits) | CLOSED | workers wanted (bits 16-30) | workers joined (0-15)
  std::atomic<uint64_t> word_{0};
  std::atomic<int64_t> finished_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<Fn> fn_{nullptr};
  std::atomic<void*> ctx_{nullptr};
  std::exception_ptr error_;
  std::mutex sleep_;
  std::condition_variable wake_;
  int64_t workers_ = 0;
};

// Threads a parallel call of the kernels takes: the pool's own count where one is set (the thread
// governor sets every allowed core: a thread the OS does not run stalls no call), else torch's.
inline int64_t kernel_threads() {
  const KernelPool::Settings& s = KernelPool::settings();
  const int64_t own = s.threads.load(std::memory_order_relaxed);
  return own > 0 && s.enabled.load(std::memory_order_relaxed) ? own : at::get_num_threads();
}

// Runs fn(i) for the participants i = 0..n - 1 of one parallel call (fn(0) on the calling thread),
// on the kernel pool; participants that no thread took in time are skipped, so fn must leave no
// work to a participant: each takes tasks from a shared supply until none is left (shared_tasks).
template <class F>
void run_participants(int64_t n, F&& fn) {
  if (n <= 1 || KernelPool::in_call() || at::in_parallel_region()) {
    fn(0);
    return;
  }
  KernelPool* pool = KernelPool::get();
  if (!pool) {  // the pool off: an OpenMP region, a participant a thread
    at::parallel_for(0, n, 1, [&](int64_t i0, int64_t /*i1*/) { fn(i0); });
    return;
  }
  std::unique_lock<std::mutex> hold(pool->calls, std::try_to_lock);
  if (!hold.owns_lock()) {
    fn(0);  // another thread's call is running: this caller alone
    return;
  }
  using Fn = std::remove_reference_t<F>;
  pool->run(n, [](void* ctx, int64_t i) { (*static_cast<Fn*>(ctx))(i); }, &fn);
}

// f(b0, b1) over [begin, end) in chunks of at least `grain` (at::parallel_for's contract), on the
// kernel pool: up to 4 chunks a thread, taken in turn from one counter, so a thread the OS runs
// late leaves its chunks to the others.
template <class F>
void pool_for(int64_t begin, int64_t end, int64_t grain, F&& f) {
  const int64_t range = end - begin;
  if (range <= 0) return;
  const int64_t threads = kernel_threads();
  if (range <= grain || threads <= 1) {
    f(begin, end);
    return;
  }
  const int64_t size = std::max<int64_t>(grain, (range + 4 * threads - 1) / (4 * threads));
  const int64_t chunks = (range + size - 1) / size;
  std::atomic<int64_t> next{0};
  run_participants(std::min(threads, chunks), [&](int64_t /*participant*/) {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;)
      f(begin + c * size, std::min(end, begin + (c + 1) * size));
  });
}

// a fixed horizontal sum: ((0+4)+(2+6)) + ((1+5)+(3+7))
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// ---------------------------------------------------------------------------------------------
// linear: x [M, K] @ w [N, K]^T. Tiles of MR rows x NR columns share their loads; every output
// element keeps its own accumulator, so the tile sizes change nothing in its numbers.
template <int MR, int NR>
void tile(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy) {
  __m256 acc[MR][NR];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 3
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t K8 = K / 8 * 8;
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 wv[NR];
#pragma GCC unroll 3
    for (int j = 0; j < NR; ++j) wv[j] = _mm256_loadu_ps(w + j * K + k);
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
#pragma GCC unroll 3
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float s = hsum8(acc[i][j]);
      for (int64_t k = K8; k < K; ++k) s += x[i * ldx + k] * w[j * K + k];
      y[i * ldy + j] = s;
    }
}

template <int NR>
void tile_rows(int mr, const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy) {
  switch (mr) {
    case 4: tile<4, NR>(x, ldx, w, K, y, ldy); break;
    case 3: tile<3, NR>(x, ldx, w, K, y, ldy); break;
    case 2: tile<2, NR>(x, ldx, w, K, y, ldy); break;
    default: tile<1, NR>(x, ldx, w, K, y, ldy); break;
  }
}

at::Tensor linear(const at::Tensor& x_, const at::Tensor& w) {
  TORCH_CHECK(x_.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "linear: float32 only");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && x_.size(-1) == w.size(1), "linear: w must be [N, K], contiguous");
  const at::Tensor x = x_.contiguous();
  const int64_t K = w.size(1), N = w.size(0), M = K ? x.numel() / K : 0;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty(shape, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  constexpr int64_t MR = 4, NR = 3, GROUP = 8 * NR;  // a group of columns: its weights stay in L2 across the rows
  const int64_t groups = (N + GROUP - 1) / GROUP;
  pool_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n0 = g * GROUP, n1 = std::min(N, n0 + GROUP);
      for (int64_t m = 0; m < M; m += MR) {
        const int mr = static_cast<int>(std::min(MR, M - m));
        for (int64_t n = n0; n < n1; n += NR) {
          const int nr = static_cast<int>(std::min(NR, n1 - n));
          const float* xt = xp + m * K;
          const float* wt = wp + n * K;
          float* yt = yp + m * N + n;
          if (nr == 3) tile_rows<3>(mr, xt, K, wt, K, yt, N);
          else if (nr == 2) tile_rows<2>(mr, xt, K, wt, K, yt, N);
          else tile_rows<1>(mr, xt, K, wt, K, yt, N);
        }
      }
    }
  });
  return y;
}

// ---------------------------------------------------------------------------------------------
// The same products read from a GGUF file's Q4_1 / Q8_0 blocks in gguf_blocks' K-major layout
// (output rows in groups of 4; per group and 32-weight block, Q4_1: d[4], m[4] float32 then 4 x 16
// nibble bytes; Q8_0: d[4] float32 then 4 x 32 int8). Each weight is rebuilt in a register exactly
// as the dequantised fp32 copy holds it (Q4_1: fma(q, d, m), d * q being exact; Q8_0: q * d) and
// enters the same FMA chain as in `linear`, so the outputs equal `linear` over the fp32 copy bit for
// bit, while a step reads ~0.75 (Q4_1) or ~1.1 (Q8_0) bytes a weight instead of 4.

// Blocks ahead to prefetch (~0.8-1.2 KB; a prefetch never faults past the end): without it a 1-token
// step of the default model took 10.4-10.7 ms, with 4 / 8 / 16 / 24 ahead 9.8 / 9.4-9.55 / 9.5 / 9.5
// (forward_costs.py, 2-core Zen 2); 3-token steps 15.0 -> 12.9 ms.
constexpr int64_t PF = 8;

// MR rows x NJ of a group's 4 outputs (from output j0) over all nb blocks. Each 8-weight chunk is
// rebuilt once and serves the MR rows; every output's sum keeps its own register.
template <int MR, int NJ, bool Q4>
void block_tile(const float* x, int64_t ldx, const uint8_t* g, int64_t nb, int j0, float* y, int64_t ldy) {
  constexpr int64_t GB = Q4 ? 32 + 64 : 16 + 128;  // bytes of a group's block
  __m256 acc[MR][NJ];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NJ; ++j) acc[i][j] = _mm256_setzero_ps();
  const __m256i f = _mm256_set1_epi32(0x0F);
  for (int64_t blk = 0; blk < nb; ++blk) {
    const uint8_t* p = g + blk * GB;
    const float* ds = reinterpret_cast<const float*>(p);
    const float* xb = x + blk * 32;
    if (j0 == 0)
      for (int64_t c = 0; c < GB; c += 64) _mm_prefetch(reinterpret_cast<const char*>(p + PF * GB + c), _MM_HINT_T0);
    for (int j = 0; j < NJ; ++j) {
      const __m256 d = _mm256_set1_ps(ds[j0 + j]);
      const __m256 m = Q4 ? _mm256_set1_ps(ds[4 + j0 + j]) : d;
      const uint8_t* q = Q4 ? p + 32 + 16 * (j0 + j) : p + 16 + 32 * (j0 + j);
      for (int c = 0; c < 4; ++c) {
        __m256 w;
        if (Q4) {  // nibbles: weights 0-15 low, 16-31 high
          const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * (c & 1))));
          w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c < 2 ? _mm256_and_si256(b, f) : _mm256_srli_epi32(b, 4)), d, m);
        } else {
          w = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * c)))), d);
        }
        for (int i = 0; i < MR; ++i) acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + i * ldx + 8 * c), w, acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NJ; ++j) y[i * ldy + j0 + j] = hsum8(acc[i][j]);
}

#if ROWSTABLE_VNNI
// The VNNI build (AVX-512F) takes a group's 4 outputs as two pairs in 512-bit registers: lanes 0-7
// output j, 8-15 output j + 1, each weight chunk rebuilt for both at once and each activation chunk
// loaded once into both halves (bz_tile). Every lane runs block_tile's operations on the same
// numbers (the rebuild's fma / mul, then one FMA chain a row and output), and each output is its
// 8 lanes by hsum8: the same numbers bit for bit, with about half the instructions.
// x chunk (8 floats) in both halves
inline __m512 bz_x(const float* p) {
  return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(reinterpret_cast<const double*>(p))));
}
// float lanes [v[a] x 8 | v[b] x 8] of the 4 floats at v
inline __m512 bz_pair(const float* v, int a) {
  return _mm512_permutexvar_ps(_mm512_set_epi32(a + 1, a + 1, a + 1, a + 1, a + 1, a + 1, a + 1, a + 1, a, a, a, a, a, a, a, a),
                               _mm512_castps128_ps512(_mm_loadu_ps(v)));
}

template <int MR, bool Q4>
void bz_tile(const float* x, int64_t ldx, const uint8_t* g, int64_t nb, float* y, int64_t ldy) {
  constexpr int64_t GB = Q4 ? 32 + 64 : 16 + 128;
  __m512 acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  const __m512i f = _mm512_set1_epi32(0x0F);
  for (int64_t blk = 0; blk < nb; ++blk) {
    const uint8_t* p = g + blk * GB;
    const float* ds = reinterpret_cast<const float*>(p);
    const float* xb = x + blk * 32;
    for (int64_t c = 0; c < GB; c += 64) _mm_prefetch(reinterpret_cast<const char*>(p + PF * GB + c), _MM_HINT_T0);
    __m512 w[2][4];  // [pair][chunk]
    for (int h = 0; h < 2; ++h) {
      const __m512 d = bz_pair(ds, 2 * h);
      if (Q4) {  // outputs 2h, 2h + 1: 16 nibble bytes each, weights 0-15 low, 16-31 high
        const __m512 m = bz_pair(ds + 4, 2 * h);
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 + 32 * h));
        for (int c = 0; c < 2; ++c) {  // bytes 8c..8c+7 of both outputs: chunks c (low nibbles) and c + 2 (high)
          const __m512i q = _mm512_cvtepu8_epi32(_mm256_castsi256_si128(_mm256_permute4x64_epi64(b, c ? 0x0D : 0x08)));
          w[h][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, f)), d, m);
          w[h][c + 2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), d, m);
        }
      } else {  // outputs 2h, 2h + 1: 32 int8 each
        const uint8_t* q = p + 16 + 64 * h;
        for (int c = 0; c < 4; ++c) {
          const __m128i b = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * c)),
                                               _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 32 + 8 * c)));
          w[h][c] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), d);
        }
      }
    }
    for (int c = 0; c < 4; ++c)
      for (int i = 0; i < MR; ++i) {
        const __m512 xv = bz_x(xb + i * ldx + 8 * c);
        acc[i][0] = _mm512_fmadd_ps(xv, w[0][c], acc[i][0]);
        acc[i][1] = _mm512_fmadd_ps(xv, w[1][c], acc[i][1]);
      }
  }
  for (int i = 0; i < MR; ++i)
    for (int h = 0; h < 2; ++h) {
      y[i * ldy + 2 * h] = hsum8(_mm512_castps512_ps256(acc[i][h]));
      y[i * ldy + 2 * h + 1] = hsum8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[i][h]), 1)));
    }
}
#endif

template <bool Q4>
at::Tensor block_linear(const at::Tensor& x_, const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(x_.scalar_type() == at::kFloat, "block linear: float32 activations only");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "block linear: packed blocks must be uint8");
  const at::Tensor x = x_.contiguous();
  const int64_t K = x.size(-1), M = K ? x.numel() / K : 0, nb = K / 32, groups = N / 4;
  constexpr int64_t GB = Q4 ? 32 + 64 : 16 + 128;
  TORCH_CHECK(K % 32 == 0 && N % 4 == 0 && packed.numel() == groups * nb * GB, "block linear: shapes do not match the blocks");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty(shape, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const uint8_t* bp = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  // tasks of 6 groups (24 outputs); rows in tiles of up to 6, each tile one pass over the group's
  // blocks with its sums in registers: tiles of up to 3 rows take the group's 4 outputs at once,
  // larger ones 2 at a time (12 sums either way)
  constexpr int64_t GROUPS = 6, MR = 6;
  pool_for(0, (groups + GROUPS - 1) / GROUPS, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t g = t0 * GROUPS, g1 = std::min(groups, t1 * GROUPS); g < g1; ++g) {
      const uint8_t* gp = bp + g * nb * GB;
      for (int64_t m = 0; m < M; m += MR) {
        const int64_t r = std::min(MR, M - m);
        const float* xt = xp + m * K;
        float* yt = yp + m * N + 4 * g;
#if ROWSTABLE_VNNI
        switch (r) {
          case 1: bz_tile<1, Q4>(xt, K, gp, nb, yt, N); break;
          case 2: bz_tile<2, Q4>(xt, K, gp, nb, yt, N); break;
          case 3: bz_tile<3, Q4>(xt, K, gp, nb, yt, N); break;
          case 4: bz_tile<4, Q4>(xt, K, gp, nb, yt, N); break;
          case 5: bz_tile<5, Q4>(xt, K, gp, nb, yt, N); break;
          default: bz_tile<6, Q4>(xt, K, gp, nb, yt, N); break;
        }
        continue;
#endif
        switch (r) {
          case 1: block_tile<1, 4, Q4>(xt, K, gp, nb, 0, yt, N); break;
          case 2: block_tile<2, 4, Q4>(xt, K, gp, nb, 0, yt, N); break;
          case 3: block_tile<3, 4, Q4>(xt, K, gp, nb, 0, yt, N); break;
          case 4: for (int j0 = 0; j0 < 4; j0 += 2) block_tile<4, 2, Q4>(xt, K, gp, nb, j0, yt, N); break;
          case 5: for (int j0 = 0; j0 < 4; j0 += 2) block_tile<5, 2, Q4>(xt, K, gp, nb, j0, yt, N); break;
          default: for (int j0 = 0; j0 < 4; j0 += 2) block_tile<6, 2, Q4>(xt, K, gp, nb, j0, yt, N); break;
        }
      }
    }
  });
  return y;
}

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n) { return block_linear<true>(x, packed, n); }
at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n) { return block_linear<false>(x, packed, n); }

// ---------------------------------------------------------------------------------------------
// gguf_linear / gguf_rows: products and row lookups straight from a GGUF tensor's bytes as the file
// holds them (N rows of K / BS blocks each, row-major; typically a view of the memory-mapped file),
// for F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K. No copy of the weights.
// gguf_linear_cat multiplies by several such tensors (q, k, v; gate, up; of any types) in one call
// and one parallel region, their outputs side by side: the numbers of separate gguf_linear calls.
//
// Numbers. A decoder rebuilds 8 weights at a time in a register with exactly the float32 values
// gguf.quants.dequantize gives; every type's formula has at most one rounding:
//  - Q8_0: q * d; Q4_0, Q5_0: d * (q - 8 | 16); Q6_K: (d * sc) * (q - 32): exact products (an 11-bit
//    float16 scale times integers of <= 13 bits), so fma(q, d, -8d) etc. give the same exact value;
//  - Q4_1, Q5_1: d * q + m, and Q4_K, Q5_K: (d * sc) * q - dmin * m: the products are exact (<= 22
//    significant bits), the sum is the one rounding, which fma(q, d, m) performs the same way;
//  - F16, BF16, F32: exact conversions.
// (This holds for finite scales; a block whose float16 scale is inf or NaN may differ in which of
// inf / NaN it gives.) Each output then runs `linear`'s sum: one 8-lane FMA chain over k in order,
// hsum8, the k % 8 tail in order (float types only), so
//     gguf_linear(x, raw) == linear(x, dequantize(raw))   bit for bit, for every type and every M,
// and a row's outputs never depend on the other rows in the call. Small calls (M <= fused_rows)
// rebuild the weights in registers, one pass over a group of weight rows per tile of up to 6
// activation rows; larger ones rebuild a group of weight rows into a per-thread float32 buffer (in
// L2) and run `linear`'s tiles over it: the same numbers either way.

inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// the float16 at p, converted, in all 8 lanes (a broadcast load and one conversion)
inline __m256 f16_set1(const uint8_t* p) {
  int16_t h;
  std::memcpy(&h, p, 2);
  return _mm256_cvtph_ps(_mm_set1_epi16(h));
}

inline __m128i load8(const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }

// 8 of a 32-weight block's 4-bit quants: chunk c (weights 8c..8c+7) of 16 bytes holding weights
// 0-15 in the low nibbles and 16-31 in the high ones, as int32 lanes
inline __m256i nibbles(const uint8_t* q16, int c) {
  const __m256i b = _mm256_cvtepu8_epi32(load8(q16 + 8 * (c & 1)));
  return c < 2 ? _mm256_and_si256(b, _mm256_set1_epi32(0xF)) : _mm256_srli_epi32(b, 4);
}

// 16 where bit (lane) of `bits` is set: the fifth bit of Q5_0 / Q5_1 quants
inline __m256i high_bits8(uint32_t bits) {
  const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i on = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), lane), lane);
  return _mm256_and_si256(on, _mm256_set1_epi32(16));
}

inline __m256 fma_i(__m256i q, __m256 d, __m256 m) { return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, m); }

// Decoders: BS weights in BB bytes a block; block(p, f) calls f(c, w) for its 8-weight chunks in order
// (the K-quants instead read a block's scales with prepare() and its chunks PARTS parts at a time with
// part(); decode_block() walks any decoder's block in order).
struct DecF32 {
  static constexpr int BS = 8, BB = 32, PARTS = 1;
  template <class F> static inline void block(const uint8_t* p, F&& f) { f(0, _mm256_loadu_ps(reinterpret_cast<const float*>(p))); }
  static float one(const uint8_t* row, int64_t k) { float v; std::memcpy(&v, row + 4 * k, 4); return v; }
};
struct DecF16 {
  static constexpr int BS = 8, BB = 16, PARTS = 1;
  template <class F> static inline void block(const uint8_t* p, F&& f) {
    f(0, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static float one(const uint8_t* row, int64_t k) { return f16_at(row + 2 * k); }
};
struct DecBF16 {
  static constexpr int BS = 8, BB = 16, PARTS = 1;
  template <class F> static inline void block(const uint8_t* p, F&& f) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    f(0, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
  }
  static float one(const uint8_t* row, int64_t k) {
    uint16_t h; std::memcpy(&h, row + 2 * k, 2);
    const uint32_t u = static_cast<uint32_t>(h) << 16; float v; std::memcpy(&v, &u, 4); return v;
  }
};
struct DecQ4_0 {  // d, 16 bytes of nibbles: d * (q - 8)
  static constexpr int BS = 32, BB = 18, PARTS = 1;
  template <class F> static inline void block(const uint8_t* p, F&& f) {
    const __m256 d = f16_set1(p), o = _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
    for (int c = 0; c < 4; ++c) f(c, fma_i(nibbles(p + 2, c), d, o));
  }
};
struct DecQ4_1 {  // d, m, 16 bytes of nibbles: d * q + m
  static constexpr int BS = 32, BB = 20, PARTS = 1;
  template <class F> static inline void block(const uint8_t* p, F&& f) {
    const __m256 d = f16_set1(p), m = f16_set1(p + 2);
    for (int c = 0; c < 4; ++c) f(c, fma_i(nibbles(p + 4, c), d, m));
  }
};
struct DecQ5_0 {  // d, 32 high bits, 16 bytes of nibbles: d * (q - 16)
  static constexpr int BS = 32, BB = 22, PARTS = 1;
  template <class F> static inline void block(const uint8_t* p, F&& f) {
    uint32_t qh; std::memcpy(&qh, p + 2, 4);
    const __m256 d = f16_set1(p), o = _mm256_mul_ps(d, _mm256_set1_ps(-16.0f));
    for (int c = 0; c < 4; ++c) f(c, fma_i(_mm256_or_si256(nibbles(p + 6, c), high_bits8(qh >> (8 * c))), d, o));
  }
};
struct DecQ5_1 {  // d, m, 32 high bits, 16 bytes of nibbles: d * q + m
  static constexpr int BS = 32, BB = 24, PARTS = 1;
  template <class F> static inline void block(const uint8_t* p, F&& f) {
    const __m256 d = f16_set1(p), m = f16_set1(p + 2);
    uint32_t qh; std::memcpy(&qh, p + 4, 4);
    for (int c = 0; c < 4; ++c) f(c, fma_i(_mm256_or_si256(nibbles(p + 8, c), high_bits8(qh >> (8 * c))), d, m));
  }
};
struct DecQ8_0 {  // d, 32 int8: q * d
  static constexpr int BS = 32, BB = 34, PARTS = 1;
  template <class F> static inline void block(const uint8_t* p, F&& f) {
    const __m256 d = f16_set1(p);
    for (int c = 0; c < 4; ++c) f(c, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load8(p + 2 + 8 * c))), d));
  }
};

// Q4_K / Q5_K: the 8 sub-blocks' 6-bit scales and mins from 12 bytes (gguf's Q4_K.get_scale_min,
// four bytes at a time as ggml does), as d * sc and -(dmin * m): dsc[8], ndm[8]
// (the 8 scales and the 8 mins as bytes of sc and mn, sub-block 0 lowest)
inline void k_scale_bytes(const uint8_t* p, uint64_t& sc, uint64_t& mn) {
  uint32_t a, b, c;
  std::memcpy(&a, p + 4, 4);
  std::memcpy(&b, p + 8, 4);
  std::memcpy(&c, p + 12, 4);
  sc = (a & 0x3f3f3f3fu) | static_cast<uint64_t>((c & 0x0f0f0f0fu) | ((a >> 2) & 0x30303030u)) << 32;
  mn = (b & 0x3f3f3f3fu) | static_cast<uint64_t>(((c >> 4) & 0x0f0f0f0fu) | ((b >> 2) & 0x30303030u)) << 32;
}
inline void k_scales(const uint8_t* p, float* dsc, float* ndm) {
  uint64_t sc, mn;
  k_scale_bytes(p, sc, mn);
  const __m256 s = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(sc))));
  const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(mn))));
  _mm256_storeu_ps(dsc, _mm256_mul_ps(f16_set1(p), s));
  _mm256_storeu_ps(ndm, _mm256_xor_ps(_mm256_mul_ps(f16_set1(p + 2), m), _mm256_set1_ps(-0.0f)));
}

// K-quant decoders also split a block into PARTS parts of 4 chunks after prepare() has read its
// scales, so that a tile can interleave its weight rows part by part (independent FMA chains in flight).
struct KScales {
  alignas(32) float dsc[8], ndm[8];
};
struct DecQ4_K {  // d, dmin, scales, 128 bytes of nibbles (sub-blocks 2i, 2i+1: low, high of bytes 32i..)
  static constexpr int BS = 256, BB = 144, PARTS = 8;
  using St = KScales;
  static inline void prepare(const uint8_t* p, St& st) { k_scales(p, st.dsc, st.ndm); }
  template <class F> static inline void part(const uint8_t* p, const St& st, int s, F&& f) {
    const __m256 d = _mm256_broadcast_ss(st.dsc + s), m = _mm256_broadcast_ss(st.ndm + s);
    const uint8_t* q = p + 16 + 32 * (s >> 1);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256i b = _mm256_cvtepu8_epi32(load8(q + 8 * c));
      f(4 * s + c, fma_i((s & 1) ? _mm256_srli_epi32(b, 4) : _mm256_and_si256(b, _mm256_set1_epi32(0xF)), d, m));
    }
  }
};
// 32 quant bytes (weights 0..31 of a part) as 4 chunks of 8 int32 lanes, in order; Signed: int8 quants
template <bool Signed, class F>
inline void widen32(__m256i q, F&& g) {
  const __m128i a = _mm256_castsi256_si128(q), b = _mm256_extracti128_si256(q, 1);
  const __m128i parts[4] = {a, _mm_unpackhi_epi64(a, a), b, _mm_unpackhi_epi64(b, b)};
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) g(c, Signed ? _mm256_cvtepi8_epi32(parts[c]) : _mm256_cvtepu8_epi32(parts[c]));
}

struct DecQ5_K {  // d, dmin, scales, 32 bytes of high bits (bit s of byte l: weight 32s + l), 128 bytes of nibbles
  static constexpr int BS = 256, BB = 176, PARTS = 8;
  using St = KScales;
  static inline void prepare(const uint8_t* p, St& st) { k_scales(p, st.dsc, st.ndm); }
  // part s, built 32 bytes at a time: the nibbles of bytes 48 + 32 (s / 2).. (low for even s) | bit s of bytes 16.. as 16
  template <class F> static inline void part(const uint8_t* p, const St& st, int s, F&& f) {
    const __m256 d = _mm256_broadcast_ss(st.dsc + s), m = _mm256_broadcast_ss(st.ndm + s);
    const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 48 + 32 * (s >> 1)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
    const __m256i lo = _mm256_and_si256((s & 1) ? _mm256_srli_epi16(qs, 4) : qs, _mm256_set1_epi8(0x0F));
    const __m256i hb = s <= 4 ? _mm256_slli_epi16(qh, 4 - s) : _mm256_srli_epi16(qh, s - 4);  // bit s -> bit 4
    const __m256i q = _mm256_or_si256(lo, _mm256_and_si256(hb, _mm256_set1_epi8(0x10)));
    widen32<false>(q, [&](int c, __m256i v) { f(4 * s + c, fma_i(v, d, m)); });
  }
};
struct DecQ6_K {  // 128 bytes low nibbles, 64 bytes 2-bit highs, 16 int8 scales, d: (d * sc) * (q - 32)
  static constexpr int BS = 256, BB = 210, PARTS = 8;
  struct St {
    alignas(32) float ds[16];
  };
  static inline void prepare(const uint8_t* p, St& st) {
    const __m256 d = f16_set1(p + 208);
    _mm256_storeu_ps(st.ds, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load8(p + 192)))));
    _mm256_storeu_ps(st.ds + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load8(p + 200)))));
  }
  // part s = 4h + t: weights 128h + 32t + l (l = 0..31): the low nibble of byte 64h + 32(t & 1) + l (the
  // high one for t >= 2), and bits 2t, 2t + 1 of byte 128 + 32h + l; built 32 bytes at a time
  template <class F> static inline void part(const uint8_t* p, const St& st, int s, F&& f) {
    const int h = s >> 2, t = s & 3;
    const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * h + 32 * (t & 1)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * h));
    const __m256i lo = _mm256_and_si256(t < 2 ? ql : _mm256_srli_epi16(ql, 4), _mm256_set1_epi8(0x0F));
    const __m256i hb = t < 2 ? _mm256_slli_epi16(qh, 4 - 2 * t) : _mm256_srli_epi16(qh, 2 * t - 4);  // bits 2t.. -> 4..
    const __m256i q = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_and_si256(hb, _mm256_set1_epi8(0x30))), _mm256_set1_epi8(32));
    widen32<true>(q, [&](int c, __m256i v) {
      f(4 * s + c, _mm256_mul_ps(_mm256_cvtepi32_ps(v), _mm256_broadcast_ss(st.ds + 2 * s + (c >> 1))));
    });
  }
};

// a whole block's chunks in order, for any decoder
template <class D, class F>
inline void decode_block(const uint8_t* p, F&& f) {
  if constexpr (D::PARTS == 1) {
    D::block(p, f);
  } else {
    typename D::St st;
    D::prepare(p, st);
#pragma GCC unroll 8
    for (int s = 0; s < D::PARTS; ++s) D::part(p, st, s, f);
  }
}

// One weight row's K float32 values (gguf.quants.dequantize's), into out.
template <class D>
void dequant_row(const uint8_t* row, int64_t K, float* out) {
  const int64_t nb = K / D::BS;
  for (int64_t b = 0; b < nb; ++b)
    decode_block<D>(row + b * D::BB, [&](int c, __m256 w) { _mm256_storeu_ps(out + b * D::BS + 8 * c, w); });
  if constexpr (D::BS == 8)
    for (int64_t k = nb * 8; k < K; ++k) out[k] = D::one(row, k);
}

// Prefetch (a prefetch never faults past the end): a tile's NR weight rows are NR interleaved streams
// that the hardware prefetchers follow poorly, so each block prefetches the same block of the same row
// in the next tile (NR rows further on). From memory, one thread, 151936x1536 / 16384x8960 weights:
// Q8_0 2.3 -> 6-8 GB/s and 6.3-7.4 -> 8.5 GB/s, Q4_K 2.8-2.9 -> 3.3 GB/s at 8960 wide, against 512
// bytes ahead in its own row; 2 or 4 tiles ahead were no better than 1.

// MR activation rows x NR weight rows (row-major blocks, rb bytes a row) over nb blocks: each chunk of 8
// weights is rebuilt once and serves the MR rows; every output keeps its own register.
template <class D, int MR, int NR>
void gguf_tile(const float* x, int64_t K, const uint8_t* w, int64_t rb, int64_t nb, float* y, int64_t ldy) {
  __m256 acc[MR][NR];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t pf = NR * rb;
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * D::BS;
    const uint8_t* pb = w + b * D::BB;
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j)
      for (int o = 0; o < D::BB; o += 64) _mm_prefetch(reinterpret_cast<const char*>(pb + j * rb + pf + o), _MM_HINT_T0);
    if constexpr (D::PARTS == 1) {
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j)
        D::block(pb + j * rb, [&](int c, __m256 wv) {
#pragma GCC unroll 6
          for (int i = 0; i < MR; ++i) acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + i * K + 8 * c), wv, acc[i][j]);
        });
    } else {  // the NR rows part by part: NR * MR independent chains in flight
      typename D::St st[NR];
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) D::prepare(pb + j * rb, st[j]);
#pragma GCC unroll 8
      for (int s = 0; s < D::PARTS; ++s)
#pragma GCC unroll 4
        for (int j = 0; j < NR; ++j)
          D::part(pb + j * rb, st[j], s, [&](int c, __m256 wv) {
#pragma GCC unroll 6
            for (int i = 0; i < MR; ++i) acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + i * K + 8 * c), wv, acc[i][j]);
          });
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) y[i * ldy + j] = hsum8(acc[i][j]);
}

// rows n0..n1 of the output for activation rows m..m+mr (mr <= 6) by gguf_tile
template <class D, int MR>
void gguf_tiles(const float* x, int64_t K, const uint8_t* w, int64_t rb, int64_t n0, int64_t n1, float* y, int64_t N) {
  constexpr int NR = MR <= 3 ? 4 : 2;
  const int64_t nb = K / D::BS;
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) gguf_tile<D, MR, NR>(x, K, w + n * rb, rb, nb, y + n, N);
  for (; n < n1; ++n) gguf_tile<D, MR, 1>(x, K, w + n * rb, rb, nb, y + n, N);
}

// Calls of up to this many activation rows rebuild the weights in registers, larger ones into a buffer
// (where the buffered products were as fast or faster, one thread on a 2-core Zen 3):
// 4+ rows for the K-quants (their rebuilding costs more), 6+ for the others.
template <class D>
constexpr int64_t fused_rows() { return D::PARTS > 1 ? 3 : 5; }

template <class D>
bool in_registers(int64_t M, int64_t K) { return M <= fused_rows<D>() && K % 8 == 0; }

// The weight rows a task takes: 24 rebuilt in registers, or a buffer's worth (<= ~96 KB, a multiple
// of `linear`'s 3 columns).
template <class D>
int64_t task_rows(int64_t M, int64_t K) {
  return in_registers<D>(M, K) ? 24 : std::max<int64_t>(3, (24576 / std::max<int64_t>(K, 1)) / 3 * 3);
}

// Output columns n0..n1 (at most task_rows) of one weight (rb bytes a row at wp) for all M rows of x,
// into yp (the weight's first output column; row stride ldy); buf: the calling thread's buffer.
template <class D>
void gguf_columns(const float* xp, int64_t M, int64_t K, const uint8_t* wp, int64_t rb, int64_t n0, int64_t n1,
                  float* yp, int64_t ldy, std::vector<float>& buf) {
  if (in_registers<D>(M, K)) {
    switch (M) {
      case 1: gguf_tiles<D, 1>(xp, K, wp, rb, n0, n1, yp, ldy); break;
      case 2: gguf_tiles<D, 2>(xp, K, wp, rb, n0, n1, yp, ldy); break;
      case 3: gguf_tiles<D, 3>(xp, K, wp, rb, n0, n1, yp, ldy); break;
      case 4: gguf_tiles<D, 4>(xp, K, wp, rb, n0, n1, yp, ldy); break;
      case 5: gguf_tiles<D, 5>(xp, K, wp, rb, n0, n1, yp, ldy); break;
      default: gguf_tiles<D, 6>(xp, K, wp, rb, n0, n1, yp, ldy); break;
    }
    return;
  }
  constexpr int64_t MR = 4, NR = 3;
  const float* wf;
  if constexpr (std::is_same<D, DecF32>::value) {
    wf = reinterpret_cast<const float*>(wp + n0 * rb);
  } else {
    if (static_cast<int64_t>(buf.size()) < (n1 - n0) * K) buf.resize((n1 - n0) * K);
    for (int64_t n = n0; n < n1; ++n) dequant_row<D>(wp + n * rb, K, buf.data() + (n - n0) * K);
    wf = buf.data();
  }
  for (int64_t m = 0; m < M; m += MR) {
    const int mr = static_cast<int>(std::min(MR, M - m));
    for (int64_t n = n0; n < n1; n += NR) {
      const int nr = static_cast<int>(std::min(NR, n1 - n));
      const float* xt = xp + m * K;
      const float* wt = wf + (n - n0) * K;
      float* yt = yp + m * ldy + n;
      if (nr == 3) tile_rows<3>(mr, xt, K, wt, K, yt, ldy);
      else if (nr == 2) tile_rows<2>(mr, xt, K, wt, K, yt, ldy);
      else tile_rows<1>(mr, xt, K, wt, K, yt, ldy);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// gguf_linear_q8 / gguf_linear_cat_q8: the same products with each activation row first rounded to
// 8 bits, and the quantised blocks multiplied as integer dot products, as llama.cpp does. Every slice
// of a row (256 wide for the K-quants, as llama.cpp's Q8_K; 32 for Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0,
// as its Q8_0 / Q8_1) gets the scale dx = max|x| / 127 and the 8-bit values q = round(x / dx) (0 for
// an all-zero slice). A K-quant block then contributes, for one row,
//     d * dx * sum_s (scale_s * <q_w, q_x>_s)  +  c * dx * sum_l coef_l * bsum_l
// where the first sum is exact int32 arithmetic (_mm256_maddubs_epi16 / _mm256_madd_epi16 over the
// block's unsigned quants; _mm256_dpbusd_epi32 in the VNNI build), and the second folds in what the
// unsigned quants leave out (Q4_K / Q5_K: the mins, c = -dmin; Q6_K: the offset 32, c = -d); the block types are alike (int32_tile). Integers
// are exact whatever their order, and the float accumulations run block by block in order, so a row's
// outputs still never depend on the other rows or the threads: row-stable, as the float path. The
// numbers are not the float path's: the product is that of the rounded activations (to float32
// rounding), ~0.2-0.5% of sum |x w| from the unrounded one (tests/unit/test_gguf_types.py states both).
// F32 / F16 / BF16 compute as in gguf_linear.
//
// No saturation, so both builds' integers are exact and equal: _mm256_maddubs_epi16 saturates a pair
// of products at int16, but |q_x| <= 127 (max|x| / 127 scaling) and a weight quant is at most 15
// (Q4_0, Q4_1, Q4_K), 31 (Q5_0, Q5_1, Q5_K), 63 (Q6_K, before its offset) or, as |q_w| for Q8_0, 128
// (q_w = -128: _mm256_sign_epi8 leaves the byte 0x80, read unsigned), so a pair is at most
// 2 * 128 * 127 = 32512 < 32767; the K-quants' int16 sums of GROUP pairs stay below it too (KInt).
// _mm256_dpbusd_epi32 sums 4 products into int32 without saturation. Each build arranges its lanes so
// that every int32 lane converted to float holds the same integer (int32_tile: lane j = the 4
// products of bytes 4j..4j+3 in both; int_tile, int_row: lane j of each 128-bit half = the scaled sums of
// parts 2j and 2j + 1 over that half, in both).

constexpr int64_t INT_MR = 4;  // activation rows a tile of the block types' integer path takes at most
constexpr int64_t KQ_MR = 16;  // and of the K-quants' (int_tile)

// Interleaves 8 parts of 32 bytes, as 8 int16 lanes (byte pairs) in each 128-bit half: afterwards
// vector k's lane L (of each half) holds lane k of part L's half. quantize_rows_q8 stores the
// activations' 256-slices so, int_tile does it to each weight block (once for all the rows of a tile),
// and the byte pairs _mm256_maddubs_epi16 multiplies stay the same pairs: a product of vector k is
// then part L's in lane L, in every vector alike, so that the products of several vectors add up in
// int16 and take one multiply by the part scales for all of them, instead of one per part.
inline void interleave_parts(__m256i v[8]) {
  __m256i a[8], b[8];
  for (int k = 0; k < 4; ++k) {
    a[2 * k] = _mm256_unpacklo_epi16(v[2 * k], v[2 * k + 1]);  // lanes 0-3 of parts 2k, 2k + 1
    a[2 * k + 1] = _mm256_unpackhi_epi16(v[2 * k], v[2 * k + 1]);  // lanes 4-7
  }
  for (int h = 0; h < 2; ++h)  // parts 0-3 (h = 0), 4-7 (h = 1)
    for (int u = 0; u < 2; ++u) {  // lanes 0-3 (u = 0), 4-7 (u = 1)
      b[4 * h + 2 * u] = _mm256_unpacklo_epi32(a[4 * h + u], a[4 * h + 2 + u]);
      b[4 * h + 2 * u + 1] = _mm256_unpackhi_epi32(a[4 * h + u], a[4 * h + 2 + u]);
    }
  for (int k = 0; k < 4; ++k) {  // b[k]: lanes 2k, 2k + 1 of parts 0-3; b[4 + k]: of parts 4-7
    v[2 * k] = _mm256_unpacklo_epi64(b[k], b[4 + k]);
    v[2 * k + 1] = _mm256_unpackhi_epi64(b[k], b[4 + k]);
  }
}

// The VNNI build's layout instead (_mm256_dpbusd_epi32 sums 4 adjacent bytes' products into an int32
// lane, so the parts are interleaved 4 bytes at a time, in two sets of 4): afterwards vector k < 4 holds
// in int32 lane L of each 128-bit half the 4 bytes k of part L's half, and vector 4 + k those of part
// 4 + L. The dot products of vectors 0-3 added up then hold in lane L part L's sum over that half,
// those of vectors 4-7 part 4 + L's: 8 sums each multiplied by its own scale, 16 instructions a block.
inline void interleave_dwords(__m256i v[8]) {
  for (int g = 0; g < 8; g += 4) {  // a 4 x 4 transpose of int32 lanes in each half
    const __m256i t0 = _mm256_unpacklo_epi32(v[g], v[g + 1]), t1 = _mm256_unpackhi_epi32(v[g], v[g + 1]);
    const __m256i t2 = _mm256_unpacklo_epi32(v[g + 2], v[g + 3]), t3 = _mm256_unpackhi_epi32(v[g + 2], v[g + 3]);
    v[g] = _mm256_unpacklo_epi64(t0, t2);
    v[g + 1] = _mm256_unpackhi_epi64(t0, t2);
    v[g + 2] = _mm256_unpacklo_epi64(t1, t3);
    v[g + 3] = _mm256_unpackhi_epi64(t1, t3);
  }
}

// a 256-slice's 8 parts in the layout of this build's int_tile (applied alike to weights and activations)
inline void interleave_quants(__m256i v[8]) {
#if ROWSTABLE_VNNI
  interleave_dwords(v);
#else
  interleave_parts(v);
#endif
}

#if ROWSTABLE_VNNI
// The VNNI build's K-quant products of several activation rows (kz_pass) take two weight rows at a time
// on 512-bit registers, in the "pair layout": a 256-block's 8 parts of 32 quants as 4 vectors, whose
// 128-bit lane q holds in int32 lane i the bytes 4k..4k+3 (vector k) of the half q & 1 of part
// kz_part(q, i) = {0, 1, 4, 5}[i] + 2 (q >> 1). The 4 vectors' _mm512_dpbusd_epi32 products added
// then hold in lane (q, i) the dot product of that part's half (16 quants): the numbers int_tile's
// lanes are made of, and it takes 8 shuffles a block to get there from the parts as they lie in
// memory (transpose_dwords512), where the ymm layout takes 16 for the same 256 bytes.
constexpr int kz_part(int q, int i) { return (i < 2 ? i : i + 2) + 2 * (q >> 1); }
// The lane (q, j) of a product of two weight rows' sums (kz_pass's isum, corr, acc) is the int_tile /
// int_row lane kz_lane(q, j) (4 half + pair of parts) of weight row j >> 1
constexpr int kz_lane(int q, int j) { return 4 * (q & 1) + (q >> 1) + 2 * (j & 1); }

// a 4 x 4 transpose of int32 lanes inside each 128-bit lane of (a, b, c, d): with a = [part 0 | part
// 2], b = [1 | 3], c = [4 | 6], d = [5 | 7] (32 bytes each), afterwards a, b, c, d are the pair
// layout's vectors 0-3
inline void transpose_dwords512(__m512i& a, __m512i& b, __m512i& c, __m512i& d) {
  const __m512i t0 = _mm512_unpacklo_epi32(a, b), t1 = _mm512_unpackhi_epi32(a, b);
  const __m512i t2 = _mm512_unpacklo_epi32(c, d), t3 = _mm512_unpackhi_epi32(c, d);
  a = _mm512_unpacklo_epi64(t0, t2);
  b = _mm512_unpackhi_epi64(t0, t2);
  c = _mm512_unpacklo_epi64(t1, t3);
  d = _mm512_unpackhi_epi64(t1, t3);
}

inline __m512i join256(const void* lo, const void* hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi)), 1);
}
#endif

// Activation rows rounded to 8 bits in slices of S (256 for the K-quants, 32 for the 32-weight
// block types; K % S == 0): q [M, K], (S = 256) qi: q with each slice's 8 parts of 32 interleaved
// (interleave_quants), the scale d of each slice, the sums of each 16 q (bsum; S = 256: bsum2, those
// of each 32 as int32 lanes, for int_row), and (S = 32) sx = d * (sum of the slice's q) for the block
// types' offsets and minimums. All on 64-byte boundaries, so that a 256-slice's 32-byte loads never
// cross a cache line (each that does costs a second load: a one-row Q4_K block's integer part alone
// took ~2 more cycles, ~20%, with the activations 16 bytes off a boundary).
template <class T>
struct Align64 {  // a std::vector allocator on 64-byte boundaries
  using value_type = T;
  Align64() = default;
  template <class U> Align64(const Align64<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <class U> bool operator==(const Align64<U>&) const { return true; }
  template <class U> bool operator!=(const Align64<U>&) const { return false; }
};
template <class T>
using vec64 = std::vector<T, Align64<T>>;

struct Q8Rows {
  int64_t S = 0;
  vec64<int8_t> q, qi, qz;
  vec64<float> d, sx;
  vec64<int16_t> bsum, bsz;
  vec64<int32_t> bsum2;
};

// layouts: S = 256 only: also qi, bsum2 and the pair layout (gguf_linear_q8's kernels; kq_linear_q8
// reads q, d and bsum alone)
void quantize_rows_q8(const float* x, int64_t M, int64_t K, int64_t S, Q8Rows& r, bool layouts = true) {
  const int64_t nb = M * K / S;  // slices of all rows (rows are contiguous)
  r.S = S;
  r.q.resize(M * K);
  r.qi.resize(S == 256 && layouts ? M * K : 0);
  r.d.resize(nb);
  r.sx.resize(S == 32 ? nb : 0);
  r.bsum.resize(M * K / 16);
  r.bsum2.resize(S == 256 && layouts ? M * K / 32 : 0);
  const bool pairs = ROWSTABLE_VNNI && S == 256 && M >= 2 && layouts;  // (kz_pass's layouts)
  r.qz.resize(pairs ? M * K : 0);
  r.bsz.resize(pairs ? M * K / 8 : 0);
  // (a decoding step's few thousand values take ~1-2 us on one thread, less than waking the others)
  pool_for(0, nb, std::max<int64_t>(16, 32768 / S), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* xb = x + b * S;
      __m256 mx = _mm256_setzero_ps();
      const __m256 sign = _mm256_set1_ps(-0.0f);
      for (int k = 0; k < S; k += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + k)));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float amax = _mm_cvtss_f32(m4);
      const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
      r.d[b] = d;
      const __m256 iv = _mm256_set1_ps(id);
      int8_t* q = r.q.data() + b * S;
      for (int k = 0; k < S; k += 8) {
        const __m256i v = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + k), iv),
                                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k), _mm_packs_epi16(w16, w16));
      }
      int total = 0;
      for (int l = 0; l < S / 16; ++l) {
        int sum = 0;
        for (int k = 0; k < 16; ++k) sum += q[16 * l + k];
        r.bsum[b * (S / 16) + l] = static_cast<int16_t>(sum);
        if (S == 256 && layouts && (l & 1)) r.bsum2[b * 8 + l / 2] = r.bsum[b * 16 + l - 1] + sum;
        total += sum;
      }
      if (S == 32) r.sx[b] = d * static_cast<float>(total);
      if (S == 256 && layouts) {
        __m256i v[8];
        for (int s = 0; s < 8; ++s) v[s] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * s));
        interleave_quants(v);
        for (int s = 0; s < 8; ++s) _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.qi.data() + b * S + 32 * s), v[s]);
#if ROWSTABLE_VNNI
        if (pairs) {  // the pair layout, and the 16-sums in kz_pass's corr order: lane (q, j, e) = bsum 2 kz_lane(q, j) + e
          __m512i z[4] = {join256(q, q + 64), join256(q + 32, q + 96), join256(q + 128, q + 192), join256(q + 160, q + 224)};
          transpose_dwords512(z[0], z[1], z[2], z[3]);
          for (int k = 0; k < 4; ++k) _mm512_storeu_si512(r.qz.data() + b * S + 64 * k, z[k]);
          int16_t* bz = r.bsz.data() + b * 32;
          for (int qq = 0; qq < 4; ++qq)
            for (int j = 0; j < 4; ++j)
              for (int e = 0; e < 2; ++e) bz[8 * qq + 2 * j + e] = r.bsum[b * 16 + 2 * kz_lane(qq, j) + e];
        }
#endif
      }
    }
  });
}

// Integer-path K-quant decoders. prepare() reads a block's scales: d and c (float, broadcast), scl (int16: the
// part scales in the interleaved layout of interleave_parts, lane L of each 128-bit half holding the
// scale of part L's weights in that half) and coef (int16 [16]: the factor of each 16-slice sum of
// q_x in the correction); quants(p, s) gives part s's 32 unsigned quants as bytes, in the order of
// q_x[32 s .. 32 s + 31]. GROUP: how many of a row's 8 interleaved _mm256_maddubs_epi16 products are
// summed in int16 before one _mm256_madd_epi16 by scl (the largest that cannot overflow: a product's
// lane is at most 2 * 127 * the largest quant, Q4_K 3810 (8 of them 30480), Q5_K 7874 (4: 31496),
// Q6_K 16002 (2: 32004)). FOLD: c == -d, so the correction is subtracted from the integer sum (exact)
// and a block takes one float FMA instead of two.
struct KInt {
  __m256 d, c;  // (in all 8 lanes)
  __m256i scl, coef;
};
// prepare_row(): a block's scales for int_row: scl as KInt's, coef (Q4_K / Q5_K: the 8 mins as int32
// lanes, the factors of bsum2; Q6_K: as KInt's) and f = [d, c] as float lanes 0 and 1 (Q6_K: d)
struct KRow {
  __m256i scl, coef;
  __m128 f;
};

// One row's int32 sums from its 8 parts' int16 products p[s] (natural order): the numbers the
// interleaved path's lanes hold (lane j of each 128-bit half: the scale of part 2j times the sum of
// its 8 lanes in that half, plus the same of part 2j + 1), by interleave_parts' network with an add
// at each level, in int16 while GROUP allows (8: all three levels; 4: two, then the scales' multiply
// on both halves of the last; 2: one, then the multiply by each pair's scales and the other two
// levels in int32). 21-37 instructions a block against the 24 of interleaving a block's weights,
// 7-15 of adding the interleaved products, and the multiplies.
template <int GROUP>
inline __m256i reduce_parts(const __m256i p[8], __m256i scl) {
  __m256i a[4], b[2];
  for (int k = 0; k < 4; ++k)
    a[k] = _mm256_add_epi16(_mm256_unpacklo_epi16(p[2 * k], p[2 * k + 1]), _mm256_unpackhi_epi16(p[2 * k], p[2 * k + 1]));
  if constexpr (GROUP == 2) {  // a[k]: parts 2k, 2k + 1 alternating; times their scales, pairs of int32
    __m256i c[4];
    c[0] = _mm256_madd_epi16(a[0], _mm256_shuffle_epi32(scl, 0x00));
    c[1] = _mm256_madd_epi16(a[1], _mm256_shuffle_epi32(scl, 0x55));
    c[2] = _mm256_madd_epi16(a[2], _mm256_shuffle_epi32(scl, 0xAA));
    c[3] = _mm256_madd_epi16(a[3], _mm256_shuffle_epi32(scl, 0xFF));
    for (int h = 0; h < 2; ++h)
      b[h] = _mm256_add_epi32(_mm256_unpacklo_epi32(c[2 * h], c[2 * h + 1]), _mm256_unpackhi_epi32(c[2 * h], c[2 * h + 1]));
    return _mm256_add_epi32(_mm256_unpacklo_epi64(b[0], b[1]), _mm256_unpackhi_epi64(b[0], b[1]));
  } else {
    for (int h = 0; h < 2; ++h)
      b[h] = _mm256_add_epi16(_mm256_unpacklo_epi32(a[2 * h], a[2 * h + 1]), _mm256_unpackhi_epi32(a[2 * h], a[2 * h + 1]));
    if constexpr (GROUP == 8)
      return _mm256_madd_epi16(_mm256_add_epi16(_mm256_unpacklo_epi64(b[0], b[1]), _mm256_unpackhi_epi64(b[0], b[1])), scl);
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_unpacklo_epi64(b[0], b[1]), scl),
                            _mm256_madd_epi16(_mm256_unpackhi_epi64(b[0], b[1]), scl));
  }
}

struct IntQ4_K {
  static constexpr int BS = 256;
  static constexpr int BB = 144;
  static constexpr int GROUP = 8;
  static constexpr bool FOLD = false;
  static inline void prepare(const uint8_t* p, KInt& st) {
    uint64_t sc, mn;
    k_scale_bytes(p, sc, mn);
    st.scl = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(sc))));
    // mins per 16-slice: m_0 m_0 m_1 m_1 ...
    const __m128i m8 = _mm_cvtsi64_si128(static_cast<int64_t>(mn));
    st.coef = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
    st.d = f16_set1(p);
    st.c = _mm256_xor_ps(f16_set1(p + 2), _mm256_set1_ps(-0.0f));
  }
  static inline void prepare_row(const uint8_t* p, KRow& st) {
    uint64_t sc, mn;
    k_scale_bytes(p, sc, mn);
    st.scl = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(sc))));
    st.coef = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(mn)));
    uint32_t dm;
    std::memcpy(&dm, p, 4);
    st.f = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dm ^ 0x80000000u)));  // d, -dmin (the sign bit of the float16)
  }
  static inline __m256i quants(const uint8_t* p, int s) {
    const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 + 32 * (s >> 1)));
    return _mm256_and_si256((s & 1) ? _mm256_srli_epi16(qs, 4) : qs, _mm256_set1_epi8(0x0F));
  }
};
struct IntQ5_K {
  static constexpr int BS = 256;
  static constexpr int BB = 176;
  static constexpr int GROUP = 4;
  static constexpr bool FOLD = false;
  static inline void prepare(const uint8_t* p, KInt& st) { IntQ4_K::prepare(p, st); }
  static inline void prepare_row(const uint8_t* p, KRow& st) { IntQ4_K::prepare_row(p, st); }
  static inline __m256i quants(const uint8_t* p, int s) {
    const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 48 + 32 * (s >> 1)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
    const __m256i lo = _mm256_and_si256((s & 1) ? _mm256_srli_epi16(qs, 4) : qs, _mm256_set1_epi8(0x0F));
    const __m256i hb = s <= 4 ? _mm256_slli_epi16(qh, 4 - s) : _mm256_srli_epi16(qh, s - 4);
    return _mm256_or_si256(lo, _mm256_and_si256(hb, _mm256_set1_epi8(0x10)));
  }
};
struct IntQ6_K {  // the quants without their offset 32 (q - 32 = quants - 32: coef = 32 sc, c = -d)
  static constexpr int BS = 256;
  static constexpr int BB = 210;
  static constexpr int GROUP = 2;
  static constexpr bool FOLD = true;
  static inline void prepare(const uint8_t* p, KInt& st) {
    const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192));  // 16 int8, one a 16-slice
    st.coef = _mm256_slli_epi16(_mm256_cvtepi8_epi16(sc8), 5);  // 32 * sc_l
    // part s's first 16 weights (the low half) have scale 2s, its last 16 2s + 1
    st.scl = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15)));
    st.d = f16_set1(p + 208);
    st.c = _mm256_xor_ps(st.d, _mm256_set1_ps(-0.0f));
  }
  static inline void prepare_row(const uint8_t* p, KRow& st) {
    const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192));
    st.coef = _mm256_slli_epi16(_mm256_cvtepi8_epi16(sc8), 5);
    st.scl = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15)));
    int16_t h;
    std::memcpy(&h, p + 208, 2);
    st.f = _mm_cvtph_ps(_mm_set1_epi16(h));
  }
  static inline __m256i quants(const uint8_t* p, int s) {
    const int h = s >> 2, t = s & 3;
    const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * h + 32 * (t & 1)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * h));
    const __m256i lo = _mm256_and_si256(t < 2 ? ql : _mm256_srli_epi16(ql, 4), _mm256_set1_epi8(0x0F));
    const __m256i hb = t < 2 ? _mm256_slli_epi16(qh, 4 - 2 * t) : _mm256_srli_epi16(qh, 2 * t - 4);
    return _mm256_or_si256(lo, _mm256_and_si256(hb, _mm256_set1_epi8(0x30)));
  }
};

// a block's float part for one row (slice xb of the activations): acc += d * dx * isum, accc +=
// c * dx * the correction (FOLD: acc += d * dx * (isum - the correction))
template <class D>
inline void accumulate(__m256i isum, const KInt& st, const Q8Rows& xr, int64_t xb, __m256& acc, __m256& accc) {
  const __m256 dx = _mm256_broadcast_ss(xr.d.data() + xb);
  const __m256i corr = _mm256_madd_epi16(st.coef, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr.bsum.data() + xb * 16)));
  if constexpr (D::FOLD) {
    acc = _mm256_fmadd_ps(_mm256_mul_ps(st.d, dx), _mm256_cvtepi32_ps(_mm256_sub_epi32(isum, corr)), acc);
  } else {
    acc = _mm256_fmadd_ps(_mm256_mul_ps(st.d, dx), _mm256_cvtepi32_ps(isum), acc);
    accc = _mm256_fmadd_ps(_mm256_mul_ps(st.c, dx), _mm256_cvtepi32_ps(corr), accc);
  }
}

// mr (2 <= mr <= KQ_MR) activation rows x 1 weight row over nb 256-blocks (one row: int_row). A
// block's quants are decoded and interleaved once for the mr rows; each row then sums its 8 interleaved products in int16 (GROUP at a
// time) and multiplies them by the part scales with one _mm256_madd_epi16 a group: 8 / GROUP
// multiplies a block and row where each part took its own before (9-12 multiply instructions instead
// of 16, the ones that limited a tile of several rows). The integer sums are exact, and their lanes
// hold the same numbers for any mr. Per output: a float32 vector accumulation, block by block, of
// d * dx times the 8 int32 lanes of the scaled dot products, and another of c * dx times those of the
// correction (FOLD: one, of d * dx times their difference); out = hsum8 of their sum. (Two chains of
// one FMA a block, rather than one of two: 8960x1536 Q4_K on 8 and 16 rows ran ~1.2x faster so, the
// rows' chains through memory being what a block waited on.) MR: the row count as a constant (2-8),
// or 0: mr_ rows (9-16), a loop with its accumulators in memory (on 2-8 rows ~5-15% slower than the
// constant counts, one thread).
// int_columns reads one weight row at a time, front to back (the access the hardware prefetchers
// follow best), and prefetches >= 4 KB ahead: a 1-token product read cold from memory ran 1.2-1.6x
// faster so than with tiles of 4 interleaved weight rows 1 tile ahead (one thread, Zen 3). noinline:
// GCC otherwise inlined some tiles into their callers, and a 1536-wide Q4_K product ran ~15% slower so.
template <class D, int MR>
__attribute__((noinline)) void int_tile(const Q8Rows& xr, int64_t row0, int mr_, int64_t K, const uint8_t* w, int64_t rb, int64_t nb, float* y,
                                        int64_t ldy) {
  const int mr = MR ? MR : mr_;
  __m256 acc[MR ? MR : KQ_MR], accc[MR ? MR : KQ_MR];
  for (int i = 0; i < mr; ++i) acc[i] = accc[i] = _mm256_setzero_ps();
  const int64_t pf = rb * std::max<int64_t>(1, (4096 + rb - 1) / rb);  // >= 4 KB ahead, in a later row
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* pb = w + b * D::BB;
    for (int o = 0; o < D::BB; o += 64) _mm_prefetch(reinterpret_cast<const char*>(pb + pf + o), _MM_HINT_T0);
    KInt st;
    D::prepare(pb, st);
    __m256i wq[8];
    for (int s = 0; s < 8; ++s) wq[s] = D::quants(pb, s);
    interleave_quants(wq);
#if ROWSTABLE_VNNI
    // the part scales as int32 lanes: lane L of each half, part L's (lo) and part 4 + L's (hi); each
    // row's 8 dot products into two sums (parts 0-3, 4-7), times them, and neighbouring lanes added
    // (_mm256_hadd_epi32: lane j of a half = lanes 2j and 2j + 1 of lo for j < 2, lanes 2j - 4 and
    // 2j - 3 of hi for j >= 2): the lanes of the AVX2 build's _mm256_madd_epi16 by scl
    const __m256i scl_lo = _mm256_srai_epi32(_mm256_unpacklo_epi16(st.scl, st.scl), 16);
    const __m256i scl_hi = _mm256_srai_epi32(_mm256_unpackhi_epi16(st.scl, st.scl), 16);
    for (int i = 0; i < mr; ++i) {
      const __m256i* xq = reinterpret_cast<const __m256i*>(xr.qi.data() + (row0 + i) * K + b * 256);
      __m256i lo = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wq[0], _mm256_loadu_si256(xq));
      __m256i hi = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wq[4], _mm256_loadu_si256(xq + 4));
      for (int k = 1; k < 4; ++k) {
        lo = _mm256_dpbusd_epi32(lo, wq[k], _mm256_loadu_si256(xq + k));
        hi = _mm256_dpbusd_epi32(hi, wq[4 + k], _mm256_loadu_si256(xq + 4 + k));
      }
      // (Q4_K, GROUP 8: a part's sum over a half fits int16, |sum| <= 16 * 15 * 127, so the two sums
      // are packed to int16 lanes in the order of scl and take one _mm256_madd_epi16 instead)
      const __m256i isum = D::GROUP == 8 ? _mm256_madd_epi16(_mm256_packs_epi32(lo, hi), st.scl)
                                         : _mm256_hadd_epi32(_mm256_mullo_epi32(lo, scl_lo), _mm256_mullo_epi32(hi, scl_hi));
      accumulate<D>(isum, st, xr, (row0 + i) * (K / 256) + b, acc[i], accc[i]);
    }
#else
    for (int i = 0; i < mr; ++i) {
      const int8_t* xq = xr.qi.data() + (row0 + i) * K + b * 256;
      __m256i isum = _mm256_setzero_si256();
      for (int g = 0; g < 8; g += D::GROUP) {
        __m256i p16 = _mm256_maddubs_epi16(wq[g], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * g)));
        for (int k = g + 1; k < g + D::GROUP; ++k)
          p16 = _mm256_add_epi16(p16, _mm256_maddubs_epi16(wq[k], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * k))));
        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p16, st.scl));
      }
      accumulate<D>(isum, st, xr, (row0 + i) * (K / 256) + b, acc[i], accc[i]);
    }
#endif
  }
  for (int i = 0; i < mr; ++i) y[i * ldy] = hsum8(D::FOLD ? acc[i] : _mm256_add_ps(acc[i], accc[i]));
}

// One activation row (a plain decoding step) x 1 weight row over nb 256-blocks: the numbers of
// int_tile's lanes, without interleaving. A block's 8 parts are multiplied in their natural order and
// reduced by reduce_parts to the same int32 lanes; the float part takes the block's two scales as
// one float16 pair, [d, c] * dx in one multiply, each broadcast from there (the same products, so the
// same numbers as accumulate()), and Q4_K / Q5_K take the correction's 8 sums from bsum2 (each the
// sum of a pair of bsum's, so each lane again holds the same integer). Every vector instruction
// counts here: a one-row Q4_K block runs ~21 cycles on Zen 4 whether its weights come from L1, L2 or
// L3, bound by its vector instructions and loads rather than by any one chain (its integer part
// alone, without scales or floats, ~12). Against int_tile's one-row branch that this replaced
// (Zen 4, one thread): Q4_K 1.03-1.05x from cache, Q6_K the same (gguf_kernels.py ab --hot); read
// from memory, the kernel functions alone interleaved, Q4_K 1.02-1.04x and Q6_K 1.1-1.25x (ab through
// the op on the loaded shared machine: 0.93-1.14x, no clear sign); the 1.5B Q4_K_M target's one-token
// step 1.05x (gguf_kernels.py verify, three runs).
// Tried and not faster there: _mm256_dpbusd_epi32 with _mm256_packs_epi32 and _mm256_madd_epi16 (by
// ones, or by the scales for Q6_K) in place of reduce_parts; the same on 512-bit registers (half the
// instructions, the same time: a 512-bit one takes a 256-bit unit twice); the float part on 512-bit
// registers; the weights' bytes loaded once rather than folded into each instruction; two weight
// rows a pass (sharing the activations' loads: 1-3%); prefetching to L2 (Q6_K faster, Q4_K slower)
// or further ahead (slower).
// Prefetches as int_tile.
template <class D>
__attribute__((noinline)) void int_row(const Q8Rows& xr, int64_t row0, int64_t K, const uint8_t* w, int64_t rb, int64_t nb, float* y) {
  __m256 acc = _mm256_setzero_ps(), accc = _mm256_setzero_ps();
  const char* pf = reinterpret_cast<const char*>(w) + rb * std::max<int64_t>(1, (4096 + rb - 1) / rb);
  const int8_t* xq = xr.q.data() + row0 * K;
  const float* dx = xr.d.data() + row0 * (K / 256);
  const int16_t* bs = xr.bsum.data() + row0 * (K / 16);
  const int32_t* bs2 = xr.bsum2.data() + row0 * (K / 32);
  for (int64_t b = 0; b < nb; ++b, pf += D::BB, xq += 256) {
    const uint8_t* pb = w + b * D::BB;
    for (int o = 0; o < D::BB; o += 64) _mm_prefetch(pf + o, _MM_HINT_T0);
    KRow st;
    D::prepare_row(pb, st);
    __m256i wq[8];
    for (int s = 0; s < 8; ++s)
      wq[s] = _mm256_maddubs_epi16(D::quants(pb, s), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * s)));
    const __m256i isum = reduce_parts<D::GROUP>(wq, st.scl);
    const __m128 f = _mm_mul_ps(st.f, _mm_broadcast_ss(dx + b));  // d * dx, c * dx (lanes 0, 1)
    if constexpr (D::FOLD) {
      const __m256i corr = _mm256_madd_epi16(st.coef, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs + b * 16)));
      acc = _mm256_fmadd_ps(_mm256_broadcastss_ps(f), _mm256_cvtepi32_ps(_mm256_sub_epi32(isum, corr)), acc);
    } else {
      const __m256i corr = _mm256_madd_epi16(st.coef, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs2 + b * 8)));
      acc = _mm256_fmadd_ps(_mm256_broadcastss_ps(f), _mm256_cvtepi32_ps(isum), acc);
      accc = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(_mm256_castps128_ps256(f), _mm256_set1_epi32(1)), _mm256_cvtepi32_ps(corr), accc);
    }
  }
  *y = hsum8(D::FOLD ? acc : _mm256_add_ps(acc, accc));
}

#if ROWSTABLE_VNNI
// kz_pass: 2 weight rows x up to KZ_ROWS activation rows over nb 256-blocks, on 512-bit
// registers, in the pair layout (transpose_dwords512; the activations' copy: Q8Rows.qz). Every
// output gets int_tile's numbers: each int32 lane holds the integer of int_tile's lane kz_lane(q, j)
// of its weight row, and the float part runs the same operations on each lane, two weight rows'
// lanes side by side in one register (acc, accc in lane order (q, j)); at the end each output's 8
// lanes are put back in int_tile's order (kz_idx.fin) and summed by hsum8. Against int_tile's 18-19
// instructions a block and row (16 of them 256-bit dot products, sums and float work), a pair of
// rows takes 17 (Q4_K) to 22 (Q5_K) for both: 8 dpbusd of 64 bytes, the part scales (one packs and
// one madd where a part's sums fit int16, Q4_K; else two mullo and two permutes), the correction's
// madd, and the float part once for both rows; and a block's weights are decoded once for all the rows.
struct KzIdx {
  alignas(64) int16_t scl4[32], coef4[32], coef6[32];
  alignas(64) int32_t scl5[2][16], scl6[16], even[16], odd[16], fin[2][16];
  alignas(64) int32_t dsel[16], csel[16], dsel6[16];
  KzIdx() {
    for (int q = 0; q < 4; ++q)
      for (int j = 0; j < 4; ++j) {
        const int l = 4 * q + j, w = j >> 1;
        for (int e = 0; e < 2; ++e) {
          scl4[8 * q + 2 * j + e] = static_cast<int16_t>(8 * ((2 * j + e) >> 2) + kz_part(q, (2 * j + e) & 3));
          coef4[8 * q + 2 * j + e] = static_cast<int16_t>(8 * w + kz_lane(q, j));
          coef6[8 * q + 2 * j + e] = static_cast<int16_t>(16 * w + 2 * kz_lane(q, j) + e);
        }
        for (int r = 0; r < 2; ++r) scl5[r][l] = 8 * r + kz_part(q, j);
        scl6[l] = 2 * kz_part(q, j) + (q & 1);
        even[l] = 16 * w + 4 * q + 2 * (j & 1);
        odd[l] = even[l] + 1;
        dsel[l] = 2 * w;
        csel[l] = 2 * w + 1;
        dsel6[l] = w;
      }
    for (int r = 0; r < 2; ++r)
      for (int n = 0; n < 16; ++n) {  // int_tile's lane n = 4 h + jp of row r: lane (2 (jp & 1) + h, 2 r + (jp >> 1))
        const int h = (n & 7) >> 2, jp = n & 3;
        fin[r][n] = 4 * (2 * (jp & 1) + h) + 2 * r + (jp >> 1);
      }
  }
};
const KzIdx kz_idx;

inline __m512i kz_load(const int16_t* t) { return _mm512_load_si512(t); }
inline __m512i kz_load(const int32_t* t) { return _mm512_load_si512(t); }

// two weight rows' block (p0, p1) for kz_pass: quants (v[row][4], pair layout) and scales: scl
// (GROUP 8: int16 lane (q, m), the scale of part kz_part(q, m & 3) of row m >> 2, for the madd after
// packing both rows' sums), scl32 (else: int32 lane (q, i) of each row: the scale of part kz_part(q, i)'s
// half q & 1), coef (int16 lane (q, j, e): the factor of 16-sum 2 kz_lane(q, j) + e of row j >> 1 in
// the correction, as KInt's coef), d and c (float lane (q, j): row j >> 1's, as KInt's)
struct KPair {
  __m512i v[2][4];
  __m512i scl, scl32[2], coef;
  __m512 d, c;
};

inline void kz_k4_scales(const uint8_t* p0, const uint8_t* p1, bool int32_scales, KPair& st) {
  uint64_t sc0, mn0, sc1, mn1;
  k_scale_bytes(p0, sc0, mn0);
  k_scale_bytes(p1, sc1, mn1);
  const __m256i s16 = _mm256_cvtepu8_epi16(_mm_set_epi64x(static_cast<int64_t>(sc1), static_cast<int64_t>(sc0)));
  const __m256i m16 = _mm256_cvtepu8_epi16(_mm_set_epi64x(static_cast<int64_t>(mn1), static_cast<int64_t>(mn0)));
  if (int32_scales) {
    const __m512i s32 = _mm512_cvtepu16_epi32(s16);
    st.scl32[0] = _mm512_permutexvar_epi32(kz_load(kz_idx.scl5[0]), s32);
    st.scl32[1] = _mm512_permutexvar_epi32(kz_load(kz_idx.scl5[1]), s32);
  } else {
    st.scl = _mm512_permutexvar_epi16(kz_load(kz_idx.scl4), _mm512_castsi256_si512(s16));
  }
  st.coef = _mm512_permutexvar_epi16(kz_load(kz_idx.coef4), _mm512_castsi256_si512(m16));
  uint32_t dm0, dm1;
  std::memcpy(&dm0, p0, 4);
  std::memcpy(&dm1, p1, 4);
  // d, -dmin of each row (the sign bit of the second float16 flipped), as KInt's d and c
  const __m128 f = _mm_cvtph_ps(_mm_set_epi32(0, 0, static_cast<int>(dm1 ^ 0x80000000u), static_cast<int>(dm0 ^ 0x80000000u)));
  st.d = _mm512_permutexvar_ps(kz_load(kz_idx.dsel), _mm512_castps128_ps512(f));
  st.c = _mm512_permutexvar_ps(kz_load(kz_idx.csel), _mm512_castps128_ps512(f));
}

// the rotation (by 64-bit lane, lower and upper 256 bits) that takes bit `lo` / `hi` of each byte to bit 4
inline __m512i kz_rot(int lo, int hi) {
  const long long a = (4 - lo) & 63, b = (4 - hi) & 63;
  return _mm512_set_epi64(b, b, b, b, a, a, a, a);
}

// the 4-bit quants of a Q4_K / Q5_K block's 128 bytes at qs as parts [0 | 2], [1 | 3], [4 | 6], [5 | 7]
// (bytes 0-63: parts 0, 2 in the low nibbles, 1, 3 in the high ones; bytes 64-127: parts 4-7)
inline void kz_nibbles(const uint8_t* qs, __m512i v[4]) {
  const __m512i f = _mm512_set1_epi8(0x0F), a = _mm512_loadu_si512(qs), b = _mm512_loadu_si512(qs + 64);
  v[0] = _mm512_and_si512(a, f);
  v[1] = _mm512_and_si512(_mm512_srli_epi16(a, 4), f);
  v[2] = _mm512_and_si512(b, f);
  v[3] = _mm512_and_si512(_mm512_srli_epi16(b, 4), f);
}
struct PairQ4_K {
  static constexpr int KZ_MR = 6;
  static inline void prepare(const uint8_t* p0, const uint8_t* p1, KPair& st) {
    const uint8_t* ps[2] = {p0, p1};
    for (int r = 0; r < 2; ++r) {
      kz_nibbles(ps[r] + 16, st.v[r]);
      transpose_dwords512(st.v[r][0], st.v[r][1], st.v[r][2], st.v[r][3]);
    }
    kz_k4_scales(p0, p1, false, st);
  }
};
struct PairQ5_K {
  static constexpr int KZ_MR = 6;
  static inline void prepare(const uint8_t* p0, const uint8_t* p1, KPair& st) {
    const uint8_t* ps[2] = {p0, p1};
    const __m512i b4 = _mm512_set1_epi8(0x10);
    const int bits[4][2] = {{0, 2}, {1, 3}, {4, 6}, {5, 7}};  // (the parts of each vector)
    for (int r = 0; r < 2; ++r) {  // Q4_K's nibbles at 48, and the fifth bit s of part s from byte l of the 32 at 16
      const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ps[r] + 16)));
      __m512i* v = st.v[r];
      kz_nibbles(ps[r] + 48, v);
      for (int k = 0; k < 4; ++k)
        v[k] = _mm512_or_si512(v[k], _mm512_and_si512(_mm512_rolv_epi64(h, kz_rot(bits[k][0], bits[k][1])), b4));
      transpose_dwords512(v[0], v[1], v[2], v[3]);
    }
    kz_k4_scales(p0, p1, true, st);
  }
};
struct PairQ6_K {
  static constexpr int KZ_MR = 8;
  static inline void prepare(const uint8_t* p0, const uint8_t* p1, KPair& st) {
    const uint8_t* ps[2] = {p0, p1};
    const __m512i f = _mm512_set1_epi8(0x0F), b45 = _mm512_set1_epi8(0x30);
    const __m512i hi_nibble = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);
    for (int r = 0; r < 2; ++r) {  // part 4 h + t: the low (t < 2) or high nibble of ql byte 64 h + 32 (t & 1) + l,
      const uint8_t* p = ps[r];     // bits 2 t, 2 t + 1 of qh byte 128 + 32 h + l; vector k = parts [k' | k' + 2]
      for (int k = 0; k < 4; ++k) {
        const int h = k >> 1, t = k & 1;  // (vectors 0-3: parts [0 | 2], [1 | 3], [4 | 6], [5 | 7])
        const __m512i ql = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * h + 32 * t)));
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * h)));
        const __m512i lo = _mm512_and_si512(_mm512_srlv_epi64(ql, hi_nibble), f);
        // bits 2t, 2t + 1 (and 2t + 4, 2t + 5 for the upper part) to bits 4, 5
        const __m512i hb = _mm512_and_si512(_mm512_rolv_epi64(qh, kz_rot(2 * t, 2 * t + 4)), b45);
        st.v[r][k] = _mm512_or_si512(lo, hb);
      }
      transpose_dwords512(st.v[r][0], st.v[r][1], st.v[r][2], st.v[r][3]);
    }
    st.scl32[0] = _mm512_permutexvar_epi32(kz_load(kz_idx.scl6), _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p0 + 192))));
    st.scl32[1] = _mm512_permutexvar_epi32(kz_load(kz_idx.scl6), _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p1 + 192))));
    const __m256i sc = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p0 + 192))),
                                               _mm_loadu_si128(reinterpret_cast<const __m128i*>(p1 + 192)), 1);
    st.coef = _mm512_permutexvar_epi16(kz_load(kz_idx.coef6), _mm512_slli_epi16(_mm512_cvtepi8_epi16(sc), 5));  // 32 sc
    int16_t h0, h1;
    std::memcpy(&h0, p0 + 208, 2);
    std::memcpy(&h1, p1 + 208, 2);
    st.d = _mm512_permutexvar_ps(kz_load(kz_idx.dsel6), _mm512_castps128_ps512(_mm_cvtph_ps(_mm_set_epi16(0, 0, 0, 0, 0, 0, h1, h0))));
    st.c = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(st.d), _mm512_set1_epi32(INT32_MIN)));  // -d
  }
};
template <class D> struct PairOf;
template <> struct PairOf<IntQ4_K> { using T = PairQ4_K; };
template <> struct PairOf<IntQ5_K> { using T = PairQ5_K; };
template <> struct PairOf<IntQ6_K> { using T = PairQ6_K; };

// MR activation rows (row0..) of one block b of the weight rows' pair st: acc, accc (lanes (q, j)) updated
template <class D, int MR>
__attribute__((always_inline)) inline void kz_rows(const KPair& st, const Q8Rows& xr, int64_t row0, int64_t K, int64_t b,
                                                   __m512* acc, __m512* accc, __m512i even, __m512i odd) {
  for (int i = 0; i < MR; ++i) {
    const int64_t xb = (row0 + i) * (K / 256) + b;
    const __m512i* xq = reinterpret_cast<const __m512i*>(xr.qz.data() + xb * 256);
    const __m512i x0 = _mm512_load_si512(xq), x1 = _mm512_load_si512(xq + 1), x2 = _mm512_load_si512(xq + 2),
                  x3 = _mm512_load_si512(xq + 3);
    __m512i r[2];
    for (int j = 0; j < 2; ++j) {
      __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), st.v[j][0], x0);
      t = _mm512_dpbusd_epi32(t, st.v[j][1], x1);
      t = _mm512_dpbusd_epi32(t, st.v[j][2], x2);
      r[j] = _mm512_dpbusd_epi32(t, st.v[j][3], x3);
    }
    __m512i isum;
    if constexpr (D::GROUP == 8) {  // (a part half's sum fits int16: |sum| <= 16 * 15 * 127)
      isum = _mm512_madd_epi16(_mm512_packs_epi32(r[0], r[1]), st.scl);
    } else {
      const __m512i m0 = _mm512_mullo_epi32(r[0], st.scl32[0]), m1 = _mm512_mullo_epi32(r[1], st.scl32[1]);
      isum = _mm512_add_epi32(_mm512_permutex2var_epi32(m0, even, m1), _mm512_permutex2var_epi32(m0, odd, m1));
    }
    const __m512 dx = _mm512_set1_ps(xr.d[xb]);
    const __m512i corr = _mm512_madd_epi16(st.coef, _mm512_load_si512(xr.bsz.data() + xb * 32));
    if constexpr (D::FOLD) {
      acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(st.d, dx), _mm512_cvtepi32_ps(_mm512_sub_epi32(isum, corr)), acc[i]);
    } else {
      acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(st.d, dx), _mm512_cvtepi32_ps(isum), acc[i]);
      accc[i] = _mm512_fmadd_ps(_mm512_mul_ps(st.c, dx), _mm512_cvtepi32_ps(corr), accc[i]);
    }
  }
}

// The weight rows n, n + 1 (at w) for activation rows m0..m0 + M (2 <= M <= KZ_ROWS), block by block:
// each block's pair decoded once (a decoding took ~35 cycles on Sapphire Rapids, about 3 rows' work)
// for all M rows, in row tiles of up to KZ_MR kept in registers for the block (the running sums of
// all M rows wait in L1 between blocks).
constexpr int64_t KZ_ROWS = 32;

template <class D>
__attribute__((noinline)) void kz_pass(const Q8Rows& xr, int64_t m0, int64_t M, int64_t K, const uint8_t* w, int64_t rb,
                                       float* y, int64_t ldy) {
  using P = typename PairOf<D>::T;
  constexpr int64_t MRZ = P::KZ_MR;
  const int64_t nb = K / 256;
  __m512 acc[KZ_ROWS], accc[KZ_ROWS];
  for (int64_t i = 0; i < M; ++i) acc[i] = accc[i] = _mm512_setzero_ps();
  const int64_t tiles = (M + MRZ - 1) / MRZ;
  const int64_t pf = 2 * rb * std::max<int64_t>(1, (4096 + 2 * rb - 1) / (2 * rb));  // >= 4 KB ahead, a later pair of rows
  const __m512i even = kz_load(kz_idx.even), odd = kz_load(kz_idx.odd);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p0 = w + b * D::BB;
    for (int o = 0; o < D::BB; o += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(p0 + pf + o), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p0 + rb + pf + o), _MM_HINT_T0);
    }
    KPair st;
    P::prepare(p0, p0 + rb, st);
    for (int64_t t = 0; t < tiles; ++t) {  // row tiles as even as M allows
      const int64_t a = t * M / tiles, e = (t + 1) * M / tiles, r0 = m0 + a;
      __m512 *ac = acc + a, *cc = accc + a;
      switch (e - a) {
        case 1: kz_rows<D, 1>(st, xr, r0, K, b, ac, cc, even, odd); break;
        case 2: kz_rows<D, 2>(st, xr, r0, K, b, ac, cc, even, odd); break;
        case 3: kz_rows<D, 3>(st, xr, r0, K, b, ac, cc, even, odd); break;
        case 4: kz_rows<D, 4>(st, xr, r0, K, b, ac, cc, even, odd); break;
        case 5: kz_rows<D, 5>(st, xr, r0, K, b, ac, cc, even, odd); break;
        case 6: kz_rows<D, 6>(st, xr, r0, K, b, ac, cc, even, odd); break;
        case 7: if constexpr (MRZ >= 7) kz_rows<D, 7>(st, xr, r0, K, b, ac, cc, even, odd); break;
        default: if constexpr (MRZ >= 8) kz_rows<D, 8>(st, xr, r0, K, b, ac, cc, even, odd); break;
      }
    }
  }
  const __m512i fin0 = kz_load(kz_idx.fin[0]), fin1 = kz_load(kz_idx.fin[1]);
  for (int64_t i = 0; i < M; ++i) {
    const __m512 s = D::FOLD ? acc[i] : _mm512_add_ps(acc[i], accc[i]);
    y[i * ldy] = hsum8(_mm512_castps512_ps256(_mm512_permutexvar_ps(fin0, s)));
    y[i * ldy + 1] = hsum8(_mm512_castps512_ps256(_mm512_permutexvar_ps(fin1, s)));
  }
}
#endif

// The 32-weight block types on 8-bit activations (llama.cpp's ggml_vec_dot_q*_q8_0 / _q8_1): a block
// contributes d * dx * <q_w, q_x> + c * sx, the dot product exact in int32 (the quants unsigned, or
// for Q8_0 signed through |q_w| and the sign moved onto q_x), c the block's offset (Q4_0: -8 d,
// Q5_0: -16 d) or minimum (Q4_1, Q5_1), sx = dx * sum q_x (Q8Rows). Per output: a float32 vector
// accumulation of the first terms and a scalar one of the second, block by block in order.
inline __m256i nibbles32(const uint8_t* q16) {  // weights 0-15 low nibbles, 16-31 high
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q16));
  const __m128i f = _mm_set1_epi8(0x0F);
  return _mm256_setr_m128i(_mm_and_si128(b, f), _mm_and_si128(_mm_srli_epi16(b, 4), f));
}
inline __m256i bits16_32(const uint8_t* qh) {  // 16 in byte i where bit i of the 32 bits is set
  uint32_t h;
  std::memcpy(&h, qh, 4);
  const __m256i shuf = _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303);
  __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(h)), shuf);
  b = _mm256_or_si256(b, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_and_si256(_mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}
struct Int32Q4_0 {
  static constexpr int BS = 32;
  static constexpr int BB = 18;
  static constexpr bool SIGNED = false, CORR = true;
  static inline __m256i quants(const uint8_t* p) { return nibbles32(p + 2); }
  static inline void scales(const uint8_t* p, float& d, float& c) { d = f16_at(p); c = -8.0f * d; }
};
struct Int32Q4_1 {
  static constexpr int BS = 32;
  static constexpr int BB = 20;
  static constexpr bool SIGNED = false, CORR = true;
  static inline __m256i quants(const uint8_t* p) { return nibbles32(p + 4); }
  static inline void scales(const uint8_t* p, float& d, float& c) { d = f16_at(p); c = f16_at(p + 2); }
};
struct Int32Q5_0 {
  static constexpr int BS = 32;
  static constexpr int BB = 22;
  static constexpr bool SIGNED = false, CORR = true;
  static inline __m256i quants(const uint8_t* p) { return _mm256_or_si256(nibbles32(p + 6), bits16_32(p + 2)); }
  static inline void scales(const uint8_t* p, float& d, float& c) { d = f16_at(p); c = -16.0f * d; }
};
struct Int32Q5_1 {
  static constexpr int BS = 32;
  static constexpr int BB = 24;
  static constexpr bool SIGNED = false, CORR = true;
  static inline __m256i quants(const uint8_t* p) { return _mm256_or_si256(nibbles32(p + 8), bits16_32(p + 4)); }
  static inline void scales(const uint8_t* p, float& d, float& c) { d = f16_at(p); c = f16_at(p + 2); }
};
struct Int32Q8_0 {
  static constexpr int BS = 32;
  static constexpr int BB = 34;
  static constexpr bool SIGNED = true, CORR = false;
  static inline __m256i quants(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2)); }
  static inline void scales(const uint8_t* p, float& d, float& c) { d = f16_at(p); c = 0.0f; }
};

template <class D, int MR, int NR>
void int32_tile(const Q8Rows& xr, int64_t row0, int64_t K, const uint8_t* w, int64_t rb, int64_t nb, float* y, int64_t ldy) {
  __m256 acc[MR][NR];
  float accc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps(), accc[i][j] = 0.0f;
  const int64_t pf = NR * rb;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* pb = w + b * D::BB;
    for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(pb + j * rb + pf), _MM_HINT_T0);
    __m256i xq[MR];
    float dx[MR], sx[MR];
    for (int i = 0; i < MR; ++i) {
      const int64_t xb = (row0 + i) * nb + b;
      xq[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr.q.data() + xb * 32));
      dx[i] = xr.d[xb];
      if (D::CORR) sx[i] = xr.sx[xb];
    }
    for (int j = 0; j < NR; ++j) {
      const __m256i wq = D::quants(pb + j * rb);
      float d, c;
      D::scales(pb + j * rb, d, c);
      const __m256i wa = D::SIGNED ? _mm256_sign_epi8(wq, wq) : wq;
      for (int i = 0; i < MR; ++i) {
        const __m256i xs = D::SIGNED ? _mm256_sign_epi8(xq[i], wq) : xq[i];
#if ROWSTABLE_VNNI
        const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wa, xs);
#else
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(wa, xs), ones);
#endif
        acc[i][j] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx[i]), _mm256_cvtepi32_ps(dot), acc[i][j]);
        if (D::CORR) accc[i][j] = std::fma(c, sx[i], accc[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * ldy + j] = hsum8(acc[i][j]) + accc[i][j];
}

#if ROWSTABLE_VNNI
// iz_tile: int32_tile for 2 weight rows x MR activation rows (2 <= MR <= IZ_MR) on 512-bit registers,
// the VNNI build's multi-row path: a block of each weight row side by side in one register (lanes 0-7,
// 8-15), the activations' block in both halves, so one _mm512_dpbusd_epi32 gives both rows' int32
// lanes of int32_tile and the float part runs once for both (d * dx, then the FMA, as int32_tile
// does lane by lane; the offsets' / minimums' c * sx as int32_tile's scalar fma, in lanes 0 and 8).
// Q8_0's quants are signed, and AVX-512 has no _mm256_sign_epi8: the activations go in as unsigned
// q + 128 (bytes ^ 0x80) and each lane starts from -128 x the sum of its 4 weight quants (the same
// exact integer: sum (q + 128) w - 128 sum w = sum q w).
constexpr int IZ_MR = 8;
// [a x 8 | b x 8]
inline __m512 bz_halves(float a, float b) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_set1_ps(a))),
                                             _mm256_castps_pd(_mm256_set1_ps(b)), 1));
}

template <class D, int MR>
__attribute__((noinline)) void iz_tile(const Q8Rows& xr, int64_t row0, int64_t K, const uint8_t* w, int64_t rb, int64_t nb,
                                       float* y, int64_t ldy) {
  __m512 acc[MR], accc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = accc[i] = _mm512_setzero_ps();
  const int64_t pf = 2 * rb;  // the same block of the next pair of rows
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p0 = w + b * D::BB;
    const uint8_t* p1 = p0 + rb;
    _mm_prefetch(reinterpret_cast<const char*>(p0 + pf), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p1 + pf), _MM_HINT_T0);
    const __m512i wq = _mm512_inserti64x4(_mm512_castsi256_si512(D::quants(p0)), D::quants(p1), 1);
    // (Q8_0: -128 x each lane's 4 signed quants; else 0)
    const __m512i start = D::SIGNED ? _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), flip, wq))
                                    : _mm512_setzero_si512();
    float d0, c0, d1, c1;
    D::scales(p0, d0, c0);
    D::scales(p1, d1, c1);
    const __m512 d = bz_halves(d0, d1), c = bz_halves(c0, c1);
    for (int i = 0; i < MR; ++i) {
      const int64_t xb = (row0 + i) * nb + b;
      __m512i xq = _mm512_broadcast_i64x4(_mm256_load_si256(reinterpret_cast<const __m256i*>(xr.q.data() + xb * 32)));
      const __m512i dot = D::SIGNED ? _mm512_dpbusd_epi32(start, _mm512_xor_si512(xq, flip), wq)
                                    : _mm512_dpbusd_epi32(start, wq, xq);
      acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(xr.d[xb])), _mm512_cvtepi32_ps(dot), acc[i]);
      if (D::CORR) accc[i] = _mm512_fmadd_ps(c, _mm512_set1_ps(xr.sx[xb]), accc[i]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    y[i * ldy] = hsum8(_mm512_castps512_ps256(acc[i])) + _mm512_cvtss_f32(accc[i]);
    y[i * ldy + 1] = hsum8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[i]), 1))) +
                     _mm_cvtss_f32(_mm512_extractf32x4_ps(accc[i], 2));
  }
}

template <class D>
void iz_tiles(const Q8Rows& xr, int64_t m0, int64_t mr, int64_t K, const uint8_t* wn, int64_t rb, float* y, int64_t ldy) {
  const int64_t nb = K / 32;
  switch (mr) {
    case 2: iz_tile<D, 2>(xr, m0, K, wn, rb, nb, y, ldy); break;
    case 3: iz_tile<D, 3>(xr, m0, K, wn, rb, nb, y, ldy); break;
    case 4: iz_tile<D, 4>(xr, m0, K, wn, rb, nb, y, ldy); break;
    case 5: iz_tile<D, 5>(xr, m0, K, wn, rb, nb, y, ldy); break;
    case 6: iz_tile<D, 6>(xr, m0, K, wn, rb, nb, y, ldy); break;
    case 7: iz_tile<D, 7>(xr, m0, K, wn, rb, nb, y, ldy); break;
    default: iz_tile<D, 8>(xr, m0, K, wn, rb, nb, y, ldy); break;
  }
}
#endif

#if ROWSTABLE_VNNI
// The VNNI build's products of several rows: weight rows n0..n1 in pairs, the M activation rows in
// runs of at most `most`, as even as M allows; f(a, e, n): rows a..e by weight rows n, n + 1. Returns
// the weight row left over (n1, or an odd last one, for the 256-bit code).
template <class F>
int64_t in_pairs(int64_t M, int64_t n0, int64_t n1, int64_t most, F&& f) {
  const int64_t runs = (M + most - 1) / most;
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2)
    for (int64_t t = 0; t < runs; ++t) f(t * M / runs, (t + 1) * M / runs, n);
  return n;
}
#endif

// rows n0..n1 of the output for all M activation rows: the K-quants in tiles of up to KQ_MR rows
// (int_tile; a tile of one row: int_row), the block types in tiles of up to INT_MR rows (int32_tile)
template <class D>
void int_columns(const Q8Rows& xr, int64_t M, int64_t K, const uint8_t* w, int64_t rb, int64_t n0, int64_t n1, float* y,
                 int64_t ldy) {
  if constexpr (D::BS == 256) {
#if ROWSTABLE_VNNI
    if (M >= 2) {  // pairs of weight rows (kz_pass), up to KZ_ROWS activation rows a pass; an odd last row as below
      n0 = in_pairs(M, n0, n1, KZ_ROWS, [&](int64_t a, int64_t e, int64_t n) {
        kz_pass<D>(xr, a, e - a, K, w + n * rb, rb, y + a * ldy + n, ldy);
      });
      if (n0 == n1) return;
    }
#endif
    for (int64_t m = 0; m < M; m += KQ_MR) {
      const int64_t mr = std::min<int64_t>(KQ_MR, M - m);
      float* ym = y + m * ldy;
      for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* wn = w + n * rb;
        switch (mr) {
          case 1: int_row<D>(xr, m, K, wn, rb, K / 256, ym + n); break;
          case 2: int_tile<D, 2>(xr, m, 2, K, wn, rb, K / 256, ym + n, ldy); break;
          case 3: int_tile<D, 3>(xr, m, 3, K, wn, rb, K / 256, ym + n, ldy); break;
          case 4: int_tile<D, 4>(xr, m, 4, K, wn, rb, K / 256, ym + n, ldy); break;
          case 5: int_tile<D, 5>(xr, m, 5, K, wn, rb, K / 256, ym + n, ldy); break;
          case 6: int_tile<D, 6>(xr, m, 6, K, wn, rb, K / 256, ym + n, ldy); break;
          case 7: int_tile<D, 7>(xr, m, 7, K, wn, rb, K / 256, ym + n, ldy); break;
          case 8: int_tile<D, 8>(xr, m, 8, K, wn, rb, K / 256, ym + n, ldy); break;
          default: int_tile<D, 0>(xr, m, static_cast<int>(mr), K, wn, rb, K / 256, ym + n, ldy); break;
        }
      }
    }
  } else {
#if ROWSTABLE_VNNI
    if (M >= 2) {  // pairs of weight rows (iz_tile) in row tiles of at most IZ_MR; an odd last row as below
      n0 = in_pairs(M, n0, n1, IZ_MR, [&](int64_t a, int64_t e, int64_t n) {
        iz_tiles<D>(xr, a, e - a, K, w + n * rb, rb, y + a * ldy + n, ldy);
      });
      if (n0 == n1) return;
    }
#endif
    for (int64_t m = 0; m < M; m += INT_MR) {
      const int64_t mr = std::min<int64_t>(INT_MR, M - m);
      float* ym = y + m * ldy;
      int64_t n = n0;
      if (mr == 1) {
        for (; n + 4 <= n1; n += 4) int32_tile<D, 1, 4>(xr, m, K, w + n * rb, rb, K / 32, ym + n, ldy);
        for (; n < n1; ++n) int32_tile<D, 1, 1>(xr, m, K, w + n * rb, rb, K / 32, ym + n, ldy);
      } else if (mr == 2) {
        for (; n + 2 <= n1; n += 2) int32_tile<D, 2, 2>(xr, m, K, w + n * rb, rb, K / 32, ym + n, ldy);
        for (; n < n1; ++n) int32_tile<D, 2, 1>(xr, m, K, w + n * rb, rb, K / 32, ym + n, ldy);
      } else if (mr == 3) {
        for (; n < n1; ++n) int32_tile<D, 3, 1>(xr, m, K, w + n * rb, rb, K / 32, ym + n, ldy);
      } else {
        for (; n < n1; ++n) int32_tile<D, 4, 1>(xr, m, K, w + n * rb, rb, K / 32, ym + n, ldy);
      }
    }
  }
}

// (the activations' slice width: 256 for the K-quants, 32 for the block types, 0 for a type without)
int64_t int_slice(int64_t t) {
  switch (t) {
    case 12: case 13: case 14: return 256;
    case 2: case 3: case 6: case 7: case 8: return 32;
    default: return 0;
  }
}

void int_path(int64_t t, const Q8Rows& xr, int64_t M, int64_t K, const uint8_t* w, int64_t rb, int64_t n0, int64_t n1,
              float* y, int64_t ldy) {
  switch (t) {
    case 12: int_columns<IntQ4_K>(xr, M, K, w, rb, n0, n1, y, ldy); break;
    case 13: int_columns<IntQ5_K>(xr, M, K, w, rb, n0, n1, y, ldy); break;
    case 14: int_columns<IntQ6_K>(xr, M, K, w, rb, n0, n1, y, ldy); break;
    case 2: int_columns<Int32Q4_0>(xr, M, K, w, rb, n0, n1, y, ldy); break;
    case 3: int_columns<Int32Q4_1>(xr, M, K, w, rb, n0, n1, y, ldy); break;
    case 6: int_columns<Int32Q5_0>(xr, M, K, w, rb, n0, n1, y, ldy); break;
    case 7: int_columns<Int32Q5_1>(xr, M, K, w, rb, n0, n1, y, ldy); break;
    default: int_columns<Int32Q8_0>(xr, M, K, w, rb, n0, n1, y, ldy); break;
  }
}

// ggml type id -> (weights a block, bytes a block); 0 for a type these kernels do not read
struct GgufType { int bs, bb; const char* name; };
GgufType gguf_type(int64_t t) {
  switch (t) {
    case 0: return {1, 4, "F32"};
    case 1: return {1, 2, "F16"};
    case 2: return {32, 18, "Q4_0"};
    case 3: return {32, 20, "Q4_1"};
    case 6: return {32, 22, "Q5_0"};
    case 7: return {32, 24, "Q5_1"};
    case 8: return {32, 34, "Q8_0"};
    case 12: return {256, 144, "Q4_K"};
    case 13: return {256, 176, "Q5_K"};
    case 14: return {256, 210, "Q6_K"};
    case 30: return {1, 2, "BF16"};
    default: return {0, 0, ""};
  }
}

// the checked bytes-per-row of a [?, K] tensor of type t held in raw
int64_t gguf_row_bytes(const char* op, const at::Tensor& raw, int64_t t, int64_t K) {
  const GgufType g = gguf_type(t);
  TORCH_CHECK(g.bs > 0, op, ": ggml type ", t, " is not one these kernels read (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, "
              "Q4_K, Q5_K, Q6_K)");
  TORCH_CHECK(K > 0 && K % g.bs == 0, op, ": ", g.name, " rows hold whole blocks of ", g.bs, " weights; K=", K, " is not a multiple");
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.is_contiguous(), op, ": the raw tensor must be contiguous uint8 bytes");
  return K / g.bs * g.bb;
}

template <class F>
void with_decoder(int64_t t, F&& f) {
  switch (t) {
    case 0: f(DecF32{}); break;
    case 1: f(DecF16{}); break;
    case 2: f(DecQ4_0{}); break;
    case 3: f(DecQ4_1{}); break;
    case 6: f(DecQ5_0{}); break;
    case 7: f(DecQ5_1{}); break;
    case 8: f(DecQ8_0{}); break;
    case 12: f(DecQ4_K{}); break;
    case 13: f(DecQ5_K{}); break;
    case 14: f(DecQ6_K{}); break;
    default: f(DecBF16{}); break;  // 30; gguf_row_bytes has rejected any other
  }
}

// Runs f(t, buf) for every task t in [0, tasks) on the intra-op threads, each task once (buf: the
// running thread's scratch vector). Thread i owns the contiguous share [i tasks / n, (i + 1) tasks / n)
// that a static split would give it and takes its tasks one at a time, front to back (each thread
// streams its own stretch of the weights); a thread done with its share then takes the tasks left in
// the others'. Threads that run at different speeds (one slowed by another process on its core, or
// shares of unequal cost: q, k, v of different types) then finish together, where the static split
// left the faster one idle at the barrier; a thread the OS has not run in time takes none (the kernel
// pool, run_participants). Which thread computes a task changes none of its numbers: every output
// is computed by one task alone.
template <class F>
void shared_tasks(int64_t tasks, F&& f) {
  if (tasks <= 0) return;
  const int64_t n = std::min<int64_t>(kernel_threads(), tasks);
  struct alignas(64) Share {
    std::atomic<int64_t> next;
    int64_t end;
  };
  std::unique_ptr<Share[]> share(new Share[n]);
  for (int64_t i = 0; i < n; ++i) {
    share[i].next.store(i * tasks / n, std::memory_order_relaxed);
    share[i].end = (i + 1) * tasks / n;
  }
  run_participants(n, [&](int64_t i) {
    std::vector<float> buf;
    for (int64_t k = 0; k < n; ++k) {  // its own share first, then the others' in turn
      Share& s = share[(i + k) % n];
      for (int64_t t; (t = s.next.fetch_add(1, std::memory_order_relaxed)) < s.end;) f(t, buf);
    }
  });
}

// One weight of a product: its bytes, type, rows, bytes a row, and its first output column.
struct WeightPart {
  const uint8_t* w;
  int64_t type, N, rb, col;
};

// y [M, ldy] columns of every part: one parallel region over all parts' tasks.
// act8: the K-quant parts on the 8-bit activations' integer path (gguf_linear_q8).
void gguf_linear_parts(const float* xp, int64_t M, int64_t K, const std::vector<WeightPart>& parts, float* yp, int64_t ldy,
                       bool act8 = false) {
  std::vector<int64_t> rows(parts.size()), first(parts.size() + 1, 0);
  std::vector<int64_t> slice(parts.size(), 0);
  Q8Rows x256, x32;
  for (size_t p = 0; p < parts.size(); ++p) {
    slice[p] = act8 ? int_slice(parts[p].type) : 0;
    if (slice[p]) rows[p] = 24;
    else with_decoder(parts[p].type, [&](auto d) { rows[p] = task_rows<decltype(d)>(M, K); });
    first[p + 1] = first[p] + (parts[p].N + rows[p] - 1) / rows[p];
  }
  if (std::find(slice.begin(), slice.end(), 256) != slice.end()) quantize_rows_q8(xp, M, K, 256, x256);
  if (std::find(slice.begin(), slice.end(), 32) != slice.end()) quantize_rows_q8(xp, M, K, 32, x32);
  const int64_t tasks = first.back();
  auto run = [&](int64_t t, std::vector<float>& buf) {
    const size_t p = std::upper_bound(first.begin(), first.end(), t) - first.begin() - 1;
    const WeightPart& wp = parts[p];
    const int64_t n0 = (t - first[p]) * rows[p], n1 = std::min(wp.N, n0 + rows[p]);
    if (slice[p]) {
      int_path(wp.type, slice[p] == 256 ? x256 : x32, M, K, wp.w, wp.rb, n0, n1, yp + wp.col, ldy);
      return;
    }
    with_decoder(wp.type, [&](auto d) { gguf_columns<decltype(d)>(xp, M, K, wp.w, wp.rb, n0, n1, yp + wp.col, ldy, buf); });
  };
  shared_tasks(tasks, run);
}

// an uninitialised float32 [..., n] for the rows of x [..., K]
at::Tensor empty_outputs(const at::Tensor& x, int64_t n) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return at::empty(shape, x.options());
}

// x [..., K] @ the concatenation of the weights' rows^T -> [..., sum of N]; each weight's bytes checked.
at::Tensor gguf_linear_cat_impl(const at::Tensor& x_, at::TensorList raws, at::IntArrayRef types, at::IntArrayRef Ns,
                                int64_t K, bool act8) {
  TORCH_CHECK(raws.size() >= 1 && raws.size() == types.size() && raws.size() == Ns.size(),
              "gguf_linear: give one type and one row count for each raw tensor");
  TORCH_CHECK(x_.scalar_type() == at::kFloat && x_.dim() >= 1 && x_.size(-1) == K,
              "gguf_linear: x must be float32 [..., K] with K=", K);
  std::vector<WeightPart> parts;
  int64_t cols = 0;
  for (size_t p = 0; p < raws.size(); ++p) {
    const int64_t rb = gguf_row_bytes("gguf_linear", raws[p], types[p], K);
    TORCH_CHECK(Ns[p] >= 0 && raws[p].numel() == Ns[p] * rb, "gguf_linear: ", gguf_type(types[p]).name, " [", Ns[p], ", ", K,
                "] takes ", Ns[p] * rb, " bytes; the raw tensor holds ", raws[p].numel());
    if (Ns[p] > 0) parts.push_back({raws[p].data_ptr<uint8_t>(), types[p], Ns[p], rb, cols});
    cols += Ns[p];
  }
  const at::Tensor x = x_.contiguous();
  const int64_t M = x.numel() / K;
  at::Tensor y = empty_outputs(x, cols);
  if (M > 0 && cols > 0) gguf_linear_parts(x.data_ptr<float>(), M, K, parts, y.data_ptr<float>(), cols, act8);
  return y;
}

at::Tensor gguf_linear_cat(const at::Tensor& x, at::TensorList raws, at::IntArrayRef types, at::IntArrayRef Ns, int64_t K) {
  return gguf_linear_cat_impl(x, raws, types, Ns, K, false);
}
at::Tensor gguf_linear_cat_q8(const at::Tensor& x, at::TensorList raws, at::IntArrayRef types, at::IntArrayRef Ns, int64_t K) {
  return gguf_linear_cat_impl(x, raws, types, Ns, K, true);
}
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& raw, int64_t t, int64_t N, int64_t K) {
  return gguf_linear_cat_impl(x, {raw}, {t}, {N}, K, false);
}
at::Tensor gguf_linear_q8(const at::Tensor& x, const at::Tensor& raw, int64_t t, int64_t N, int64_t K) {
  return gguf_linear_cat_impl(x, {raw}, {t}, {N}, K, true);
}

at::Tensor gguf_rows(const at::Tensor& raw, int64_t t, const at::Tensor& ids_, int64_t K) {
  const int64_t rb = gguf_row_bytes("gguf_rows", raw, t, K);
  TORCH_CHECK(raw.numel() % rb == 0, "gguf_rows: ", raw.numel(), " bytes are not whole ", gguf_type(t).name, " rows of K=", K);
  const int64_t N = raw.numel() / rb;
  const at::Tensor ids = ids_.to(at::kLong).contiguous();
  const int64_t n = ids.numel();
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < N, "gguf_rows: row ", ip[i], " is outside 0..", N - 1);
  at::Tensor out = at::empty({n, K}, at::kFloat);
  const uint8_t* wp = raw.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  with_decoder(t, [&](auto d) {
    pool_for(0, n, 16, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) dequant_row<decltype(d)>(wp + ip[i] * rb, K, op + i * K);
    });
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
at::Tensor rms_norm(const at::Tensor& x_, const at::Tensor& w, double eps) {
  TORCH_CHECK(x_.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && w.is_contiguous(), "rms_norm: float32 only");
  const at::Tensor x = x_.contiguous();
  const int64_t D = x.size(-1), M = D ? x.numel() / D : 0;
  TORCH_CHECK(D % 8 == 0 && w.numel() == D, "rms_norm: the width must be a multiple of 8 and match the weight");
  at::Tensor y = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t r = 0; r < M; ++r) {
    const float* xr = xp + r * D;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 v = _mm256_loadu_ps(xr + d);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / std::sqrt(hsum8(acc) / static_cast<float>(D) + static_cast<float>(eps)));
    for (int64_t d = 0; d < D; d += 8)
      _mm256_storeu_ps(yp + r * D + d, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + d), inv), _mm256_loadu_ps(wp + d)));
  }
  return y;
}

// ---------------------------------------------------------------------------------------------
// exp(x) for x <= 0 (scores minus their maximum), exactly 0 below -87 (a hidden slot's -inf among
// them): exp(x) = 2^n exp(r), x = n ln 2 + r, |r| <= ln 2 / 2, exp(r) by a degree-6 polynomial
// (Cephes' expf coefficients, ~1 ulp). One fixed computation per lane.
inline __m256 exp_nonpos(__m256 x) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), live);
}

// hsum8 of 8 vectors at once, [hsum8(a[0]), ..., hsum8(a[7])]: the same additions in the same
// pairs, ((0+4)+(2+6)) + ((1+5)+(3+7)) of each, so the same numbers, in 14 shuffles and 7 adds
// instead of 8 x 6 operations.
inline __m256 hsum8x8(const __m256 a[8]) {
  __m256 u[4];  // u[k]: lanes 0-3 a[k][j] + a[k][j + 4], lanes 4-7 the same of a[k + 4]
  for (int k = 0; k < 4; ++k)
    u[k] = _mm256_add_ps(_mm256_permute2f128_ps(a[k], a[k + 4], 0x20), _mm256_permute2f128_ps(a[k], a[k + 4], 0x31));
  // w01: (u0[0] + u0[2], u0[1] + u0[3], u1[0] + u1[2], u1[1] + u1[3]) in each half; w23 of u2, u3
  const __m256 w01 = _mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 w23 = _mm256_add_ps(_mm256_shuffle_ps(u[2], u[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(u[2], u[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm256_add_ps(_mm256_shuffle_ps(w01, w23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm256_shuffle_ps(w01, w23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// The largest score of sc[0, S8) (the slots past S already -inf). A maximum is exact, so the same
// value as a pass in slot order (whose chain of S dependent scalar maxima held up a query's softmax).
inline float max_scores(const float* sc, int64_t S8) {
  __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0;
  int64_t s = 0;
  for (; s + 16 <= S8; s += 16) {
    m0 = _mm256_max_ps(m0, _mm256_loadu_ps(sc + s));
    m1 = _mm256_max_ps(m1, _mm256_loadu_ps(sc + s + 8));
  }
  if (s < S8) m0 = _mm256_max_ps(m0, _mm256_loadu_ps(sc + s));
  m0 = _mm256_max_ps(m0, m1);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m0), _mm256_extractf128_ps(m0, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
}

// One query's (Dh = 8 * NV) weights over the first S slots of its K/V head, exp(score - max), into
// sc[0, S8) (0 past S); mrow: its additive mask row or null. from (a multiple of 8): the slots whose
// scores sc already holds (attend_two's).
template <int NV>
void attend_weights(const float* q, const float* mrow, const float* K, int64_t S, float scale, float* sc, int64_t from = 0) {
  constexpr int64_t Dh = 8 * NV;
  __m256 qv[NV];
  for (int d = 0; d < NV; ++d) qv[d] = _mm256_loadu_ps(q + 8 * d);
  const int64_t S8 = (S + 7) / 8 * 8;
  const __m256 scv = _mm256_set1_ps(scale);
  int64_t s = from;
  for (; s + 8 <= S; s += 8) {  // 8 slots' chains, then their 8 horizontal sums at once (hsum8x8)
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_mul_ps(qv[0], _mm256_loadu_ps(K + (s + j) * Dh));
    for (int d = 1; d < NV; ++d)
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv[d], _mm256_loadu_ps(K + (s + j) * Dh + 8 * d), acc[j]);
    __m256 r = _mm256_mul_ps(hsum8x8(acc), scv);
    if (mrow) r = _mm256_add_ps(r, _mm256_loadu_ps(mrow + s));
    _mm256_storeu_ps(sc + s, r);
  }
  for (; s < S; ++s) {
    const float* k = K + s * Dh;
    __m256 acc = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k));
    for (int d = 1; d < NV; ++d) acc = _mm256_fmadd_ps(qv[d], _mm256_loadu_ps(k + 8 * d), acc);
    const float r = hsum8(acc) * scale;
    sc[s] = mrow ? r + mrow[s] : r;
  }
  for (int64_t s = S; s < S8; ++s) sc[s] = -INFINITY;
  const __m256 m = _mm256_set1_ps(max_scores(sc, S8));
  for (int64_t s = 0; s < S8; s += 8) _mm256_storeu_ps(sc + s, exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(sc + s), m)));
}

// One query (Dh = 8 * NV) over the first S slots of its K/V head; mrow: its additive mask row or null.
template <int NV>
void attend_one(const float* q, const float* mrow, float* dst, const float* K, const float* V, int64_t S, float scale,
                float* sc) {
  constexpr int64_t Dh = 8 * NV;
  attend_weights<NV>(q, mrow, K, S, scale, sc);
  float l = 0.0f;
#if ROWSTABLE_VNNI
  // (the VNNI build: 16 dims a register, each lane the same FMA chain as the 8-lane code's)
  __m512 o[NV / 2];
  for (int d = 0; d < NV / 2; ++d) o[d] = _mm512_setzero_ps();
  for (int64_t s = 0; s < S; ++s) {
    const float w = sc[s];
    l += w;
    const __m512 p = _mm512_set1_ps(w);
    const float* v = V + s * Dh;
    for (int d = 0; d < NV / 2; ++d) o[d] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 16 * d), o[d]);
  }
  const __m512 iv = _mm512_set1_ps(1.0f / l);
  for (int d = 0; d < NV / 2; ++d) _mm512_storeu_ps(dst + 16 * d, _mm512_mul_ps(o[d], iv));
#else
  __m256 o[NV];
  for (int d = 0; d < NV; ++d) o[d] = _mm256_setzero_ps();
  for (int64_t s = 0; s < S; ++s) {
    const float w = sc[s];
    l += w;
    const __m256 p = _mm256_set1_ps(w);
    const float* v = V + s * Dh;
    for (int d = 0; d < NV; ++d) o[d] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * d), o[d]);
  }
  const __m256 iv = _mm256_set1_ps(1.0f / l);
  for (int d = 0; d < NV; ++d) _mm256_storeu_ps(dst + 8 * d, _mm256_mul_ps(o[d], iv));
#endif
}

#if ROWSTABLE_VNNI
// Two queries of one K/V head (each with its mask row), attend_one's operations for each, lane for
// lane: their scores in one pass over the keys (the two 8-lane chains in one 512-bit register) and
// their weighted sums of values in one pass over the slots, whose two sets of FMA chains (each a
// dependent chain over the slots) then run side by side. (The AVX2 build's 16 registers do not hold
// both sets.)
template <int NV>
void attend_two(const float* qa, const float* qb, const float* ma, const float* mb, float* da, float* db, const float* K,
                const float* V, int64_t S, float scale, float* sa, float* sb) {
  constexpr int64_t Dh = 8 * NV;
  // the scores of whole groups of 8 slots: query a's 8-lane chains in the low half of a 512-bit
  // register, b's in the high half, each slot's 8 keys broadcast to both (half the FMAs)
  __m512 qv[NV];
  for (int d = 0; d < NV; ++d)
    qv[d] = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(qa + 8 * d))),
                                                _mm256_castps_pd(_mm256_loadu_ps(qb + 8 * d)), 1));
  const __m256 scv = _mm256_set1_ps(scale);
  auto keys = [&](int64_t slot, int d) {
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(K + slot * Dh + 8 * d))));
  };
  int64_t s = 0;
  for (; s + 8 <= S; s += 8) {
    __m512 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm512_mul_ps(qv[0], keys(s + j, 0));
    for (int d = 1; d < NV; ++d)
      for (int j = 0; j < 8; ++j) acc[j] = _mm512_fmadd_ps(qv[d], keys(s + j, d), acc[j]);
    __m256 lo[8], hi[8];
    for (int j = 0; j < 8; ++j) {
      lo[j] = _mm512_castps512_ps256(acc[j]);
      hi[j] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[j]), 1));
    }
    __m256 ra = _mm256_mul_ps(hsum8x8(lo), scv), rb = _mm256_mul_ps(hsum8x8(hi), scv);
    if (ma) ra = _mm256_add_ps(ra, _mm256_loadu_ps(ma + s));
    if (mb) rb = _mm256_add_ps(rb, _mm256_loadu_ps(mb + s));
    _mm256_storeu_ps(sa + s, ra);
    _mm256_storeu_ps(sb + s, rb);
  }
  attend_weights<NV>(qa, ma, K, S, scale, sa, s);
  attend_weights<NV>(qb, mb, K, S, scale, sb, s);
  float la = 0.0f, lb = 0.0f;
  __m512 oa[NV / 2], ob[NV / 2];
  for (int d = 0; d < NV / 2; ++d) oa[d] = ob[d] = _mm512_setzero_ps();
  for (int64_t s = 0; s < S; ++s) {
    const float wa = sa[s], wb = sb[s];
    la += wa;
    lb += wb;
    const __m512 pa = _mm512_set1_ps(wa), pb = _mm512_set1_ps(wb);
    const float* v = V + s * Dh;
    for (int d = 0; d < NV / 2; ++d) {
      const __m512 vv = _mm512_loadu_ps(v + 16 * d);
      oa[d] = _mm512_fmadd_ps(pa, vv, oa[d]);
      ob[d] = _mm512_fmadd_ps(pb, vv, ob[d]);
    }
  }
  const __m512 ia = _mm512_set1_ps(1.0f / la), ib = _mm512_set1_ps(1.0f / lb);
  for (int d = 0; d < NV / 2; ++d) {
    _mm512_storeu_ps(da + 16 * d, _mm512_mul_ps(oa[d], ia));
    _mm512_storeu_ps(db + 16 * d, _mm512_mul_ps(ob[d], ib));
  }
}
#endif

// Attention runs on one thread while its work (queries x slots x head size) is under this: a short
// context's decoding step, a few microseconds, where waking the others costs as much (and far more on
// a busy machine). Above it the queries are shared out. The cache's K/V come from memory in a
// decoding step (the weights streamed between two layers' attention evict them), so a query's pass
// over its slots is slower than its arithmetic suggests: the default model (9 heads of 64) at 384
// slots took ~1 ms a step on one thread; was 1 << 18 (one thread up to 455 slots there), 1 << 15
// took a one-token step 0.9-1.0 ms faster at 128 and 384 slots (Xeon, 2 threads).
constexpr int64_t ATTEND_ALONE_BELOW = int64_t{1} << 15;

// out[b, h, t] = softmax(q . k / sqrt(Dh) + mask) @ v over the first S cache slots (row b: its first
// rk[b] where rk is given), grouped-query heads (query head h reads K/V head h / G). mask: null or
// additive [B, 1, G * T, S] (row g * T + t: token t of query head g of a K/V head; -inf = hidden), the
// layout models/llama.py builds. q [B, H, T, Dh] contiguous; out at op + (b * so_b + t * so_t + h * so_h) * Dh.
void attention_core(const float* qp, int64_t B, int64_t H, int64_t T, int64_t Dh, const float* kp, const float* vp,
                    int64_t Hkv, int64_t Smax, int64_t S, const float* mp, const int64_t* rk, float* op, int64_t so_b,
                    int64_t so_t, int64_t so_h) {
  TORCH_CHECK(Dh == 16 || Dh == 32 || Dh == 64 || Dh == 128, "attend: head size ", Dh, " (the kernel takes 16, 32, 64, 128)");
  const int64_t G = H / Hkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(Dh));
  const int64_t S8 = (S + 7) / 8 * 8;
  const int64_t items = B * H * T, grain = items * S * Dh < ATTEND_ALONE_BELOW ? items : 1;
  pool_for(0, items, grain, [&](int64_t w0, int64_t w1) {
    std::vector<float> sc(2 * S8);
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t t = w % T, h = (w / T) % H, b = w / (T * H);
      const int64_t hk = h / G, g = h % G;
      const int64_t Sb = rk ? std::min(S, rk[b]) : S;
      const float* q = qp + ((b * H + h) * T + t) * Dh;
      const float* mrow = mp ? mp + (b * G * T + g * T + t) * S : nullptr;
      float* dst = op + (b * so_b + t * so_t + h * so_h) * Dh;
      const float* K = kp + (b * Hkv + hk) * Smax * Dh;
      const float* V = vp + (b * Hkv + hk) * Smax * Dh;
#if ROWSTABLE_VNNI
      // the next item too where it reads the same K/V head (the next token, or the next query head
      // of the group): attend_two
      const int64_t w2 = w + 1, t2 = w2 % T, h2 = (w2 / T) % H;
      if (w2 < w1 && w2 / (T * H) == b && h2 / G == hk && (Dh == 64 || Dh == 128)) {
        const float* q2 = qp + ((b * H + h2) * T + t2) * Dh;
        const float* m2 = mp ? mp + (b * G * T + (h2 % G) * T + t2) * S : nullptr;
        float* d2 = op + (b * so_b + t2 * so_t + h2 * so_h) * Dh;
        if (Dh == 64) attend_two<8>(q, q2, mrow, m2, dst, d2, K, V, Sb, scale, sc.data(), sc.data() + S8);
        else attend_two<16>(q, q2, mrow, m2, dst, d2, K, V, Sb, scale, sc.data(), sc.data() + S8);
        ++w;
        continue;
      }
#endif
      if (Dh == 64) attend_one<8>(q, mrow, dst, K, V, Sb, scale, sc.data());
      else if (Dh == 128) attend_one<16>(q, mrow, dst, K, V, Sb, scale, sc.data());
      else if (Dh == 32) attend_one<4>(q, mrow, dst, K, V, Sb, scale, sc.data());
      else attend_one<2>(q, mrow, dst, K, V, Sb, scale, sc.data());
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

// row_keys (optional, [B], each 1..S): the slots row b can see at most (attention_core's rk)
const int64_t* row_keys_ptr(const c10::optional<at::Tensor>& rk, int64_t B, int64_t S, at::Tensor& keep) {
  if (!rk.has_value()) return nullptr;
  keep = rk->to(at::kLong).contiguous();
  TORCH_CHECK(keep.numel() == B, "attend: row_keys must hold one count per row");
  const int64_t* p = keep.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(p[b] >= 1 && p[b] <= S, "attend: row_keys must lie in 1..n_keys");
  return p;
}

at::Tensor attend(const at::Tensor& q_, const at::Tensor& kc, const at::Tensor& vc, int64_t S,
                  const c10::optional<at::Tensor>& mask_, const c10::optional<at::Tensor>& row_keys) {
  TORCH_CHECK(q_.scalar_type() == at::kFloat && kc.scalar_type() == at::kFloat && vc.scalar_type() == at::kFloat,
              "attend: float32 only");
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous(), "attend: the cache must be contiguous");
  const at::Tensor q = q_.contiguous();
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), Dh = q.size(3);
  const int64_t Hkv = kc.size(1), Smax = kc.size(2);
  TORCH_CHECK(Dh % 8 == 0 && H % Hkv == 0 && S >= 1 && S <= Smax && kc.size(3) == Dh, "attend: bad shapes");
  const float* mp = mask_ptr(mask_, B, (H / Hkv) * T, S);
  at::Tensor keep;
  const int64_t* rk = row_keys_ptr(row_keys, B, S, keep);
  at::Tensor out = at::empty({B, H, T, Dh}, q.options());
  attention_core(q.data_ptr<float>(), B, H, T, Dh, kc.data_ptr<float>(), vc.data_ptr<float>(), Hkv, Smax, S, mp, rk,
                 out.data_ptr<float>(), H * T, 1, T);
  return out;
}

// A decoding step's attention from the fused projection qkv [B, T, (H + 2 Hkv) Dh]: rotate q and k
// (x * cos + roll(x, Dh / 2) * sin: a product, a product and a sum, as models/llama.py computes it,
// with its signed sin [B, T, 1, Dh]), write k and v to the cache at slots start[b] + t, attend over the
// first S slots and return [B, T, H Dh]. The numbers of the torch rotation followed by `attend`.
at::Tensor rope_attend(const at::Tensor& qkv_, const at::Tensor& cos_, const at::Tensor& sin_, at::Tensor kc, at::Tensor vc,
                       const at::Tensor& start_, int64_t H, int64_t S, const c10::optional<at::Tensor>& mask_,
                       const c10::optional<at::Tensor>& row_keys) {
  TORCH_CHECK(qkv_.scalar_type() == at::kFloat && kc.scalar_type() == at::kFloat && cos_.scalar_type() == at::kFloat,
              "rope_attend: float32 only");
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous(), "rope_attend: the cache must be contiguous");
  const at::Tensor qkv = qkv_.contiguous(), cs = cos_.contiguous(), sn = sin_.contiguous();
  const at::Tensor start = start_.to(at::kLong).contiguous();
  const int64_t B = qkv.size(0), T = qkv.size(1), Hkv = kc.size(1), Smax = kc.size(2), Dh = kc.size(3);
  TORCH_CHECK(Dh % 16 == 0 && H % Hkv == 0 && qkv.size(2) == (H + 2 * Hkv) * Dh && cs.numel() == B * T * Dh &&
              start.numel() == B && S >= 1 && S <= Smax, "rope_attend: bad shapes");
  const float* mp = mask_ptr(mask_, B, (H / Hkv) * T, S);
  at::Tensor keep;
  const int64_t* rk = row_keys_ptr(row_keys, B, S, keep);
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
        for (int64_t d = 0; d < Dh; d += 8) {
          const int64_t dr = (d + half) % Dh;  // roll by Dh / 2: element d takes x[(d + Dh / 2) mod Dh]
          const __m256 a = _mm256_mul_ps(_mm256_loadu_ps(x + d), _mm256_loadu_ps(c + d));
          const __m256 r = _mm256_mul_ps(_mm256_loadu_ps(x + dr), _mm256_loadu_ps(sg + d));
          _mm256_storeu_ps(dst + d, _mm256_add_ps(a, r));
        }
      }
      for (int64_t j = 0; j < Hkv; ++j)
        std::memcpy(vp + ((b * Hkv + j) * Smax + slot) * Dh, row + (H + Hkv + j) * Dh, Dh * sizeof(float));
    }
  at::Tensor out = at::empty({B, T, H * Dh}, qkv.options());
  attention_core(qp, B, H, T, Dh, kp, vp, Hkv, Smax, S, mp, rk, out.data_ptr<float>(), T * H, H, 1);
  return out;
}

// silu(gate) * up of gu = [..., gate | up]: torch's silu and product (the numbers of the Python path,
// F.silu(gate) * up). On the kernel pool, in blocks of rows: torch's own threads would wake for the
// 4+ rows of a verification step and spin after it beside the pool's. A block holds at most 32768
// values, torch's grain, so that torch's ops run on the thread that calls them (at::parallel_for
// would start an OpenMP team of its own from a pool worker).
at::Tensor silu_mul(const at::Tensor& gu_) {
  constexpr int64_t TORCH_GRAIN = 32768;
  const int64_t I = gu_.size(-1) / 2;
  const int64_t M = I ? gu_.numel() / (2 * I) : 0;
  if (!KernelPool::settings().enabled.load(std::memory_order_relaxed) || M * I <= TORCH_GRAIN || I > TORCH_GRAIN ||
      gu_.requires_grad())
    return at::silu(gu_.narrow(-1, 0, I)).mul_(gu_.narrow(-1, I, I));  // (torch's threads, or one thread)
  const at::Tensor gu = gu_.contiguous();
  std::vector<int64_t> shape(gu.sizes().begin(), gu.sizes().end());
  shape.back() = I;
  at::Tensor out = at::empty(shape, gu.options());
  const at::Tensor rows = gu.reshape({M, 2 * I}), out_rows = out.view({M, I});
  const int64_t per_block = TORCH_GRAIN / I, blocks = (M + per_block - 1) / per_block;
  // the caller's inference mode on every thread (an in-place product on an inference tensor needs
  // it; the whole thread-local state would also copy Python objects that a worker may not release)
  const bool inference = c10::InferenceMode::is_enabled();
  pool_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::optional<c10::InferenceMode> same_mode;
    if (inference) same_mode.emplace();
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r0 = b * per_block, n = std::min(per_block, M - r0);
      const at::Tensor part = rows.narrow(0, r0, n);
      at::Tensor dst = out_rows.narrow(0, r0, n);
      at::silu_out(dst, part.narrow(-1, 0, I));
      dst.mul_(part.narrow(-1, I, I));
    }
  });
  return out;
}

// which integer dot products this build's 8-bit-activation path runs on
std::string int_dot() { return ROWSTABLE_VNNI ? "avx512vnni" : "avx2"; }

}  // namespace

TORCH_LIBRARY(specdec_rs, lib) {
  lib.def("linear(Tensor x, Tensor w) -> Tensor");
  lib.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  lib.def("attend(Tensor q, Tensor k_cache, Tensor v_cache, int n_keys, Tensor? mask, Tensor? row_keys=None) -> Tensor");
  lib.def("rope_attend(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor start, int heads, "
          "int n_keys, Tensor? mask, Tensor? row_keys=None) -> Tensor");
  lib.def("silu_mul(Tensor gu) -> Tensor");
  lib.def("q4_1_linear(Tensor x, Tensor packed, int n) -> Tensor");
  lib.def("q8_0_linear(Tensor x, Tensor packed, int n) -> Tensor");
  lib.def("gguf_linear(Tensor x, Tensor raw, int ggml_type, int N, int K) -> Tensor");
  lib.def("gguf_rows(Tensor raw, int ggml_type, Tensor ids, int K) -> Tensor");
  lib.def("gguf_linear_cat(Tensor x, Tensor[] raws, int[] ggml_types, int[] Ns, int K) -> Tensor");
  lib.def("gguf_linear_q8(Tensor x, Tensor raw, int ggml_type, int N, int K) -> Tensor");
  lib.def("gguf_linear_cat_q8(Tensor x, Tensor[] raws, int[] ggml_types, int[] Ns, int K) -> Tensor");
  lib.def("int_dot() -> str", &int_dot);  // (no tensor to dispatch on: one kernel for every backend)
}
TORCH_LIBRARY_IMPL(specdec_rs, CPU, lib) {
  lib.impl("linear", &linear);
  lib.impl("rms_norm", &rms_norm);
  lib.impl("attend", &attend);
  lib.impl("rope_attend", &rope_attend);
  lib.impl("silu_mul", &silu_mul);
  lib.impl("q4_1_linear", &q4_1_linear);
  lib.impl("q8_0_linear", &q8_0_linear);
  lib.impl("gguf_linear", &gguf_linear);
  lib.impl("gguf_rows", &gguf_rows);
  lib.impl("gguf_linear_cat", &gguf_linear_cat);
  lib.impl("gguf_linear_q8", &gguf_linear_q8);
  lib.impl("gguf_linear_cat_q8", &gguf_linear_cat_q8);
}

// ---------------------------------------------------------------------------------------------
// The kernels of the model families beyond Llama's (models/families.py): attention with a given
// scale, soft-capped scores and any head size that is a multiple of 8 (Gemma's 256, Phi-3's 96),
// Gemma's GELU-tanh gate, and soft-capped logits (Gemma 2). As above, each output number is one
// fixed sequence of operations on its own row's inputs: a vector tail is computed in a padded
// buffer by the same instructions as the other lanes, so no number depends on the row's length
// modulo 8, on the number of rows or on how the threads split them.
namespace {

// tanh of every lane by one fixed computation: for |x| < 0.625 x + x^3 P(x^2) (Cephes' tanhf
// polynomial), else sign(x) (1 - t) / (1 + t) with t = exp(-2|x|) (exactly 1 for large |x|).
inline __m256 tanh8(__m256 x) {
  const __m256 neg0 = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
  const __m256 ax = _mm256_andnot_ps(neg0, x);
  const __m256 s = _mm256_mul_ps(x, x);
  __m256 p = _mm256_set1_ps(-5.70498872745e-3f);
  p = _mm256_fmadd_ps(p, s, _mm256_set1_ps(2.06390887954e-2f));
  p = _mm256_fmadd_ps(p, s, _mm256_set1_ps(-5.37397155531e-2f));
  p = _mm256_fmadd_ps(p, s, _mm256_set1_ps(1.33314422036e-1f));
  p = _mm256_fmadd_ps(p, s, _mm256_set1_ps(-3.33332819422e-1f));
  const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, s), x, x);
  const __m256 t = exp_nonpos(_mm256_mul_ps(ax, _mm256_set1_ps(-2.0f)));
  const __m256 large = _mm256_or_ps(_mm256_div_ps(_mm256_sub_ps(one, t), _mm256_add_ps(one, t)), _mm256_and_ps(x, neg0));
  return _mm256_blendv_ps(large, small, _mm256_cmp_ps(ax, _mm256_set1_ps(0.625f), _CMP_LT_OQ));
}

// y[0:n] = f(x[0:n]) eight lanes at a time, the last partial group through a zero-padded buffer
template <typename F>
inline void map8(const float* x, float* y, int64_t n, F&& f) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, f(_mm256_loadu_ps(x + i)));
  if (i < n) {
    float buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(buf, x + i, (n - i) * sizeof(float));
    _mm256_storeu_ps(buf, f(_mm256_loadu_ps(buf)));
    std::memcpy(y + i, buf, (n - i) * sizeof(float));
  }
}

// cap * tanh(x / cap), as transformers writes the soft-capping (a division, tanh, a product)
inline __m256 softcap8(__m256 x, __m256 cap) { return _mm256_mul_ps(tanh8(_mm256_div_ps(x, cap)), cap); }

// One query (Dh = 8 * nv, nv <= 64) over the first S slots of its K/V head: scores q . k * scale,
// soft-capped where softcap > 0, plus the mask row mrow where given (hidden slots -inf), then as
// attend_one: exact maximum, exp_nonpos, the weighted sum of values over the slots in order.
void attend_one_scaled(const float* q, const float* mrow, float* dst, const float* K, const float* V, int64_t S,
                       int64_t nv, float scale, float softcap, float* sc) {
  const int64_t Dh = 8 * nv, S8 = (S + 7) / 8 * 8;
  __m256 qv[64], o[64];
  for (int64_t d = 0; d < nv; ++d) qv[d] = _mm256_loadu_ps(q + 8 * d);
  for (int64_t s = 0; s < S; ++s) {
    const float* k = K + s * Dh;
    __m256 acc = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k));
    for (int64_t d = 1; d < nv; ++d) acc = _mm256_fmadd_ps(qv[d], _mm256_loadu_ps(k + 8 * d), acc);
    sc[s] = hsum8(acc) * scale;
  }
  for (int64_t s = S; s < S8; ++s) sc[s] = 0.0f;
  if (softcap > 0.0f) {
    const __m256 cap = _mm256_set1_ps(softcap);
    for (int64_t s = 0; s < S8; s += 8) _mm256_storeu_ps(sc + s, softcap8(_mm256_loadu_ps(sc + s), cap));
  }
  if (mrow)
    for (int64_t s = 0; s < S; ++s) sc[s] += mrow[s];
  for (int64_t s = S; s < S8; ++s) sc[s] = -INFINITY;
  const __m256 m = _mm256_set1_ps(max_scores(sc, S8));
  for (int64_t s = 0; s < S8; s += 8) _mm256_storeu_ps(sc + s, exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(sc + s), m)));
  for (int64_t d = 0; d < nv; ++d) o[d] = _mm256_setzero_ps();
  float l = 0.0f;
  for (int64_t s = 0; s < S; ++s) {
    const float w = sc[s];
    l += w;
    const __m256 p = _mm256_set1_ps(w);
    const float* v = V + s * Dh;
    for (int64_t d = 0; d < nv; ++d) o[d] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * d), o[d]);
  }
  const __m256 iv = _mm256_set1_ps(1.0f / l);
  for (int64_t d = 0; d < nv; ++d) _mm256_storeu_ps(dst + 8 * d, _mm256_mul_ps(o[d], iv));
}

// out [B, T, H * Dh] = attention of q [B, T, H, Dh] over the first n_keys slots of the caches
// [B, Hkv, Smax, Dh] (row b: its first row_keys[b] where given), grouped-query heads (query head h
// reads K/V head h / G), scores scaled by `scale` and soft-capped by `softcap` (0: none); mask: null
// or additive [B, 1, G * T, n_keys] (row g * T + t: token t of query head g of a K/V head), the
// layout models/llama.py builds.
at::Tensor attend_scaled(const at::Tensor& q_, const at::Tensor& kc, const at::Tensor& vc, int64_t S,
                         const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& row_keys, double scale,
                         double softcap) {
  TORCH_CHECK(q_.scalar_type() == at::kFloat && kc.scalar_type() == at::kFloat && vc.scalar_type() == at::kFloat,
              "attend_scaled: float32 only");
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous(), "attend_scaled: the cache must be contiguous");
  const at::Tensor q = q_.contiguous();
  TORCH_CHECK(q.dim() == 4, "attend_scaled: q must be [B, T, H, Dh]");
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), Dh = q.size(3);
  const int64_t Hkv = kc.size(1), Smax = kc.size(2);
  TORCH_CHECK(Dh % 8 == 0 && Dh <= 512 && Hkv > 0 && H % Hkv == 0 && kc.size(0) == B && kc.size(3) == Dh &&
              vc.sizes() == kc.sizes() && S >= 1 && S <= Smax, "attend_scaled: bad shapes");
  const int64_t G = H / Hkv;
  const float* mp = nullptr;
  if (mask.has_value()) {
    const at::Tensor& m = *mask;
    TORCH_CHECK(m.scalar_type() == at::kFloat && m.is_contiguous() && m.dim() == 4 && m.size(0) == B &&
                m.size(2) == G * T && m.size(3) == S, "attend_scaled: the mask must be [B, 1, G*T, n_keys] float32");
    mp = m.data_ptr<float>();
  }
  at::Tensor rk;
  const int64_t* rkp = nullptr;
  if (row_keys.has_value()) {
    rk = row_keys->to(at::kLong).contiguous();
    TORCH_CHECK(rk.numel() == B, "attend_scaled: row_keys must hold one count per row");
    rkp = rk.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) TORCH_CHECK(rkp[b] >= 1 && rkp[b] <= S, "attend_scaled: row_keys must lie in 1..n_keys");
  }
  at::Tensor out = at::empty({B, T, H * Dh}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  const int64_t items = B * T * H, S8 = (S + 7) / 8 * 8, grain = items * S * Dh < ATTEND_ALONE_BELOW ? items : 1;
  pool_for(0, items, grain, [&](int64_t w0, int64_t w1) {
    std::vector<float> scores(S8);
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t h = w % H, t = (w / H) % T, b = w / (H * T);
      const int64_t hk = h / G, g = h % G;
      const int64_t Sb = rkp ? std::min(S, rkp[b]) : S;
      const float* mrow = mp ? mp + (b * G * T + g * T + t) * S : nullptr;
      attend_one_scaled(qp + w * Dh, mrow, op + w * Dh, kp + (b * Hkv + hk) * Smax * Dh, vp + (b * Hkv + hk) * Smax * Dh,
                        Sb, Dh / 8, sc, cap, scores.data());
    }
  });
  return out;
}

// gu [..., 2 I] (gate, up side by side) -> gelu_tanh(gate) * up [..., I], GELU with tanh as torch's
// approximate="tanh" writes it: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
at::Tensor gelu_tanh_mul(const at::Tensor& gu_) {
  TORCH_CHECK(gu_.scalar_type() == at::kFloat && gu_.size(-1) % 2 == 0, "gelu_tanh_mul: float32 [..., 2 I]");
  const at::Tensor gu = gu_.contiguous();
  const int64_t I = gu.size(-1) / 2, M = I ? gu.numel() / (2 * I) : 0;
  std::vector<int64_t> shape(gu.sizes().begin(), gu.sizes().end());
  shape.back() = I;
  at::Tensor out = at::empty(shape, gu.options());
  const float* xp = gu.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  const __m256 beta = _mm256_set1_ps(0.7978845608028654f), kappa = _mm256_set1_ps(0.044715f);
  const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
  pool_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* g = xp + r * 2 * I;
      float* y = yp + r * I;
      map8(g, y, I, [&](__m256 x) {
        const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
        const __m256 inner = _mm256_mul_ps(beta, _mm256_add_ps(x, _mm256_mul_ps(kappa, cube)));
        return _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, tanh8(inner)));
      });
      const float* u = g + I;
      for (int64_t i = 0; i < I; ++i) y[i] *= u[i];
    }
  });
  return out;
}

// cap * tanh(x / cap) of every element (logits of a Gemma 2 model)
at::Tensor softcap(const at::Tensor& x_, double cap_) {
  TORCH_CHECK(x_.scalar_type() == at::kFloat && cap_ > 0.0, "softcap: float32 and a cap > 0");
  const at::Tensor x = x_.contiguous();
  at::Tensor y = at::empty_like(x);
  const int64_t D = x.dim() ? x.size(-1) : 1, M = D ? x.numel() / D : 0;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const __m256 cap = _mm256_set1_ps(static_cast<float>(cap_));
  pool_for(0, M, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) map8(xp + r * D, yp + r * D, D, [&](__m256 v) { return softcap8(v, cap); });
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec_rs, lib) {
  lib.def("attend_scaled(Tensor q, Tensor k_cache, Tensor v_cache, int n_keys, Tensor? mask, Tensor? row_keys, "
          "float scale, float softcap) -> Tensor");
  lib.def("gelu_tanh_mul(Tensor gu) -> Tensor");
  lib.def("softcap(Tensor x, float cap) -> Tensor");
}
TORCH_LIBRARY_IMPL(specdec_rs, CPU, lib) {
  lib.impl("attend_scaled", &attend_scaled);
  lib.impl("gelu_tanh_mul", &gelu_tanh_mul);
  lib.impl("softcap", &softcap);
}

// ---------------------------------------------------------------------------------------------
// A family layer's decoding-step attention in one call (models/families.py, FamilyBlock): from the
// fused projection qkv [B, T, (H + 2 Hkv) Dh], RMS-norm each query and key head where q_norm / k_norm
// are given (rms_norm's operations on a row of Dh), rotate the first R dimensions of each (x * cos +
// roll(x, R / 2) * sin within them: a product, a product and a sum, as the torch expression), write k
// and v to the caches at slots start[b] + t, and attend as attend_scaled does. The numbers of those
// calls made one by one (tests/engine/test_families.py compares them).
namespace {

at::Tensor rope_attend_scaled(const at::Tensor& qkv_, const c10::optional<at::Tensor>& q_norm,
                              const c10::optional<at::Tensor>& k_norm, double eps, const at::Tensor& cos_,
                              const at::Tensor& sin_, at::Tensor kc, at::Tensor vc, const at::Tensor& start_, int64_t H,
                              int64_t S, const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& row_keys,
                              double scale, double softcap) {
  TORCH_CHECK(qkv_.scalar_type() == at::kFloat && kc.scalar_type() == at::kFloat && cos_.scalar_type() == at::kFloat,
              "rope_attend_scaled: float32 only");
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous(), "rope_attend_scaled: the cache must be contiguous");
  const at::Tensor qkv = qkv_.contiguous(), cs = cos_.contiguous(), sn = sin_.contiguous();
  const at::Tensor start = start_.to(at::kLong).contiguous();
  const int64_t B = qkv.size(0), T = qkv.size(1), Hkv = kc.size(1), Smax = kc.size(2), Dh = kc.size(3);
  const int64_t R = cs.size(-1);
  TORCH_CHECK(Dh % 8 == 0 && Hkv > 0 && H % Hkv == 0 && qkv.size(2) == (H + 2 * Hkv) * Dh && R % 2 == 0 && R <= Dh &&
              cs.numel() == B * T * R && sn.numel() == B * T * R && start.numel() == B && S >= 1 && S <= Smax,
              "rope_attend_scaled: bad shapes");
  const float* wq = nullptr;
  const float* wk = nullptr;
  if (q_norm.has_value()) {
    TORCH_CHECK(k_norm.has_value() && q_norm->numel() == Dh && k_norm->numel() == Dh && q_norm->is_contiguous() &&
                k_norm->is_contiguous() && q_norm->scalar_type() == at::kFloat && k_norm->scalar_type() == at::kFloat,
                "rope_attend_scaled: q_norm and k_norm are float32 [Dh], both or neither");
    wq = q_norm->data_ptr<float>();
    wk = k_norm->data_ptr<float>();
  }
  at::Tensor q = at::empty({B, T, H, Dh}, qkv.options());
  const float* xp = qkv.data_ptr<float>();
  const float* cp = cs.data_ptr<float>();
  const float* sp = sn.data_ptr<float>();
  const int64_t* st = start.data_ptr<int64_t>();
  float* qp = q.data_ptr<float>();
  float* kp = kc.data_ptr<float>();
  float* vp = vc.data_ptr<float>();
  const int64_t half = R / 2, W = (H + 2 * Hkv) * Dh;
  const float feps = static_cast<float>(eps);
  std::vector<float> normed(Dh);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const float* row = xp + (b * T + t) * W;
      const float* c = cp + (b * T + t) * R;
      const float* sg = sp + (b * T + t) * R;
      const int64_t slot = st[b] + t;
      TORCH_CHECK(slot < Smax, "rope_attend_scaled: the cache is full");
      for (int64_t j = 0; j < H + Hkv; ++j) {
        const float* x = row + j * Dh;
        if (wq) {  // (rms_norm's operations on this head's Dh values)
          const float* w = j < H ? wq : wk;
          __m256 acc = _mm256_setzero_ps();
          for (int64_t d = 0; d < Dh; d += 8) {
            const __m256 v = _mm256_loadu_ps(x + d);
            acc = _mm256_fmadd_ps(v, v, acc);
          }
          const __m256 inv = _mm256_set1_ps(1.0f / std::sqrt(hsum8(acc) / static_cast<float>(Dh) + feps));
          for (int64_t d = 0; d < Dh; d += 8)
            _mm256_storeu_ps(normed.data() + d,
                             _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + d), inv), _mm256_loadu_ps(w + d)));
          x = normed.data();
        }
        float* dst = j < H ? qp + ((b * T + t) * H + j) * Dh : kp + ((b * Hkv + (j - H)) * Smax + slot) * Dh;
        for (int64_t d = 0; d < R; ++d) {
          const float a = x[d] * c[d];
          const float r = x[(d + half) % R] * sg[d];
          dst[d] = a + r;
        }
        for (int64_t d = R; d < Dh; ++d) dst[d] = x[d];
      }
      for (int64_t j = 0; j < Hkv; ++j)
        std::memcpy(vp + ((b * Hkv + j) * Smax + slot) * Dh, row + (H + Hkv + j) * Dh, Dh * sizeof(float));
    }
  return attend_scaled(q, kc, vc, S, mask, row_keys, scale, softcap);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec_rs, lib) {
  lib.def("rope_attend_scaled(Tensor qkv, Tensor? q_norm, Tensor? k_norm, float eps, Tensor cos, Tensor sin, "
          "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor start, int heads, int n_keys, Tensor? mask, Tensor? row_keys, "
          "float scale, float softcap) -> Tensor");
}
TORCH_LIBRARY_IMPL(specdec_rs, CPU, lib) { lib.impl("rope_attend_scaled", &rope_attend_scaled); }

// ---------------------------------------------------------------------------------------------
// q4_1_linear_q8 / q8_0_linear_q8: a GGUF file's Q4_0 / Q4_1 / Q8_0 matrices on 8-bit activations,
// over their blocks repacked for integer dot products of 16 output rows at once (models/gguf_blocks,
// pack_q4_i8 / pack_q8_i8): the arithmetic of a row is then a small part of what reading the
// weights costs, so a step of several tokens costs little more than one (docs/benchmarks.md).
//
// Layout: output rows in groups of 16, K-major; per group and 32-weight block:
//   Q4 (Q4_1, and Q4_0 as Q4_1 with m = -8 d): d[16], m[16] as float16, then 4 vectors of 64 bytes,
//     vector t holding in bytes 4n..4n+3 the quant bytes 4t..4t+3 of output n (low nibbles: weights
//     4t..4t+3, high: 16 + 4t..16 + 4t + 3): 320 bytes, 0.625 a weight as in the file;
//   Q8 (Q8_0): d[16] as float16, -sum q of each output's block as int16 [16], then 8 vectors of 64
//     bytes, vector j holding in bytes 4n..4n+3 the quants 4j..4j+3 of output n: 576 bytes.
// The activations are rounded as gguf_linear_q8 rounds them for these types (quantize_rows_q8, slices
// of 32: dx, q_x, sx = dx sum q_x). Per activation row, output n and block b:
//     isum = <q_w, q_x>  (exact int32)
//     acc = fma(d_n * dx_b, float(isum), acc);   Q4 only: cor = fma(m_n, sx_b, cor)
// blocks in order, and y = acc + cor (Q8: y = acc). Lane n of a register is output n throughout, so
// no horizontal sum is left, and each 4-byte group of a row's activations is one broadcast for 16
// outputs: per block and row 8 integer dot-product instructions (VNNI: _mm512_dpbusd_epi32 over all
// 16 outputs; AVX2: _mm256_maddubs_epi16 + _mm256_madd_epi16 per 8) and 3-4 float operations, the
// weights decoded once for a tile of up to 8 rows. Every integer is exact (the AVX2 build's int16
// pairs: Q4 at most 8 x 2 x 15 x 127 = 30480 summed, Q8 2 x 128 x 127 = 32512 each; the VNNI build's
// Q8 takes q_x + 128 unsigned and starts from -128 sum q_w), and every float operation is the same
// in both builds and for every row count and thread split: row-stable, and the two builds agree bit
// for bit. The numbers are not gguf_linear_q8's (it adds a block's 8 partial sums in float lanes).
//
// Blocks ahead to prefetch, every line of the block (one thread, the default model's 30 layers, CPU ms
// of a 1 / 8 / 16-token step's projections and head: 4 ahead 7.1-7.5 / 10.0-10.4 / 14.9-16.2, 8 ahead
// 6.7-7.2 / 8.8-9.1 / 14.3-14.6, 16 ahead 6.5 / 8.4-8.6 / 14.2-14.6, 24 ahead no better; a 2-core
// Sapphire Rapids shared with other jobs). -DI8_PF_BLOCKS=N for comparisons.
#ifndef I8_PF_BLOCKS
#define I8_PF_BLOCKS 16
#endif
namespace {

constexpr int64_t I8_G = 16;  // output rows per group
constexpr int64_t I8_MR = 8;  // activation rows a tile takes at most
constexpr int64_t I8_PF = I8_PF_BLOCKS;  // blocks ahead to prefetch

template <bool Q4>
constexpr int64_t i8_block_bytes() { return Q4 ? 320 : 576; }

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#if ROWSTABLE_VNNI
// MR activation rows (quants xq, row stride K; Q8: flipped to q + 128) x one group's 16 outputs.
template <int MR, bool Q4>
void i8_tile(const int8_t* xq, const float* dx, const float* sx, int64_t K, const uint8_t* g, int64_t nb, float* y,
             int64_t ldy) {
  constexpr int64_t BB = i8_block_bytes<Q4>();
  const int64_t nbx = K / 32;
  __m512 acc[MR], cor[MR];
  for (int i = 0; i < MR; ++i) acc[i] = cor[i] = _mm512_setzero_ps();
  const __m512i lo4 = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = g + b * BB;
    for (int64_t c = 0; c < BB; c += 64) _mm_prefetch(reinterpret_cast<const char*>(p + I8_PF * BB + c), _MM_HINT_T0);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    __m512i isum[MR];
    if (Q4) {
      for (int i = 0; i < MR; ++i) isum[i] = _mm512_setzero_si512();
      for (int t = 0; t < 4; ++t) {
        const __m512i v = _mm512_loadu_si512(p + 64 + 64 * t);
        const __m512i lo = _mm512_and_si512(v, lo4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
        for (int i = 0; i < MR; ++i) {
          const int8_t* xb = xq + i * K + 32 * b;
          isum[i] = _mm512_dpbusd_epi32(isum[i], lo, _mm512_set1_epi32(load_i32(xb + 4 * t)));
          isum[i] = _mm512_dpbusd_epi32(isum[i], hi, _mm512_set1_epi32(load_i32(xb + 16 + 4 * t)));
        }
      }
    } else {  // (q_x + 128) q_w summed, from -128 sum q_w
      const __m512i start = _mm512_slli_epi32(_mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))), 7);
      for (int i = 0; i < MR; ++i) isum[i] = start;
      for (int j = 0; j < 8; ++j) {
        const __m512i w = _mm512_loadu_si512(p + 64 + 64 * j);
        for (int i = 0; i < MR; ++i)
          isum[i] = _mm512_dpbusd_epi32(isum[i], _mm512_set1_epi32(load_i32(xq + i * K + 32 * b + 4 * j)), w);
      }
    }
    const __m512 m = Q4 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))) : d;
    for (int i = 0; i < MR; ++i) {
      acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(dx[i * nbx + b])), _mm512_cvtepi32_ps(isum[i]), acc[i]);
      if (Q4) cor[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[i * nbx + b]), cor[i]);
    }
  }
  for (int i = 0; i < MR; ++i) _mm512_storeu_ps(y + i * ldy, Q4 ? _mm512_add_ps(acc[i], cor[i]) : acc[i]);
}
#else
// The AVX2 build: the same operations on the group's 8 outputs from h (0 or 8) at a time.
template <int MR, bool Q4>
void i8_tile_half(const int8_t* xq, const float* dx, const float* sx, int64_t K, const uint8_t* g, int64_t nb, int h,
                  float* y, int64_t ldy) {
  constexpr int64_t BB = i8_block_bytes<Q4>();
  const int64_t nbx = K / 32;
  __m256 acc[MR], cor[MR];
  for (int i = 0; i < MR; ++i) acc[i] = cor[i] = _mm256_setzero_ps();
  const __m256i lo4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = g + b * BB;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * h)));
    __m256i isum[MR];
    if (Q4) {  // a row's 8 pair sums add up in int16 (at most 30480), then one madd
      __m256i s16[MR];
      for (int i = 0; i < MR; ++i) s16[i] = _mm256_setzero_si256();
      for (int t = 0; t < 4; ++t) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 + 64 * t + 4 * h));
        const __m256i lo = _mm256_and_si256(v, lo4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
        for (int i = 0; i < MR; ++i) {
          const int8_t* xb = xq + i * K + 32 * b;
          s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(load_i32(xb + 4 * t))));
          s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load_i32(xb + 16 + 4 * t))));
        }
      }
      for (int i = 0; i < MR; ++i) isum[i] = _mm256_madd_epi16(s16[i], ones);
    } else {  // |q_w| by q_x with q_w's sign
      for (int i = 0; i < MR; ++i) isum[i] = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 + 64 * j + 4 * h));
        const __m256i wa = _mm256_sign_epi8(w, w);
        for (int i = 0; i < MR; ++i) {
          const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(load_i32(xq + i * K + 32 * b + 4 * j)), w);
          isum[i] = _mm256_add_epi32(isum[i], _mm256_madd_epi16(_mm256_maddubs_epi16(wa, xs), ones));
        }
      }
    }
    const __m256 m = Q4 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 + 2 * h))) : d;
    for (int i = 0; i < MR; ++i) {
      acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(dx[i * nbx + b])), _mm256_cvtepi32_ps(isum[i]), acc[i]);
      if (Q4) cor[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[i * nbx + b]), cor[i]);
    }
  }
  for (int i = 0; i < MR; ++i) _mm256_storeu_ps(y + i * ldy + h, Q4 ? _mm256_add_ps(acc[i], cor[i]) : acc[i]);
}
template <int MR, bool Q4>
void i8_tile(const int8_t* xq, const float* dx, const float* sx, int64_t K, const uint8_t* g, int64_t nb, float* y,
             int64_t ldy) {
  i8_tile_half<MR, Q4>(xq, dx, sx, K, g, nb, 0, y, ldy);
  i8_tile_half<MR, Q4>(xq, dx, sx, K, g, nb, 8, y, ldy);
}
#endif

template <bool Q4>
void i8_tiles(int64_t mr, const int8_t* xq, const float* dx, const float* sx, int64_t K, const uint8_t* g, int64_t nb,
              float* y, int64_t ldy) {
  switch (mr) {
    case 1: i8_tile<1, Q4>(xq, dx, sx, K, g, nb, y, ldy); break;
    case 2: i8_tile<2, Q4>(xq, dx, sx, K, g, nb, y, ldy); break;
    case 3: i8_tile<3, Q4>(xq, dx, sx, K, g, nb, y, ldy); break;
    case 4: i8_tile<4, Q4>(xq, dx, sx, K, g, nb, y, ldy); break;
    case 5: i8_tile<5, Q4>(xq, dx, sx, K, g, nb, y, ldy); break;
    case 6: i8_tile<6, Q4>(xq, dx, sx, K, g, nb, y, ldy); break;
    case 7: i8_tile<7, Q4>(xq, dx, sx, K, g, nb, y, ldy); break;
    default: i8_tile<8, Q4>(xq, dx, sx, K, g, nb, y, ldy); break;
  }
}

template <bool Q4>
at::Tensor block_linear_q8(const at::Tensor& x_, const at::Tensor& packed, int64_t N) {
  const char* op = Q4 ? "q4_1_linear_q8" : "q8_0_linear_q8";
  TORCH_CHECK(x_.scalar_type() == at::kFloat && x_.dim() >= 1, op, ": x must be float32 [..., K]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), op, ": the packed blocks must be contiguous uint8");
  const at::Tensor x = x_.contiguous();
  const int64_t K = x.size(-1), M = K ? x.numel() / K : 0, nb = K / 32, groups = N / I8_G;
  constexpr int64_t BB = i8_block_bytes<Q4>();
  TORCH_CHECK(K > 0 && K % 32 == 0 && N >= 0 && N % I8_G == 0 && packed.numel() == groups * nb * BB, op,
              ": [", N, ", ", K, "] blocks take ", groups * nb * BB, " bytes (N a multiple of 16, K of 32); got ", packed.numel());
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty(shape, x.options());
  if (M == 0 || N == 0) return y;
  Q8Rows xr;
  quantize_rows_q8(x.data_ptr<float>(), M, K, 32, xr);
  const int8_t* xq = xr.q.data();
#if ROWSTABLE_VNNI
  vec64<int8_t> flipped;
  if (!Q4) {  // (_mm512_dpbusd_epi32 takes one operand unsigned: q_x + 128)
    flipped.resize(M * K);
    for (int64_t k = 0; k < M * K; ++k) flipped[k] = static_cast<int8_t>(xr.q[k] ^ 0x80);
    xq = flipped.data();
  }
#endif
  const uint8_t* bp = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  // row tiles of at most I8_MR, as even as M allows; tasks of 4 groups (64 outputs)
  const int64_t tiles = (M + I8_MR - 1) / I8_MR;
  constexpr int64_t TASK = 4;
  shared_tasks((groups + TASK - 1) / TASK, [&](int64_t t, std::vector<float>&) {
    for (int64_t gi = t * TASK, g1 = std::min(groups, gi + TASK); gi < g1; ++gi)
      for (int64_t r = 0; r < tiles; ++r) {
        const int64_t a = r * M / tiles, e = (r + 1) * M / tiles;
        i8_tiles<Q4>(e - a, xq + a * K, xr.d.data() + a * nb, xr.sx.data() + a * nb, K, bp + gi * nb * BB, nb,
                     yp + a * N + I8_G * gi, N);
      }
  });
  return y;
}

at::Tensor q4_1_linear_q8(const at::Tensor& x, const at::Tensor& packed, int64_t n) { return block_linear_q8<true>(x, packed, n); }
at::Tensor q8_0_linear_q8(const at::Tensor& x, const at::Tensor& packed, int64_t n) { return block_linear_q8<false>(x, packed, n); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec_rs, lib) {
  lib.def("q4_1_linear_q8(Tensor x, Tensor packed, int n) -> Tensor");
  lib.def("q8_0_linear_q8(Tensor x, Tensor packed, int n) -> Tensor");
}
TORCH_LIBRARY_IMPL(specdec_rs, CPU, lib) {
  lib.impl("q4_1_linear_q8", &q4_1_linear_q8);
  lib.impl("q8_0_linear_q8", &q8_0_linear_q8);
}

// ---------------------------------------------------------------------------------------------
// kq_linear_q8: a GGUF file's Q4_K / Q5_K / Q6_K matrices on 8-bit activations, over their blocks repacked
// in groups of 16 output rows (models/gguf_blocks, pack_q4_k_i8 / pack_q5_k_i8 / pack_q6_k_i8), so that one integer
// dot-product instruction takes the same 4 weights of all 16 outputs, and each sub-block's scale is
// one float operation for 16 outputs: a step of several tokens then costs little more than one. A
// block is decoded once for a tile of up to 16 activation rows (VNNI; 8 on AVX2).
//
// Layout: output rows in groups of 16, K-major; per group and 256-weight block, a quad u (0-63) being
// the weights 4u..4u+3 and a 64-byte vector holding in bytes 4n..4n+3 a quad of output n:
//   Q4_K: d[16], dmin[16] as float16; sc[8][16], m[8][16], the sub-blocks' scales and mins as bytes;
//     then 32 vectors, vector 8p + t with quad 16p + t in
//     the low nibbles and quad 16p + 8 + t in the high ones (the file's nibble pairing): 2368 bytes,
//     64 more than the file's 16 blocks (2.8%);
//   Q5_K: Q4_K's (q's low 4 bits in the nibbles), then 8 vectors of the fifth bits (vector t: bits 2p,
//     2p + 1 of a byte those of quads 16p + t, 16p + 8 + t): 2880 bytes, 64 more than the file's (2.3%);
//   Q6_K: d[16] as float16; sc[16][16], the sub-blocks' int8 scales; 32
//     vectors of the quants' low 4 bits (vector v: quad v low, quad v + 32 high); 16 vectors of their
//     high 2 bits (vector w: bits 2c, 2c + 1 of a byte those of quad w + 16c): 3360 bytes, as the file.
// The activations are rounded as gguf_linear_q8 rounds them for the K-quants (quantize_rows_q8,
// slices of 256: dx, q_x, and the sums B of each 32 (Q4_K, Q5_K) or 16 (Q6_K) q_x). Per activation
// row, output n and block b, sub-blocks s (Q4_K, Q5_K: 8 of 32 weights; Q6_K: 16 of 16), quants q >= 0:
//     S_s = <q_s, q_x,s>,  C = sum_s c_s B_s            (exact int32; Q4_K, Q5_K c = m, Q6_K c = sc)
//     dsc_s = d * sc_s                                   (float)
//     t = dsc_0 S_0;  t = fma(S_s, dsc_s, t) for s = 1, 2, ...;  t = fma(C, e, t)   (Q4/5_K e = -dmin, Q6_K -32 d)
//     acc = fma(t, dx_b, acc)
// blocks in order, y = acc (S, C converted to float32; w = d sc q - dmin m for Q4_K and Q5_K,
// d sc (q - 32) for Q6_K). Lane n of a register is output n throughout. Every integer is exact in both builds
// (VNNI: _mm512_dpbusd_epi32 / _mm512_dpwssd_epi32 on 16 outputs; AVX2: _mm256_maddubs_epi16 (a pair
// at most 2 x 63 x 127) + _mm256_madd_epi16 on 8), and the float operations are the same in both
// and for every row count: row-stable, the two builds equal bit for bit. The VNNI build takes Q4_K's
// high nibbles unshifted (16 q) against dsc / 16: the same real products, so the same numbers. The
// numbers are not gguf_linear_q8's (which adds a block's parts in 8 float lanes a row), nor the
// float path's.
namespace {

constexpr int64_t KQ_G = 16;    // output rows per group
constexpr int64_t KQ_TILE = ROWSTABLE_VNNI ? 16 : 8;  // activation rows a tile takes at most (kq_tile)
#ifndef KQ_PF_BLOCKS
#define KQ_PF_BLOCKS 4
#endif

constexpr int64_t kq_block_bytes(int64_t type) { return type == 12 ? 2368 : type == 13 ? 2880 : type == 14 ? 3360 : 0; }

// What the tile needs of a block, the same in both builds: NS sub-blocks of QPS quads, NP pairs of the
// correction's factors.
struct KqQ4K {
  static constexpr int NS = 8, QPS = 8, NP = 4, GROUP16 = 8;  // GROUP16: the AVX2 build's int16 sums (kq_tile)
  static constexpr int64_t BB = 2368;
  static constexpr bool B32 = true;  // the correction's sums over 32 q_x (else 16)
};
struct KqQ5K {  // (AVX2 int16 sums of 4 quads: at most 4 x 2 x 31 x 127 = 31496)
  static constexpr int NS = 8, QPS = 8, NP = 4, GROUP16 = 4;
  static constexpr int64_t BB = 2880;
  static constexpr bool B32 = true;
};
struct KqQ6K {
  static constexpr int NS = 16, QPS = 4, NP = 8, GROUP16 = 2;
  static constexpr int64_t BB = 3360;
  static constexpr bool B32 = false;
};

#if ROWSTABLE_VNNI
using kq_f = __m512;
using kq_i = __m512i;
#else
using kq_f = __m256;
using kq_i = __m256i;
#endif

// One build's view of a group: VNNI all 16 outputs, AVX2 the 8 from h (0 or 8). Loads of 16 or 8
// lanes from an array laid out [16].
struct KqLanes {
  int h;
#if ROWSTABLE_VNNI
  kq_i bytes(const uint8_t* p) const { return _mm512_loadu_si512(p); }  // a vector of 64 quant bytes
  kq_f f16(const uint8_t* p) const { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  kq_i u8_32(const uint8_t* p) const { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  kq_i i8_32(const uint8_t* p) const { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  // the bytes a[n], b[n] of each output n as an int16 pair (signed: int8 bytes, else uint8)
  kq_i pairs(const uint8_t* a, const uint8_t* b, bool is_signed) const {
    const __m128i va = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a)), vb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
    const __m256i ab = _mm256_set_m128i(_mm_unpackhi_epi8(va, vb), _mm_unpacklo_epi8(va, vb));
    return is_signed ? _mm512_cvtepi8_epi16(ab) : _mm512_cvtepu8_epi16(ab);
  }
  static kq_i set8(int v) { return _mm512_set1_epi8(static_cast<char>(v)); }
  static kq_i and_(kq_i a, kq_i b) { return _mm512_and_si512(a, b); }
  static kq_i or_and(kq_i a, kq_i b, kq_i c) { return _mm512_ternarylogic_epi32(a, b, c, 0xF8); }  // a | (b & c)
  static kq_i shl(kq_i a, int n) { return _mm512_slli_epi16(a, n); }
  static kq_i shr(kq_i a, int n) { return _mm512_srli_epi16(a, n); }
  static kq_i zero() { return _mm512_setzero_si512(); }
  static kq_i dot4(kq_i acc, kq_i w, int32_t x) { return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x)); }
  static kq_i dot2(kq_i acc, kq_i c, int32_t b) { return _mm512_dpwssd_epi32(acc, c, _mm512_set1_epi32(b)); }
  static kq_f cvt(kq_i a) { return _mm512_cvtepi32_ps(a); }
  static kq_f mul(kq_f a, kq_f b) { return _mm512_mul_ps(a, b); }
  static kq_f fma(kq_f a, kq_f b, kq_f c) { return _mm512_fmadd_ps(a, b, c); }
  static kq_f set1(float v) { return _mm512_set1_ps(v); }
  static kq_f fzero() { return _mm512_setzero_ps(); }
  void store(float* y, kq_f v) const { _mm512_storeu_ps(y, v); }
#else
  kq_i bytes(const uint8_t* p) const { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 4 * h)); }
  kq_f f16(const uint8_t* p) const { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * h))); }
  kq_i u8_32(const uint8_t* p) const { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + h))); }
  kq_i i8_32(const uint8_t* p) const { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + h))); }
  kq_i pairs(const uint8_t* a, const uint8_t* b, bool is_signed) const {
    const __m128i va = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a)), vb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
    const __m128i ab = h ? _mm_unpackhi_epi8(va, vb) : _mm_unpacklo_epi8(va, vb);
    return is_signed ? _mm256_cvtepi8_epi16(ab) : _mm256_cvtepu8_epi16(ab);
  }
  static kq_i set8(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }
  static kq_i and_(kq_i a, kq_i b) { return _mm256_and_si256(a, b); }
  static kq_i or_and(kq_i a, kq_i b, kq_i c) { return _mm256_or_si256(a, _mm256_and_si256(b, c)); }
  static kq_i shl(kq_i a, int n) { return _mm256_slli_epi16(a, n); }
  static kq_i shr(kq_i a, int n) { return _mm256_srli_epi16(a, n); }
  static kq_i zero() { return _mm256_setzero_si256(); }
  static kq_i dot4(kq_i acc, kq_i w, int32_t x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_set1_epi32(x)), _mm256_set1_epi16(1)));
  }
  static kq_i dot2(kq_i acc, kq_i c, int32_t b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(c, _mm256_set1_epi32(b))); }
  static kq_f cvt(kq_i a) { return _mm256_cvtepi32_ps(a); }
  static kq_f mul(kq_f a, kq_f b) { return _mm256_mul_ps(a, b); }
  static kq_f fma(kq_f a, kq_f b, kq_f c) { return _mm256_fmadd_ps(a, b, c); }
  static kq_f set1(float v) { return _mm256_set1_ps(v); }
  static kq_f fzero() { return _mm256_setzero_ps(); }
  void store(float* y, kq_f v) const { _mm256_storeu_ps(y + h, v); }
#endif
};

// The weights of sub-blocks 2j and 2j + 1 are taken together (two dot-product chains a row): quad
// vector k (< QPS) of each as w0, w1, and each one's dsc (scaled to match: the VNNI build's Q4_K odd
// sub-blocks are 16 q against dsc / 16).
// Q4_K: one load of vector 8j + k holds both (low and high nibbles)
inline void kq_quads(KqQ4K, const KqLanes& L, const uint8_t* p, int j, int k, kq_i& w0, kq_i& w1) {
  const kq_i v = L.bytes(p + 320 + 512 * j + 64 * k);
  w0 = KqLanes::and_(v, KqLanes::set8(0x0F));
#if ROWSTABLE_VNNI
  w1 = KqLanes::and_(v, KqLanes::set8(0xF0));
#else
  w1 = KqLanes::and_(KqLanes::shr(v, 4), KqLanes::set8(0x0F));
#endif
}
inline void kq_dsc(KqQ4K, const KqLanes& L, const uint8_t* p, kq_f d, int j, kq_f& dsc0, kq_f& dsc1) {
  dsc0 = KqLanes::mul(KqLanes::cvt(L.u8_32(p + 64 + 32 * j)), d);
  dsc1 = KqLanes::mul(KqLanes::cvt(L.u8_32(p + 80 + 32 * j)), d);
#if ROWSTABLE_VNNI
  dsc1 = KqLanes::mul(dsc1, KqLanes::set1(0.0625f));
#endif
}

// Q5_K: Q4_K's nibbles (both shifted down) with the fifth bits of vector 2048 / 64 + k, bits 2j and
// 2j + 1 (a branch on j, as kq_q6_quad's on the quarter)
inline void kq_quads(KqQ5K, const KqLanes& L, const uint8_t* p, int j, int k, kq_i& w0, kq_i& w1) {
  const kq_i v = L.bytes(p + 320 + 512 * j + 64 * k);
  const kq_i h = L.bytes(p + 2368 + 64 * k);
  const kq_i h0 = j == 0 ? KqLanes::shl(h, 4) : j == 1 ? KqLanes::shl(h, 2) : j == 2 ? h : KqLanes::shr(h, 2);
  const kq_i h1 = j == 0 ? KqLanes::shl(h, 3) : j == 1 ? KqLanes::shl(h, 1) : j == 2 ? KqLanes::shr(h, 1) : KqLanes::shr(h, 3);
  w0 = KqLanes::or_and(KqLanes::and_(v, KqLanes::set8(0x0F)), h0, KqLanes::set8(0x10));
  w1 = KqLanes::or_and(KqLanes::and_(KqLanes::shr(v, 4), KqLanes::set8(0x0F)), h1, KqLanes::set8(0x10));
}
inline void kq_dsc(KqQ5K, const KqLanes& L, const uint8_t* p, kq_f d, int j, kq_f& dsc0, kq_f& dsc1) {
  dsc0 = KqLanes::mul(KqLanes::cvt(L.u8_32(p + 64 + 32 * j)), d);
  dsc1 = KqLanes::mul(KqLanes::cvt(L.u8_32(p + 80 + 32 * j)), d);
}

// Q6_K quad u (quarter c = u / 16): low 4 bits from vector u % 32 (low nibbles for u < 32), high 2
// from vector 32 + u % 16, bits 2c, 2c + 1
inline kq_i kq_q6_quad(const KqLanes& L, const uint8_t* p, int u) {
  const int c = u >> 4;
  const kq_i ql = L.bytes(p + 288 + 64 * (u & 31));
  const kq_i qh = L.bytes(p + 288 + 2048 + 64 * (u & 15));
  // (a branch on the quarter: shifts by a count in a register instead ran Q6_K ~1.2x slower; the
  // loop over sub-block pairs unrolled, so that the quarter is a constant, ~1.2x slower too)
  const kq_i lo = KqLanes::and_(c < 2 ? ql : KqLanes::shr(ql, 4), KqLanes::set8(0x0F));
  const kq_i hb = c == 0 ? KqLanes::shl(qh, 4) : c == 1 ? KqLanes::shl(qh, 2) : c == 2 ? qh : KqLanes::shr(qh, 2);
  return KqLanes::or_and(lo, hb, KqLanes::set8(0x30));
}
inline void kq_quads(KqQ6K, const KqLanes& L, const uint8_t* p, int j, int k, kq_i& w0, kq_i& w1) {
  w0 = kq_q6_quad(L, p, 8 * j + k);
  w1 = kq_q6_quad(L, p, 8 * j + 4 + k);
}
inline void kq_dsc(KqQ6K, const KqLanes& L, const uint8_t* p, kq_f d, int j, kq_f& dsc0, kq_f& dsc1) {
  dsc0 = KqLanes::mul(KqLanes::cvt(L.i8_32(p + 32 + 32 * j)), d);
  dsc1 = KqLanes::mul(KqLanes::cvt(L.i8_32(p + 48 + 32 * j)), d);
}

// the correction's factor pair j (sub-blocks 2j, 2j + 1) of a group's 16 outputs
inline kq_i kq_pair(KqQ4K, const KqLanes& L, const uint8_t* p, int j) { return L.pairs(p + 192 + 32 * j, p + 208 + 32 * j, false); }
inline kq_i kq_pair(KqQ5K, const KqLanes& L, const uint8_t* p, int j) { return L.pairs(p + 192 + 32 * j, p + 208 + 32 * j, false); }
inline kq_i kq_pair(KqQ6K, const KqLanes& L, const uint8_t* p, int j) { return L.pairs(p + 32 + 32 * j, p + 48 + 32 * j, true); }
// the correction's float factor e: Q4_K -dmin, Q6_K -32 d
inline kq_f kq_e(KqQ4K, const KqLanes& L, const uint8_t* p, kq_f) { return KqLanes::mul(L.f16(p + 32), KqLanes::set1(-1.0f)); }
inline kq_f kq_e(KqQ5K, const KqLanes& L, const uint8_t* p, kq_f) { return KqLanes::mul(L.f16(p + 32), KqLanes::set1(-1.0f)); }
inline kq_f kq_e(KqQ6K, const KqLanes&, const uint8_t*, kq_f d) { return KqLanes::mul(d, KqLanes::set1(-32.0f)); }

// MR + MR2 activation rows (quants xq, row stride K; scales dx, row stride K / 256; the correction's
// int16 sums bs, row stride K / 32 (Q4_K) or K / 16 (Q6_K)) x a group's outputs (L) over nb blocks.
// The VNNI build's second MR2 rows (up to 8 more; the accumulators of 16 rows do not fit the 32
// registers) take each pair's quads as the first MR decoded them (kept on the stack): a block is
// decoded once for up to 16 rows. Each row's operations are the same whatever MR and MR2.
template <int MR, int MR2, class T>
void kq_tile(const KqLanes& L, const int8_t* xq, const float* dx, const int16_t* bs, int64_t K, const uint8_t* g, int64_t nb,
             float* y, int64_t ldy) {
  static_assert(ROWSTABLE_VNNI || MR2 == 0, "the AVX2 build's tiles take 8 rows at most");
  constexpr int R = MR + MR2;
  const int64_t nbx = K / 256, nbs = T::B32 ? K / 32 : K / 16, per_block = T::B32 ? 8 : 16;
  kq_f acc[R];
  for (int i = 0; i < R; ++i) acc[i] = KqLanes::fzero();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = g + b * T::BB;
    const kq_f d = L.f16(p);
    kq_f t[R];
    for (int j = 0; j < T::NS / 2; ++j) {
      // the block KQ_PF_BLOCKS ahead, a share of its lines with each pair of sub-blocks (a burst of
      // 37-53 prefetches at the start of a block filled the line buffers and stalled), into L2 at
      // every tile size: prefetches into L1 hold the line buffers the tile's own loads need
      // (Qwen2.5-Coder-1.5B, 2 threads, one forward after 200 tokens: 3 tokens 52-56 ms against
      // 58-64 with L1 from 3 rows, 4 tokens 57-60 against 60-66, 1-2 and 8-16 the same; 8 blocks
      // ahead slower at 1-2 rows)
      constexpr int64_t lines = (T::BB + 63) / 64, pairs = T::NS / 2;
      for (int64_t c = j * lines / pairs; c < (j + 1) * lines / pairs; ++c)
        _mm_prefetch(reinterpret_cast<const char*>(p + KQ_PF_BLOCKS * T::BB + 64 * c), _MM_HINT_T1);
      kq_i S0[MR], S1[MR];
      for (int i = 0; i < MR; ++i) S0[i] = S1[i] = KqLanes::zero();
      // (unrolled in full: with the loop over k kept, GCC copied each accumulator to another register
      // and to the stack around every vpdpbusd)
#if ROWSTABLE_VNNI
      kq_i kept[MR2 ? 2 * T::QPS : 1];  // (the pair's quads for rows MR..R - 1)
#pragma GCC unroll 8
      for (int k = 0; k < T::QPS; ++k) {
        kq_i w0, w1;
        kq_quads(T{}, L, p, j, k, w0, w1);
        if (MR2) kept[2 * k] = w0, kept[2 * k + 1] = w1;
        const int64_t off0 = 256 * b + 4 * (T::QPS * 2 * j + k), off1 = off0 + 4 * T::QPS;
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
          S0[i] = KqLanes::dot4(S0[i], w0, load_i32(xq + i * K + off0));
          S1[i] = KqLanes::dot4(S1[i], w1, load_i32(xq + i * K + off1));
        }
      }
#else
      // AVX2: the _mm256_maddubs_epi16 products of GROUP quads summed in int16 (Q4_K 8: at most
      // 8 x 2 x 15 x 127 = 30480; Q6_K 2: 2 x 2 x 63 x 127 = 32004), then one _mm256_madd_epi16 by ones
      const __m256i ones = _mm256_set1_epi16(1);
      for (int k0 = 0; k0 < T::QPS; k0 += T::GROUP16) {
        __m256i P0[MR], P1[MR];
#pragma GCC unroll 8
        for (int k = k0; k < k0 + T::GROUP16; ++k) {
          kq_i w0, w1;
          kq_quads(T{}, L, p, j, k, w0, w1);
          const int64_t off0 = 256 * b + 4 * (T::QPS * 2 * j + k), off1 = off0 + 4 * T::QPS;
          for (int i = 0; i < MR; ++i) {
            const __m256i p0 = _mm256_maddubs_epi16(w0, _mm256_set1_epi32(load_i32(xq + i * K + off0)));
            const __m256i p1 = _mm256_maddubs_epi16(w1, _mm256_set1_epi32(load_i32(xq + i * K + off1)));
            P0[i] = k == k0 ? p0 : _mm256_add_epi16(P0[i], p0);
            P1[i] = k == k0 ? p1 : _mm256_add_epi16(P1[i], p1);
          }
        }
        for (int i = 0; i < MR; ++i) {
          S0[i] = _mm256_add_epi32(S0[i], _mm256_madd_epi16(P0[i], ones));
          S1[i] = _mm256_add_epi32(S1[i], _mm256_madd_epi16(P1[i], ones));
        }
      }
#endif
      kq_f dsc0, dsc1;
      kq_dsc(T{}, L, p, d, j, dsc0, dsc1);
      for (int i = 0; i < MR; ++i) {
        t[i] = j == 0 ? KqLanes::mul(KqLanes::cvt(S0[i]), dsc0) : KqLanes::fma(KqLanes::cvt(S0[i]), dsc0, t[i]);
        t[i] = KqLanes::fma(KqLanes::cvt(S1[i]), dsc1, t[i]);
      }
#if ROWSTABLE_VNNI
      if constexpr (MR2 > 0) {
        kq_i U0[MR2 ? MR2 : 1], U1[MR2 ? MR2 : 1];
        for (int i = 0; i < MR2; ++i) U0[i] = U1[i] = KqLanes::zero();
#pragma GCC unroll 8
        for (int k = 0; k < T::QPS; ++k) {
          const int64_t off0 = 256 * b + 4 * (T::QPS * 2 * j + k), off1 = off0 + 4 * T::QPS;
#pragma GCC unroll 8
          for (int i = 0; i < MR2; ++i) {
            U0[i] = KqLanes::dot4(U0[i], kept[2 * k], load_i32(xq + (MR + i) * K + off0));
            U1[i] = KqLanes::dot4(U1[i], kept[2 * k + 1], load_i32(xq + (MR + i) * K + off1));
          }
        }
        for (int i = 0; i < MR2; ++i) {
          kq_f& u = t[MR + i];
          u = j == 0 ? KqLanes::mul(KqLanes::cvt(U0[i]), dsc0) : KqLanes::fma(KqLanes::cvt(U0[i]), dsc0, u);
          u = KqLanes::fma(KqLanes::cvt(U1[i]), dsc1, u);
        }
      }
#endif
    }
    const kq_f e = kq_e(T{}, L, p, d);
    kq_i C[R];
    for (int i = 0; i < R; ++i) C[i] = KqLanes::zero();
    for (int j = 0; j < T::NP; ++j) {
      const kq_i cp = kq_pair(T{}, L, p, j);
      for (int i = 0; i < R; ++i) {
        int32_t pair;
        std::memcpy(&pair, bs + i * nbs + per_block * b + 2 * j, 4);
        C[i] = KqLanes::dot2(C[i], cp, pair);
      }
    }
    for (int i = 0; i < R; ++i)
      acc[i] = KqLanes::fma(KqLanes::fma(KqLanes::cvt(C[i]), e, t[i]), KqLanes::set1(dx[i * nbx + b]), acc[i]);
  }
  for (int i = 0; i < R; ++i) L.store(y + i * ldy, acc[i]);
}

template <class T>
void kq_tiles(int64_t mr, const int8_t* xq, const float* dx, const int16_t* bs, int64_t K, const uint8_t* g, int64_t nb,
              float* y, int64_t ldy) {
#if ROWSTABLE_VNNI
  for (int h = 0; h < 1; ++h) {
#else
  for (int h = 0; h < 16; h += 8) {
#endif
    const KqLanes L{h};
    switch (mr) {
      case 1: kq_tile<1, 0, T>(L, xq, dx, bs, K, g, nb, y, ldy); break;
      case 2: kq_tile<2, 0, T>(L, xq, dx, bs, K, g, nb, y, ldy); break;
      case 3: kq_tile<3, 0, T>(L, xq, dx, bs, K, g, nb, y, ldy); break;
      case 4: kq_tile<4, 0, T>(L, xq, dx, bs, K, g, nb, y, ldy); break;
      case 5: kq_tile<5, 0, T>(L, xq, dx, bs, K, g, nb, y, ldy); break;
      case 6: kq_tile<6, 0, T>(L, xq, dx, bs, K, g, nb, y, ldy); break;
      case 7: kq_tile<7, 0, T>(L, xq, dx, bs, K, g, nb, y, ldy); break;
      case 8: kq_tile<8, 0, T>(L, xq, dx, bs, K, g, nb, y, ldy); break;
#if ROWSTABLE_VNNI
      case 9: kq_tile<8, 1, T>(L, xq, dx, bs, K, g, nb, y, ldy); break;
      case 10: kq_tile<8, 2, T>(L, xq, dx, bs, K, g, nb, y, ldy); break;
      case 11: kq_tile<8, 3, T>(L, xq, dx, bs, K, g, nb, y, ldy); break;
      case 12: kq_tile<8, 4, T>(L, xq, dx, bs, K, g, nb, y, ldy); break;
      case 13: kq_tile<8, 5, T>(L, xq, dx, bs, K, g, nb, y, ldy); break;
      case 14: kq_tile<8, 6, T>(L, xq, dx, bs, K, g, nb, y, ldy); break;
      case 15: kq_tile<8, 7, T>(L, xq, dx, bs, K, g, nb, y, ldy); break;
      case 16: kq_tile<8, 8, T>(L, xq, dx, bs, K, g, nb, y, ldy); break;
#endif
      default: TORCH_CHECK(false, "kq_tiles: ", mr, " rows in a tile");
    }
  }
}

// x [..., K] @ the concatenation of the parts' rows^T -> [..., sum of Ns]; each part's packed blocks
// (type 12: Q4_K, 13: Q5_K, 14: Q6_K) checked for size.
at::Tensor kq_linear_q8(const at::Tensor& x_, at::TensorList packed, at::IntArrayRef types, at::IntArrayRef Ns, int64_t K) {
  const char* op = "kq_linear_q8";
  TORCH_CHECK(packed.size() >= 1 && packed.size() == types.size() && packed.size() == Ns.size(), op,
              ": give one type and one row count for each packed tensor");
  TORCH_CHECK(x_.scalar_type() == at::kFloat && x_.dim() >= 1 && x_.size(-1) == K, op, ": x must be float32 [..., K] with K=", K);
  TORCH_CHECK(K > 0 && K % 256 == 0, op, ": K=", K, " is not a multiple of 256");
  const int64_t nb = K / 256;
  struct Part { const uint8_t* w; int64_t type, groups, col; };
  std::vector<Part> parts;
  std::vector<int64_t> first{0};
  constexpr int64_t TASK = 4;  // groups a task (64 outputs)
  int64_t cols = 0;
  for (size_t p = 0; p < packed.size(); ++p) {
    const int64_t bb = kq_block_bytes(types[p]);
    TORCH_CHECK(bb > 0, op, ": ggml type ", types[p], " is not Q4_K (12), Q5_K (13) or Q6_K (14)");
    TORCH_CHECK(packed[p].scalar_type() == at::kByte && packed[p].is_contiguous(), op, ": the packed blocks must be contiguous uint8");
    TORCH_CHECK(Ns[p] >= 0 && Ns[p] % KQ_G == 0 && packed[p].numel() == Ns[p] / KQ_G * nb * bb, op, ": [", Ns[p], ", ", K,
                "] takes ", Ns[p] / KQ_G * nb * bb, " bytes (N a multiple of 16); got ", packed[p].numel());
    if (Ns[p] > 0) {
      parts.push_back({packed[p].data_ptr<uint8_t>(), types[p], Ns[p] / KQ_G, cols});
      first.push_back(first.back() + (Ns[p] / KQ_G + TASK - 1) / TASK);
    }
    cols += Ns[p];
  }
  const at::Tensor x = x_.contiguous();
  const int64_t M = x.numel() / K;
  at::Tensor y = empty_outputs(x, cols);
  if (M == 0 || cols == 0) return y;
  Q8Rows xr;
  quantize_rows_q8(x.data_ptr<float>(), M, K, 256, xr, false);
  vec64<int16_t> b32(M * K / 32);  // the sums of each 32 q_x (Q4_K's mins), from those of each 16
  for (int64_t k = 0; k < M * K / 32; ++k) b32[k] = static_cast<int16_t>(xr.bsum[2 * k] + xr.bsum[2 * k + 1]);
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (M + KQ_TILE - 1) / KQ_TILE;
  shared_tasks(first.back(), [&](int64_t t, std::vector<float>&) {
    const size_t pi = std::upper_bound(first.begin(), first.end(), t) - first.begin() - 1;
    const Part& pt = parts[pi];
    const int64_t bb = kq_block_bytes(pt.type);
    for (int64_t gi = (t - first[pi]) * TASK, g1 = std::min(pt.groups, gi + TASK); gi < g1; ++gi)
      for (int64_t r = 0; r < tiles; ++r) {
        const int64_t a = r * M / tiles, e = (r + 1) * M / tiles;
        const uint8_t* g = pt.w + gi * nb * bb;
        float* yt = yp + a * cols + pt.col + KQ_G * gi;
        if (pt.type == 12)
          kq_tiles<KqQ4K>(e - a, xr.q.data() + a * K, xr.d.data() + a * nb, b32.data() + a * (K / 32), K, g, nb, yt, cols);
        else if (pt.type == 13)
          kq_tiles<KqQ5K>(e - a, xr.q.data() + a * K, xr.d.data() + a * nb, b32.data() + a * (K / 32), K, g, nb, yt, cols);
        else
          kq_tiles<KqQ6K>(e - a, xr.q.data() + a * K, xr.d.data() + a * nb, xr.bsum.data() + a * (K / 16), K, g, nb, yt, cols);
      }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec_rs, lib) { lib.def("kq_linear_q8(Tensor x, Tensor[] packed, int[] ggml_types, int[] Ns, int K) -> Tensor"); }
TORCH_LIBRARY_IMPL(specdec_rs, CPU, lib) { lib.impl("kq_linear_q8", &kq_linear_q8); }

namespace {
// One decoding step's layer of a Llama-family model whose four projections are on the kernels'
// repacked blocks (kinds: 0 q4_1_linear_q8, 1 q8_0_linear_q8, 2 kq_linear_q8): the calls the Python
// fused step makes (models/llama.py, Block.forward), in the same order on the same functions, so the
// same numbers, without 8 calls through the dispatcher and the Python between them (the default
// model's plain decoding 1.035-1.048x faster on a 2-core Xeon, benchmarks/decode_layer_ab.py). Per
// projection p, counts[p] tensors of `packed` (and their types and Ns: kinds 0 and 1 take one, with
// its N) and Ks[p] (kind 2's K).
at::Tensor layer_projection(int64_t kind, const at::Tensor& x, at::TensorList packed, at::IntArrayRef types,
                            at::IntArrayRef Ns, int64_t K) {
  if (kind == 0) return q4_1_linear_q8(x, packed[0], Ns[0]);
  if (kind == 1) return q8_0_linear_q8(x, packed[0], Ns[0]);
  return kq_linear_q8(x, packed, types, Ns, K);
}

at::Tensor decode_layer(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor kc, at::Tensor vc,
                        const at::Tensor& start, int64_t heads, int64_t n_keys, const c10::optional<at::Tensor>& mask,
                        const c10::optional<at::Tensor>& row_keys, const at::Tensor& attn_norm, const at::Tensor& mlp_norm,
                        double eps, at::IntArrayRef kinds, at::TensorList packed, at::IntArrayRef counts,
                        at::IntArrayRef types, at::IntArrayRef Ns, at::IntArrayRef Ks,
                        const c10::optional<at::Tensor>& qkv_bias) {
  TORCH_CHECK(kinds.size() == 4 && counts.size() == 4 && Ks.size() == 4, "decode_layer: four projections");
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  TORCH_CHECK(static_cast<int64_t>(packed.size()) == total &&
                  static_cast<int64_t>(types.size()) == total && static_cast<int64_t>(Ns.size()) == total,
              "decode_layer: one type and one row count for each packed tensor");
  int64_t first[5] = {0, 0, 0, 0, 0};
  for (int p = 0; p < 4; ++p) {
    TORCH_CHECK(kinds[p] >= 0 && kinds[p] <= 2 && counts[p] >= 1 && (kinds[p] == 2 || counts[p] == 1),
                "decode_layer: projection ", p, " has kind ", kinds[p], " and ", counts[p], " tensors");
    first[p + 1] = first[p] + counts[p];
  }
  auto proj = [&](int p, const at::Tensor& in) {
    const int64_t a = first[p], n = counts[p];
    return layer_projection(kinds[p], in, packed.slice(a, n), types.slice(a, n), Ns.slice(a, n), Ks[p]);
  };
  at::Tensor qkv = proj(0, rms_norm(x, attn_norm, eps));
  if (qkv_bias.has_value()) qkv = qkv + *qkv_bias;  // (Qwen2's: the Python step's same addition)
  const at::Tensor o = rope_attend(qkv, cos, sin, kc, vc, start, heads, n_keys, mask, row_keys);
  const at::Tensor h = x + proj(1, o);
  return h + proj(3, silu_mul(proj(2, rms_norm(h, mlp_norm, eps))));
}

// Every layer of a decoding step, decode_layer after decode_layer (the same calls, so the same
// numbers), for a model whose layers all take it: one call through the dispatcher a step instead of
// one a layer (each ~15 us of argument parsing and Python: the default model's one-token step 5.34 ->
// 4.88 ms on a 2-core Xeon, benchmarks/decode_layer_ab.py --switch layers). Per layer l: its caches,
// its norms, and 4 projections' kinds, counts and Ks at [4 l, 4 l + 4); its tensors, types and Ns
// follow each other in `packed`, `types` and `Ns`; qkv_biases: none, or one a layer.
at::Tensor decode_layers(const at::Tensor& x_, const at::Tensor& cos, const at::Tensor& sin, at::TensorList kcs,
                         at::TensorList vcs, const at::Tensor& start, int64_t heads, int64_t n_keys,
                         const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& row_keys,
                         at::TensorList attn_norms, at::TensorList mlp_norms, double eps, at::IntArrayRef kinds,
                         at::TensorList packed, at::IntArrayRef counts, at::IntArrayRef types, at::IntArrayRef Ns,
                         at::IntArrayRef Ks, at::TensorList qkv_biases) {
  const int64_t L = static_cast<int64_t>(kcs.size());
  TORCH_CHECK(qkv_biases.empty() || static_cast<int64_t>(qkv_biases.size()) == L,
              "decode_layers: no qkv biases or one a layer");
  TORCH_CHECK(static_cast<int64_t>(vcs.size()) == L && static_cast<int64_t>(attn_norms.size()) == L &&
                  static_cast<int64_t>(mlp_norms.size()) == L && static_cast<int64_t>(kinds.size()) == 4 * L &&
                  static_cast<int64_t>(counts.size()) == 4 * L && static_cast<int64_t>(Ks.size()) == 4 * L,
              "decode_layers: per layer a K and V cache, two norms and four projections");
  at::Tensor x = x_;
  int64_t at = 0;
  for (int64_t l = 0; l < L; ++l) {
    int64_t n = 0;
    for (int64_t p = 4 * l; p < 4 * l + 4; ++p) n += counts[p];
    TORCH_CHECK(at + n <= static_cast<int64_t>(packed.size()) && at + n <= static_cast<int64_t>(types.size()) &&
                    at + n <= static_cast<int64_t>(Ns.size()),
                "decode_layers: fewer packed tensors than the counts name");
    x = decode_layer(x, cos, sin, kcs[l], vcs[l], start, heads, n_keys, mask, row_keys, attn_norms[l], mlp_norms[l], eps,
                     kinds.slice(4 * l, 4), packed.slice(at, n), counts.slice(4 * l, 4), types.slice(at, n),
                     Ns.slice(at, n), Ks.slice(4 * l, 4),
                     qkv_biases.empty() ? c10::optional<at::Tensor>() : c10::optional<at::Tensor>(qkv_biases[l]));
    at += n;
  }
  TORCH_CHECK(at == static_cast<int64_t>(packed.size()), "decode_layers: more packed tensors than the counts name");
  return x;
}

// The index of each row's largest value over the last dimension, as torch.argmax(x, -1) gives it:
// the first index of the maximum (0.0 and -0.0 equal), or of the first NaN where a row has one. A
// greedy step reads it over the vocabulary for every verified position: torch's reduction took
// ~62 us a 49152-wide row on a 2-core Xeon, this one a vector maximum and a vector search.
int64_t argmax_row(const float* p, int64_t V) {
  const int64_t V8 = V / 8 * 8;
  __m256 best = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
  for (int64_t i = 0; i < V8; i += 8) {
    const __m256 v = _mm256_loadu_ps(p + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    best = _mm256_max_ps(best, v);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, best);
  float mx = -INFINITY;
  for (float l : lanes) mx = l > mx ? l : mx;
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t i = V8; i < V; ++i) {
    has_nan = has_nan || std::isnan(p[i]);
    mx = p[i] > mx ? p[i] : mx;
  }
  if (has_nan) {
    for (int64_t i = 0; i < V; ++i)
      if (std::isnan(p[i])) return i;
  }
  const __m256 target = _mm256_set1_ps(mx);
  for (int64_t i = 0; i < V8; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + i), target, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(static_cast<unsigned>(hit));
  }
  for (int64_t i = V8; i < V; ++i)
    if (p[i] == mx) return i;
  return 0;
}

at::Tensor argmax_last(const at::Tensor& x_) {
  TORCH_CHECK(x_.scalar_type() == at::kFloat && x_.dim() >= 1 && x_.size(-1) > 0,
              "argmax_last: x must be float32 [..., V] with V > 0");
  const at::Tensor x = x_.contiguous();
  const int64_t V = x.size(-1), R = x.numel() / V;
  at::Tensor out = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  // (one thread for a few rows: a 49152-wide row takes microseconds, waking others costs as much)
  const int64_t grain = R * V < (int64_t{1} << 20) ? std::max<int64_t>(R, 1) : 1;
  pool_for(0, R, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = argmax_row(xp + r * V, V);
  });
  return out;
}

// Switches the kernels between their own pool (enabled 1) and OpenMP regions (0), sets how long the
// pool's workers spin for the next call (microseconds; -2: as they find their cores shared or not) and
// how many threads a call takes (0: torch's count); -1 leaves a setting as it is. The same numbers
// either way.
void set_kernel_pool(int64_t enabled, int64_t spin_us, int64_t threads) {
  if (enabled >= 0) KernelPool::settings().enabled.store(enabled > 0);
  if (spin_us >= 0 || spin_us == -2) KernelPool::settings().spin_us.store(spin_us);
  if (threads >= 0) KernelPool::settings().threads.store(threads);
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec_rs, lib) {
  lib.def("set_kernel_pool(int enabled, int spin_us, int threads) -> ()", &set_kernel_pool);  // (no tensor: every backend)
  lib.def("argmax_last(Tensor x) -> Tensor");
  lib.def("decode_layer(Tensor x, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor start, int heads, "
          "int n_keys, Tensor? mask, Tensor? row_keys, Tensor attn_norm, Tensor mlp_norm, float eps, int[] kinds, "
          "Tensor[] packed, int[] counts, int[] ggml_types, int[] Ns, int[] Ks, Tensor? qkv_bias=None) -> Tensor");
  lib.def("decode_layers(Tensor x, Tensor cos, Tensor sin, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor start, "
          "int heads, int n_keys, Tensor? mask, Tensor? row_keys, Tensor[] attn_norms, Tensor[] mlp_norms, float eps, "
          "int[] kinds, Tensor[] packed, int[] counts, int[] ggml_types, int[] Ns, int[] Ks, Tensor[] qkv_biases) -> Tensor");
}
TORCH_LIBRARY_IMPL(specdec_rs, CPU, lib) {
  lib.impl("decode_layer", &decode_layer);
  lib.impl("decode_layers", &decode_layers);
  lib.impl("argmax_last", &argmax_last);
}
