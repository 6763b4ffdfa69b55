// moescope native CPU kernels: dense dots over [out, in] weights (bf16, f32, or ggml's Q8_0 / Q4_0 / Q4_K /
// Q6_K blocks: see "Block-quantized weights" below), SwiGLU experts, a layer's routed experts in one call,
// and row gathers (embedding lookups). Used from jitted JAX programs through XLA FFI custom calls
// (moescope_linear, moescope_swiglu, moescope_experts, each with an _f32 variant, moescope_qlinear,
// moescope_qswiglu, moescope_qexperts, and moescope_take_rows) and from Python through ctypes (ms_linear,
// ms_experts, ms_qlinear, ms_qexperts; models/native/__init__.py). Built by models/native/build.py with plain
// -O3: the ISA-specific code is compiled under `#pragma GCC target` and chosen once at load time (AMX-BF16 tiles
// for calls of >= 16 activation rows, 8-12 for block types, where the CPU has AMX and the kernel grants the tile state,
// AVX512-BF16 + VNNI, AVX2+FMA, or portable scalar code; MOESCOPE_NATIVE_ISA or ms_set_isa force a slower one).
//
// Layout. Every weight is [N, K] row-major with contiguous rows (HF/torch [out, in]):
//   y[m, n] = sum_k x[m, k] * W[n, k].
// A SwiGLU expert is gate [F, H], up [F, H], down [H, F]:
//   y = (silu(x gate^T) * (x up^T)) down^T.
// Weights are only read, never written (they may be read-only mappings of checkpoint files).
//
// Numerics.
//   * Products are accumulated in f32, always. Each output element is one f32 sum whose order depends
//     on K, on the ISA path and, on the AVX-512 path, on whether the call has one activation row or
//     more (two lane layouts, below) -- never on the thread count, on how rows are split into parts
//     or on how K is chunked: results are deterministic and the same for any number of threads.
//   * bf16 weights: the activation is bf16 (exact). The AVX512-BF16 path multiplies bf16 pairs with
//     VDPBF16PS (exact products, f32 sums; this instruction reads bf16 denormals as zero); the AVX2 and
//     scalar paths widen both to f32 and use f32 FMAs / multiply-adds. A linear map returns f32 (C ABI)
//     or its f32 sums rounded once to bf16, round-to-nearest-even (FFI). A SwiGLU expert rounds the
//     gate and up projections to bf16, computes silu(g) * u in f32, rounds h to bf16 before the down
//     projection (as a bf16 JAX/torch model does: every matmul output is bf16), and returns the down
//     projection in f32, unrounded.
//   * f32 weights: plain f32 everywhere, no rounding.
//
// Memory streaming. A decode-sized call (M <= 4 rows) is bound by the rate weights come from memory.
// On one core that rate is limited by how many cache lines are in flight, so a call streams several
// weight rows at once (a part's rows are cut into R equal runs, each read sequentially) and, on the
// AVX-512 path, packs up to 4 activation rows into the 128-bit lanes of one accumulator (a 16-byte
// weight chunk broadcast to every lane), which leaves enough registers for 6-8 concurrent weight
// streams at M = 2..4, and prefetches those streams into L2 a few KiB ahead (for 1 row the out-of-order window
// keeps enough lines in flight by itself). For more rows, groups of 4 are computed two at a time
// against each block of weight rows and K is walked in chunks (partial sums kept as vectors between
// chunks), so the weight block and the activation chunk stay in cache and the weights are read from
// memory once per 128 activation rows.
//
// Threads. A persistent pool of std::threads shared by all callers, safe for concurrent calls from
// different host threads (XLA's thread and a torch worker may call at the same time). A call splits
// its output rows into parts; the calling thread and up to `threads - 1` pool workers take parts
// from a shared counter, so a call never waits for a worker busy elsewhere: it does the work itself.
// Work under 256 KiB of weights (and little compute) runs on the calling thread alone. A layer's
// experts may instead be shared out whole, one thread per expert (experts_core: small experts at
// decode sizes), with the same results bit for bit. Inside an XLA FFI call the helpers are tasks on
// XLA's own intra-op pool instead of the kernels' workers (Executor): XLA's idle pool threads spin
// for a while after each op, and extra threads of ours would compete with them for the cores
// (measured: a 6-expert DeepSeek layer in a jitted loop took 3.0 ms a call on our workers and
// 2.2 ms on XLA's, 2 cores).

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

// x86-64 kernels (MOESCOPE_PORTABLE: build only the portable scalar code, as on other architectures)
#if defined(__x86_64__) && !defined(MOESCOPE_PORTABLE)
#define MS_X86 1
#include <immintrin.h>
#else
#define MS_X86 0
#endif

#if defined(__has_include)
#if __has_include("xla/ffi/api/ffi.h") && !defined(MOESCOPE_NO_FFI)
#define MOESCOPE_HAVE_FFI 1
#include "xla/ffi/api/ffi.h"
#endif
#endif

namespace {

// ------------------------------------------------------------------------------------------------
// Basics
// ------------------------------------------------------------------------------------------------

enum Isa { kScalar = 0, kAvx2 = 1, kAvx512Bf16 = 2, kAmx = 3 };
enum WType { kWBf16 = 0, kWF32 = 1 };

constexpr int kKC = 2048;                    // K chunk (elements) of a weight-row block, reused from cache
constexpr int kMB = 128;                     // activation rows per pass over the weights (multiple of 4)
constexpr size_t kSmallBytes = 256 * 1024;   // below this much weight, one thread ...
constexpr double kSmallMacs = 4.0e6;         // ... unless the compute is large
constexpr size_t kTakeParallelBytes = 4 * 1024 * 1024;  // row copies (take_rows) over threads from here

inline float bf16_to_f32(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even; NaN stays a (quiet) NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

inline void cpu_relax() {
#if MS_X86
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// AMX tiles need the kernel's permission for the XTILEDATA state component, once per process.
bool amx_permitted() {
#if MS_X86 && defined(__linux__)
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18, kSysArchPrctl = 158;
  return syscall(kSysArchPrctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

int detect_isa() {
#if MS_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16") &&
      __builtin_cpu_supports("avx512vnni")) {
    if (__builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8") &&
        __builtin_cpu_supports("amx-bf16") && amx_permitted())
      return kAmx;
    return kAvx512Bf16;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
#endif
  return kScalar;
}

const char* isa_name(int isa) {
  switch (isa) {
    case kAmx: return "amx";
    case kAvx512Bf16: return "avx512bf16";
    case kAvx2: return "avx2";
    default: return "scalar";
  }
}

int isa_from_name(const char* s) {
  if (!s) return -1;
  std::string n(s);
  if (n == "amx") return kAmx;
  if (n == "avx512bf16" || n == "avx512" || n == "avx512vnni") return kAvx512Bf16;
  if (n == "avx2") return kAvx2;
  if (n == "scalar") return kScalar;
  return -1;
}

int cpus_available() {
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
#endif
  unsigned n = std::thread::hardware_concurrency();
  return n ? int(n) : 1;
}

const int g_best_isa = detect_isa();
std::atomic<int> g_isa{[] {
  int want = isa_from_name(std::getenv("MOESCOPE_NATIVE_ISA"));
  return (want >= 0 && want <= g_best_isa) ? want : g_best_isa;
}()};
std::atomic<int> g_threads{cpus_available()};

// Where the AVX-512 block kernels prefetch their weight streams (enum QPrefetch, next to the kernels): L1 on AMD,
// L2 elsewhere (see kQPrefetch); MOESCOPE_NATIVE_QPREFETCH=l1|l2|off overrides it at load, ms_set_qprefetch after.
int qprefetch_from_name(const char* s) {
  if (!s) return -1;
  const std::string n(s);
  return n == "off" ? 0 : n == "l2" ? 1 : n == "l1" ? 2 : -1;
}

const char* qprefetch_name(int pf) { return pf == 0 ? "off" : pf == 1 ? "l2" : "l1"; }

int qprefetch_default() {
#if MS_X86
  __builtin_cpu_init();
  if (__builtin_cpu_is("amd")) return 2;
#endif
  return 1;
}

std::atomic<int> g_qprefetch{[] {
  const int want = qprefetch_from_name(std::getenv("MOESCOPE_NATIVE_QPREFETCH"));
  return want >= 0 ? want : qprefetch_default();
}()};

thread_local std::string t_error;

int fail(const std::string& msg) {
  t_error = msg;
  return -1;
}
// ------------------------------------------------------------------------------------------------
// Thread pool
// ------------------------------------------------------------------------------------------------

// Another thread pool to borrow helpers from: an FFI handler lends XLA's intra-op pool for the duration
// of its call (t_executor), so that the kernels' helpers run on XLA's own threads instead of competing
// for the cores with them (XLA:CPU's idle pool threads spin for a while after each op).
struct Executor {
  virtual ~Executor() = default;
  virtual int threads() const = 0;                        // its thread count (<= 0: unusable)
  virtual void schedule(std::function<void()> task) = 0;  // runs task() on one of its threads, later
};
thread_local Executor* t_executor = nullptr;

// Parts claimed from a counter by the caller and by helper tasks that may start late -- even after the
// call returned: the state is shared, and a helper counts itself active before it claims a part, so the
// caller, once every part is claimed, only waits for helpers that hold one.
struct SharedJob {
  void (*fn)(void*, int);
  void* ctx;
  int nparts;
  std::atomic<int> next{0};
  std::atomic<int> active{0};
  void work() {
    for (;;) {
      const int i = next.fetch_add(1);
      if (i >= nparts) return;
      fn(ctx, i);
    }
  }
};

void run_borrowed(Executor& ex, int nparts, int threads, void (*fn)(void*, int), void* ctx) {
  auto job = std::make_shared<SharedJob>();
  job->fn = fn;
  job->ctx = ctx;
  job->nparts = nparts;
  const int helpers = std::min({threads, nparts, ex.threads() + 1}) - 1;
  for (int h = 0; h < helpers; ++h)
    ex.schedule([job] {
      job->active.fetch_add(1);
      job->work();
      job->active.fetch_sub(1);
    });
  job->work();
  for (int i = 0; job->active.load() != 0; ++i) {
    if (i < 20000) cpu_relax(); else std::this_thread::yield();
  }
}

struct Job {
  void (*fn)(void*, int);
  void* ctx;
  int nparts;
  std::atomic<int> next{0};
  std::atomic<int> active{0};  // workers that hold this job (changed under the pool mutex)
};

class Pool {
 public:
  // Runs fn(ctx, i) for i in [0, nparts) on the caller and up to threads - 1 workers.
  void run(int nparts, int threads, void (*fn)(void*, int), void* ctx) {
    if (nparts <= 0) return;
    if (threads <= 1 || nparts == 1) {
      for (int i = 0; i < nparts; ++i) fn(ctx, i);
      return;
    }
    if (t_executor != nullptr && t_executor->threads() > 0) return run_borrowed(*t_executor, nparts, threads, fn, ctx);
    Job job;
    job.fn = fn;
    job.ctx = ctx;
    job.nparts = nparts;
    int tickets = std::min(threads, nparts) - 1;
    ensure_workers(tickets);
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (int t = 0; t < tickets; ++t) queue_.push_back(&job);
      pending_.fetch_add(tickets, std::memory_order_release);
    }
    if (tickets == 1)
      cv_work_.notify_one();
    else
      cv_work_.notify_all();
    work(&job);
    // Every part is claimed: withdraw the tickets nobody took, then wait for the workers that did.
    std::unique_lock<std::mutex> lk(mu_);
    size_t before = queue_.size();
    queue_.erase(std::remove(queue_.begin(), queue_.end(), &job), queue_.end());
    pending_.fetch_sub(int(before - queue_.size()), std::memory_order_relaxed);
    if (job.active.load(std::memory_order_acquire) != 0) {
      lk.unlock();
      for (int i = 0; i < 10000 && job.active.load(std::memory_order_acquire) != 0; ++i) cpu_relax();
      lk.lock();
      cv_done_.wait(lk, [&] { return job.active.load(std::memory_order_acquire) == 0; });
    }
  }

 private:
  static void work(Job* job) {
    for (;;) {
      int i = job->next.fetch_add(1, std::memory_order_relaxed);
      if (i >= job->nparts) return;
      job->fn(job->ctx, i);
    }
  }

  void ensure_workers(int n) {
    n = std::min(n, 255);
    if (nworkers_.load(std::memory_order_acquire) >= n) return;
    std::lock_guard<std::mutex> lk(mu_);
    while (nworkers_.load(std::memory_order_relaxed) < n) {
      std::thread(&Pool::loop, this).detach();
      nworkers_.fetch_add(1, std::memory_order_release);
    }
  }

  void loop() {
    for (;;) {
      // spin a little first: back-to-back calls (an expert's two phases, a layer's experts) find us awake
      for (int i = 0; i < 4000 && pending_.load(std::memory_order_acquire) == 0; ++i) cpu_relax();
      Job* job;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_work_.wait(lk, [&] { return !queue_.empty(); });
        job = queue_.front();
        queue_.pop_front();
        pending_.fetch_sub(1, std::memory_order_relaxed);
        job->active.fetch_add(1, std::memory_order_relaxed);
      }
      work(job);
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (job->active.fetch_sub(1, std::memory_order_acq_rel) == 1) cv_done_.notify_all();
      }
    }
  }

  std::mutex mu_;
  std::condition_variable cv_work_, cv_done_;
  std::deque<Job*> queue_;
  std::atomic<int> pending_{0};
  std::atomic<int> nworkers_{0};
};

// Leaked on purpose: detached workers may still be blocked in it at exit. A forked child gets a fresh
// pool (the parent's workers do not exist there, and its mutex may have been held at fork time).
Pool* g_pool = new Pool();

#if defined(__linux__)
void reset_pool_in_child() { g_pool = new Pool(); }
const int g_atfork = pthread_atfork(nullptr, nullptr, reset_pool_in_child);
#endif

template <class F>
void parallel(int nparts, int threads, F& f) {
  g_pool->run(nparts, threads, [](void* c, int i) { (*static_cast<F*>(c))(i); }, &f);
}

int resolve_threads(int threads) {
  if (threads <= 0) threads = g_threads.load(std::memory_order_relaxed);
  return std::max(1, std::min(threads, 256));
}

// Threads for a section that reads `wbytes` of weights and does `macs` multiply-adds.
int threads_for(int threads, double wbytes, double macs) {
  threads = resolve_threads(threads);
  if (wbytes < double(kSmallBytes) && macs < kSmallMacs) return 1;
  return threads;
}

// Parts for `n` output rows on `threads` threads: a few per thread (the caller takes over parts of
// a worker that is late), at least 16 rows each.
int parts_for(int64_t n, int threads) {
  if (threads <= 1) return 1;
  int64_t p = std::min<int64_t>(int64_t(threads) * 4, std::max<int64_t>(1, n / 16));
  return int(std::max<int64_t>(p, 1));
}

inline int64_t part_begin(int64_t n, int nparts, int i) { return n * i / nparts; }

// ------------------------------------------------------------------------------------------------
// Activations, as the ISA path reads them.
//   kPlain: rows of `ld` elements.
//   kQuad (AVX-512, M >= 2): groups of 4 rows, each [Kp / g][4][g] with g elements per 128-bit lane
//     (bf16 8, f32 4); group q starts at q * gstride. Rows past M are zero.
// Kp is K rounded up to a whole 64-byte vector (bf16 32, f32 16); the padding is zero.
// Element type: bf16 bits on the AVX-512 path with bf16 weights, else f32.
// ------------------------------------------------------------------------------------------------

enum Layout { kPlain = 0, kQuad = 1 };

struct Act {
  const void* x = nullptr;
  size_t ld = 0;        // kPlain: row stride (elements)
  int64_t gstride = 0;  // kQuad: group stride (elements)
  int layout = kPlain;
};

inline bool act_is_bf16(int isa, int wt) { return isa >= kAvx512Bf16 && wt == kWBf16; }

// ------------------------------------------------------------------------------------------------
// Micro-kernels. A micro-kernel computes R weight rows (given by pointers) against activation rows
// (one or a few; on AVX-512 one row or groups of four), over k in [k0, k1), and stores -- or, when
// `acc`, adds -- each sum into y[m * ldy + nc[r]].
// ------------------------------------------------------------------------------------------------

#define MK_ARGS(XT, WT) \
  const XT *x, size_t ldx, const WT *const *wr, int k0, int k1, float *y, size_t ldy, const int *nc, bool acc
#define MK_PASS x, ldx, wr, k0, k1, y, ldy, nc, acc

inline void put(float* p, float s, bool acc) { *p = acc ? *p + s : s; }

// ---- scalar (any architecture): 8 lanes per sum, summed in a fixed order -------------------------

inline float wval(uint16_t w) { return bf16_to_f32(w); }
inline float wval(float w) { return w; }

template <class WT>
void mk_scalar(MK_ARGS(float, WT)) {  // one activation row, one weight row
  (void)ldx;
  (void)ldy;
  const WT* w = wr[0];
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int k = k0;
  for (; k + 8 <= k1; k += 8)
    for (int j = 0; j < 8; ++j) lane[j] += x[k + j] * wval(w[k + j]);
  float tail = 0.0f;
  for (; k < k1; ++k) tail += x[k] * wval(w[k]);
  float s = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7])) + tail;
  put(y + nc[0], s, acc);
}

template <class WT>
struct KScalar {
  using W = WT;
  static constexpr int R = 1, MRMAX = 1;
  static void run(int, int, MK_ARGS(float, WT)) { mk_scalar<WT>(MK_PASS); }
};

#if MS_X86

// ---- AVX2 + FMA: f32 activations; bf16 weights widened by a 16-bit shift; 8 lanes per sum --------

#pragma GCC push_options
#pragma GCC target("avx2,fma")

inline float hsum128(__m128 q) {
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}

inline float hsum256(__m256 v) { return hsum128(_mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1))); }

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <int R, int MR, class WT>
void mk_avx2(MK_ARGS(float, WT)) {
  __m256 a[MR][R];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) a[m][r] = _mm256_setzero_ps();
  int k = k0;
  for (; k + 8 <= k1; k += 8) {
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load8(wr[r] + k);
    for (int m = 0; m < MR; ++m) {
      __m256 xv = _mm256_loadu_ps(x + m * ldx + k);
      for (int r = 0; r < R; ++r) a[m][r] = _mm256_fmadd_ps(xv, wv[r], a[m][r]);
    }
  }
  if (k < k1) {  // tail: zero-padded copies
    const int n = k1 - k;
    alignas(32) WT wt[8];
    alignas(32) float xt[8];
    __m256 wv[R];
    for (int r = 0; r < R; ++r) {
      std::memset(wt, 0, sizeof(wt));
      std::memcpy(wt, wr[r] + k, n * sizeof(WT));
      wv[r] = load8(wt);
    }
    for (int m = 0; m < MR; ++m) {
      std::memset(xt, 0, sizeof(xt));
      std::memcpy(xt, x + m * ldx + k, n * sizeof(float));
      __m256 xv = _mm256_load_ps(xt);
      for (int r = 0; r < R; ++r) a[m][r] = _mm256_fmadd_ps(xv, wv[r], a[m][r]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) put(y + m * ldy + nc[r], hsum256(a[m][r]), acc);
}

template <class WT>
struct KAvx2 {
  using W = WT;
  static constexpr int R = 4, MRMAX = 2;
  static void run(int r, int mr, MK_ARGS(float, WT)) {
    if (r == R) {
      if (mr == 2) mk_avx2<R, 2, WT>(MK_PASS); else mk_avx2<R, 1, WT>(MK_PASS);
    } else {
      if (mr == 2) mk_avx2<1, 2, WT>(MK_PASS); else mk_avx2<1, 1, WT>(MK_PASS);
    }
  }
};

#pragma GCC pop_options

// ---- AVX-512 (+BF16): bf16 weights with VDPBF16PS, f32 weights with FMA ------------------------

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

// hsum128 / hsum256 (AVX2 section above) inline here too: the wider target is a superset of theirs
inline float hsum512(__m512 v) {
  return hsum256(_mm512_castps512_ps256(_mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4e))));
}

// Element traits: a 64-byte vector holds kE elements; `dot` accumulates x * w into 16 f32 lanes.
struct E512Bf16 {
  using E = uint16_t;
  static constexpr int kE = 32;
  static __m512 dot(__m512 a, __m512i x, __m512i w) { return _mm512_dpbf16_ps(a, (__m512bh)x, (__m512bh)w); }
  static __m512i load(const E* p) { return _mm512_loadu_si512(static_cast<const void*>(p)); }
  static __m512i load_n(const E* p, int n) {  // first n (< 32) elements, rest zero
    return _mm512_maskz_loadu_epi16(__mmask32((uint64_t(1) << n) - 1), p);
  }
  static __m512i bcast128_n(const E* p, int n) {  // n <= 8 elements broadcast to all four lanes
    __m128i q = n >= 8 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))
                       : _mm_maskz_loadu_epi16(__mmask8((1u << n) - 1), p);
    return _mm512_broadcast_i32x4(q);
  }
};

struct E512F32 {
  using E = float;
  static constexpr int kE = 16;
  static __m512 dot(__m512 a, __m512i x, __m512i w) {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(x), _mm512_castsi512_ps(w), a);
  }
  static __m512i load(const E* p) { return _mm512_castps_si512(_mm512_loadu_ps(p)); }
  static __m512i load_n(const E* p, int n) {
    return _mm512_castps_si512(_mm512_maskz_loadu_ps(__mmask16((1u << n) - 1), p));
  }
  static __m512i bcast128_n(const E* p, int n) {
    __m128 q = n >= 4 ? _mm_loadu_ps(p) : _mm_maskz_loadu_ps(__mmask8((1u << n) - 1), p);
    return _mm512_castps_si512(_mm512_broadcast_f32x4(q));
  }
};

// One activation row (plain), R weight rows.
template <class T, int R>
void mk512_sep(MK_ARGS(typename T::E, typename T::E)) {
  (void)ldx;
  (void)ldy;
  constexpr int kE = T::kE;
  __m512 a[R];
  for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_ps();
  int k = k0;
  for (; k + kE <= k1; k += kE) {
    __m512i xv = T::load(x + k);
    for (int r = 0; r < R; ++r) a[r] = T::dot(a[r], xv, T::load(wr[r] + k));
  }
  if (k < k1) {
    const int n = k1 - k;
    __m512i xv = T::load_n(x + k, n);
    for (int r = 0; r < R; ++r) a[r] = T::dot(a[r], xv, T::load_n(wr[r] + k, n));
  }
  for (int r = 0; r < R; ++r) put(y + nc[r], hsum512(a[r]), acc);
}

// Groups of four activation rows packed in 128-bit lanes (x: kQuad layout from the first group, absolute
// k; NG groups, `gstride` apart), R weight rows; `rows` (1 .. 4 * NG) rows are stored, the rest is padding.
// Weight chunks are broadcast once and used for every group. K may come in chunks: the accumulators start
// from zero on the first chunk, else from `vacc`, and go back to `vacc` (NG * R vectors) unless this is
// the last chunk, which reduces them into y. The sums are thus the same however K is chunked.
// PF: the weights come from memory (the first group pair of a chunk): prefetch them kPrefetch bytes ahead
// into L2, which lets more lines be in flight than the out-of-order window alone allows at 4 dots a line.
constexpr int kPrefetch = 3072;

template <class T, int R, int NG, bool PF>
void mk512_quad(const typename T::E* x, int rows, int64_t gstride, const typename T::E* const* wr, int k0, int k1,
                float* y, size_t ldy, const int* nc, float* vacc, bool first, bool last) {
  constexpr int kE = T::kE, kG = kE / 4;
  __m512 a[NG][R];
  for (int q = 0; q < NG; ++q)
    for (int r = 0; r < R; ++r) a[q][r] = first ? _mm512_setzero_ps() : _mm512_load_ps(vacc + (q * R + r) * 16);
  int k = k0;
  for (; k + kE <= k1; k += kE) {
    if (PF)
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(wr[r] + k) + kPrefetch, _MM_HINT_T1);
    for (int j = 0; j < 4; ++j) {
      __m512i xv[NG];
      for (int q = 0; q < NG; ++q) xv[q] = T::load(x + q * gstride + 4 * k + j * kE);
      for (int r = 0; r < R; ++r) {
        const __m512i wv = T::bcast128_n(wr[r] + k + j * kG, kG);
        for (int q = 0; q < NG; ++q) a[q][r] = T::dot(a[q][r], xv[q], wv);
      }
    }
  }
  if (k < k1) {
    const int n = k1 - k;
    for (int j = 0; j < 4 && n > j * kG; ++j) {
      const int nj = std::min(kG, n - j * kG);
      __m512i xv[NG];
      for (int q = 0; q < NG; ++q) xv[q] = T::load(x + q * gstride + 4 * k + j * kE);
      for (int r = 0; r < R; ++r) {
        const __m512i wv = T::bcast128_n(wr[r] + k + j * kG, nj);
        for (int q = 0; q < NG; ++q) a[q][r] = T::dot(a[q][r], xv[q], wv);
      }
    }
  }
  if (!last) {
    for (int q = 0; q < NG; ++q)
      for (int r = 0; r < R; ++r) _mm512_store_ps(vacc + (q * R + r) * 16, a[q][r]);
    return;
  }
  for (int q = 0; q < NG; ++q)
    for (int r = 0; r < R; ++r) {
      const float s[4] = {hsum128(_mm512_extractf32x4_ps(a[q][r], 0)), hsum128(_mm512_extractf32x4_ps(a[q][r], 1)),
                          hsum128(_mm512_extractf32x4_ps(a[q][r], 2)), hsum128(_mm512_extractf32x4_ps(a[q][r], 3))};
      for (int m = 0; m < 4 && 4 * q + m < rows; ++m) y[(4 * q + m) * ldy + nc[r]] = s[m];
    }
}

// Rows (weight streams) per micro-kernel call, by activation layout. More streams keep more lines in
// flight, but rows whose size is a multiple of 4 KiB put every stream in the same L1 set at each step
// (8 ways): 6 quad streams measured best over the real widths (8 loses up to 30% at 2048 x 1408).
constexpr int kRSep = 4, kRQuad = 6;

template <class T>
struct K512 {
  using E = typename T::E;
  static void sep(int r, MK_ARGS(E, E)) {
    if (r == kRSep) mk512_sep<T, kRSep>(MK_PASS); else mk512_sep<T, 1>(MK_PASS);
  }
  // ng quad groups (1 or 2) against r weight rows; see mk512_quad.
  template <bool PF>
  static void quad_pf(int ng, int r, const E* x, int rows, int64_t gstride, const E* const* wr, int k0, int k1,
                      float* y, size_t ldy, const int* nc, float* vacc, bool first, bool last) {
    if (ng == 2) {
      if (r == kRQuad) mk512_quad<T, kRQuad, 2, PF>(x, rows, gstride, wr, k0, k1, y, ldy, nc, vacc, first, last);
      else mk512_quad<T, 1, 2, PF>(x, rows, gstride, wr, k0, k1, y, ldy, nc, vacc, first, last);
    } else {
      if (r == kRQuad) mk512_quad<T, kRQuad, 1, PF>(x, rows, gstride, wr, k0, k1, y, ldy, nc, vacc, first, last);
      else mk512_quad<T, 1, 1, PF>(x, rows, gstride, wr, k0, k1, y, ldy, nc, vacc, first, last);
    }
  }
  static void quad(bool pf, int ng, int r, const E* x, int rows, int64_t gstride, const E* const* wr, int k0, int k1,
                   float* y, size_t ldy, const int* nc, float* vacc, bool first, bool last) {
    if (pf) quad_pf<true>(ng, r, x, rows, gstride, wr, k0, k1, y, ldy, nc, vacc, first, last);
    else quad_pf<false>(ng, r, x, rows, gstride, wr, k0, k1, y, ldy, nc, vacc, first, last);
  }
};

// Streaming read (bandwidth reference): sums 64-bit words with four independent accumulators.
uint64_t read_avx512(const uint8_t* p, size_t n) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  size_t i = 0;
  for (; i + 256 <= n; i += 256) {
    a0 = _mm512_add_epi64(a0, _mm512_loadu_si512(p + i));
    a1 = _mm512_add_epi64(a1, _mm512_loadu_si512(p + i + 64));
    a2 = _mm512_add_epi64(a2, _mm512_loadu_si512(p + i + 128));
    a3 = _mm512_add_epi64(a3, _mm512_loadu_si512(p + i + 192));
  }
  alignas(64) uint64_t t[8];
  _mm512_store_si512(t, _mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3)));
  uint64_t s = 0;
  for (int j = 0; j < 8; ++j) s += t[j];
  for (; i < n; ++i) s += p[i];
  return s;
}

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2")
uint64_t read_avx2(const uint8_t* p, size_t n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  size_t i = 0;
  for (; i + 128 <= n; i += 128) {
    a0 = _mm256_add_epi64(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
    a1 = _mm256_add_epi64(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    a2 = _mm256_add_epi64(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
    a3 = _mm256_add_epi64(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
  }
  alignas(32) uint64_t t[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(t),
                     _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3)));
  uint64_t s = t[0] + t[1] + t[2] + t[3];
  for (; i < n; ++i) s += p[i];
  return s;
}
#pragma GCC pop_options

#endif  // MS_X86

uint64_t read_scalar(const uint8_t* p, size_t n) {
  uint64_t s[4] = {0, 0, 0, 0};
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    uint64_t v[4];
    std::memcpy(v, p + i, 32);
    for (int j = 0; j < 4; ++j) s[j] += v[j];
  }
  uint64_t t = s[0] + s[1] + s[2] + s[3];
  for (; i < n; ++i) t += p[i];
  return t;
}

// ------------------------------------------------------------------------------------------------
// Drivers: y[m, n] for n in [n0, n1) and every activation row m, from weight rows [n0, n1).
// The rows are cut into R equal runs and a micro-kernel takes one row from each run: R long
// sequential streams.
// ------------------------------------------------------------------------------------------------

// Calls block(r, nc) for the blocks of [n0, n1): R rows from R runs, then the remainder one by one.
template <int R, class Block>
void for_blocks(int64_t n0, int64_t n1, Block&& block) {
  const int64_t L = (n1 - n0) / R;
  for (int64_t i = 0; i < L; ++i) {
    int nc[R];
    for (int j = 0; j < R; ++j) nc[j] = int(n0 + j * L + i);
    block(R, nc);
  }
  for (int64_t n = n0 + R * L; n < n1; ++n) {
    int nc[1] = {int(n)};
    block(1, nc);
  }
}

inline void zero_cols(int64_t M, int64_t n0, int64_t n1, float* y, size_t ldy) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = n0; n < n1; ++n) y[m * ldy + n] = 0.0f;
}

// Plain f32 activations (AVX2 and scalar paths). For more rows than one micro-kernel call takes, K is
// walked in chunks (each chunk's sums added to y) and every row group reuses the chunk from cache.
template <class KT>
void drive_plain(const float* x, size_t ldx, int64_t M, int64_t K, const typename KT::W* w, size_t ldw,
                 int64_t n0, int64_t n1, float* y, size_t ldy) {
  constexpr int R = KT::R, MRMAX = KT::MRMAX;
  const int64_t kc = M > MRMAX ? kKC : K;  // K in chunks only when several calls share a weight block
  for (int64_t mb = 0; mb < M; mb += kMB) {
    const int64_t me = std::min(M, mb + kMB);
    for_blocks<R>(n0, n1, [&](int r, const int* nc) {
      const typename KT::W* wr[R];
      for (int j = 0; j < r; ++j) wr[j] = w + size_t(nc[j]) * ldw;
      for (int64_t k0 = 0; k0 < K; k0 += kc) {
        const int k1 = int(std::min<int64_t>(K, k0 + kc));
        for (int64_t m = mb; m < me; m += MRMAX) {
          const int mr = int(std::min<int64_t>(MRMAX, me - m));
          KT::run(r, mr, x + m * ldx, ldx, wr, int(k0), k1, y + m * ldy, ldy, nc, k0 > 0);
        }
      }
    });
  }
}

#if MS_X86
// AVX-512: the activation is kPlain (M == 1) or kQuad (M >= 2).
template <class T>
void drive512(const Act& a, int64_t M, int64_t K, const typename T::E* w, size_t ldw, int64_t n0, int64_t n1,
              float* y, size_t ldy) {
  using E = typename T::E;
  const E* x = static_cast<const E*>(a.x);
  auto rows_of = [&](int r, const int* nc, const E** wr) {
    for (int j = 0; j < r; ++j) wr[j] = w + size_t(nc[j]) * ldw;
  };
  if (a.layout == kPlain) {  // one activation row: one pass over K
    for_blocks<kRSep>(n0, n1, [&](int r, const int* nc) {
      const E* wr[kRSep];
      rows_of(r, nc, wr);
      K512<T>::sep(r, x, a.ld, wr, 0, int(K), y, ldy, nc, false);
    });
  } else {
    // groups of 4 rows, two per call; over 2 groups, K in chunks so the block of weight rows and the
    // activation chunk stay in cache while every group pair uses them (accumulators kept in vacc)
    const int64_t groups = (M + 3) / 4;
    const int64_t kc = groups > 2 ? kKC : K;
    alignas(64) float vacc[(kMB / 8) * 2 * kRQuad * 16];
    for (int64_t gb = 0; gb < groups; gb += kMB / 4) {
      const int64_t ge = std::min(groups, gb + kMB / 4);
      for_blocks<kRQuad>(n0, n1, [&](int r, const int* nc) {
        const E* wr[kRQuad];
        rows_of(r, nc, wr);
        for (int64_t k0 = 0; k0 < K; k0 += kc) {
          const int64_t k1 = std::min(K, k0 + kc);
          for (int64_t g = gb; g < ge; g += 2) {
            const int ng = int(std::min<int64_t>(2, ge - g));
            const int rows = int(std::min<int64_t>(4 * ng, M - 4 * g));
            K512<T>::quad(g == gb, ng, r, x + g * a.gstride, rows, a.gstride, wr, int(k0), int(k1),
                          y + 4 * g * ldy, ldy, nc, vacc + (g - gb) / 2 * (2 * kRQuad * 16), k0 == 0, k1 == K);
          }
        }
      });
    }
  }
}
#endif

