// vmmalloc's torch companion: PyTorch's CUDA allocator interface, answered by
// libvmmalloc's C ABI (crates/capi/src/lib.rs, torch_abi.rs). Built by
// vmmalloc/_companion.py against the installed PyTorch (per version and C++
// ABI), because it subclasses PyTorch's classes and throws c10 types.
//
// PyTorch sources it follows (read them with the method names below):
// * torch/csrc/cuda/CUDAPluggableAllocator.{h,cpp}: the class we extend. It
//   implements malloc/free and eight hooks and TORCH_CHECK(false)s the rest;
//   its methods are virtual, so a subclass can answer them.
// * c10/cuda/CUDACachingAllocator.h: the CUDAAllocator interface and the
//   defaults that throw ("does not yet support ..."), and
//   c10/cuda/CUDACachingAllocator.cpp for what each method means.
// * torch/csrc/cuda/Module.cpp: _cuda_setCheckpointPoolState, which swaps
//   storage deleters using raw_deleter() and the CheckpointDelta we return.
//
// No allocator logic lives here: which blocks are live, checkpoints and
// restores, use counts and statistics are Rust's (pools.rs). The exception:
// a torch.cuda.MemPool(allocator=...)'s pool, whose memory is another
// allocator's, keeps its blocks here as PyTorch's caching allocator does
// (section "torch.cuda.MemPool(allocator=...)").
//
// Versions: PyTorch 2.5 and newer (scripts/companion_matrix.py compiles this
// file against each minor version's headers). Where the interface changed,
// the override matching the version is chosen by VMM_TORCH_AT_LEAST (the
// versions are listed at each one); what a version has no virtual for is
// left out by the same test and listed in _companion.NOT_IN_VERSION. Each
// override is also inside #ifndef VMM_NO_<name>: for a newer PyTorch whose
// interface changed again, _companion.py builds without the ones the
// compiler says override nothing and reports them as features lost.

#include <c10/core/Device.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/csrc/profiler/combined_traceback.h>
#include <torch/version.h>

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <optional>
#include <limits>
#include <type_traits>
#include <cstring>
#include <map>
#include <set>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#ifndef VMMALLOC_TORCH_VERSION
#define VMMALLOC_TORCH_VERSION "unknown"
#endif

// True for the PyTorch these headers are of, if it is MAJ.MIN or newer
// (torch/version.h).
#define VMM_TORCH_AT_LEAST(MAJ, MIN) \
  (TORCH_VERSION_MAJOR > (MAJ) || (TORCH_VERSION_MAJOR == (MAJ) && TORCH_VERSION_MINOR >= (MIN)))

// The constructors of the pluggable allocator's bookkeeping record
// (CUDAPluggableAllocator.h declares them; libtorch_cuda defines them
// without exporting them), with CUDAPluggableAllocator.cpp's meaning.
namespace torch::cuda::CUDAPluggableAllocator {
_AllocationMetadata::_AllocationMetadata() : size(0), device_idx(-1), stream{} {}
_AllocationMetadata::_AllocationMetadata(size_t size_, c10::DeviceIndex device, cudaStream_t s)
    : size(size_), device_idx(device), stream(s) {}
}  // namespace torch::cuda::CUDAPluggableAllocator

namespace {

namespace CCA = c10::cuda::CUDACachingAllocator;
using Base = torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator;
using c10::cuda::MempoolId_t;

// libvmmalloc's C ABI (crates/capi), resolved with dlsym.
struct Segment {
  int device, is_large, is_expandable;
  uint64_t address, total_size, allocated_size, active_size, requested_size, stream, pool_hi,
      pool_lo;
};
struct Block {
  uint64_t address, size, requested_size;
  int allocated, active;
};
using SegmentFn = void (*)(void*, const Segment*, const Block*, size_t);
// One allocator event (crates/capi/src/history.rs, VmmallocTraceEntry):
// action is the index of PyTorch's TraceEntry::Action (ALLOC .. OOM; USER_DEFINED is never sent).
struct TraceEvent {
  int device, action;
  uint64_t addr, size, stream;
  int64_t time_us;
  uint64_t pool_hi, pool_lo;
};
using TraceSinkFn = void (*)(const TraceEvent*);
constexpr int kHistoryClear = 1;     // crates/capi/src/history_abi.rs VMMALLOC_HISTORY_CLEAR
constexpr int kHistorySinkOnly = 2;  // VMMALLOC_HISTORY_SINK_ONLY
using FreedFn = void (*)(void*, uint64_t);
using AllocatedFn = void (*)(void*, uint64_t, size_t, uint64_t);
constexpr size_t kStatsLen = 9 * 3 * 4 + 2 + 4 + 4 + 4;  // torch_abi.rs VMMALLOC_STATS_LEN

struct Lib {
  void* (*malloc)(size_t, int, void*);
  void (*free)(void*, size_t, int, void*);
  int (*try_free)(void*, size_t, int, void*);  // optional: raw_delete raises with it
  int (*reset_accumulated_stats)(int);         // optional: resetAccumulatedStats
  void (*init)(int);
  void (*empty_cache)();
  void (*set_memory_fraction)(double, int);
  void (*record_stream)(void*, void*);
  void (*begin_pool)(int, MempoolId_t, std::function<bool(cudaStream_t)>);
  void (*end_pool)(int, MempoolId_t);
  void (*release_pool)(int, MempoolId_t);
  int (*pool_create_or_incref)(int, uint64_t, uint64_t);
  int (*pool_use_count)(int, uint64_t, uint64_t);
  int (*pool_set_use_on_oom)(int, uint64_t, uint64_t, int);
  int (*pool_set_no_split)(int, uint64_t, uint64_t);
  int (*pool_check_live)(int, uint64_t, uint64_t, const uint64_t*, size_t);
  uint64_t (*pool_checkpoint)(int, uint64_t, uint64_t);
  int (*checkpoint_restore)(int, uint64_t, FreedFn, AllocatedFn, void*);
  int (*checkpoint_drop)(int, uint64_t);
  int (*device_stats)(int, int64_t*, size_t);
  int (*visit_segments)(int, int, uint64_t, uint64_t, SegmentFn, void*);
  int (*reset_peak_stats)(int);
  const char* (*last_error)();
  // Optional (IPC, crates/capi/src/ipc): NULL where this libvmmalloc lacks them.
  int (*ipc_export)(void*, void*, size_t, size_t*);
  int (*ipc_import)(const void*, size_t, void**);
  int (*ipc_close)(void*);
  int (*ipc_import_device)(const void*, size_t, int, void**);  // -1: the handle's device
  // PyTorch's own 'e' handle of PyTorch major.minor where it fits (issue 35).
  int (*ipc_export_torch)(void*, int, int, void*, size_t, size_t*, size_t*);
  int (*ipc_close_on)(void*, void*);  // after the work queued on a stream
  // Optional (newer libvmmalloc): the out-of-memory handler and device memory info.
  void (*set_oom_handler)(void (*)(int, size_t, const char*));
  int (*mem_get_info)(int, uint64_t*, uint64_t*);
  char* (*settings)();
  void (*free_string)(char*);
  // Optional (newer libvmmalloc): PyTorch's memory history and cacheInfo
  // (crates/capi/src/history_abi.rs).
  int (*record_history)(int, size_t, int);
  void (*set_trace_sink)(TraceSinkFn);
  int (*cache_info)(int, uint64_t*);
};
Lib lib;

std::string last_error() {
  const char* e = lib.last_error();
  return e ? std::string(e) : std::string("no reason recorded");
}

// ---------------------------------------------------------------------------
// PyTorch's memory history (torch.cuda.memory._record_memory_history).
//
// libvmmalloc records the events (alloc, free_requested, free_completed,
// segment_map/unmap or segment_alloc/free, oom) and hands each to the trace
// sink on the thread that caused it (crates/capi/src/history.rs). Here each
// event gets the stack context PyTorch's recorder gathers
// (CapturedTraceback, exactly as stacks=/context= asked) and goes into
// PyTorch's TraceEntry ring, as DeviceCachingAllocator::record_trace does
// (c10/cuda/CUDACachingAllocator.cpp); snapshot() reports the rings and the
// contexts of live blocks, and torch/csrc/cuda/Module.cpp symbolizes them.
// ---------------------------------------------------------------------------

// What recordHistory set, read by the allocation path without a lock: the
// RecordContext level (NEVER 0, STATE 1, ALLOC 2, ALL 3) and the recorder.
// With recording off the hot path reads g_when only (one relaxed load).
std::atomic<int> g_when{0};
std::atomic<CCA::CreateContextFn> g_recorder{nullptr};

// The context gathered for the allocator call running on this thread
// (record_trace's `context`), read by the trace sink during that call.
thread_local std::shared_ptr<c10::GatheredContext> t_context;
// torch.cuda.memory._set_memory_metadata: the calling thread's metadata,
// copied into each trace entry it causes.
thread_local std::string t_user_metadata;

constexpr int kState = static_cast<int>(CCA::RecordContext::STATE);
constexpr int kAlloc = static_cast<int>(CCA::RecordContext::ALLOC);
constexpr int kAll = static_cast<int>(CCA::RecordContext::ALL);

// DeviceCachingAllocator::maybeGatherContext: a context if recording asks
// for one at `level`.
std::shared_ptr<c10::GatheredContext> gather_at(int level) {
  if (g_when.load(std::memory_order_relaxed) < level) return nullptr;
  auto fn = g_recorder.load(std::memory_order_acquire);
  return fn ? fn() : nullptr;
}

// Sets t_context for one allocator call (restored on exit, exceptions too).
struct ContextScope {
  std::shared_ptr<c10::GatheredContext> saved;
  explicit ContextScope(std::shared_ptr<c10::GatheredContext> c)
      : saved(std::exchange(t_context, std::move(c))) {}
  ~ContextScope() { t_context = std::move(saved); }
  ContextScope(const ContextScope&) = delete;
  ContextScope& operator=(const ContextScope&) = delete;
};

// Pools with their own allocator (torch.cuda.MemPool(allocator=...)): how
// many begin..end spans of such pools are open, and how many of their
// allocations are live. The hot path reads these two (relaxed) and goes to
// the companion's tables only when one is non-zero.
std::atomic<int> g_custom_spans{0};
std::atomic<int> g_custom_live{0};
void* custom_malloc(size_t n, int device, cudaStream_t s, bool* routed);
bool custom_free(void* p);

// The malloc and free PyTorch's pluggable allocator calls (allocate,
// raw_alloc, raw_alloc_with_stream, raw_delete all end here). As the native
// allocator: malloc gathers a context at STATE (kept with the block and, at
// ALLOC or more, in the trace), free at ALL.
void* companion_malloc(size_t n, int device, cudaStream_t s) {
  if (g_custom_spans.load(std::memory_order_relaxed) > 0) {
    bool routed = false;
    void* p = custom_malloc(n, device, s, &routed);
    if (routed) return p;
  }
  if (g_when.load(std::memory_order_relaxed) < kState) return lib.malloc(n, device, s);
  ContextScope scope(gather_at(kState));
  return lib.malloc(n, device, s);
}

void companion_free(void* p, size_t n, int device, cudaStream_t s) {
  if (g_custom_live.load(std::memory_order_relaxed) > 0 && custom_free(p)) return;
  if (g_when.load(std::memory_order_relaxed) < kAll) return lib.free(p, n, device, s);
  ContextScope scope(gather_at(kAll));
  lib.free(p, n, device, s);
}

// PyTorch's TraceEntry::Action of a sink event's action code (its index in
// vmmalloc_alloc::pickle_snapshot::TRACE_ACTIONS, which follows the enum's order).
std::optional<CCA::TraceEntry::Action> action_of(int code) {
  using A = CCA::TraceEntry;
  switch (code) {
    case 0: return A::ALLOC;
    case 1: return A::FREE_REQUESTED;
    case 2: return A::FREE_COMPLETED;
    case 3: return A::SEGMENT_ALLOC;
    case 4: return A::SEGMENT_FREE;
    case 5: return A::SEGMENT_MAP;
    case 6: return A::SEGMENT_UNMAP;
    case 7: return A::SNAPSHOT;
    case 8: return A::OOM;
    default: return std::nullopt;
  }
}

// The actions skip_actions may name (PyTorch's parseTraceEntryAction).
std::optional<CCA::TraceEntry::Action> action_named(const std::string& name) {
  static const char* const kNames[] = {"alloc",        "free_requested", "free_completed",
                                       "segment_alloc", "segment_free",  "segment_map",
                                       "segment_unmap", "snapshot",      "oom"};
  for (int i = 0; i < 9; ++i) {
    if (name == kNames[i]) return action_of(i);
  }
  return std::nullopt;
}

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// A TraceEntry with its time in microseconds since the epoch (what
// snapshot()'s device_traces carry: the native allocator converts its
// approximate clock before returning them). The constructor's trailing
// arguments differ between PyTorch versions.
// Its constructor: (action, device, addr, size, stream, time, context) in
// 2.5-2.7; + mempool after stream from 2.8; + compile_context from 2.8;
// + user_metadata from 2.10.
template <class TE = CCA::TraceEntry>
TE make_entry(typename TE::Action action, int device, uint64_t addr, uint64_t size,
              uint64_t stream, MempoolId_t pool, std::shared_ptr<c10::GatheredContext> ctx,
              int64_t time_us, const std::string& compile_context,
              const std::string& user_metadata) {
  using Ctx = std::shared_ptr<c10::GatheredContext>;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  auto d = static_cast<c10::DeviceIndex>(device);
  c10::approx_time_t t{};
  auto out = [&]() {
    if constexpr (std::is_constructible_v<TE, typename TE::Action, c10::DeviceIndex, size_t, size_t,
                                          cudaStream_t, MempoolId_t, c10::approx_time_t, Ctx,
                                          std::string, std::string>) {
      return TE(action, d, addr, size, s, pool, t, std::move(ctx), compile_context,
                user_metadata);
    } else if constexpr (std::is_constructible_v<TE, typename TE::Action, c10::DeviceIndex, size_t,
                                                 size_t, cudaStream_t, MempoolId_t,
                                                 c10::approx_time_t, Ctx, std::string>) {
      return TE(action, d, addr, size, s, pool, t, std::move(ctx), compile_context);
    } else if constexpr (std::is_constructible_v<TE, typename TE::Action, c10::DeviceIndex, size_t,
                                                 size_t, cudaStream_t, MempoolId_t,
                                                 c10::approx_time_t, Ctx>) {
      return TE(action, d, addr, size, s, pool, t, std::move(ctx));
    } else {
      (void)pool;
      (void)compile_context;
      (void)user_metadata;
      return TE(action, d, addr, size, s, t, std::move(ctx));
    }
  }();
  out.time_.t_ = static_cast<time_t>(time_us);
  return out;
}

// A checkpoint of a graph pool (PyTorch's PrivatePoolState): a handle of
// Rust's checkpoint, dropped with the last reference PyTorch keeps.
struct Checkpoint : CCA::AllocatorState {
  int device;
  uint64_t handle;
  Checkpoint(int d, uint64_t h) : device(d), handle(h) {}
  ~Checkpoint() override { lib.checkpoint_drop(device, handle); }
};

#ifndef VMM_OVERRIDE
#define VMM_OVERRIDE override
#endif

class VmmallocAllocator : public Base {
 public:
  VmmallocAllocator()
      : Base(&companion_malloc, &companion_free) {}

