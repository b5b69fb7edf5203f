// The torch companion's test entry points (*_for_tests, the counting host
// allocator standing for a MemPool's own allocator, vmmalloc_companion_test_pool_*),
// built only by the tests: this file #includes the shipped companion
// (python/vmmalloc/companion/vmmalloc_torch.cpp, one translation unit, found
// through the -I of the companion directory that vmmalloc/_companion.py's
// compile command adds) and adds them, so that the companion users build
// carries none of them. python/tests/conftest.py points
// $VMMALLOC_COMPANION_SOURCE here; scripts/bench_*.py do the same.

#include "vmmalloc_torch.cpp"

namespace {
VmmallocAllocator* current_allocator_for_tests() { return current_allocator(); }
}  // namespace

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
    auto* a = current_allocator();
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
    auto* a = current_allocator();
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
    auto* a = current_allocator();
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
    auto* a = current_allocator();
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

#if VMM_TORCH_AT_LEAST(2, 8)
namespace {
// MemPool(allocator=x)'s constructor as each version calls it: the
// allocator as a shared_ptr from 2.11, a raw pointer 2.8-2.10 (the MemPool
// owns it; `x` outlives the pool in the tests).
void create_pool_with(VmmallocAllocator* a, MempoolId_t id,
                      const std::shared_ptr<HostTestAllocator>& x) {
#if VMM_TORCH_AT_LEAST(2, 11)
  a->createOrIncrefPool(0, id, x);
#else
  a->createOrIncrefPool(0, id, x.get());
#endif
}

// setUseOnOOM as each version calls it: MemPool(use_on_oom=True) turns it
// on; only from 2.11 does ~MemPool turn it off (setUseOnOOM(.., false)).
// Returns whether this version can make the call.
bool set_use_on_oom(VmmallocAllocator* a, MempoolId_t id, bool on) {
#if VMM_TORCH_AT_LEAST(2, 11)
  a->setUseOnOOM(0, id, on);
  return true;
#else
  if (!on) return false;
  a->setUseOnOOM(0, id);
  return true;
#endif
}
}  // namespace
#endif