// AMX paths (defined below) take calls of at least this many activation rows.
constexpr int64_t kAmxMinRows = 16;
inline bool amx_bf16_rows(int isa, int wt, int64_t M) { return isa == kAmx && wt == kWBf16 && M >= kAmxMinRows; }
#if MS_X86
void gemm_range_amx_bf16(const Act& a, int64_t M, int64_t K, const uint16_t* w, size_t ldw, int64_t n0, int64_t n1,
                         float* y, size_t ldy);
#endif

void gemm_range(int isa, int wt, const Act& a, int64_t M, int64_t K, const void* w, size_t ldw, int64_t n0,
                int64_t n1, float* y, size_t ldy) {
  if (n1 <= n0 || M <= 0) return;
  if (K == 0) return zero_cols(M, n0, n1, y, ldy);
#if MS_X86
  if (amx_bf16_rows(isa, wt, M))
    return gemm_range_amx_bf16(a, M, K, static_cast<const uint16_t*>(w), ldw, n0, n1, y, ldy);
  if (isa >= kAvx512Bf16) {
    if (wt == kWBf16)
      drive512<E512Bf16>(a, M, K, static_cast<const uint16_t*>(w), ldw, n0, n1, y, ldy);
    else
      drive512<E512F32>(a, M, K, static_cast<const float*>(w), ldw, n0, n1, y, ldy);
    return;
  }
  if (isa == kAvx2) {
    const float* x = static_cast<const float*>(a.x);
    if (wt == kWBf16)
      drive_plain<KAvx2<uint16_t>>(x, a.ld, M, K, static_cast<const uint16_t*>(w), ldw, n0, n1, y, ldy);
    else
      drive_plain<KAvx2<float>>(x, a.ld, M, K, static_cast<const float*>(w), ldw, n0, n1, y, ldy);
    return;
  }
#endif
  (void)isa;
  const float* x = static_cast<const float*>(a.x);
  if (wt == kWBf16)
    drive_plain<KScalar<uint16_t>>(x, a.ld, M, K, static_cast<const uint16_t*>(w), ldw, n0, n1, y, ldy);
  else
    drive_plain<KScalar<float>>(x, a.ld, M, K, static_cast<const float*>(w), ldw, n0, n1, y, ldy);
}

// ------------------------------------------------------------------------------------------------
// Scratch of the calling thread (workers write into the caller's buffers).
// ------------------------------------------------------------------------------------------------

struct Scratch {
  std::vector<float> xa, xb, ha;  // prepared activations (x, x for a second block type; h of an expert), raw storage
  std::vector<float> g, u, h, y;
  std::vector<float> ep;       // a layer call's weighted expert outputs (expert-parallel plan)
  std::vector<int64_t> offs;   // FFI: offsets widened to int64
};
thread_local Scratch t_scratch;

template <class T>
T* grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

void* grow_bytes(std::vector<float>& v, size_t bytes) { return grow(v, (bytes + 3) / 4 + 16); }

inline float to_f32(uint16_t v) { return bf16_to_f32(v); }
inline float to_f32(float v) { return v; }

#if MS_X86
// The activations of an AMX-BF16 call as its B tiles (defined with the AMX kernels).
Act amx_bf16_panel(const uint16_t* src, size_t ld, const int32_t* rows, int64_t M, int64_t K, std::vector<float>& buf);
Act amx_bf16_panel(const float* src, size_t ld, const int32_t* rows, int64_t M, int64_t K, std::vector<float>& buf);
#endif

// Prepares M rows of K elements for the ISA path: row m is src + row(m) * ld, row(m) = rows ? rows[m] : m;
// SRC is uint16_t (bf16 bits) or float, the weights' type.
template <class SRC>
Act prepare(int isa, int wt, const SRC* src, size_t ld, const int32_t* rows, int64_t M, int64_t K,
            std::vector<float>& buf) {
  Act a;
  auto row = [&](int64_t m) { return src + (rows ? int64_t(rows[m]) : m) * int64_t(ld); };
  if (isa < kAvx512Bf16) {  // f32 rows
    if (std::is_same<SRC, float>::value && !rows) {
      a.x = src;
      a.ld = ld;
      return a;
    }
    float* d = static_cast<float*>(grow_bytes(buf, size_t(M * K) * 4));
    for (int64_t m = 0; m < M; ++m) {
      const SRC* s = row(m);
      for (int64_t k = 0; k < K; ++k) d[m * K + k] = to_f32(s[k]);
    }
    a.x = d;
    a.ld = size_t(K);
    return a;
  }
  constexpr int64_t kE = 64 / int64_t(sizeof(SRC));
  const int64_t Kp = (K + kE - 1) / kE * kE;
#if MS_X86
  if (std::is_same<SRC, uint16_t>::value && amx_bf16_rows(isa, wt, M)) return amx_bf16_panel(src, ld, rows, M, K, buf);
#endif
  if (M == 1) {
    if (!rows) {
      a.x = src;
      a.ld = ld;
      return a;
    }
    SRC* d = static_cast<SRC*>(grow_bytes(buf, size_t(K) * sizeof(SRC)));
    std::memcpy(d, row(0), size_t(K) * sizeof(SRC));
    a.x = d;
    a.ld = size_t(K);
    return a;
  }
  constexpr int64_t g = kE / 4;
  const int64_t groups = (M + 3) / 4;
  SRC* d = static_cast<SRC*>(grow_bytes(buf, size_t(groups * 4 * Kp) * sizeof(SRC)));
  std::memset(d, 0, size_t(groups * 4 * Kp) * sizeof(SRC));
  for (int64_t m = 0; m < M; ++m) {
    const SRC* s = row(m);
    SRC* q = d + (m / 4) * 4 * Kp + (m % 4) * g;
    for (int64_t k0 = 0; k0 < K; k0 += g) std::memcpy(q + k0 * 4, s + k0, size_t(std::min(g, K - k0)) * sizeof(SRC));
  }
  a.x = d;
  a.layout = kQuad;
  a.gstride = 4 * Kp;
  return a;
}

// Prepares x (bf16 bits for bf16 weights, f32 for f32 weights; rows of `ld` elements).
Act prepare_x(int isa, int wt, const void* x, size_t ld, const int32_t* rows, int64_t M, int64_t K,
              std::vector<float>& buf) {
  if (wt == kWBf16) return prepare(isa, wt, static_cast<const uint16_t*>(x), ld, rows, M, K, buf);
  return prepare(isa, wt, static_cast<const float*>(x), ld, rows, M, K, buf);
}

// y f32 [M, N] (row stride ldy) = x W^T over `threads` threads; then epi(n0, n1) on each part's columns.
template <class Epi>
void gemm(int isa, int wt, const Act& a, int64_t M, int64_t K, const void* w, int64_t N, float* y, size_t ldy,
          int threads, Epi&& epi) {
  const double wbytes = double(N) * double(K) * (wt == kWBf16 ? 2 : 4);
  const int th = threads_for(threads, wbytes, double(M) * double(N) * double(K));
  const int nparts = parts_for(N, th);
  auto part = [&](int i) {
    const int64_t n0 = part_begin(N, nparts, i), n1 = part_begin(N, nparts, i + 1);
    gemm_range(isa, wt, a, M, K, w, size_t(K), n0, n1, y, ldy);
    epi(n0, n1);
  };
  parallel(nparts, th, part);
}

// One SwiGLU expert on M prepared rows `a` of H elements: y f32 [M, H] (row stride H) =
// (silu(x gate^T) * (x up^T)) down^T, with the bf16 roundings described at the top for bf16
// weights. Phase 2 calls sink(n0, n1) per part after writing y[:, n0:n1].
template <class Sink>
void swiglu_expert(int isa, int wt, const Act& a, int64_t M, int64_t H, int64_t F, const void* gate, const void* up,
                   const void* down, float* y, int threads, Sink&& sink) {
  if (M <= 0 || H <= 0) return;
  Scratch& s = t_scratch;
  const bool bf = wt == kWBf16;
  const bool hbits = act_is_bf16(isa, wt);  // h kept as bf16 bits (else f32)
  const double ws = bf ? 2 : 4;
  float* G = grow(s.g, size_t(M * F));
  float* U = grow(s.u, size_t(M * F));
  void* Hraw = grow(s.h, size_t(M * F));
  uint16_t* Hb = static_cast<uint16_t*>(Hraw);
  float* Hf = static_cast<float*>(Hraw);
  {  // phase 1: gate and up rows [f0, f1), then h for those columns
    const int th = threads_for(threads, 2 * double(F) * double(H) * ws, 2 * double(M) * double(F) * double(H));
    const int nparts = parts_for(F, th);
    auto part = [&](int i) {
      const int64_t f0 = part_begin(F, nparts, i), f1 = part_begin(F, nparts, i + 1);
      gemm_range(isa, wt, a, M, H, gate, size_t(H), f0, f1, G, size_t(F));
      gemm_range(isa, wt, a, M, H, up, size_t(H), f0, f1, U, size_t(F));
      for (int64_t m = 0; m < M; ++m) {
        const float* g = G + m * F;
        const float* u = U + m * F;
        if (bf) {
          for (int64_t f = f0; f < f1; ++f) {
            const uint16_t h = f32_to_bf16(silu(round_bf16(g[f])) * round_bf16(u[f]));
            if (hbits) Hb[m * F + f] = h; else Hf[m * F + f] = bf16_to_f32(h);
          }
        } else {
          for (int64_t f = f0; f < f1; ++f) Hf[m * F + f] = silu(g[f]) * u[f];
        }
      }
    };
    parallel(nparts, th, part);
  }
  // phase 2: down rows [n0, n1)
  const Act ha = hbits ? prepare(isa, wt, Hb, size_t(F), nullptr, M, F, s.ha)
                       : prepare(isa, wt, static_cast<const float*>(Hf), size_t(F), nullptr, M, F, s.ha);
  gemm(isa, wt, ha, M, F, down, H, y, size_t(H), threads, [&](int64_t n0, int64_t n1) { sink(n0, n1); });
}

// ------------------------------------------------------------------------------------------------
// A layer's experts in one call (ms_experts and the moescope_experts FFI handler).
//
// Two plans, the same numbers. Every expert's output rows are computed the same way whatever the
// plan or the thread count (the split of rows over threads never changes a sum), and every pair's
// weighted output w * y (one f32 product) is added into its token's row of `out` expert after expert,
// pair after pair -- so the result is bit for bit the same under either plan and any thread count.
//   * Row split: experts one after another, each expert's output rows (gate/up, then down) split
//     over the threads; pairs added into `out` as each part finishes. Right for large experts
//     (Mixtral's 336 MiB: each thread streams a long run of rows) and for large M (compute bound).
//   * Expert parallel: threads take whole experts (largest cost first, from a shared counter), each
//     running its expert on one thread into a scratch block [M_e, H] of weighted outputs; a last
//     pass adds the blocks into `out` in expert order. For several small experts at decode sizes
//     (Qwen3's 9 MiB, DeepSeek-V2-Lite's 16.5 MiB): no barrier between an expert's two phases and
//     no short row runs per thread. An expert whose cost exceeds a thread's fair share, and the
//     experts left over when the rest do not divide evenly among the threads, run row split (into
//     their scratch blocks) after the parallel ones (3, 5 or 7 small experts on 2 threads: 5-15%
//     faster than either plan alone).
// Experts without pairs are never read.
// ------------------------------------------------------------------------------------------------

enum Strategy { kStrategyAuto = 0, kStrategyRows = 1, kStrategyExperts = 2 };

// Auto plan: expert parallel when an expert's weights are at most this many bytes (MOESCOPE_NATIVE_EP_MAX_MB
// overrides). Measured on 2 Zen 4 cores, a layer of k experts x m = 1 / 4 rows, GB/s expert parallel over
// row split: 9 MiB +11% / +25%, 16.5 MiB +5% / +14%, 33 MiB +4% / +10%, 48 MiB +1% / +5%, 64 MiB +5% / +9%,
// 96 MiB +5% / -1%, 192 MiB +3% / -4%, 336 MiB +2% / +6% (noise ~5%): a clear gain up to 64 MiB, none
// beyond; the row split also lets a caller take over the parts of a late helper, which whole large
// experts would not ...
constexpr double kEpMaxBytesDefault = 64.0 * 1024 * 1024;
// ... and the scratch of weighted outputs (live pairs x H x 4 bytes) stays under this much.
constexpr double kEpScratchBytes = 32.0 * 1024 * 1024;
// Cost of an expert in weight-read units: kEpRowCost per row on top of 1 for reading the weights
// (about where an expert turns compute bound on one core).
constexpr double kEpRowCost = 1.0 / 16;

const double g_ep_max_bytes = [] {
  const char* v = std::getenv("MOESCOPE_NATIVE_EP_MAX_MB");
  if (v && *v) {
    char* end = nullptr;
    const double mb = std::strtod(v, &end);
    if (end != v && mb >= 0) return mb * 1024 * 1024;
  }
  return kEpMaxBytesDefault;
}();

struct ExpertW {
  const void* gate;
  const void* up;
  const void* down;
};

// Runs expert e on the M rows tokens[0..M) of x into Y [M, H] on `threads` threads, calling sink(n0, n1)
// after each part of Y's columns is written (bf16 / f32 weights: swiglu_expert; block weights: qswiglu_expert).
using Sink = std::function<void(int64_t, int64_t)>;
using ExpertRun = std::function<void(int64_t e, const int32_t* tokens, int64_t M, float* Y, int threads, const Sink&)>;

// Validated arguments (see ms_experts). run(e, ...) is called for experts with pairs only; wbytes: the
// bytes of one expert's weights (the plan's size rule). Adds into out (the caller zeroes it first when it
// wants a fresh result).
void experts_core(int64_t H, double wbytes, int64_t n_experts, const ExpertRun& run_expert,
                  const int64_t* offsets, const int32_t* tokens, const float* pair_weight, float* out, int threads,
                  int strategy, double* seconds) {
  using clock = std::chrono::steady_clock;
  std::vector<int64_t> used;
  int64_t live = 0;
  for (int64_t e = 0; e < n_experts; ++e) {
    const int64_t M = offsets[e + 1] - offsets[e];
    if (M > 0 && H > 0) {
      used.push_back(e);
      live += M;
    } else if (seconds) {
      seconds[e] = 0.0;
    }
  }
  if (used.empty()) return;
  const int th = resolve_threads(threads);
  auto rows_of = [&](int64_t e) { return offsets[e + 1] - offsets[e]; };
  auto cost = [&](int64_t e) { return 1.0 + kEpRowCost * double(rows_of(e)); };

  // the plan: experts run in parallel (ep) and experts run row split into scratch (rs)
  std::vector<int64_t> ep, rs;
  if (strategy == kStrategyExperts) {
    ep = used;
  } else if (strategy == kStrategyAuto && th > 1 && used.size() >= 2 && wbytes <= g_ep_max_bytes &&
             double(live) * double(H) * 4 <= kEpScratchBytes) {
    ep = used;
    std::stable_sort(ep.begin(), ep.end(), [&](int64_t a, int64_t b) { return cost(a) > cost(b); });
    double total = 0;
    for (int64_t e : ep) total += cost(e);
    // an expert worth more than a thread's share of the rest runs row split
    size_t first = 0;
    while (ep.size() - first >= 2 && cost(ep[first]) * th > total) total -= cost(ep[first++]);
    rs.assign(ep.begin(), ep.begin() + first);
    ep.erase(ep.begin(), ep.begin() + first);
    // the experts past the last whole round of `th` run row split (the cheapest ones)
    const size_t whole = ep.size() / size_t(th) * size_t(th);
    rs.insert(rs.end(), ep.begin() + whole, ep.end());
    ep.resize(whole);
    if (ep.size() < 2) {  // nothing left to run in parallel: plain row split
      ep.clear();
      rs.clear();
    }
    std::sort(rs.begin(), rs.end());
  }

  if (ep.empty() && rs.empty()) {  // row split, pairs added into out as each part finishes
    for (int64_t e : used) {
      const auto start = clock::now();
      const int64_t lo = offsets[e], M = rows_of(e);
      const int32_t* tok = tokens + lo;
      const float* pw = pair_weight + lo;
      float* Y = grow(t_scratch.y, size_t(M * H));
      run_expert(e, tok, M, Y, threads, [&](int64_t n0, int64_t n1) {
        for (int64_t i = 0; i < M; ++i) {
          float* o = out + int64_t(tok[i]) * H;
          const float* r = Y + i * H;
          const float wgt = pw[i];
          for (int64_t n = n0; n < n1; ++n) o[n] += wgt * r[n];
        }
      });
      if (seconds) seconds[e] = std::chrono::duration<double>(clock::now() - start).count();
    }
    return;
  }

  // scratch block of each used expert (in expert order)
  std::vector<int64_t> slot(size_t(n_experts), 0);
  {
    int64_t at = 0;
    for (int64_t e : used) {
      slot[size_t(e)] = at;
      at += rows_of(e) * H;
    }
  }
  float* S = grow(t_scratch.ep, size_t(live * H));
  // expert e on `nthreads` threads into its block: y, then y *= pair weight (one rounding, as w * y)
  auto run = [&](int64_t e, int nthreads) {
    const auto start = clock::now();
    const int64_t lo = offsets[e], M = rows_of(e);
    const float* pw = pair_weight + lo;
    float* Y = S + slot[size_t(e)];
    run_expert(e, tokens + lo, M, Y, nthreads, [&](int64_t n0, int64_t n1) {
      for (int64_t i = 0; i < M; ++i) {
        float* r = Y + i * H;
        const float wgt = pw[i];
        for (int64_t n = n0; n < n1; ++n) r[n] = wgt * r[n];
      }
    });
    if (seconds) seconds[e] = std::chrono::duration<double>(clock::now() - start).count();
  };
  auto ep_part = [&](int i) { run(ep[size_t(i)], 1); };
  parallel(int(ep.size()), th, ep_part);
  for (int64_t e : rs) run(e, threads);
  // out[token] += block rows, expert after expert; columns split over threads when large
  const int fth = threads_for(threads, double(live) * double(H) * 4, 0.0);
  const int nparts = parts_for(H, fth);
  auto add = [&](int i) {
    const int64_t n0 = part_begin(H, nparts, i), n1 = part_begin(H, nparts, i + 1);
    for (int64_t e : used) {
      const int64_t lo = offsets[e], M = rows_of(e);
      const float* Y = S + slot[size_t(e)];
      for (int64_t j = 0; j < M; ++j) {
        float* o = out + int64_t(tokens[lo + j]) * H;
        const float* r = Y + j * H;
        for (int64_t n = n0; n < n1; ++n) o[n] += r[n];
      }
    }
  };
  parallel(nparts, fth, add);
}

// experts_core over bf16 / f32 SwiGLU experts; weights(e) -> ExpertW.
template <class Weights>
void dense_experts(int isa, int wt, const void* x, int64_t H, int64_t F, int64_t n_experts, Weights&& weights,
                   const int64_t* offsets, const int32_t* tokens, const float* pair_weight, float* out, int threads,
                   int strategy, double* seconds) {
  const double wbytes = 3.0 * double(F) * double(H) * (wt == kWBf16 ? 2 : 4);
  const ExpertRun run = [&](int64_t e, const int32_t* tok, int64_t M, float* Y, int th, const Sink& sink) {
    const ExpertW w = weights(e);
    const Act a = prepare_x(isa, wt, x, size_t(H), tok, M, H, t_scratch.xa);  // this thread's scratch
    swiglu_expert(isa, wt, a, M, H, F, w.gate, w.up, w.down, Y, th, sink);
  };
  experts_core(H, wbytes, n_experts, run, offsets, tokens, pair_weight, out, threads, strategy, seconds);
}

// ------------------------------------------------------------------------------------------------
// Block-quantized weights (ggml's layouts, byte for byte: ggml-common.h).
//
// A weight [N, K] is N rows of K / blk blocks. Supported types (ggml ids):
//   Q4_0 (2)  32 weights, 18 bytes: f16 d, 16 bytes of nibbles (weight j: low nibble of byte j, j+16: high);
//             w = d * (q - 8).
//   Q8_0 (8)  32 weights, 34 bytes: f16 d, 32 int8;                        w = d * q.
//   Q4_K (12) 256 weights, 144 bytes: f16 d, f16 dmin, 12 bytes of 6-bit scales / mins of 8 sub-blocks of 32,
//             128 bytes of nibbles (32 bytes per 64 weights: low nibbles the first sub-block, high the second);
//             w = d * sc_j * q - dmin * m_j.
//   Q6_K (14) 256 weights, 210 bytes: 128 bytes low nibbles, 64 bytes high 2 bits, 16 int8 scales (one per 16
//             weights), f16 d;                                             w = d * sc_j * (q - 32).
//
// Activations are quantized as llama.cpp does before its integer dot products: per 32 to Q8_0 (scale
// d = amax / 127 stored as f16, q = roundf(x / d), the quotient taken with the unrounded d) for Q8_0 / Q4_0
// weights; per 256 to Q8_K (f32 scale d = max / -127 of the element of largest magnitude, q = nearest-even
// of x * (-127 / max), at most 127) for Q4_K / Q6_K. Each product is then exact in integers: per 4 weights
// (one 32-bit lane) sum_k u_k * q_k - o * sum_k q_k (u: the weight's unsigned code, o its offset: Q8_0 128,
// Q4_0 8, Q4_K 0, Q6_K 32), converted to f32, times (weight scale * activation scale), plus Q4_K's
// -dmin * m_j * d_x * sum_k q_k; those f32 terms are summed per lane, then the lanes in a fixed order.
// So each output equals "dequantize the blocks, dequantize the quantized activation, f32 matmul" up to f32
// summation error. On the AVX-512 path an output does not depend on the other rows of the call: row m of an M-row
// call is the 1-row call on that row, bit for bit (qgemm_range_512), up to kKTileMin rows (Q8_0 kKTileMin8); calls of
// more rows of Q4_K / Q6_K / Q8_0 take kgemm's tiles, whose rows are the same bits in every call on that path (a
// different f32 summation order from the 1-row call's).
// Paths: AVX512-VNNI (VPDPBUSD; from kKTileMin rows (Q8_0 kKTileMin8) tiles of 16 activation rows against broadcast
// weight codes, kgemm_range; below, the K-quants with integer sub-block scales, two outputs per vector; Q4_0 with exact
// per-block sums, four outputs per vector, qmk512_u; Q8_0 in the same 4-block units, qmk512_u8), AVX2 (16-bit madd;
// the K-quants likewise, qmk_avx2_k; Q4_0 in 2-block units, four outputs per vector, qmk_avx2_q4_0_u; Q8_0 per block,
// four outputs per vector, qmk_avx2_q8_0_b), portable scalar -- all with the Q8 activations above (vector code on the
// AVX-512 and AVX2 paths, the scalar loop's bytes) -- and, on the amx ISA path
// for calls of at least amx_rows_default(type) rows (12), AMX-BF16 tiles over the
// weights dequantized to bf16 (qgemm_amx_bf16_t). That path rounds differently, stated here:
//   * weights: ggml's f32 dequantized value (d * q; Q4_K (d * sc) * q - dmin * m; Q6_K (d * sc) * (q - 32)), rounded
//     to bf16, nearest even (a relative error of at most 2^-9 per weight; the other paths use the weights exactly);
//   * activations: x rounded to bf16, nearest even (bf16 input unchanged) instead of Q8_0 / Q8_K (relative 2^-9
//     per element against Q8's absolute step of amax / 127 per block: smaller for all but the block's largest
//     values);
//   * products of bf16 exact in f32, summed in f32 in tile order.
// So each output of that path equals "dequantize the blocks, round weights and activations to bf16, f32 matmul" up
// to f32 summation error (numpy: qlinear_reference(x, w, rounding="bf16")). Against the exact product of the f32
// activations and the dequantized weights its error is smaller than the Q8 activations' (measured on random
// shapes, tests/test_native_quant.py::test_bf16_tiles_error_below_q8_activations; README "AMX, block types").
// A block-quantized expert's h = silu(g) * u takes exp(-g) as the correctly rounded f32 (an f64 exp rounded once,
// silu_mul; glibc's expf before 2026-12-06, 1 ulp apart on ~0.03 % of values), on every path.
// ------------------------------------------------------------------------------------------------

#define MS_INLINE inline __attribute__((always_inline))
#define MS_INLINE_LAMBDA __attribute__((always_inline))
#ifndef MS_QPREFETCH
#define MS_QPREFETCH 2048  // bytes ahead each weight stream is prefetched (AVX-512 block kernels)
#endif
#ifndef MS_QR_SMALL_M
#define MS_QR_SMALL_M 4  // weight streams at 1-2 activation rows (AVX-512 block kernels)
#endif

enum QType { kQ4_0 = 2, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14 };
#ifndef MS_KTILE_MIN
#define MS_KTILE_MIN 8  // 1-thread A/B vs the pair kernels (Zen 5; Q4_K / Q6_K): 8 rows (2 lanes a row, kseg) 1.39-1.46x /
                        // 1.14-1.24x, 9 rows 1.19x / 1.10x (kgemm_range)
#endif
constexpr int kKTileMin = MS_KTILE_MIN;  // rows from which Q4_K / Q6_K calls take kgemm (AVX-512 path; kgemm_range)
#ifndef MS_KTILE_MIN8
#define MS_KTILE_MIN8 12  // A/B: 9 rows 0.96x, 10 1.00x, 11 0.94x, 12 1.05-1.10x, 16 1.25x
#endif
constexpr int kKTileMin8 = MS_KTILE_MIN8;  // the same for Q8_0 (kgemm8_tiles)

struct QSpec {
  int blk = 0;    // weights per block
  int bytes = 0;  // bytes per block
  int xblk = 0;   // activation block (32: Q8_0, 256: Q8_K)
  int offset = 0; // o: w = s * (u - o) (+ Q4_K's min term)
  int group = 0;  // weights per weight scale (32, Q6_K 16)
};

bool qspec(int qt, QSpec& s) {
  switch (qt) {
    case kQ4_0: s = {32, 18, 32, 8, 32}; return true;
    case kQ8_0: s = {32, 34, 32, 128, 32}; return true;
    case kQ4_K: s = {256, 144, 256, 0, 32}; return true;
    case kQ6_K: s = {256, 210, 256, 32, 16}; return true;
    default: return false;
  }
}

const float* f16_table() {
  static const std::vector<float> t = [] {
    std::vector<float> v(65536);
    for (uint32_t h = 0; h < 65536; ++h) {
      const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
      uint32_t u;
      if (exp == 0) {
        float f = std::ldexp(float(man), -24);
        std::memcpy(&u, &f, 4);
        u |= sign;
      } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
      } else {
        u = sign | ((exp + 112) << 23) | (man << 13);
      }
      float f;
      std::memcpy(&f, &u, 4);
      v[h] = f;
    }
    return v;
  }();
  return t.data();
}
const float* const g_f16 = f16_table();

MS_INLINE float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return g_f16[h];
}

// f32 -> f16 bits, round to nearest even (as F16C's VCVTPS2PH, which ggml uses to store the scale).
// Inlined (as kq_side): called out of line from the vector roundings, this SSE-encoded code paid an SSE/AVX transition.
MS_INLINE uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return uint16_t(sign | 0x7e00u);
  if (x >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (x < 0x38800000u) {                                  // f16 subnormal (or zero)
    const float a = std::fabs(f) * 16777216.0f;           // exact: in units of 2^-24
    return uint16_t(sign | uint32_t(std::nearbyint(a)));
  }
  const uint32_t mant_odd = (x >> 13) & 1u;
  x += 0xfffu + mant_odd;
  return uint16_t(sign | ((x - 0x38000000u) >> 13));
}

// ---- activations ---------------------------------------------------------------------------------
// One row quantized for a weight type, padded to Kp = K rounded up to 64 (zeros), as 5 arrays:
//   q int8 [Kp], nxo int32 [Kp/4] (-o * the sum of each lane's 4 q), dl f32 [Kp/4] (each lane's d),
//   xs f32 [Kp/4] (d * the lane's sum of q; Q4_K's min term), bs int16 [Kp/16] (the sum of each 16 q: the
//   K-quant kernels' min / offset terms, as llama.cpp's q8_K bsums), and for the K-quants kx [64 bytes per 256]:
//   the activation side of the AVX-512 kernels' min / offset term, laid out for their lanes (kq_side).
//   4 * Kp + bs_bytes(Kp) + kx_bytes(Kp) bytes per row; the 32-weight types (Q8_0, Q4_0) add ux [ux_bytes(Kp)]: the
//   same row in the AVX-512 block-unit layout (q32_units).
struct QRow {
  const int8_t* q;
  const int32_t* nxo;
  const float* dl;
  const float* xs;
  const int16_t* bs;
  const uint8_t* kx;
  const uint8_t* ux;
};

inline int64_t pad64(int64_t k) { return (k + 63) / 64 * 64; }
inline int64_t bs_bytes(int64_t kp) { return pad64(kp / 8); }
inline int64_t kx_bytes(int64_t kp) { return pad64(kp / 4); }
inline int64_t ux_bytes(int64_t kp) { return (kp + 127) / 128 * 256; }  // 256 bytes per 128 weights

struct QAct {
  const uint8_t* base = nullptr;
  int64_t Kp = 0;
  int64_t stride = 0;  // bytes from row to row: 4 Kp + bs_bytes + kx_bytes (+ ux_bytes) + 64 (rows 4 KiB-multiples apart share L1 sets)
  QRow row(int64_t m) const {
    const uint8_t* r = base + size_t(m) * size_t(stride);
    const uint8_t* kx = r + 4 * Kp + bs_bytes(Kp);
    return {reinterpret_cast<const int8_t*>(r), reinterpret_cast<const int32_t*>(r + Kp),
            reinterpret_cast<const float*>(r + 2 * Kp), reinterpret_cast<const float*>(r + 3 * Kp),
            reinterpret_cast<const int16_t*>(r + 4 * Kp), kx, kx + kx_bytes(Kp)};
  }
};

// The block-unit layout of a row for 32-weight blocks (the AVX-512 Q4_0 kernel, qmk512_u), 256 bytes per unit of 4
// blocks (128 weights), zero past K: qa [64] (128-bit lane b: q of weights 0..15 of block b), qb [64] (weights 16..31),
// off int32 [16] (Q4_0, per_block: the 4 dwords of lane b: -o * the sum of block b's 32 q, its offset term; Q8_0:
// dword 4b + l: -o * the sum of the 8 q at weights 4l .. 4l+3 and 16+4l .. 16+4l+3 of block b, the offset of the 8
// products that dword gathers), dx f32 [16] (lane b: block b's d). Built from the row's q / nxo / dl arrays.
void q32_units(const int8_t* q, const int32_t* nxo, const float* dl, int64_t K, bool per_block, uint8_t* ux) {
  for (int64_t blk = 0; blk < K / 32; ++blk) {
    uint8_t* u = ux + 256 * (blk / 4);
    const int b = int(blk % 4);
    std::memcpy(u + 16 * b, q + 32 * blk, 16);
    std::memcpy(u + 64 + 16 * b, q + 32 * blk + 16, 16);
    int32_t all = 0;
    for (int l = 0; l < 8; ++l) all += nxo[8 * blk + l];
    for (int l = 0; l < 4; ++l) {
      const int32_t off = per_block ? all : nxo[8 * blk + l] + nxo[8 * blk + 4 + l];
      std::memcpy(u + 128 + 4 * (4 * b + l), &off, 4);
      std::memcpy(u + 192 + 4 * (4 * b + l), dl + 8 * blk, 4);
    }
  }
}

// The activation side of the AVX-512 K-quant kernels' second term, per 256-weight super-block (64 bytes), for
// lanes where an output owns dwords p = 4k + e (k: 128-bit lane, e: 0..3) with e in {0, 1} or in {2, 3}, the
// same values in both halves. Q4_K (f32): dword p holds -(d * the sum of the 32 q of sub-block 2k + p % 2),
// which meets dmin * m of that sub-block. Q6_K (int16): word 2p + h holds -(the sum of the 16 q of 16-weight
// sub-block 4k + 2 (p % 2) + h), which meets 32 * that sub-block's scale (Q6_K's offset of 32).
MS_INLINE void kq_side(int qt, const int16_t* bs, float d, uint8_t* kx) {  // (inlined: see f32_to_f16)
  for (int p = 0; p < 16; ++p) {
    const int k = p / 4, e = p % 2;
    if (qt == kQ4_K) {
      const float v = -(d * float(int(bs[2 * (2 * k + e)]) + int(bs[2 * (2 * k + e) + 1])));
      std::memcpy(kx + 4 * p, &v, 4);
    } else {
      for (int h = 0; h < 2; ++h) {
        const int16_t v = int16_t(-bs[4 * k + 2 * e + h]);
        std::memcpy(kx + 4 * p + 2 * h, &v, 2);
      }
    }
  }
}

inline float roundf_away(float v) { return std::round(v); }

