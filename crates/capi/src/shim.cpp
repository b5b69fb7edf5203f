// libvmmalloc's C++ entry points: the functions PyTorch calls from C++ that
// must be able to throw, or that take C++ types.
//
// * vmmalloc_malloc: PyTorch's CUDAPluggableAllocator::malloc
//   (torch/csrc/cuda/CUDAPluggableAllocator.cpp) stores and returns whatever
//   alloc_fn_ returns and never checks for NULL, so a failed allocation must
//   throw. The Rust side never unwinds: vmmalloc_try_malloc returns an error
//   code and leaves its message in vmmalloc_last_error(); this function, which
//   has no Rust frame below it when it throws, turns that into a C++
//   exception. PyTorch's exception translation (torch/csrc/Exceptions.h,
//   CATCH_CORE_ERRORS) turns a std::exception into a Python RuntimeError
//   carrying what(), and a c10::OutOfMemoryError into
//   torch.cuda.OutOfMemoryError; the latter needs PyTorch's headers, so it is
//   thrown by an optional companion registered with vmmalloc_set_oom_thrower.
// * vmmalloc_begin_allocate_to_pool / _end_ / _release_pool: the CUDA graph
//   hooks of CUDAPluggableAllocator (set_begin_allocate_to_pool,
//   set_end_allocate_to_pool_fn, set_release_pool). Their C++ signatures are
//   in the same file; the filter is a std::function, so the registry of
//   captures underway lives here, as DeviceCachingAllocator's
//   captures_underway does in c10/cuda/CUDACachingAllocator.cpp.
//
// Exported from the cdylib by build.rs's version script (exports.map).

#include <dlfcn.h>

#include <atomic>
#include <cstdlib>
#include <cstddef>
#include <cstdio>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

// cudaStream_t and c10::cuda::MempoolId_t without the CUDA or PyTorch
// headers: driver_types.h `typedef struct CUstream_st* cudaStream_t;`,
// c10/cuda/CUDAGraphsC10Utils.h `using CaptureId_t = unsigned long long;
// using MempoolId_t = std::pair<CaptureId_t, CaptureId_t>;`.
struct CUstream_st;
typedef CUstream_st* cudaStream_t;
typedef unsigned long long CaptureId_t;
typedef std::pair<CaptureId_t, CaptureId_t> MempoolId_t;
typedef std::function<bool(cudaStream_t)> StreamFilter;

extern "C" {
// The Rust side (lib.rs). Codes (error.rs): 0 ok, 1 out of memory, 2 invalid
// argument, 3 driver error, 4 allocator failed, 5 unsupported.
int vmmalloc_try_malloc(size_t size, int device, void* stream, void** out);
int vmmalloc_pool_try_malloc(size_t size, int device, void* stream, CaptureId_t pool_hi,
                             CaptureId_t pool_lo, void** out);
int vmmalloc_pool_begin(int device, CaptureId_t pool_hi, CaptureId_t pool_lo);
int vmmalloc_pool_end(int device, CaptureId_t pool_hi, CaptureId_t pool_lo);
int vmmalloc_pool_release(int device, CaptureId_t pool_hi, CaptureId_t pool_lo);
int vmmalloc_raises(void);
int vmmalloc_forked(void);
const char* vmmalloc_last_error(void);
}

