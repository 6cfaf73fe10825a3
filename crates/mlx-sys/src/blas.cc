// The BLAS switch for the Linux wheels.
//
// libmlx.so leaves `cblas_sgemm` undefined and the dynamic linker binds it to the first
// definition in the process's global scope. This file defines it in the executable (the
// static shim archive is linked into every binary that uses mlx-sys), so every f32 matmul MLX
// runs comes here first and is forwarded to the selected provider:
//   - "openblas": libopenblas.so.0 (Debian's libopenblas0-pthread), loaded with dlopen at the
//     first call; about 50x the reference BLAS on sgemm on the machines we measured;
//   - "reference": the netlib reference CBLAS bundled in the wheel (mlx_cpu.libs/libblas-*).
// The default is OpenBLAS when it can be loaded, else the reference; `blas_select` switches
// at run time (benchmarks compare both in one process). mlx-core's settings module calls it
// for `MLX_SPEC_BLAS` = `openblas` | `reference` | an absolute path to another CBLAS library
// before its first evaluation. The one variable read here is OpenBLAS's own OPENBLAS_CORETYPE:
// when it is unset and OpenBLAS picks generic kernels on a CPU with AVX2 or AVX-512, the
// switch loads it again with the kernel family the CPU supports (`openblas()` below).
// Without OpenBLAS on the machine nothing fails: the reference BLAS is used.
//
// Matrix-vector shapes: MLX sends every f32 product to cblas_sgemm, including M = 1 (one
// token's activations times a weight matrix) and N = 1. OpenBLAS's sgemm packs the whole
// matrix for those shapes (about 4 GB/s here, where sgemv reads the same matrix at 14 GB/s),
// so the switch rewrites them as one cblas_sgemv of the same provider with the transposes and
// strides that compute the same product (`route_gemv`). `blas_set_gemv_routing(false)` turns
// the rewrite off (benchmarks compare both; mlx-core's settings call it for `MLX_SPEC_GEMV=off`);
// `blas_gemv_calls` counts the rewritten calls.
#include "mlx-sys/src/shim.h"
#include "mlx-sys/src/lib.rs.h"

#include <dlfcn.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <utility>

extern "C" void cblas_sgemm(int, int, int, int, int, int, float, const float*, int, const float*, int, float,
                            float*, int);

namespace {
using sgemm_fn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float,
                          float*, int);
// cblas_sgemv(order, trans, m, n, alpha, a, lda, x, incx, beta, y, incy)
using sgemv_fn = void (*)(int, int, int, int, float, const float*, int, const float*, int, float, float*, int);

// CBLAS enum values (cblas.h).
constexpr int kRowMajor = 101, kColMajor = 102, kNoTrans = 111, kTrans = 112, kConjTrans = 113;

struct Provider {
  std::string name;
  std::string path;
  sgemm_fn sgemm = nullptr;
  sgemv_fn sgemv = nullptr;  // optional: without it every call stays a sgemm
  std::string note;          // how the provider was set up, when that differs from a plain load
};

// Loads `lib` privately (RTLD_LOCAL, so its other symbols do not leak into the process) and
// returns its cblas_sgemm, or nullptr when the library or the symbol is missing.
Provider load(const std::string& name, const std::string& lib) {
  Provider p{name, lib, nullptr, nullptr, {}};
  if (lib.empty()) return p;  // dlopen("") would return the executable itself
  void* h = dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (h) {
    p.sgemm = reinterpret_cast<sgemm_fn>(dlsym(h, "cblas_sgemm"));
    p.sgemv = reinterpret_cast<sgemv_fn>(dlsym(h, "cblas_sgemv"));
  }
  // A library that resolves cblas_sgemm to this very switch would forward to itself forever.
  if (p.sgemm == &cblas_sgemm) p.sgemm = nullptr;
  if (p.sgemm) {
    Dl_info info;
    if (dladdr(reinterpret_cast<void*>(p.sgemm), &info) && info.dli_fname) p.path = info.dli_fname;
  }
  return p;
}

Provider reference() { return load("reference", MLXSYS_REFERENCE_BLAS); }