#if MS_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
// quantize_row's per-32 (Q8_0) quantization of the blocks, vectorized: the same values bit for bit (the same amax,
// the same IEEE division, product and round-half-away-from-zero: trunc, then +-1 where the exact fraction is >= 1/2;
// a NaN or an out-of-range product gives the scalar conversion's byte). A decode call's activation rounding cost
// 5-6 ns per element in scalar code (round() is a libm call), ~45 us for 4 rows of 2048: a fifth of a 4-token Q4_0
// expert at Qwen3-30B-A3B's width.
void quantize_q32_512(int offset, const float* x, int64_t K, int8_t* q, int32_t* nxo, float* dl, float* xs, int16_t* bs) {
  const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f);
  const __m512i absmask = _mm512_set1_epi32(0x7fffffff);
  const __m256i ones = _mm256_set1_epi8(1), noff = _mm256_set1_epi32(-offset);
  auto round_away = [&](__m512 y) MS_INLINE_LAMBDA {
    const __m512 t = _mm512_roundscale_ps(y, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m512 fr = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(_mm512_sub_ps(y, t)), absmask));
    const __m512 sgn = _mm512_castsi512_ps(_mm512_or_si512(_mm512_andnot_si512(absmask, _mm512_castps_si512(y)),
                                                           _mm512_castps_si512(one)));
    return _mm512_cvttps_epi32(_mm512_mask_add_ps(t, _mm512_cmp_ps_mask(fr, half, _CMP_GE_OQ), t, sgn));
  };
  for (int64_t b = 0; b < K / 32; ++b) {
    const __m512 v0 = _mm512_loadu_ps(x + 32 * b), v1 = _mm512_loadu_ps(x + 32 * b + 16);
    const __m512 a0 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v0), absmask));
    const __m512 a1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v1), absmask));
    // max(|v|, m) keeps m where |v| is NaN, as std::max(amax, |v|) does
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(a1, _mm512_max_ps(a0, _mm512_setzero_ps())));
    const float dd = amax / 127.0f;
    const __m512 id = _mm512_set1_ps(dd != 0.0f ? 1.0f / dd : 0.0f);
    const __m128i q0 = _mm512_cvtepi32_epi8(round_away(_mm512_mul_ps(v0, id)));
    const __m128i q1 = _mm512_cvtepi32_epi8(round_away(_mm512_mul_ps(v1, id)));
    const __m256i qv = _mm256_inserti128_si256(_mm256_castsi128_si256(q0), q1, 1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * b), qv);
    const float d = g_f16[f32_to_f16(dd)];
    const __m256i s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, qv);  // each lane's sum of 4 q
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(nxo + 8 * b), _mm256_mullo_epi32(s, noff));
    _mm256_storeu_ps(dl + 8 * b, _mm256_set1_ps(d));
    _mm256_storeu_ps(xs + 8 * b, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(s)));
    alignas(32) int32_t sl[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(sl), s);
    bs[2 * b] = int16_t(sl[0] + sl[1] + sl[2] + sl[3]);
    bs[2 * b + 1] = int16_t(sl[4] + sl[5] + sl[6] + sl[7]);
  }
}

// The lane terms every vector rounding stores for one run of q (lanes of 4 q, 16 per 64 q): nxo = -o * the lane's sum,
// dl = d, xs = d * the lane's sum (one f32 product, as the scalar loop), bs = each 16 q's sum (4 lanes).
MS_INLINE void lane_terms_512(const int8_t* q, int offset, float d, int32_t* nxo, float* dl, float* xs, int16_t* bs) {
  const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), _mm512_loadu_si512(q));
  _mm512_storeu_si512(nxo, _mm512_mullo_epi32(s, _mm512_set1_epi32(-offset)));
  _mm512_storeu_ps(dl, _mm512_set1_ps(d));
  _mm512_storeu_ps(xs, _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(s)));
  __m512i t = _mm512_add_epi32(s, _mm512_shuffle_epi32(s, _MM_PERM_CDAB));
  t = _mm512_add_epi32(t, _mm512_shuffle_epi32(t, _MM_PERM_BADC));  // each 128-bit lane: its 16 q's sum, 4 times
  _mm_storel_epi64(reinterpret_cast<__m128i*>(bs), _mm_cvtepi32_epi16(_mm512_castsi512_si128(_mm512_maskz_compress_epi32(0x1111, t))));
}

// quantize_row's per-256 (Q8_K, Q4_K / Q6_K weights) quantization, vectorized: the same bytes as the scalar loop.
// The scale comes from the first element of largest magnitude (the scalar strict '>' scan; NaN never wins:
// VMAXPS returns its second operand, the running max, where |v| is NaN), q = x * (-127 / max) converted by VCVTPS2DQ
// in the current rounding mode (nearest even, as nearbyint), min 127, the low byte kept (the int8_t conversion; a NaN
// product gives 0x80000000's low byte either way), d = 1 / iscale. The scalar loop spent ~3 ns a value (nearbyint is
// a libm call without SSE4.1): 4 rows of 2048 took ~25 us, a tenth of a Qwen3-30B-A3B Q4_K expert at m = 4; now 3.5 us.
void quantize_q256_512(int qt, const float* x, int64_t K, int8_t* q, int32_t* nxo, float* dl, float* xs, int16_t* bs,
                       uint8_t* kx) {
  const __m512i absmask = _mm512_set1_epi32(0x7fffffff), c127 = _mm512_set1_epi32(127);
  const int offset = qt == kQ4_K ? 0 : 32;
  for (int64_t b = 0; b < K / 256; ++b) {
    const float* v = x + 256 * b;
    int8_t* o = q + 256 * b;
    __m512 m = _mm512_setzero_ps();
    for (int i = 0; i < 16; ++i)
      m = _mm512_max_ps(_mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(v + 16 * i), absmask)), m);
    const float amax = _mm512_reduce_max_ps(m);
    float d = 0.0f;
    if (amax != 0.0f) {
      const __m512 am = _mm512_set1_ps(amax);
      int j = 0;
      for (int i = 0; i < 16; ++i) {
        const __m512 a = _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(v + 16 * i), absmask));
        const __mmask16 hit = _mm512_cmp_ps_mask(a, am, _CMP_EQ_OQ);
        if (hit) {
          j = 16 * i + __builtin_ctz(unsigned(hit));
          break;
        }
      }
      const float iscale = -127.0f / v[j];
      const __m512 is = _mm512_set1_ps(iscale);
      for (int i = 0; i < 16; ++i) {
        const __m512i r = _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + 16 * i), is)), c127);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 16 * i), _mm512_cvtepi32_epi8(r));
      }
      d = 1.0f / iscale;
    } else {
      std::memset(o, 0, 256);
    }
    for (int c = 0; c < 4; ++c)
      lane_terms_512(o + 64 * c, offset, d, nxo + 64 * b + 16 * c, dl + 64 * b + 16 * c, xs + 64 * b + 16 * c,
                     bs + 16 * b + 4 * c);
    kq_side(qt, bs + 16 * b, d, kx + 64 * b);
  }
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
// The AVX2 path's activation rounding, both kinds, vectorized as the AVX-512 ones above (the same bytes as the scalar
// loop): Q8_0 per 32 (round half away from zero: trunc, then +-1 where the exact fraction is >= 1/2) and Q8_K per 256.

// The low bytes of 4 x 8 int32 (as the int8_t conversion; masked to 0..255 so the unsigned packs never saturate).
MS_INLINE __m256i low_bytes_avx2(__m256i a, __m256i b, __m256i c, __m256i e) {
  const __m256i ff = _mm256_set1_epi32(0xff);
  const __m256i ab = _mm256_packus_epi32(_mm256_and_si256(a, ff), _mm256_and_si256(b, ff));
  const __m256i ce = _mm256_packus_epi32(_mm256_and_si256(c, ff), _mm256_and_si256(e, ff));
  return _mm256_permutevar8x32_epi32(_mm256_packus_epi16(ab, ce), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

MS_INLINE float hmax256(__m256 m) {  // no NaN in m
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

// Lane terms of 32 q (8 lanes, 2 bs), as lane_terms_512.
MS_INLINE void lane_terms_avx2(__m256i qv, int offset, float d, int32_t* nxo, float* dl, float* xs, int16_t* bs) {
  const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), qv), _mm256_set1_epi16(1));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(nxo), _mm256_mullo_epi32(s, _mm256_set1_epi32(-offset)));
  _mm256_storeu_ps(dl, _mm256_set1_ps(d));
  _mm256_storeu_ps(xs, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(s)));
  __m256i t = _mm256_add_epi32(s, _mm256_shuffle_epi32(s, 0xB1));
  t = _mm256_add_epi32(t, _mm256_shuffle_epi32(t, 0x4E));
  bs[0] = int16_t(_mm256_extract_epi32(t, 0));
  bs[1] = int16_t(_mm256_extract_epi32(t, 4));
}

void quantize_q32_avx2(int offset, const float* x, int64_t K, int8_t* q, int32_t* nxo, float* dl, float* xs, int16_t* bs) {
  const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* v = x + 32 * b;
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(v + 8 * i), absmask), m);
    const float dd = hmax256(m) / 127.0f;
    const __m256 id = _mm256_set1_ps(dd != 0.0f ? 1.0f / dd : 0.0f);
    __m256i r[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 y = _mm256_mul_ps(_mm256_loadu_ps(v + 8 * i), id);
      const __m256 t = _mm256_round_ps(y, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
      const __m256 fr = _mm256_and_ps(_mm256_sub_ps(y, t), absmask);
      const __m256 sgn = _mm256_or_ps(_mm256_andnot_ps(absmask, y), one);
      const __m256 up = _mm256_and_ps(_mm256_cmp_ps(fr, half, _CMP_GE_OQ), sgn);  // +-1 or +0
      r[i] = _mm256_cvttps_epi32(_mm256_add_ps(t, up));
    }
    const __m256i qv = low_bytes_avx2(r[0], r[1], r[2], r[3]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * b), qv);
    lane_terms_avx2(qv, offset, g_f16[f32_to_f16(dd)], nxo + 8 * b, dl + 8 * b, xs + 8 * b, bs + 2 * b);
  }
}

void quantize_q256_avx2(int qt, const float* x, int64_t K, int8_t* q, int32_t* nxo, float* dl, float* xs, int16_t* bs,
                        uint8_t* kx) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i c127 = _mm256_set1_epi32(127);
  const int offset = qt == kQ4_K ? 0 : 32;
  for (int64_t b = 0; b < K / 256; ++b) {
    const float* v = x + 256 * b;
    int8_t* o = q + 256 * b;
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < 32; ++i) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(v + 8 * i), absmask), m);
    const float amax = hmax256(m);
    float d = 0.0f;
    if (amax != 0.0f) {
      const __m256 am = _mm256_set1_ps(amax);
      int j = 0;
      for (int i = 0; i < 32; ++i) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_and_ps(_mm256_loadu_ps(v + 8 * i), absmask), am, _CMP_EQ_OQ));
        if (hit) {
          j = 8 * i + __builtin_ctz(unsigned(hit));
          break;
        }
      }
      const float iscale = -127.0f / v[j];
      const __m256 is = _mm256_set1_ps(iscale);
      for (int c = 0; c < 8; ++c) {
        __m256i r[4];
        for (int i = 0; i < 4; ++i)
          r[i] = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 32 * c + 8 * i), is)), c127);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 32 * c), low_bytes_avx2(r[0], r[1], r[2], r[3]));
      }
      d = 1.0f / iscale;
    } else {
      std::memset(o, 0, 256);
    }
    for (int c = 0; c < 8; ++c)
      lane_terms_avx2(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + 32 * c)), offset, d, nxo + 64 * b + 8 * c,
                      dl + 64 * b + 8 * c, xs + 64 * b + 8 * c, bs + 16 * b + 2 * c);
    kq_side(qt, bs + 16 * b, d, kx + 64 * b);
  }
}
#pragma GCC pop_options
#endif

void quantize_row(const QSpec& sp, const float* x, int64_t K, uint8_t* dst, int64_t Kp) {
  int8_t* q = reinterpret_cast<int8_t*>(dst);
  int32_t* nxo = reinterpret_cast<int32_t*>(dst + Kp);
  float* dl = reinterpret_cast<float*>(dst + 2 * Kp);
  float* xs = reinterpret_cast<float*>(dst + 3 * Kp);
  int16_t* bs = reinterpret_cast<int16_t*>(dst + 4 * Kp);
  std::memset(dst, 0, size_t(4 * Kp + bs_bytes(Kp) + kx_bytes(Kp)));
  const int xb = sp.xblk;
  uint8_t* kx = dst + 4 * Kp + bs_bytes(Kp);
  const int kqt = sp.offset == 0 ? kQ4_K : kQ6_K;  // the K-quant whose kq_side a Q8_K row carries
#if MS_X86
  const int isa = g_isa.load(std::memory_order_relaxed);
  const bool vec = isa >= kAvx2;
  if (isa >= kAvx512Bf16) {
    if (xb == 32) quantize_q32_512(sp.offset, x, K, q, nxo, dl, xs, bs);
    else quantize_q256_512(kqt, x, K, q, nxo, dl, xs, bs, kx);
  } else if (vec) {
    if (xb == 32) quantize_q32_avx2(sp.offset, x, K, q, nxo, dl, xs, bs);
    else quantize_q256_avx2(kqt, x, K, q, nxo, dl, xs, bs, kx);
  }
#else
  const bool vec = false;
#endif
  for (int64_t b = 0; b < (vec ? 0 : K / xb); ++b) {
    const float* v = x + b * xb;
    int8_t* o = q + b * xb;
    float d;
    if (xb == 32) {  // quantize_row_q8_0
      float amax = 0.0f;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(v[j]));
      const float dd = amax / 127.0f;
      const float id = dd != 0.0f ? 1.0f / dd : 0.0f;
      for (int j = 0; j < 32; ++j) o[j] = int8_t(roundf_away(v[j] * id));
      d = g_f16[f32_to_f16(dd)];
    } else {  // quantize_row_q8_K
      float amax = 0.0f, mx = 0.0f;
      for (int j = 0; j < 256; ++j)
        if (std::fabs(v[j]) > amax) {
          amax = std::fabs(v[j]);
          mx = v[j];
        }
      if (amax == 0.0f) {
        d = 0.0f;
        for (int j = 0; j < 256; ++j) o[j] = 0;
      } else {
        const float iscale = -127.0f / mx;
        for (int j = 0; j < 256; ++j) o[j] = int8_t(std::min(127, int(std::nearbyint(iscale * v[j]))));
        d = 1.0f / iscale;
      }
    }
    for (int t = 0; t < xb / 16; ++t) {
      int s16 = 0;
      for (int k = 0; k < 16; ++k) s16 += o[16 * t + k];
      bs[b * (xb / 16) + t] = int16_t(s16);
    }
    if (xb == 256) kq_side(kqt, bs + 16 * b, d, kx + 64 * b);
    for (int l = 0; l < xb / 4; ++l) {
      const int64_t lane = b * (xb / 4) + l;
      const int s = o[4 * l] + o[4 * l + 1] + o[4 * l + 2] + o[4 * l + 3];
      nxo[lane] = -sp.offset * s;
      dl[lane] = d;
      xs[lane] = d * float(s);
    }
  }
  if (xb == 32) {
    uint8_t* ux = kx + kx_bytes(Kp);
    std::memset(ux, 0, size_t(ux_bytes(Kp)));
    q32_units(q, nxo, dl, K, sp.offset == 8, ux);
  }
}

// Quantizes M rows (row m: x + row(m) * ld, bf16 bits if xbf16 else f32; row(m) = rows ? rows[m] : m).
QAct quantize_rows(const QSpec& sp, const void* x, bool xbf16, size_t ld, const int32_t* rows, int64_t M, int64_t K,
                   std::vector<float>& buf, size_t extra = 0) {
  QAct a;
  a.Kp = pad64(K);
  // only the vector paths read these rows, never past M (the AMX path takes bf16 tiles, amx_bf16_panel)
  a.stride = 4 * a.Kp + bs_bytes(a.Kp) + kx_bytes(a.Kp) + (sp.xblk == 32 ? ux_bytes(a.Kp) : 0) + 64;
  uint8_t* d = static_cast<uint8_t*>(grow_bytes(buf, size_t(M * a.stride) + extra + 64));  // extra: after the rows
  d += (64 - reinterpret_cast<uintptr_t>(d) % 64) % 64;
  std::vector<float> tmp(xbf16 ? size_t(K) : 0);
  for (int64_t m = 0; m < M; ++m) {
    const int64_t r = rows ? int64_t(rows[m]) : m;
    const float* src;
    if (xbf16) {
      const uint16_t* s = static_cast<const uint16_t*>(x) + r * int64_t(ld);
      for (int64_t k = 0; k < K; ++k) tmp[size_t(k)] = bf16_to_f32(s[k]);
      src = tmp.data();
    } else {
      src = static_cast<const float*>(x) + r * int64_t(ld);
    }
    quantize_row(sp, src, K, d + size_t(m) * size_t(a.stride), a.Kp);
  }
  a.base = d;
  return a;
}

// ---- weights, 64 at a time -------------------------------------------------------------------------
// Group g of a row: weights 64g .. 64g + n - 1 (n = 64, or 32 for a last half group of a 32-block type),
// unpacked to unsigned codes u [64] (zero past n), per-lane scales s [16] (lane l: weights 4l .. 4l+3)
// and Q4_K's per-lane min term c [16] (w = s * (u - o) + c).
struct U64 {
  alignas(64) uint8_t u[64];
  alignas(64) float s[16];
  alignas(64) float c[16];
};

MS_INLINE void scale_min_k4(int j, const uint8_t* q, uint8_t& d, uint8_t& m) {  // ggml's get_scale_min_k4
  if (j < 4) {
    d = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    d = uint8_t((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    m = uint8_t((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

// Scales of group g (s, c) for every type; shared by the unpackers of all ISA paths. Always inlined: a call
// from the AVX-512 loops into this baseline-ISA code (vzeroupper, accumulators spilled around it) measured
// 15-50x slower for the K-quants than the scalar path.
MS_INLINE void group_scales(int qt, const uint8_t* row, int64_t g, int n, float* s, float* c) {
  for (int l = 0; l < 16; ++l) s[l] = c[l] = 0.0f;
  switch (qt) {
    case kQ8_0:
    case kQ4_0: {
      const int bytes = qt == kQ8_0 ? 34 : 18;
      for (int h = 0; h < 2 && 32 * h < n; ++h) {
        const float d = f16_at(row + (2 * g + h) * bytes);
        for (int l = 0; l < 8; ++l) s[8 * h + l] = d;
      }
      return;
    }
    case kQ4_K: {
      const uint8_t* sb = row + (g / 4) * 144;
      const int j = int(g % 4);
      const float d = f16_at(sb), dmin = f16_at(sb + 2);
      for (int h = 0; h < 2; ++h) {
        uint8_t sc, m;
        scale_min_k4(2 * j + h, sb + 4, sc, m);
        const float ds = d * float(sc), dm = -(dmin * float(m));
        for (int l = 0; l < 8; ++l) {
          s[8 * h + l] = ds;
          c[8 * h + l] = dm;
        }
      }
      return;
    }
    case kQ6_K: {
      const uint8_t* sb = row + (g / 4) * 210;
      const int j = int(g % 4);
      const int8_t* sc = reinterpret_cast<const int8_t*>(sb + 192) + 8 * (j / 2) + 4 * (j % 2);
      const float d = f16_at(sb + 208);
      for (int i = 0; i < 4; ++i)
        for (int l = 0; l < 4; ++l) s[4 * i + l] = d * float(sc[i]);
      return;
    }
    default: return;
  }
}

MS_INLINE void unpack_codes(int qt, const uint8_t* row, int64_t g, int n, uint8_t* u) {
  std::memset(u, 0, 64);
  switch (qt) {
    case kQ8_0:
      for (int h = 0; h < 2 && 32 * h < n; ++h) {
        const uint8_t* q = row + (2 * g + h) * 34 + 2;
        for (int j = 0; j < 32; ++j) u[32 * h + j] = uint8_t(q[j] ^ 0x80);
      }
      return;
    case kQ4_0:
      for (int h = 0; h < 2 && 32 * h < n; ++h) {
        const uint8_t* q = row + (2 * g + h) * 18 + 2;
        for (int j = 0; j < 16; ++j) {
          u[32 * h + j] = q[j] & 15;
          u[32 * h + 16 + j] = q[j] >> 4;
        }
      }
      return;
    case kQ4_K: {
      const uint8_t* q = row + (g / 4) * 144 + 16 + 32 * (g % 4);
      for (int l = 0; l < 32; ++l) {
        u[l] = q[l] & 15;
        u[32 + l] = q[l] >> 4;
      }
      return;
    }
    case kQ6_K: {
      const uint8_t* sb = row + (g / 4) * 210;
      const int j = int(g % 4), half = j / 2, p = j % 2;
      const uint8_t* ql = sb + 64 * half;
      const uint8_t* qh = sb + 128 + 32 * half;
      for (int l = 0; l < 32; ++l) {
        if (p == 0) {
          u[l] = uint8_t((ql[l] & 15) | ((qh[l] & 3) << 4));
          u[32 + l] = uint8_t((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4));
        } else {
          u[l] = uint8_t((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
          u[32 + l] = uint8_t((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
        }
      }
      return;
    }
    default: return;
  }
}

MS_INLINE void unpack64(int qt, const uint8_t* row, int64_t g, int n, U64& w) {
  unpack_codes(qt, row, g, n, w.u);
  group_scales(qt, row, g, n, w.s, w.c);
}

// A quantized micro-kernel: R weight rows wr[0..r) (pointers to their first block) against activation
// rows m0 .. m0 + mr - 1 of `a`, over groups [g0, g1) (weights 64 g0 .. min(64 g1, K)), storing (or adding,
// `acc`) each sum into y[m * ldy + nc[j]].
#define QMK_ARGS \
  int qt, int r, const uint8_t* const* wr, const QAct& a, int64_t m0, int mr, int64_t g0, int64_t g1, int64_t K, \
      float* y, size_t ldy, const int* nc, bool acc
constexpr int kQR = 4;   // weight rows per micro-kernel call
constexpr int kQMR = 4;  // activation rows per micro-kernel call

void qmk_scalar(QMK_ARGS) {
  float lanes[kQR][kQMR][16] = {};
  U64 w;
  for (int64_t g = g0; g < g1; ++g) {
    const int n = int(std::min<int64_t>(64, K - 64 * g));
    for (int j = 0; j < r; ++j) {
      unpack64(qt, wr[j], g, n, w);
      for (int i = 0; i < mr; ++i) {
        const QRow x = a.row(m0 + i);
        for (int l = 0; l < 16; ++l) {
          const int64_t lane = 16 * g + l;
          int32_t v = x.nxo[lane];
          for (int t = 0; t < 4; ++t) v += int32_t(w.u[4 * l + t]) * int32_t(x.q[4 * lane + t]);
          lanes[j][i][l] += float(v) * (w.s[l] * x.dl[lane]) + w.c[l] * x.xs[lane];
        }
      }
    }
  }
  for (int j = 0; j < r; ++j)
    for (int i = 0; i < mr; ++i) {
      const float* L = lanes[j][i];
      float s8[8];
      for (int l = 0; l < 8; ++l) s8[l] = L[l] + L[l + 8];
      const float s = ((s8[0] + s8[4]) + (s8[2] + s8[6])) + ((s8[1] + s8[5]) + (s8[3] + s8[7]));
      put(y + (m0 + i) * ldy + nc[j], s, acc);
    }
}

#if MS_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma")

// AVX2: codes widened to 16 bits, pairs multiplied and added (VPMADDWD), pairs of pairs added and put back
// in order: one 32-bit lane per 4 weights, as on the other paths.
// K-quants on AVX2, as llama.cpp's q4_K / q6_K x q8_K (AVX-512: qmk512k_rm, outputs in pairs): per 32 weights VPMADDUBSW
// (unsigned codes x signed activations into 16-bit pair sums) and VPMADDWD by the integer sub-block scale into
// 8 int32 lanes, summed exactly over the super-block; the float scales applied once per 256 weights (Q4_K's mins
// and Q6_K's offset of 32 through the activations' 16-sums). Same integer sums, so the same reference tolerance.
// Single-core A/B against the earlier per-64-weight float scheme (bench_qlinear_ab --isa avx2, [14336, 4096], under
// load): Q4_K 3.5x / 3.3x / 3.1x at m = 1 / 4 / 8, Q6_K 2.7x / 2.9x / 2.6x (Q8_0, unchanged, 1.00-1.16x).
// Q4_K's eight 6-bit sub-block scales and eight 6-bit mins (bytes 4-15 of a super-block), one per byte.
MS_INLINE void q4k_scales_mins(const uint8_t* sb, uint64_t& sc, uint64_t& mn) {
  uint32_t a, b, c;
  std::memcpy(&a, sb + 4, 4);
  std::memcpy(&b, sb + 8, 4);
  std::memcpy(&c, sb + 12, 4);
  sc = uint64_t(a & 0x3f3f3f3fu) | uint64_t((c & 0x0f0f0f0fu) | ((a >> 2) & 0x30303030u)) << 32;
  mn = uint64_t(b & 0x3f3f3f3fu) | uint64_t(((c >> 4) & 0x0f0f0f0fu) | ((b >> 2) & 0x30303030u)) << 32;
}

// The AVX2 block kernels' activation-row count (1..4, kQMR) as a compile-time constant: f(std::integral_constant).
template <class F>
MS_INLINE void with_rows(int mr, F&& f) {
  switch (mr) {
    case 1: return f(std::integral_constant<int, 1>());
    case 2: return f(std::integral_constant<int, 2>());
    case 3: return f(std::integral_constant<int, 3>());
    default: return f(std::integral_constant<int, 4>());
  }
}

// One activation row's r outputs (at y_row[nc[j]]) from an accumulator laid out [rows 0..3 | rows 0..3]: the halves
// summed once, at the end.
MS_INLINE void put_quad_avx2(__m256 v, int r, float* y_row, const int* nc, bool acc) {
  alignas(16) float o[4];
  _mm_store_ps(o, _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)));
  for (int j = 0; j < r; ++j) put(y_row + nc[j], o[j], acc);
}

// Weights 32c .. 32c + 31 of a super-block: unsigned codes (the activations' order) and the 16-bit sub-block scales
// VPMADDWD takes. Made in registers per 32 weights and used by every activation row of the call before the next.
template <int QT>
MS_INLINE void kcodes_avx2(const uint8_t* sb, int c, uint64_t sc, __m256i& u, __m256i& sv) {
  const __m256i m4 = _mm256_set1_epi8(15);
  if constexpr (QT == kQ4_K) {  // 32 bytes per 64 weights: low nibbles 64g .., high 64g + 32 ..
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 16 + 32 * (c / 2)));
    u = _mm256_and_si256(c % 2 ? _mm256_srli_epi16(raw, 4) : raw, m4);
    sv = _mm256_set1_epi16(short((sc >> (8 * c)) & 0xff));
  } else {  // c = 2g + part, g = 2h + p: ql bytes 64h + 32 part .., nibble p; qh bytes 128 + 32h .., bits 2 part + 4p
    const int h = c / 4, p = (c / 2) % 2, part = c % 2, sub = 2 * c;  // first 16-weight scale: 4g + 2 part
    const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 64 * h + 32 * part));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 128 + 32 * h));
    const __m256i hb = _mm256_srli_epi16(qh, 2 * part + 4 * p);
    u = _mm256_or_si256(_mm256_and_si256(p ? _mm256_srli_epi16(ql, 4) : ql, m4),
                        _mm256_slli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8(3)), 4));
    const int8_t* scs = reinterpret_cast<const int8_t*>(sb + 192);
    sv = _mm256_set_m128i(_mm_set1_epi16(short(scs[sub + 1])), _mm_set1_epi16(short(scs[sub])));
  }
}

// K-quants on AVX2 for MR activation rows: per super-block and weight row, each 32 weights' codes are made once
// (kcodes_avx2) and taken by all MR rows (8 int32 lanes each, exact over the super-block); then per row the min /
// offset term t (the per-16 scales times the activations' 16-sums) and the float scales, once per 256 weights.
template <int QT, int MR>
void qmk_avx2_k_rows(int r, const uint8_t* const* wr, const QAct& a, int64_t m0, int64_t g0, int64_t g1, float* y,
                     size_t ldy, const int* nc, bool acc) {
  constexpr int bytes = QT == kQ4_K ? 144 : 210;
  __m256 accv[kQR][MR];
  QRow xr[MR];
  for (int i = 0; i < MR; ++i) {
    xr[i] = a.row(m0 + i);
    for (int j = 0; j < kQR; ++j) accv[j][i] = _mm256_setzero_ps();
  }
  for (int64_t s = g0 / 4; s < (g1 + 3) / 4; ++s)
    for (int j = 0; j < r; ++j) {
      const uint8_t* sb = wr[j] + s * bytes;
      for (int o = 0; o < bytes; o += 64)  // every cache line of the super-block, as the Q4_0 / Q8_0 kernels
        _mm_prefetch(reinterpret_cast<const char*>(sb) + MS_QPREFETCH + o, _MM_HINT_T1);
      uint64_t sc = 0, mn = 0;
      if constexpr (QT == kQ4_K) q4k_scales_mins(sb, sc, mn);
      __m256i v[MR];
      for (int i = 0; i < MR; ++i) v[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        __m256i u, sv;
        kcodes_avx2<QT>(sb, c, sc, u, sv);
#pragma GCC unroll 4
        for (int i = 0; i < MR; ++i) {
          const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[i].q + 256 * s + 32 * c));
          v[i] = _mm256_add_epi32(v[i], _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), sv));
        }
      }
      __m256i m16;
      if constexpr (QT == kQ4_K) {
        const __m128i m8 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(int64_t(mn)));
        m16 = _mm256_set_m128i(_mm_unpackhi_epi16(m8, m8), _mm_unpacklo_epi16(m8, m8));
      } else {
        m16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 192)));
      }
      const float d = f16_at(QT == kQ4_K ? sb : sb + 208), dmin = QT == kQ4_K ? f16_at(sb + 2) : 0.0f;
      for (int i = 0; i < MR; ++i) {
        const __m256i t = _mm256_madd_epi16(m16, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[i].bs + 16 * s)));
        const float dx = xr[i].dl[64 * s];
        __m256i vi = v[i];
        if constexpr (QT == kQ6_K) vi = _mm256_sub_epi32(vi, _mm256_slli_epi32(t, 5));
        accv[j][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(vi), _mm256_set1_ps(d * dx), accv[j][i]);
        if constexpr (QT == kQ4_K)
          accv[j][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(-(dmin * dx)), accv[j][i]);
      }
    }
  for (int j = 0; j < r; ++j)
    for (int i = 0; i < MR; ++i) put(y + (m0 + i) * ldy + nc[j], hsum256(accv[j][i]), acc);
}

template <int QT>
void qmk_avx2_k(int r, const uint8_t* const* wr, const QAct& a, int64_t m0, int mr, int64_t g0, int64_t g1, float* y,
                size_t ldy, const int* nc, bool acc) {
  with_rows(mr, [&](auto MR) { qmk_avx2_k_rows<QT, decltype(MR)::value>(r, wr, a, m0, g0, g1, y, ldy, nc, acc); });
}

// Q4_0 on AVX2 in 2-block units (64 weights: the AVX-512 kernel's 4-block units, qmk512_u, in halves, so the
// activations' ux layout serves both). Per weight row, two 16-byte loads give both blocks' nibbles: U = the low
// nibbles (128-bit lane h: block 2g + h's weights 0..15), V = the high ones (16..31), against the unit's qa / qb halves.
// Per activation row and weight row: VPMADDUBSW of U and of V (pair sums <= 2 * 15 * 127) added in 16 bits (<= 7620)
// and VPMADDWD by ones (4 dwords per block, <= 15240); then the 4 weight rows' dwords are packed to 16 bits and
// pair-added twice (<= 30480 in 16 bits, <= 60960 in 32: nothing saturates) into one exact int32 per block and row,
// lanes [block 2g: rows 0..3 | block 2g + 1: rows 0..3], plus the block's offset term (-8 * its activation sum). One
// conversion, one multiply (the rows' f16 scales times d_x) and one FMA per 64 weights then serve 4 outputs, where
// the per-block kernel (vpmaddubsw + vpmaddwd into a lane per 4 weights) took 8 operations per block and output.
// Each output's terms go to its two lanes in K order, summed once at the end (block 2g's lane + block 2g + 1's).
template <int MR>
void qmk_avx2_q4_0_u(int r, const uint8_t* const* wr, const QAct& a, int64_t m0, int64_t g0, int64_t g1, int64_t K,
                     float* y, size_t ldy, const int* nc, bool acc) {
  const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  __m256 accv[MR];
  const uint8_t* xu[MR];
  for (int i = 0; i < MR; ++i) {
    accv[i] = _mm256_setzero_ps();
    xu[i] = a.row(m0 + i).ux;
  }
  const int64_t nblk = K / 32;
  for (int64_t g = g0; g < g1; ++g) {
    const bool two = 2 * g + 1 < nblk;  // a row's last unit may hold one block (zeros in the activations' lane 1)
    __m256i U[4], V[4];
    float sc[8];  // built in registers (stored one by one and loaded as a vector, they stalled the store forwarding)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      sc[j] = sc[4 + j] = 0.0f;
      if (j >= r) {
        U[j] = V[j] = _mm256_setzero_si256();
        continue;
      }
      const uint8_t* p = wr[j] + 2 * g * 18;
      _mm_prefetch(reinterpret_cast<const char*>(p) + MS_QPREFETCH, _MM_HINT_T1);
      const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2));
      const __m128i hi = two ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 20)) : _mm_setzero_si128();
      const __m256i raw = _mm256_set_m128i(hi, lo);
      U[j] = _mm256_and_si256(raw, m4);
      V[j] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
      sc[j] = f16_at(p);
      if (two) sc[4 + j] = f16_at(p + 18);
    }
    const __m256 dw = _mm256_setr_ps(sc[0], sc[1], sc[2], sc[3], sc[4], sc[5], sc[6], sc[7]);
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const uint8_t* x = xu[i] + 256 * (g / 2) + 32 * (g % 2);
      const __m256i qa = _mm256_load_si256(reinterpret_cast<const __m256i*>(x));
      const __m256i qb = _mm256_load_si256(reinterpret_cast<const __m256i*>(x + 64));
      __m256i s[4];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j)
        s[j] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(U[j], qa), _mm256_maddubs_epi16(V[j], qb)), ones);
      const __m256i s01 = _mm256_madd_epi16(_mm256_packs_epi32(s[0], s[1]), ones);
      const __m256i s23 = _mm256_madd_epi16(_mm256_packs_epi32(s[2], s[3]), ones);
      const __m256i v = _mm256_add_epi32(_mm256_madd_epi16(_mm256_packs_epi32(s01, s23), ones),
                                         _mm256_load_si256(reinterpret_cast<const __m256i*>(x + 128)));
      accv[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_mul_ps(dw, _mm256_load_ps(reinterpret_cast<const float*>(x + 192))),
                                accv[i]);
    }
  }
  for (int i = 0; i < MR; ++i) put_quad_avx2(accv[i], r, y + (m0 + i) * ldy, nc, acc);
}

