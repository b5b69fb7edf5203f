// Part of vmmalloc_torch.cpp (one translation unit; see there): version macros and libvmmalloc's C ABI.
#pragma once

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
// (ctx, pool_hi, pool_lo, 12 values: all, small_pool, large_pool x current, peak, allocated, freed)
using PrivatePoolStatsFn = void (*)(void*, uint64_t, uint64_t, const int64_t*);
using AllocatedFn = void (*)(void*, uint64_t, size_t, uint64_t);
// (ctx, action 1 added / 0 about to go, device, addr, size, stream, pool_hi, pool_lo):
// crates/capi/src/segments.rs VmmallocSegmentFn.
using SegmentChangeFn = void (*)(void*, int, int, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t);
constexpr size_t kStatsLen = 9 * 3 * 4 + 2 + 4 + 4 + 4;  // torch_abi.rs VMMALLOC_STATS_LEN

// Whether this PyTorch's DeviceStats has reserved_bytes_by_private_pools
// (c10/core/CachingDeviceAllocator.h, from 2.13).
template <typename S, typename = void>
struct HasPrivatePoolStats : std::false_type {};
template <typename S>
struct HasPrivatePoolStats<S, std::void_t<decltype(std::declval<S&>().reserved_bytes_by_private_pools)>>
    : std::true_type {};

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
  // Optional (newer libvmmalloc): reserved bytes per private pool
  // (crates/capi/src/torch_abi.rs vmmalloc_private_pool_stats).
  int (*private_pool_stats)(int, PrivatePoolStatsFn, void*);
  // Optional (newer libvmmalloc): following the registrable segments for
  // NCCL's register hook (crates/capi/src/segments.rs).
  int (*follow_segments)(SegmentChangeFn, void*);
  int (*segment_changes)(int, uint64_t*, uint64_t*);
};
Lib lib;

std::string last_error() {
  const char* e = lib.last_error();
  return e ? std::string(e) : std::string("no reason recorded");
}

}  // namespace