  std::string name() VMM_OVERRIDE { return "vmmalloc"; }

  // ---- The hot path ----
  // PyTorch's pluggable allocator records every pointer in a map under a
  // mutex (malloc inserts; raw_delete looks it up, erases it and calls the
  // free function) and reaches libvmmalloc through std::function
  // (torch/csrc/cuda/CUDAPluggableAllocator.cpp: malloc, allocate,
  // raw_delete, custom_raw_deleter). libvmmalloc's free needs only the
  // pointer (the device is a hint: vmmalloc_free asks every device when it
  // is wrong), so the companion calls it directly: a tensor's DataPtr
  // carries the device in its context, next to the pointer, and its deleter
  // (raw_deleter(), the one Module.cpp's checkpoint code compares against)
  // frees with no lookup. Every allocation path (allocate, raw_alloc,
  // raw_alloc_with_stream) and every free path (the deleter, raw_delete) goes
  // this way; the map is never used.
  c10::DataPtr allocate(size_t size) VMM_OVERRIDE {
    c10::DeviceIndex device = -1;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device);
    return data_ptr_of(companion_malloc(size, device, stream), device);
  }

  c10::DeleterFnPtr raw_deleter() const VMM_OVERRIDE { return &delete_context; }

  void* raw_alloc(size_t nbytes) VMM_OVERRIDE {
    c10::DeviceIndex device = -1;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    return companion_malloc(nbytes, device, c10::cuda::getCurrentCUDAStream(device));
  }

  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) VMM_OVERRIDE {
    c10::DeviceIndex device = -1;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    return companion_malloc(nbytes, device, stream);
  }

  // As the native raw_delete (CUDACachingAllocator.cpp free: no allocated
  // block -> TORCH_CHECK(false, "invalid device pointer: ", ptr)), a pointer
  // that is not a live allocation (never allocated, freed already) raises
  // and changes nothing (issue 40); NULL does nothing. A libvmmalloc without
  // vmmalloc_try_free only logs it.
  void raw_delete(void* ptr) VMM_OVERRIDE {
    if (!ptr) return;
    if (!lib.try_free) return companion_free(ptr, 0, current_device_hint(), nullptr);
    if (g_custom_live.load(std::memory_order_relaxed) > 0 && custom_free(ptr)) return;
    int rc = 0;
    if (g_when.load(std::memory_order_relaxed) < kAll) {
      rc = lib.try_free(ptr, 0, current_device_hint(), nullptr);
    } else {
      ContextScope scope(gather_at(kAll));
      rc = lib.try_free(ptr, 0, current_device_hint(), nullptr);
    }
    TORCH_CHECK(rc == 0, "invalid device pointer: ", ptr);
  }

  // The DataPtr of `ptr` on `device` (what allocate returns).
  static c10::DataPtr data_ptr_of(void* ptr, c10::DeviceIndex device) {
    return c10::DataPtr(ptr, pack_context(ptr, device), &delete_context,
                        c10::Device(c10::DeviceType::CUDA, device));
  }

  // A DataPtr's context: the pointer with device + 1 in bits 57-63 (user
  // addresses stay below 2^57 on x86-64 and AArch64, five-level paging
  // included); the pointer alone if it does not fit.
  static constexpr int kDeviceShift = 57;
  static void* pack_context(void* ptr, int device) {
    auto v = reinterpret_cast<uintptr_t>(ptr);
    if (!v || device < 0 || device >= 127 || (v >> kDeviceShift) != 0) return ptr;
    return reinterpret_cast<void*>(v | (static_cast<uintptr_t>(device + 1) << kDeviceShift));
  }

  // raw_deleter(): frees the pointer of a context (the device hint from it,
  // else the current device).
  static void delete_context(void* ctx) {
    auto v = reinterpret_cast<uintptr_t>(ctx);
    if (!v) return;
    int device = static_cast<int>(v >> kDeviceShift) - 1;
    void* ptr = reinterpret_cast<void*>(v & ((static_cast<uintptr_t>(1) << kDeviceShift) - 1));
    companion_free(ptr, 0, device >= 0 ? device : current_device_hint(), nullptr);
  }

  static int current_device_hint() {
    int device = -1;
    if (cudaGetDevice(&device) != cudaSuccess) {
      (void)cudaGetLastError();
      device = -1;
    }
    return device;
  }

  // ---- Memory history (torch.cuda.memory._record_memory_history) ----

  // As DeviceCachingAllocator::recordHistory: recording on or off, the
  // recorder and level, the ring size; stopping or clearHistory drops the
  // rings. libvmmalloc records the events and hands them to on_trace_event
  // (kHistorySinkOnly: it keeps no second copy).
  // Its signature: + clearHistory from 2.8, + skip_actions from 2.11.
#ifndef VMM_NO_recordHistory
#if VMM_TORCH_AT_LEAST(2, 11)
  void recordHistory(bool enabled, CCA::CreateContextFn context_recorder, size_t max_entries,
                     CCA::RecordContext when, bool clearHistory,
                     const std::vector<std::string>& skip_actions) VMM_OVERRIDE {
    record_history(enabled, context_recorder, max_entries, when, clearHistory, skip_actions);
  }
#elif VMM_TORCH_AT_LEAST(2, 8)
  void recordHistory(bool enabled, CCA::CreateContextFn context_recorder, size_t max_entries,
                     CCA::RecordContext when, bool clearHistory) VMM_OVERRIDE {
    record_history(enabled, context_recorder, max_entries, when, clearHistory, {});
  }
#else
  void recordHistory(bool enabled, CCA::CreateContextFn context_recorder, size_t max_entries,
                     CCA::RecordContext when) VMM_OVERRIDE {
    record_history(enabled, context_recorder, max_entries, when, false, {});
  }
#endif
#endif

  void record_history(bool enabled, CCA::CreateContextFn recorder, size_t max_entries,
                      CCA::RecordContext when, bool clear,
                      const std::vector<std::string>& skip_actions) {
    TORCH_CHECK(lib.record_history && lib.set_trace_sink,
                "vmmalloc: this libvmmalloc cannot record memory history (it lacks "
                "vmmalloc_record_history); install a newer vmmalloc");
    TORCH_CHECK(when == CCA::RecordContext::NEVER || recorder);  // PyTorch's own check
    std::vector<CCA::TraceEntry::Action> skip;
    for (const auto& name : skip_actions) {
      auto a = action_named(name);
      TORCH_CHECK(a, "Unknown TraceEntry action: ", name);
      skip.push_back(*a);
    }
    lib.set_trace_sink(&on_trace_event);
    {
      std::lock_guard<std::mutex> g(history_mu_);
      record_history_.store(enabled);
      max_entries_ = std::max<size_t>(max_entries, 1);
      skip_ = std::move(skip);
      if (!enabled || clear) {
        traces_.clear();
        annotations_.clear();
      }
      if (!enabled) {
        live_.clear();
        segment_context_.clear();
      }
      for (auto& [device, ring] : traces_) {
        while (ring.size() > max_entries_) ring.pop_front();
      }
    }
    g_recorder.store(enabled ? recorder : nullptr, std::memory_order_release);
    g_when.store(enabled ? static_cast<int>(when) : 0, std::memory_order_relaxed);
    int flags = kHistorySinkOnly | (clear ? kHistoryClear : 0);
    TORCH_CHECK(lib.record_history(enabled ? 1 : 0, max_entries_, flags) == 0, "vmmalloc: ",
                last_error());
  }

#ifndef VMM_NO_isHistoryEnabled
  bool isHistoryEnabled() VMM_OVERRIDE { return record_history_.load(); }
#endif

  // torch.cuda.memory's traceback of a live allocation: the context gathered
  // when the block at `ptr` was allocated (while recording).
  // From 2.12.
#if !defined(VMM_NO_getContextForPointer) && VMM_TORCH_AT_LEAST(2, 12)
  std::shared_ptr<c10::GatheredContext> getContextForPointer(const void* ptr) VMM_OVERRIDE {
    std::lock_guard<std::mutex> g(history_mu_);
    auto it = live_.find(reinterpret_cast<uint64_t>(ptr));
    return it == live_.end() ? nullptr : it->second.context;
  }
#endif

  // record_function ranges (_record_memory_history(global_record_annotations=True)).
#ifndef VMM_NO_recordAnnotation
  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) VMM_OVERRIDE {
    if (!record_history_.load()) return;
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) {
      (void)cudaGetLastError();
      device = 0;
    }
    Annotation ae(static_cast<c10::DeviceIndex>(device), c10::approx_time_t{});
    ae.time_.t_ = static_cast<time_t>(now_us());
    for (const auto& [k, v] : md) ae.recordUserMetadata(k, v);
    std::lock_guard<std::mutex> g(history_mu_);
    if (annotations_.size() >= max_entries_) annotations_.pop_front();
    annotations_.push_back(std::move(ae));
  }
#endif

  // torch._C._cuda_pushCompileContext / pop (torch.compile's
  // _record_memory_history(compile_context=True)): the innermost context
  // names each trace entry's compile_context ("N/A" outside any).
  // From 2.8.
#if !defined(VMM_NO_pushCompileContext) && VMM_TORCH_AT_LEAST(2, 8)
  void pushCompileContext(std::string& md) VMM_OVERRIDE {
    std::lock_guard<std::mutex> g(history_mu_);
    compile_context_.push_back(md);
  }
#endif
#if !defined(VMM_NO_popCompileContext) && VMM_TORCH_AT_LEAST(2, 8)
  void popCompileContext() VMM_OVERRIDE {
    std::lock_guard<std::mutex> g(history_mu_);
    if (!compile_context_.empty()) compile_context_.pop_back();
  }
#endif

  // torch.cuda.memory._set_memory_metadata: recorded on the calling
  // thread's trace entries.
  // setUserMetadata / getUserMetadata from 2.10; supportsUserMetadata and
  // annotateMemory from 2.14.
#if !defined(VMM_NO_supportsUserMetadata) && VMM_TORCH_AT_LEAST(2, 14)
  bool supportsUserMetadata() VMM_OVERRIDE { return true; }
#endif
#if !defined(VMM_NO_setUserMetadata) && VMM_TORCH_AT_LEAST(2, 10)
  void setUserMetadata(const std::string& metadata) VMM_OVERRIDE { t_user_metadata = metadata; }
#endif
#if !defined(VMM_NO_getUserMetadata) && VMM_TORCH_AT_LEAST(2, 10)
  std::string getUserMetadata() VMM_OVERRIDE { return t_user_metadata; }
#endif

  // torch.cuda.memory._annotate_memory: an "annotate" trace entry for the
  // live allocation at `ptr`, its payload in user_metadata.
#if !defined(VMM_NO_annotateMemory) && VMM_TORCH_AT_LEAST(2, 14)
  void annotateMemory(const void* ptr, const std::string& metadata) VMM_OVERRIDE {
    if (!record_history_.load()) return;
    std::lock_guard<std::mutex> g(history_mu_);
    auto it = live_.find(reinterpret_cast<uint64_t>(ptr));
    if (it == live_.end()) return;  // PyTorch annotates only live allocations
    push_locked(it->second.device,
                make_entry(CCA::TraceEntry::ANNOTATE, it->second.device, it->first,
                           it->second.size, it->second.stream, it->second.pool, nullptr,
                           now_us(), compile_context_locked(), metadata));
  }
#endif

  // cudnn.benchmark sizes its workspace by cacheInfo
  // (aten/src/ATen/native/cudnn/Conv_v7.cpp): libvmmalloc answers the
  // device's free bytes for a zero guess, raised to the largest request it
  // can serve from what it holds (crates/capi/src/history_abi.rs).
#ifndef VMM_NO_cacheInfo
  void cacheInfo(c10::DeviceIndex device, size_t* largest) VMM_OVERRIDE {
    if (!lib.cache_info) return Base::cacheInfo(device, largest);
    TORCH_CHECK(largest, "vmmalloc: cacheInfo(largest=NULL)");
    uint64_t v = *largest;
    TORCH_CHECK(lib.cache_info(device, &v) == 0, "vmmalloc: ", last_error());
    *largest = static_cast<size_t>(v);
  }
#endif

  // The trace sink (libvmmalloc calls it with each event, on the thread
  // that caused it, holding that device's history lock; it must not unwind).
  static void on_trace_event(const TraceEvent* e) {
    try {
      if (current_allocator && e) current_allocator->on_event(*e);
    } catch (...) {
    }
  }

  // DeviceCachingAllocator::record_trace for one event: blocks remember
  // their allocation context (STATE), entries carry the call's context at
  // ALLOC or more (a free without its own context: the block's).
  void on_event(const TraceEvent& e) {
    if (!record_history_.load(std::memory_order_relaxed)) return;
    auto action = action_of(e.action);
    if (!action) return;
    using TE = CCA::TraceEntry;
    MempoolId_t pool{e.pool_hi, e.pool_lo};
    std::shared_ptr<c10::GatheredContext> ctx = t_context;
    std::lock_guard<std::mutex> g(history_mu_);
    switch (*action) {
      case TE::ALLOC:
        live_[e.addr] = Live{e.device, e.size, e.stream, pool, ctx};
        break;
      case TE::FREE_REQUESTED:
      case TE::FREE_COMPLETED: {
        auto it = live_.find(e.addr);
        if (it != live_.end()) {
          if (!ctx) ctx = it->second.context;
          if (*action == TE::FREE_COMPLETED) live_.erase(it);
        }
        break;
      }
      case TE::SEGMENT_ALLOC:
      case TE::SEGMENT_MAP:
        segment_context_[e.addr] = ctx;
        break;
      case TE::SEGMENT_FREE:
      case TE::SEGMENT_UNMAP:
        segment_context_.erase(e.addr);
        break;
      default:
        break;
    }
    if (std::find(skip_.begin(), skip_.end(), *action) != skip_.end()) return;
    bool keep_context = g_when.load(std::memory_order_relaxed) >= kAlloc;
    push_locked(e.device, make_entry(*action, e.device, e.addr, e.size, e.stream, pool,
                                     keep_context ? std::move(ctx) : nullptr, e.time_us,
                                     compile_context_locked(), t_user_metadata));
  }

  // Out-of-memory observers (torch.cuda.memory._record_memory_history's
  // oom hook, attachOutOfMemoryObserver): called by notify_oom, from the
  // handler libvmmalloc's vmmalloc_malloc calls before it throws, so every
  // PyTorch allocation path (allocate, raw_alloc, raw_alloc_with_stream)
  // notifies once.
#ifndef VMM_NO_attachOutOfMemoryObserver
  void attachOutOfMemoryObserver(CCA::OutOfMemoryObserver observer) VMM_OVERRIDE {
    std::lock_guard<std::mutex> g(mu_);
    oom_observers_.push_back(std::move(observer));
  }
#endif

  // From 2.6.