void qmk_avx2_q4_0(int r, const uint8_t* const* wr, const QAct& a, int64_t m0, int mr, int64_t g0, int64_t g1,
                   int64_t K, float* y, size_t ldy, const int* nc, bool acc) {
  with_rows(mr, [&](auto MR) { qmk_avx2_q4_0_u<decltype(MR)::value>(r, wr, a, m0, g0, g1, K, y, ldy, nc, acc); });
}

// Q8_0 on AVX2, per 32-weight block, as llama.cpp's AVX2 q8_0 x q8_0: VPSIGNB moves each weight's sign onto its
// activation, VPMADDUBSW takes |w| (at most 128) times that (pair sums <= 2 * 128 * 127: nothing saturates), VPMADDWD
// by ones gives 8 dwords of 4 products; three VPHADDD reduce 4 weight rows to [rows 0..3 | rows 0..3] (each 128-bit
// half: 16 of the block's 32 products, exact), then one conversion and one FMA by (the rows' f16 scales times d_x)
// per block and 4 outputs, where the generic path unpacked 64 weights through memory and took per lane of 4 weights
// a conversion, a multiply and two FMAs per output. The halves are summed once at the end.
template <int MR>
void qmk_avx2_q8_0_b(int r, const uint8_t* const* wr, const QAct& a, int64_t m0, int64_t g0, int64_t g1, int64_t K,
                     float* y, size_t ldy, const int* nc, bool acc) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 accv[MR];
  QRow xr[MR];
  for (int i = 0; i < MR; ++i) {
    accv[i] = _mm256_setzero_ps();
    xr[i] = a.row(m0 + i);
  }
  const int64_t b1 = std::min<int64_t>(2 * g1, K / 32);
  for (int64_t b = 2 * g0; b < b1; ++b) {
    __m256i w[4], aw[4];
    float sc[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      sc[j] = 0.0f;
      if (j >= r) {
        w[j] = aw[j] = _mm256_setzero_si256();
        continue;
      }
      const uint8_t* p = wr[j] + b * 34;
      _mm_prefetch(reinterpret_cast<const char*>(p) + MS_QPREFETCH, _MM_HINT_T1);
      w[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
      aw[j] = _mm256_abs_epi8(w[j]);
      sc[j] = f16_at(p);
    }
    const __m256 dw = _mm256_setr_ps(sc[0], sc[1], sc[2], sc[3], sc[0], sc[1], sc[2], sc[3]);
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const __m256i q = _mm256_load_si256(reinterpret_cast<const __m256i*>(xr[i].q + 32 * b));
      __m256i m[4];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) m[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(aw[j], _mm256_sign_epi8(q, w[j])), ones);
      const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(m[0], m[1]), _mm256_hadd_epi32(m[2], m[3]));
      accv[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), _mm256_mul_ps(dw, _mm256_broadcast_ss(xr[i].dl + 8 * b)), accv[i]);
    }
  }
  for (int i = 0; i < MR; ++i) put_quad_avx2(accv[i], r, y + (m0 + i) * ldy, nc, acc);
}

void qmk_avx2_q8_0(int r, const uint8_t* const* wr, const QAct& a, int64_t m0, int mr, int64_t g0, int64_t g1,
                   int64_t K, float* y, size_t ldy, const int* nc, bool acc) {
  with_rows(mr, [&](auto MR) { qmk_avx2_q8_0_b<decltype(MR)::value>(r, wr, a, m0, g0, g1, K, y, ldy, nc, acc); });
}

void qmk_avx2(QMK_ARGS) {
  if (qt == kQ4_K) return qmk_avx2_k<kQ4_K>(r, wr, a, m0, mr, g0, g1, y, ldy, nc, acc);
  if (qt == kQ6_K) return qmk_avx2_k<kQ6_K>(r, wr, a, m0, mr, g0, g1, y, ldy, nc, acc);
  if (qt == kQ4_0) return qmk_avx2_q4_0(r, wr, a, m0, mr, g0, g1, K, y, ldy, nc, acc);
  if (qt == kQ8_0) return qmk_avx2_q8_0(r, wr, a, m0, mr, g0, g1, K, y, ldy, nc, acc);
  __m256 accv[kQR][kQMR];
  for (int j = 0; j < kQR; ++j)
    for (int i = 0; i < kQMR; ++i) accv[j][i] = _mm256_setzero_ps();
  U64 w;
  const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
  for (int64_t g = g0; g < g1; ++g) {
    const int n = int(std::min<int64_t>(64, K - 64 * g));
    for (int j = 0; j < r; ++j) {
      unpack64(qt, wr[j], g, n, w);
      for (int h = 0; h < 2; ++h) {  // 32 weights, 8 lanes
        const __m128i ub0 = _mm_load_si128(reinterpret_cast<const __m128i*>(w.u + 32 * h));
        const __m128i ub1 = _mm_load_si128(reinterpret_cast<const __m128i*>(w.u + 32 * h + 16));
        const __m256i u0 = _mm256_cvtepu8_epi16(ub0), u1 = _mm256_cvtepu8_epi16(ub1);
        const __m256 s = _mm256_load_ps(w.s + 8 * h), c = _mm256_load_ps(w.c + 8 * h);
        for (int i = 0; i < mr; ++i) {
          const QRow x = a.row(m0 + i);
          const int64_t k = 64 * g + 32 * h, lane = k / 4;
          const __m256i x0 = _mm256_cvtepi8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(x.q + k)));
          const __m256i x1 = _mm256_cvtepi8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(x.q + k + 16)));
          __m256i v = _mm256_hadd_epi32(_mm256_madd_epi16(u0, x0), _mm256_madd_epi16(u1, x1));
          v = _mm256_permutevar8x32_epi32(v, order);
          v = _mm256_add_epi32(v, _mm256_load_si256(reinterpret_cast<const __m256i*>(x.nxo + lane)));
          const __m256 sd = _mm256_mul_ps(s, _mm256_load_ps(x.dl + lane));
          __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), sd, accv[j][i]);
          accv[j][i] = _mm256_fmadd_ps(c, _mm256_load_ps(x.xs + lane), t);
        }
      }
    }
  }
  for (int j = 0; j < r; ++j)
    for (int i = 0; i < mr; ++i) put(y + (m0 + i) * ldy + nc[j], hsum256(accv[j][i]), acc);
}

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")

// AVX-512: codes unpacked in registers, VPDPBUSD (unsigned codes x signed activations, 4 products a lane)
// starting from -o * the lane's activation sum, so each lane holds the exact signed integer sum.
template <int QT>
inline __m512i codes512(const uint8_t* row, int64_t g, int n) {
  const __m512i m4 = _mm512_set1_epi8(15);
  if constexpr (QT == kQ8_0) {
    const uint8_t* b = row + 2 * g * 34 + 2;
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
    const __m256i hi = n > 32 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 34)) : _mm256_set1_epi8(-128);
    return _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), _mm512_set1_epi8(-128));
  } else if constexpr (QT == kQ4_0) {
    const uint8_t* b = row + 2 * g * 18 + 2;
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
    const __m128i q1 = n > 32 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18)) : _mm_setzero_si128();
    // [q0, q0 >> 4, q1, q1 >> 4] & 15
    __m512i v = _mm512_castsi128_si512(q0);
    v = _mm512_inserti32x4(v, _mm_srli_epi16(q0, 4), 1);
    v = _mm512_inserti32x4(v, q1, 2);
    v = _mm512_inserti32x4(v, _mm_srli_epi16(q1, 4), 3);
    return _mm512_and_si512(v, m4);
  } else if constexpr (QT == kQ4_K) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + (g / 4) * 144 + 16 + 32 * (g % 4)));
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 4), 1);
    return _mm512_and_si512(v, m4);
  } else {
    const uint8_t* sb = row + (g / 4) * 210;
    const int j = int(g % 4), half = j / 2, p = j % 2;
    const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 64 * half));
    const __m256i qb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 64 * half + 32));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 128 + 32 * half));
    const __m512i ql = _mm512_inserti64x4(_mm512_castsi256_si512(qa), qb, 1);
    // high bits: lanes 0..31 from qh bits (4p, 4p+1), 32..63 from bits (4p+2, 4p+3)
    const __m512i h2 = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
    const __m512i lo = p ? _mm512_srli_epi16(ql, 4) : ql;
    const __m512i hi = p ? _mm512_srli_epi16(h2, 4) : h2;
    return _mm512_or_si512(_mm512_and_si512(lo, m4),
                           _mm512_slli_epi16(_mm512_and_si512(hi, _mm512_set1_epi8(3)), 4));
  }
}

// The micro-kernels take R weight rows x MR activation rows, both compile-time: the accumulators stay in registers.
// Each weight row's block is unpacked once and applied to all MR activation rows. PF: prefetch every stream
// kQPrefetch bytes ahead into L2 or L1 (QPrefetch, below; the weights come from memory): with MR rows' work per line the out-of-order
// window alone no longer keeps enough lines in flight.
constexpr int kQPrefetch = MS_QPREFETCH;

// Which cache level the block kernels prefetch their weight streams into (PF of the micro-kernels; the hint is
// an immediate, so each is its own instantiation). Chosen at load by CPU vendor (qprefetch_default): Intel L2
// (T1, as tuned on Sapphire Rapids), AMD L1 (T0). Measured on an AMD EPYC Zen 5 (2 vCPUs), the real Q4_K_M
// decode-step matrices of a Mixtral-width layer at m = 1 on 2 threads (attention, 2 experts, the Q6_K LM head),
// builds alternated in one process, the median of 30-50 paired rounds of process CPU time on a loaded, shared
// machine: T0 / T1 1.08-1.18x the step over four runs (the experts 1.09-1.23x, the head 1.07-1.15x); with T0,
// distances 1024 / 4096 0.85x / 0.98x of 2048; no prefetch 0.77x of T1. One thread, weights from memory
// (bench_qlinear_ab, thread CPU time, m = 1): Q4_K 1.00-1.02x, Q6_K 1.02-1.07x, Q8_0 1.10x, Q4_0 1.05x.
// Bits unchanged: a prefetch moves no data into the arithmetic (tests/test_native_prefetch.py).
enum QPrefetch { kQPfOff = 0, kQPfL2 = 1, kQPfL1 = 2 };

template <int PF>
MS_INLINE void qprefetch(const void* p) {
  if constexpr (PF == kQPfL2) _mm_prefetch(static_cast<const char*>(p) + kQPrefetch, _MM_HINT_T1);
  else if constexpr (PF == kQPfL1) _mm_prefetch(static_cast<const char*>(p) + kQPrefetch, _MM_HINT_T0);
}
thread_local std::vector<float> t_qvacc;  // vector partial sums between K chunks (qgemm_range_512)

// Accumulators of a micro-kernel call over one K chunk: zero on the first chunk, else the previous chunk's
// vectors (vacc: R x MR vectors); kept as vectors between chunks and reduced once after the last, so a sum
// is the same however K is chunked and however many rows share the call (row m of an M-row call equals a
// 1-row call on that row, bit for bit, on this path).
template <int R, int MR>
MS_INLINE void load_acc(__m512 (&accv)[R][MR], const float* vacc, bool first) {
  for (int j = 0; j < R; ++j)
    for (int i = 0; i < MR; ++i) accv[j][i] = first ? _mm512_setzero_ps() : _mm512_load_ps(vacc + (j * MR + i) * 16);
}

template <int R, int MR>
MS_INLINE void store_acc(const __m512 (&accv)[R][MR], float* vacc, bool last, float* y, size_t ldy, const int* nc) {
  for (int j = 0; j < R; ++j)
    for (int i = 0; i < MR; ++i) {
      if (last) y[i * ldy + nc[j]] = hsum512(accv[j][i]);
      else _mm512_store_ps(vacc + (j * MR + i) * 16, accv[j][i]);
    }
}

// Q4_0 in units of 4 blocks (128 weights, 72 bytes of a weight row), four outputs per vector. Per unit and weight
// row, the 4 blocks' nibbles are gathered by one word permute (128-bit lane b: block b's 16 bytes; 18 is even), ua =
// the low nibbles (weights 0..15 of each block), ub = the high (16..31); the activations come in the matching layout
// (QRow::ux, q32_units). For weight rows j0..j3 and one activation row: two chained VPDPBUSD per weight row give 16
// dwords of 8 products each (4 per block, |sum| <= 8 * 15 * 127 < 2^15); VPACKSSDW + VPMADDWD by ones pair the rows
// (j0, j1) and (j2, j3) (2 dwords per block and row, |sum| < 2^15: nothing saturates), and VPACKSSDW + VPDPWSSD by
// ones, accumulating onto the block's offset term (-8 * the sum of its 32 q), leave one exact int32 per block and
// weight row: 128-bit lane b holds block b's sums of j0, j1, j2, j3. Then one conversion, one multiply (d_w x d_x,
// the four rows' f16 scales permuted into that layout and converted together) and one FMA serve four outputs. Per
// unit of 4 weight rows: 4 word permutes, 4 shifts, 8 ANDs and 3 scale permutes / blends + 1 conversion, and per
// activation row 8 VPDPBUSD + 6 packs / madds + 3 float operations: 17 vector operations where the per-output
// kernel it replaced (64 weights a step) took 32 and its scale look-ups. An output's terms, block by block, go into
// its own 4 lanes (one per block position of a unit) in K order, and the lanes are summed in one fixed order at the
// end (qsum4): whatever rows share the call, row m of an M-row call is the 1-row call on that row, bit for bit.
MS_INLINE void q4_0_codes(const uint8_t* p, int nb, __m512i& ua, __m512i& ub, __m512i& hdr) {
  const __m512i m4 = _mm512_set1_epi8(15);
  __m512i raw;
  if (nb == 4) {  // the unit's 36 words: 0..31 in hdr, 32..35 (bytes 64..71) in the second source
    const __m512i nidx = _mm512_set_epi16(35, 34, 33, 32, 31, 30, 29, 28, 26, 25, 24, 23, 22, 21, 20, 19, 17, 16, 15, 14,
                                          13, 12, 11, 10, 8, 7, 6, 5, 4, 3, 2, 1);
    hdr = _mm512_loadu_si512(p);
    raw = _mm512_permutex2var_epi16(hdr, nidx, _mm512_castsi128_si512(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 64))));
  } else {  // the row's last 1-3 blocks: nothing read past them, zero codes and scales in the missing lanes
    raw = _mm512_setzero_si512();
    for (int b = 0; b < nb; ++b) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 18 * b + 2));
      raw = _mm512_mask_broadcast_i32x4(raw, __mmask16(0xFu << (4 * b)), v);
    }
    hdr = _mm512_maskz_loadu_epi8((uint64_t(1) << (18 * nb)) - 1, p);
  }
  ua = _mm512_and_si512(raw, m4);
  ub = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
}

// The f16 scales of four weight rows' units (hdr: each unit's first 64 bytes; block b's d is word 9b) as f32, dword
// 4b + k = row k's block b.
MS_INLINE __m512 q4_0_scales4(const __m512i* hdr) {
  const __m512i i01 = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 59, 27, 0, 0, 50, 18, 0, 0,
                                       41, 9, 0, 0, 32, 0);
  const __m512i i23 = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 59, 27, 0, 0, 50, 18, 0, 0, 41, 9,
                                       0, 0, 32, 0, 0, 0);
  const __m512i w = _mm512_mask_blend_epi16(0xCCCC, _mm512_permutex2var_epi16(hdr[0], i01, hdr[1]),
                                            _mm512_permutex2var_epi16(hdr[2], i23, hdr[3]));
  return _mm512_cvtph_ps(_mm512_castsi512_si256(w));
}

// Block sums of weight rows j0..j3 (codes ua[k], ub[k]) against one activation row's unit x: lane b = [j0 .. j3] of
// block b, plus the block's offset term.
MS_INLINE __m512i q4_0_sums4(const __m512i* ua, const __m512i* ub, const uint8_t* x) {
  const __m512i ones = _mm512_set1_epi16(1);
  const __m512i qa = _mm512_load_si512(x), qb = _mm512_load_si512(x + 64);
  __m512i v[4];
  for (int k = 0; k < 4; ++k) v[k] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ua[k], qa), ub[k], qb);
  const __m512i p01 = _mm512_madd_epi16(_mm512_packs_epi32(v[0], v[1]), ones);
  const __m512i p23 = _mm512_madd_epi16(_mm512_packs_epi32(v[2], v[3]), ones);
  return _mm512_dpwssd_epi32(_mm512_load_si512(x + 128), _mm512_packs_epi32(p01, p23), ones);
}

// Output k of a four-output vector: ((block 0 + block 2) + (block 1 + block 3)) of its lanes, for k = 0..3 at once.
MS_INLINE __m128 qsum4(__m512 v) {
  const __m512 t = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
  return _mm_add_ps(_mm512_castps512_ps128(t), _mm512_extractf32x4_ps(t, 1));
}

// R weight rows (in quads; rows past R are zero codes, their outputs dropped) x MR activation rows over groups
// [g0, g1) (g0 even: chunks start at multiples of kQKC groups). vacc: the quads' vectors between K chunks.
template <int R, int MR, int PF>
void qmk512_u(const uint8_t* const* wr, const QAct& a, int64_t m0, int64_t g0, int64_t g1, int64_t K, float* y,
              size_t ldy, const int* nc, float* vacc, bool first, bool last) {
  constexpr int NQ = (R + 3) / 4;
  __m512 acc[NQ][MR];
  for (int q = 0; q < NQ; ++q)
    for (int i = 0; i < MR; ++i) acc[q][i] = first ? _mm512_setzero_ps() : _mm512_load_ps(vacc + (q * MR + i) * 16);
  const uint8_t* xu[MR];
  for (int i = 0; i < MR; ++i) xu[i] = a.row(m0 + i).ux;
  auto unit = [&](int64_t u, int nb) MS_INLINE_LAMBDA {
#pragma GCC unroll 2
    for (int q = 0; q < NQ; ++q) {
      __m512i ua[4], ub[4], hdr[4];
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
        if (4 * q + k >= R) {
          ua[k] = ub[k] = hdr[k] = _mm512_setzero_si512();
          continue;
        }
        const uint8_t* p = wr[4 * q + k] + u * 72;
        qprefetch<PF>(p);
        qprefetch<PF>(p + 71);
        q4_0_codes(p, nb, ua[k], ub[k], hdr[k]);
      }
      const __m512 dw = q4_0_scales4(hdr);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const uint8_t* x = xu[i] + 256 * u;
        acc[q][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q4_0_sums4(ua, ub, x)), _mm512_mul_ps(dw, _mm512_load_ps(x + 192)),
                                    acc[q][i]);
      }
    }
  };
  const int64_t nblk = K / 32, ue = (g1 + 1) / 2, full = std::min(ue, nblk / 4);
  for (int64_t u = g0 / 2; u < full; ++u) unit(u, 4);
  if (full < ue) unit(full, int(nblk - 4 * full));
  for (int q = 0; q < NQ; ++q)
    for (int i = 0; i < MR; ++i) {
      if (!last) {
        _mm512_store_ps(vacc + (q * MR + i) * 16, acc[q][i]);
        continue;
      }
      alignas(16) float o[4];
      _mm_store_ps(o, qsum4(acc[q][i]));
      for (int k = 0; k < 4 && 4 * q + k < R; ++k) y[(m0 + i) * ldy + nc[4 * q + k]] = o[k];
    }
}

// Q8_0 in the same units of 4 blocks (136 bytes of a weight row): ua = each block's codes 0..15, ub = 16..31 (128-bit
// lane b: block b), gathered by word permutes (34-byte blocks are word-aligned) and made unsigned (xor 0x80, the offset
// of 128 in the activations' off), the 4 f16 scales converted at once. Per weight row and activation row: two chained
// VPDPBUSD from off give 16 exact int32 sums of 8 products each (|sum| <= 8 * 255 * 127 + 8 * 128 * 127 < 2^24: the
// conversion is exact), then one conversion, one multiply (d_w * d_x) and one FMA per 128 weights, where the
// per-group kernel took 8 and unpacked 64 weights at a time with 128-bit inserts and scalar scale look-ups. Q8_0's
// 8-product sums need 18 bits, so they are not packed into 16 as Q4_0's are. Each dword of an output's accumulator
// takes its 8-product sum times (d_w * d_x) per block in K order; the 16 dwords are summed in one fixed order (hsum512):
// row m of an M-row call is the 1-row call on that row, bit for bit.
MS_INLINE void q8_0_unit(const uint8_t* p, int nb, __m512i& ua, __m512i& ub, __m512& dw) {
  // words of the unit: block b's d is word 17b, its codes 0..15 words 17b+1 .. 17b+8, codes 16..31 17b+9 .. 17b+16
  const __m512i ia = _mm512_set_epi16(59, 58, 57, 56, 55, 54, 53, 52, 42, 41, 40, 39, 38, 37, 36, 35, 25, 24, 23, 22, 21,
                                      20, 19, 18, 8, 7, 6, 5, 4, 3, 2, 1);
  // ub from bytes 8..71 (words 4..35: blocks 0, 1's words 9..16, 26..33) and 72..135 (words 36..67: blocks 2, 3's
  // 43..50, 60..67; + 32 for the second source)
  const __m512i ib = _mm512_set_epi16(63, 62, 61, 60, 59, 58, 57, 56, 46, 45, 44, 43, 42, 41, 40, 39, 29, 28, 27, 26, 25,
                                      24, 23, 22, 12, 11, 10, 9, 8, 7, 6, 5);
  const __m512i id = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 51, 51, 51, 51, 34, 34, 34, 34, 17,
                                      17, 17, 17, 0, 0, 0, 0);
  __m512i s0, s1, s8, s2;
  if (nb == 4) {
    s0 = _mm512_loadu_si512(p);
    s1 = _mm512_loadu_si512(p + 64);
    s8 = _mm512_loadu_si512(p + 8);
    s2 = _mm512_loadu_si512(p + 72);
  } else {  // the row's last 1-3 blocks: nothing read past them, zero scales in the missing lanes
    const int n = 34 * nb;
    auto upto = [](int c) { return c <= 0 ? uint64_t(0) : c >= 64 ? ~uint64_t(0) : (uint64_t(1) << c) - 1; };
    s0 = _mm512_maskz_loadu_epi8(upto(n), p);
    s1 = _mm512_maskz_loadu_epi8(upto(n - 64), p + 64);
    s8 = _mm512_maskz_loadu_epi8(upto(n - 8), p + 8);
    s2 = _mm512_maskz_loadu_epi8(upto(n - 72), p + 72);
  }
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  ua = _mm512_xor_si512(_mm512_permutex2var_epi16(s0, ia, s1), flip);
  ub = _mm512_xor_si512(_mm512_permutex2var_epi16(s8, ib, s2), flip);
  // d words: 0, 17 in s0; 34, 51 are words 2, 19 of s1 (index 32 + 2, 32 + 19)
  dw = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutex2var_epi16(s0, id, s1)));
}

template <int R, int MR, int PF>
void qmk512_u8(const uint8_t* const* wr, const QAct& a, int64_t m0, int64_t g0, int64_t g1, int64_t K, float* y,
               size_t ldy, const int* nc, float* vacc, bool first, bool last) {
  __m512 accv[R][MR];
  load_acc<R, MR>(accv, vacc, first);
  const uint8_t* xu[MR];
  for (int i = 0; i < MR; ++i) xu[i] = a.row(m0 + i).ux;
  auto unit = [&](int64_t u, int nb) MS_INLINE_LAMBDA {
#pragma GCC unroll 8
    for (int j = 0; j < R; ++j) {
      const uint8_t* p = wr[j] + u * 136;
      if constexpr (PF != kQPfOff)
        for (int off = 0; off < 136; off += 64) qprefetch<PF>(p + off);
      __m512i ua, ub;
      __m512 dw;
      q8_0_unit(p, nb, ua, ub, dw);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const uint8_t* x = xu[i] + 256 * u;
        __m512i v = _mm512_dpbusd_epi32(_mm512_load_si512(x + 128), ua, _mm512_load_si512(x));
        v = _mm512_dpbusd_epi32(v, ub, _mm512_load_si512(x + 64));
        accv[j][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_mul_ps(dw, _mm512_load_ps(x + 192)), accv[j][i]);
      }
    }
  };
  const int64_t nblk = K / 32, ue = (g1 + 1) / 2, full = std::min(ue, nblk / 4);
  for (int64_t u = g0 / 2; u < full; ++u) unit(u, 4);
  if (full < ue) unit(full, int(nblk - 4 * full));
  store_acc<R, MR>(accv, vacc, last, y + m0 * ldy, ldy, nc);
}

// K-quants (Q4_K, Q6_K): inside a 256-weight super-block the integer sub-block scales multiply exact integer sums
// and the float scales are applied once per super-block, as in llama.cpp's q4_K / q6_K x q8_K dot products:
// d * d_x * (sum_j sc_j sum_k u_k q_k - 32 sum_j sc_j bs_j for Q6_K) - dmin * d_x * sum_j m_j bs_j (Q4_K's mins; bs:
// the activations' 16-sums). Outputs are taken in pairs, which cuts the integer work per output: per 64-weight
// group, VPDPBUSD (unsigned codes x signed activations, 4 products a dword, |sum| <= 4 * 63 * 127 < 2^15) for each
// of the two outputs, VPACKSSDW of the two (exact: nothing saturates), and one VPDPWSSD by the 16-bit sub-block
// scales (two dwords into one) into one int32 vector holding both outputs: per 128-bit lane, dwords 0-1 the first
// output's ("A"), 2-3 the second's ("B"). A pair is two activation rows against one weight row or, for an odd last
// activation row, that row against two weight rows. The second term joins the pair too: Q6_K's offset by one more
// VPDPWSSD (32 x the scales against kx = -bs), Q4_K's mins in f32 (dmin * m_j times kx = -(d_x * bs_j)). Per
// super-block and pair: 8 VPDPBUSD + 4 VPACKSSDW + 4 (Q6_K 5) VPDPWSSD, one conversion, one multiply and one (Q4_K
// two) FMA into 8 f32 lanes per output; the earlier kernel took 4 VPMADDUBSW + 4 VPDPWSSD + a VPMADDWD + 2
// conversions + 2 FMAs and 4 scalar operations per output (1-thread A/B in engine/bench/bench_qlinear_ab.py).
// An output's 8 lane values do not depend on its partner or its half (the same exact integer sums, the same f32
// products and FMAs in the same order), and its final sum takes them in one fixed order (khsum): row m of an
// M-row call is still the 1-row call on that row, bit for bit. The int32 lanes are exact (per super-block below 2^22
// for Q4_K, 2^26 for Q6_K; converted to f32 exactly below 2^24, else to a relative 2^-24), so each output is
// "dequantize, f32 matmul" up to f32 rounding.

// The 4 groups' codes of one super-block (codes512's values, without its per-group index arithmetic).
template <int QT>
MS_INLINE void kcodes(const uint8_t* sb, __m512i* u) {
  const __m512i m4 = _mm512_set1_epi8(15);
  if constexpr (QT == kQ4_K) {
    for (int g = 0; g < 4; ++g) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 16 + 32 * g));
      u[g] = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 4), 1), m4);
    }
  } else {
    const __m512i m3 = _mm512_set1_epi8(3);
    for (int h = 0; h < 2; ++h) {
      const __m512i ql = _mm512_loadu_si512(sb + 64 * h);
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 128 + 32 * h));
      const __m512i h2 = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
      u[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, m4), _mm512_slli_epi16(_mm512_and_si512(h2, m3), 4));
      u[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                                     _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h2, 4), m3), 4));
    }
  }
}

// One weight row's super-block, unpacked: u the codes of each 64-weight group; sc per group the 16-bit sub-block
// scales in the pair layout (every word of 128-bit lane k: the scale of the sub-block holding weights 16k .. 16k+15
// of the group); d the f16 scale, broadcast; x the weight side of the second term in kq_side's layout (Q4_K: dword
// p = dmin * m of sub-block 2k + p % 2, f32; Q6_K: word 2p + h = 32 * the scale of sub-block 4k + 2 (p % 2) + h).
struct KRow {
  __m512i u[4], sc[4], x;
  __m512 d;
};

template <int QT>
MS_INLINE void kunpack(const uint8_t* sb, KRow& w) {
  kcodes<QT>(sb, w.u);
  if constexpr (QT == kQ4_K) {
    uint64_t sc, mn;
    q4k_scales_mins(sb, sc, mn);
    const __m512i s16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(int64_t(sc))));
    for (int g = 0; g < 4; ++g)
      w.sc[g] = _mm512_permutexvar_epi16(
          _mm512_inserti64x4(_mm512_set1_epi16(short(2 * g)), _mm256_set1_epi16(short(2 * g + 1)), 1), s16);
    const __m512i m32 = _mm512_castsi256_si512(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(mn))));
    const __m512i mi = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 1, 0, 1, 2, 3, 2, 3, 4, 5, 4, 5, 6, 7, 6, 7), m32);
    w.x = _mm512_castps_si512(_mm512_mul_ps(_mm512_cvtepi32_ps(mi), _mm512_set1_ps(f16_at(sb + 2))));
    w.d = _mm512_set1_ps(f16_at(sb));
  } else {
    const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 192)));
    const __m512i s512 = _mm512_castsi256_si512(s16);
    for (int g = 0; g < 4; ++g) {
      const __m512i idx = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_set_m128i(_mm_set1_epi16(short(4 * g + 1)), _mm_set1_epi16(short(4 * g)))),
          _mm256_set_m128i(_mm_set1_epi16(short(4 * g + 3)), _mm_set1_epi16(short(4 * g + 2))), 1);
      w.sc[g] = _mm512_permutexvar_epi16(idx, s512);
    }
    const __m512i xi = _mm512_set_epi16(15, 14, 13, 12, 15, 14, 13, 12, 11, 10, 9, 8, 11, 10, 9, 8, 7, 6, 5, 4, 7, 6, 5, 4,
                                        3, 2, 1, 0, 3, 2, 1, 0);  // word w: sub-block 4 (w / 8) + w % 4
    w.x = _mm512_permutexvar_epi16(xi, _mm512_castsi256_si512(_mm256_slli_epi16(s16, 5)));
    w.d = _mm512_set1_ps(f16_at(sb + 208));
  }
}

constexpr __mmask16 kPairB = 0xCCCC;  // the dwords of a pair's second output

// The exact integer sums of one super-block for a pair: codes ua x activations qa (A) and ub x qb (B), scaled by
// sc (the pair's sub-block scales), plus Q6_K's offset term x * kx.
template <int QT>
MS_INLINE __m512i kpair(const __m512i* ua, const __m512i* ub, const __m512i* sc, __m512i x, const int8_t* qa,
                        const int8_t* qb, __m512i kx) {
  __m512i v = _mm512_setzero_si512();
  for (int g = 0; g < 4; ++g) {
    const __m512i sa = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ua[g], _mm512_load_si512(qa + 64 * g));
    const __m512i sb = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ub[g], _mm512_load_si512(qb + 64 * g));
    v = _mm512_dpwssd_epi32(v, _mm512_packs_epi32(sa, sb), sc[g]);
  }
  if constexpr (QT == kQ6_K) v = _mm512_dpwssd_epi32(v, x, kx);
  return v;
}

// acc += v * (d * d_x) (scale: per lane), + Q4_K's mins (x * kx)
template <int QT>
MS_INLINE void kaccumulate(__m512& acc, __m512i v, __m512 scale, __m512i x, __m512i kx) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), scale, acc);
  if constexpr (QT == kQ4_K) acc = _mm512_fmadd_ps(_mm512_castsi512_ps(x), _mm512_castsi512_ps(kx), acc);
}

// The sum of a pair's first (second: B) output's 8 lanes, in one order for both.
MS_INLINE float khsum(__m512 v, bool second) {
  if (second) v = _mm512_permute_ps(v, 0x4E);  // dwords 2-3 of each 128-bit lane to 0-1
  const __m512 t = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
  const __m128 u = _mm_add_ps(_mm512_castps512_ps128(t), _mm512_extractf32x4_ps(t, 1));
  return _mm_cvtss_f32(_mm_add_ss(u, _mm_movehdup_ps(u)));
}

