// Transparent huge pages for the buffers the update writes in place.

#ifndef SPARSEFLOW_CPU_KERNELS_HUGE_PAGES_H_
#define SPARSEFLOW_CPU_KERNELS_HUGE_PAGES_H_

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <set>
#include <string>
#include <utility>

#ifdef __linux__
#include <sys/mman.h>
#endif

// MADV_HUGEPAGE is Linux's (<sys/mman.h>); elsewhere the buffers keep the
// pages they have.
#ifdef MADV_HUGEPAGE
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // Linux 6.1's; older headers lack the name
#endif
#endif

namespace {

// Tables and slots are read and written at random rows. On 4 KiB pages
// nearly every row is a TLB miss, and where the TLB misses, prefetching
// hides little: an update of random rows took more than twice as long on
// 4 KiB pages as on 2 MiB pages, prefetching or not (docs/benchmarks.md).
// So the variables ask for transparent huge pages:
// madvise(MADV_HUGEPAGE) for pages not yet touched, and, for a buffer that
// stays in place from step to step (donated and aliased), a synchronous
// MADV_COLLAPSE of the pages already there, at every call. The first
// collapse of a buffer takes time; on pages already huge it returns at
// once (docs/benchmarks.md). Remembering which buffers
// were collapsed is not enough: a buffer freed and made again at the same
// address (variables restored, or made for another model) comes back on
// 4 KiB pages, and the step took twice as long. It is advice: where the
// kernel refuses it, nothing changes but the speed. SPARSEFLOW_HUGE_PAGES=0
// in the environment turns it off.
void AdviseHugePages(void* data, size_t bytes, bool collapse) {
#ifdef MADV_HUGEPAGE
  static const bool enabled = [] {
    const char* setting = std::getenv("SPARSEFLOW_HUGE_PAGES");
    return setting == nullptr || std::string(setting) != "0";
  }();
  if (!enabled) return;
  constexpr uintptr_t kHuge = 2u << 20;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHuge - 1);
  if (end <= begin) return;
  static std::mutex mutex;
  static std::set<std::pair<uintptr_t, uintptr_t>> advised;
  bool known;
  {
    std::lock_guard<std::mutex> lock(mutex);
    // Buffers that move every step (not aliased) are advised each time they
    // are new; forget them before the set grows without bound.
    if (advised.size() > 256) advised.clear();
    known = !advised.insert({begin, end}).second;
  }
  void* start = reinterpret_cast<void*>(begin);
  // Setting the flag again takes the address space's write lock, which every
  // page fault of every device waits for; a stale entry only leaves pages
  // faulted later on 4 KiB pages, and the next collapse gathers them.
  if (!known) madvise(start, end - begin, MADV_HUGEPAGE);
  if (collapse) madvise(start, end - begin, MADV_COLLAPSE);
#endif
}

}  // namespace

#endif  // SPARSEFLOW_CPU_KERNELS_HUGE_PAGES_H_
