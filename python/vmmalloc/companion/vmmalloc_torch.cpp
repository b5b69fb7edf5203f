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
// restores, use counts and statistics are Rust's (pools.rs).
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

  void raw_delete(void* ptr) VMM_OVERRIDE { companion_free(ptr, 0, current_device_hint(), nullptr); }

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
    return s;
  }
#endif

#ifndef VMM_NO_resetPeakStats
  void resetPeakStats(c10::DeviceIndex device) VMM_OVERRIDE {
    TORCH_CHECK(lib.reset_peak_stats(device) == 0, "vmmalloc: ", last_error());
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
        for (auto& [p, l] : custom_live_) {
          if (l.id != id) continue;
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

  // Pools: torch.cuda.MemPool (createOrIncrefPool in its constructor,
  // use_count() = getPoolUseCount, releasePool in its destructor).
  // From 2.8 (the allocator as a raw pointer to 2.10, a shared_ptr from
  // 2.11). Before 2.8 there is no such call: beginAllocateToPool creates or
  // increfs the pool (the native allocator's beginAllocateToPool of those
  // versions) and releasePool decrefs it, which the override below does.
#if !defined(VMM_NO_createOrIncrefPool) && VMM_TORCH_AT_LEAST(2, 11)
  void createOrIncrefPool(c10::DeviceIndex device, MempoolId_t id,
                          std::shared_ptr<CCA::CUDAAllocator> allocator) VMM_OVERRIDE {
    create_or_incref_pool(device, id, allocator.get());
  }
#elif !defined(VMM_NO_createOrIncrefPool) && VMM_TORCH_AT_LEAST(2, 8)
  void createOrIncrefPool(c10::DeviceIndex device, MempoolId_t id,
                          CCA::CUDAAllocator* allocator) VMM_OVERRIDE {
    create_or_incref_pool(device, id, allocator);
  }
#endif

  void create_or_incref_pool(c10::DeviceIndex device, MempoolId_t id,
                             CCA::CUDAAllocator* allocator) {
    {
      std::lock_guard<std::mutex> g(custom_mu_);
      auto it = custom_pools_.find(id);
      if (it != custom_pools_.end()) {  // a capture into a MemPool(allocator=...)'s id
        TORCH_CHECK(!allocator || allocator == it->second.allocator,
                    "vmmalloc: pool (", id.first, ", ", id.second,
                    ") already has another allocator");
        it->second.use_count++;
        return;
      }
      if (allocator && allocator != this) {
        custom_pools_[id] = CustomPool{allocator, static_cast<int>(device), 1};
        return;
      }
    }
    TORCH_CHECK(lib.pool_create_or_incref(device, id.first, id.second) == 0, "vmmalloc: ",
                last_error());
  }

  // ---- torch.cuda.MemPool(allocator=...) ----
  // As the native allocator (CUDACachingAllocator.cpp: a PrivatePool with an
  // allocator gets its memory from allocator->raw_alloc and gives it back
  // with raw_delete; vLLM's sleep mode works this way), a pool made with its
  // own allocator gets each allocation made into it from that allocator,
  // while vmmalloc stays PyTorch's allocator for everything else. vmmalloc
  // does not cache for such a pool (it cannot reuse memory it did not map):
  // each allocation is one raw_alloc_with_stream and its free one
  // raw_delete. Its bytes are the other allocator's and are not in
  // vmmalloc's statistics or snapshot().
  bool is_custom_pool(MempoolId_t id) {
    std::lock_guard<std::mutex> g(custom_mu_);
    return custom_pools_.count(id) != 0;
  }

  // The allocator of the first open span whose filter takes `s` on
  // `device` (native get_pool's order), with its pool.
  CCA::CUDAAllocator* custom_route(int device, cudaStream_t s, MempoolId_t* id) {
    std::lock_guard<std::mutex> g(custom_mu_);
    for (auto& span : custom_spans_) {
      if (span.device == device && span.filter(s)) {
        auto it = custom_pools_.find(span.id);
        if (it == custom_pools_.end()) continue;
        *id = span.id;
        return it->second.allocator;
      }
    }
    return nullptr;
  }

  void custom_record(void* p, CCA::CUDAAllocator* a, MempoolId_t id) {
    std::lock_guard<std::mutex> g(custom_mu_);
    custom_live_[p] = CustomLive{a, id};
    g_custom_live.fetch_add(1, std::memory_order_relaxed);
  }

  // Gives `p` back to its pool's allocator if it came from one.
  bool custom_release(void* p) {
    CCA::CUDAAllocator* a = nullptr;
    {
      std::lock_guard<std::mutex> g(custom_mu_);
      auto it = custom_live_.find(p);
      if (it == custom_live_.end()) return false;
      a = it->second.allocator;
      MempoolId_t id = it->second.id;
      custom_live_.erase(it);
      g_custom_live.fetch_sub(1, std::memory_order_relaxed);
      forget_pool_if_done_locked(id);
    }
    a->raw_delete(p);
    return true;
  }

  // A pool whose use count reached 0 and that holds nothing is forgotten
  // (the native allocator frees such a PrivatePool).
  void forget_pool_if_done_locked(MempoolId_t id) {
    auto it = custom_pools_.find(id);
    if (it == custom_pools_.end() || it->second.use_count > 0) return;
    for (auto& [p, live] : custom_live_) {
      if (live.id == id) return;
    }
    custom_pools_.erase(it);
  }

  void beginAllocateToPool(c10::DeviceIndex device, MempoolId_t id,
                           std::function<bool(cudaStream_t)> filter) VMM_OVERRIDE {
#if !VMM_TORCH_AT_LEAST(2, 8)
    // Before 2.8 there is no createOrIncrefPool: the pool is created or
    // increfed here (those versions' native beginAllocateToPool), and a
    // MemPool's own allocator is reachable only through MemPoolContext.
    auto* active = c10::cuda::MemPoolContext::getActiveMemPool();
    TORCH_CHECK(!active || !active->allocator() || active->allocator() == this,
                "vmmalloc: torch.cuda.MemPool(allocator=...) under vmmalloc needs PyTorch 2.8 or "
                "newer; this is PyTorch ", TORCH_VERSION);
    create_or_incref_pool(device, id, nullptr);
#endif
    {
      std::lock_guard<std::mutex> g(custom_mu_);
      if (custom_pools_.count(id)) {
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
        auto n = custom_spans_.size();
        custom_spans_.erase(std::remove_if(custom_spans_.begin(), custom_spans_.end(),
                                           [&](const CustomSpan& s) {
                                             return s.id == id && s.device == device;
                                           }),
                            custom_spans_.end());
        g_custom_spans.fetch_sub(static_cast<int>(n - custom_spans_.size()),
                                 std::memory_order_relaxed);
        return;
      }
    }
    Base::endAllocateToPool(device, id);
  }

  void releasePool(c10::DeviceIndex device, MempoolId_t id) VMM_OVERRIDE {
    {
      std::lock_guard<std::mutex> g(custom_mu_);
      auto it = custom_pools_.find(id);
      if (it != custom_pools_.end()) {
        if (it->second.use_count > 0) it->second.use_count--;
        forget_pool_if_done_locked(id);
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
    if (is_custom_pool(id)) return;  // nothing is split: each allocation is its allocator's own
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
  // (vmmalloc_pool_set_use_on_oom). A pool with its own allocator keeps no
  // free blocks here to lend: accepted, nothing to do.
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
      if (it != custom_pools_.end()) return it->second.use_count;
    }
    int n = lib.pool_use_count(device, id.first, id.second);
    TORCH_CHECK(n >= 0, "vmmalloc: ", last_error());
    return n;
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

  // Pools with their own allocator (MemPool(allocator=...)).
  struct CustomPool {
    CCA::CUDAAllocator* allocator;  // kept alive by the MemPool (and PyTorch's pool table)
    int device;
    int use_count;
  };
  struct CustomSpan {
    int device;
    MempoolId_t id;
    std::function<bool(cudaStream_t)> filter;
  };
  struct CustomLive {
    CCA::CUDAAllocator* allocator;
    MempoolId_t id;
  };
  std::mutex custom_mu_;  // never held while calling another allocator or libvmmalloc
  std::map<MempoolId_t, CustomPool> custom_pools_;
  std::vector<CustomSpan> custom_spans_;
  std::unordered_map<void*, CustomLive> custom_live_;

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
void* custom_malloc(size_t n, int device, cudaStream_t s, bool* routed) {
  auto* a = VmmallocAllocator::current_allocator;
  if (!a) return nullptr;
  MempoolId_t id{0, 0};
  CCA::CUDAAllocator* other = a->custom_route(device, s, &id);
  if (!other) return nullptr;
  *routed = true;
  void* p = other->raw_alloc_with_stream(n, s);
  if (p) a->custom_record(p, other, id);
  return p;
}

bool custom_free(void* p) {
  auto* a = VmmallocAllocator::current_allocator;
  return a && a->custom_release(p);
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
// An allocator of host memory standing for a MemPool's own allocator in
// tests without a GPU (the pluggable allocator's raw_alloc_with_stream asks
// CUDA for the current device). Counts what it serves.
class HostTestAllocator : public Base {
 public:
  HostTestAllocator()
      : Base([](size_t n, int, cudaStream_t) { return std::malloc(n); },
             [](void* p, size_t, int, cudaStream_t) { std::free(p); }) {}
  void* raw_alloc_with_stream(size_t n, cudaStream_t) override {
    live++;
    served++;
    return std::malloc(n);
  }
  void raw_delete(void* p) override {
    live--;
    std::free(p);
  }
  int live = 0, served = 0;
};

int64_t allocated_bytes(int device) {
  int64_t v[kStatsLen] = {};
  if (lib.device_stats(device, v, kStatsLen) != static_cast<int>(kStatsLen)) return -1;
  return v[4 * 12];  // allocated_bytes, "all", current (torch_abi.rs layout)
}
}  // namespace

// torch.cuda.MemPool(allocator=other) + use_mem_pool as PyTorch 2.11+ call
// the allocator (MemPool's constructor: createOrIncrefPool(device, id,
// allocator); use_mem_pool: beginAllocateToPool / endAllocateToPool;
// ~MemPool: releasePool), with a host allocator standing for `other`, and
// the allocations made through the companion's own path. Returns 0, or -1
// with the first failed check in `err`. For tests without a GPU.
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
    void* p1 = companion_malloc(1 << 20, 0, nullptr);
    c10::DataPtr d2 = VmmallocAllocator::data_ptr_of(companion_malloc(3 << 20, 0, nullptr), 0);
    a->endAllocateToPool(0, id);
    TORCH_CHECK(other->served == 2 && other->live == 2, "the pool's allocations went to its allocator");
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
#if VMM_TORCH_AT_LEAST(2, 10)
    a->setNoSplit(0, id);  // nothing to split in such a pool: accepted
#endif
    // Frees: the deleter and raw_delete give the memory back to `other`.
    d2.clear();
    TORCH_CHECK(other->live == 1, "the deleter returned the block to its allocator");
    a->releasePool(0, id);  // ~MemPool
    TORCH_CHECK(a->getPoolUseCount(0, id) == 0, "use count after ~MemPool");
    a->raw_delete(p1);
    TORCH_CHECK(other->live == 0, "raw_delete returned the block to its allocator");
    bool forgotten = false;
    try {
      a->getPoolUseCount(0, id);  // forgotten by the companion: libvmmalloc does not know it
    } catch (const c10::Error&) {
      forgotten = true;
    }
    TORCH_CHECK(forgotten, "the pool was not forgotten after its last block and reference");
    companion_free(p3, 1 << 20, 0, nullptr);
    TORCH_CHECK(allocated_bytes(0) == before, "vmmalloc's own block freed");
#if VMM_TORCH_AT_LEAST(2, 10)
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