// R weight rows x MR activation rows over groups [g0, g1): pairs (j, 2p) + (j, 2p + 1), and for an odd MR
// (2jp, MR - 1) + (2jp + 1, MR - 1) (with R = 1 the one weight row twice: B is discarded). vacc: the pairs'
// vectors between K chunks.
template <int QT, int R, int MR, int PF>
void qmk512k_rm(const uint8_t* const* wr, const QAct& a, int64_t m0, int64_t g0, int64_t g1, float* y, size_t ldy,
                const int* nc, float* vacc, bool first, bool last) {
  constexpr int bytes = QT == kQ4_K ? 144 : 210;
  constexpr int NP = MR / 2, ODD = MR % 2, NW = (R + 1) / 2, NV = R * NP + ODD * NW;
  __m512 acc[NV];
  for (int v = 0; v < NV; ++v) acc[v] = first ? _mm512_setzero_ps() : _mm512_load_ps(vacc + 16 * v);
  QRow xr[MR];
  for (int i = 0; i < MR; ++i) xr[i] = a.row(m0 + i);
  for (int64_t s = g0 / 4; s < (g1 + 3) / 4; ++s) {
    __m512 dxp[NP + ODD];  // per activation pair: d_x of A's and B's rows
    __m512i kxp[NP + ODD];
    for (int p = 0; p < NP; ++p) {
      const QRow &x0 = xr[2 * p], &x1 = xr[2 * p + 1];
      dxp[p] = _mm512_mask_blend_ps(kPairB, _mm512_set1_ps(x0.dl[64 * s]), _mm512_set1_ps(x1.dl[64 * s]));
      kxp[p] = _mm512_mask_blend_epi32(kPairB, _mm512_load_si512(x0.kx + 64 * s), _mm512_load_si512(x1.kx + 64 * s));
    }
    if constexpr (ODD != 0) {
      dxp[NP] = _mm512_set1_ps(xr[MR - 1].dl[64 * s]);
      kxp[NP] = _mm512_load_si512(xr[MR - 1].kx + 64 * s);
    }
    auto unpack = [&](int j, KRow& w) {
      const uint8_t* sb = wr[j] + s * bytes;
      if constexpr (PF != kQPfOff)
        for (int off = 0; off < bytes; off += 64) qprefetch<PF>(sb + off);
      kunpack<QT>(sb, w);
    };
    auto row_pairs = [&](const KRow& w, int j) {
      for (int p = 0; p < NP; ++p) {
        const __m512i v = kpair<QT>(w.u, w.u, w.sc, w.x, xr[2 * p].q + 256 * s, xr[2 * p + 1].q + 256 * s, kxp[p]);
        kaccumulate<QT>(acc[j * NP + p], v, _mm512_mul_ps(w.d, dxp[p]), w.x, kxp[p]);
      }
    };
    if constexpr (ODD == 0) {
      for (int j = 0; j < R; ++j) {
        KRow w;
        unpack(j, w);
        row_pairs(w, j);
      }
    } else {
      for (int jp = 0; jp < NW; ++jp) {
        KRow w0, w1;
        unpack(2 * jp, w0);
        row_pairs(w0, 2 * jp);
        if (2 * jp + 1 < R) {
          unpack(2 * jp + 1, w1);
          row_pairs(w1, 2 * jp + 1);
        } else {
          w1 = w0;
        }
        __m512i sc[4];
        for (int g = 0; g < 4; ++g) sc[g] = _mm512_mask_blend_epi32(kPairB, w0.sc[g], w1.sc[g]);
        const __m512i x = _mm512_mask_blend_epi32(kPairB, w0.x, w1.x);
        const int8_t* q = xr[MR - 1].q + 256 * s;
        const __m512i v = kpair<QT>(w0.u, w1.u, sc, x, q, q, kxp[NP]);
        kaccumulate<QT>(acc[R * NP + jp], v, _mm512_mul_ps(_mm512_mask_blend_ps(kPairB, w0.d, w1.d), dxp[NP]), x,
                        kxp[NP]);
      }
    }
  }
  for (int v = 0; v < NV; ++v) {
    if (!last) {
      _mm512_store_ps(vacc + 16 * v, acc[v]);
      continue;
    }
    const bool rows = v < R * NP;
    const int j0 = rows ? v / NP : 2 * (v - R * NP), i0 = rows ? 2 * (v % NP) : MR - 1;
    const int j1 = rows ? j0 : j0 + 1, i1 = rows ? i0 + 1 : i0;
    y[(m0 + i0) * ldy + nc[j0]] = khsum(acc[v], false);
    if (j1 < R) y[(m0 + i1) * ldy + nc[j1]] = khsum(acc[v], true);
  }
}

template <int QT, int R, int MR, int PF>
MS_INLINE void qmk512_call(const uint8_t* const* wr, const QAct& a, int64_t m0, int64_t g0, int64_t g1, int64_t K,
                           float* y, size_t ldy, const int* nc, float* vacc, bool first, bool last) {
  if constexpr (QT == kQ4_K || QT == kQ6_K) qmk512k_rm<QT, R, MR, PF>(wr, a, m0, g0, g1, y, ldy, nc, vacc, first, last);
  else if constexpr (QT == kQ4_0) qmk512_u<R, MR, PF>(wr, a, m0, g0, g1, K, y, ldy, nc, vacc, first, last);
  else qmk512_u8<R, MR, PF>(wr, a, m0, g0, g1, K, y, ldy, nc, vacc, first, last);
}

template <int QT, int R, int PF>
void qmk512_mr(int mr, const uint8_t* const* wr, const QAct& a, int64_t m0, int64_t g0, int64_t g1, int64_t K, float* y,
               size_t ldy, const int* nc, float* vacc, bool first, bool last) {
  if constexpr (QT == kQ8_0) {  // at most 4 rows a call (kQGroup)
    switch (mr) {
      case 1: return qmk512_call<QT, R, 1, PF>(wr, a, m0, g0, g1, K, y, ldy, nc, vacc, first, last);
      case 2: return qmk512_call<QT, R, 2, PF>(wr, a, m0, g0, g1, K, y, ldy, nc, vacc, first, last);
      case 3: return qmk512_call<QT, R, 3, PF>(wr, a, m0, g0, g1, K, y, ldy, nc, vacc, first, last);
      default: return qmk512_call<QT, R, 4, PF>(wr, a, m0, g0, g1, K, y, ldy, nc, vacc, first, last);
    }
  }
  switch (mr) {
    case 1: return qmk512_call<QT, R, 1, PF>(wr, a, m0, g0, g1, K, y, ldy, nc, vacc, first, last);
    case 2: return qmk512_call<QT, R, 2, PF>(wr, a, m0, g0, g1, K, y, ldy, nc, vacc, first, last);
    case 3: return qmk512_call<QT, R, 3, PF>(wr, a, m0, g0, g1, K, y, ldy, nc, vacc, first, last);
    case 4: return qmk512_call<QT, R, 4, PF>(wr, a, m0, g0, g1, K, y, ldy, nc, vacc, first, last);
    case 5: return qmk512_call<QT, R, 5, PF>(wr, a, m0, g0, g1, K, y, ldy, nc, vacc, first, last);
    case 6: return qmk512_call<QT, R, 6, PF>(wr, a, m0, g0, g1, K, y, ldy, nc, vacc, first, last);
    case 7: return qmk512_call<QT, R, 7, PF>(wr, a, m0, g0, g1, K, y, ldy, nc, vacc, first, last);
    default: return qmk512_call<QT, R, 8, PF>(wr, a, m0, g0, g1, K, y, ldy, nc, vacc, first, last);
  }
}

// Weight streams (rows per micro-kernel call) for mr activation rows: R x mr accumulators in registers.
constexpr int kQRBig = MS_QR_SMALL_M;  // mr 1..2
// (2 instead of 4 at 3-4 rows: the K-quants no faster, 1-thread A/B 0.94-1.01x: compute-, not register-bound)
inline int qstreams(int mr) { return mr <= 2 ? kQRBig : mr <= 4 ? 4 : 2; }

template <int QT>
void qmk512_any(int pf, int r, int mr, const uint8_t* const* wr, const QAct& a, int64_t m0, int64_t g0, int64_t g1,
                int64_t K, float* y, size_t ldy, const int* nc, float* vacc, bool first, bool last) {
#define MS_QMK_R(RR)                                                                                 \
  case RR:                                                                                           \
    if (pf == kQPfL1) return qmk512_mr<QT, RR, kQPfL1>(mr, wr, a, m0, g0, g1, K, y, ldy, nc, vacc, first, last); \
    if (pf == kQPfL2) return qmk512_mr<QT, RR, kQPfL2>(mr, wr, a, m0, g0, g1, K, y, ldy, nc, vacc, first, last); \
    return qmk512_mr<QT, RR, kQPfOff>(mr, wr, a, m0, g0, g1, K, y, ldy, nc, vacc, first, last);
  switch (r) {
    MS_QMK_R(kQRBig)
#if MS_QR_SMALL_M != 4
    MS_QMK_R(4)
#endif
#if MS_QR_SMALL_M != 2
    MS_QMK_R(2)
#endif
    default: return qmk512_mr<QT, 1, kQPfOff>(mr, wr, a, m0, g0, g1, K, y, ldy, nc, vacc, first, last);
  }
#undef MS_QMK_R
}

// y[m, n] for n in [n0, n1), all M rows, on the AVX-512 path. Up to kQOnePass rows: one pass over the weights,
// every weight row unpacked once for all rows, prefetched. More rows: blocks of R weight rows x kQKC groups (in
// L1) taken by every group of kQGroup rows in turn, prefetched by the first. The K-quants' integer sums leave
// registers for 8 rows x 2 weight rows; Q8_0 measured faster in 4-row groups x 4 weight rows (its per-row float
// work is larger: 1-thread A/B at 14336 x 4096, m = 8, weights from memory: 8 x 2 0.82x of 4 x 4). Q4_0 (qmk512_u:
// one vector per activation row and 4 weight rows) takes 8 rows x 4 weight rows.
template <int QT>
constexpr int kQOnePass = QT == kQ8_0 ? 4 : 8;
template <int QT>
constexpr int kQGroup = QT == kQ8_0 ? 4 : 8;

template <int QT>
void qgemm_range_512(const QAct& a, int64_t M, int64_t K, const uint8_t* w, size_t row_bytes, int64_t n0, int64_t n1,
                     float* y, size_t ldy, int64_t kc, int64_t kmb) {
  const int64_t G = (K + 63) / 64;
  const int pf = g_qprefetch.load(std::memory_order_relaxed);  // kQPrefetch
  float* vacc = static_cast<float*>(grow_bytes(t_qvacc, size_t((kmb + 3) / 4 * 8 * 8 * 16 * 4) + 64));
  vacc += (16 - reinterpret_cast<uintptr_t>(vacc) / 4 % 16) % 16;
  constexpr int MG = kQGroup<QT>;
  auto pass = [&](int R, int64_t mb, int64_t me, int64_t chunk, int mg, auto&& for_rows) {
    for_rows([&](int r, const int* nc) {
      const uint8_t* wr[8];
      for (int j = 0; j < r; ++j) wr[j] = w + size_t(nc[j]) * row_bytes;
      for (int64_t g0 = 0; g0 < G; g0 += chunk) {
        const int64_t g1 = std::min(G, g0 + chunk);
        for (int64_t m = mb; m < me; m += mg)
          qmk512_any<QT>(m == mb && r == R ? pf : int(kQPfOff), r, int(std::min<int64_t>(mg, me - m)), wr, a, m, g0, g1, K, y, ldy, nc,
                         vacc + (m - mb) / mg * (8 * 8 * 16), g0 == 0, g1 == G);
      }
    });
  };
  if (M <= kQOnePass<QT>) {
    const int R = QT == kQ4_0 ? 4 : qstreams(int(M));
    auto rows = [&](auto&& block) {
      if (R == kQRBig) for_blocks<kQRBig>(n0, n1, block);
      else if (R == 4) for_blocks<4>(n0, n1, block);
      else for_blocks<2>(n0, n1, block);
    };
    return pass(R, 0, M, G, int(M), rows);
  }
  constexpr int R = MG == 8 && QT != kQ4_0 ? 2 : 4;
  for (int64_t mb = 0; mb < M; mb += kmb)
    pass(R, mb, std::min(M, mb + kmb), kc, MG, [&](auto&& block) { for_blocks<R>(n0, n1, block); });
}

// ---- K-quants and Q8_0 at many activation rows: weight codes broadcast, 16 rows per vector (kgemm) ------------
// Why: at 4-64 rows qmk512k_rm is compute-bound on Zen 5 (no AMX; 0.17-0.25 TOP/s per core measured). Per super-block
// and output pair it issues 8 VPDPBUSD for 4 VPACKSSDW + 4 (Q6_K 5) VPDPWSSD + a conversion, a multiply and one or two
// FMAs (~12 operations of overhead for 8 useful ones), each weight row's super-block unpacked in registers for only
// MR / 2 pairs (8 rows: 4), its sub-block scales permuted into the pair layout, and 4-8 horizontal sums per pair at the
// end. Here a call of at least kKTileMin rows takes another layout: the activations of 16 rows as one vector per 4
// consecutive k (dword r: row r's 4 int8 q; kpanel_build, once per call), each weight row's super-block unpacked once
// per K chunk into its codes (u8, memory) and float sub-block scales (KW), shared by every tile of 16 rows. Per 4 codes
// one broadcast dword (a load) x the tile's vector, VPDPBUSD (codes unsigned, q signed) into one int32 lane per row;
// per sub-block (Q4_K 32 weights: 8 VPDPBUSD; Q6_K 16: 4) the exact int32 sum is converted and multiplied into the
// super-block's f32 sum by d * sc (VCVTDQ2PS + FMA), Q6_K's offset (-32 x the sub-block's q sum) the chain's start
// value and Q4_K's mins 4 VPDPWSSD of (m_2i, m_2i+1) against the rows' 32-sums per super-block; then x d_x into the
// output (one FMA per super-block). Per 256 weights x 16 rows: 64 VPDPBUSD + 16 (Q6_K 32) + 7 (Q6_K 1) other
// operations, no pair packing and no horizontal sums (lane r is row r's output). Q8_0 likewise per 32-weight block
// (kgemm8_tiles; its pair kernel, qmk512_u8, ran at ~0.12 TOP/s per core from 16 rows).
// Rounding: every sub-block's integer sum is exact (|sum| < 2^17), converted exactly, then f32 products and sums in a
// fixed order per lane (sub-blocks in K order into the super-block's sum, super-blocks in K order into the output),
// whatever the row count, the tile a row lands in or the K chunking: a row's output is the same bits in every call
// of >= 9 rows (8-row K-quant calls, two lanes a row (kseg), are a class of their own); against a call on the pair
// kernels (fewer rows) it differs by f32 summation order only (both within the reference's f32 tolerance).
constexpr int kKT = 16;        // activation rows per tile (one vector)

// bytes per tile and super-block in the panel: 64 vectors of 4 q per row, the side (Q4_K: 4 vectors of the rows'
// (bs32[2i], bs32[2i+1]) int16 pairs; Q6_K: 16 vectors of -32 * the rows' 16-sums, int32), the rows' d_x
template <int QT>
constexpr int kKSide = QT == kQ4_K ? 256 : 1024;
// Q8_0 (kgemm8_tiles) takes units of one 32-weight block: 8 vectors of 4 q per row, -128 * the rows' 32-sums (int32,
// the start of the block's chain: the weights are made unsigned, w + 128), the rows' d_x: 640 bytes.
template <int QT>
constexpr int kKSB = QT == kQ8_0 ? 640 : 4096 + kKSide<QT> + 64;  // panel bytes per tile and unit
template <int QT>
constexpr int kKUnit = QT == kQ8_0 ? 32 : 256;  // weights per unit

// Segments: a K-quant call of 8 rows fills a vector with 8 rows, each in S = 2 lanes: lane r * S + s takes row r's
// products of segment s of every super-block (weights 256 / S * s .. 256 / S * (s + 1) - 1), its weight codes, scales
// and mins broadcast S at a time (VPBROADCASTQ: a load, as the dword broadcast), and the S lanes of a row are summed
// once at the end. Rows per tile: kKT / S. 1-thread A/B against the pair kernels (bench_qlinear_ab, cached [14336 x
// 4096]; Q4_K / Q6_K): 8 rows 1.39-1.46x / 1.14-1.24x, but 6 rows 1.01x / 1.01x, 7 rows 0.95x / 0.89x, 5 rows 0.70x /
// 0.65x; S = 4 at 3-4 rows 0.74-0.83x / 0.59-0.62x: at one tile the weight unpacking (kw_unpack: codes, the
// segment-interleaving permutes, scales), per weight row and super-block, outweighs the tile's 16-32 VPDPBUSD.
inline int kseg(int qt, int64_t M) { return qt == kQ8_0 || M > 8 ? 1 : 2; }

inline int64_t kpanel_bytes(int qt, int64_t M, int64_t K) {
  const int64_t sbb = qt == kQ4_K ? kKSB<kQ4_K> : qt == kQ6_K ? kKSB<kQ6_K> : kKSB<kQ8_0>;
  const int64_t tr = kKT / kseg(qt, M);
  return (M + tr - 1) / tr * (K / (qt == kQ8_0 ? 32 : 256)) * sbb;
}

// The panel of a call (layout above; rows past M zero), tile t's super-block s at p + (t * nsb + s) * kKSB.
template <int QT, int S>
void kpanel_build_t(const QAct& a, int64_t M, int64_t K, uint8_t* p) {
  constexpr int TR = kKT / S;
  const int64_t nsb = K / kKUnit<QT>, T = (M + TR - 1) / TR;
  std::memset(p, 0, size_t(kpanel_bytes(QT, M, K)));
  for (int64_t t = 0; t < T; ++t)
    for (int r = 0; r < TR && t * TR + r < M; ++r) {
      const QRow x = a.row(t * TR + r);
      if constexpr (QT == kQ8_0) {
        for (int64_t b = 0; b < nsb; ++b) {
          uint8_t* u = p + (t * nsb + b) * kKSB<QT>;
          for (int k4 = 0; k4 < 8; ++k4) std::memcpy(u + 64 * k4 + 4 * r, x.q + 32 * b + 4 * k4, 4);
          const int32_t off = -128 * (int32_t(x.bs[2 * b]) + x.bs[2 * b + 1]);
          std::memcpy(u + 512 + 4 * r, &off, 4);
          std::memcpy(u + 576 + 4 * r, x.dl + 8 * b, 4);
        }
        continue;
      }
      for (int64_t s = 0; s < nsb; ++s) {
        uint8_t* b = p + (t * nsb + s) * kKSB<QT>;
        const int16_t* bs = x.bs + 16 * s;
        uint8_t* side = b + 4096;
        for (int g = 0; g < S; ++g) {  // segment g: lane r * S + g of vector i (i: its quad, sub-block or pair step)
          const int lane = 4 * (r * S + g);
          for (int i = 0; i < 64 / S; ++i) std::memcpy(b + 64 * i + lane, x.q + 256 * s + 4 * (64 / S * g + i), 4);
          if constexpr (QT == kQ4_K) {
            for (int i = 0; i < 4 / S; ++i) {
              const int pr = 4 / S * g + i;
              const int16_t v[2] = {int16_t(bs[4 * pr] + bs[4 * pr + 1]), int16_t(bs[4 * pr + 2] + bs[4 * pr + 3])};
              std::memcpy(side + 64 * i + lane, v, 4);
            }
          } else {
            for (int i = 0; i < 16 / S; ++i) {
              const int32_t v = -32 * int32_t(bs[16 / S * g + i]);
              std::memcpy(side + 64 * i + lane, &v, 4);
            }
          }
          std::memcpy(side + kKSide<QT> + lane, x.dl + 64 * s, 4);
        }
      }
    }
}

template <int QT>
void kpanel_build_s(const QAct& a, int64_t M, int64_t K, uint8_t* p) {
  if (kseg(QT, M) == 1) return kpanel_build_t<QT, 1>(a, M, K, p);
  kpanel_build_t<QT, 2>(a, M, K, p);
}

void kpanel_build(int qt, const QAct& a, int64_t M, int64_t K, uint8_t* p) {
  if (qt == kQ4_K) kpanel_build_s<kQ4_K>(a, M, K, p);
  else if (qt == kQ6_K) kpanel_build_s<kQ6_K>(a, M, K, p);
  else kpanel_build_t<kQ8_0, 1>(a, M, K, p);
}

// One weight row's super-block for kgemm: codes in k order (Q4_K 0..15, Q6_K 0..63), d * sc per sub-block (Q4_K 8,
// Q6_K 16), Q4_K's mins as (m_2i, m_2i+1) int16 pairs and -dmin.
struct alignas(64) KW {
  uint8_t u[256];
  float dsc[16];
  int32_t mn[4];
  float ndmin;
};

// With S segments (kseg) the codes, scales and min pairs are stored segment-interleaved: element i * S + g is
// segment g's i-th (dword of 4 codes, sub-block scale, min pair), so that S of them broadcast together.
template <int QT, int S>
MS_INLINE void kw_unpack(const uint8_t* sb, KW& w) {
  __m512i u[4];
  kcodes<QT>(sb, u);
  if constexpr (S == 2) {  // segments: dwords 0..31 (u0, u1) and 32..63 (u2, u3)
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    const __m512i o[4] = {_mm512_permutex2var_epi32(u[0], lo, u[2]), _mm512_permutex2var_epi32(u[0], hi, u[2]),
                          _mm512_permutex2var_epi32(u[1], lo, u[3]), _mm512_permutex2var_epi32(u[1], hi, u[3])};
    for (int g = 0; g < 4; ++g) u[g] = o[g];
  }
  for (int g = 0; g < 4; ++g) _mm512_store_si512(w.u + 64 * g, u[g]);
  if constexpr (QT == kQ4_K) {
    uint64_t sc, mn;
    q4k_scales_mins(sb, sc, mn);
    const __m256 d = _mm256_set1_ps(f16_at(sb));
    __m256 ds = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(sc)))));
    __m128i m = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(int64_t(mn)));
    if constexpr (S == 2) {  // sub-blocks 0..3 | 4..7; pairs 0, 1 | 2, 3
      ds = _mm256_permutevar8x32_ps(ds, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      m = _mm_shuffle_epi32(m, 0xD8);
    }
    _mm256_store_ps(w.dsc, ds);
    _mm_store_si128(reinterpret_cast<__m128i*>(w.mn), m);
    w.ndmin = -f16_at(sb + 2);
  } else {
    const __m512i s = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 192)));
    __m512 ds = _mm512_mul_ps(_mm512_set1_ps(f16_at(sb + 208)), _mm512_cvtepi32_ps(s));
    if constexpr (S == 2) ds = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15), ds);
    _mm512_store_ps(w.dsc, ds);
  }
}

// S consecutive dwords (S = 1, 2) broadcast to every S-lane group of a vector (one load).
template <int S>
MS_INLINE __m512i kbcast(const void* p) {
  static_assert(S == 1 || S == 2, "segments: 1 or 2");
  if constexpr (S == 1) {
    int32_t c;
    std::memcpy(&c, p, 4);
    return _mm512_set1_epi32(c);
  } else {
    int64_t c;
    std::memcpy(&c, p, 8);
    return _mm512_set1_epi64(c);
  }
}

// kgemm's output sums between K chunks: v(t, j) for tile t and weight row j (zero at the first chunk).
template <int NT, int NW>
MS_INLINE void kgemm_sums(__m512 (&tot)[NT][NW], const float* v, int64_t vt, int64_t vj, bool first) {
  for (int t = 0; t < NT; ++t)
    for (int j = 0; j < NW; ++j) tot[t][j] = first ? _mm512_setzero_ps() : _mm512_load_ps(v + t * vt + j * vj);
}

template <int NT, int NW>
MS_INLINE void kgemm_sums_out(const __m512 (&tot)[NT][NW], float* v, int64_t vt, int64_t vj) {
  for (int t = 0; t < NT; ++t)
    for (int j = 0; j < NW; ++j) _mm512_store_ps(v + t * vt + j * vj, tot[t][j]);
}

// NT tiles x NW weight rows over nsb super-blocks: tp[t] the tiles' panel at the chunk's first super-block, wp[j] the
// rows' unpacked super-blocks; v(t, j) the 16 output sums (rows of tile t, weight row j) between chunks.
template <int QT, int NT, int NW, int S>
MS_INLINE void kgemm_tiles(const uint8_t* const* tp, const KW* const* wp, int64_t nsb, float* v, int64_t vt,
                           int64_t vj, bool first) {
  constexpr int SUB = QT == kQ4_K ? 32 : 16, NSUB = 256 / SUB / S, QPS = SUB / 4;  // NSUB: sub-block steps
  __m512 tot[NT][NW];
  kgemm_sums(tot, v, vt, vj, first);
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* x[NT];
    for (int t = 0; t < NT; ++t) x[t] = tp[t] + s * kKSB<QT>;
    const KW* w[NW];
    for (int j = 0; j < NW; ++j) w[j] = wp[j] + s;
    __m512 sbs[NT][NW];
#pragma GCC unroll 16
    for (int b = 0; b < NSUB; ++b) {
      __m512i acc[NT][NW];
      for (int t = 0; t < NT; ++t) {
        const __m512i a0 = QT == kQ4_K ? _mm512_setzero_si512() : _mm512_load_si512(x[t] + 4096 + 64 * b);
        for (int j = 0; j < NW; ++j) acc[t][j] = a0;
      }
#pragma GCC unroll 8
      for (int q = 0; q < QPS; ++q) {
        const int k4 = b * QPS + q;
        __m512i xv[NT];
        for (int t = 0; t < NT; ++t) xv[t] = _mm512_load_si512(x[t] + 64 * k4);
        for (int j = 0; j < NW; ++j) {
          const __m512i wb = kbcast<S>(w[j]->u + 4 * S * k4);
          for (int t = 0; t < NT; ++t) acc[t][j] = _mm512_dpbusd_epi32(acc[t][j], wb, xv[t]);
        }
      }
      for (int j = 0; j < NW; ++j) {
        const __m512 ds = _mm512_castsi512_ps(kbcast<S>(w[j]->dsc + S * b));
        for (int t = 0; t < NT; ++t) {
          const __m512 f = _mm512_cvtepi32_ps(acc[t][j]);
          sbs[t][j] = b == 0 ? _mm512_mul_ps(f, ds) : _mm512_fmadd_ps(f, ds, sbs[t][j]);
        }
      }
    }
    if constexpr (QT == kQ4_K) {
      for (int j = 0; j < NW; ++j)
        for (int t = 0; t < NT; ++t) {
          __m512i m = _mm512_setzero_si512();
          for (int i = 0; i < 4 / S; ++i)
            m = _mm512_dpwssd_epi32(m, kbcast<S>(w[j]->mn + S * i), _mm512_load_si512(x[t] + 4096 + 64 * i));
          sbs[t][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(m), _mm512_set1_ps(w[j]->ndmin), sbs[t][j]);
        }
    }
    for (int t = 0; t < NT; ++t) {
      const __m512 dx = _mm512_load_ps(x[t] + 4096 + kKSide<QT>);
      for (int j = 0; j < NW; ++j) tot[t][j] = _mm512_fmadd_ps(sbs[t][j], dx, tot[t][j]);
    }
  }
  kgemm_sums_out(tot, v, vt, vj);
}

// One weight row's Q8_0 block for kgemm8_tiles: the codes made unsigned (w + 128), d.
struct alignas(64) KW8 {
  uint8_t u[32];
  float d;
};

MS_INLINE void kw8_unpack(const uint8_t* b, KW8& w) {
  const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
  _mm256_store_si256(reinterpret_cast<__m256i*>(w.u), _mm256_xor_si256(q, _mm256_set1_epi8(char(0x80))));
  w.d = f16_at(b);
}

// kgemm_tiles for Q8_0, per 32-weight block: 8 VPDPBUSD from -128 * the rows' 32-sum (exact: |sum| < 2^20), one
// conversion, d_w x the rows' d_x (f16 x f16: exact in f32) and one FMA into the output.
template <int NT, int NW>
MS_INLINE void kgemm8_tiles(const uint8_t* const* tp, const KW8* const* wp, int64_t nb, float* v, int64_t vt,
                            int64_t vj, bool first) {
  __m512 tot[NT][NW];
  kgemm_sums(tot, v, vt, vj, first);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* x[NT];
    for (int t = 0; t < NT; ++t) x[t] = tp[t] + b * kKSB<kQ8_0>;
    const KW8* w[NW];
    for (int j = 0; j < NW; ++j) w[j] = wp[j] + b;
    __m512i acc[NT][NW];
    for (int t = 0; t < NT; ++t) {
      const __m512i a0 = _mm512_load_si512(x[t] + 512);
      for (int j = 0; j < NW; ++j) acc[t][j] = a0;
    }
#pragma GCC unroll 8
    for (int q = 0; q < 8; ++q) {
      __m512i xv[NT];
      for (int t = 0; t < NT; ++t) xv[t] = _mm512_load_si512(x[t] + 64 * q);
      for (int j = 0; j < NW; ++j) {
        int32_t c;
        std::memcpy(&c, w[j]->u + 4 * q, 4);
        const __m512i wb = _mm512_set1_epi32(c);
        for (int t = 0; t < NT; ++t) acc[t][j] = _mm512_dpbusd_epi32(acc[t][j], wb, xv[t]);
      }
    }
    for (int t = 0; t < NT; ++t) {
      const __m512 dx = _mm512_load_ps(x[t] + 576);
      for (int j = 0; j < NW; ++j)
        tot[t][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[t][j]), _mm512_mul_ps(dx, _mm512_set1_ps(w[j]->d)), tot[t][j]);
    }
  }
  kgemm_sums_out(tot, v, vt, vj);
}

thread_local std::vector<float> t_kw, t_kv;  // kgemm's unpacked weight rows and output sums

// y[m, n] for n in [n0, n1), M rows of at most kKTB tiles (panel: their first tile). K in chunks whose panel (all
// tiles) stays in L2; per chunk, blocks of 8 weight rows unpacked once (the next block prefetched) and taken by every
// tile, 2 tiles x 4 rows (1 x 8 for a last odd tile) a kernel call; the sums kept in v [n][tile][16] between chunks,
// written to y at the end.
template <int QT, int S>
void kgemm_rows(const uint8_t* panel, int64_t M, int64_t K, const uint8_t* w, size_t row_bytes, int64_t n0,
                int64_t n1, float* y, size_t ldy) {
  using W = typename std::conditional<QT == kQ8_0, KW8, KW>::type;
  constexpr int bytes = QT == kQ4_K ? 144 : QT == kQ6_K ? 210 : 34, NB = 8, SB = kKSB<QT>, TR = kKT / S;
  const int64_t nsb = K / kKUnit<QT>, T = (M + TR - 1) / TR, N = n1 - n0;
  const int64_t kc = std::max<int64_t>(1, std::min<int64_t>(nsb, (384 << 10) / (T * SB)));
  W* kw = static_cast<W*>(grow_bytes(t_kw, size_t(NB * kc) * sizeof(W) + 64));
  kw = reinterpret_cast<W*>(reinterpret_cast<uintptr_t>(kw) + (64 - reinterpret_cast<uintptr_t>(kw) % 64) % 64);
  float* v = static_cast<float*>(grow_bytes(t_kv, size_t((N + NB) * T * kKT) * 4 + 64));
  v += (16 - reinterpret_cast<uintptr_t>(v) / 4 % 16) % 16;
  const int64_t vj = T * kKT;  // floats from one weight row's sums to the next's
  auto tiles = [&](auto nt, auto nw, const uint8_t* const* tp, const W* const* wp, int64_t cn, float* vv, bool first) {
    if constexpr (QT == kQ8_0) kgemm8_tiles<decltype(nt)::value, decltype(nw)::value>(tp, wp, cn, vv, kKT, vj, first);
    else kgemm_tiles<QT, decltype(nt)::value, decltype(nw)::value, S>(tp, wp, cn, vv, kKT, vj, first);
  };
  using I1 = std::integral_constant<int, 1>;
  using I2 = std::integral_constant<int, 2>;
  using I4 = std::integral_constant<int, 4>;
  using I8 = std::integral_constant<int, 8>;
  for (int64_t c0 = 0; c0 < nsb; c0 += kc) {
    const int64_t c1 = std::min(nsb, c0 + kc), cn = c1 - c0;
    for (int64_t n = n0; n < n1; n += NB) {
      const int r = int(std::min<int64_t>(NB, n1 - n));
      for (int j = 0; j < r; ++j) {
        const uint8_t* row = w + size_t(n + j) * row_bytes + c0 * bytes;
        for (int64_t s = 0; s < cn; ++s) {
          if constexpr (QT == kQ8_0) kw8_unpack(row + s * bytes, kw[j * kc + s]);
          else kw_unpack<QT, S>(row + s * bytes, kw[j * kc + s]);
        }
        if (n + NB + j < n1)  // the next block's row, this chunk
          for (int64_t off = 0; off < cn * bytes; off += 64)
            _mm_prefetch(reinterpret_cast<const char*>(row + NB * row_bytes + off), _MM_HINT_T0);
      }
      const W* wp[NB];
      for (int j = 0; j < NB; ++j) wp[j] = kw + (j < r ? j : 0) * kc;  // rows past r: row 0 again, sums dropped
      float* vn = v + (n - n0) * vj;
      int64_t t = 0;
      for (; t + 2 <= T; t += 2) {
        const uint8_t* tp[2] = {panel + (t * nsb + c0) * SB, panel + ((t + 1) * nsb + c0) * SB};
        tiles(I2(), I4(), tp, wp, cn, vn + t * kKT, c0 == 0);
        tiles(I2(), I4(), tp, wp + 4, cn, vn + 4 * vj + t * kKT, c0 == 0);
      }
      if (t < T) {
        const uint8_t* tp[1] = {panel + (t * nsb + c0) * SB};
        tiles(I1(), I8(), tp, wp, cn, vn + t * kKT, c0 == 0);
      }
    }
  }
  for (int64_t m = 0; m < M; ++m) {  // row m: lanes S (m % TR) .. + S - 1 of its tile, summed pairwise
    const float* vm = v + (m / TR) * kKT + S * (m % TR);
    for (int64_t n = 0; n < N; ++n) {
      const float* l = vm + n * vj;
      y[m * int64_t(ldy) + n0 + n] = S == 1 ? l[0] : l[0] + l[1];
    }
  }
}