#if !defined(VMM_NO_getMemoryFraction) && VMM_TORCH_AT_LEAST(2, 6)
  double getMemoryFraction(c10::DeviceIndex device) VMM_OVERRIDE {
    std::lock_guard<std::mutex> g(mu_);
    auto it = fractions_.find(device);
    return it == fractions_.end() ? 1.0 : it->second;
  }
#endif

#ifndef VMM_NO_setMemoryFraction
  void setMemoryFraction(double fraction, c10::DeviceIndex device) VMM_OVERRIDE {
    // DeviceCachingAllocator::setMemoryFraction's check, in its words (older
    // versions assert the same range); NaN fails it too. Issue 40.
    TORCH_CHECK(0 <= fraction && fraction <= 1, "invalid fraction:", fraction,
                ". Please set within [0, 1].");
    Base::setMemoryFraction(fraction, device);
    std::lock_guard<std::mutex> g(mu_);
    fractions_[device] = fraction;
  }
#endif

  // Statistics (torch.cuda.memory_stats and friends read getDeviceStats).
#ifndef VMM_NO_getDeviceStats
  CCA::DeviceStats getDeviceStats(c10::DeviceIndex device) VMM_OVERRIDE {
    int64_t v[kStatsLen] = {};
    TORCH_CHECK(lib.device_stats(device, v, kStatsLen) == static_cast<int>(kStatsLen),
                "vmmalloc: ", last_error());
    CCA::DeviceStats s;
    size_t i = 0;
    auto stat = [&](auto& st) {
      st.current = v[i++];
      st.peak = v[i++];
      st.allocated = v[i++];
      st.freed = v[i++];
    };
    for (auto* a : {&s.allocation, &s.segment, &s.active, &s.inactive_split, &s.allocated_bytes,
                    &s.reserved_bytes, &s.active_bytes, &s.inactive_split_bytes,
                    &s.requested_bytes}) {
      for (auto& st : *a) stat(st);
    }
    s.num_alloc_retries = v[i++];
    s.num_ooms = v[i++];
    stat(s.oversize_allocations);
    stat(s.oversize_segments);
    s.num_sync_all_streams = v[i++];
    s.num_device_alloc = v[i++];
    s.num_device_free = v[i++];
    s.max_split_size = v[i++];
    add_pool_stats(device, v, s);  // MemPool(allocator=...)'s blocks
    return s;
  }
#endif

  // torch.cuda.reset_accumulated_memory_stats (issue 40): as the native
  // resetAccumulatedStats, every stat's allocated/freed and the counts it
  // zeroes read 0 from now on (libvmmalloc: vmmalloc_reset_accumulated_stats,
  // crates/capi/src/accumulated.rs; the pools with their own allocator here).
#ifndef VMM_NO_resetAccumulatedStats
  void resetAccumulatedStats(c10::DeviceIndex device) VMM_OVERRIDE {
    TORCH_CHECK(lib.reset_accumulated_stats, "vmmalloc: this libvmmalloc has no "
                "vmmalloc_reset_accumulated_stats (resetAccumulatedStats)");
    TORCH_CHECK(lib.reset_accumulated_stats(device) == 0, "vmmalloc: ", last_error());
    reset_pool_accumulated(device);
  }
#endif

#ifndef VMM_NO_resetPeakStats
  void resetPeakStats(c10::DeviceIndex device) VMM_OVERRIDE {
    TORCH_CHECK(lib.reset_peak_stats(device) == 0, "vmmalloc: ", last_error());
    reset_pool_peaks(device);
  }
#endif

  // snapshot(): segments and blocks of every device used (or of one pool),
  // as CUDACachingAllocator.cpp's snapshot() reports them. ProcessGroupNCCL
  // calls it in initNCCLComm and register_mem_pool; torch.cuda.MemPool's
  // snapshot() passes its pool. With history recorded, the trace entries
  // and stack contexts too (add_history).
  // Its signature: () to 2.7, (mempool) 2.8-2.10, (mempool, include_traces)
  // from 2.11.
#ifndef VMM_NO_snapshot
#if VMM_TORCH_AT_LEAST(2, 11)
  CCA::SnapshotInfo snapshot(MempoolId_t mempool, bool include_traces) VMM_OVERRIDE {
    return snapshot_of(mempool, include_traces);
  }
#elif VMM_TORCH_AT_LEAST(2, 8)
  CCA::SnapshotInfo snapshot(MempoolId_t mempool) VMM_OVERRIDE { return snapshot_of(mempool, true); }
#else
  CCA::SnapshotInfo snapshot() VMM_OVERRIDE { return snapshot_of({0, 0}, true); }
#endif
#endif

  CCA::SnapshotInfo snapshot_of(MempoolId_t mempool, bool include_traces) {
    CCA::SnapshotInfo info{};  // value-initialized: no field left indeterminate
    set_config(info.config_metadata);
    bool only = mempool.first != 0 || mempool.second != 0;
    TORCH_CHECK(lib.visit_segments(-1, only ? 1 : 0, mempool.first, mempool.second, &add_segment,
                                   &info) >= 0,
                "vmmalloc: ", last_error());
    add_pool_segments(info, mempool);  // MemPool(allocator=...)'s segments
    add_history(info, mempool, include_traces);
    return info;
  }

  // The history's part of snapshot(): each live block's and segment's
  // allocation context; while recording, one "snapshot" entry per device
  // (size: its active bytes), as the native snapshot() records; then the
  // rings (device_traces[i] is device i's) and the annotations.
  void add_history(CCA::SnapshotInfo& info, MempoolId_t mempool, bool include_traces) {
    std::lock_guard<std::mutex> g(history_mu_);
    int devices = 0;
    std::unordered_map<int, uint64_t> active;
    for (auto& seg : info.segments) {
      devices = std::max(devices, static_cast<int>(seg.device) + 1);
      active[seg.device] += seg.active_size;
      auto sc = segment_context_.find(seg.address);
      if (sc != segment_context_.end()) seg.context_when_allocated = sc->second;
      uint64_t at = seg.address;
      for (auto& b : seg.blocks) {
        if (b.allocated) {
          auto it = live_.find(at);
          if (it != live_.end()) b.context_when_allocated = it->second.context;
        }
        at += b.size;
      }
    }
    for (auto& [device, ring] : traces_) devices = std::max(devices, device + 1);
    if (record_history_.load()) {
      auto t = now_us();
      for (int d = 0; d < devices; ++d) {
        push_locked(d, make_entry(CCA::TraceEntry::SNAPSHOT, d, 0, active[d], 0, mempool,
                                  nullptr, t, compile_context_locked(), t_user_metadata));
      }
    }
    if (!include_traces) return;
    info.device_traces.resize(devices);
    for (auto& [device, ring] : traces_) {
      info.device_traces[device].assign(ring.begin(), ring.end());
    }
    info.external_annotations.assign(annotations_.begin(), annotations_.end());
  }

  // CUDA graph trees (torch/_inductor/cudagraph_trees.py).
#ifndef VMM_NO_checkPoolLiveAllocations
  bool checkPoolLiveAllocations(c10::DeviceIndex device, MempoolId_t id,
                                const std::unordered_set<void*>& expected) VMM_OVERRIDE {
    {
      std::lock_guard<std::mutex> g(custom_mu_);
      if (custom_pools_.count(id)) {
        size_t live = 0;
        for (auto& [p, b] : custom_live_) {
          if (b->pool->owner->id != id) continue;
          if (!expected.count(p)) return false;
          live++;
        }
        return live == expected.size();
      }
    }
    std::vector<uint64_t> ptrs;
    ptrs.reserve(expected.size());
    for (void* p : expected) ptrs.push_back(reinterpret_cast<uint64_t>(p));
    int r = lib.pool_check_live(device, id.first, id.second, ptrs.data(), ptrs.size());
    TORCH_CHECK(r >= 0, "vmmalloc: ", last_error());
    return r == 1;
  }
#endif

#ifndef VMM_NO_getCheckpointState
  std::shared_ptr<CCA::AllocatorState> getCheckpointState(c10::DeviceIndex device,
                                                          MempoolId_t id) VMM_OVERRIDE {
    uint64_t h = lib.pool_checkpoint(device, id.first, id.second);
    TORCH_CHECK(h != 0, "vmmalloc: ", last_error());
    return std::make_shared<Checkpoint>(device, h);
  }
#endif

  // As the native allocator: ptrs_freed lists every pointer freed, and
  // dataptrs_allocd a DataPtr (deleter raw_deleter(), which Module.cpp's
  // removeStorageDeleterFns compares against) for every block handed back.
#ifndef VMM_NO_setCheckpointPoolState
  CCA::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex device, std::shared_ptr<CCA::AllocatorState> pps) VMM_OVERRIDE {
    auto cp = std::dynamic_pointer_cast<Checkpoint>(pps);
    TORCH_CHECK(cp, "vmmalloc: this checkpoint was not made by vmmalloc");
    TORCH_CHECK(cp->device == device, "vmmalloc: checkpoint of device ", cp->device,
                " restored on device ", static_cast<int>(device));
    struct Out {
      std::vector<void*> freed;
      std::vector<std::pair<void*, std::pair<size_t, uint64_t>>> allocd;
    } out;
    FreedFn on_freed = [](void* ctx, uint64_t p) {
      try {
        static_cast<Out*>(ctx)->freed.push_back(reinterpret_cast<void*>(p));
      } catch (...) {
      }
    };
    AllocatedFn on_allocd = [](void* ctx, uint64_t p, size_t n, uint64_t s) {
      try {
        static_cast<Out*>(ctx)->allocd.push_back({reinterpret_cast<void*>(p), {n, s}});
      } catch (...) {
      }
    };
    TORCH_CHECK(lib.checkpoint_restore(device, cp->handle, on_freed, on_allocd, &out) == 0,
                "vmmalloc: ", last_error());
    CCA::CheckpointDelta delta;
    delta.ptrs_freed = std::move(out.freed);
    for (auto& a : out.allocd) {
      delta.dataptrs_allocd.push_back(data_ptr_of(a.first, device));
    }
    return delta;
  }
#endif

 private:
  // The blocks of a pool with its own allocator (torch.cuda.MemPool(allocator=...)),
  // as the native Block / BlockPool / PrivatePool keep them
  // (c10/cuda/CUDACachingAllocator.cpp).
  struct PoolBlocks;
  struct CustomPool;
  struct PoolBlock {
    uintptr_t ptr;
    size_t size;
    size_t requested;  // requested_size of its last allocation
    cudaStream_t stream;
    PoolBlocks* pool;
    bool allocated = false;
    PoolBlock* prev = nullptr;  // neighbours in its segment
    PoolBlock* next = nullptr;
    bool is_split() const { return prev != nullptr || next != nullptr; }
  };
  // BlockComparatorSize: stream, then size, then address.
  struct BySize {
    bool operator()(const PoolBlock* a, const PoolBlock* b) const {
      if (a->stream != b->stream) {
        return reinterpret_cast<uintptr_t>(a->stream) < reinterpret_cast<uintptr_t>(b->stream);
      }
      if (a->size != b->size) return a->size < b->size;
      return a->ptr < b->ptr;
    }
  };
  // A BlockPool: the free blocks of one size class.
  struct PoolBlocks {
    bool is_small;
    CustomPool* owner = nullptr;
    std::set<PoolBlock*, BySize> blocks;
    explicit PoolBlocks(bool small) : is_small(small) {}
    ~PoolBlocks() {
      for (PoolBlock* b : blocks) delete b;
    }
  };
  // A PrivatePool with an allocator.
  struct CustomPool {
    MempoolId_t id{0, 0};
    CCA::CUDAAllocator* allocator = nullptr;
    std::shared_ptr<CCA::CUDAAllocator> keep;  // owning from 2.11 (the native pool's allocator_)
    int device = 0;
    int use_count = 1;
    int segments = 0;  // cudaMalloc_count: segments not yet given back
    bool no_split = false;  // MemPool(no_split=True): no_split_pools
    PoolBlocks small{true}, large{false};
  };
  // One Stat (current, peak, allocated, freed) and what track_peaks keeps.
  struct PoolStat {
    int64_t current = 0, peak = 0, allocated = 0, freed = 0;
  };
  struct PeakTrack {
    int64_t seen_peak = 0, low = 0, combined = 0;
  };
  // The pools' figures of one device: [stat][AGGREGATE, SMALL_POOL,
  // LARGE_POOL], stats in getDeviceStats' (and vmmalloc_device_stats') order.
  enum {
    kAllocation, kSegment, kActive, kInactiveSplit, kAllocatedBytes, kReservedBytes,
    kActiveBytes, kInactiveSplitBytes, kRequestedBytes
  };
  struct PoolStats {
    PoolStat st[9][3];
    PeakTrack track[9][3];
    int64_t ooms = 0, device_alloc = 0, device_free = 0;
  };

 public:

  // Pools: torch.cuda.MemPool (createOrIncrefPool in its constructor,
  // use_count() = getPoolUseCount, releasePool in its destructor).
  // From 2.8 (the allocator as a raw pointer to 2.10, a shared_ptr from
  // 2.11). Before 2.8 there is no such call: beginAllocateToPool creates or
  // increfs the pool (the native allocator's beginAllocateToPool of those
  // versions) and releasePool decrefs it, which the override below does.
#if !defined(VMM_NO_createOrIncrefPool) && VMM_TORCH_AT_LEAST(2, 11)
  void createOrIncrefPool(c10::DeviceIndex device, MempoolId_t id,
                          std::shared_ptr<CCA::CUDAAllocator> allocator) VMM_OVERRIDE {
    create_or_incref_pool(device, id, std::move(allocator));
  }
#elif !defined(VMM_NO_createOrIncrefPool) && VMM_TORCH_AT_LEAST(2, 8)
  void createOrIncrefPool(c10::DeviceIndex device, MempoolId_t id,
                          CCA::CUDAAllocator* allocator) VMM_OVERRIDE {
    // 2.8-2.10's PrivatePool keeps a raw pointer (the MemPool owns it): not owned here either.
    create_or_incref_pool(device, id, std::shared_ptr<CCA::CUDAAllocator>(std::shared_ptr<void>(),
                                                                          allocator));
  }
