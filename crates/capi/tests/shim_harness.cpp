// A C++ caller of libvmmalloc.so, as PyTorch's CUDAPluggableAllocator is:
// dlopen + the function pointers PyTorch takes (torch/csrc/cuda/
// CUDAPluggableAllocator.cpp). Built and run by tests/shim.rs:
//   shim_harness <path to libvmmalloc.so> <backend>
// Prints "ok <n> checks" and exits 0, or prints the failed check and exits 1.

#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>

struct CUstream_st;
typedef CUstream_st* cudaStream_t;
typedef std::pair<unsigned long long, unsigned long long> MempoolId_t;

// PyTorch's hook types (CUDAPluggableAllocator.h).
using MallocFn = void* (*)(size_t, int, cudaStream_t);
using FreeFn = void (*)(void*, size_t, int, cudaStream_t);
using BeginFn = void (*)(int, MempoolId_t, std::function<bool(cudaStream_t)>);
using EndFn = void (*)(int, MempoolId_t);
using ReleaseFn = void (*)(int, MempoolId_t);

static int checks = 0;
#define CHECK(cond, ...)                                       \
  do {                                                         \
    ++checks;                                                  \
    if (!(cond)) {                                             \
      std::printf("FAILED line %d: %s: ", __LINE__, #cond);    \
      std::printf(__VA_ARGS__);                                \
      std::printf("\n");                                       \
      std::exit(1);                                            \
    }                                                          \
  } while (0)

static void* lib;
template <typename T>
static T sym(const char* name) {
  void* p = dlsym(lib, name);
  if (!p) {
    std::printf("FAILED: symbol %s not exported: %s\n", name, dlerror());
    std::exit(1);
  }
  return reinterpret_cast<T>(p);
}

struct FakeOom : std::runtime_error {
  using std::runtime_error::runtime_error;
};
static void throw_fake_oom(const char* what) { throw FakeOom(what); }

int main(int argc, char** argv) {
  if (argc != 3) {
    std::printf("usage: shim_harness LIB BACKEND\n");
    return 2;
  }
  lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    std::printf("FAILED: dlopen: %s\n", dlerror());
    return 1;
  }
  std::string backend = argv[2];
  auto malloc_fn = sym<MallocFn>("vmmalloc_malloc");
  auto free_fn = sym<FreeFn>("vmmalloc_free");
  auto begin = sym<BeginFn>("vmmalloc_begin_allocate_to_pool");
  auto end = sym<EndFn>("vmmalloc_end_allocate_to_pool");
  auto release = sym<ReleaseFn>("vmmalloc_release_pool");
  auto set_thrower = sym<void (*)(void (*)(const char*))>("vmmalloc_set_oom_thrower");
  auto configure = sym<int (*)(const char*)>("vmmalloc_configure");
  auto reset = sym<void (*)()>("vmmalloc_reset_for_tests");
  auto last_error = sym<const char* (*)()>("vmmalloc_last_error");
  auto stats = sym<char* (*)(int)>("vmmalloc_memory_stats_json");
  auto free_string = sym<void (*)(char*)>("vmmalloc_free_string");
  auto record_stream = sym<void (*)(void*, void*)>("vmmalloc_record_stream");
  auto empty_cache = sym<void (*)()>("vmmalloc_empty_cache");
  auto err = [&]() { return std::string(last_error() ? last_error() : "(none)"); };
  auto stat = [&](const char* name) {
    char* s = stats(0);
    std::string j = s ? s : "";
    free_string(s);
    std::string key = std::string("\"") + name + "\":";
    size_t at = j.find(key);
    return at == std::string::npos ? -1L : std::atol(j.c_str() + at + key.size());
  };
  auto live = [&]() { return stat("allocation.all.current"); };
  const size_t MiB = 1 << 20;
  std::string base = "device:host,capacity_gb:0.0625,log:off,backend:" + backend;

  // 1. Default (on_oom:raise): out of memory throws std::runtime_error
  //    (PyTorch: RuntimeError) whose message starts with "CUDA out of memory.".
  reset();
  CHECK(configure(base.c_str()) == 0, "%s", err().c_str());
  void* a = malloc_fn(40 * MiB, 0, nullptr);
  CHECK(a != nullptr, "%s", err().c_str());
  bool thrown = false;
  try {
    malloc_fn(40 * MiB, 0, nullptr);
  } catch (const std::runtime_error& e) {
    thrown = true;
    std::string what = e.what();
    CHECK(what.rfind("CUDA out of memory.", 0) == 0, "message: %s", what.c_str());
    CHECK(what.find("Tried to allocate 40.00 MiB") != std::string::npos, "%s", what.c_str());
    CHECK(what.find("GPU 0 has a total capacity of 64.00 MiB") != std::string::npos, "%s",
          what.c_str());
  }
  CHECK(thrown, "out of memory did not throw");
  // Other failures throw too (PyTorch would store a NULL tensor otherwise).
  thrown = false;
  try {
    malloc_fn(MiB, 77, nullptr);
  } catch (const std::runtime_error& e) {
    thrown = true;
    std::string what = e.what();
    CHECK(what.rfind("vmmalloc: invalid argument: ", 0) == 0 &&
              what.find("invalid device ordinal 77") != std::string::npos,
          "%s", what.c_str());
  }
  CHECK(thrown, "a bad ordinal did not throw");
  // Size 0 is NULL without an exception (an empty tensor).
  CHECK(malloc_fn(0, 0, nullptr) == nullptr, "size 0");
  // 2. The companion's thrower (c10::OutOfMemoryError in a real PyTorch).
  set_thrower(throw_fake_oom);
  thrown = false;
  try {
    malloc_fn(40 * MiB, 0, nullptr);
  } catch (const FakeOom& e) {
    thrown = true;
    CHECK(std::string(e.what()).rfind("CUDA out of memory.", 0) == 0, "%s", e.what());
  }
  CHECK(thrown, "the registered thrower was not used");
  set_thrower(nullptr);
  free_fn(a, 40 * MiB, 0, nullptr);
  CHECK(live() == 0, "live %ld", live());

  // 3. on_oom:null keeps the C contract: NULL, reason in the last error.
  reset();
  CHECK(configure((base + ",on_oom:null").c_str()) == 0, "%s", err().c_str());
  a = malloc_fn(40 * MiB, 0, nullptr);
  CHECK(a != nullptr, "%s", err().c_str());
  void* b = nullptr;
  try {
    b = malloc_fn(40 * MiB, 0, nullptr);
  } catch (...) {
    CHECK(false, "on_oom:null threw");
  }
  CHECK(b == nullptr && err().find("Tried to allocate 40.00 MiB") != std::string::npos, "%s",
        err().c_str());
  free_fn(a, 40 * MiB, 0, nullptr);

  // 4. Graph pools through PyTorch's hook signatures: allocations on the
  //    captured stream go to the pool, others to the main allocator; frees
  //    follow PyTorch (c10/cuda/CUDACachingAllocator.cpp, free()): only a
  //    block with record_stream uses waits for the capture to end.
  reset();
  std::string roomy = "device:host,capacity_gb:1,log:off,backend:" + backend;
  CHECK(configure(roomy.c_str()) == 0, "%s", err().c_str());
  cudaStream_t captured = reinterpret_cast<cudaStream_t>(0x100);
  MempoolId_t pool{0, 1};
  auto throws = [&](auto call, const char* needle) {
    try {
      call();
    } catch (const std::runtime_error& e) {
      std::string what = e.what();
      CHECK(what.find(needle) != std::string::npos, "threw %s, expected %s", what.c_str(), needle);
      return;
    }
    CHECK(false, "did not throw (expected %s)", needle);
  };
  void* before = malloc_fn(MiB, 0, nullptr);
  if (backend != "expandable") {
    // Only expandable keeps private pools: a capture is refused, loudly.
    throws([&] { begin(0, pool, [captured](cudaStream_t s) { return s == captured; }); },
           "has no CUDA-graph private pools");
    void* p = malloc_fn(MiB, 0, captured);  // not routed anywhere: main allocator
    CHECK(p != nullptr && live() == 2, "live %ld", live());
    free_fn(p, MiB, 0, captured);
    free_fn(before, MiB, 0, nullptr);
    CHECK(live() == 0, "live %ld", live());
    reset();
    std::printf("ok %d checks\n", checks);
    return 0;
  }
  begin(0, pool, [captured](cudaStream_t s) { return s == captured; });
  CHECK(last_error() == nullptr, "%s", err().c_str());
  // A free of the main allocator during a capture is never deferred.
  free_fn(before, MiB, 0, nullptr);
  CHECK(last_error() == nullptr, "%s", err().c_str());
  CHECK(stat("vmmalloc.deferred_frees") == 0 && live() == 0, "deferred %ld, live %ld",
        stat("vmmalloc.deferred_frees"), live());
  empty_cache();  // returns nothing during a capture, and says nothing wrong
  CHECK(last_error() == nullptr, "%s", err().c_str());
  void* in_pool = malloc_fn(3 * MiB, 0, captured);
  void* outside = malloc_fn(3 * MiB, 0, nullptr);
  CHECK(in_pool && outside, "%s", err().c_str());
  // Pool bytes are in the device's figures, as PyTorch counts them.
  CHECK(live() == 2, "the allocator holds %ld allocations, expected 2", live());
  CHECK(stat("vmmalloc.graph_pool_allocated_bytes") >= long(3 * MiB), "pool bytes %ld",
        stat("vmmalloc.graph_pool_allocated_bytes"));
  // A temporary freed during the capture is reused by it: 50 rounds of
  // 16 MiB leave the pool's reservation where one round left it.
  void* tmp = malloc_fn(16 * MiB, 0, captured);
  free_fn(tmp, 16 * MiB, 0, captured);
  long reserved = stat("vmmalloc.graph_pool_reserved_bytes");
  for (int i = 0; i < 50; ++i) {
    void* t = malloc_fn(16 * MiB, 0, captured);
    CHECK(t == tmp, "round %d: %p, not the freed %p", i, t, tmp);
    free_fn(t, 16 * MiB, 0, captured);
  }
  CHECK(stat("vmmalloc.graph_pool_reserved_bytes") == reserved, "pool grew to %ld from %ld",
        stat("vmmalloc.graph_pool_reserved_bytes"), reserved);
  std::memset(in_pool, 0x5a, 3 * MiB);
  // A block used by another stream (record_stream) waits for the capture to end.
  void* shared = malloc_fn(MiB, 0, captured);
  record_stream(shared, nullptr);  // the default stream (host devices know no other)
  CHECK(last_error() == nullptr, "%s", err().c_str());
  free_fn(shared, MiB, 0, captured);
  CHECK(stat("vmmalloc.deferred_frees") == 1, "deferred %ld", stat("vmmalloc.deferred_frees"));
  // A second capture into the same pool is refused while the first runs.
  throws([&] { begin(0, pool, [](cudaStream_t) { return true; }); }, "already recording");
  end(0, pool);
  CHECK(last_error() == nullptr, "%s", err().c_str());
  // The first allocation after the capture applies the deferred free; the
  // stream allocates from the main allocator again, and main-allocator
  // churn never touches the pool's memory.
  void* after = malloc_fn(MiB, 0, captured);
  CHECK(stat("vmmalloc.deferred_frees") == 0, "deferred %ld", stat("vmmalloc.deferred_frees"));
  CHECK(live() == 3, "live %ld", live());
  for (int i = 0; i < 20; ++i) {
    void* p = malloc_fn((i + 1) * MiB, 0, nullptr);
    CHECK(p != nullptr, "%s", err().c_str());
    std::memset(p, 0xee, (i + 1) * MiB);
    free_fn(p, 0, 0, nullptr);
  }
  empty_cache();
  for (size_t i = 0; i < 3 * MiB; i += 4096) {
    CHECK(static_cast<unsigned char*>(in_pool)[i] == 0x5a, "pool byte %zu overwritten", i);
  }
  // Bad input: unknown pools, ending twice (both throw, as PyTorch's
  // TORCH_CHECKs), releasing twice (logged: releasePool runs in destructors).
  throws([&] { end(0, MempoolId_t{9, 9}); }, "unknown pool (9, 9)");
  throws([&] { end(0, pool); }, "not currently recording");
  release(0, pool);
  CHECK(last_error() == nullptr, "%s", err().c_str());
  release(0, pool);
  CHECK(err().find("no users left") != std::string::npos, "%s", err().c_str());
  release(0, MempoolId_t{5, 5});
  CHECK(err().find("unknown pool (5, 5)") != std::string::npos, "%s", err().c_str());
  // The graph's output is still usable; once freed, empty_cache returns the
  // pool's memory and the pool is gone.
  CHECK(static_cast<unsigned char*>(in_pool)[4096] == 0x5a, "output lost after release");
  CHECK(stat("vmmalloc.graph_pools") == 1, "pools %ld", stat("vmmalloc.graph_pools"));
  free_fn(in_pool, 3 * MiB, 0, captured);
  CHECK(last_error() == nullptr, "%s", err().c_str());
  empty_cache();
  CHECK(stat("vmmalloc.graph_pools") == 0, "pools %ld", stat("vmmalloc.graph_pools"));
  CHECK(stat("vmmalloc.graph_pool_reserved_bytes") == 0, "pool bytes %ld",
        stat("vmmalloc.graph_pool_reserved_bytes"));
  free_fn(outside, 0, 0, nullptr);
  free_fn(after, 0, 0, nullptr);
  CHECK(live() == 0, "live %ld", live());
  reset();
  std::printf("ok %d checks\n", checks);
  return 0;
}