// Tiles per pass over the weights: bounds the sums kept between K chunks ((n1 - n0) x 8 x 16 floats a thread, 3.5 MiB
// at 7168 columns) and the panel chunk's share of L2; calls of more rows read and unpack the weights once per pass.
constexpr int64_t kKTB = 8;

template <int QT, int S>
void kgemm_range(const uint8_t* panel, int64_t M, int64_t K, const uint8_t* w, size_t row_bytes, int64_t n0,
                 int64_t n1, float* y, size_t ldy) {
  const int64_t tr = kKT / S, per = kKTB * tr, tile_bytes = K / kKUnit<QT> * kKSB<QT>;
  for (int64_t m0 = 0; m0 < M; m0 += per)
    kgemm_rows<QT, S>(panel + m0 / tr * tile_bytes, std::min(per, M - m0), K, w, row_bytes, n0, n1, y + m0 * ldy, ldy);
}

void kgemm_range_any(int qt, const uint8_t* panel, int64_t M, int64_t K, const uint8_t* w, size_t row_bytes,
                     int64_t n0, int64_t n1, float* y, size_t ldy) {
  const int S = kseg(qt, M);
  auto go = [&](auto qtc) {
    constexpr int QT = decltype(qtc)::value;
    if (S == 1) return kgemm_range<QT, 1>(panel, M, K, w, row_bytes, n0, n1, y, ldy);
    if constexpr (QT != kQ8_0) kgemm_range<QT, 2>(panel, M, K, w, row_bytes, n0, n1, y, ldy);
  };
  if (qt == kQ4_K) go(std::integral_constant<int, kQ4_K>());
  else if (qt == kQ6_K) go(std::integral_constant<int, kQ6_K>());
  else go(std::integral_constant<int, kQ8_0>());
}

void qgemm_range_avx512(int qt, const QAct& a, int64_t M, int64_t K, const uint8_t* w, size_t row_bytes, int64_t n0,
                        int64_t n1, float* y, size_t ldy, int64_t kc, int64_t kmb) {
  switch (qt) {
    case kQ8_0: return qgemm_range_512<kQ8_0>(a, M, K, w, row_bytes, n0, n1, y, ldy, kc, kmb);
    case kQ4_0: return qgemm_range_512<kQ4_0>(a, M, K, w, row_bytes, n0, n1, y, ldy, kc, kmb);
    case kQ4_K: return qgemm_range_512<kQ4_K>(a, M, K, w, row_bytes, n0, n1, y, ldy, kc, kmb);
    default: return qgemm_range_512<kQ6_K>(a, M, K, w, row_bytes, n0, n1, y, ldy, kc, kmb);
  }
}

#pragma GCC pop_options
#endif  // MS_X86

constexpr int64_t kQKC = 32;  // groups of 64 weights per K chunk when several activation-row passes share it

// y[m, n] for n in [n0, n1), all M rows, weights w [N, row_bytes] of type qt.
void qgemm_range_vec(int isa, int qt, const QAct& a, int64_t M, int64_t K, const uint8_t* w, size_t row_bytes,
                     int64_t n0, int64_t n1, float* y, size_t ldy) {
  const int64_t G = (K + 63) / 64;
  const int64_t kc = M > kQMR ? kQKC : G;
#if MS_X86
  if (isa >= kAvx512Bf16) return qgemm_range_avx512(qt, a, M, K, w, row_bytes, n0, n1, y, ldy, kQKC, kMB);
#endif
  auto mk = [&](int r, const uint8_t* const* wr, int64_t m0, int mr, int64_t g0, int64_t g1, const int* nc, bool acc) {
#if MS_X86
    if (isa == kAvx2) return qmk_avx2(qt, r, wr, a, m0, mr, g0, g1, K, y, ldy, nc, acc);
#endif
    (void)isa;
    qmk_scalar(qt, r, wr, a, m0, mr, g0, g1, K, y, ldy, nc, acc);
  };
  for (int64_t mb = 0; mb < M; mb += kMB) {
    const int64_t me = std::min(M, mb + kMB);
    for_blocks<kQR>(n0, n1, [&](int r, const int* nc) {
      const uint8_t* wr[kQR];
      for (int j = 0; j < r; ++j) wr[j] = w + size_t(nc[j]) * row_bytes;
      for (int64_t g0 = 0; g0 < G; g0 += kc) {
        const int64_t g1 = std::min(G, g0 + kc);
        for (int64_t m = mb; m < me; m += kQMR)
          mk(r, wr, m, int(std::min<int64_t>(kQMR, me - m)), g0, g1, nc, g0 > 0);
      }
    });
  }
}

// ---- AMX (tiles of 16 rows x 64 bytes; TDPBF16PS bf16) -----------------------------------------------------
// Calls of at least kAmxMinRows activation rows (block types: amx_rows_default). The weights are the A tiles (16
// output rows x 32 k), the activations the B tiles (k-pair interleaved: B[k / 2][m][k % 2], built once per call by
// amx_bf16_panel), so C tiles are [n][m] and are transposed into y. bf16 weights are tile-loaded where they are (rows
// ldw apart); block weights are dequantized to bf16 per 16-row strip and 256 weights into a small staging block
// (qgemm_amx_bf16_t). Each A tile serves up to 64 activation rows (4 C tiles), so weights are read (and block weights
// dequantized) once per 64 rows. The tiles accumulate in f32 over K (bf16 products exact, f32 sums).
// Single-core A/B against the earlier panel kernels (bench_qlinear_ab --isa amx, one [14336, 4096] matrix, under
// load): bf16 1.45x at m = 16, 1.38x at m = 64. The block types' earlier AMX-INT8 kernel (one TDPBSSD per 32-weight
// scale group, each int32 tile then scaled into f32) lost to the bf16-dequantized tiles at every row count (1.3-1.8x
// at m = 8 / 16 / 32, every type) and was removed.

#if MS_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,amx-tile,amx-int8,amx-bf16")

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0-3: C (16 x 16 words); 4, 5: A (16 rows x ka bytes); 6, 7: B (ka / 4 rows x 64 bytes)
void amx_config(int ka) {
  TileConfig c;
  for (int t = 0; t < 4; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  for (int t = 4; t < 6; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = uint16_t(ka);
  }
  for (int t = 6; t < 8; ++t) {
    c.rows[t] = uint8_t(ka / 4);
    c.colsb[t] = 64;
  }
  // Not _tile_loadconfig: GCC's intrinsic tells the compiler that LDTILECFG reads 8 bytes of the config, so the stores
  // of colsb / rows may be dropped as dead (seen once the caller's loop body became a lambda: every tile 0 rows, and
  // the first tile instruction an illegal one). The whole 64-byte config as the operand keeps them.
  __asm__ volatile("ldtilecfg %0" : : "m"(c));
}

// r[i]: 16 words of row i -> r[c]: word c of rows 0..15.
inline void transpose16x16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i alo = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44), ahi = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);
    const __m512i blo = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44), bhi = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
    r[j] = _mm512_shuffle_i32x4(alo, blo, 0x88);
    r[4 + j] = _mm512_shuffle_i32x4(alo, blo, 0xDD);
    r[8 + j] = _mm512_shuffle_i32x4(ahi, bhi, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(ahi, bhi, 0xDD);
  }
}

struct AmxScratch {
  std::vector<float> panel, cb, rows, acc;
};
thread_local AmxScratch t_amx;

// The activations of an AMX-BF16 call as its B tiles, built once for every part of the call: rows (row(m) = rows ?
// rows[m] : m, `ld` elements apart; bf16 bits as they are, or f32 rounded to bf16 by VCVTNE2PS2BF16: nearest even,
// f32 subnormals as zero) padded with zeros to a multiple of 32, K to a multiple of 32; tile (t, kb) = rows 16t ..
// 16t + 15, k 32kb .. 32kb + 31 as 16 k-pairs x 16 rows x 2 (1 KiB), by a 16 x 16 transpose of 32-bit words per
// tile; tiles [Mp / 16][KB]. a.ld: KB.
template <class SRC>
Act amx_bf16_panel_t(const SRC* src, size_t ld, const int32_t* rows, int64_t M, int64_t K, std::vector<float>& buf) {
  const int64_t Mp = (M + 31) / 32 * 32, KB = (K + 31) / 32, words = 16 * KB;
  uint32_t* d = static_cast<uint32_t*>(grow_bytes(buf, size_t(Mp * words) * 4 + 64));
  d += (64 - reinterpret_cast<uintptr_t>(d) % 64) % 64 / 4;
  uint32_t* tmp = static_cast<uint32_t*>(grow_bytes(t_amx.rows, size_t(16 * words) * 4 + 64));
  tmp += (64 - reinterpret_cast<uintptr_t>(tmp) % 64) % 64 / 4;
  for (int64_t t = 0; t < Mp / 16; ++t) {
    for (int i = 0; i < 16; ++i) {  // 16 rows as bf16, zero padded
      const int64_t m = 16 * t + i;
      uint16_t* h = reinterpret_cast<uint16_t*>(tmp + i * words);
      if (m >= M) {
        std::memset(h, 0, size_t(words) * 4);
        continue;
      }
      const SRC* sr = src + (rows ? int64_t(rows[m]) : m) * int64_t(ld);
      if constexpr (std::is_same<SRC, uint16_t>::value) {
        std::memcpy(h, sr, size_t(K) * 2);
        std::memset(h + K, 0, size_t(32 * KB - K) * 2);
      } else {
        for (int64_t k = 0; k < 32 * KB; k += 32) {
          const int64_t n = K - k;
          const __mmask16 m0 = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << std::max<int64_t>(n, 0)) - 1);
          const __mmask16 m1 = n >= 32 ? __mmask16(0xFFFF) : __mmask16((1u << std::max<int64_t>(n - 16, 0)) - 1);
          const __m512 lo = _mm512_maskz_loadu_ps(m0, sr + k), hi = _mm512_maskz_loadu_ps(m1, sr + k + 16);
          _mm512_store_si512(h + k, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
      }
    }
    for (int64_t kb = 0; kb < KB; ++kb) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(tmp + i * words + 16 * kb);
      transpose16x16(r);
      for (int c = 0; c < 16; ++c) _mm512_store_si512(d + ((t * KB + kb) * 16 + c) * 16, r[c]);
    }
  }
  Act a;
  a.x = d;
  a.ld = size_t(KB);
  return a;
}

Act amx_bf16_panel(const uint16_t* src, size_t ld, const int32_t* rows, int64_t M, int64_t K, std::vector<float>& buf) {
  return amx_bf16_panel_t(src, ld, rows, M, K, buf);
}
Act amx_bf16_panel(const float* src, size_t ld, const int32_t* rows, int64_t M, int64_t K, std::vector<float>& buf) {
  return amx_bf16_panel_t(src, ld, rows, M, K, buf);
}

#pragma GCC pop_options
#endif  // MS_X86

#if MS_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,amx-tile,amx-int8,amx-bf16")

// C tiles 0 .. nt - 1 (activation rows 16 (t0 + t) .. 16 (t0 + t) + 15 against a 16-row weight strip) stored and
// transposed into y's columns [0, nr) (y: the strip's first column).
MS_INLINE void amx_c_to_y(float* cb, int64_t t0, int nt, int64_t M, int nr, float* y, size_t ldy) {
  _tile_stored(0, cb, 64);
  _tile_stored(1, cb + 256, 64);
  _tile_stored(2, cb + 512, 64);
  _tile_stored(3, cb + 768, 64);
  if (nt > 4) {  // the block types' passes of 5 or 6 C tiles (qgemm_amx_bf16_t; cb of 6 tiles)
    _tile_stored(4, cb + 1024, 64);
    _tile_stored(5, cb + 1280, 64);
  }
  const __mmask16 mask = __mmask16((1u << nr) - 1);
  for (int t = 0; t < nt; ++t) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_castps_si512(_mm512_load_ps(cb + 256 * t + 16 * i));
    transpose16x16(r);
    for (int i = 0; i < 16 && 16 * (t0 + t) + i < M; ++i)
      _mm512_mask_storeu_ps(y + size_t(16 * (t0 + t) + i) * ldy, mask, _mm512_castsi512_ps(r[i]));
  }
}

// An activation (B) tile into tile T. kStream: by TILELOADDT1, a hint that the line will not be read again soon, so the
// B panel (L2-resident: 1 KiB a tile and 32-k step) streams past L1 and leaves it to the staged weights; for calls that
// read each B tile once per weight strip (one pass over the strip: up to 96 rows for the block types, 64 for bf16).
// Measured (bench_qlinear_ab, 1 thread, under load): 1.08-1.1x at 64-96 rows with it, but 0.9-0.95x at 256 rows,
// whose several passes per strip read the panel back: there the plain load.
// (A macro: GCC's tile intrinsics take the tile number as a literal.)
#define MS_AMX_LOAD_B(T, p, stream)    \
  do {                                 \
    if (stream)                        \
      _tile_stream_loadd(T, (p), 64);  \
    else                               \
      _tile_loadd(T, (p), 64);         \
  } while (0)

// One 32-k tile step of amx_bf16_steps (A: the strip's 16 rows at this step, lda bytes apart).
template <bool kStream>
MS_INLINE void amx_bf16_step(const uint16_t* A, size_t lda, const uint16_t* b, int64_t KB, int64_t kb, int nt) {
  _tile_loadd(4, A, lda);
  MS_AMX_LOAD_B(6, b + kb * 512, kStream);
  _tile_dpbf16ps(0, 4, 6);
  if (nt > 1) {
    MS_AMX_LOAD_B(7, b + (KB + kb) * 512, kStream);
    _tile_dpbf16ps(1, 4, 7);
  }
  if (nt > 2) {
    MS_AMX_LOAD_B(6, b + (2 * KB + kb) * 512, kStream);
    _tile_dpbf16ps(2, 4, 6);
  }
  if (nt > 3) {
    MS_AMX_LOAD_B(7, b + (3 * KB + kb) * 512, kStream);
    _tile_dpbf16ps(3, 4, 7);
  }
}

// C tiles 0 .. nt - 1 += the 16-row bf16 strip A (k-steps kb0 .. kb1 - 1 of 32; step kb at A + 32 (kb - kb0), rows
// lda bytes apart) x the B tiles b[t][kb] (b: the panel's tiles of activation rows 16 t0 .., rows of KB tiles).
// pf: prefetch A's next lines into L2 (weights read from memory).
template <bool kStream>
MS_INLINE void amx_bf16_steps(const uint16_t* A, size_t lda, const uint16_t* b, int64_t KB, int64_t kb0, int64_t kb1,
                              int nt, bool pf) {
  for (int64_t kb = kb0; kb < kb1; ++kb) {
    const uint16_t* at = A + 32 * (kb - kb0);
    if (pf && kb + 8 < kb1)  // the weights' next lines into L2 (16 rows a multiple of 4 KiB apart share an L1 set)
      for (int i = 0; i < 16; ++i) _mm_prefetch(reinterpret_cast<const char*>(at) + i * lda + 8 * 64, _MM_HINT_T1);
    amx_bf16_step<kStream>(at, lda, b, KB, kb, nt);
  }
}

MS_INLINE void amx_zero_c() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// One 32-k tile step over 5 or 6 C tiles (0 .. nt - 1; tiles 4 and 5 as C, the weights in 6, the activations in 7):
// the block types' passes of 65-96 activation rows, so that such a call makes one pass over its weights, not a pass
// of 4 C tiles and another of 1-2, whose few tile products per step wait on each other (measured: a 1-tile pass
// cost ~60% of a 4-tile pass with its dequantization).
template <bool kStream>
MS_INLINE void amx_bf16_step6(const uint16_t* A, size_t lda, const uint16_t* b, int64_t KB, int64_t kb, int nt) {
  _tile_loadd(6, A, lda);
  MS_AMX_LOAD_B(7, b + kb * 512, kStream);
  _tile_dpbf16ps(0, 6, 7);
  MS_AMX_LOAD_B(7, b + (KB + kb) * 512, kStream);
  _tile_dpbf16ps(1, 6, 7);
  MS_AMX_LOAD_B(7, b + (2 * KB + kb) * 512, kStream);
  _tile_dpbf16ps(2, 6, 7);
  MS_AMX_LOAD_B(7, b + (3 * KB + kb) * 512, kStream);
  _tile_dpbf16ps(3, 6, 7);
  MS_AMX_LOAD_B(7, b + (4 * KB + kb) * 512, kStream);
  _tile_dpbf16ps(4, 6, 7);
  if (nt > 5) {
    MS_AMX_LOAD_B(7, b + (5 * KB + kb) * 512, kStream);
    _tile_dpbf16ps(5, 6, 7);
  }
}

// Calls of many activation rows (over kAmxBlockTiles tiles) whose B panel would not stay in L2 take their rows in
// groups, each its own call over the weights (bf16's weights then read once per group, the block types' dequantized
// once per group), so that a group's panel slice (16 rows x K bf16 = KB KiB a tile) stays within 1 MiB and holds at
// least min_tiles tiles (a full pass: 4 for bf16, 6 for the block types); groups even, bf16's a whole number of its
// 4-tile passes (unit). Calls of fewer tiles take K in blocks instead (amx_blocks), and so does a group whose slice
// still outgrows L2 (K 14336). Each output is the same tile sum over the same k steps either way: bit-identical.
// Measured (bench_qlinear_ab, 1 thread, under load): at 256 rows of one [14336, 4096] matrix the 2 MiB panel made a
// call 0.75-0.9 TFLOP/s against 1.0-1.2 at 128-192 rows; with the groups 1.2-1.55x at 256 rows, ~2x at 512. K blocks
// there instead of the groups: bf16 0.85-0.93x, Q4_K 0.93-1.0x, hence the groups past 8 tiles; at 64-128 rows of K
// 14336 (a prefill expert's down projection) K blocks beat the groups by 1.2-2x.
constexpr int64_t kAmxBlockTiles = 8;
inline int64_t amx_group_tiles(int64_t MT, int64_t KB, int64_t min_tiles, int64_t unit) {
  const int64_t cap = std::max<int64_t>(min_tiles, (int64_t(1) << 20) / (KB * 1024));
  const int64_t groups = (MT + cap - 1) / cap, per = (MT + groups - 1) / groups;
  return (per + unit - 1) / unit * unit;
}

// Calls fn(sub_act, rows, first_row) for each group of activation tiles (amx_group_tiles); false when the call is one
// group (the caller then runs it whole).
template <class Fn>
bool amx_row_groups(const Act& a, int64_t M, int64_t min_tiles, int64_t unit, Fn&& fn) {
  const int64_t KB = int64_t(a.ld), MT = (M + 15) / 16;
  if (MT <= kAmxBlockTiles) return false;
  const int64_t per = amx_group_tiles(MT, KB, min_tiles, unit);
  if (per >= MT) return false;
  for (int64_t t0 = 0; t0 < MT; t0 += per) {
    Act g = a;
    g.x = static_cast<const uint16_t*>(a.x) + t0 * KB * 512;
    fn(g, std::min<int64_t>(M - 16 * t0, 16 * per), 16 * t0);
  }
  return true;
}

// C tiles 0 .. nt - 1 saved to (save) or restored from acc (nt tiles of 16 x 16 f32, 1 KiB apart): a pass's partial
// sums between two K blocks (amx_blocks). f32 bits as they are, so the sums go on exactly as in one run of steps.
// (A macro per tile: GCC's tile intrinsics take the tile number as a literal.)
#define MS_AMX_C_MOVE(T, p, save) \
  do {                            \
    if (save)                     \
      _tile_stored(T, (p), 64);   \
    else                          \
      _tile_loadd(T, (p), 64);    \
  } while (0)

MS_INLINE void amx_c_move(float* acc, int nt, bool save) {
  MS_AMX_C_MOVE(0, acc, save);
  if (nt > 1) MS_AMX_C_MOVE(1, acc + 256, save);
  if (nt > 2) MS_AMX_C_MOVE(2, acc + 512, save);
  if (nt > 3) MS_AMX_C_MOVE(3, acc + 768, save);
  if (nt > 4) MS_AMX_C_MOVE(4, acc + 1024, save);
  if (nt > 5) MS_AMX_C_MOVE(5, acc + 1280, save);
}

// How an AMX call whose activation panel would not stay in L2 cuts K (rows x K bf16: 2.9 MiB at 102 rows of K 14336,
// a prefill expert's down projection; read once per 16-row weight strip, it came from L3): blocks of 32-k steps (a
// multiple of 8: whole 256-weight chunks), even, such that the panel's slice of one block (every activation tile of
// the call, 1 KiB per tile and step) stays within kAmxPanelBytes, half of this CPU's 2 MiB L2, beside the weights and
// the partial sums; one block when the whole panel fits (K 4096 up to 128 rows). Blocked calls take the weight strips
// in groups whose partial sums (MT tiles a strip) stay within 256 KiB: for each group, block after block, each strip's
// passes run that block's steps, their C tiles saved in acc between blocks (amx_c_move: exact, the
// sums go on in the same order, so the outputs are bit-identical to one run of steps) and written to y after the
// last. The panel's slice is then read from L3 once per group and block.
constexpr int64_t kAmxPanelBytes = int64_t(1) << 20;
struct AmxBlocks {
  int64_t steps = 0, group = 0;  // 32-k steps per block; strips per group
  float* acc = nullptr;          // the group's partial sums (blocked calls), MT tiles per strip
};

inline AmxBlocks amx_blocks(int64_t MT, int64_t KB, int64_t strips, std::vector<float>& acc_buf) {
  const int64_t cap = std::max<int64_t>(8, kAmxPanelBytes / (MT * 1024) / 8 * 8);
  const int64_t blocks = (KB + cap - 1) / cap;
  AmxBlocks b;
  b.steps = ((KB + blocks - 1) / blocks + 7) / 8 * 8;
  if (b.steps >= KB) {
    b.steps = KB;
    b.group = std::max<int64_t>(1, strips);
    return b;
  }
  b.group = std::max<int64_t>(1, 256 / MT);
  b.acc = grow(acc_buf, size_t(b.group * MT * 256) + 16);
  b.acc += (16 - reinterpret_cast<uintptr_t>(b.acc) / 4 % 16) % 16;
  return b;
}

// body(nb, nr, kb0, kb1, first, last, sacc) for every 16-row strip nb of [n0, n1) (nr rows) and K block [kb0, kb1)
// of steps, in amx_blocks' order; sacc: the strip's partial sums (MT tiles; null when K is one block).
template <class Body>
MS_INLINE void amx_each_block(const AmxBlocks& b, int64_t MT, int64_t KB, int64_t n0, int64_t n1, Body&& body) {
  for (int64_t g0 = n0; g0 < n1; g0 += 16 * b.group) {
    const int64_t g1 = std::min(n1, g0 + 16 * b.group);
    for (int64_t kb0 = 0; kb0 < KB; kb0 += b.steps) {
      const int64_t kb1 = std::min(KB, kb0 + b.steps);
      for (int64_t nb = g0; nb < g1; nb += 16)
        body(nb, int(std::min<int64_t>(16, n1 - nb)), kb0, kb1, kb0 == 0, kb1 == KB,
             b.acc ? b.acc + size_t((nb - g0) / 16 * MT * 256) : nullptr);
    }
  }
}

// Starts a pass over C tiles 0 .. nt - 1: zeroed at the first K block, else restored from sacc.
MS_INLINE void amx_c_begin(bool first, float* sacc, int nt) {
  if (!first) return amx_c_move(sacc, nt, false);
  amx_zero_c();
  if (nt > 4) {
    _tile_zero(4);
    _tile_zero(5);
  }
}

// Ends a pass over C tiles 0 .. nt - 1 (activation tiles t0 ..): into y at the last K block, else saved in sacc.
MS_INLINE void amx_c_end(bool last, float* sacc, float* cb, int64_t t0, int nt, int64_t M, int nr, float* y,
                         size_t ldy) {
  if (last)
    amx_c_to_y(cb, t0, nt, M, nr, y, ldy);
  else
    amx_c_move(sacc, nt, true);
}

// bf16 weights on AMX: the weights are the A tiles, read where they are (16 rows x 32 k, the rows ldw apart), the
// activations the B tiles of prepare()'s panel: each 16-row weight tile is loaded once per 32-k step for up to 64
// activation rows (C tiles 0-3: one per 16 rows), so the weights are read once per 64 rows. C[n][m] is transposed
// into y. A 16-row block short of 16 rows (the last of [n0, n1)) or a K short of a multiple of 32 is staged zero
// padded first. Each output is one f32 sum over the 32-k steps in order (the tiles' own order inside a step).
void gemm_range_amx_bf16(const Act& a, int64_t M, int64_t K, const uint16_t* w, size_t ldw, int64_t n0, int64_t n1,
                         float* y, size_t ldy) {
  if (amx_row_groups(a, M, 4, 4, [&](const Act& g, int64_t rows, int64_t r0) {
        gemm_range_amx_bf16(g, rows, K, w, ldw, n0, n1, y + size_t(r0) * ldy, ldy);
      }))
    return;
  const int64_t KB = int64_t(a.ld), MT = (M + 15) / 16;
  const uint16_t* panel = static_cast<const uint16_t*>(a.x);
  AmxScratch& s = t_amx;
  const AmxBlocks blk = amx_blocks(MT, KB, (n1 - n0 + 15) / 16, s.acc);
  uint16_t* stage = reinterpret_cast<uint16_t*>(grow_bytes(s.panel, size_t(16 * KB * 64) + 64));
  stage += (64 - reinterpret_cast<uintptr_t>(stage) % 64) % 64 / 2;
  float* cb = grow(s.cb, 4 * 256 + 16);
  cb += (16 - reinterpret_cast<uintptr_t>(cb) / 4 % 16) % 16;
  amx_config(64);
  amx_each_block(blk, MT, KB, n0, n1, [&](int64_t nb, int nr, int64_t kb0, int64_t kb1, bool first, bool last,
                                          float* sacc) MS_INLINE_LAMBDA {
    const uint16_t* A = w + size_t(nb) * ldw + 32 * kb0;
    size_t lda = ldw * 2;
    if (nr < 16 || K % 32 != 0) {  // staged zero padded (the whole strip, once per K block)
      std::memset(stage, 0, size_t(16 * KB * 64));
      for (int i = 0; i < nr; ++i) std::memcpy(stage + size_t(i) * size_t(KB * 32), w + size_t(nb + i) * ldw, size_t(K) * 2);
      A = stage + 32 * kb0;
      lda = size_t(KB * 64);
    }
    for (int64_t t0 = 0; t0 < MT; t0 += 4) {
      const int nt = int(std::min<int64_t>(4, MT - t0));
      float* tacc = sacc ? sacc + t0 * 256 : nullptr;
      amx_c_begin(first, tacc, nt);
      if (MT <= 4)  // one pass over each strip: the panel streams (MS_AMX_LOAD_B)
        amx_bf16_steps<true>(A, lda, panel + t0 * KB * 512, KB, kb0, kb1, nt, t0 == 0);
      else
        amx_bf16_steps<false>(A, lda, panel + t0 * KB * 512, KB, kb0, kb1, nt, t0 == 0);
      amx_c_end(last, tacc, cb, t0, nt, M, nr, y + nb, ldy);
    }
  });
  _tile_release();
}

// Block weights dequantized to bf16, then the bf16 tiles (qpath kQAmxBf16). For each 16-row strip of weights and up
// to 64 activation rows, the strip's K is taken 256 weights at a time: its 16 rows are dequantized into a small
// L1-resident staging block (w = s (u - o) + c in f32, as ggml's dequantize_row_* computes it: (d * sc) * q, Q4_K
// minus dmin * m; then rounded to bf16, nearest even), and 8 tile steps of 32 k run over it against the activations'
// bf16 B tiles (amx_bf16_panel: x rounded to bf16). Products of bf16 are exact in f32 and summed in f32, so each
// output is "dequantize the blocks, round weights and activations to bf16, f32 matmul" up to f32 summation error.
// The dequantization is paid once per weight and 64 activation rows, the tile products then as bf16 weights'.
// 16 f32 rounded to bf16 (nearest even) in both 256-bit halves: a 32-entry VPERMW table whose index bit 4 is a
// don't-care, so a code byte's zero-extended word indexes its low nibble directly.
MS_INLINE __m512i bf16_table16(__m512 v) { return _mm512_broadcast_i64x4((__m256i)_mm512_cvtneps_pbh(v)); }

// 32 values (two 16-lane f32 vectors, int8 codes times a scale) rounded to bf16 and stored.
MS_INLINE void store_bf16x32(uint16_t* dst, __m512 lo, __m512 hi) {
  _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

MS_INLINE __m512 i8x16_ps(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)); }

// One f32 broadcast to 16 lanes by a load (VBROADCASTSS from memory: a load port only). Left to itself the compiler
// keeps a small array of scales in a register and broadcasts its lanes with shuffles (VPERMD, VSHUFPS + VBROADCASTSS),
// on the shuffle port that already bounds the dequantization: Q4_K's and Q6_K's chunks 1.5x / 1.2x faster this way
// (dequantization alone, L1-resident blocks, 60 -> 40 and 83 -> 69 ps per weight).
MS_INLINE __m512 bcast_ps(const float* p) {
  __m512 r;
  __asm__("vbroadcastss %1, %0" : "=v"(r) : "m"(*p));
  return r;
}

// Weights [k0, k1) of one row (k0 a multiple of 256; k1 - k0 <= 256, a multiple of the block) dequantized to bf16
// into dst: the 4-bit types through a 16-entry bf16 table per scale group (VPERMW by the codes), Q8_0 / Q6_K by
// converting the codes. Each value is ggml's f32 dequantized weight rounded to bf16, nearest even.
template <int QT>
MS_INLINE void dequant_chunk_bf16(const uint8_t* row, int64_t k0, int64_t k1, uint16_t* dst) {
  if constexpr (QT == kQ8_0) {
    for (int64_t b = k0 / 32; b < k1 / 32; ++b, dst += 32) {
      const uint8_t* blk = row + b * 34;
      const __m512 d = _mm512_set1_ps(f16_at(blk));
      // each half's codes sign-extended straight from memory (no lane extract on the shuffle port: 1.1x)
      store_bf16x32(dst, _mm512_mul_ps(i8x16_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2))), d),
                    _mm512_mul_ps(i8x16_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18))), d));
    }
  } else if constexpr (QT == kQ4_0) {
    const __m512 iota = _mm512_set_ps(7, 6, 5, 4, 3, 2, 1, 0, -1, -2, -3, -4, -5, -6, -7, -8);  // u - 8
    for (int64_t b = k0 / 32; b < k1 / 32; ++b, dst += 32) {
      const uint8_t* blk = row + b * 18;
      const __m512i tab = bf16_table16(_mm512_mul_ps(_mm512_set1_ps(f16_at(blk)), iota));
      const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2)));
      const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(w), _mm256_srli_epi16(w, 4), 1);
      _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(idx, tab));
    }
  } else if constexpr (QT == kQ4_K) {
    const uint8_t* sb = row + (k0 / 256) * 144;
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    uint64_t sc, mn;
    q4k_scales_mins(sb, sc, mn);
    alignas(32) float s8[8], c8[8];  // d * sc_j and -(dmin * m_j)
    const __m256 sv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(sc))));
    const __m256 mv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(mn))));
    _mm256_store_ps(s8, _mm256_mul_ps(sv, _mm256_set1_ps(f16_at(sb))));
    _mm256_store_ps(c8, _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(mv, _mm256_set1_ps(f16_at(sb + 2)))));
    // both sub-blocks' 16-entry tables in one 32-entry VPERMW table (one VCVTNE2PS2BF16, no broadcasts: the
    // shuffle port bounded this loop): low nibbles index entries 0-15, high nibbles | 16 entries 16-31. Same values.
    const __m512i lo4 = _mm512_set1_epi16(15), hi_half = _mm512_set1_epi16(16);
    for (int g = 0; g < 4; ++g, dst += 64) {
      const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 16 + 32 * g)));
      const __m512 fa = _mm512_add_ps(_mm512_mul_ps(iota, bcast_ps(s8 + 2 * g)), bcast_ps(c8 + 2 * g));
      const __m512 fb = _mm512_add_ps(_mm512_mul_ps(iota, bcast_ps(s8 + 2 * g + 1)), bcast_ps(c8 + 2 * g + 1));
      const __m512i tab = (__m512i)_mm512_cvtne2ps_pbh(fb, fa);
      _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(_mm512_and_si512(w, lo4), tab));
      _mm512_storeu_si512(dst + 32, _mm512_permutexvar_epi16(_mm512_or_si512(_mm512_srli_epi16(w, 4), hi_half), tab));
    }
  } else {
    const uint8_t* sb = row + (k0 / 256) * 210;
    alignas(64) float s16[16];  // d * sc_j of the 16 sub-blocks, broadcast from memory below (bcast_ps)
    _mm512_store_ps(s16, _mm512_mul_ps(i8x16_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 192))),
                                       _mm512_set1_ps(f16_at(sb + 208))));
    __m512i u[4];
    kcodes<kQ6_K>(sb, u);
    for (int g = 0; g < 4; ++g, dst += 64) {
      const __m512i v = _mm512_sub_epi8(u[g], _mm512_set1_epi8(32));
      __m512 f[4];
      f[0] = _mm512_mul_ps(i8x16_ps(_mm512_castsi512_si128(v)), bcast_ps(s16 + 4 * g));
      f[1] = _mm512_mul_ps(i8x16_ps(_mm512_extracti32x4_epi32(v, 1)), bcast_ps(s16 + 4 * g + 1));
      f[2] = _mm512_mul_ps(i8x16_ps(_mm512_extracti32x4_epi32(v, 2)), bcast_ps(s16 + 4 * g + 2));
      f[3] = _mm512_mul_ps(i8x16_ps(_mm512_extracti32x4_epi32(v, 3)), bcast_ps(s16 + 4 * g + 3));
      store_bf16x32(dst, f[0], f[1]);
      store_bf16x32(dst + 32, f[2], f[3]);
    }
  }
}