#endif

  void create_or_incref_pool(c10::DeviceIndex device, MempoolId_t id,
                             std::shared_ptr<CCA::CUDAAllocator> allocator) {
    {
      std::lock_guard<std::mutex> g(custom_mu_);
      auto it = custom_pools_.find(id);
      if (it != custom_pools_.end()) {  // a capture into a MemPool(allocator=...)'s id
        // create_or_incref_pool: TORCH_INTERNAL_ASSERT(use_count > 0) and no second allocator.
        TORCH_CHECK(it->second->use_count > 0, "vmmalloc: pool (", id.first, ", ", id.second,
                    ") has no users left");
        TORCH_CHECK(!allocator || allocator.get() == it->second->allocator, "vmmalloc: pool (",
                    id.first, ", ", id.second, ") already has another allocator");
        it->second->use_count++;
        return;
      }
      if (allocator && allocator.get() != this) {
        auto pool = std::make_unique<CustomPool>();
        pool->id = id;
        pool->allocator = allocator.get();
        pool->keep = std::move(allocator);
        pool->device = static_cast<int>(device);
        pool->small.owner = pool->large.owner = pool.get();
        custom_pools_[id] = std::move(pool);
        return;
      }
    }
    TORCH_CHECK(lib.pool_create_or_incref(device, id.first, id.second) == 0, "vmmalloc: ",
                last_error());
  }

  // ---- torch.cuda.MemPool(allocator=...) ----
  // As the native allocator does it (c10/cuda/CUDACachingAllocator.cpp,
  // DeviceCachingAllocator): a pool made with its own allocator X is a
  // PrivatePool whose segments come from X: alloc_block asks
  // X->raw_alloc(get_allocation_size(size)) (allocPrimitive), blocks are
  // split and cached inside the pool (get_free_block's best fit on the
  // allocation's stream, should_split, alloc_found_block, free_block's
  // merge), and X->raw_delete(segment) is called only by release_block,
  // which runs for the unsplit free segments of a pool without users
  // (use_count 0) when the cache is emptied (release_cached_blocks:
  // torch.cuda.empty_cache(), ~MemPool's emptyCache(id)). vLLM's sleep mode
  // (CuMemAllocator) is this path: one cuMem handle per segment.
  // The pool's blocks count in getDeviceStats (as the native allocator's
  // stats, small or large pool by block size) and its segments are in
  // snapshot(). vmmalloc stays PyTorch's allocator for everything else.
  // Not modelled: roundup_power2_divisions and max_split_size (vmmalloc
  // reports SIZE_MAX, PyTorch's default: no oversize rules), recordStream
  // on such a block (its free is not deferred) and lending the pool's free
  // blocks for use_on_oom. While memory history is recorded, the pool's
  // events are recorded as record_trace does (segment_alloc, alloc,
  // free_requested, free_completed, segment_free, oom; its pool id).
  static constexpr size_t kMinBlockSize = 512;            // all sizes rounded to at least 512 B
  static constexpr size_t kSmallSize = 1048576;           // largest "small" allocation: 1 MiB
  static constexpr size_t kSmallBuffer = 2097152;         // small segments: 2 MiB
  static constexpr size_t kMinLargeAlloc = 10485760;      // 1-10 MiB requests take kLargeBuffer
  static constexpr size_t kRoundLarge = 2097152;          // larger ones round up to 2 MiB
  static constexpr size_t kLargeBuffer = 20971520;        // large_segment_size() default: 20 MiB

  // round_size without roundup_power2_divisions (PyTorch's default).
  static size_t pool_round_size(size_t size) {
    if (size < kMinBlockSize) return kMinBlockSize;
    return kMinBlockSize * ((size + kMinBlockSize - 1) / kMinBlockSize);
  }

  // get_allocation_size: the segment a new block of `size` asks X for.
  static size_t pool_allocation_size(size_t size) {
    if (size <= kSmallSize) return kSmallBuffer;
    if (size < kMinLargeAlloc) return kLargeBuffer;
    return kRoundLarge * ((size + kRoundLarge - 1) / kRoundLarge);
  }

  bool is_custom_pool(MempoolId_t id) {
    std::lock_guard<std::mutex> g(custom_mu_);
    return custom_pools_.count(id) != 0;
  }

  // get_pool's search: the last open span (LIFO) whose filter takes `s` on
  // `device`; custom_mu_ held.
  CustomPool* route_locked(int device, cudaStream_t s) {
    for (auto it = custom_spans_.rbegin(); it != custom_spans_.rend(); ++it) {
      if (it->device == device && it->filter(s)) {
        auto p = custom_pools_.find(it->id);
        if (p != custom_pools_.end()) return p->second.get();
      }
    }
    return nullptr;
  }

  // Adds `delta` to stat `kind` of the pool-size class (AGGREGATE and
  // SMALL_POOL or LARGE_POOL, get_stat_types_for_pool).
  static void stat_add(PoolStats& st, int kind, bool small, int64_t delta) {
    for (int t : {0, small ? 1 : 2}) {
      auto& s = st.st[kind][t];
      s.current += delta;
      if (delta > 0) {
        s.allocated += delta;
        s.peak = std::max(s.peak, s.current);
      } else {
        s.freed += -delta;
      }
    }
  }

  // The peak of a figure PyTorch reports is that of vmmalloc's part plus the
  // pools' part, but vmmalloc keeps its peak alone. Called with vmmalloc's
  // figures (`v`, vmmalloc_device_stats' layout) before and after each change
  // of the pools' figures and when the stats are read: between two calls the
  // pools' part is constant, so a rise of vmmalloc's peak in between adds to
  // that constant. A lower bound of the true peak, exact unless vmmalloc's
  // part rises and falls below its own peak between two such calls while the
  // pools' part is higher than when that peak was reached.
  static void track_peaks(PoolStats& st, const int64_t* v) {
    for (int k = 0; k < 9; ++k) {
      for (int t = 0; t < 3; ++t) {
        const int64_t* r = v + (k * 3 + t) * 4;  // current, peak, allocated, freed
        auto& tr = st.track[k][t];
        int64_t mine = st.st[k][t].current;
        if (r[1] < tr.seen_peak) {
          tr.combined = r[1] + mine;  // vmmalloc's peak was reset
        } else if (r[1] > tr.seen_peak) {
          tr.combined = std::max(tr.combined, r[1] + tr.low);
        }
        tr.seen_peak = r[1];
        tr.combined = std::max(tr.combined, r[0] + mine);
        tr.low = mine;
      }
    }
  }

  // vmmalloc's figures for track_peaks (zeros if they cannot be read).
  static void vmmalloc_figures(int device, int64_t* v) {
    std::fill(v, v + kStatsLen, 0);
    if (lib.device_stats(device, v, kStatsLen) != static_cast<int>(kStatsLen)) {
      std::fill(v, v + kStatsLen, 0);
    }
  }

  // The history events of one pool operation, recorded after custom_mu_ is
  // released (on_event takes history_mu_), on the calling thread (its
  // gathered context, t_context, goes with them). Empty unless recording.
  struct PoolEvents {
    bool on = false;
    std::vector<TraceEvent> events;
    void add(int action, const CustomPool& pool, uint64_t addr, uint64_t size, cudaStream_t s) {
      if (on) {
        events.push_back(TraceEvent{pool.device, action, addr, size,
                                    reinterpret_cast<uint64_t>(s), now_us(), pool.id.first,
                                    pool.id.second});
      }
    }
  };
  PoolEvents pool_events() {
    PoolEvents e;
    e.on = record_history_.load(std::memory_order_relaxed);
    return e;
  }
  void record_pool_events(const PoolEvents& e) {
    for (const auto& ev : e.events) {
      try {
        on_event(ev);
      } catch (...) {
      }
    }
  }
  // TraceEntry::Action codes of TraceEvent (action_of).
  static constexpr int kEvAlloc = 0, kEvFreeRequested = 1, kEvFreeCompleted = 2,
                       kEvSegmentAlloc = 3, kEvSegmentFree = 4, kEvOom = 8;

  // Whether an open span of such a pool takes stream `s` on `device` now.
  bool pool_routes(int device, cudaStream_t s) {
    std::lock_guard<std::mutex> g(custom_mu_);
    return route_locked(device, s) != nullptr;
  }

  // Whether `p` is an allocated block of such a pool.
  bool is_pool_block(void* p) {
    std::lock_guard<std::mutex> g(custom_mu_);
    return custom_live_.count(p) != 0;
  }

  // DeviceCachingAllocator::malloc for an allocation routed to a pool with
  // its own allocator: `*routed` when an open span of such a pool takes
  // stream `s` on `device`.
  void* pool_malloc(size_t orig_size, int device, cudaStream_t s, bool* routed) {
    PoolEvents ev = pool_events();
    std::unique_lock<std::mutex> g(custom_mu_);
    CustomPool* pool = route_locked(device, s);
    if (!pool) return nullptr;
    *routed = true;
    const size_t size = pool_round_size(orig_size);
    PoolBlocks& bp = size <= kSmallSize ? pool->small : pool->large;
    int64_t v[kStatsLen];
    vmmalloc_figures(device, v);
    PoolStats& st = pool_stats_[device];
    track_peaks(st, v);
    // get_free_block: the smallest free block of the stream that fits.
    PoolBlock key{0, size, 0, s, nullptr};
    PoolBlock* block = nullptr;
    auto it = bp.blocks.lower_bound(&key);
    if (it != bp.blocks.end() && (*it)->stream == s) {
      block = *it;
      bp.blocks.erase(it);
    }
    if (!block) {
      // alloc_block: a segment from X (allocPrimitive), the lock released
      // around the call as with release_lock_on_cudamalloc. The pool stays:
      // its segment count is taken first, so no emptyCache erases it.
      const size_t alloc_size = pool_allocation_size(size);
      CCA::CUDAAllocator* x = pool->allocator;
      auto keep = pool->keep;
      pool->segments++;
      g.unlock();
      void* p = nullptr;
      try {
        p = x->raw_alloc(alloc_size);
      } catch (...) {
        g.lock();
        pool->segments--;
        throw;
      }
      g.lock();
      if (!p) {
        pool->segments--;
        st.ooms++;  // stats.num_ooms
        ev.add(kEvOom, *pool, 0, size, s);
        g.unlock();
        record_pool_events(ev);
        notify_oom(device, alloc_size);
        TORCH_CHECK_WITH(OutOfMemoryError, false, "vmmalloc: the allocator of MemPool (",
                         pool->id.first, ", ", pool->id.second, ") could not allocate ",
                         alloc_size, " bytes (raw_alloc returned NULL)");
      }
      block = new PoolBlock{reinterpret_cast<uintptr_t>(p), alloc_size, 0, s, &bp};
      stat_add(st, kSegment, bp.is_small, 1);
      stat_add(st, kReservedBytes, bp.is_small, static_cast<int64_t>(alloc_size));
      st.device_alloc++;
      ev.add(kEvSegmentAlloc, *pool, block->ptr, alloc_size, s);
    }
    // should_split (max_split_size is SIZE_MAX) and alloc_found_block.
    const size_t remaining_size = block->size - size;
    const bool split = !pool->no_split && (bp.is_small ? remaining_size >= kMinBlockSize
                                                       : remaining_size > kSmallSize);
    const bool already_split = block->is_split();
    if (split) {
      PoolBlock* remaining = block;
      block = new PoolBlock{remaining->ptr, size, 0, s, &bp};
      block->prev = remaining->prev;
      if (block->prev) block->prev->next = block;
      block->next = remaining;
      remaining->prev = block;
      remaining->ptr += size;
      remaining->size -= size;
      bp.blocks.insert(remaining);
      if (already_split) {
        stat_add(st, kInactiveSplitBytes, bp.is_small, -static_cast<int64_t>(block->size));
      } else {
        stat_add(st, kInactiveSplitBytes, bp.is_small, static_cast<int64_t>(remaining->size));
        stat_add(st, kInactiveSplit, bp.is_small, 1);
      }
    } else if (already_split) {
      stat_add(st, kInactiveSplitBytes, bp.is_small, -static_cast<int64_t>(block->size));
      stat_add(st, kInactiveSplit, bp.is_small, -1);
    }
    block->allocated = true;
    block->requested = orig_size;
    stat_add(st, kAllocation, bp.is_small, 1);
    stat_add(st, kAllocatedBytes, bp.is_small, static_cast<int64_t>(block->size));
    stat_add(st, kActive, bp.is_small, 1);
    stat_add(st, kActiveBytes, bp.is_small, static_cast<int64_t>(block->size));
    stat_add(st, kRequestedBytes, bp.is_small, static_cast<int64_t>(orig_size));
    track_peaks(st, v);
    void* out = reinterpret_cast<void*>(block->ptr);
    custom_live_[out] = block;
    g_custom_live.fetch_add(1, std::memory_order_relaxed);
    ev.add(kEvAlloc, *pool, block->ptr, orig_size, s);
    g.unlock();
    record_pool_events(ev);
    return out;
  }

  // DeviceCachingAllocator::free + free_block for a block of such a pool:
  // it goes back to its pool, merged with free neighbours; X is not called.
  bool pool_free(void* p) {
    PoolEvents ev = pool_events();
    std::unique_lock<std::mutex> g(custom_mu_);
    auto it = custom_live_.find(p);
    if (it == custom_live_.end()) return false;
    PoolBlock* block = it->second;
    custom_live_.erase(it);
    g_custom_live.fetch_sub(1, std::memory_order_relaxed);
    PoolBlocks& bp = *block->pool;
    const int device = bp.owner->device;
    int64_t v[kStatsLen];
    vmmalloc_figures(device, v);
    PoolStats& st = pool_stats_[device];
    track_peaks(st, v);
    block->allocated = false;
    ev.add(kEvFreeRequested, *bp.owner, block->ptr, block->requested, block->stream);
    ev.add(kEvFreeCompleted, *bp.owner, block->ptr, block->requested, block->stream);
    const auto original_size = static_cast<int64_t>(block->size);
    stat_add(st, kAllocation, bp.is_small, -1);
    stat_add(st, kAllocatedBytes, bp.is_small, -original_size);
    int64_t split_blocks = 0, split_bytes = 0;
    for (PoolBlock* candidate : {block->prev, block->next}) {
      size_t subsumed = try_merge_locked(block, candidate, bp);
      if (subsumed > 0) {
        split_blocks -= 1;
        split_bytes -= static_cast<int64_t>(subsumed);
      }
    }
    bp.blocks.insert(block);
    if (block->is_split()) {
      split_blocks += 1;
      split_bytes += static_cast<int64_t>(block->size);
    }
    stat_add(st, kInactiveSplit, bp.is_small, split_blocks);
    stat_add(st, kInactiveSplitBytes, bp.is_small, split_bytes);
    stat_add(st, kActive, bp.is_small, -1);
    stat_add(st, kActiveBytes, bp.is_small, -original_size);
    stat_add(st, kRequestedBytes, bp.is_small, -static_cast<int64_t>(block->requested));
    track_peaks(st, v);
    g.unlock();
    record_pool_events(ev);
    return true;
  }

  // try_merge_blocks: `src`, if free, merges into `dst`; its size or 0.
  static size_t try_merge_locked(PoolBlock* dst, PoolBlock* src, PoolBlocks& bp) {
    if (!src || src->allocated) return 0;
    if (dst->prev == src) {  // [src dst]
      dst->ptr = src->ptr;
      dst->prev = src->prev;
      if (dst->prev) dst->prev->next = dst;
    } else {  // [dst src]
      dst->next = src->next;
      if (dst->next) dst->next->prev = dst;
    }
    const size_t subsumed = src->size;
    dst->size += subsumed;
    bp.blocks.erase(src);
    delete src;
    return subsumed;
  }

  // release_cached_blocks' part for these pools: each pool without users
  // (all of them for {0, 0}, else the one named) gives its unsplit free
  // segments back to its allocator (release_blocks, release_block's
  // raw_delete); one left with no segment is forgotten (graph_pools.erase).
  void pool_empty_cache(MempoolId_t id) {
    PoolEvents ev = pool_events();
    std::vector<std::pair<CCA::CUDAAllocator*, void*>> deletes;
    std::vector<std::shared_ptr<CCA::CUDAAllocator>> keep;  // X outlives its raw_deletes
    {
      std::lock_guard<std::mutex> g(custom_mu_);
      const bool all = id.first == 0 && id.second == 0;
      for (auto it = custom_pools_.begin(); it != custom_pools_.end();) {
        CustomPool& pool = *it->second;
        if ((!all && it->first != id) || pool.use_count > 0) {
          ++it;
          continue;
        }
        int64_t v[kStatsLen];
        vmmalloc_figures(pool.device, v);
        PoolStats& st = pool_stats_[pool.device];
        track_peaks(st, v);
        for (PoolBlocks* bp : {&pool.small, &pool.large}) {
          for (auto b = bp->blocks.begin(); b != bp->blocks.end();) {
            PoolBlock* block = *b;
            if (block->is_split()) {
              ++b;
              continue;
            }
            b = bp->blocks.erase(b);
            deletes.emplace_back(pool.allocator, reinterpret_cast<void*>(block->ptr));
            ev.add(kEvSegmentFree, pool, block->ptr, block->size, block->stream);
            stat_add(st, kSegment, bp->is_small, -1);
            stat_add(st, kReservedBytes, bp->is_small, -static_cast<int64_t>(block->size));
            st.device_free++;
            pool.segments--;
            delete block;
          }
        }
        track_peaks(st, v);
        keep.push_back(pool.keep);
        if (pool.segments == 0) {
          it = custom_pools_.erase(it);
        } else {
          ++it;
        }
      }
    }
    record_pool_events(ev);
    for (auto& [x, p] : deletes) x->raw_delete(p);
  }

  // torch.cuda.empty_cache() (id {0, 0}) and ~MemPool (its id): the pools'
  // part, then vmmalloc's (the pluggable allocator's reset function) unless
  // the id is such a pool's. From 2.8 (before, emptyCache takes no id and no
  // pool has its own allocator).
