// Part of vmmalloc_torch.cpp (one translation unit; see there): the CUDAAllocator adaptor.
#pragma once

namespace {

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
          // A free's own context is gathered at ALL (native free()); below
          // that, or without one, the entry carries the block's.
          if (!ctx || g_when.load(std::memory_order_relaxed) < kAll) ctx = it->second.context;
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
    add_private_pools(device, s);
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
    // The restore's entries carry the caller's frames, as the native
    // setCheckpointPoolState gathers one context at STATE for the blocks it
    // allocates again (its frees gather their own at ALL: the sink gives a
    // free below ALL its block's context instead, on_event).
    int rc;
    {
      ContextScope scope(gather_at(kState));
      rc = lib.checkpoint_restore(device, cp->handle, on_freed, on_allocd, &out);
    }
    TORCH_CHECK(rc == 0, "vmmalloc: ", last_error());
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
    // Each pool's reserved bytes [AGGREGATE, SMALL_POOL, LARGE_POOL]
    // (DeviceStats::reserved_bytes_by_private_pools, 2.13+): kept after the
    // pool is forgotten, current 0, as the native map keeps its entry.
    std::map<MempoolId_t, std::array<PoolStat, 3>> reserved_by_pool;
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

  // Adds `delta` to one Stat (increase_stat / decrease_stat).
  static void stat_bump(PoolStat& s, int64_t delta) {
    s.current += delta;
    if (delta > 0) {
      s.allocated += delta;
      s.peak = std::max(s.peak, s.current);
    } else {
      s.freed += -delta;
    }
  }

  // Adds `delta` to stat `kind` of the pool-size class (AGGREGATE and
  // SMALL_POOL or LARGE_POOL, get_stat_types_for_pool).
  static void stat_add(PoolStats& st, int kind, bool small, int64_t delta) {
    for (int t : {0, small ? 1 : 2}) stat_bump(st.st[kind][t], delta);
  }