// The chunks of 256 weights are double-buffered: while the tiles run over chunk c, two of chunk c + 1's 16 rows are
// dequantized after each tile step, meant to let the vector units and the tile unit work at the same time (measured
// since: on this core the two times add however the dequantization is interleaved, README "Whole-model prefill
// against llama.cpp", second round; the double buffer still keeps the tile loads off the rows being written). A pass
// over a strip takes up to 6 C tiles (96 rows: tiles 4 and 5 as C, amx_bf16_step6). Calls of more than 96 rows
// (several passes over each strip, the C tiles shared evenly among them) stage the strip's K block instead (16 rows x
// the block's K in bf16: 128 KiB at K 4096, L2-resident): the first pass dequantizes it as above, chunk after chunk,
// and the later passes run their tile steps over the staged block, so every weight is dequantized once per call, not
// once per 64 rows (a prefill's experts get 65-110 rows at Mixtral's top-2 of 8: up to 96 rows in one pass, 97-112 in
// passes of 4 + 3 C tiles). Calls whose activation panel would outgrow L2 take K in blocks (amx_blocks; up to 8 tiles
// they were cut into row groups before, each dequantizing the weights again: 1.22-1.86x at 64-128 rows of K 14336).
template <int QT>
void qgemm_amx_bf16_t(const Act& a, int64_t M, int64_t K, const uint8_t* w, size_t row_bytes, int64_t n0, int64_t n1,
                      float* y, size_t ldy) {
  if (amx_row_groups(a, M, 6, 1, [&](const Act& g, int64_t rows, int64_t r0) {
        qgemm_amx_bf16_t<QT>(g, rows, K, w, row_bytes, n0, n1, y + size_t(r0) * ldy, ldy);
      }))
    return;
  constexpr int64_t kSteps = 8;                 // 32-k tile steps per staged chunk (256 weights)
  const int64_t KB = int64_t(a.ld), MT = (M + 15) / 16;
  // passes of up to 6 C tiles (96 rows) over each strip, the tiles shared evenly among them (7 tiles: 4 + 3)
  const int64_t passes = (MT + 5) / 6, per = (MT + passes - 1) / passes;
  const bool whole = passes > 1;                // several passes: stage the strip's K block
  AmxScratch& s = t_amx;
  const AmxBlocks blk = amx_blocks(MT, KB, (n1 - n0 + 15) / 16, s.acc);
  // staged row stride, elements: one chunk plus 64 bytes (576 bytes: rows in distinct L1 sets), or a K block plus
  // 64 bytes
  const int64_t lds = whole ? 32 * blk.steps + 32 : 32 * kSteps + 32;
  const size_t stage_elems = whole ? size_t(16 * lds) : size_t(2 * 16 * lds);
  const uint16_t* panel = static_cast<const uint16_t*>(a.x);
  uint16_t* stage = reinterpret_cast<uint16_t*>(grow_bytes(s.panel, stage_elems * 2 + 64));
  stage += (64 - reinterpret_cast<uintptr_t>(stage) % 64) % 64 / 2;
  float* cb = grow(s.cb, 6 * 256 + 16);
  cb += (16 - reinterpret_cast<uintptr_t>(cb) / 4 % 16) % 16;
  QSpec sp;
  qspec(QT, sp);
  const size_t chunk_bytes = size_t(256 / sp.blk) * size_t(sp.bytes);
  amx_config(64);
  amx_each_block(blk, MT, KB, n0, n1, [&](int64_t nb, int nr, int64_t kb0, int64_t kb1, bool first, bool last,
                                          float* sacc) MS_INLINE_LAMBDA {
    const int64_t c0 = kb0 / kSteps, c1 = (kb1 + kSteps - 1) / kSteps;  // the block's chunks
    // chunk c in the staging block: alternate halves, or its place in the staged K block
    auto chunk_at = [&](int64_t c) { return whole ? stage + 256 * (c - c0) : stage + (c & 1) * 16 * lds; };
    if (nr < 16) std::memset(stage, 0, stage_elems * 2);  // rows past nr stay zero
    const uint8_t* wb = w + size_t(nb) * row_bytes;
    for (int64_t t0 = 0; t0 < MT; t0 += per) {
      const int nt = int(std::min<int64_t>(per, MT - t0));
      const uint16_t* b = panel + t0 * KB * 512;
      float* tacc = sacc ? sacc + t0 * 256 : nullptr;
      // one 32-k step over the C tiles of this pass
      auto step = [&](const uint16_t* A, int64_t kb) {  // B streamed when this is the strip's only pass
        if (whole)
          return nt > 4 ? amx_bf16_step6<false>(A, size_t(lds * 2), b, KB, kb, nt)
                        : amx_bf16_step<false>(A, size_t(lds * 2), b, KB, kb, nt);
        if (nt > 4) return amx_bf16_step6<true>(A, size_t(lds * 2), b, KB, kb, nt);
        amx_bf16_step<true>(A, size_t(lds * 2), b, KB, kb, nt);
      };
      amx_c_begin(first, tacc, nt);
      if (t0 > 0) {  // the strip's K block is staged by the first pass
        for (int64_t kb = kb0; kb < kb1; ++kb) step(stage + 32 * (kb - kb0), kb);
        amx_c_end(last, tacc, cb, t0, nt, M, nr, y + nb, ldy);
        continue;
      }
      // the first pass over the strip reads it from memory: prefetch two chunks ahead
      auto deq = [&](int64_t c, int i) {
        if (i >= nr) return;
        const uint8_t* row = wb + size_t(i) * row_bytes;
        for (size_t o = 0; o < chunk_bytes; o += 64)
          _mm_prefetch(reinterpret_cast<const char*>(row + size_t(c + 2) * chunk_bytes + o), _MM_HINT_T1);
        dequant_chunk_bf16<QT>(row, 256 * c, std::min(K, 256 * c + 256), chunk_at(c) + size_t(i) * lds);
      };
      for (int i = 0; i < 16; ++i) deq(c0, i);
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t s0 = c * kSteps, s1 = std::min(kb1, s0 + kSteps);
        for (int64_t kb = s0; kb < s1; ++kb) {
          step(chunk_at(c) + 32 * (kb - s0), kb);
          if (c + 1 < c1) {  // chunk c has all 8 steps when another follows
            deq(c + 1, int(2 * (kb - s0)));
            deq(c + 1, int(2 * (kb - s0) + 1));
          }
        }
      }
      amx_c_end(last, tacc, cb, t0, nt, M, nr, y + nb, ldy);
    }
  });
  _tile_release();
}

void qgemm_range_amx_bf16(int qt, const Act& a, int64_t M, int64_t K, const uint8_t* w, size_t row_bytes, int64_t n0,
                          int64_t n1, float* y, size_t ldy) {
  switch (qt) {
    case kQ8_0: return qgemm_amx_bf16_t<kQ8_0>(a, M, K, w, row_bytes, n0, n1, y, ldy);
    case kQ4_0: return qgemm_amx_bf16_t<kQ4_0>(a, M, K, w, row_bytes, n0, n1, y, ldy);
    case kQ4_K: return qgemm_amx_bf16_t<kQ4_K>(a, M, K, w, row_bytes, n0, n1, y, ldy);
    default: return qgemm_amx_bf16_t<kQ6_K>(a, M, K, w, row_bytes, n0, n1, y, ldy);
  }
}

#pragma GCC pop_options
#endif

// Which path block weights of type qt take for a call of M activation rows on ISA path isa: kQVec (AVX-512 / AVX2 /
// scalar, Q8 activations) or kQAmxBf16 (the weights dequantized to bf16 per 16-row strip, AMX-BF16 tiles, bf16
// activations: qgemm_amx_bf16_t), from a threshold of rows per type. ms_set_amx_rows changes it (A/B, tests).
enum QPath { kQVec = 0, kQTiles = 1, kQAmxBf16 = 2 };  // kQTiles: kgemm (Q4_K / Q6_K / Q8_0, AVX-512, many rows)
constexpr int kNoRows = 1 << 30;
std::atomic<int> g_amx_rows[16] = {};  // by ggml type id; 0: amx_rows_default

// Measured (bench_qlinear_ab --isa avx512bf16 --new-isa amx --new-amx-rows=1, 1 thread, one [14336, 4096] matrix
// cached and 512 MiB from memory, under load): AMX / AVX-512 at 8 / 12 / 16 rows Q8_0 1.09-1.16x / 1.51-1.65x / 1.9-2.3x,
// Q4_0 1.59-1.83x / 2.3-2.6x / 2.9-3.4x, Q4_K 0.89-0.99x / 1.29-1.54x / 1.8-2.1x, Q6_K 0.86-0.96x / 1.25-1.49x /
// 1.94-1.95x. A type takes the tiles from the first count where they win clearly.
// from 12 rows for every type: Q4_0's tiles won from 8 rows against its old AVX-512 kernel, the 4-block one wins up
// to 10 (AMX / AVX-512 0.74x / 0.90x / 0.95x / 1.03x / 1.10x at 8-12 rows, README "AMX, block types")
inline int64_t amx_rows_default(int) { return 12; }

// kgemm's tiles (kQTiles) on the avx512bf16 ISA path only: measured on Zen 5 (no AMX); on the amx path calls below the
// tiles' threshold keep the pair kernels, as tuned on Sapphire Rapids (kgemm there is unmeasured).
inline int qpath(int isa, int qt, int64_t M) {
  if (isa != kAmx) {
    const bool tiles = MS_X86 && isa == kAvx512Bf16 && (qt == kQ4_K || qt == kQ6_K || qt == kQ8_0) &&
                       M >= (qt == kQ8_0 ? kKTileMin8 : kKTileMin);
    return tiles ? kQTiles : kQVec;
  }
  const int v = g_amx_rows[qt & 15].load(std::memory_order_relaxed);
  return M >= (v > 0 ? v : amx_rows_default(qt)) ? kQAmxBf16 : kQVec;
}

// The activations of a block-weight call, prepared for its path.
struct QIn {
  int path = kQVec;
  QAct q;  // kQVec, kQTiles: the rows quantized for the weight type (quantize_rows)
  const uint8_t* panel = nullptr;  // kQTiles: the rows as kgemm's tiles (kpanel_build), in buf after q's rows
  Act b;   // kQAmxBf16: the rows' bf16 B tiles (amx_bf16_panel)
};

QIn qprepare(int isa, int qt, const QSpec& sp, const void* x, bool xbf16, size_t ld, const int32_t* rows, int64_t M,
             int64_t K, std::vector<float>& buf) {
  QIn in;
  in.path = qpath(isa, qt, M);
#if MS_X86
  if (in.path == kQAmxBf16) {
    in.b = xbf16 ? amx_bf16_panel(static_cast<const uint16_t*>(x), ld, rows, M, K, buf)
                 : amx_bf16_panel(static_cast<const float*>(x), ld, rows, M, K, buf);
    return in;
  }
#endif
#if MS_X86
  if (in.path == kQTiles) {
    in.q = quantize_rows(sp, x, xbf16, ld, rows, M, K, buf, size_t(kpanel_bytes(qt, M, K)) + 64);
    uint8_t* p = const_cast<uint8_t*>(in.q.base) + size_t(M) * size_t(in.q.stride);  // stride: a multiple of 64
    kpanel_build(qt, in.q, M, K, p);
    in.panel = p;
    return in;
  }
#endif
  in.q = quantize_rows(sp, x, xbf16, ld, rows, M, K, buf);
  return in;
}

void qgemm_range(int isa, int qt, const QIn& a, int64_t M, int64_t K, const uint8_t* w, size_t row_bytes,
                 int64_t n0, int64_t n1, float* y, size_t ldy) {
  if (n1 <= n0 || M <= 0) return;
  if (K == 0) return zero_cols(M, n0, n1, y, ldy);
#if MS_X86
  if (a.path == kQAmxBf16) return qgemm_range_amx_bf16(qt, a.b, M, K, w, row_bytes, n0, n1, y, ldy);
  if (a.path == kQTiles) return kgemm_range_any(qt, a.panel, M, K, w, row_bytes, n0, n1, y, ldy);
#endif
  qgemm_range_vec(isa, qt, a.q, M, K, w, row_bytes, n0, n1, y, ldy);
}

// y f32 [M, N] = x W^T for block weights w [N, row_bytes] of type qt; then epi(n0, n1) on each part's columns.
template <class Epi>
void qgemm(int isa, int qt, const QIn& a, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y, size_t ldy,
           int threads, Epi&& epi) {
  QSpec sp;
  qspec(qt, sp);
  const size_t rb = size_t(K / sp.blk) * size_t(sp.bytes);
  const int th = threads_for(threads, double(N) * double(rb), double(M) * double(N) * double(K));
  const int nparts = parts_for(N, th);
  auto part = [&](int i) {
    const int64_t n0 = part_begin(N, nparts, i), n1 = part_begin(N, nparts, i + 1);
    qgemm_range(isa, qt, a, M, K, w, rb, n0, n1, y, ldy);
    epi(n0, n1);
  };
  parallel(nparts, th, part);
}

// h[i] = silu(g[i]) * u[i] for the block-quantized experts: g / (1 + e) * u in f32, with e = exp(-g) computed in double
// and rounded once to f32, the correctly rounded expf. ROUNDING CHANGE (2026-12-06): this loop called glibc's expf,
// which is within 0.502 ulp, not correctly rounded: it differs by 1 ulp on ~0.03 % of values (277 of 960k normal ones
// against the f64 reference), so h now differs from before in ~1 of 3,000 values by 1 f32 ulp, before its own
// rounding to bf16 / Q8. The AVX-512 path computes the same e 16 at a time (range reduction by ln2 / 16 in two parts,
// a 16-entry table of 2^(j/16) built with exp2, a degree-6 polynomial: relative error ~2^-50, rounded once to f32),
// so both paths give the same bits wherever the exact value is not within ~2^-50 of an f32 rounding boundary
// (tests/test_native_quant.py::test_silu_mul_matches_scalar: 2 million values bit for bit, and against numpy's f64 exp).
// Why: the scalar loop called expf through the PLT per value, 2.6 ns each, ~6 % of a prefill expert layer's CPU time
// (2.5 ms per 67-row Mixtral-width expert; vector 0.75 ms). The bf16 experts keep silu() (bits unchanged).
void silu_mul_scalar(const float* g, const float* u, float* h, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float e = float(std::exp(-double(g[i])));
    h[i] = g[i] / (1.0f + e) * u[i];
  }
}

#if MS_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512dq")

const double* exp2_sixteenths() {  // 2^(j/16), j = 0..15
  static const std::array<double, 16> t = [] {
    std::array<double, 16> v{};
    for (int j = 0; j < 16; ++j) v[size_t(j)] = std::exp2(double(j) / 16.0);
    return v;
  }();
  return t.data();
}

// exp(x) for 8 doubles in [-150, 89] (all normal doubles there; NaN stays NaN).
MS_INLINE __m512d exp_pd(__m512d x, __m512d tlo, __m512d thi) {
  const double ln2_16_hi = 0x1.62e42fefa3800p-5, ln2_16_lo = 0x1.ef35793c76730p-49;  // ln2 / 16 in two parts
  const __m512d kd = _mm512_roundscale_pd(_mm512_mul_pd(x, _mm512_set1_pd(16.0 / 0.6931471805599453)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512d r = _mm512_fnmadd_pd(kd, _mm512_set1_pd(ln2_16_hi), x);
  r = _mm512_fnmadd_pd(kd, _mm512_set1_pd(ln2_16_lo), r);  // |r| <= ln2 / 32
  __m512d p = _mm512_set1_pd(1.0 / 720);
  p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(1.0 / 120));
  p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(1.0 / 24));
  p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(1.0 / 6));
  p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(0.5));
  p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(1.0));
  p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(1.0));
  const __m512i k = _mm512_cvtpd_epi64(kd);
  const __m512d t = _mm512_permutex2var_pd(tlo, k, thi);  // 2^((k mod 16) / 16): index bits 0-3
  const __m512i e = _mm512_slli_epi64(_mm512_srai_epi64(k, 4), 52);  // 2^(k div 16) into the exponent
  return _mm512_castsi512_pd(_mm512_add_epi64(_mm512_castpd_si512(_mm512_mul_pd(p, t)), e));
}

// exp(-g) for 16 floats, each the double result rounded once to f32.
MS_INLINE __m512 exp_neg_ps(__m512 g, __m512d tlo, __m512d thi) {
  const __m512d lo = _mm512_set1_pd(-150.0), hi = _mm512_set1_pd(89.0);
  auto half = [&](__m256 v) {  // max / min keep a NaN (their second operand)
    const __m512d x = _mm512_min_pd(hi, _mm512_max_pd(lo, _mm512_sub_pd(_mm512_setzero_pd(), _mm512_cvtps_pd(v))));
    return _mm512_cvtpd_ps(exp_pd(x, tlo, thi));
  };
  const __m256 a = half(_mm512_castps512_ps256(g)), b = half(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(g), 1)));
  return _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1);
}

void silu_mul_avx512(const float* g, const float* u, float* h, int64_t n) {
  const double* t = exp2_sixteenths();
  const __m512d tlo = _mm512_loadu_pd(t), thi = _mm512_loadu_pd(t + 8);
  const __m512 one = _mm512_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 gv = _mm512_loadu_ps(g + i);
    const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, exp_neg_ps(gv, tlo, thi)));
    _mm512_storeu_ps(h + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
  }
  silu_mul_scalar(g + i, u + i, h + i, n - i);
}

#pragma GCC pop_options
#endif

void silu_mul(int isa, const float* g, const float* u, float* h, int64_t n) {
#if MS_X86
  if (isa >= kAvx512Bf16) return silu_mul_avx512(g, u, h, n);
#endif
  (void)isa;
  silu_mul_scalar(g, u, h, n);
}

// Block-quantized SwiGLU expert: gate [F, H] (type qg), up [F, H] (qu), down [H, F] (qd). The M rows of x
// (row(m) = rows ? rows[m] : m; bf16 bits if xbf16, else f32) are quantized for gate and up; g = x gate^T
// and u = x up^T stay f32, h = silu(g) * u (f32) is quantized for down; y f32 [M, H] = h down^T.
void qswiglu_expert(int isa, int qg, int qu, int qd, const void* x, bool xbf16, const int32_t* rows, int64_t M,
                    int64_t H, int64_t F, const uint8_t* gate, const uint8_t* up, const uint8_t* down, float* y,
                    int threads, const Sink& sink) {
  if (M <= 0 || H <= 0) return;
  Scratch& s = t_scratch;
  QSpec sg, su, sd;
  qspec(qg, sg);
  qspec(qu, su);
  qspec(qd, sd);
  const QIn ag = qprepare(isa, qg, sg, x, xbf16, size_t(H), rows, M, H, s.xa);
  const int pu = qpath(isa, qu, M);  // up shares gate's activations where both paths read them alike
  const QIn au = (pu == ag.path && (pu == kQAmxBf16 || (su.xblk == sg.xblk && su.offset == sg.offset)))
                     ? ag : qprepare(isa, qu, su, x, xbf16, size_t(H), rows, M, H, s.xb);
  float* G = grow(s.g, size_t(M * F));
  float* U = grow(s.u, size_t(M * F));
  float* Hf = grow(s.h, size_t(M * F));
  const size_t rbg = size_t(H / sg.blk) * size_t(sg.bytes), rbu = size_t(H / su.blk) * size_t(su.bytes);
  {
    const int th = threads_for(threads, double(F) * double(rbg + rbu), 2 * double(M) * double(F) * double(H));
    const int nparts = parts_for(F, th);
    auto part = [&](int i) {
      const int64_t f0 = part_begin(F, nparts, i), f1 = part_begin(F, nparts, i + 1);
      qgemm_range(isa, qg, ag, M, H, gate, rbg, f0, f1, G, size_t(F));
      qgemm_range(isa, qu, au, M, H, up, rbu, f0, f1, U, size_t(F));
      for (int64_t m = 0; m < M; ++m) silu_mul(isa, G + m * F + f0, U + m * F + f0, Hf + m * F + f0, f1 - f0);
    };
    parallel(nparts, th, part);
  }
  const QIn ah = qprepare(isa, qd, sd, Hf, false, size_t(F), nullptr, M, F, s.ha);
  qgemm(isa, qd, ah, M, F, down, H, y, size_t(H), threads, [&](int64_t n0, int64_t n1) { sink(n0, n1); });
}

// Why a block-quantized matrix [rows, cols] of type qt cannot be used ("" if it can).
std::string qcheck(int qt, int64_t cols, const char* what) {
  QSpec sp;
  if (!qspec(qt, sp))
    return std::string(what) + ": unsupported block type id " + std::to_string(qt) + " (q4_0 2, q8_0 8, q4_k 12, q6_k 14)";
  if (cols % sp.blk != 0)
    return std::string(what) + ": " + std::to_string(cols) + " columns are not a whole number of " +
           std::to_string(sp.blk) + "-weight blocks";
  return "";
}

inline size_t qrow_bytes(int qt, int64_t cols) {
  QSpec sp;
  qspec(qt, sp);
  return size_t(cols / sp.blk) * size_t(sp.bytes);
}

// experts_core over block-quantized experts; weights(e) -> ExpertW (block data).
template <class Weights>
void quant_experts(int isa, int qg, int qu, int qd, const void* x, bool xbf16, int64_t H, int64_t F,
                   int64_t n_experts, Weights&& weights, const int64_t* offsets, const int32_t* tokens,
                   const float* pair_weight, float* out, int threads, int strategy, double* seconds) {
  const double wbytes = double(F) * double(qrow_bytes(qg, H) + qrow_bytes(qu, H)) + double(H) * double(qrow_bytes(qd, F));
  const ExpertRun run = [&](int64_t e, const int32_t* tok, int64_t M, float* Y, int th, const Sink& sink) {
    const ExpertW w = weights(e);
    qswiglu_expert(isa, qg, qu, qd, x, xbf16, tok, M, H, F, static_cast<const uint8_t*>(w.gate),
                   static_cast<const uint8_t*>(w.up), static_cast<const uint8_t*>(w.down), Y, th, sink);
  };
  experts_core(H, wbytes, n_experts, run, offsets, tokens, pair_weight, out, threads, strategy, seconds);
}

// Copies rows of `row_bytes` bytes: out[i] = table[clamp(index[i])], where a negative index counts from
// the end (index + V, as numpy / jnp indexing) and anything still outside [0, V) is clamped to it.
void take_rows(const char* table, int64_t V, size_t row_bytes, const int32_t* index, int64_t N, char* out) {
  if (N <= 0 || row_bytes == 0) return;
  if (V <= 0) {
    std::memset(out, 0, size_t(N) * row_bytes);
    return;
  }
  auto copy = [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      int64_t v = index[i];
      if (v < 0) v += V;
      v = std::min<int64_t>(std::max<int64_t>(v, 0), V - 1);
      std::memcpy(out + size_t(i) * row_bytes, table + size_t(v) * row_bytes, row_bytes);
    }
  };
  const double bytes = double(N) * double(row_bytes);
  const int th = bytes >= double(kTakeParallelBytes) ? resolve_threads(0) : 1;
  const int nparts = th > 1 ? int(std::min<int64_t>(N, int64_t(th) * 4)) : 1;
  auto part = [&](int i) { copy(part_begin(N, nparts, i), part_begin(N, nparts, i + 1)); };
  parallel(nparts, th, part);
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// C ABI (ctypes). Functions returning int: 0 on success, -1 on a bad argument (ms_last_error()).
// ------------------------------------------------------------------------------------------------

extern "C" {

const char* ms_isa() { return isa_name(g_isa.load()); }
const char* ms_best_isa() { return isa_name(g_best_isa); }
const char* ms_last_error() { return t_error.c_str(); }

// Forces an ISA path ("avx512bf16", "avx2", "scalar"; "" or null: the best one). -1 if this CPU lacks it.
int ms_set_isa(const char* name) {
  const int want = (name == nullptr || name[0] == 0) ? g_best_isa : isa_from_name(name);
  if (want < 0) return fail(std::string("unknown ISA '") + name + "' (amx, avx512bf16, avx2, scalar)");
  if (want > g_best_isa) return fail(std::string("this CPU does not support ") + name);
  g_isa.store(want);
  return 0;
}

// Where the AVX-512 block kernels prefetch their weight streams: "l1", "l2", "off"; "" or null: this CPU's
// default (qprefetch_default). Changes no result, only speed.
int ms_set_qprefetch(const char* name) {
  const int want = (name == nullptr || name[0] == 0) ? qprefetch_default() : qprefetch_from_name(name);
  if (want < 0) return fail(std::string("unknown prefetch level '") + name + "' (l1, l2, off)");
  g_qprefetch.store(want);
  return 0;
}
const char* ms_qprefetch() { return qprefetch_name(g_qprefetch.load()); }

// Default thread count of calls that pass threads <= 0 (the FFI handlers). n <= 0: CPUs in the affinity mask.
void ms_set_threads(int n) { g_threads.store(n > 0 ? std::min(n, 256) : cpus_available()); }
int ms_get_threads() { return g_threads.load(); }

// y f32 [M, N] = x [M, K] W[N, K]^T; x bf16 (uint16 bits) if wdtype == 0 (bf16 weights), else f32.
int ms_linear(const void* x, int64_t M, int64_t K, const void* w, int64_t N, float* y, int wdtype, int threads) {
  if (M < 0 || K < 0 || N < 0) return fail("ms_linear: negative size");
  if (wdtype != kWBf16 && wdtype != kWF32) return fail("ms_linear: wdtype must be 0 (bf16) or 1 (f32)");
  if (M == 0 || N == 0) return 0;
  const int isa = g_isa.load();
  Act a = prepare_x(isa, wdtype, x, size_t(K), nullptr, M, K, t_scratch.xa);
  gemm(isa, wdtype, a, M, K, w, N, y, size_t(N), threads, [](int64_t, int64_t) {});
  return 0;
}

// All the CPU experts of one layer in one call.
//   x [T, H]: bf16 bits for bf16 weights (wdtype 0), f32 for f32 weights (wdtype 1).
//   gates[e], ups[e] [F, H] and downs[e] [H, F]: expert e's weights, e < n_experts (read only for
//   experts with pairs; the pointers of the others are never followed).
//   Pairs offsets[e] .. offsets[e+1] (<= n_pairs) belong to expert e; pair p takes row tokens[p] of x
//   and adds pair_weight[p] * expert(x[tokens[p]]) to out[tokens[p]] (out f32 [T, H], in place).
//   seconds (nullable) [n_experts]: each expert's wall time (0 for an expert without pairs).
//   strategy: 0 auto, 1 row split, 2 expert parallel (see experts_core; the same result bit for bit).
// Experts are added in order, pairs in order: out is the same for any thread count and strategy.
int ms_experts(const void* x, int64_t T, int64_t H, int64_t F, int wdtype, int64_t n_experts,
               const void* const* gates, const void* const* ups, const void* const* downs, const int64_t* offsets,
               int64_t n_pairs, const int32_t* tokens, const float* pair_weight, float* out, int threads,
               double* seconds, int strategy) {
  if (T < 0 || H < 0 || F < 0 || n_experts < 0 || n_pairs < 0) return fail("ms_experts: negative size");
  if (wdtype != kWBf16 && wdtype != kWF32) return fail("ms_experts: wdtype must be 0 (bf16) or 1 (f32)");
  if (strategy < kStrategyAuto || strategy > kStrategyExperts)
    return fail("ms_experts: strategy must be 0 (auto), 1 (rows) or 2 (experts)");
  for (int64_t e = 0; e < n_experts; ++e) {
    if (offsets[e] < 0 || offsets[e + 1] < offsets[e] || offsets[e + 1] > n_pairs)
      return fail("ms_experts: offsets must be >= 0, not decrease, and stay <= n_pairs = " +
                  std::to_string(n_pairs) + " (expert " + std::to_string(e) + ")");
    for (int64_t p = offsets[e]; p < offsets[e + 1]; ++p)
      if (tokens[p] < 0 || tokens[p] >= T)
        return fail("ms_experts: token " + std::to_string(tokens[p]) + " of pair " + std::to_string(p) +
                    " is outside [0, " + std::to_string(T) + ")");
  }
  dense_experts(g_isa.load(), wdtype, x, H, F, n_experts,
               [&](int64_t e) { return ExpertW{gates[e], ups[e], downs[e]}; }, offsets, tokens, pair_weight, out,
               threads, strategy, seconds);
  return 0;
}

// y f32 [M, N] = x [M, K] W[N, K]^T for block-quantized W (qtype: ggml type id; data [N, K / blk * bytes]);
// x bf16 bits if xbf16, else f32. Activations quantized as described at the block-quantized section.
int ms_qlinear(const void* x, int xbf16, int64_t M, int64_t K, const void* w, int qtype, int64_t N, float* y,
               int threads) {
  if (M < 0 || K < 0 || N < 0) return fail("ms_qlinear: negative size");
  const std::string bad = qcheck(qtype, K, "ms_qlinear: w");
  if (!bad.empty()) return fail(bad);
  if (M == 0 || N == 0) return 0;
  QSpec sp;
  qspec(qtype, sp);
  const int isa = g_isa.load();
  const QIn a = qprepare(isa, qtype, sp, x, xbf16 != 0, size_t(K), nullptr, M, K, t_scratch.xa);
  qgemm(isa, qtype, a, M, K, static_cast<const uint8_t*>(w), N, y, size_t(N), threads, [](int64_t, int64_t) {});
  return 0;
}

// The path (0: vector kernels with Q8 activations, 1: kgemm's tiles of 16 rows (Q4_K / Q6_K, Q8 activations), 2:
// bf16-dequantized weights on AMX-BF16 with bf16 activations;
// qpath) that ms_qlinear takes for M rows of weight type qtype on the current ISA
// path; -1 for an unknown type.
int ms_qpath(int qtype, int64_t M) {
  QSpec sp;
  if (!qspec(qtype, sp)) return fail("ms_qpath: unsupported block type id " + std::to_string(qtype));
  return qpath(g_isa.load(), qtype, M);
}

// Rows from which block type qtype takes the bf16-dequantized AMX path on the amx ISA path: > 0 sets, 0 restores
// the measured default, < 0 never. For A/B of the paths and for tests.
int ms_set_amx_rows(int qtype, int rows) {
  QSpec sp;
  if (!qspec(qtype, sp)) return fail("ms_set_amx_rows: unsupported block type id " + std::to_string(qtype));
  g_amx_rows[qtype & 15].store(rows < 0 ? kNoRows : rows);
  return 0;
}

// The activation quantization of ms_qlinear for weight type qtype, as plain arrays: q int8 [M, K] and
// d f32 [M, K / xblk] (xblk 32 for Q8_0 / Q4_0, 256 for the K-quants): x ~ d * q per block.
int ms_qquantize(const float* x, int64_t M, int64_t K, int qtype, int8_t* q, float* d) {
  const std::string bad = qcheck(qtype, K, "ms_qquantize: x");
  if (!bad.empty()) return fail(bad);
  QSpec sp;
  qspec(qtype, sp);
  const QAct a = quantize_rows(sp, x, false, size_t(K), nullptr, M, K, t_scratch.xa);
  for (int64_t m = 0; m < M; ++m) {
    const QRow r = a.row(m);
    std::memcpy(q + m * K, r.q, size_t(K));
    for (int64_t b = 0; b < K / sp.xblk; ++b) d[m * (K / sp.xblk) + b] = r.dl[b * sp.xblk / 4];
  }
  return 0;
}

// Every byte the kernels read of x [M, K] f32 quantized for weights of qtype: row m's layout (QRow: q, nxo, dl, xs, bs,
// kx, and for Q8_0 / Q4_0 ux) at out + m * ms_qrow_bytes(qtype, K). For tests: each ISA path's rounding, bit for bit.
int64_t ms_qrow_bytes(int qtype, int64_t K) {
  QSpec sp;
  if (!qspec(qtype, sp)) return -1;
  const int64_t kp = pad64(K);
  return 4 * kp + bs_bytes(kp) + kx_bytes(kp) + (sp.xblk == 32 ? ux_bytes(kp) : 0);
}

int ms_qquantize_rows(const float* x, int64_t M, int64_t K, int qtype, uint8_t* out) {
  const std::string bad = qcheck(qtype, K, "ms_qquantize_rows: x");
  if (!bad.empty()) return fail(bad);
  QSpec sp;
  qspec(qtype, sp);
  const QAct a = quantize_rows(sp, x, false, size_t(K), nullptr, M, K, t_scratch.xa);
  const int64_t n = ms_qrow_bytes(qtype, K);
  for (int64_t m = 0; m < M; ++m) std::memcpy(out + m * n, a.base + m * a.stride, size_t(n));
  return 0;
}

// ms_experts for block-quantized experts: gates[e], ups[e] [F, H] of types qgate / qup and downs[e] [H, F]
// of type qdown (block data); x [T, H] bf16 bits if xbf16 else f32. Same routing arguments and guarantees.
int ms_qexperts(const void* x, int xbf16, int64_t T, int64_t H, int64_t F, int qgate, int qup, int qdown,
                int64_t n_experts, const void* const* gates, const void* const* ups, const void* const* downs,
                const int64_t* offsets, int64_t n_pairs, const int32_t* tokens, const float* pair_weight, float* out,
                int threads, double* seconds, int strategy) {
  if (T < 0 || H < 0 || F < 0 || n_experts < 0 || n_pairs < 0) return fail("ms_qexperts: negative size");
  for (const std::string& bad : {qcheck(qgate, H, "ms_qexperts: gate"), qcheck(qup, H, "ms_qexperts: up"),
                                 qcheck(qdown, F, "ms_qexperts: down")})
    if (!bad.empty()) return fail(bad);
  if (strategy < kStrategyAuto || strategy > kStrategyExperts)
    return fail("ms_qexperts: strategy must be 0 (auto), 1 (rows) or 2 (experts)");
  for (int64_t e = 0; e < n_experts; ++e) {
    if (offsets[e] < 0 || offsets[e + 1] < offsets[e] || offsets[e + 1] > n_pairs)
      return fail("ms_qexperts: offsets must be >= 0, not decrease, and stay <= n_pairs = " +
                  std::to_string(n_pairs) + " (expert " + std::to_string(e) + ")");
    for (int64_t p = offsets[e]; p < offsets[e + 1]; ++p)
      if (tokens[p] < 0 || tokens[p] >= T)
        return fail("ms_qexperts: token " + std::to_string(tokens[p]) + " of pair " + std::to_string(p) +
                    " is outside [0, " + std::to_string(T) + ")");
  }
  quant_experts(g_isa.load(), qgate, qup, qdown, x, xbf16 != 0, H, F, n_experts,
                [&](int64_t e) { return ExpertW{gates[e], ups[e], downs[e]}; }, offsets, tokens, pair_weight, out,
                threads, strategy, seconds);
  return 0;
}

// h[i] = silu(g[i]) * u[i], i < n, as the block-quantized experts compute it: vector != 0 the AVX-512 path where this
// CPU has it (silu_mul), 0 the scalar loop (tests compare the two bit for bit).
void ms_silu_mul(const float* g, const float* u, float* h, int64_t n, int vector) {
  if (n <= 0) return;
  if (vector) return silu_mul(g_best_isa, g, u, h, n);
  silu_mul_scalar(g, u, h, n);
}

// Reads `bytes` from p on `threads` threads (memory read-rate reference); returns a checksum.
double ms_read(const void* p, int64_t bytes, int threads) {
  if (bytes <= 0) return 0.0;
  const int th = resolve_threads(threads);
  const int isa = g_isa.load();
  const uint8_t* base = static_cast<const uint8_t*>(p);
  const int nparts = th;
  std::vector<uint64_t> sums(size_t(nparts), 0);
  auto part = [&](int i) {
    const int64_t a = (bytes * i / nparts) & ~int64_t(63);
    const int64_t b = i + 1 == nparts ? bytes : (bytes * (i + 1) / nparts) & ~int64_t(63);
    const uint8_t* q = base + a;
    const size_t n = size_t(b - a);
#if MS_X86
    if (isa >= kAvx512Bf16) { sums[i] = read_avx512(q, n); return; }
    if (isa == kAvx2) { sums[i] = read_avx2(q, n); return; }
#endif
    (void)isa;
    sums[i] = read_scalar(q, n);
  };
  parallel(nparts, th, part);
  uint64_t t = 0;
  for (uint64_t v : sums) t += v;
  return double(t);
}

// Counts NaN / Inf values among n floats of `bits` bits (16: bf16 when `bf16`, else fp16; 32: fp32) on
// `threads` threads: an exponent of all ones. A checkpoint scan reads every byte once.
int64_t ms_nonfinite(const void* p, int64_t n, int bits, int bf16, int threads) {
  if (n <= 0) return 0;
  const int th = resolve_threads(threads);
  std::vector<int64_t> counts(size_t(th), 0);
  auto part = [&](int i) {
    const int64_t a = n * i / th, b = n * (i + 1) / th;
    int64_t c = 0;
    if (bits == 32) {
      const uint32_t* q = static_cast<const uint32_t*>(p);
      for (int64_t k = a; k < b; ++k) c += (q[k] & 0x7f800000u) == 0x7f800000u;
    } else {
      const uint16_t mask = bf16 ? 0x7f80 : 0x7c00;
      const uint16_t* q = static_cast<const uint16_t*>(p);
      for (int64_t k = a; k < b; ++k) c += (q[k] & mask) == mask;
    }
    counts[size_t(i)] = c;
  };
  parallel(th, th, part);
  int64_t t = 0;
  for (int64_t v : counts) t += v;
  return t;
}

}  // extern "C"