// torch.cuda.MemPool(allocator=other) + use_mem_pool as PyTorch 2.8+ call
// the allocator (MemPool's constructor: createOrIncrefPool(device, id,
// allocator); use_mem_pool: beginAllocateToPool / endAllocateToPool /
// releasePool; ~MemPool: releasePool, emptyCache(id)), with a host
// allocator standing for `other`, and the allocations made through the
// companion's own path and freed through a DataPtr's deleter and
// raw_delete. Returns 0, or -1 with the first failed check in `err`. For
// tests without a GPU.
extern "C" int vmmalloc_companion_mempool_allocator_for_tests(char* err, size_t err_len) {
#if VMM_TORCH_AT_LEAST(2, 8)
  try {
    auto* a = current_allocator();
    TORCH_CHECK(a, "the companion is not installed");
    auto other = std::make_shared<HostTestAllocator>();
    MempoolId_t id{0, 901};
    int64_t before = allocated_bytes(0);
    create_pool_with(a, id, other);
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
    create_pool_with(a, ns, whole);
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
  copy_error("needs PyTorch 2.8 headers", err, err_len);
  return -1;
#endif
}

// MemPool(use_on_oom=True) as PyTorch 2.8+ calls it, on a 1 GiB host
// device: a 400 MiB block allocated into the pool and freed stays the
// pool's (pinned while the pool has users); with 500 MiB live outside, a
// 300 MiB allocation runs out of memory, then, once the pool is marked
// use_on_oom, gets the pool's free block; ~MemPool's setUseOnOOM(false)
// ends it.
extern "C" int vmmalloc_companion_use_on_oom_for_tests(char* err, size_t err_len) {
#if VMM_TORCH_AT_LEAST(2, 8)
  try {
    auto* a = current_allocator();
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
    set_use_on_oom(a, id, true);
    void* lent = companion_malloc(300 * MiB, 0, nullptr);
    TORCH_CHECK(lent == pooled, "the allocation did not get the pool's free block");
    companion_free(lent, 300 * MiB, 0, nullptr);
    if (set_use_on_oom(a, id, false)) {  // ~MemPool (2.11+)
      TORCH_CHECK(oom(), "the pool still lends after setUseOnOOM(false)");
    }
    bool unknown = false;
    try {
      set_use_on_oom(a, MempoolId_t{0, 904}, true);
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
  copy_error("needs PyTorch 2.8 headers", err, err_len);
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
    TORCH_CHECK(current_allocator(), "vmmalloc: the companion is not installed");
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
    current_allocator()->record_history(en.has_value(), recorder, max_entries, when,
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
    auto* a = current_allocator();
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

// Whether c10's registered CUDA allocator (c10::GetAllocator(kCUDA), what
// at::getDeviceAllocator and torch.accelerator read) is the installed
// companion: 1, 0, or -1 (none installed).
extern "C" int vmmalloc_companion_registered_cuda_allocator_for_tests() {
  VmmallocAllocator* mine = current_allocator_for_tests();
  if (!mine) return -1;
  return c10::GetAllocator(c10::DeviceType::CUDA) == static_cast<c10::Allocator*>(mine) ? 1 : 0;
}

// ---------------------------------------------------------------------------
// A fake NCCL behind ProcessGroupNCCL's register hook (issue 43), as strict
// as the real pair (docs/pytorch.md, "NCCL"):
// - the tracker is ProcessGroupNCCL's (torch/csrc/distributed/c10d/
//   ProcessGroupNCCL.cpp, attachAllocatorHooks): cacheAllocatorRegisterHook
//   registers the range of each SEGMENT_ALLOC entry, cacheAllocatorDeregisterHook
//   deregisters the address of each SEGMENT_FREE; from 2.8 only for pools
//   registered with register_mem_pool unless the hook variable asks for all
//   (shouldAllCommunicatorsRegisterAllTensors; `all` here);
// - initNCCLComm (hook on) and register_mem_pool register the segments of a
//   snapshot (all of them / the pool's), deregister_mem_pool deregisters the
//   pool's snapshot segments;
// - NCCLComm::registerSegment refuses an address already registered and
//   NCCLComm::deregisterSegment one not registered (NCCLUtils.cpp
//   TORCH_CHECKs; ncclCommDeregister of an unknown handle fails too);
// - NCCL keeps a registration until it is deregistered, so a registered
//   byte must stay mapped: vmmalloc_companion_fake_nccl_check_for_tests
//   finds every registration equal to a segment of the snapshot now (a
//   segment unmapped, moved or joined under a live registration leaves a
//   registration the snapshot no longer has).
// Errors are collected (the tracker runs under libvmmalloc's lock and must
// not throw there) and reported by the check.
// ---------------------------------------------------------------------------
namespace {
struct FakeNccl {
  std::mutex mu;
  bool all = true;
  std::set<MempoolId_t> pools;
  std::map<uint64_t, uint64_t> registered;  // address -> size
  std::vector<std::string> errors;
  uint64_t registrations = 0, deregistrations = 0;

  void reg(uint64_t addr, uint64_t size) {
    if (registered.count(addr)) {
      errors.push_back("register: " + std::to_string(addr) + " is already registered");
      return;
    }
    auto next = registered.lower_bound(addr);
    if ((next != registered.end() && next->first < addr + size) ||
        (next != registered.begin() && std::prev(next)->first + std::prev(next)->second > addr)) {
      errors.push_back("register: " + std::to_string(addr) + " overlaps a registration");
      return;
    }
    registered[addr] = size;
    registrations++;
  }
  void dereg(uint64_t addr, uint64_t size) {
    auto it = registered.find(addr);
    if (it == registered.end()) {
      errors.push_back("deregister: " + std::to_string(addr) + " is not registered");
      return;
    }
    if (size && it->second != size) {
      errors.push_back("deregister: " + std::to_string(addr) + " registered with " +
                       std::to_string(it->second) + " bytes, freed with " + std::to_string(size));
    }
    registered.erase(it);
    deregistrations++;
  }
};
FakeNccl* g_nccl = nullptr;

std::vector<CCA::SegmentInfo> segments_of(MempoolId_t pool) {
  return current_allocator_for_tests()->snapshot_of(pool, false).segments;
}
}  // namespace

// Attaches the fake NCCL's tracker to the installed companion: `all` 1 as
// with TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1 (every segment of
// the snapshot is registered first, as initNCCLComm does), 0 for
// register_mem_pool only (from 2.8, where entries carry their pool).
// Returns 0, 1 when the companion does not serve the trackers (the warning
// says why), -1 when none is installed.
extern "C" int vmmalloc_companion_fake_nccl_attach_for_tests(int all) {
  VmmallocAllocator* a = current_allocator_for_tests();
  if (!a) return -1;
  if (!g_nccl) g_nccl = new FakeNccl;
  {
    std::lock_guard<std::mutex> g(g_nccl->mu);
    g_nccl->all = all != 0;
  }
  if (all) {
    auto segs = segments_of({0, 0});
    std::lock_guard<std::mutex> g(g_nccl->mu);
    for (auto& s : segs) g_nccl->reg(s.address, s.total_size);
  }
  static const bool debug = std::getenv("VMMALLOC_FAKE_NCCL_DEBUG") != nullptr;
  a->attachAllocatorTraceTracker([](const CCA::TraceEntry& te) {
    std::lock_guard<std::mutex> g(g_nccl->mu);
    bool wanted = g_nccl->all;
#if VMM_TORCH_AT_LEAST(2, 8)
    wanted = wanted || g_nccl->pools.count(te.mempool_) != 0;
    if (debug) {
      std::fprintf(stderr, "fake nccl: action %d addr %#zx size %zu pool (%llu, %llu)%s\n",
                   static_cast<int>(te.action_), static_cast<size_t>(te.addr_), static_cast<size_t>(te.size_),
                   static_cast<unsigned long long>(te.mempool_.first),
                   static_cast<unsigned long long>(te.mempool_.second), wanted ? "" : " (skipped)");
    }
#endif
    if (!wanted) return;
    if (te.action_ == CCA::TraceEntry::SEGMENT_ALLOC) g_nccl->reg(te.addr_, te.size_);
    if (te.action_ == CCA::TraceEntry::SEGMENT_FREE) g_nccl->dereg(te.addr_, te.size_);
  });
  return a->serving_trackers() ? 0 : 1;
}

// Attaches a tracker that throws on every SEGMENT_ALLOC entry, as a
// ProcessGroupNCCL hook does when ncclCommRegister fails (C10D_NCCL_CHECK
// throws), and counts the entries it saw. Returns 0, or -1 (none installed).
std::atomic<uint64_t> g_throwing_seen{0};
extern "C" int vmmalloc_companion_attach_throwing_tracker_for_tests() {
  VmmallocAllocator* a = current_allocator_for_tests();
  if (!a) return -1;
  a->attachAllocatorTraceTracker([](const CCA::TraceEntry& te) {
    g_throwing_seen.fetch_add(1);
    if (te.action_ == CCA::TraceEntry::SEGMENT_ALLOC) throw std::runtime_error("ncclCommRegister refused (test)");
  });
  return 0;
}
extern "C" uint64_t vmmalloc_companion_throwing_tracker_seen_for_tests() { return g_throwing_seen.load(); }

// ProcessGroupNCCL.register_mem_pool(pool) (`reg` 1) and
// deregister_mem_pool(pool) (`reg` 0) against the fake NCCL. Returns 0, or
// -1 (nothing attached).
extern "C" int vmmalloc_companion_fake_nccl_pool_for_tests(uint64_t hi, uint64_t lo, int reg) {
  if (!g_nccl || !current_allocator_for_tests()) return -1;
  MempoolId_t id{hi, lo};
  auto segs = segments_of(id);
  std::lock_guard<std::mutex> g(g_nccl->mu);
  if (reg) {
    g_nccl->pools.insert(id);
    for (auto& s : segs) {
      // registerMemPool skips what the hook registered already.
      if (!g_nccl->registered.count(s.address)) g_nccl->reg(s.address, s.total_size);
    }
  } else {
    g_nccl->pools.erase(id);
    for (auto& s : segs) g_nccl->dereg(s.address, s.total_size);
  }
  return 0;
}

// Checks the fake NCCL: no error so far, and the registrations are exactly
// the snapshot's segments now (all of them, or those of the registered
// pools). Writes the counts of registrations and deregistrations made.
// Returns 0, or -1 with the first problem in `err`.
extern "C" int vmmalloc_companion_fake_nccl_check_for_tests(uint64_t* registrations,
                                                            uint64_t* deregistrations, char* err,
                                                            size_t err_len) {
  try {
    if (!g_nccl || !current_allocator_for_tests()) throw std::runtime_error("nothing attached");
    std::set<MempoolId_t> pools;
    bool all;
    {
      std::lock_guard<std::mutex> g(g_nccl->mu);
      pools = g_nccl->pools;
      all = g_nccl->all;
    }
    std::map<uint64_t, uint64_t> expected;
    for (auto& s : segments_of({0, 0})) {
      if (all || pools.count(s.owner_private_pool_id)) expected[s.address] = s.total_size;
    }
    std::lock_guard<std::mutex> g(g_nccl->mu);
    *registrations = g_nccl->registrations;
    *deregistrations = g_nccl->deregistrations;
    if (!g_nccl->errors.empty()) throw std::runtime_error(g_nccl->errors.front());
    if (expected != g_nccl->registered) {
      std::string m = "registered:";
      for (auto& [a, n] : g_nccl->registered) m += " " + std::to_string(a) + "+" + std::to_string(n);
      m += "; snapshot segments:";
      for (auto& [a, n] : expected) m += " " + std::to_string(a) + "+" + std::to_string(n);
      throw std::runtime_error(m);
    }
    return 0;
  } catch (const std::exception& e) {
    copy_error(e.what(), err, err_len);
    return -1;
  }
}