#if !defined(VMM_NO_emptyCache) && VMM_TORCH_AT_LEAST(2, 8)
  void emptyCache(MempoolId_t mempool_id) VMM_OVERRIDE {
    const bool custom = is_custom_pool(mempool_id);
    {
      ContextScope scope(gather_at(kAll));  // emptyCache's context (ALL)
      pool_empty_cache(mempool_id);
    }
    if (!custom) Base::emptyCache(mempool_id);
  }
#endif

  // The pools' figures added to vmmalloc's (`v`, read into `s`), as the
  // native allocator's one DeviceStats counts every pool.
  void add_pool_stats(int device, const int64_t* v, CCA::DeviceStats& s) {
    std::lock_guard<std::mutex> g(custom_mu_);
    auto it = pool_stats_.find(device);
    if (it == pool_stats_.end()) return;
    PoolStats& st = it->second;
    track_peaks(st, v);
    int k = 0;
    for (auto* a : {&s.allocation, &s.segment, &s.active, &s.inactive_split, &s.allocated_bytes,
                    &s.reserved_bytes, &s.active_bytes, &s.inactive_split_bytes,
                    &s.requested_bytes}) {
      for (int t = 0; t < 3; ++t) {
        auto& out = (*a)[t];
        const auto& mine = st.st[k][t];
        out.current += mine.current;
        out.peak = std::max<int64_t>(out.peak, st.track[k][t].combined);
        out.allocated += mine.allocated;
        out.freed += mine.freed;
      }
      ++k;
    }
    s.num_ooms += st.ooms;
    s.num_device_alloc += st.device_alloc;
    s.num_device_free += st.device_free;
  }

  // The pools' part of getDeviceStats in vmmalloc_device_stats' layout
  // (`out`, kStatsLen entries): current, allocated and freed are the pools'
  // own, peak is the combined peak less vmmalloc's. 0 when no such pool was
  // used on `device`, else kStatsLen.
  int pool_figures(int device, int64_t* out) {
    std::lock_guard<std::mutex> g(custom_mu_);
    auto it = pool_stats_.find(device);
    if (it == pool_stats_.end()) return 0;
    PoolStats& st = it->second;
    int64_t v[kStatsLen];
    vmmalloc_figures(device, v);
    track_peaks(st, v);
    std::fill(out, out + kStatsLen, 0);
    for (int k = 0; k < 9; ++k) {
      for (int t = 0; t < 3; ++t) {
        int64_t* o = out + (k * 3 + t) * 4;
        const auto& mine = st.st[k][t];
        o[0] = mine.current;
        o[1] = std::max<int64_t>(0, st.track[k][t].combined - v[(k * 3 + t) * 4 + 1]);
        o[2] = mine.allocated;
        o[3] = mine.freed;
      }
    }
    out[9 * 3 * 4 + 1] = st.ooms;          // num_ooms (torch_abi.rs layout)
    out[9 * 3 * 4 + 11] = st.device_alloc;  // num_device_alloc
    out[9 * 3 * 4 + 12] = st.device_free;   // num_device_free
    return static_cast<int>(kStatsLen);
  }

  // resetPeakStats' part for the pools (after vmmalloc's own reset).
  void reset_pool_peaks(int device) {
    std::lock_guard<std::mutex> g(custom_mu_);
    auto it = pool_stats_.find(device);
    if (it == pool_stats_.end()) return;
    int64_t v[kStatsLen];
    vmmalloc_figures(device, v);
    for (int k = 0; k < 9; ++k) {
      for (int t = 0; t < 3; ++t) {
        auto& mine = it->second.st[k][t];
        mine.peak = mine.current;
        const int64_t* r = v + (k * 3 + t) * 4;
        it->second.track[k][t] = PeakTrack{r[1], mine.current, r[0] + mine.current};
      }
    }
  }

  // resetAccumulatedStats' part for the pools (allocated/freed and the
  // counts the native resetAccumulatedStats zeroes).
  void reset_pool_accumulated(int device) {
    std::lock_guard<std::mutex> g(custom_mu_);
    auto it = pool_stats_.find(device);
    if (it == pool_stats_.end()) return;
    for (auto& row : it->second.st) {
      for (auto& s : row) s.allocated = s.freed = 0;
    }
    it->second.ooms = it->second.device_alloc = it->second.device_free = 0;
  }

  // snapshot()'s segments of these pools (all, or the one named), as the
  // native snapshot() describes a segment and its blocks.
  void add_pool_segments(CCA::SnapshotInfo& info, MempoolId_t mempool) {
    std::lock_guard<std::mutex> g(custom_mu_);
    const bool only = mempool.first != 0 || mempool.second != 0;
    std::vector<PoolBlock*> heads;
    for (auto& [id, pool] : custom_pools_) {
      if (only && id != mempool) continue;
      for (PoolBlocks* bp : {&pool->small, &pool->large}) {
        for (PoolBlock* b : bp->blocks) {
          if (!b->prev) heads.push_back(b);
        }
      }
    }
    for (auto& [p, b] : custom_live_) {
      if (!b->prev && (!only || b->pool->owner->id == mempool)) heads.push_back(b);
    }
    if (heads.empty()) return;
    for (PoolBlock* head : heads) {
      info.segments.emplace_back();
      auto& seg = info.segments.back();
      const CustomPool& pool = *head->pool->owner;
      seg.device = static_cast<c10::DeviceIndex>(pool.device);
      seg.address = static_cast<int64_t>(head->ptr);
      seg.stream = head->stream;
      seg.is_large = !head->pool->is_small;
      seg.is_expandable = false;
      seg.owner_private_pool_id = pool.id;
      for (PoolBlock* b = head; b; b = b->next) {
        seg.blocks.emplace_back();
        auto& bi = seg.blocks.back();
        bi.size = static_cast<int64_t>(b->size);
        bi.requested_size = static_cast<int64_t>(b->requested);
        bi.allocated = b->allocated;
        bi.active = b->allocated;
        seg.total_size += bi.size;
        if (bi.allocated) seg.allocated_size += bi.size;
        if (bi.active) {
          seg.active_size += bi.size;
          seg.requested_size += bi.requested_size;
        }
      }
    }
    // The native snapshot lists segments by address.
    std::stable_sort(info.segments.begin(), info.segments.end(),
                     [](const auto& a, const auto& b) { return a.address < b.address; });
  }

  void beginAllocateToPool(c10::DeviceIndex device, MempoolId_t id,
                           std::function<bool(cudaStream_t)> filter) VMM_OVERRIDE {
#if !VMM_TORCH_AT_LEAST(2, 8)
    // Before 2.8 a MemPool's own allocator is reachable only through
    // MemPoolContext. The pool is created or increfed once, by libvmmalloc's
    // begin hook behind Base::beginAllocateToPool (as the native
    // beginAllocateToPool of every version does: +1 per begin, issue 40).
    auto* active = c10::cuda::MemPoolContext::getActiveMemPool();
    TORCH_CHECK(!active || !active->allocator() || active->allocator() == this,
                "vmmalloc: torch.cuda.MemPool(allocator=...) under vmmalloc needs PyTorch 2.8 or "
                "newer; this is PyTorch ", TORCH_VERSION);
#endif
    {
      std::lock_guard<std::mutex> g(custom_mu_);
      auto it = custom_pools_.find(id);
      if (it != custom_pools_.end()) {
        // The native beginAllocateToPool: create_or_incref_pool (the span
        // is a user: use_mem_pool's exit releasePool drops it again), then
        // one span per pool at a time.
        TORCH_CHECK(it->second->use_count > 0, "vmmalloc: pool (", id.first, ", ", id.second,
                    ") has no users left");
        it->second->use_count++;
        for (const auto& span : custom_spans_) {
          TORCH_CHECK(!(span.id == id && span.device == device),
                      "beginAllocateToPool: already recording to mempool_id");
        }
        custom_spans_.push_back(CustomSpan{static_cast<int>(device), id, std::move(filter)});
        g_custom_spans.fetch_add(1, std::memory_order_relaxed);
        return;
      }
    }
    Base::beginAllocateToPool(device, id, std::move(filter));
  }

  void endAllocateToPool(c10::DeviceIndex device, MempoolId_t id) VMM_OVERRIDE {
    {
      std::lock_guard<std::mutex> g(custom_mu_);
      if (custom_pools_.count(id)) {
        for (auto it = custom_spans_.begin(); it != custom_spans_.end(); ++it) {
          if (it->id == id && it->device == device) {
            custom_spans_.erase(it);
            g_custom_spans.fetch_sub(1, std::memory_order_relaxed);
            return;
          }
        }
        TORCH_CHECK(false, "endAllocatePool: not currently recording to mempool_id");
      }
    }
    Base::endAllocateToPool(device, id);
  }

  // The native releasePool: one user less; at 0 the pool's free segments
  // may go back to its allocator at the next emptyCache.
  void releasePool(c10::DeviceIndex device, MempoolId_t id) VMM_OVERRIDE {
    {
      std::lock_guard<std::mutex> g(custom_mu_);
      auto it = custom_pools_.find(id);
      if (it != custom_pools_.end()) {
        TORCH_CHECK(it->second->use_count > 0, "vmmalloc: pool (", id.first, ", ", id.second,
                    ") has no users left");
        it->second->use_count--;
        return;
      }
    }
    Base::releasePool(device, id);
  }

  // setNoSplit (MemPool(no_split=True), from 2.10): blocks of the pool are
  // never split (CUDACachingAllocator.cpp should_split, no_split_pools) nor
  // merged; libvmmalloc does it (vmmalloc_pool_set_no_split).
#if !defined(VMM_NO_setNoSplit) && VMM_TORCH_AT_LEAST(2, 10)
  void setNoSplit(c10::DeviceIndex device, MempoolId_t id) VMM_OVERRIDE {
    {
      std::lock_guard<std::mutex> g(custom_mu_);
      auto it = custom_pools_.find(id);
      if (it != custom_pools_.end()) {  // should_split: no block of the pool is split
        it->second->no_split = true;
        return;
      }
    }
    TORCH_CHECK(lib.pool_set_no_split(device, id.first, id.second) == 0, "vmmalloc: ",
                last_error());
  }
#endif

  // MemPool(use_on_oom=True): an allocation outside any pool that would run
  // out of memory takes a free block of the pool instead, which then belongs
  // to the pool (CUDACachingAllocator.cpp malloc: "try to use existing
  // mempools as a last resort", use_on_oom_pools, get_free_block);
  // ~MemPool() turns it off (from 2.11; 2.8-2.10 call setUseOnOOM(device,
  // id) only to turn it on). libvmmalloc does it
  // (vmmalloc_pool_set_use_on_oom). A pool with its own allocator: accepted,
  // but its free blocks are not lent (libvmmalloc does not see them).
#if !defined(VMM_NO_setUseOnOOM) && VMM_TORCH_AT_LEAST(2, 11)
  void setUseOnOOM(c10::DeviceIndex device, MempoolId_t id, bool use_on_oom) VMM_OVERRIDE {
    set_use_on_oom(device, id, use_on_oom);
  }
#elif !defined(VMM_NO_setUseOnOOM) && VMM_TORCH_AT_LEAST(2, 8)
  void setUseOnOOM(c10::DeviceIndex device, MempoolId_t id) VMM_OVERRIDE {
    set_use_on_oom(device, id, true);
  }
#endif
  void set_use_on_oom(c10::DeviceIndex device, MempoolId_t id, bool on) {
    if (is_custom_pool(id)) return;
    TORCH_CHECK(lib.pool_set_use_on_oom(device, id.first, id.second, on ? 1 : 0) == 0,
                "vmmalloc: ", last_error());
  }

  // From 2.6.
#if !defined(VMM_NO_getPoolUseCount) && VMM_TORCH_AT_LEAST(2, 6)
  int getPoolUseCount(c10::DeviceIndex device, MempoolId_t id) VMM_OVERRIDE {
    {
      std::lock_guard<std::mutex> g(custom_mu_);
      auto it = custom_pools_.find(id);
      if (it != custom_pools_.end()) return it->second->use_count;
    }
    int n = lib.pool_use_count(device, id.first, id.second);
    TORCH_CHECK(n >= 0, "vmmalloc: ", last_error());
    return n;
  }
#endif

  // 2.6 and 2.7 only (2.8 renamed it createOrIncrefPool and added the
  // allocator): torch.cuda.MemPool's constructor creates its pool with use
  // count 1 (c10/cuda/CUDACachingAllocator.cpp MemPool::MemPool), use_mem_pool
  // adds one in beginAllocateToPool and drops it with releasePool, ~MemPool
  // releases the last (torch/cuda/memory.py use_mem_pool). No pool has its
  // own allocator before 2.8.
#if !defined(VMM_NO_ensureExistsAndIncrefPool) && VMM_TORCH_AT_LEAST(2, 6) && \
    !VMM_TORCH_AT_LEAST(2, 8)
  void ensureExistsAndIncrefPool(c10::DeviceIndex device, MempoolId_t id) VMM_OVERRIDE {
    TORCH_CHECK(lib.pool_create_or_incref(device, id.first, id.second) == 0, "vmmalloc: ",
                last_error());
  }
#endif

  // NCCL's register hook (ProcessGroupNCCL with
  // TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK) attaches a tracker and
  // registers the segments of SEGMENT_ALLOC entries. vmmalloc emits none:
  // its mappings move (reclaim, pause), so enable() turns the hook off and
  // says so. A tracker attached anyway is kept and never called.