  // A segment of pool `id` was allocated (delta > 0) or released: its
  // reserved bytes, in the device's figures and in the pool's own.
  static void reserved_add(PoolStats& st, MempoolId_t id, bool small, int64_t delta) {
    stat_add(st, kReservedBytes, small, delta);
    auto& mine = st.reserved_by_pool[id];
    for (int t : {0, small ? 1 : 2}) stat_bump(mine[t], delta);
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
    bool on = false;        // recording history, or trackers served
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
    e.on = record_history_.load(std::memory_order_relaxed) || serving_trackers();
    return e;
  }
  // The events into the history, and the segment ones to the trackers
  // (after X's raw_alloc; before its raw_delete: the caller deletes after).
  void record_pool_events(const PoolEvents& e) {
    const bool trackers = serving_trackers();
    for (const auto& ev : e.events) {
      try {
        on_event(ev);
      } catch (...) {
      }
      if (trackers && (ev.action == kEvSegmentAlloc || ev.action == kEvSegmentFree)) {
        deliver_segment_reporting(ev.action == kEvSegmentAlloc, ev.device, ev.addr, ev.size,
                                  ev.stream, MempoolId_t{ev.pool_hi, ev.pool_lo});
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
      reserved_add(st, pool->id, bp.is_small, static_cast<int64_t>(alloc_size));
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
            reserved_add(st, pool.id, bp->is_small, -static_cast<int64_t>(block->size));
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
    // emptyCache's context (ALL), as the native release_cached_blocks
    // gathers it: the segment_unmap entries carry the caller's frames.
    ContextScope scope(gather_at(kAll));
    pool_empty_cache(mempool_id);
    if (!custom) Base::emptyCache(mempool_id);
  }
#elif !defined(VMM_NO_emptyCache)
  void emptyCache() VMM_OVERRIDE {
    ContextScope scope(gather_at(kAll));
    Base::emptyCache();
  }
#endif

  // DeviceStats::reserved_bytes_by_private_pools (the field exists from
  // 2.13; detected, not assumed): vmmalloc's private pools (graph pools,
  // MemPools it serves), then those with their own allocator.
  template <typename S>
  void add_private_pools(int device, S& s) {
    if constexpr (HasPrivatePoolStats<S>::value) {
      if (lib.private_pool_stats) {
        PrivatePoolStatsFn cb = [](void* ctx, uint64_t hi, uint64_t lo, const int64_t* v) {
          try {
            auto& out = static_cast<S*>(ctx)->reserved_bytes_by_private_pools[MempoolId_t{hi, lo}];
            for (int t = 0; t < 3; ++t) {
              out[t].current = v[t * 4];
              out[t].peak = v[t * 4 + 1];
              out[t].allocated = v[t * 4 + 2];
              out[t].freed = v[t * 4 + 3];
            }
          } catch (...) {
          }
        };
        TORCH_CHECK(lib.private_pool_stats(device, cb, &s) >= 0, "vmmalloc: ", last_error());
      }
      std::lock_guard<std::mutex> g(custom_mu_);
      auto it = pool_stats_.find(device);
      if (it == pool_stats_.end()) return;
      for (const auto& [id, arr] : it->second.reserved_by_pool) {
        auto& out = s.reserved_bytes_by_private_pools[id];
        for (int t = 0; t < 3; ++t) {
          out[t].current = arr[t].current;
          out[t].peak = arr[t].peak;
          out[t].allocated = arr[t].allocated;
          out[t].freed = arr[t].freed;
        }
      }
    }
  }

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
    for (auto& [id, arr] : it->second.reserved_by_pool) {
      for (auto& x : arr) x.peak = x.current;
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
    for (auto& [id, arr] : it->second.reserved_by_pool) {
      for (auto& x : arr) x.allocated = x.freed = 0;
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

  // NCCL's register hook: ProcessGroupNCCL (with
  // TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1, or register_mem_pool)
  // attaches trackers (attachAllocatorHooks,
  // torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp) that call
  // ncclCommRegister(addr, size) for each SEGMENT_ALLOC entry and
  // ncclCommDeregister for the handle registered at exactly addr at its
  // SEGMENT_FREE (NCCLUtils.cpp NCCLComm::registerSegment/deregisterSegment);
  // DeviceCachingAllocator::record_trace hands every entry to the trackers,
  // recording or not. Here the first tracker makes libvmmalloc follow the
  // registrable segments (crates/capi/src/segments.rs): each run of mapped
  // memory, the segments snapshot() reports, as a SEGMENT_ALLOC once it is
  // mapped and accessible and a SEGMENT_FREE before any byte of it is
  // unmapped or moved (unpinning, spill, pause, IPC re-backing: deregister,
  // move, register). MemPool(allocator=X) segments get theirs around X's
  // raw_alloc / raw_delete (record_pool_events). The trackers get only
  // these entries: vmmalloc's segment_map/unmap history entries describe
  // mappings, not registrable segments. With nccl_register:False (or a
  // libvmmalloc without the call) trackers are kept and never called.
#ifndef VMM_NO_attachAllocatorTraceTracker
  void attachAllocatorTraceTracker(CCA::AllocatorTraceTracker tracker) VMM_OVERRIDE {
    bool first = false;
    {
      std::lock_guard<std::mutex> g(mu_);
      first = trackers_.empty();
      trackers_.push_back(std::move(tracker));
    }
    if (!first) return;
    if (!lib.follow_segments) {
      TORCH_WARN("vmmalloc: this libvmmalloc cannot follow segments; NCCL's register hook is not served");
      return;
    }
    if (lib.follow_segments(&VmmallocAllocator::on_segment_change, this) != 0) {
      TORCH_WARN("vmmalloc: NCCL's register hook is not served: ", last_error());
      return;
    }
    serve_trackers_.store(true, std::memory_order_release);
  }
#endif

  // libvmmalloc's segment callback (VmmallocSegmentFn): runs under its
  // allocator's lock, as record_trace runs the trackers under the native
  // allocator's mutex. A tracker that throws (a refused ncclCommRegister)
  // cannot unwind into libvmmalloc: it is reported on stderr and the
  // allocator call goes on (the collective then copies, unregistered).
  static void on_segment_change(void* ctx, int action, int device, uint64_t addr, uint64_t size,
                                uint64_t stream, uint64_t pool_hi, uint64_t pool_lo) noexcept {
    static_cast<VmmallocAllocator*>(ctx)->deliver_segment_reporting(
        action != 0, device, addr, size, stream, MempoolId_t{pool_hi, pool_lo});
  }

  // deliver_segment, a tracker's exception reported on stderr rather than
  // thrown (for libvmmalloc's callback and MemPool(allocator=X) segments).
  void deliver_segment_reporting(bool alloc, int device, uint64_t addr, uint64_t size,
                                 uint64_t stream, MempoolId_t pool) noexcept {
    try {
      deliver_segment(alloc ? CCA::TraceEntry::SEGMENT_ALLOC : CCA::TraceEntry::SEGMENT_FREE,
                      device, addr, size, stream, pool);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "vmmalloc: warning: an allocator trace tracker failed on segment_%s %#llx (%llu bytes): %s\n",
                   alloc ? "alloc" : "free", static_cast<unsigned long long>(addr),
                   static_cast<unsigned long long>(size), e.what());
    } catch (...) {
      std::fprintf(stderr, "vmmalloc: warning: an allocator trace tracker failed on segment_%s %#llx\n",
                   alloc ? "alloc" : "free", static_cast<unsigned long long>(addr));
    }
  }

  // One SEGMENT_ALLOC / SEGMENT_FREE entry to every tracker (a copy of the
  // list: a tracker attached meanwhile waits for the next entry).
  void deliver_segment(CCA::TraceEntry::Action action, int device, uint64_t addr, uint64_t size,
                       uint64_t stream, MempoolId_t pool) {
    std::vector<CCA::AllocatorTraceTracker> trackers;
    {
      std::lock_guard<std::mutex> g(mu_);
      trackers = trackers_;
    }
    auto te = make_entry(action, device, addr, size, stream, pool, nullptr, now_us(),
                         std::string(), std::string());
    for (auto& t : trackers) t(te);
  }

  // Whether trackers get segment entries (libvmmalloc follows segments).
  bool serving_trackers() const { return serve_trackers_.load(std::memory_order_acquire); }

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
  // Whether trackers get segment entries (libvmmalloc follows segments).
  std::atomic<bool> serve_trackers_{false};
  std::unordered_map<int, double> fractions_;
};

// Never destroyed: PyTorch's own static destructors may still call the
// current allocator while the process exits (CudaIPCTypes.cpp's sent-data
// cleanup, "Producer process has been terminated before all shared CUDA
// tensors released"), so a static shared_ptr here could free it first ("pure
// virtual method called").
std::shared_ptr<VmmallocAllocator>* current = nullptr;

VmmallocAllocator* current_allocator() { return current ? current->get() : nullptr; }

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
