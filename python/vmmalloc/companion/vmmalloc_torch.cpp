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
//
// The parts, one translation unit (this file #includes them in order; each
// part relies on those before it):
// * abi.h: version macros and libvmmalloc's C ABI table (Lib), resolved with dlsym;
// * history.h: PyTorch's memory history (trace entries, gathered contexts);
// * allocator.h: VmmallocAllocator, the CUDAAllocator adaptor, with the
//   torch.cuda.MemPool(allocator=...) segment cache;
// * entry_points.h: the extern "C" functions vmmalloc/_companion.py resolves.
// The test-only entry points are not shipped: the tests
// compile python/tests/companion_test_harness.cpp, which #includes this file.

#include <c10/core/Device.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/csrc/profiler/combined_traceback.h>
#include <torch/version.h>

#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
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

#include "abi.h"
#include "history.h"
#include "allocator.h"
#include "entry_points.h"
