// Part of vmmalloc_torch.cpp (one translation unit; see there): the extern "C" entry points _companion.py resolves.
#pragma once

extern "C" const char* vmmalloc_companion_torch_version() { return VMMALLOC_TORCH_VERSION; }

// 1 once installed over a libvmmalloc with the IPC functions, else 0.
extern "C" int vmmalloc_companion_has_ipc() { return lib.ipc_export != nullptr; }

// 1 once installed over a libvmmalloc that records history and answers
// cacheInfo (vmmalloc_record_history, vmmalloc_cache_info), else 0.
extern "C" int vmmalloc_companion_has_history() {
  return lib.record_history != nullptr && lib.set_trace_sink != nullptr && lib.cache_info != nullptr;
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

// The torch.cuda.MemPool(allocator=...) pools' part of device `device`'s
// figures, for torch.cuda.memory_stats() as vmmalloc answers it
// (vmmalloc._torch, which reads libvmmalloc's own figures): n must be
// vmmalloc_device_stats' length; `out` gets what getDeviceStats adds to
// libvmmalloc's figures in that layout (the pools' current, allocated and
// freed; the combined peak less libvmmalloc's). Returns n, 0 when no such
// pool was used on the device, -1 when n is not that length or the
// companion is not installed.
extern "C" int vmmalloc_companion_pool_figures(int device, int64_t* out, size_t n) {
  auto* a = current_allocator();
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
  auto* a = current_allocator();
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
    resolve(h, "vmmalloc_private_pool_stats", lib.private_pool_stats, later);
    resolve(h, "vmmalloc_mem_get_info", lib.mem_get_info, later);
    resolve(h, "vmmalloc_settings", lib.settings, later);
    resolve(h, "vmmalloc_free_string", lib.free_string, later);
    resolve(h, "vmmalloc_record_history", lib.record_history, later);
    resolve(h, "vmmalloc_set_trace_sink", lib.set_trace_sink, later);
    resolve(h, "vmmalloc_cache_info", lib.cache_info, later);
    resolve(h, "vmmalloc_follow_segments", lib.follow_segments, later);
    resolve(h, "vmmalloc_segment_changes", lib.segment_changes, later);
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
    // PyTorch's native allocator is both CUDACachingAllocator's current one
    // and c10's registered CUDA allocator (REGISTER_ALLOCATOR in
    // c10/cuda/CUDACachingAllocator.cpp), which at::getDeviceAllocator(kCUDA)
    // returns: torch.accelerator's memory API (2.9+) and whatever asks
    // c10::GetAllocator(kCUDA). changeCurrentAllocator
    // (torch/csrc/cuda/CUDAPluggableAllocator.cpp) sets only the first, so
    // those would read (and initialise) the native allocator beside
    // vmmalloc: register the companion there too (kept alive by `current`).
    c10::SetAllocator(c10::DeviceType::CUDA, a.get(), /*priority=*/1);
    VmmallocAllocator::current_allocator = a.get();
    if (lib.set_oom_handler) lib.set_oom_handler(&vmmalloc_companion_on_oom);
    return 0;
  } catch (const std::exception& e) {
    copy_error(e.what(), err, err_len);
    return -1;
  }
}
