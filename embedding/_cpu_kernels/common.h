// What several kernels share: work cut into chunks and run on XLA's
// threads, rows requested ahead, the row width as a constant, a row's
// running sum, and the exchanged buffers' pieces.

#ifndef SPARSEFLOW_CPU_KERNELS_COMMON_H_
#define SPARSEFLOW_CPU_KERNELS_COMMON_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// Internal linkage, as in every part: the parts make one translation unit
// (kernels.cc), and the library exports only the handler symbols.
namespace {

// Rows are read and written at random places of tables far larger than the
// caches; requesting a row this many rows ahead hides most of the wait
// (fewer left the sparse step slower, docs/benchmarks.md).
constexpr int64_t kPrefetchAhead = 64;

// Work is cut into chunks by its size alone, whatever the thread count,
// each chunk computed in a fixed order, so that one build's results are
// bitwise the same on any thread count and in every run (between machines
// they may differ: _cpu_kernels.py states the contract). Smaller work stays
// on one thread: it takes less than handing it over, and where devices share
// the cores (XLA runs every device's program at once) a helper may wait for
// a core.
constexpr int64_t kMaxChunks = 16;
constexpr int64_t kMinChunkItems = 8192;

int64_t ChunksFor(int64_t items) {
  return std::max<int64_t>(1, std::min(kMaxChunks, items / kMinChunkItems));
}

// Runs body(c) for c in [0, chunks) on the caller and XLA's intra-op threads.
// Every participant takes the next chunk until none is left, so the call
// never waits for a thread that has not started (on a busy pool the caller
// does everything); late helpers find no chunk and touch nothing of the
// caller's, whose frame they may outlive.
void ParallelFor(ffi::ThreadPool& pool, int64_t chunks, const std::function<void(int64_t)>& body) {
  const int64_t threads = std::min<int64_t>(pool.num_threads(), chunks);
  if (threads <= 1) {
    for (int64_t c = 0; c < chunks; ++c) body(c);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    int64_t chunks = 0;
    const std::function<void(int64_t)>* body = nullptr;
  };
  auto state = std::make_shared<State>();
  state->chunks = chunks;
  state->body = &body;
  auto work = [](State& st) {
    for (int64_t c = st.next.fetch_add(1); c < st.chunks; c = st.next.fetch_add(1)) {
      (*st.body)(c);
      st.done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 1; t < threads; ++t) pool.Schedule([state, work] { work(*state); });
  work(*state);
  while (state->done.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
}

// [begin, end) of chunk c of n items.
std::pair<int64_t, int64_t> ChunkOf(int64_t c, int64_t n, int64_t chunks) {
  return {n * c / chunks, n * (c + 1) / chunks};
}

template <int rw>
void PrefetchRow(const float* row, int64_t dim) {
  for (int64_t d = 0; d < dim; d += 64 / sizeof(float)) __builtin_prefetch(row + d, rw, 1);
}

// Calls body(std::integral_constant<int64_t, D>) with the row width as a
// compile-time constant for the common widths, so that a row's running sum
// stays in registers (with the width known only at run time, the compiler
// kept it in memory, and the pooling's transpose took 40% longer than
// adding into its output row in place); other widths get D = 0, meaning
// `dim` at run time.
template <typename Body>
void WithRowWidth(int64_t dim, Body&& body) {
  switch (dim) {
    case 8: return body(std::integral_constant<int64_t, 8>{});
    case 16: return body(std::integral_constant<int64_t, 16>{});
    case 32: return body(std::integral_constant<int64_t, 32>{});
    case 64: return body(std::integral_constant<int64_t, 64>{});
    case 128: return body(std::integral_constant<int64_t, 128>{});
    default: return body(std::integral_constant<int64_t, 0>{});
  }
}

// A running sum of rows of D floats (`dim` when D = 0), in registers when D
// is a constant.
template <int64_t D>
class RowSum {
 public:
  explicit RowSum(int64_t dim) : dim_(D ? D : dim), heap_(D ? 0 : dim) {}
  void Clear() { std::fill(data(), data() + width(), 0.0f); }
  void Add(float gain, const float* row) {
    float* sum = data();
    for (int64_t d = 0; d < width(); ++d) sum[d] += gain * row[d];
  }
  void Set(const float* row) { std::copy(row, row + width(), data()); }
  void Store(float* out) const { std::copy(data(), data() + width(), out); }
  int64_t width() const { return D ? D : dim_; }

 private:
  float* data() { return D ? local_ : heap_.data(); }
  const float* data() const { return D ? local_ : heap_.data(); }
  int64_t dim_;
  alignas(64) float local_[D ? D : 1] = {};
  std::vector<float> heap_;
};

// An exchanged buffer [S, G, U, W] (W = D for rows, 1 for row ids) as the
// all-to-all leaves it, or as a kernel leaves it for the all-to-all: G
// pieces [S, U, W], piece h what device h sent (or what goes to device h).
// The kernels take and give the pieces as they are: joining them after an
// exchange, or cutting a kernel's output before one, was one more copy of
// the whole buffer (and, for the cut, G more small programs to run).
// `Value` is const for operands.
template <typename Value>
class Pieces {
 public:
  // Operands args[first, first + devices), each holding slots * U rows of width W.
  template <ffi::DataType T>
  static ffi::ErrorOr<Pieces> FromArgs(const ffi::RemainingArgs& args, size_t first,
                                       int64_t devices, int64_t slots, int64_t width) {
    std::vector<Value*> data;
    std::vector<int64_t> counts;
    for (int64_t h = 0; h < devices; ++h) {
      auto piece = args.get<ffi::Buffer<T>>(first + h);
      if (piece.has_error()) return ffi::Unexpected(piece.error());
      data.push_back(piece->typed_data());
      counts.push_back(piece->element_count());
    }
    return Make(std::move(data), counts, slots, width);
  }

  // Every remaining result, each holding slots * U rows of width W.
  template <ffi::DataType T>
  static ffi::ErrorOr<Pieces> FromRets(const ffi::RemainingRets& rets, int64_t slots,
                                       int64_t width) {
    std::vector<Value*> data;
    std::vector<int64_t> counts;
    for (size_t h = 0; h < rets.size(); ++h) {
      auto piece = rets.get<ffi::Buffer<T>>(h);
      if (piece.has_error()) return ffi::Unexpected(piece.error());
      data.push_back((*piece)->typed_data());
      counts.push_back((*piece)->element_count());
    }
    return Make(std::move(data), counts, slots, width);
  }

  int64_t uniques() const { return uniques_; }
  int64_t devices() const { return devices_; }
  int64_t runs(int64_t slots) const { return slots * devices_; }
  // Run r = s * G + h: the U rows of slot s from (or for) device h.
  Value* Run(int64_t r) const { return data_[r % devices_] + (r / devices_) * uniques_ * width_; }

  // Row i of [S * G * U, W], for passes that mostly stay in one run (rows in
  // ascending order): the run is looked up again only where it changes.
  class Reader {
   public:
    explicit Reader(const Pieces& pieces) : pieces_(pieces) {}
    // Inlined where it is called once per row: the call cost more than the lookup.
    __attribute__((always_inline)) Value* Row(int64_t i) {
      if (i < begin_ || i >= end_) Seek(i);
      return run_ + (i - begin_) * pieces_.width_;
    }

   private:
    void Seek(int64_t i) {
      const int64_t run = i / pieces_.uniques_;
      begin_ = run * pieces_.uniques_;
      end_ = begin_ + pieces_.uniques_;
      run_ = pieces_.Run(run);
    }

    const Pieces& pieces_;
    int64_t begin_ = 0;
    int64_t end_ = 0;
    Value* run_ = nullptr;
  };

  // Sets rows [begin, end) of [S * G * U, W] to `value`.
  void Fill(int64_t begin, int64_t end, Value value) const {
    while (begin < end) {
      const int64_t run = begin / uniques_;
      const int64_t stop = std::min(end, (run + 1) * uniques_);
      Value* first = Run(run) + (begin - run * uniques_) * width_;
      std::fill(first, first + (stop - begin) * width_, value);
      begin = stop;
    }
  }

 private:
  static ffi::ErrorOr<Pieces> Make(std::vector<Value*> data, const std::vector<int64_t>& counts,
                                   int64_t slots, int64_t width) {
    const int64_t count = counts.empty() ? 0 : counts[0];
    for (int64_t c : counts) {
      if (c != count) {
        return ffi::Unexpected(ffi::Error::InvalidArgument("the exchanged pieces differ in size"));
      }
    }
    if (data.empty() || slots < 1 || count % (slots * width) != 0) {
      return ffi::Unexpected(ffi::Error::InvalidArgument("the exchanged pieces are not whole runs"));
    }
    Pieces pieces;
    pieces.data_ = std::move(data);
    pieces.devices_ = pieces.data_.size();
    pieces.uniques_ = count / (slots * width);
    pieces.width_ = width;
    return pieces;
  }

  std::vector<Value*> data_;
  int64_t devices_ = 0;
  int64_t uniques_ = 0;
  int64_t width_ = 0;
};

}  // namespace

#endif  // SPARSEFLOW_CPU_KERNELS_COMMON_H_