#ifndef VMM_NO_attachAllocatorTraceTracker
  void attachAllocatorTraceTracker(CCA::AllocatorTraceTracker tracker) VMM_OVERRIDE {
    std::lock_guard<std::mutex> g(mu_);
    trackers_.push_back(std::move(tracker));
  }
#endif

  // IPC (torch.multiprocessing; torch/csrc/StorageSharing.cpp): the producer's
  // THPStorage_shareCuda passes getBaseAllocation(ptr) (the pluggable
  // allocator returns ptr itself) to shareIpcHandle and sends the handle and
  // its offset; the consumer's THPStorage_newSharedCuda adds that offset to
  // getIpcDevPtr(handle). With vmmalloc_ipc_export_torch the handle is
  // PyTorch's own expandable-segments one of this PyTorch's version when the
  // allocation's chunks fit it ('e', version 3 on 2.13+, 2 on 2.11/2.12:
  // ExpandableSegment::share in c10/cuda/CUDACachingAllocator.cpp), so a stock
  // PyTorch consumer imports it, with the pointer's offset in the shared
  // range; otherwise vmmalloc's own (offset 0). VMMALLOC_IPC_FORMAT chooses
  // (crates/capi/src/ipc/mod.rs). The consumer's pointer is unmapped with
  // PyTorch's last reference to it, after an event on the device's current
  // stream (which PyTorch's IPC deleter has just synchronized), not a device
  // synchronize. Without those functions in libvmmalloc, the older calls or
  // PyTorch's pluggable behaviour (it raises) apply.
#ifndef VMM_NO_shareIpcHandle
  CCA::ShareableHandle shareIpcHandle(void* ptr) VMM_OVERRIDE {
    if (lib.ipc_export_torch) {
      // "2.15.0+cu132" -> 2, 15 ("unknown" -> 0, 0: vmmalloc's own format).
      int version[2] = {0, 0};
      const char* v = VMMALLOC_TORCH_VERSION;
      for (int i = 0; i < 2 && *v >= '0' && *v <= '9'; ++i) {
        while (*v >= '0' && *v <= '9') version[i] = version[i] * 10 + (*v++ - '0');
        if (*v == '.') ++v;
      }
      const int major = version[0], minor = version[1];
      size_t len = 0, offset = 0;
      TORCH_CHECK(lib.ipc_export_torch(ptr, major, minor, nullptr, 0, &len, &offset) == 0,
                  "vmmalloc: ", last_error());
      std::string handle(len, '\0');
      TORCH_CHECK(lib.ipc_export_torch(ptr, major, minor, handle.data(), handle.size(), &len,
                                       &offset) == 0,
                  "vmmalloc: ", last_error());
      handle.resize(len);
      return CCA::ShareableHandle{static_cast<ptrdiff_t>(offset), std::move(handle)};
    }
    if (!lib.ipc_export) return Base::shareIpcHandle(ptr);
    size_t len = 0;
    TORCH_CHECK(lib.ipc_export(ptr, nullptr, 0, &len) == 0, "vmmalloc: ", last_error());
    std::string handle(len, '\0');
    TORCH_CHECK(lib.ipc_export(ptr, handle.data(), handle.size(), &len) == 0, "vmmalloc: ",
                last_error());
    handle.resize(len);
    return CCA::ShareableHandle{0, std::move(handle)};
  }
#endif

#ifndef VMM_NO_getIpcDevPtr
  std::shared_ptr<void> getIpcDevPtr(std::string handle) VMM_OVERRIDE {
    if (!lib.ipc_import) return Base::getIpcDevPtr(std::move(handle));
    // THPStorage_newSharedCuda holds a CUDAGuard on the storage's device: a
    // handle of PyTorch's own allocator names no device, so import there.
    int device = -1;
    if (lib.ipc_import_device && cudaGetDevice(&device) != cudaSuccess) {
      (void)cudaGetLastError();
      device = -1;
    }
    void* p = nullptr;
    int rc = lib.ipc_import_device ? lib.ipc_import_device(handle.data(), handle.size(), device, &p)
                                   : lib.ipc_import(handle.data(), handle.size(), &p);
    TORCH_CHECK(rc == 0, "vmmalloc: ", last_error());
    if (lib.ipc_close_on && device >= 0) {
      auto index = static_cast<c10::DeviceIndex>(device);
      return std::shared_ptr<void>(p, [index](void* q) {
        // The stream PyTorch's IPC deleter synchronized before releasing us.
        void* stream = nullptr;
        try {
          stream = c10::cuda::getCurrentCUDAStream(index).stream();
        } catch (...) {
        }
        lib.ipc_close_on(q, stream);
      });
    }
    return std::shared_ptr<void>(p, [](void* q) { lib.ipc_close(q); });
  }
#endif

 private:
  static void add_segment(void* ctx, const Segment* s, const Block* blocks, size_t n) {
    try {
      auto* info = static_cast<CCA::SnapshotInfo*>(ctx);
      info->segments.emplace_back();
      auto& seg = info->segments.back();
      seg.device = s->device;
      seg.address = static_cast<int64_t>(s->address);
      seg.total_size = static_cast<int64_t>(s->total_size);
      seg.allocated_size = static_cast<int64_t>(s->allocated_size);
      seg.active_size = static_cast<int64_t>(s->active_size);
      seg.requested_size = static_cast<int64_t>(s->requested_size);
      seg.stream = reinterpret_cast<cudaStream_t>(s->stream);
      seg.is_large = s->is_large != 0;
      seg.is_expandable = s->is_expandable != 0;
      seg.owner_private_pool_id = {s->pool_hi, s->pool_lo};
      for (size_t i = 0; i < n; ++i) {
        seg.blocks.emplace_back();
        auto& b = seg.blocks.back();
        b.size = static_cast<int64_t>(blocks[i].size);
        b.requested_size = static_cast<int64_t>(blocks[i].requested_size);
        b.allocated = blocks[i].allocated != 0;
        b.active = blocks[i].active != 0;
      }
    } catch (...) {
    }
  }


 public:
  // PyTorch's observers get (device, size of the failed request, the
  // memory-fraction cap if one is set else the device's total, the device's
  // free bytes): DeviceCachingAllocator::malloc,
  // `obs(device, alloc_size, set_fraction ? allowed_memory_maximum :
  // device_total, device_free)` (c10/cuda/CUDACachingAllocator.cpp).
  void notify_oom(int device, size_t size) {
    std::vector<CCA::OutOfMemoryObserver> observers;
    double fraction = -1;
    {
      std::lock_guard<std::mutex> g(mu_);
      observers = oom_observers_;
      auto it = fractions_.find(device);
      if (it != fractions_.end()) fraction = it->second;
    }
    if (observers.empty()) return;
    uint64_t free_bytes = 0, total = 0;
    if (!lib.mem_get_info || lib.mem_get_info(device, &free_bytes, &total) != 0) {
      size_t f = 0, t = 0;
      if (cudaMemGetInfo(&f, &t) == cudaSuccess) {
        free_bytes = f;
        total = t;
      } else {
        (void)cudaGetLastError();
      }
    }
    size_t cap = fraction >= 0 ? static_cast<size_t>(fraction * static_cast<double>(total)) : total;
    for (auto& o : observers) o(device, size, cap, free_bytes);
  }

 private:
  // The allocator settings of snapshot()["allocator_settings"]
  // (torch/csrc/cuda/Module.cpp reads config_metadata): vmmalloc maps pages
  // (expandable segments), never caps splits (PyTorch's default
  // max_split_size, SIZE_MAX) and has no garbage-collection threshold (0, its
  // default); last_allocator_settings (Python's "PYTORCH_CUDA_ALLOC_CONF"
  // key) carries vmmalloc's effective configuration. Fields a PyTorch
  // version lacks are skipped at compile time.
  template <class T, class = void>
  struct HasSettings : std::false_type {};
  template <class T>
  struct HasSettings<T, std::void_t<decltype(std::declval<T&>().last_allocator_settings)>>
      : std::true_type {};
  template <class T, class = void>
  struct HasSplit : std::false_type {};
  template <class T>
  struct HasSplit<T, std::void_t<decltype(std::declval<T&>().max_split_size)>> : std::true_type {};
  template <class T, class = void>
  struct HasGc : std::false_type {};
  template <class T>
  struct HasGc<T, std::void_t<decltype(std::declval<T&>().garbage_collection_threshold)>>
      : std::true_type {};

  template <class C>
  static void set_config(C& c) {
    c.expandable_segments = true;
    if constexpr (HasSplit<C>::value) c.max_split_size = std::numeric_limits<size_t>::max();
    if constexpr (HasGc<C>::value) c.garbage_collection_threshold = 0.0;
    if constexpr (HasSettings<C>::value) {
      std::string text = "vmmalloc";
      if (lib.settings && lib.free_string) {
        if (char* s = lib.settings()) {
          text += " ";
          text += s;
          lib.free_string(s);
        }
      }
      c.last_allocator_settings = text;
    }
  }

  using Annotation = decltype(CCA::SnapshotInfo{}.external_annotations)::value_type;
  // A block allocated while recording.
  struct Live {
    int device;
    uint64_t size, stream;
    MempoolId_t pool;
    std::shared_ptr<c10::GatheredContext> context;
  };

  // Appends to device `device`'s ring (oldest dropped first); history_mu_ held.
  void push_locked(int device, CCA::TraceEntry&& te) {
    auto& ring = traces_[device];
    if (ring.size() >= max_entries_) ring.pop_front();
    ring.push_back(std::move(te));
  }

  std::string compile_context_locked() const {
    return compile_context_.empty() ? std::string("N/A") : compile_context_.back();
  }

 public:
  // The allocator PyTorch uses (set by vmmalloc_companion_install), for the
  // trace sink.
  static inline VmmallocAllocator* current_allocator = nullptr;

 private:
  std::atomic<bool> record_history_{false};
  // Guards the history state below. Taken inside libvmmalloc's history lock
  // (the sink) and after its allocator lock is released (snapshot); never
  // held while calling libvmmalloc.
  std::mutex history_mu_;
  size_t max_entries_ = 1;
  std::vector<CCA::TraceEntry::Action> skip_;
  std::unordered_map<int, std::deque<CCA::TraceEntry>> traces_;
  std::deque<Annotation> annotations_;
  std::unordered_map<uint64_t, Live> live_;
  std::unordered_map<uint64_t, std::shared_ptr<c10::GatheredContext>> segment_context_;
  std::vector<std::string> compile_context_;

  // Pools with their own allocator (MemPool(allocator=...)): the pools, the
  // open begin..end spans (captures_underway), the allocated blocks by
  // address and the pools' figures by device.
  struct CustomSpan {
    int device;
    MempoolId_t id;
    std::function<bool(cudaStream_t)> filter;
  };
  // Never held while calling another allocator; held while reading
  // vmmalloc_device_stats (libvmmalloc never waits for it).
  std::mutex custom_mu_;
  std::map<MempoolId_t, std::unique_ptr<CustomPool>> custom_pools_;
  std::vector<CustomSpan> custom_spans_;
  std::unordered_map<void*, PoolBlock*> custom_live_;
  std::unordered_map<int, PoolStats> pool_stats_;

  std::mutex mu_;
  std::vector<CCA::OutOfMemoryObserver> oom_observers_;
  std::vector<CCA::AllocatorTraceTracker> trackers_;
  std::unordered_map<int, double> fractions_;
};

// Never destroyed: PyTorch's own static destructors may still call the
// current allocator while the process exits (CudaIPCTypes.cpp's sent-data
// cleanup, "Producer process has been terminated before all shared CUDA
// tensors released"), so a static shared_ptr here could free it first ("pure
// virtual method called").
std::shared_ptr<VmmallocAllocator>* current = nullptr;

VmmallocAllocator* current_allocator_for_tests() { return current ? current->get() : nullptr; }

// companion_malloc's route for pools with their own allocator: `*routed`
// when an open span of such a pool takes this stream.
// While history is recorded, the allocation's context (STATE, as malloc)
// and the free's (ALL) are gathered first, outside the companion's locks.
void* custom_malloc(size_t n, int device, cudaStream_t s, bool* routed) {
  auto* a = VmmallocAllocator::current_allocator;
  if (!a) return nullptr;
  if (g_when.load(std::memory_order_relaxed) < kState || !a->pool_routes(device, s)) {
    return a->pool_malloc(n, device, s, routed);
  }
  ContextScope scope(gather_at(kState));
  return a->pool_malloc(n, device, s, routed);
}

bool custom_free(void* p) {
  auto* a = VmmallocAllocator::current_allocator;
  if (!a) return false;
  if (g_when.load(std::memory_order_relaxed) < kAll || !a->is_pool_block(p)) return a->pool_free(p);
  ContextScope scope(gather_at(kAll));
  return a->pool_free(p);
}

template <class F>
bool resolve(void* h, const char* name, F& f, std::string& missing) {
  void* p = dlsym(h, name);
  if (!p) missing += std::string(missing.empty() ? "" : ", ") + name;
  f = reinterpret_cast<F>(p);
  return p != nullptr;
}

void copy_error(const std::string& what, char* err, size_t len) {
  if (!err || len == 0) return;
  std::strncpy(err, what.c_str(), len - 1);
  err[len - 1] = '\0';
}

}  // namespace

extern "C" const char* vmmalloc_companion_torch_version() { return VMMALLOC_TORCH_VERSION; }

// 1 once installed over a libvmmalloc with the IPC functions, else 0.
extern "C" int vmmalloc_companion_has_ipc() { return lib.ipc_export != nullptr; }

// 1 once installed over a libvmmalloc that records history and answers
// cacheInfo (vmmalloc_record_history, vmmalloc_cache_info), else 0.
extern "C" int vmmalloc_companion_has_history() {
  return lib.record_history != nullptr && lib.set_trace_sink != nullptr && lib.cache_info != nullptr;
}

// c10::cuda::CUDACachingAllocator::cacheInfo (what cudnn calls) through
// PyTorch's current allocator. Returns 0, or -1 if it raised. For tests.
extern "C" int vmmalloc_companion_cache_info_for_tests(int device, size_t* largest) {
  try {
    c10::cuda::CUDACachingAllocator::cacheInfo(static_cast<c10::DeviceIndex>(device), largest);
    return 0;
  } catch (...) {
    return -1;
  }
}

extern "C" void vmmalloc_companion_throw_oom(const char* what) {
  throw c10::OutOfMemoryError(
      c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, std::string(what));
}

// libvmmalloc's out-of-memory handler (vmmalloc_set_oom_handler): tells the
// observers, then throws c10::OutOfMemoryError (torch.cuda.OutOfMemoryError).
extern "C" void vmmalloc_companion_on_oom(int device, size_t size, const char* what) {
  if (current) (*current)->notify_oom(device, size);
  vmmalloc_companion_throw_oom(what);
}