// ------------------------------------------------------------------------------------------------
// XLA FFI handlers (platform "cpu"). Rank-2 buffers; the Python wrappers reshape leading dims.
// ------------------------------------------------------------------------------------------------

#if defined(MOESCOPE_HAVE_FFI)

namespace ffi = xla::ffi;

namespace {

// XLA's intra-op thread pool, lent to the kernels for the duration of a handler (see Executor);
// MOESCOPE_NATIVE_XLA_POOL=0 keeps the kernels on their own pool.
const bool g_borrow_xla_pool = [] {
  const char* v = std::getenv("MOESCOPE_NATIVE_XLA_POOL");
  return !(v && std::string(v) == "0");
}();

struct XlaPool final : Executor {
  explicit XlaPool(ffi::ThreadPool& p) : pool(p), n(g_borrow_xla_pool ? int(p.num_threads()) : 0) {}
  int threads() const override { return n; }
  void schedule(std::function<void()> task) override { pool.Schedule(std::move(task)); }
  ffi::ThreadPool& pool;
  int n;
};

struct LendPool {
  XlaPool pool;
  Executor* prev;
  explicit LendPool(ffi::ThreadPool& p) : pool(p), prev(t_executor) { t_executor = &pool; }
  ~LendPool() { t_executor = prev; }
  LendPool(const LendPool&) = delete;
  LendPool& operator=(const LendPool&) = delete;
};

std::string dims_str(ffi::Span<const int64_t> d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

template <ffi::DataType DT, ffi::DataType OUT>
ffi::Error linear_impl(ffi::Buffer<DT, 2> x, ffi::Buffer<DT, 2> w, ffi::ResultBuffer<OUT, 2> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  const int64_t M = xd[0], K = xd[1], N = wd[0];
  if (wd[1] != K || yd[0] != M || yd[1] != N)
    return ffi::Error::InvalidArgument("moescope_linear: x " + dims_str(xd) + ", w " + dims_str(wd) + ", y " +
                                       dims_str(yd) + ": expected x [M, K], w [N, K], y [M, N]");
  if (M == 0 || N == 0) return ffi::Error::Success();
  constexpr int wt = DT == ffi::DataType::BF16 ? kWBf16 : kWF32;
  const int isa = g_isa.load();
  Scratch& s = t_scratch;
  const Act a = prepare_x(isa, wt, x.untyped_data(), size_t(K), nullptr, M, K, s.xa);
  if constexpr (OUT == ffi::DataType::F32) {
    float* out = static_cast<float*>(y->untyped_data());
    gemm(isa, wt, a, M, K, w.untyped_data(), N, out, size_t(N), 0, [](int64_t, int64_t) {});
  } else {
    float* tmp = grow(s.y, size_t(M * N));
    uint16_t* out = static_cast<uint16_t*>(y->untyped_data());
    gemm(isa, wt, a, M, K, w.untyped_data(), N, tmp, size_t(N), 0, [&](int64_t n0, int64_t n1) {
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = n0; n < n1; ++n) out[m * N + n] = f32_to_bf16(tmp[m * N + n]);
    });
  }
  return ffi::Error::Success();
}

template <ffi::DataType DT>
ffi::Error swiglu_impl(ffi::Buffer<DT, 2> x, ffi::Buffer<DT, 2> gate_up, ffi::Buffer<DT, 2> down,
                       ffi::ResultBuffer<ffi::DataType::F32, 2> y) {
  auto xd = x.dimensions(), gd = gate_up.dimensions(), dd = down.dimensions(), yd = y->dimensions();
  const int64_t M = xd[0], H = xd[1], F = gd[0] / 2;
  if (gd[0] % 2 != 0 || gd[1] != H || dd[0] != H || dd[1] != F || yd[0] != M || yd[1] != H)
    return ffi::Error::InvalidArgument("moescope_swiglu: x " + dims_str(xd) + ", gate_up " + dims_str(gd) +
                                       ", down " + dims_str(dd) + ", y " + dims_str(yd) +
                                       ": expected x [M, H], gate_up [2F, H], down [H, F], y [M, H]");
  if (M == 0 || H == 0) return ffi::Error::Success();
  float* out = static_cast<float*>(y->untyped_data());
  if (F == 0) {
    std::fill(out, out + M * H, 0.0f);
    return ffi::Error::Success();
  }
  constexpr int wt = DT == ffi::DataType::BF16 ? kWBf16 : kWF32;
  const int isa = g_isa.load();
  Scratch& s = t_scratch;
  const Act a = prepare_x(isa, wt, x.untyped_data(), size_t(H), nullptr, M, H, s.xa);
  const size_t ws = wt == kWBf16 ? 2 : 4;
  const char* gu = static_cast<const char*>(gate_up.untyped_data());
  swiglu_expert(isa, wt, a, M, H, F, gu, gu + size_t(F * H) * ws, down.untyped_data(), out, 0,
                [](int64_t, int64_t) {});
  return ffi::Error::Success();
}

// table [V, ...] (any dtype of 1, 2, 4 or 8 bytes), index int32 [N] -> [N, ...]: rows copied (take_rows).
ffi::Error take_rows_impl(ffi::AnyBuffer table, ffi::Buffer<ffi::DataType::S32, 1> index,
                          ffi::Result<ffi::AnyBuffer> out) {
  auto td = table.dimensions(), od = out->dimensions();
  const int64_t N = index.dimensions()[0];
  const ffi::DataType dt = table.element_type();
  const size_t width = ffi::ByteWidth(dt);
  bool ok = td.size() >= 1 && od.size() == td.size() && od[0] == N && out->element_type() == dt &&
            (width == 1 || width == 2 || width == 4 || width == 8);
  for (size_t i = 1; ok && i < td.size(); ++i) ok = od[i] == td[i];
  switch (dt) {  // sub-byte types may be stored packed: not rows of whole bytes
    case ffi::DataType::S1: case ffi::DataType::S2: case ffi::DataType::S4: case ffi::DataType::U1:
    case ffi::DataType::U2: case ffi::DataType::U4: case ffi::DataType::F4E2M1FN: ok = false; break;
    default: break;
  }
  if (!ok)
    return ffi::Error::InvalidArgument("moescope_take_rows: table " + dims_str(td) + ", index [" +
                                       std::to_string(N) + "], out " + dims_str(od) +
                                       ": expected table [V, ...] of 1-, 2-, 4- or 8-byte elements and out "
                                       "[N, ...] of the same dtype");
  size_t row = width;
  for (size_t i = 1; i < td.size(); ++i) row *= size_t(td[i]);
  take_rows(static_cast<const char*>(table.untyped_data()), td[0], row, index.typed_data(), N,
            static_cast<char*>(out->untyped_data()));
  return ffi::Error::Success();
}

// A layer's routed experts (see ms_experts and experts_core). weights: E gate_up [2F, H] then E down [H, F],
// or one gate_up [E, 2F, H] and one down [E, H, F]; out f32 [T, H] = the weighted sum over live pairs.
template <ffi::DataType DT>
ffi::Error experts_impl(ffi::Buffer<DT, 2> x, ffi::Buffer<ffi::DataType::S32, 1> tokens,
                        ffi::Buffer<ffi::DataType::F32, 1> pair_weight, ffi::Buffer<ffi::DataType::S32, 1> offsets,
                        ffi::RemainingArgs weights, ffi::ResultBuffer<ffi::DataType::F32, 2> y, int32_t strategy) {
  auto xd = x.dimensions(), yd = y->dimensions();
  const int64_t T = xd[0], H = xd[1], P = tokens.dimensions()[0];
  const int64_t E = offsets.dimensions()[0] - 1;
  auto bad = [](const std::string& m) { return ffi::Error::InvalidArgument("moescope_experts: " + m); };
  if (yd[0] != T || yd[1] != H)
    return bad("x " + dims_str(xd) + ", out " + dims_str(yd) + ": expected the same [T, H]");
  if (pair_weight.dimensions()[0] != P)
    return bad("tokens [" + std::to_string(P) + "] and pair_weight " + dims_str(pair_weight.dimensions()) +
               ": expected the same length");
  if (E < 0) return bad("offsets must have E + 1 >= 1 elements");
  if (strategy < kStrategyAuto || strategy > kStrategyExperts) return bad("strategy must be 0, 1 or 2");
  const size_t nw = weights.size();
  const bool stacked = nw == 2 && weights.get<ffi::AnyBuffer>(0).value().dimensions().size() == 3;
  if (!stacked && nw != size_t(2 * E))
    return bad(std::to_string(nw) + " weight operands for " + std::to_string(E) +
               " experts: expected E gate_up then E down, or one stacked gate_up and one stacked down");
  // every weight: dtype of x, gate_up [2F, H] and down [H, F] (F from the first)
  int64_t F = -1;
  for (size_t i = 0; i < nw; ++i) {
    auto b = weights.get<ffi::AnyBuffer>(i);
    if (!b.has_value()) return bad("weight operand " + std::to_string(i) + " could not be decoded");
    const ffi::AnyBuffer w = b.value();
    auto d = w.dimensions();
    const bool down = stacked ? i == 1 : int64_t(i) >= E;
    const size_t rank = stacked ? 3 : 2;
    const std::string what = std::string(down ? "down" : "gate_up") + " operand " + std::to_string(i) + " " +
                             dims_str(d);
    if (w.element_type() != DT) return bad(what + ": dtype differs from x");
    if (d.size() != rank || (stacked && d[0] != E)) return bad(what + ": wrong rank or expert count");
    const int64_t r0 = d[rank - 2], r1 = d[rank - 1];
    if (!down) {
      if (r0 % 2 != 0 || r1 != H || (F >= 0 && r0 / 2 != F)) return bad(what + ": expected [2F, H]");
      F = r0 / 2;
    } else if (r0 != H || (F >= 0 && r1 != F)) {
      return bad(what + ": expected [H, F]");
    } else {
      F = r1;
    }
  }
  // routing: 0 <= offsets[0] <= ... <= offsets[E] <= P, live pairs' tokens in [0, T)
  const int32_t* off32 = offsets.typed_data();
  const int32_t* tok = tokens.typed_data();
  for (int64_t e = 0; e <= E; ++e)
    if (off32[e] < 0 || off32[e] > P || (e > 0 && off32[e] < off32[e - 1]))
      return bad("offsets must be >= 0, not decrease and stay <= P = " + std::to_string(P) + " (offsets[" +
                 std::to_string(e) + "] = " + std::to_string(off32[e]) + ")");
  if (E > 0)
    for (int64_t p = off32[0]; p < off32[E]; ++p)
      if (tok[p] < 0 || tok[p] >= T)
        return bad("token " + std::to_string(tok[p]) + " of live pair " + std::to_string(p) + " is outside [0, " +
                   std::to_string(T) + ")");
  float* out = static_cast<float*>(y->untyped_data());
  if (T * H > 0) std::memset(out, 0, size_t(T * H) * sizeof(float));
  if (E == 0 || T == 0 || H == 0) return ffi::Error::Success();
  Scratch& s = t_scratch;
  int64_t* offs = grow(s.offs, size_t(E + 1));
  for (int64_t e = 0; e <= E; ++e) offs[e] = off32[e];
  constexpr int wt = DT == ffi::DataType::BF16 ? kWBf16 : kWF32;
  const size_t ws = wt == kWBf16 ? 2 : 4;
  const size_t gu_bytes = size_t(2 * F * H) * ws, dn_bytes = size_t(H * F) * ws;
  auto expert = [&](int64_t e) {
    const char* gu;
    const char* dn;
    if (stacked) {
      gu = static_cast<const char*>(weights.get<ffi::AnyBuffer>(0).value().untyped_data()) + size_t(e) * gu_bytes;
      dn = static_cast<const char*>(weights.get<ffi::AnyBuffer>(1).value().untyped_data()) + size_t(e) * dn_bytes;
    } else {
      gu = static_cast<const char*>(weights.get<ffi::AnyBuffer>(size_t(e)).value().untyped_data());
      dn = static_cast<const char*>(weights.get<ffi::AnyBuffer>(size_t(E + e)).value().untyped_data());
    }
    return ExpertW{gu, gu + gu_bytes / 2, dn};
  };
  dense_experts(g_isa.load(), wt, x.untyped_data(), H, F, E, expert, offs, tok, pair_weight.typed_data(), out, 0,
               strategy, nullptr);
  return ffi::Error::Success();
}

// Block-quantized weights: x bf16 or f32 [M, K]; weights uint8 [rows, K / blk * bytes] of ggml type `qtype`.
std::string qcheck_rows(int qt, int64_t rows, int64_t cols, ffi::Span<const int64_t> d, size_t rank, const char* what) {
  std::string bad = qcheck(qt, cols, what);
  if (!bad.empty()) return bad;
  const size_t rb = qrow_bytes(qt, cols);
  if (d.size() != rank || d[rank - 2] != rows || size_t(d[rank - 1]) != rb)
    return std::string(what) + " " + dims_str(d) + ": expected uint8 [" + (rank == 3 ? "E, " : "") +
           std::to_string(rows) + ", " + std::to_string(rb) + "] (" + std::to_string(cols) + " columns in blocks)";
  return "";
}

bool x_kind(const ffi::AnyBuffer& x, bool& bf16) {
  bf16 = x.element_type() == ffi::DataType::BF16;
  return bf16 || x.element_type() == ffi::DataType::F32;
}

ffi::Error qlinear_impl(ffi::AnyBuffer x, ffi::Buffer<ffi::DataType::U8, 2> w, ffi::ResultBuffer<ffi::DataType::F32, 2> y,
                        int32_t qtype) {
  auto xd = x.dimensions(), yd = y->dimensions();
  bool xbf16;
  if (xd.size() != 2 || !x_kind(x, xbf16)) return ffi::Error::InvalidArgument("moescope_qlinear: x must be bf16 or f32 [M, K]");
  const int64_t M = xd[0], K = xd[1], N = yd[1];
  std::string bad = qcheck_rows(qtype, N, K, w.dimensions(), 2, "moescope_qlinear: w");
  if (bad.empty() && yd[0] != M) bad = "moescope_qlinear: y " + dims_str(yd) + ": expected [M, N]";
  if (!bad.empty()) return ffi::Error::InvalidArgument(bad);
  if (M == 0 || N == 0) return ffi::Error::Success();
  QSpec sp;
  qspec(qtype, sp);
  const int isa = g_isa.load();
  const QIn a = qprepare(isa, qtype, sp, x.untyped_data(), xbf16, size_t(K), nullptr, M, K, t_scratch.xa);
  qgemm(isa, qtype, a, M, K, w.typed_data(), N, y->typed_data(), size_t(N), 0, [](int64_t, int64_t) {});
  return ffi::Error::Success();
}

ffi::Error qswiglu_impl(ffi::AnyBuffer x, ffi::Buffer<ffi::DataType::U8, 2> gate_up, ffi::Buffer<ffi::DataType::U8, 2> down,
                        ffi::ResultBuffer<ffi::DataType::F32, 2> y, int32_t qgu, int32_t qdown, int64_t F) {
  auto xd = x.dimensions(), yd = y->dimensions();
  bool xbf16;
  if (xd.size() != 2 || !x_kind(x, xbf16)) return ffi::Error::InvalidArgument("moescope_qswiglu: x must be bf16 or f32 [M, H]");
  const int64_t M = xd[0], H = xd[1];
  std::string bad = qcheck_rows(qgu, 2 * F, H, gate_up.dimensions(), 2, "moescope_qswiglu: gate_up");
  if (bad.empty()) bad = qcheck_rows(qdown, H, F, down.dimensions(), 2, "moescope_qswiglu: down");
  if (bad.empty() && (yd[0] != M || yd[1] != H)) bad = "moescope_qswiglu: y " + dims_str(yd) + ": expected [M, H]";
  if (!bad.empty()) return ffi::Error::InvalidArgument(bad);
  if (M == 0 || H == 0) return ffi::Error::Success();
  float* out = y->typed_data();
  if (F == 0) {
    std::fill(out, out + M * H, 0.0f);
    return ffi::Error::Success();
  }
  const uint8_t* gu = gate_up.typed_data();
  qswiglu_expert(g_isa.load(), qgu, qgu, qdown, x.untyped_data(), xbf16, nullptr, M, H, F, gu,
                 gu + size_t(F) * qrow_bytes(qgu, H), down.typed_data(), out, 0, [](int64_t, int64_t) {});
  return ffi::Error::Success();
}

// A layer's block-quantized experts: weights E gate_up [2F, rb] then E down [H, rbd], or E gate [F, rb], E up
// [F, rb] and E down, or one [E, 2F, rb] and one [E, H, rbd] (uint8); see experts_impl for the routing arguments.
ffi::Error qexperts_impl(ffi::AnyBuffer x, ffi::Buffer<ffi::DataType::S32, 1> tokens,
                         ffi::Buffer<ffi::DataType::F32, 1> pair_weight, ffi::Buffer<ffi::DataType::S32, 1> offsets,
                         ffi::RemainingArgs weights, ffi::ResultBuffer<ffi::DataType::F32, 2> y, int32_t strategy,
                         int32_t qgu, int32_t qdown, int64_t F) {
  auto xd = x.dimensions(), yd = y->dimensions();
  auto bad = [](const std::string& m) { return ffi::Error::InvalidArgument("moescope_qexperts: " + m); };
  bool xbf16;
  if (xd.size() != 2 || !x_kind(x, xbf16)) return bad("x must be bf16 or f32 [T, H]");
  const int64_t T = xd[0], H = xd[1], P = tokens.dimensions()[0];
  const int64_t E = offsets.dimensions()[0] - 1;
  if (yd[0] != T || yd[1] != H) return bad("x " + dims_str(xd) + ", out " + dims_str(yd) + ": expected the same [T, H]");
  if (pair_weight.dimensions()[0] != P) return bad("tokens and pair_weight: expected the same length");
  if (E < 0) return bad("offsets must have E + 1 >= 1 elements");
  if (strategy < kStrategyAuto || strategy > kStrategyExperts) return bad("strategy must be 0, 1 or 2");
  const size_t nw = weights.size();
  const bool rank3 = nw >= 2 && weights.get<ffi::AnyBuffer>(0).value().dimensions().size() == 3;
  const bool stacked = nw == 2 && rank3;
  // stacked3: one gate [E, F, rb], one up [E, F, rb], one down [E, H, rb] (a GGUF file's three expert tensors of a
  // layer, mapped: three operands per layer where per-expert views are 3E, each a parameter of the program)
  const bool stacked3 = nw == 3 && rank3;
  // split: E gate [F, rb], E up [F, rb], E down (a GGUF file's gate and up tensors are separate mapped views)
  const bool split = !rank3 && E > 0 && nw == size_t(3 * E);
  if (!stacked && !stacked3 && !split && nw != size_t(2 * E))
    return bad(std::to_string(nw) + " weight operands for " + std::to_string(E) + " experts");
  for (size_t i = 0; i < nw; ++i) {
    auto b = weights.get<ffi::AnyBuffer>(i);
    if (!b.has_value()) return bad("weight operand " + std::to_string(i) + " could not be decoded");
    const ffi::AnyBuffer w = b.value();
    const bool down = stacked ? i == 1 : stacked3 ? i == 2 : int64_t(i) >= (split ? 2 * E : E);
    if (w.element_type() != ffi::DataType::U8) return bad("weight operand " + std::to_string(i) + ": expected uint8 blocks");
    const size_t rank = rank3 ? 3 : 2;
    if (rank3 && (w.dimensions().size() != 3 || w.dimensions()[0] != E))
      return bad("stacked weight operand " + std::to_string(i) + " " + dims_str(w.dimensions()) + ": expected E first");
    const std::string m = down ? qcheck_rows(qdown, H, F, w.dimensions(), rank, "down")
                        : stacked3 ? qcheck_rows(qgu, F, H, w.dimensions(), rank, i == 0 ? "gate" : "up")
                        : split ? qcheck_rows(qgu, F, H, w.dimensions(), rank, int64_t(i) < E ? "gate" : "up")
                                : qcheck_rows(qgu, 2 * F, H, w.dimensions(), rank, "gate_up");
    if (!m.empty()) return bad(m);
  }
  const int32_t* off32 = offsets.typed_data();
  const int32_t* tok = tokens.typed_data();
  for (int64_t e = 0; e <= E; ++e)
    if (off32[e] < 0 || off32[e] > P || (e > 0 && off32[e] < off32[e - 1]))
      return bad("offsets must be >= 0, not decrease and stay <= P = " + std::to_string(P));
  if (E > 0)
    for (int64_t p = off32[0]; p < off32[E]; ++p)
      if (tok[p] < 0 || tok[p] >= T) return bad("token " + std::to_string(tok[p]) + " of live pair " + std::to_string(p) + " is outside [0, T)");
  float* out = y->typed_data();
  if (T * H > 0) std::memset(out, 0, size_t(T * H) * sizeof(float));
  if (E == 0 || T == 0 || H == 0) return ffi::Error::Success();
  int64_t* offs = grow(t_scratch.offs, size_t(E + 1));
  for (int64_t e = 0; e <= E; ++e) offs[e] = off32[e];
  const size_t gu_bytes = size_t(2 * F) * qrow_bytes(qgu, H), dn_bytes = size_t(H) * qrow_bytes(qdown, F);
  auto expert = [&](int64_t e) {
    const uint8_t* gu;
    const uint8_t* dn;
    if (stacked) {
      gu = static_cast<const uint8_t*>(weights.get<ffi::AnyBuffer>(0).value().untyped_data()) + size_t(e) * gu_bytes;
      dn = static_cast<const uint8_t*>(weights.get<ffi::AnyBuffer>(1).value().untyped_data()) + size_t(e) * dn_bytes;
    } else if (stacked3) {
      const size_t half = gu_bytes / 2;
      gu = static_cast<const uint8_t*>(weights.get<ffi::AnyBuffer>(0).value().untyped_data()) + size_t(e) * half;
      const auto* up = static_cast<const uint8_t*>(weights.get<ffi::AnyBuffer>(1).value().untyped_data()) + size_t(e) * half;
      dn = static_cast<const uint8_t*>(weights.get<ffi::AnyBuffer>(2).value().untyped_data()) + size_t(e) * dn_bytes;
      return ExpertW{gu, up, dn};
    } else if (split) {
      gu = static_cast<const uint8_t*>(weights.get<ffi::AnyBuffer>(size_t(e)).value().untyped_data());
      const auto* up = static_cast<const uint8_t*>(weights.get<ffi::AnyBuffer>(size_t(E + e)).value().untyped_data());
      dn = static_cast<const uint8_t*>(weights.get<ffi::AnyBuffer>(size_t(2 * E + e)).value().untyped_data());
      return ExpertW{gu, up, dn};
    } else {
      gu = static_cast<const uint8_t*>(weights.get<ffi::AnyBuffer>(size_t(e)).value().untyped_data());
      dn = static_cast<const uint8_t*>(weights.get<ffi::AnyBuffer>(size_t(E + e)).value().untyped_data());
    }
    return ExpertW{gu, gu + gu_bytes / 2, dn};
  };
  quant_experts(g_isa.load(), qgu, qgu, qdown, x.untyped_data(), xbf16, H, F, E, expert, offs, tok,
                pair_weight.typed_data(), out, 0, strategy, nullptr);
  return ffi::Error::Success();
}

}  // namespace

using BufBf16 = ffi::Buffer<ffi::DataType::BF16, 2>;
using BufF32 = ffi::Buffer<ffi::DataType::F32, 2>;
using RetBf16 = ffi::ResultBuffer<ffi::DataType::BF16, 2>;
using RetF32 = ffi::ResultBuffer<ffi::DataType::F32, 2>;

using Pool_ = ffi::ThreadPool;

static ffi::Error linear_bf16(BufBf16 x, BufBf16 w, RetBf16 y, Pool_ p) {
  LendPool lend(p);
  return linear_impl(x, w, y);
}
static ffi::Error linear_f32(BufF32 x, BufF32 w, RetF32 y, Pool_ p) {
  LendPool lend(p);
  return linear_impl(x, w, y);
}
static ffi::Error swiglu_bf16(BufBf16 x, BufBf16 gu, BufBf16 d, RetF32 y, Pool_ p) {
  LendPool lend(p);
  return swiglu_impl(x, gu, d, y);
}
static ffi::Error swiglu_f32(BufF32 x, BufF32 gu, BufF32 d, RetF32 y, Pool_ p) {
  LendPool lend(p);
  return swiglu_impl(x, gu, d, y);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(ms_ffi_linear_bf16, linear_bf16,
                              ffi::Ffi::Bind().Arg<BufBf16>().Arg<BufBf16>().Ret<BufBf16>().Ctx<Pool_>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(ms_ffi_linear_f32, linear_f32,
                              ffi::Ffi::Bind().Arg<BufF32>().Arg<BufF32>().Ret<BufF32>().Ctx<Pool_>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(ms_ffi_swiglu_bf16, swiglu_bf16,
                              ffi::Ffi::Bind().Arg<BufBf16>().Arg<BufBf16>().Arg<BufBf16>().Ret<BufF32>().Ctx<Pool_>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(ms_ffi_swiglu_f32, swiglu_f32,
                              ffi::Ffi::Bind().Arg<BufF32>().Arg<BufF32>().Arg<BufF32>().Ret<BufF32>().Ctx<Pool_>());

using BufS32 = ffi::Buffer<ffi::DataType::S32, 1>;
using BufW = ffi::Buffer<ffi::DataType::F32, 1>;

static ffi::Error experts_bf16(BufBf16 x, BufS32 t, BufW pw, BufS32 o, ffi::RemainingArgs w, RetF32 y, int32_t st,
                               Pool_ p) {
  LendPool lend(p);
  return experts_impl(x, t, pw, o, w, y, st);
}
static ffi::Error experts_f32(BufF32 x, BufS32 t, BufW pw, BufS32 o, ffi::RemainingArgs w, RetF32 y, int32_t st,
                              Pool_ p) {
  LendPool lend(p);
  return experts_impl(x, t, pw, o, w, y, st);
}
static ffi::Error take_rows_ffi(ffi::AnyBuffer table, BufS32 index, ffi::Result<ffi::AnyBuffer> out, Pool_ p) {
  LendPool lend(p);
  return take_rows_impl(table, index, out);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(ms_ffi_take_rows, take_rows_ffi,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<BufS32>().Ret<ffi::AnyBuffer>().Ctx<Pool_>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(ms_ffi_experts_bf16, experts_bf16,
                              ffi::Ffi::Bind()
                                  .Arg<BufBf16>()
                                  .Arg<BufS32>()
                                  .Arg<BufW>()
                                  .Arg<BufS32>()
                                  .RemainingArgs()
                                  .Ret<BufF32>()
                                  .Attr<int32_t>("strategy")
                                  .Ctx<Pool_>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(ms_ffi_experts_f32, experts_f32,
                              ffi::Ffi::Bind()
                                  .Arg<BufF32>()
                                  .Arg<BufS32>()
                                  .Arg<BufW>()
                                  .Arg<BufS32>()
                                  .RemainingArgs()
                                  .Ret<BufF32>()
                                  .Attr<int32_t>("strategy")
                                  .Ctx<Pool_>());

using BufU8 = ffi::Buffer<ffi::DataType::U8, 2>;

static ffi::Error qlinear_ffi(ffi::AnyBuffer x, BufU8 w, RetF32 y, int32_t qtype, Pool_ p) {
  LendPool lend(p);
  return qlinear_impl(x, w, y, qtype);
}
static ffi::Error qswiglu_ffi(ffi::AnyBuffer x, BufU8 gu, BufU8 d, RetF32 y, int32_t qgu, int32_t qdown, int64_t F,
                              Pool_ p) {
  LendPool lend(p);
  return qswiglu_impl(x, gu, d, y, qgu, qdown, F);
}
static ffi::Error qexperts_ffi(ffi::AnyBuffer x, BufS32 t, BufW pw, BufS32 o, ffi::RemainingArgs w, RetF32 y, int32_t st,
                               int32_t qgu, int32_t qdown, int64_t F, Pool_ p) {
  LendPool lend(p);
  return qexperts_impl(x, t, pw, o, w, y, st, qgu, qdown, F);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(ms_ffi_qlinear, qlinear_ffi,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<BufU8>().Ret<BufF32>().Attr<int32_t>("qtype").Ctx<Pool_>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(ms_ffi_qswiglu, qswiglu_ffi,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<BufU8>()
                                  .Arg<BufU8>()
                                  .Ret<BufF32>()
                                  .Attr<int32_t>("qgu")
                                  .Attr<int32_t>("qdown")
                                  .Attr<int64_t>("F")
                                  .Ctx<Pool_>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(ms_ffi_qexperts, qexperts_ffi,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<BufS32>()
                                  .Arg<BufW>()
                                  .Arg<BufS32>()
                                  .RemainingArgs()
                                  .Ret<BufF32>()
                                  .Attr<int32_t>("strategy")
                                  .Attr<int32_t>("qgu")
                                  .Attr<int32_t>("qdown")
                                  .Attr<int64_t>("F")
                                  .Ctx<Pool_>());

extern "C" int ms_has_ffi() { return 1; }
#else
extern "C" int ms_has_ffi() { return 0; }
#endif