namespace {

struct Capture {
  int device;
  MempoolId_t pool;
  StreamFilter filter;
};

// Captures underway (PyTorch allows several at once, on different streams).
// `active` lets the hot path skip the lock when there is none.
std::mutex captures_mutex;
std::vector<Capture>* captures = new std::vector<Capture>();  // never freed: used until exit
std::atomic<int> active{0};

// The optional companion's thrower: throws c10::OutOfMemoryError(what).
std::atomic<void (*)(const char*)> oom_thrower{nullptr};
// The companion's out-of-memory handler (preferred over the thrower): told
// the device and the failed request's size (PyTorch's OutOfMemoryObserver
// arguments), it notifies observers and throws c10::OutOfMemoryError(what).
typedef void (*OomHandler)(int device, size_t size, const char* what);
std::atomic<OomHandler> oom_handler{nullptr};

std::string last_error_text() {
  const char* e = vmmalloc_last_error();
  return e ? std::string(e) : std::string("no reason recorded");
}

// The pool of the first capture underway on `device` whose filter accepts
// `stream`, as DeviceCachingAllocator::malloc picks it (the first entry of
// captures_underway whose filter returns true).
bool pool_for(int device, cudaStream_t stream, MempoolId_t* pool) {
  if (active.load(std::memory_order_acquire) == 0 || vmmalloc_forked()) return false;
  std::lock_guard<std::mutex> g(captures_mutex);
  for (const Capture& c : *captures) {
    if (c.device == device && c.filter && c.filter(stream)) {
      *pool = c.pool;
      return true;
    }
  }
  return false;
}

// While a capture is underway, allocate in relaxed capture mode, as PyTorch
// does around every device allocation during capture
// (c10/cuda/CUDACachingAllocator.cpp, cudaMallocMaybeCapturing:
// `CUDAStreamCaptureModeGuard g{cudaStreamCaptureModeRelaxed}`): in the
// default global mode (torch.cuda.graph's capture_error_mode="global") the
// driver would reject "potentially unsafe" calls made by this thread while
// any capture is underway. cuThreadExchangeStreamCaptureMode (cuda.h) is
// looked up in the libcuda already loaded (RTLD_NOLOAD: none on host/sim
// devices, where there is nothing to do).
typedef int (*ExchangeMode)(int* mode);
constexpr int CU_STREAM_CAPTURE_MODE_RELAXED = 2;  // cuda.h CUstreamCaptureMode

ExchangeMode exchange_mode() {
  static ExchangeMode fn = []() -> ExchangeMode {
    const char* names[] = {std::getenv("VMMALLOC_CUDA_LIBRARY"), "libcuda.so.1", "libcuda.so"};
    for (const char* name : names) {
      if (!name || !*name) continue;
      if (void* h = dlopen(name, RTLD_NOW | RTLD_NOLOAD)) {
        if (void* f = dlsym(h, "cuThreadExchangeStreamCaptureMode")) {
          return reinterpret_cast<ExchangeMode>(f);
        }
      }
    }
    return nullptr;
  }();
  return fn;
}

struct RelaxedCaptureMode {
  ExchangeMode fn = nullptr;
  int previous = CU_STREAM_CAPTURE_MODE_RELAXED;
  explicit RelaxedCaptureMode(bool capturing) {
    if (!capturing) return;
    fn = exchange_mode();
    if (fn && fn(&previous) != 0) fn = nullptr;  // the mode was not changed
  }
  ~RelaxedCaptureMode() {
    if (fn) fn(&previous);  // restores the thread's mode (also when throwing)
  }
};

// The kind's name for a code other than out of memory (error.rs, ErrorKind::name).
const char* kind_name(int code) {
  switch (code) {
    case 2: return "invalid argument";
    case 3: return "driver error";
    case 4: return "allocator failed";
    case 5: return "unsupported";
    default: return "error";
  }
}

// One exception per kind (error.rs has the table): out of memory is
// c10::OutOfMemoryError (companion) or std::runtime_error starting "CUDA out
// of memory."; every other kind a std::runtime_error "vmmalloc: <kind>: ...",
// which PyTorch raises as RuntimeError.
[[noreturn]] void raise(int code, size_t size, int device) {
  if (code == 1) {
    std::string what = "CUDA out of memory. vmmalloc: " + last_error_text();
    if (OomHandler h = oom_handler.load(std::memory_order_acquire)) {
      h(device, size, what.c_str());  // throws c10::OutOfMemoryError
    }
    if (void (*t)(const char*) = oom_thrower.load(std::memory_order_acquire)) {
      t(what.c_str());  // throws c10::OutOfMemoryError
    }
    throw std::runtime_error(what);
  }
  throw std::runtime_error(std::string("vmmalloc: ") + kind_name(code) + ": " + last_error_text());
}

}  // namespace

// vmmalloc_malloc while a capture is underway somewhere in the process: the
// request may belong to a graph pool, and the capture mode is relaxed around
// it. Out of line, so that the hot path below sets up no frame for the guard.
__attribute__((noinline, cold)) static int malloc_during_capture(size_t size, int device, void* stream,
                                                                 void** out) {
  MempoolId_t pool;
  RelaxedCaptureMode relaxed(true);
  return pool_for(device, static_cast<cudaStream_t>(stream), &pool)
             ? vmmalloc_pool_try_malloc(size, device, stream, pool.first, pool.second, out)
             : vmmalloc_try_malloc(size, device, stream, out);
}