// The kernel family this CPU can run when OpenBLAS picked one below it, else empty.
// A DYNAMIC_ARCH OpenBLAS (Debian's) picks its kernels from the CPU's family and model
// numbers; a model it does not know (0.3.21 on the cloud Xeons this project runs on, which
// report a generic model) gets the generic "Prescott" kernels: SSE3, 18.5 GFLOP/s on a
// 1024^3 sgemm there against 69-84 with SkylakeX's or Cooperlake's. Only the pre-AVX2 Intel
// families count as "below": a core OpenBLAS recognises (Haswell, Zen, SkylakeX, ...) is
// never overridden.
std::string better_core(const std::string& detected) {
#if defined(__x86_64__)
  static const char* const kPreAvx2[] = {"Prescott", "Core2",    "Penryn",    "Dunnington", "Nehalem",  "Atom",
                                         "Katmai",   "Coppermine", "Northwood", "Banias",     "Sandybridge"};
  bool below = false;
  for (const char* c : kPreAvx2) below = below || detected == c;
  if (!below) return {};
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
    return "SkylakeX";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "Haswell";
#else
  (void)detected;
#endif
  return {};
}

// libopenblas.so.0 with the best kernels it has for this CPU: when the user has not named a
// core (OPENBLAS_CORETYPE, which OpenBLAS reads once, when it is loaded) and `better_core`
// finds one above the detected family, the library is unloaded and loaded again with
// OPENBLAS_CORETYPE set to it for that one load (the process's environment is restored).
// Where the first load cannot be undone (another reference holds it), it stays as it is.
Provider openblas() {
  const std::string lib = "libopenblas.so.0";
  Provider p = load("openblas", lib);
  if (!p.sgemm || std::getenv("OPENBLAS_CORETYPE")) return p;
  void* h = dlopen(p.path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  if (!h) return p;
  auto corename = reinterpret_cast<char* (*)()>(dlsym(h, "openblas_get_corename"));
  const std::string detected = corename ? corename() : "";
  const std::string core = better_core(detected);
  dlclose(h);  // the NOLOAD reference
  if (core.empty()) return p;
  dlclose(h);  // load()'s reference: the library is unloaded unless something else holds it
  if (void* kept = dlopen(p.path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD)) {
    Provider same = load("openblas", lib);  // still loaded elsewhere: keep its kernels
    dlclose(kept);
    return same;
  }
  setenv("OPENBLAS_CORETYPE", core.c_str(), 0);
  p = load("openblas", lib);
  unsetenv("OPENBLAS_CORETYPE");
  p.note = "kernels " + core + " chosen from the CPU's features; OpenBLAS detected " + detected;
  return p;
}

std::mutex g_mutex;
Provider g_active;
std::atomic<sgemm_fn> g_sgemm{nullptr};
std::atomic<sgemv_fn> g_sgemv{nullptr};
std::atomic<bool> g_route_gemv{true};
std::atomic<uint64_t> g_calls{0};
std::atomic<uint64_t> g_gemv_calls{0};

void install(Provider p) {
  g_active = std::move(p);
  g_sgemv.store(g_active.sgemv, std::memory_order_release);
  g_sgemm.store(g_active.sgemm, std::memory_order_release);
}

bool is_trans(int t) { return t == kTrans || t == kConjTrans; }  // real data: ConjTrans == Trans

// Computes C = alpha * op(A) @ op(B) + beta * C with one sgemv when op(A) has one row or
// op(B) one column; returns false (nothing done) for any other shape or an argument it does
// not handle, and the caller runs sgemm. All arrays are row-major after the ColMajor swap:
// a column-major C = op(A) op(B) is the row-major C^T = op(B)^T op(A)^T.
bool route_gemv(sgemv_fn gemv, int order, int ta, int tb, int m, int n, int k, float alpha, const float* a, int lda,
                const float* b, int ldb, float beta, float* c, int ldc) {
  if (order == kColMajor) {
    std::swap(ta, tb);
    std::swap(m, n);
    std::swap(a, b);
    std::swap(lda, ldb);
  } else if (order != kRowMajor) {
    return false;
  }
  // K = 0 must still scale C by beta, which a sgemv with an empty dimension skips.
  if (k <= 0 || m <= 0 || n <= 0 || lda <= 0 || ldb <= 0 || ldc <= 0) return false;
  if (m == 1) {
    // x = op(A)[0, :] (K values): A is [1, K] (stride 1) or, transposed, [K, 1] (stride lda).
    int incx = is_trans(ta) ? lda : 1;
    // y[1, N] = x @ op(B): B [K, N] -> B^T x (Trans); B^T stored as [N, K] -> B x (NoTrans).
    if (is_trans(tb)) {
      gemv(kRowMajor, kNoTrans, n, k, alpha, b, ldb, a, incx, beta, c, 1);
    } else {
      gemv(kRowMajor, kTrans, k, n, alpha, b, ldb, a, incx, beta, c, 1);
    }
    return true;
  }
  if (n == 1) {
    // x = op(B)[:, 0]: B is [K, 1] (stride ldb) or, transposed, [1, K] (stride 1).
    int incx = is_trans(tb) ? 1 : ldb;
    // y[M, 1] (stride ldc) = op(A) x: A [M, K] -> A x; A stored [K, M] -> A^T x.
    if (is_trans(ta)) {
      gemv(kRowMajor, kTrans, k, m, alpha, a, lda, b, incx, beta, c, ldc);
    } else {
      gemv(kRowMajor, kNoTrans, m, k, alpha, a, lda, b, incx, beta, c, ldc);
    }
    return true;
  }
  return false;
}

// Picks the default provider once (under g_mutex).
void ensure_selected() {
  if (g_sgemm.load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_sgemm.load(std::memory_order_relaxed)) return;
  // OpenBLAS when present, else the wheel's reference BLAS. Another choice (MLX_SPEC_BLAS)
  // arrives from mlx-core's settings module through blas_select.
  Provider p = openblas();
  if (!p.sgemm) p = reference();
  if (!p.sgemm) std::abort();  // the wheel's own BLAS is a dependency of libmlx: cannot be missing
  install(std::move(p));
}

std::string describe(const Provider& p) {
  std::string s = p.name + " (" + p.path + ")";
  if (p.name == "openblas" || p.name == "custom") {
    void* h = dlopen(p.path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (h) {
      auto config = reinterpret_cast<char* (*)()>(dlsym(h, "openblas_get_config"));
      auto threads = reinterpret_cast<int (*)()>(dlsym(h, "openblas_get_num_threads"));
      if (config) s += " " + std::string(config());
      if (threads) s += " threads=" + std::to_string(threads());
      dlclose(h);
    }
  }
  if (!p.note.empty()) s += " (" + p.note + ")";
  return s;
}
}  // namespace

extern "C" __attribute__((visibility("default"))) void cblas_sgemm(int order, int trans_a, int trans_b, int m,
                                                                    int n, int k, float alpha, const float* a,
                                                                    int lda, const float* b, int ldb, float beta,
                                                                    float* c, int ldc) {
  ensure_selected();
  g_calls.fetch_add(1, std::memory_order_relaxed);
  sgemv_fn gemv = g_sgemv.load(std::memory_order_acquire);
  if (gemv && (m == 1 || n == 1) && g_route_gemv.load(std::memory_order_relaxed) &&
      route_gemv(gemv, order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)) {
    g_gemv_calls.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  g_sgemm.load(std::memory_order_acquire)(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

namespace mlxsys {
rust::String blas_info() {
  ensure_selected();
  std::lock_guard<std::mutex> lock(g_mutex);
  return rust::String(describe(g_active));
}

uint64_t blas_sgemm_calls() { return g_calls.load(std::memory_order_relaxed); }

uint64_t blas_gemv_calls() { return g_gemv_calls.load(std::memory_order_relaxed); }

bool blas_set_gemv_routing(bool on) { return g_route_gemv.exchange(on); }

bool blas_select(rust::Str which) {
  std::string w(which);
  Provider p = w == "reference" ? reference() : w == "openblas" ? openblas() : load("custom", w);
  if (!p.sgemm) return false;
  // No ensure_selected() first: a choice made before the first sgemm (mlx-core's settings)
  // must not load the default provider (OpenBLAS starts its threads when loaded).
  std::lock_guard<std::mutex> lock(g_mutex);
  install(std::move(p));
  return true;
}
}  // namespace mlxsys
