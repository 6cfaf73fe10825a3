// The BLAS switch for the Linux wheels.
//
// libmlx.so leaves `cblas_sgemm` undefined and the dynamic linker binds it to the first
// definition in the process's global scope. This file defines it in the executable (the
// static shim archive is linked into every binary that uses mlx-sys), so every f32 matmul MLX
// runs comes here first and is forwarded to the selected provider:
//   - "openblas": libopenblas.so.0 (Debian's libopenblas0-pthread), loaded with dlopen at the
//     first call; about 50x the reference BLAS on sgemm on the machines we measured;
//   - "reference": the netlib reference CBLAS bundled in the wheel (mlx_cpu.libs/libblas-*).
// The default is OpenBLAS when it can be loaded, else the reference; `MLX_SPEC_BLAS` =
// `openblas` | `reference` | an absolute path to another CBLAS library overrides it, and
// `blas_select` switches at run time (benchmarks compare both in one process).
// Without OpenBLAS on the machine nothing fails: the reference BLAS is used.
#include "mlx-sys/src/shim.h"
#include "mlx-sys/src/lib.rs.h"

#include <dlfcn.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

extern "C" void cblas_sgemm(int, int, int, int, int, int, float, const float*, int, const float*, int, float,
                            float*, int);

namespace {
using sgemm_fn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float,
                          float*, int);

struct Provider {
  std::string name;
  std::string path;
  sgemm_fn sgemm = nullptr;
};

// Loads `lib` privately (RTLD_LOCAL, so its other symbols do not leak into the process) and
// returns its cblas_sgemm, or nullptr when the library or the symbol is missing.
Provider load(const std::string& name, const std::string& lib) {
  Provider p{name, lib, nullptr};
  if (lib.empty()) return p;  // dlopen("") would return the executable itself
  void* h = dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (h) p.sgemm = reinterpret_cast<sgemm_fn>(dlsym(h, "cblas_sgemm"));
  // A library that resolves cblas_sgemm to this very switch would forward to itself forever.
  if (p.sgemm == &cblas_sgemm) p.sgemm = nullptr;
  if (p.sgemm) {
    Dl_info info;
    if (dladdr(reinterpret_cast<void*>(p.sgemm), &info) && info.dli_fname) p.path = info.dli_fname;
  }
  return p;
}

Provider reference() { return load("reference", MLXSYS_REFERENCE_BLAS); }
Provider openblas() { return load("openblas", "libopenblas.so.0"); }

std::mutex g_mutex;
Provider g_active;
std::atomic<sgemm_fn> g_sgemm{nullptr};
std::atomic<uint64_t> g_calls{0};

void install(Provider p) {
  g_active = std::move(p);
  g_sgemm.store(g_active.sgemm, std::memory_order_release);
}

// Picks the default provider once (under g_mutex).
void ensure_selected() {
  if (g_sgemm.load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_sgemm.load(std::memory_order_relaxed)) return;
  const char* env = std::getenv("MLX_SPEC_BLAS");
  std::string want = env && *env ? env : "auto";
  Provider p;
  if (want == "reference") {
    p = reference();
  } else if (want == "openblas" || want == "auto") {
    p = openblas();
  } else {
    p = load("custom", want);
  }
  if (!p.sgemm && want != "auto" && want != "reference") {
    std::fprintf(stderr,
                 "mlx-sys: MLX_SPEC_BLAS=%s: cannot load a cblas_sgemm from it; using the reference BLAS "
                 "(expected openblas, reference, or the path of a CBLAS library)\n",
                 want.c_str());
  }
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
    }
  }
  return s;
}
}  // namespace

extern "C" __attribute__((visibility("default"))) void cblas_sgemm(int order, int trans_a, int trans_b, int m,
                                                                    int n, int k, float alpha, const float* a,
                                                                    int lda, const float* b, int ldb, float beta,
                                                                    float* c, int ldc) {
  ensure_selected();
  g_calls.fetch_add(1, std::memory_order_relaxed);
  g_sgemm.load(std::memory_order_acquire)(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

namespace mlxsys {
rust::String blas_info() {
  ensure_selected();
  std::lock_guard<std::mutex> lock(g_mutex);
  return rust::String(describe(g_active));
}

uint64_t blas_sgemm_calls() { return g_calls.load(std::memory_order_relaxed); }

bool blas_select(rust::Str which) {
  std::string w(which);
  Provider p = w == "reference" ? reference() : w == "openblas" ? openblas() : load("custom", w);
  if (!p.sgemm) return false;
  ensure_selected();
  std::lock_guard<std::mutex> lock(g_mutex);
  install(std::move(p));
  return true;
}
}  // namespace mlxsys