// A failed vmmalloc_malloc: throws (or returns NULL, see below).
__attribute__((noinline, cold)) static void* malloc_failed(int rc, size_t size, int device) {
  if (vmmalloc_raises()) raise(rc, size, device);
  return nullptr;
}

extern "C" {

// PyTorch's alloc_fn. Throws on failure unless on_oom:null (NULL) or
// on_oom:abort (the Rust side aborts). Size 0 returns NULL without throwing
// (an empty tensor needs no memory; CUDACachingAllocator returns nullptr too).
__attribute__((visibility("default"))) void* vmmalloc_malloc(size_t size, int device, void* stream) {
  void* out = nullptr;
  // No capture underway in this process (the hot path): no pool to route
  // to, no capture mode to relax.
  int rc = active.load(std::memory_order_acquire) == 0 ? vmmalloc_try_malloc(size, device, stream, &out)
                                                       : malloc_during_capture(size, device, stream, &out);
  if (rc == 0) return out;
  return malloc_failed(rc, size, device);
}

// Registers the companion's thrower (NULL: back to std::runtime_error).
__attribute__((visibility("default"))) void vmmalloc_set_oom_thrower(void (*thrower)(const char*)) {
  oom_thrower.store(thrower, std::memory_order_release);
}

// Registers the companion's out-of-memory handler (NULL: none): called with
// the device, the failed request's size and the message when
// vmmalloc_malloc runs out of memory; it must throw (if it returns, the
// thrower or std::runtime_error follows).
__attribute__((visibility("default"))) void vmmalloc_set_oom_handler(OomHandler handler) {
  oom_handler.store(handler, std::memory_order_release);
}

}  // extern "C"

// The graph hooks have C++ parameter types; C linkage only fixes their names
// (PyTorch takes their addresses through Python, never by name).
//
// A refused beginAllocateToPool or endAllocateToPool throws, as PyTorch's
// own TORCH_CHECKs in DeviceCachingAllocator::beginAllocateToPool ("already
// recording to mempool_id") and endAllocateToPool ("not currently recording
// to mempool_id") do: a capture whose allocations silently went to the main
// pool would replay into memory others reuse. releasePool never throws: it
// runs in CUDAGraph::reset() from ~CUDAGraph (a throw there is
// std::terminate); its failure is logged and left in vmmalloc_last_error().
[[noreturn]] static void pool_hook_failed(const char* hook) {
  throw std::runtime_error(std::string("vmmalloc: ") + hook + ": " + last_error_text());
}

extern "C" __attribute__((visibility("default"))) void vmmalloc_begin_allocate_to_pool(
    int device, MempoolId_t pool, StreamFilter filter) {
  if (vmmalloc_pool_begin(device, pool.first, pool.second) != 0) {
    pool_hook_failed("beginAllocateToPool");  // nothing changed (Rust checks first)
  }
  std::lock_guard<std::mutex> g(captures_mutex);
  captures->push_back(Capture{device, pool, std::move(filter)});
  active.fetch_add(1, std::memory_order_release);
}

extern "C" __attribute__((visibility("default"))) void vmmalloc_end_allocate_to_pool(
    int device, MempoolId_t pool) {
  if (!vmmalloc_forked()) {  // in a forked child the lock may never be released
    std::lock_guard<std::mutex> g(captures_mutex);
    for (auto it = captures->begin(); it != captures->end(); ++it) {
      if (it->device == device && it->pool == pool) {
        captures->erase(it);
        active.fetch_sub(1, std::memory_order_release);
        break;
      }
    }
  }
  // The Rust side refuses a pool with no capture underway.
  if (vmmalloc_pool_end(device, pool.first, pool.second) != 0) {
    pool_hook_failed("endAllocateToPool");
  }
}

extern "C" __attribute__((visibility("default"))) void vmmalloc_release_pool(int device,
                                                                             MempoolId_t pool) {
  vmmalloc_pool_release(device, pool.first, pool.second);  // logged by Rust on failure
}