// Allocates `size` bytes on `device` through the function PyTorch's
// allocate/raw_alloc paths call (lib.malloc, libvmmalloc's vmmalloc_malloc)
// and frees them: 0 on success, 1 if it raised c10::OutOfMemoryError (the
// observers were told), -1 for any other exception. For tests on machines
// without a GPU, where PyTorch's own entry points stop at cudaGetDevice.
extern "C" int vmmalloc_companion_malloc_for_tests(size_t size, int device) {
  try {
    void* p = companion_malloc(size, device, nullptr);
    if (p) companion_free(p, size, device, nullptr);
    return 0;
  } catch (const c10::OutOfMemoryError&) {
    return 1;
  } catch (...) {
    return -1;
  }
}

// Allocates `size` bytes on `device` through the path PyTorch's
// allocate/raw_alloc take (companion_malloc: context gathering and all), or
// NULL if that raised. For tests on machines without a GPU.
extern "C" void* vmmalloc_companion_alloc_for_tests(size_t size, int device) {
  try {
    return companion_malloc(size, device, nullptr);
  } catch (...) {
    return nullptr;
  }
}

// Frees what vmmalloc_companion_alloc_for_tests returned, through the path
// PyTorch's raw_delete takes (companion_free). For tests.
extern "C" void vmmalloc_companion_free_for_tests(void* p, size_t size, int device) {
  try {
    companion_free(p, size, device, nullptr);
  } catch (...) {
  }
}

// The companion's part of a cache-hit allocation: `rounds` rounds of
// `pairs` companion_malloc + companion_free of `size` bytes on `device` (the
// path PyTorch's allocate/raw_delete take, with whatever history recording
// is set); writes the median nanoseconds per pair to `median_ns`. Returns 0,
// or -1 if an allocation failed. For scripts/bench_history.py and tests.
extern "C" int vmmalloc_companion_bench_pairs_for_tests(size_t size, int device, size_t pairs,
                                                        int rounds, double* median_ns) {
  try {
    if (!median_ns || rounds < 1 || pairs < 1) return -1;
    std::vector<double> per_pair;
    for (int r = 0; r < rounds; ++r) {
      auto t0 = std::chrono::steady_clock::now();
      for (size_t i = 0; i < pairs; ++i) {
        void* p = companion_malloc(size, device, nullptr);
        if (!p) return -1;
        companion_free(p, size, device, nullptr);
      }
      std::chrono::duration<double, std::nano> dt = std::chrono::steady_clock::now() - t0;
      per_pair.push_back(dt.count() / static_cast<double>(pairs));
    }
    std::sort(per_pair.begin(), per_pair.end());
    *median_ns = per_pair[per_pair.size() / 2];
    return 0;
  } catch (...) {
    return -1;
  }
}

// The hot path's own part, side by side (issue 35): `rounds` rounds of
// `pairs` cache-hit allocations of `size` bytes on device 0 turned into a
// tensor's DataPtr and freed by its deleter, (a) as the companion does
// (companion_malloc, data_ptr_of, delete_context) and (b) as PyTorch's
// CUDAPluggableAllocator does (its malloc: std::function + map insert under
// a mutex; its raw_delete: map lookup and erase + std::function). Both skip
// PyTorch's GetDevice/getCurrentCUDAStream, which are the same either way
// and need a GPU. Writes the median ns per pair of each. Returns 0, or -1.
extern "C" int vmmalloc_companion_bench_hot_path_for_tests(size_t size, size_t pairs, int rounds,
                                                           double* companion_ns,
                                                           double* pluggable_ns) {
  try {
    auto* a = current_allocator_for_tests();
    if (!a || !companion_ns || !pluggable_ns || rounds < 1 || pairs < 1) return -1;
    auto median = [&](auto&& one) {
      std::vector<double> per_pair;
      for (int r = 0; r < rounds; ++r) {
        auto t0 = std::chrono::steady_clock::now();
        for (size_t i = 0; i < pairs; ++i) one();
        std::chrono::duration<double, std::nano> dt = std::chrono::steady_clock::now() - t0;
        per_pair.push_back(dt.count() / static_cast<double>(pairs));
      }
      std::sort(per_pair.begin(), per_pair.end());
      return per_pair[per_pair.size() / 2];
    };
    bool ok = true;
    *companion_ns = median([&] {
      c10::DataPtr d = VmmallocAllocator::data_ptr_of(companion_malloc(size, 0, nullptr), 0);
      ok = ok && d.get() != nullptr;
    });
    *pluggable_ns = median([&] {
      void* p = a->Base::malloc(size, 0, nullptr);
      ok = ok && p != nullptr;
      a->Base::raw_delete(p);
    });
    return ok ? 0 : -1;
  } catch (...) {
    return -1;
  }
}

namespace {
// An allocator of host memory standing for a MemPool's own allocator X in
// tests without a GPU (the pluggable allocator's raw_alloc asks CUDA for the
// current device). Counts what it gets: each raw_alloc is one cuMem handle
// for vLLM's CuMemAllocator.
class HostTestAllocator : public Base {
 public:
  HostTestAllocator()
      : Base([](size_t n, int, cudaStream_t) { return std::malloc(n); },
             [](void* p, size_t, int, cudaStream_t) { std::free(p); }) {}
  void* raw_alloc(size_t n) override { return serve(n); }
  void* raw_alloc_with_stream(size_t n, cudaStream_t) override { return serve(n); }
  void raw_delete(void* p) override {
    live--;
    deleted++;
    std::free(p);
  }
  void* serve(size_t n) {
    if (fail) return nullptr;
    live++;
    served++;
    bytes += static_cast<int64_t>(n);
    return std::malloc(n);
  }
  int64_t live = 0, served = 0, deleted = 0, bytes = 0;
  bool fail = false;
};

int64_t allocated_bytes(int device) {
  int64_t v[kStatsLen] = {};
  if (lib.device_stats(device, v, kStatsLen) != static_cast<int>(kStatsLen)) return -1;
  return v[4 * 12];  // allocated_bytes, "all", current (torch_abi.rs layout)
}

// The stand-ins of vmmalloc_companion_test_pool_create's pools, by pool id
// (kept after the pool is gone, for their counts). Never destroyed.
std::map<MempoolId_t, std::shared_ptr<HostTestAllocator>>& test_allocators() {
  static auto* m = new std::map<MempoolId_t, std::shared_ptr<HostTestAllocator>>();
  return *m;
}
}  // namespace

// torch.cuda.MemPool(allocator=X)'s constructor as PyTorch 2.8+ runs it,
// createOrIncrefPool(device 0, (hi, lo), X), with X a counting host
// allocator (vmmalloc_companion_test_pool_counts). Tests drive the pool
// with torch._C's own calls (use_mem_pool's _cuda_beginAllocateCurrentThreadToPool,
// _cuda_endAllocateToPool, _cuda_releasePool; _cuda_emptyCache) and the
// companion's allocation path (vmmalloc_companion_alloc_for_tests), as
// MemPool() needs a GPU. Returns 0, or -1 with the reason in `err`.
extern "C" int vmmalloc_companion_test_pool_create(uint64_t hi, uint64_t lo, char* err,
                                                   size_t err_len) {
#if VMM_TORCH_AT_LEAST(2, 8)
  try {
    auto* a = current_allocator_for_tests();
    TORCH_CHECK(a, "the companion is not installed");
    auto x = std::make_shared<HostTestAllocator>();
    MempoolId_t id{hi, lo};
#if VMM_TORCH_AT_LEAST(2, 11)
    a->createOrIncrefPool(0, id, x);
#else
    a->createOrIncrefPool(0, id, x.get());
#endif
    test_allocators()[id] = x;
    return 0;
  } catch (const std::exception& e) {
    copy_error(e.what(), err, err_len);
    return -1;
  }
#else
  (void)hi;
  (void)lo;
  copy_error("needs PyTorch 2.8 headers", err, err_len);
  return -1;
#endif
}

// ~MemPool as PyTorch 2.8+ runs it: releasePool(device, id), then
// emptyCache(id) (torch/csrc/cuda/MemPool.cpp). Returns 0, or -1 with the reason.
extern "C" int vmmalloc_companion_test_pool_destroy(uint64_t hi, uint64_t lo, char* err,
                                                    size_t err_len) {
#if VMM_TORCH_AT_LEAST(2, 8)
  try {
    auto* a = current_allocator_for_tests();
    TORCH_CHECK(a, "the companion is not installed");
    a->releasePool(0, MempoolId_t{hi, lo});
    a->emptyCache(MempoolId_t{hi, lo});
    return 0;
  } catch (const std::exception& e) {
    copy_error(e.what(), err, err_len);
    return -1;
  }
#else
  (void)hi;
  (void)lo;
  copy_error("needs PyTorch 2.8 headers", err, err_len);
  return -1;
#endif
}

// MemPool.use_count() (getPoolUseCount on device 0), or -1 when the pool is
// unknown (it raised). For tests.
extern "C" int vmmalloc_companion_test_pool_use_count(uint64_t hi, uint64_t lo) {
#if VMM_TORCH_AT_LEAST(2, 6)
  try {
    auto* a = current_allocator_for_tests();
    return a ? a->getPoolUseCount(0, MempoolId_t{hi, lo}) : -1;
  } catch (...) {
    return -1;
  }
#else
  (void)hi;
  (void)lo;
  return -1;
#endif
}

// What the stand-in X of pool (hi, lo) got: out[0] raw_alloc calls served,
// out[1] raw_delete calls, out[2] segments live, out[3] bytes asked. With
// `fail` 1 its raw_alloc returns NULL from now on (0: serves again; -1:
// unchanged). Returns 0, or -1 for a pool it never stood for.
extern "C" int vmmalloc_companion_test_pool_counts(uint64_t hi, uint64_t lo, int fail,
                                                   int64_t* out) {
  auto it = test_allocators().find(MempoolId_t{hi, lo});
  if (it == test_allocators().end() || !out) return -1;
  auto& x = *it->second;
  if (fail >= 0) x.fail = fail != 0;
  out[0] = x.served;
  out[1] = x.deleted;
  out[2] = x.live;
  out[3] = x.bytes;
  return 0;
}

// torch.cuda.MemPool(allocator=other) + use_mem_pool as PyTorch 2.11+ call
// the allocator (MemPool's constructor: createOrIncrefPool(device, id,
// allocator); use_mem_pool: beginAllocateToPool / endAllocateToPool /
// releasePool; ~MemPool: releasePool, emptyCache(id)), with a host
// allocator standing for `other`, and the allocations made through the
// companion's own path and freed through a DataPtr's deleter and
// raw_delete. Returns 0, or -1 with the first failed check in `err`. For
// tests without a GPU.
extern "C" int vmmalloc_companion_mempool_allocator_for_tests(char* err, size_t err_len) {
#if VMM_TORCH_AT_LEAST(2, 11)
  try {
    auto* a = current_allocator_for_tests();
    TORCH_CHECK(a, "the companion is not installed");
    auto other = std::make_shared<HostTestAllocator>();
    MempoolId_t id{0, 901};
    int64_t before = allocated_bytes(0);
    a->createOrIncrefPool(0, id, other);
    TORCH_CHECK(a->getPoolUseCount(0, id) == 1, "use count after the constructor");
    a->beginAllocateToPool(0, id, [](cudaStream_t) { return true; });
    TORCH_CHECK(a->getPoolUseCount(0, id) == 2, "use count inside use_mem_pool (PyTorch: 2)");
    void* p1 = companion_malloc(1 << 20, 0, nullptr);
    c10::DataPtr d2 = VmmallocAllocator::data_ptr_of(companion_malloc(3 << 20, 0, nullptr), 0);
    a->endAllocateToPool(0, id);
    a->releasePool(0, id);  // use_mem_pool's exit
    TORCH_CHECK(a->getPoolUseCount(0, id) == 1, "use count after use_mem_pool (PyTorch: 1)");
    // A 2 MiB segment for 1 MiB, a 20 MiB one for 3 MiB (get_allocation_size).
    TORCH_CHECK(other->served == 2 && other->live == 2 && other->bytes == (22 << 20),
                "the pool's segments came from its allocator");
    TORCH_CHECK(allocated_bytes(0) == before, "vmmalloc counted the other allocator's bytes");
    void* p3 = companion_malloc(1 << 20, 0, nullptr);
    TORCH_CHECK(other->served == 2 && allocated_bytes(0) == before + (1 << 20),
                "after the span vmmalloc serves");
    TORCH_CHECK(a->checkPoolLiveAllocations(0, id, {p1, d2.get()}), "live allocations");
    TORCH_CHECK(!a->checkPoolLiveAllocations(0, id, {p1}), "live allocations (missing one)");
    // A capture into the pool's id increfs it (createOrIncrefPool without an allocator).
    a->createOrIncrefPool(0, id, nullptr);
    TORCH_CHECK(a->getPoolUseCount(0, id) == 2, "use count after a capture's incref");
    a->releasePool(0, id);
    // Frees: the deleter and raw_delete give the blocks back to the pool;
    // the segments stay cached there while the pool has a user.
    d2.clear();
    a->emptyCache({0, 0});  // torch.cuda.empty_cache(): the pool has a user
    TORCH_CHECK(other->live == 2 && other->deleted == 0, "a block went back to the allocator");
    // The second use_mem_pool: the cached 20 MiB segment serves 4 MiB, no call.
    a->beginAllocateToPool(0, id, [](cudaStream_t) { return true; });
    void* p4 = companion_malloc(4 << 20, 0, nullptr);
    a->endAllocateToPool(0, id);
    a->releasePool(0, id);
    TORCH_CHECK(other->served == 2, "the cached segment was not reused");
    a->raw_delete(p4);
    a->releasePool(0, id);  // ~MemPool: releasePool, emptyCache(id)
    a->emptyCache(id);
    TORCH_CHECK(other->deleted == 1 && other->live == 1,
                "~MemPool gave back the free segment and kept the one in use");
    TORCH_CHECK(a->getPoolUseCount(0, id) == 0, "use count after ~MemPool");
    a->raw_delete(p1);
    TORCH_CHECK(other->live == 1, "raw_delete of the last block called the allocator");
    a->emptyCache({0, 0});
    TORCH_CHECK(other->live == 0 && other->deleted == 2, "empty_cache kept the free segment");
    bool forgotten = false;
    try {
      a->getPoolUseCount(0, id);  // forgotten by the companion: libvmmalloc does not know it
    } catch (const c10::Error&) {
      forgotten = true;
    }
    TORCH_CHECK(forgotten, "the pool was not forgotten after its last segment and reference");
    companion_free(p3, 1 << 20, 0, nullptr);
    TORCH_CHECK(allocated_bytes(0) == before, "vmmalloc's own block freed");
#if VMM_TORCH_AT_LEAST(2, 10)
    // MemPool(no_split=True) with its own allocator: each block a whole segment.
    auto whole = std::make_shared<HostTestAllocator>();
    MempoolId_t ns{0, 906};
    a->createOrIncrefPool(0, ns, whole);
    a->setNoSplit(0, ns);
    a->beginAllocateToPool(0, ns, [](cudaStream_t) { return true; });
    void* n1 = companion_malloc(1000, 0, nullptr);
    void* n2 = companion_malloc(1000, 0, nullptr);
    a->endAllocateToPool(0, ns);
    a->releasePool(0, ns);
    TORCH_CHECK(whole->served == 2, "no_split: two small blocks shared a segment");
    companion_free(n1, 1000, 0, nullptr);
    companion_free(n2, 1000, 0, nullptr);
    a->releasePool(0, ns);
    a->emptyCache(ns);
    TORCH_CHECK(whole->deleted == 2 && whole->live == 0, "no_split: segments not given back");
    // MemPool(no_split=True) on one of vmmalloc's own pools: a small
    // allocation takes a whole page, a freed block is taken whole again.
    MempoolId_t own{0, 902};
    a->createOrIncrefPool(0, own, nullptr);
    a->setNoSplit(0, own);
    a->beginAllocateToPool(0, own, [](cudaStream_t) { return true; });
    int64_t at = allocated_bytes(0);
    void* s1 = companion_malloc(1000, 0, nullptr);
    TORCH_CHECK(allocated_bytes(0) - at == (2 << 20), "no_split: 1000 B did not take a whole page");
    void* b6 = companion_malloc(6 << 20, 0, nullptr);
    companion_free(b6, 6 << 20, 0, nullptr);
    void* b4 = companion_malloc(4 << 20, 0, nullptr);
    TORCH_CHECK(b4 == b6 && allocated_bytes(0) - at == (8 << 20),
                "no_split: the freed 6 MiB block was not taken whole");
    companion_free(b4, 4 << 20, 0, nullptr);
    companion_free(s1, 1000, 0, nullptr);
    a->endAllocateToPool(0, own);
    a->releasePool(0, own);
    bool unknown = false;
    try {
      a->setNoSplit(0, MempoolId_t{0, 905});
    } catch (const c10::Error& e) {
      unknown = std::string(e.what()).find("vmmalloc") != std::string::npos;
    }
    TORCH_CHECK(unknown, "setNoSplit on an unknown pool was not refused");
#endif
    return 0;
  } catch (const std::exception& e) {
    copy_error(e.what(), err, err_len);
    return -1;
  }
#else
  copy_error("needs PyTorch 2.11 headers", err, err_len);
  return -1;
#endif
}

