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
// Each override that a PyTorch version may lack is inside #ifndef VMM_NO_<name>;
// _companion.py builds without the ones the compiler says override nothing and
// reports them as features lost.

#include <c10/core/Device.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <dlfcn.h>

#include <cstdint>
#include <limits>
#include <type_traits>
#include <cstring>
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
  // Optional (newer libvmmalloc): the out-of-memory handler and device memory info.
  void (*set_oom_handler)(void (*)(int, size_t, const char*));
  int (*mem_get_info)(int, uint64_t*, uint64_t*);
  char* (*settings)();
  void (*free_string)(char*);
};
Lib lib;

std::string last_error() {
  const char* e = lib.last_error();
  return e ? std::string(e) : std::string("no reason recorded");
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
      : Base([](size_t n, int d, cudaStream_t s) { return lib.malloc(n, d, s); },
             [](void* p, size_t n, int d, cudaStream_t s) { lib.free(p, n, d, s); }) {}

  std::string name() VMM_OVERRIDE { return "vmmalloc"; }

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

#ifndef VMM_NO_getMemoryFraction
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
  // snapshot() passes its pool. No trace entries: vmmalloc's history is in
  // vmmalloc.dump_snapshot() (record_history:True).
#ifndef VMM_NO_snapshot
  CCA::SnapshotInfo snapshot(MempoolId_t mempool, bool /*include_traces*/) VMM_OVERRIDE {
    CCA::SnapshotInfo info{};  // value-initialized: no field left indeterminate
    set_config(info.config_metadata);
    bool only = mempool.first != 0 || mempool.second != 0;
    TORCH_CHECK(lib.visit_segments(-1, only ? 1 : 0, mempool.first, mempool.second, &add_segment,
                                   &info) >= 0,
                "vmmalloc: ", last_error());
    return info;
  }
#endif

  // CUDA graph trees (torch/_inductor/cudagraph_trees.py).
#ifndef VMM_NO_checkPoolLiveAllocations
  bool checkPoolLiveAllocations(c10::DeviceIndex device, MempoolId_t id,
                                const std::unordered_set<void*>& expected) VMM_OVERRIDE {
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
    {
      std::lock_guard<std::mutex> g(allocator_mutex_);
      std::unordered_set<void*> back;
      for (auto& a : out.allocd) back.insert(a.first);
      for (void* p : out.freed) {
        if (!back.count(p)) allocation_metadata_.erase(p);
      }
      for (auto& a : out.allocd) {
        allocation_metadata_.insert_or_assign(
            a.first, torch::cuda::CUDAPluggableAllocator::_AllocationMetadata(
                         a.second.first, device, reinterpret_cast<cudaStream_t>(a.second.second)));
      }
    }
    delta.ptrs_freed = std::move(out.freed);
    for (auto& a : out.allocd) {
      delta.dataptrs_allocd.emplace_back(a.first, a.first, raw_deleter(),
                                         c10::Device(c10::DeviceType::CUDA, device));
    }
    return delta;
  }
#endif

  // Pools: torch.cuda.MemPool (createOrIncrefPool in its constructor,
  // use_count() = getPoolUseCount, releasePool in its destructor).
#ifndef VMM_NO_createOrIncrefPool
  void createOrIncrefPool(c10::DeviceIndex device, MempoolId_t id,
                          std::shared_ptr<CCA::CUDAAllocator> allocator) VMM_OVERRIDE {
    TORCH_CHECK(!allocator || allocator.get() == this,
                "vmmalloc: a torch.cuda.MemPool with its own allocator cannot be used while "
                "vmmalloc is PyTorch's allocator (use torch.cuda.MemPool() without one)");
    TORCH_CHECK(lib.pool_create_or_incref(device, id.first, id.second) == 0, "vmmalloc: ",
                last_error());
  }
#endif

  // MemPool(use_on_oom=True) lets the native allocator fall back on the
  // pool's free blocks when out of memory; ~MemPool() calls it with false.
  // vmmalloc keeps pools apart: false is what it does, true is refused.
#ifndef VMM_NO_setUseOnOOM
  void setUseOnOOM(c10::DeviceIndex /*device*/, MempoolId_t /*id*/, bool use_on_oom) VMM_OVERRIDE {
    TORCH_CHECK(!use_on_oom,
                "vmmalloc: torch.cuda.MemPool(use_on_oom=True) is not supported: vmmalloc never hands "
                "a pool's memory to allocations outside it");
  }
#endif

#ifndef VMM_NO_getPoolUseCount
  int getPoolUseCount(c10::DeviceIndex device, MempoolId_t id) VMM_OVERRIDE {
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
  // getIpcDevPtr(handle). vmmalloc's handle names the allocation itself
  // (vmmalloc_ipc_export, crates/capi/src/ipc), so the offset is 0, and the
  // consumer's pointer is unmapped (vmmalloc_ipc_close) with PyTorch's last
  // reference to it. Without those functions in libvmmalloc, PyTorch's
  // pluggable behaviour applies (it raises).
#ifndef VMM_NO_shareIpcHandle
  CCA::ShareableHandle shareIpcHandle(void* ptr) VMM_OVERRIDE {
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
    void* p = lib.malloc(size, device, nullptr);
    if (p) lib.free(p, size, device, nullptr);
    return 0;
  } catch (const c10::OutOfMemoryError&) {
    return 1;
  } catch (...) {
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
    resolve(h, "vmmalloc_set_oom_handler", lib.set_oom_handler, later);
    resolve(h, "vmmalloc_mem_get_info", lib.mem_get_info, later);
    resolve(h, "vmmalloc_settings", lib.settings, later);
    resolve(h, "vmmalloc_free_string", lib.free_string, later);
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
    if (lib.set_oom_handler) lib.set_oom_handler(&vmmalloc_companion_on_oom);
    return 0;
  } catch (const std::exception& e) {
    copy_error(e.what(), err, err_len);
    return -1;
  }
}
