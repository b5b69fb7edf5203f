// Part of vmmalloc_torch.cpp (one translation unit; see there): PyTorch's memory history.
#pragma once

namespace {

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

}  // namespace