// MemPool(use_on_oom=True) as PyTorch 2.11+ calls it, on a 1 GiB host
// device: a 400 MiB block allocated into the pool and freed stays the
// pool's (pinned while the pool has users); with 500 MiB live outside, a
// 300 MiB allocation runs out of memory, then, once the pool is marked
// use_on_oom, gets the pool's free block; ~MemPool's setUseOnOOM(false)
// ends it.
extern "C" int vmmalloc_companion_use_on_oom_for_tests(char* err, size_t err_len) {
#if VMM_TORCH_AT_LEAST(2, 11)
  try {
    auto* a = current_allocator_for_tests();
    TORCH_CHECK(a, "the companion is not installed");
    constexpr size_t MiB = size_t(1) << 20;
    MempoolId_t id{0, 903};
    a->createOrIncrefPool(0, id, nullptr);
    a->beginAllocateToPool(0, id, [](cudaStream_t) { return true; });
    void* pooled = companion_malloc(400 * MiB, 0, nullptr);
    companion_free(pooled, 400 * MiB, 0, nullptr);
    a->endAllocateToPool(0, id);
    void* live = companion_malloc(500 * MiB, 0, nullptr);
    auto oom = [&]() {
      try {
        void* p = companion_malloc(300 * MiB, 0, nullptr);
        companion_free(p, 300 * MiB, 0, nullptr);
        return false;
      } catch (const c10::OutOfMemoryError&) {
        return true;
      }
    };
    TORCH_CHECK(oom(), "300 MiB fitted without the pool's block");
    a->setUseOnOOM(0, id, true);
    void* lent = companion_malloc(300 * MiB, 0, nullptr);
    TORCH_CHECK(lent == pooled, "the allocation did not get the pool's free block");
    companion_free(lent, 300 * MiB, 0, nullptr);
    a->setUseOnOOM(0, id, false);  // ~MemPool
    TORCH_CHECK(oom(), "the pool still lends after setUseOnOOM(false)");
    bool unknown = false;
    try {
      a->setUseOnOOM(0, MempoolId_t{0, 904}, true);
    } catch (const c10::Error& e) {
      unknown = std::string(e.what()).find("vmmalloc") != std::string::npos;
    }
    TORCH_CHECK(unknown, "setUseOnOOM on an unknown pool was not refused");
    a->releasePool(0, id);
    companion_free(live, 500 * MiB, 0, nullptr);
    return 0;
  } catch (const std::exception& e) {
    copy_error(e.what(), err, err_len);
    return -1;
  }
#else
  copy_error("needs PyTorch 2.11 headers", err, err_len);
  return -1;
#endif
}

namespace {
std::shared_ptr<c10::GatheredContext> gather_python() {
  return torch::CapturedTraceback::gather(true, true, false);
}
std::shared_ptr<c10::GatheredContext> gather_with_cpp() {
  return torch::CapturedTraceback::gather(true, true, true);
}
}  // namespace

// torch._C._cuda_record_memory_history(enabled, context, stacks,
// max_entries, clear_history) as torch/csrc/cuda/memory_snapshot.cpp's
// _record_memory_history does it (its options, recorders and levels),
// without its first step, at::globalContext().lazyInitDevice(CUDA), which
// needs a GPU. `enabled`/`context` NULL are Python's None. Returns 0, or -1
// with the reason in `err`. For tests on machines without a GPU.
extern "C" int vmmalloc_companion_record_memory_history_for_tests(const char* enabled,
                                                                  const char* context,
                                                                  const char* stacks,
                                                                  size_t max_entries, int clear,
                                                                  char* err, size_t err_len) {
  try {
    TORCH_CHECK(current_allocator_for_tests(), "vmmalloc: the companion is not installed");
    std::optional<std::string> en = enabled ? std::optional<std::string>(enabled) : std::nullopt;
    std::optional<std::string> ctx = context ? std::optional<std::string>(context) : std::nullopt;
    std::string st = stacks ? stacks : "all";
    TORCH_CHECK(!en || *en == "state" || *en == "all", "expected state to be 'state', 'all', or None");
    TORCH_CHECK(!ctx || *ctx == "state" || *ctx == "alloc" || *ctx == "all",
                "expected context to be 'state', 'alloc', 'all', or None");
    TORCH_CHECK(st == "python" || st == "all", "expected stacks to be 'python', or 'all'");
    CCA::CreateContextFn recorder = gather_python;
    if (en && st == "all") recorder = gather_with_cpp;
    max_entries = (en && *en == "all") ? max_entries : 1;
    auto when = CCA::RecordContext::NEVER;
    if (ctx) {
      if (*ctx == "all") {
        when = CCA::RecordContext::ALL;
      } else if (*ctx == "alloc") {
        when = CCA::RecordContext::ALLOC;
      } else if (*ctx == "state") {
        when = CCA::RecordContext::STATE;
      }
    }
    current_allocator_for_tests()->record_history(en.has_value(), recorder, max_entries, when,
                                                  clear != 0, {});
    return 0;
  } catch (const std::exception& e) {
    copy_error(e.what(), err, err_len);
    return -1;
  }
}

// Attaches `fn` as an out-of-memory observer of the installed allocator,
// as torch._C._cuda_attach_out_of_memory_observer does (it initializes CUDA
// first, so it needs a GPU). Returns 0, or -1 when none is installed. Tests.
extern "C" int vmmalloc_companion_attach_oom_observer_for_tests(void (*fn)(int64_t, int64_t,
                                                                             int64_t, int64_t)) {
  if (!current || !fn) return -1;
  (*current)->attachOutOfMemoryObserver(
      [fn](int64_t device, size_t size, size_t cap, size_t free_bytes) {
        fn(device, static_cast<int64_t>(size), static_cast<int64_t>(cap),
           static_cast<int64_t>(free_bytes));
      });
  return 0;
}

// torch.cuda.MemPool()'s constructor call into the allocator, as this
// PyTorch makes it (its constructor needs a GPU): none before 2.6 (the pool
// is made by use_mem_pool's beginAllocateToPool), ensureExistsAndIncrefPool on
// 2.6-2.7, createOrIncrefPool (no allocator of its own) from 2.8. For the
// use-count tests of every version (issue 40). Returns 0, or -1 with the
// reason in `err`.
extern "C" int vmmalloc_companion_mempool_ctor_for_tests(int device, uint64_t hi, uint64_t lo,
                                                          char* err, size_t err_len) {
  try {
    auto* a = current_allocator_for_tests();
    TORCH_CHECK(a, "vmmalloc: the companion is not installed");
    const MempoolId_t id{hi, lo};
    const auto d = static_cast<c10::DeviceIndex>(device);
#if VMM_TORCH_AT_LEAST(2, 8)
    a->createOrIncrefPool(d, id, nullptr);
#elif VMM_TORCH_AT_LEAST(2, 6)
    a->ensureExistsAndIncrefPool(d, id);
#else
    (void)a;
    (void)id;
    (void)d;
#endif
    return 0;
  } catch (const std::exception& e) {
    copy_error(e.what(), err, err_len);
    return -1;
  }
}

// The torch.cuda.MemPool(allocator=...) pools' part of device `device`'s
// figures, for torch.cuda.memory_stats() as vmmalloc answers it
// (vmmalloc._torch, which reads libvmmalloc's own figures): n must be
// vmmalloc_device_stats' length; `out` gets what getDeviceStats adds to
// libvmmalloc's figures in that layout (the pools' current, allocated and
// freed; the combined peak less libvmmalloc's). Returns n, 0 when no such
// pool was used on the device, -1 when n is not that length or the
// companion is not installed.
extern "C" int vmmalloc_companion_pool_figures(int device, int64_t* out, size_t n) {
  auto* a = current_allocator_for_tests();
  if (!a || !out || n != kStatsLen) return -1;
  try {
    return a->pool_figures(device, out);
  } catch (...) {
    return -1;
  }
}

// torch.cuda.reset_peak_memory_stats()'s part for those pools, after
// libvmmalloc's own reset. Returns 0, or -1 when the companion is not installed.
extern "C" int vmmalloc_companion_reset_pool_peaks(int device) {
  auto* a = current_allocator_for_tests();
  if (!a) return -1;
  try {
    a->reset_pool_peaks(device);
    return 0;
  } catch (...) {
    return -1;
  }
}

// Makes a VmmallocAllocator over the libvmmalloc at `library` (already loaded
// by vmmalloc._lib) PyTorch's current CUDA allocator
// (torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator). Returns 0, or
// -1 with the reason in `err`.
extern "C" int vmmalloc_companion_install(const char* library, char* err, size_t err_len) {
  try {
    void* h = dlopen(library, RTLD_NOW | RTLD_NOLOAD);
    if (!h) h = dlopen(library, RTLD_NOW);
    if (!h) {
      copy_error(std::string("dlopen: ") + dlerror(), err, err_len);
      return -1;
    }
    std::string missing;
    resolve(h, "vmmalloc_malloc", lib.malloc, missing);
    resolve(h, "vmmalloc_free", lib.free, missing);
    resolve(h, "vmmalloc_init", lib.init, missing);
    resolve(h, "vmmalloc_empty_cache", lib.empty_cache, missing);
    resolve(h, "vmmalloc_set_memory_fraction", lib.set_memory_fraction, missing);
    resolve(h, "vmmalloc_record_stream", lib.record_stream, missing);
    resolve(h, "vmmalloc_begin_allocate_to_pool", lib.begin_pool, missing);
    resolve(h, "vmmalloc_end_allocate_to_pool", lib.end_pool, missing);
    resolve(h, "vmmalloc_release_pool", lib.release_pool, missing);
    resolve(h, "vmmalloc_pool_create_or_incref", lib.pool_create_or_incref, missing);
    resolve(h, "vmmalloc_pool_use_count", lib.pool_use_count, missing);
    resolve(h, "vmmalloc_pool_set_use_on_oom", lib.pool_set_use_on_oom, missing);
    resolve(h, "vmmalloc_pool_set_no_split", lib.pool_set_no_split, missing);
    resolve(h, "vmmalloc_pool_check_live", lib.pool_check_live, missing);
    resolve(h, "vmmalloc_pool_checkpoint", lib.pool_checkpoint, missing);
    resolve(h, "vmmalloc_checkpoint_restore", lib.checkpoint_restore, missing);
    resolve(h, "vmmalloc_checkpoint_drop", lib.checkpoint_drop, missing);
    resolve(h, "vmmalloc_device_stats", lib.device_stats, missing);
    resolve(h, "vmmalloc_visit_segments", lib.visit_segments, missing);
    resolve(h, "vmmalloc_reset_peak_stats", lib.reset_peak_stats, missing);
    resolve(h, "vmmalloc_last_error", lib.last_error, missing);
    if (!missing.empty()) {
      copy_error(std::string(library) + " lacks " + missing, err, err_len);
      return -1;
    }
    std::string optional;
    if (!resolve(h, "vmmalloc_ipc_export", lib.ipc_export, optional) ||
        !resolve(h, "vmmalloc_ipc_import", lib.ipc_import, optional) ||
        !resolve(h, "vmmalloc_ipc_close", lib.ipc_close, optional)) {
      lib.ipc_export = nullptr;
      lib.ipc_import = nullptr;
      lib.ipc_close = nullptr;
    }
    std::string later;
    resolve(h, "vmmalloc_ipc_import_device", lib.ipc_import_device, later);
    if (lib.ipc_export) {
      resolve(h, "vmmalloc_ipc_export_torch", lib.ipc_export_torch, later);
      resolve(h, "vmmalloc_ipc_close_on", lib.ipc_close_on, later);
    }
    resolve(h, "vmmalloc_set_oom_handler", lib.set_oom_handler, later);
    resolve(h, "vmmalloc_try_free", lib.try_free, later);
    resolve(h, "vmmalloc_reset_accumulated_stats", lib.reset_accumulated_stats, later);
    resolve(h, "vmmalloc_mem_get_info", lib.mem_get_info, later);
    resolve(h, "vmmalloc_settings", lib.settings, later);
    resolve(h, "vmmalloc_free_string", lib.free_string, later);
    resolve(h, "vmmalloc_record_history", lib.record_history, later);
    resolve(h, "vmmalloc_set_trace_sink", lib.set_trace_sink, later);
    resolve(h, "vmmalloc_cache_info", lib.cache_info, later);
    auto a = std::make_shared<VmmallocAllocator>();
    a->set_init_fn(lib.init);
    a->set_reset_fn(lib.empty_cache);
    a->set_memory_fraction_fn(lib.set_memory_fraction);
    a->set_record_stream_fn(lib.record_stream);
    a->set_begin_allocate_to_pool(lib.begin_pool);
    a->set_end_allocate_to_pool_fn(lib.end_pool);
    a->set_release_pool(lib.release_pool);
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(a);
    current = new std::shared_ptr<VmmallocAllocator>(a);
    VmmallocAllocator::current_allocator = a.get();
    if (lib.set_oom_handler) lib.set_oom_handler(&vmmalloc_companion_on_oom);
    return 0;
  } catch (const std::exception& e) {
    copy_error(e.what(), err, err_len);
    return -1;
  }
}
