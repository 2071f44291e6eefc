// CPU kernels of the sharded lookup and update (see _cpu_kernels.py).
//
// Each is a linear pass over one device's layout or over the rows it owns,
// so its cost follows the ids of the batch, not the capacity of the buffers.
// Shapes follow embedding/_lookup.py: S slots (partitions) per device, G
// devices, N = G * S partitions, K minibatches, W = max(N, 8) row pointers
// per (slot, minibatch), C layout entries per slot, U distinct rows one slot
// may need from one device, R rows per partition, D the padded dim, P samples
// per slot.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <type_traits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#ifdef __linux__
#include <sys/mman.h>
#endif

#ifdef __AVX__
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kAlignment = 8;

// Rows are read and written at random places of tables far larger than the
// caches; requesting a row this many rows ahead hides most of the wait.
constexpr int64_t kPrefetchAhead = 16;

// Sums read and written at random this size and below stay in a core's
// cache (its L2, 1 MiB here, or more on most server cores).
constexpr int64_t kCachedSumsBytes = 512 << 10;

// The owner merges the gradients of several sources in windows of this
// many rows of its shard (4096: 256 KiB of sums at width 16; 1024 and 16384
// were slower).
constexpr int64_t kWindowRows = 4096;

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

int64_t RoundUp(int64_t x) { return (x + kAlignment - 1) / kAlignment * kAlignment; }

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

// Start and end of segment j = minibatch * N + partition in one slot's
// layout: a segment starts where the one before it ends, rounded up to 8.
struct Segment {
  int64_t start;
  int64_t end;
};

Segment SegmentOf(const int32_t* pointers, int64_t j, int64_t partitions, int64_t width,
                  int64_t capacity) {
  auto end_of = [&](int64_t i) {
    int64_t e = pointers[(i / partitions) * width + i % partitions];
    return e < 0 ? 0 : (e > capacity ? capacity : e);
  };
  int64_t start = j == 0 ? 0 : RoundUp(end_of(j - 1));
  return {start, end_of(j)};
}

// segments: int32[S, C], each entry's minibatch * N + partition, -1 for padding.
ffi::Error Segments(ffi::Buffer<ffi::S32> row_pointers, ffi::Buffer<ffi::S32> ids,
                    ffi::ResultBuffer<ffi::S32> segments, int64_t slots, int64_t partitions,
                    int64_t minibatches, int64_t width) {
  const int64_t capacity = ids.element_count() / slots;
  int32_t* out = segments->typed_data();
  std::fill(out, out + slots * capacity, -1);
  for (int64_t s = 0; s < slots; ++s) {
    const int32_t* pointers = row_pointers.typed_data() + s * minibatches * width;
    for (int64_t j = 0; j < minibatches * partitions; ++j) {
      Segment seg = SegmentOf(pointers, j, partitions, width, capacity);
      for (int64_t i = seg.start; i < seg.end; ++i) out[s * capacity + i] = static_cast<int32_t>(j);
    }
  }
  return ffi::Error::Success();
}

// For one minibatch: entry_index int32[S, C], each entry's flat index into
// [S, G, U] (-1 for entries outside the minibatch, padding, and ids past a
// partition), and send_rows int32[S, G, U] in G pieces [S, U], the shard row
// of every distinct row slot s needs from device h (S * R where unused).
ffi::Error Route(ffi::Buffer<ffi::S32> row_pointers, ffi::Buffer<ffi::S32> ids,
                 ffi::Buffer<ffi::S32> minibatch, ffi::ResultBuffer<ffi::S32> entry_index,
                 ffi::RemainingRets send_rows, int64_t slots, int64_t minibatches, int64_t width,
                 int64_t rows) {
  auto send = Pieces<int32_t>::FromRets<ffi::S32>(send_rows, slots, 1);
  if (send.has_error()) return send.error();
  const int64_t devices = send->devices();
  const int64_t uniques = send->uniques();
  const int64_t partitions = devices * slots;
  const int64_t capacity = ids.element_count() / slots;
  const int64_t shard_rows = slots * rows;
  const int64_t k = minibatch.typed_data()[0];
  int32_t* index = entry_index->typed_data();
  send->Fill(0, send->runs(slots) * uniques, static_cast<int32_t>(shard_rows));
  std::fill(index, index + slots * capacity, -1);
  std::vector<int64_t> counts(devices);
  for (int64_t s = 0; s < slots; ++s) {
    const int32_t* pointers = row_pointers.typed_data() + s * minibatches * width;
    const int32_t* slot_ids = ids.typed_data() + s * capacity;
    int32_t* slot_index = index + s * capacity;
    std::fill(counts.begin(), counts.end(), 0);
    for (int64_t p = 0; p < partitions; ++p) {
      Segment seg = SegmentOf(pointers, k * partitions + p, partitions, width, capacity);
      const int64_t dest = p / slots;
      const int64_t base = (p % slots) * rows;
      const int64_t run = s * devices + dest;
      int32_t* run_rows = send->Run(run);
      // Rows of one device come in ascending order (partitions ascending,
      // ids sorted within a partition), so a change of row is a new one.
      int64_t& count = counts[dest];
      int64_t last = -1;
      for (int64_t i = seg.start; i < seg.end; ++i) {
        const int64_t id = slot_ids[i];
        if (id < 0 || id >= rows) continue;
        const int64_t row = base + id;
        if (row != last) {
          if (count >= uniques) break;
          last = row;
          run_rows[count] = static_cast<int32_t>(row);
          ++count;
        }
        slot_index[i] = static_cast<int32_t>(run * uniques + count - 1);
      }
    }
  }
  return ffi::Error::Success();
}

// rows float32[S, G, U, D] in G pieces [S, U, D], the rows to send each
// device: row (s, h, u) = table[the id piece h of `ids` holds at (s, u)],
// zero where the id is out of range.
ffi::Error GatherRows(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> table, ffi::RemainingArgs ids,
                      ffi::RemainingRets rows, int64_t slots) {
  const int64_t num_rows = table.dimensions()[0];
  auto wanted = Pieces<const int32_t>::FromArgs<ffi::S32>(ids, 0, ids.size(), slots, 1);
  if (wanted.has_error()) return wanted.error();
  auto out = Pieces<float>::FromRets<ffi::F32>(rows, slots, table.dimensions()[1]);
  if (out.has_error()) return out.error();
  if (out->devices() != wanted->devices() || out->uniques() != wanted->uniques()) {
    return ffi::Error::InvalidArgument("gather: the rows' pieces do not match the ids'");
  }
  const int64_t n = wanted->runs(slots) * wanted->uniques();
  const float* t = table.typed_data();
  const int64_t chunks = ChunksFor(n);
  // With the width a constant, a row's copy is a few vector moves, not a
  // call of memcpy per row (the gather of 8 tables of 20k rows took 13-15%
  // less time).
  WithRowWidth(table.dimensions()[1], [&](auto width) {
    const int64_t dim = width.value ? width.value : table.dimensions()[1];
    ParallelFor(pool, chunks, [&](int64_t c) {
      auto [begin, end] = ChunkOf(c, n, chunks);
      Pieces<const int32_t>::Reader ids_at(*wanted), ids_ahead(*wanted);
      Pieces<float>::Reader out_at(*out);
      for (int64_t m = begin; m < std::min(end, begin + kPrefetchAhead); ++m) {
        const int64_t id = *ids_ahead.Row(m);
        if (id >= 0 && id < num_rows) PrefetchRow<0>(t + id * dim, dim);
      }
      for (int64_t m = begin; m < end; ++m) {
        if (m + kPrefetchAhead < end) {
          const int64_t ahead = *ids_ahead.Row(m + kPrefetchAhead);
          if (ahead >= 0 && ahead < num_rows) PrefetchRow<0>(t + ahead * dim, dim);
        }
        const int64_t id = *ids_at.Row(m);
        float* o = out_at.Row(m);
        if (id >= 0 && id < num_rows) {
          std::copy(t + id * dim, t + id * dim + dim, o);
        } else {
          std::fill(o, o + dim, 0.0f);
        }
      }
    });
  });
  return ffi::Error::Success();
}

// pooled float32[S, P, D]: per sample, the sum of gain * row over its
// entries, in layout order. Entries are sorted by row, not by sample: adding
// each entry into its sample's sum in layout order reads and writes the sums
// at random places. Where the sums fit in a core's cache (kCachedSumsBytes,
// as for one device of 8 at the benchmark's shape: 256 KiB), that is the
// fastest way (the pooling took half the time of the sort below). Where they
// do not, it waited for them (twice as long as the other way; figures in
// docs/benchmarks.md, "Measured in the CPU kernels' design"): a counting sort
// by sample (stable, so layout order within a sample) lists each sample's
// rows and gains first;
// every sum is then formed in registers and written once, and chunks cut
// the samples.
ffi::Error Pool(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> entry_index,
                ffi::Buffer<ffi::S32> samples, ffi::Buffer<ffi::F32> gains,
                ffi::RemainingArgs rows, ffi::ResultBuffer<ffi::F32> pooled) {
  const int64_t slots = pooled->dimensions()[0];
  const int64_t num_samples = pooled->dimensions()[1];
  const int64_t dim = pooled->dimensions()[2];
  const int64_t capacity = entry_index.element_count() / slots;
  auto pieces = Pieces<const float>::FromArgs<ffi::F32>(rows, 0, rows.size(), slots, dim);
  if (pieces.has_error()) return pieces.error();
  const int64_t uniques = pieces->uniques();
  const int64_t num_rows = pieces->runs(slots) * uniques;
  Pieces<const float>::Reader rows_of(*pieces);
  if (num_samples * dim * static_cast<int64_t>(sizeof(float)) <= kCachedSumsBytes) {
    // The sums fit in a core's cache (one device's share of a batch split
    // over several): each entry is added into its sample's sum in layout
    // order, which reads the rows in the order they came.
    WithRowWidth(dim, [&](auto width) {
      constexpr int64_t D = decltype(width)::value;
      const int64_t w = D ? D : dim;
      float* out = pooled->typed_data();
      std::fill(out, out + slots * num_samples * w, 0.0f);
      RowSum<D> scaled(dim);
      for (int64_t s = 0; s < slots; ++s) {
        const int64_t first = s * capacity;
        float* slot_sums = out + s * num_samples * w;
        for (int64_t e = first; e < first + capacity; ++e) {
          const int64_t i = entry_index.typed_data()[e];
          const int64_t sample = samples.typed_data()[e];
          if (i < 0 || i >= num_rows || sample < 0 || sample >= num_samples) continue;
          // Through registers: added in place, the compiler could not
          // rule out that the sum and the row overlap and added one float
          // at a time.
          float* sum = slot_sums + sample * w;
          scaled.Set(sum);
          scaled.Add(gains.typed_data()[e], rows_of.Row(i));
          scaled.Store(sum);
        }
      }
    });
    return ffi::Error::Success();
  }
  // Entry indices ascend along a slot, so a Reader finds their rows; the
  // sums read them in sample order, from a list of row pointers. With one
  // run (one device, one slot) the list holds indices instead: 4 bytes each
  // instead of a pointer's 8, for the largest lists there are (pointers made
  // the step on 1 device 7% slower).
  const bool one_run = pieces->runs(slots) == 1;
  std::vector<int32_t> starts(num_samples + 1);
  std::vector<int32_t> sorted_index(one_run ? capacity : 0);
  std::vector<const float*> sorted_rows(one_run ? 0 : capacity);
  const float* only_run = one_run ? pieces->Run(0) : nullptr;
  auto sorted_row = [&](int64_t k) {
    return one_run ? only_run + sorted_index[k] * dim : sorted_rows[k];
  };
  std::vector<float> sorted_gains(capacity);
  for (int64_t s = 0; s < slots; ++s) {
    const int32_t* index = entry_index.typed_data() + s * capacity;
    const int32_t* sample_of = samples.typed_data() + s * capacity;
    const float* gain_of = gains.typed_data() + s * capacity;
    auto valid = [&](int64_t e) {
      return index[e] >= 0 && index[e] < num_rows && sample_of[e] >= 0 &&
             sample_of[e] < num_samples;
    };
    std::fill(starts.begin(), starts.end(), 0);
    for (int64_t e = 0; e < capacity; ++e) {
      if (valid(e)) ++starts[sample_of[e] + 1];
    }
    for (int64_t p = 0; p < num_samples; ++p) starts[p + 1] += starts[p];
    std::vector<int32_t> next(starts.begin(), starts.end() - 1);
    for (int64_t e = 0; e < capacity; ++e) {
      if (!valid(e)) continue;
      const int32_t position = next[sample_of[e]]++;
      if (one_run) {
        sorted_index[position] = index[e];
      } else {
        sorted_rows[position] = rows_of.Row(index[e]);
      }
      sorted_gains[position] = gain_of[e];
    }
    float* out = pooled->typed_data() + s * num_samples * dim;
    const int64_t chunks = ChunksFor(starts[num_samples]);
    ParallelFor(pool, chunks, [&](int64_t c) {
      auto [begin, end] = ChunkOf(c, num_samples, chunks);
      const int64_t last = starts[end];
      for (int64_t k = starts[begin]; k < std::min(last, starts[begin] + kPrefetchAhead); ++k) {
        PrefetchRow<0>(sorted_row(k), dim);
      }
      WithRowWidth(dim, [&](auto width) {
        RowSum<decltype(width)::value> sum(dim);
        for (int64_t p = begin; p < end; ++p) {
          sum.Clear();
          for (int64_t k = starts[p]; k < starts[p + 1]; ++k) {
            if (k + kPrefetchAhead < last) {
              PrefetchRow<0>(sorted_row(k + kPrefetchAhead), dim);
            }
            sum.Add(sorted_gains[k], sorted_row(k));
          }
          sum.Store(out + p * dim);
        }
      });
    });
  }
  return ffi::Error::Success();
}

// The transpose of Pool: row_grads float32[S, G, U, D] in G pieces
// [S, U, D] (what goes back to each device), per distinct row the sum of
// gain * the sample's gradient over the row's entries, zero for a row
// without any. An entry's row index never decreases along the layout
// (slots, then devices, then rows in order), so chunks cut where the index
// changes write disjoint rows, and each chunk writes every row from its own
// first to the next chunk's first (rows without entries, zero, included):
// the output is written once, not zeroed first.
ffi::Error PoolTranspose(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> entry_index,
                         ffi::Buffer<ffi::S32> samples, ffi::Buffer<ffi::F32> gains,
                         ffi::Buffer<ffi::F32> grads, ffi::RemainingRets row_grads) {
  const int64_t slots = grads.dimensions()[0];
  const int64_t num_samples = grads.dimensions()[1];
  const int64_t dim = grads.dimensions()[2];
  const int64_t capacity = entry_index.element_count() / slots;
  auto out = Pieces<float>::FromRets<ffi::F32>(row_grads, slots, dim);
  if (out.has_error()) return out.error();
  const int64_t num_rows = out->runs(slots) * out->uniques();
  const int64_t n = slots * capacity;
  const int32_t* index = entry_index.typed_data();
  auto in_range = [&](int64_t e) { return index[e] >= 0 && index[e] < num_rows; };
  // A chunk starts at the first entry past its nominal start whose row
  // differs from the last row before it (entries without a row, -1, may
  // come between two of one row's).
  auto boundary = [&](int64_t position) {
    if (position <= 0 || position >= n) return position <= 0 ? int64_t{0} : n;
    int64_t previous = position - 1;
    while (previous > 0 && index[previous] < 0) --previous;
    const int32_t before = index[previous];
    while (position < n && (index[position] < 0 || index[position] == before)) ++position;
    return position;
  };
  // The row of the first entry at or past `position` with one.
  auto first_row = [&](int64_t position) {
    for (; position < n; ++position) {
      if (in_range(position)) return static_cast<int64_t>(index[position]);
    }
    return num_rows;
  };
  const int64_t chunks = ChunksFor(n);
  ParallelFor(pool, chunks, [&](int64_t c) {
    auto [nominal_begin, nominal_end] = ChunkOf(c, n, chunks);
    const int64_t begin = boundary(nominal_begin);
    const int64_t end = boundary(nominal_end);
    const int64_t last_row = c + 1 == chunks ? num_rows : first_row(end);
    // Rows before `next` are written; a row's sum is formed in `sum` and
    // written once its last entry is added.
    int64_t next = c == 0 ? 0 : first_row(begin);
    Pieces<float>::Reader out_at(*out);
    WithRowWidth(dim, [&](auto width) {
      RowSum<decltype(width)::value> sum(dim);
      bool open = false;  // whether `sum` holds row next - 1
      int64_t slot_end = begin;
      const float* slot_grads = nullptr;
      for (int64_t e = begin; e < end; ++e) {
        if (e >= slot_end) {
          const int64_t slot = e / capacity;
          slot_grads = grads.typed_data() + slot * num_samples * dim;
          slot_end = (slot + 1) * capacity;
        }
        // Samples come in row order, that is at random: request the
        // gradient of the sample kPrefetchAhead entries on.
        if (const int64_t a = e + kPrefetchAhead; a < slot_end) {
          const int64_t ahead = samples.typed_data()[a];
          if (ahead >= 0 && ahead < num_samples) PrefetchRow<0>(slot_grads + ahead * dim, dim);
        }
        if (!in_range(e)) continue;
        const int64_t u = index[e];
        if (u >= next) {
          if (open) sum.Store(out_at.Row(next - 1));
          out->Fill(next, u, 0.0f);
          sum.Clear();
          next = u + 1;
          open = true;
        }
        const int64_t sample = samples.typed_data()[e];
        if (sample < 0 || sample >= num_samples) continue;
        sum.Add(gains.typed_data()[e], slot_grads + sample * dim);
      }
      if (open) sum.Store(out_at.Row(next - 1));
    });
    if (next < last_row) out->Fill(next, last_row, 0.0f);
  });
  return ffi::Error::Success();
}

enum class Rule { kSgd, kAdagrad, kRowWiseAdagrad };

// The sum of g[d]^2 in 8 lanes, added pairwise at the end. A single running
// sum is a chain of dim dependent additions that the compiler may not
// reorder: for dim 16 it made a row-wise Adagrad update much slower than
// SGD's (docs/benchmarks.md). The order is fixed, so results stay bitwise
// the same.
float SumOfSquares(const float* g, int64_t dim) {
  constexpr int64_t kLanes = 8;
  float lanes[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= dim; d += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) lanes[j] += g[d + j] * g[d + j];
  }
  for (; d < dim; ++d) lanes[d % kLanes] += g[d] * g[d];
  for (int64_t width = kLanes / 2; width > 0; width /= 2) {
    for (int64_t j = 0; j < width; ++j) lanes[j] += lanes[j + width];
  }
  return lanes[0];
}

// The optimizer's update of one row from its summed gradient g (D floats,
// `dim` when D = 0), in place.
template <Rule rule, int64_t D>
struct RowUpdate {
  int64_t dim;
  float learning_rate;
  float epsilon;
  const int32_t* table_starts;
  const int32_t* table_dims;
  int64_t tables;
  int64_t rows_per_partition;
  float* table;
  float* slot;

  int64_t width() const { return D ? D : dim; }

  void Prefetch(int64_t row) const {
    PrefetchRow<1>(table + row * width(), width());
    if constexpr (rule == Rule::kAdagrad) PrefetchRow<1>(slot + row * width(), width());
    if constexpr (rule == Rule::kRowWiseAdagrad) __builtin_prefetch(slot + row, 1, 1);
  }

  void Apply(int64_t row, const float* g) const {
    const int64_t n = width();
    float* w = table + row * n;
    if constexpr (rule == Rule::kSgd) {
      for (int64_t d = 0; d < n; ++d) w[d] -= learning_rate * g[d];
    } else if constexpr (rule == Rule::kAdagrad) {
      float* a = slot + row * n;
      for (int64_t d = 0; d < n; ++d) {
        a[d] += g[d] * g[d];
        w[d] -= learning_rate * g[d] / std::sqrt(a[d]);
      }
    } else {
      int64_t t = 0;
      if (tables > 1) {
        const int64_t local = row % rows_per_partition;
        while (t + 1 < tables && local >= table_starts[t + 1]) ++t;
      }
      const float accumulator = slot[row] + SumOfSquares(g, n) / static_cast<float>(table_dims[t]);
      slot[row] = accumulator;
      const float scale = learning_rate / (std::sqrt(accumulator) + epsilon);
      for (int64_t d = 0; d < n; ++d) w[d] -= scale * g[d];
    }
  }
};

// Applies the optimizer to n distinct ascending rows, row i with gradient
// grads[i * D, (i + 1) * D), requesting each row kPrefetchAhead rows ahead.
template <Rule rule, int64_t D>
void ApplyToRows(const int32_t* rows, const float* grads, int64_t n,
                 const RowUpdate<rule, D>& update) {
  for (int64_t i = 0; i < std::min(n, kPrefetchAhead); ++i) update.Prefetch(rows[i]);
  for (int64_t i = 0; i < n; ++i) {
    if (i + kPrefetchAhead < n) update.Prefetch(rows[i + kPrefetchAhead]);
    update.Apply(rows[i], grads + i * update.width());
  }
}

// Runs of ascending rows, each with its gradients: the part of one received
// run that falls in a range of rows.
struct RunPart {
  const int32_t* rows;
  const float* grads;
  int64_t count;
};

// Merges runs of rows [row_begin, row_end) into distinct ascending rows
// (`rows`) and their gradients summed in run order (`sums`, D floats each);
// returns how many there are. Both outputs hold room for every row of every
// run.
//
// The range is taken in windows of kWindowRows rows. Run after run, each
// gradient in the window is added into its row's place in the window (the
// row's first gradient is copied there) and the row is marked; the marked
// rows are then read out in order. Merging this way and then updating the
// merged rows (`ApplyToRows`) took two thirds of the time of merging as the
// runs were read (finding the smallest head row of all runs by vector
// compares, then updating it), whose merge alone had taken most of it
// (docs/benchmarks.md).
template <int64_t D>
int64_t MergeRuns(const std::vector<RunPart>& runs, int64_t row_begin, int64_t row_end,
                  int64_t dim, int32_t* rows, float* sums) {
  const int64_t width = D ? D : dim;
  std::unique_ptr<float[]> window(new float[kWindowRows * width]);
  uint64_t marked[kWindowRows / 64] = {};
  std::vector<int64_t> heads(runs.size(), 0);
  RowSum<D> sum(dim);
  int64_t merged = 0;
  for (int64_t low = row_begin; low < row_end; low += kWindowRows) {
    const int64_t high = std::min(low + kWindowRows, row_end);
    for (size_t a = 0; a < runs.size(); ++a) {
      const RunPart& run = runs[a];
      int64_t i = heads[a];
      for (; i < run.count && run.rows[i] < high; ++i) {
        const int64_t offset = run.rows[i] - low;
        float* place = window.get() + offset * width;
        const uint64_t bit = uint64_t{1} << (offset % 64);
        // Through registers, as the pooling adds (see Pool).
        if (marked[offset / 64] & bit) {
          sum.Set(place);
          sum.Add(1.0f, run.grads + i * width);
        } else {
          marked[offset / 64] |= bit;
          sum.Set(run.grads + i * width);
        }
        sum.Store(place);
      }
      heads[a] = i;
    }
    for (int64_t w = 0; w < kWindowRows / 64; ++w) {
      for (uint64_t bits = marked[w]; bits != 0; bits &= bits - 1) {
        const int64_t offset = w * 64 + __builtin_ctzll(bits);
        const float* place = window.get() + offset * width;
        rows[merged] = static_cast<int32_t>(low + offset);
        std::copy(place, place + width, sums + merged * width);
        ++merged;
      }
      marked[w] = 0;
    }
  }
  return merged;
}

// Merges the gradients the owner received (runs of U rows, one per source
// slot and device, each ascending and padded with out-of-range rows) for the
// rows in [row_begin, row_end) and applies the optimizer once per distinct
// row, in place. A row's gradients are summed in run order.
template <Rule rule, int64_t D>
void MergeAndApply(const Pieces<const int32_t>& received, const Pieces<const float>& grads,
                   int64_t runs, int64_t row_begin, int64_t row_end,
                   const RowUpdate<rule, D>& update) {
  const int64_t dim = update.width();
  const int64_t uniques = received.uniques();
  // Every run holding rows of the range, from its first such row.
  std::vector<RunPart> parts;
  int64_t total = 0;
  for (int64_t r = 0; r < runs; ++r) {
    const int32_t* run = received.Run(r);
    const int64_t begin = std::lower_bound(run, run + uniques, row_begin) - run;
    const int64_t end = std::lower_bound(run, run + uniques, row_end) - run;
    if (begin < end) {
      parts.push_back({run + begin, grads.Run(r) + begin * dim, end - begin});
      total += end - begin;
    }
  }
  if (parts.empty()) return;
  if (parts.size() == 1) {
    // One source (one device, one slot): every row comes once.
    ApplyToRows(parts[0].rows, parts[0].grads, parts[0].count, update);
    return;
  }
  std::unique_ptr<int32_t[]> rows(new int32_t[total]);
  std::unique_ptr<float[]> sums(new float[total * dim]);
  const int64_t merged = MergeRuns<D>(parts, row_begin, row_end, dim, rows.get(), sums.get());
  ApplyToRows(rows.get(), sums.get(), merged, update);
}

// MADV_HUGEPAGE is Linux's (<sys/mman.h>); elsewhere the buffers keep the
// pages they have.
#ifdef MADV_HUGEPAGE
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // Linux 6.1's; older headers lack the name
#endif
#endif

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

// The outputs alias the inputs (the variables are donated); copy only where
// XLA could not alias them.
void CopyUnlessAliased(ffi::Buffer<ffi::F32>& in, ffi::ResultBuffer<ffi::F32>& out) {
  const bool aliased = out->typed_data() == in.typed_data();
  AdviseHugePages(out->typed_data(), out->size_bytes(), aliased);
  if (!aliased) std::memcpy(out->typed_data(), in.typed_data(), in.size_bytes());
}

template <Rule rule>
ffi::Error Apply(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& learning_rate,
                 ffi::Buffer<ffi::S32>& table_starts, ffi::Buffer<ffi::S32>& table_dims,
                 const ffi::RemainingArgs& received, float* table, int64_t shard_rows, int64_t dim,
                 float* slot, int64_t slots, int64_t rows_per_partition, float epsilon) {
  // The received rows' pieces, then their gradients' pieces, one per device.
  const int64_t devices = received.size() / 2;
  if (2 * devices != static_cast<int64_t>(received.size())) {
    return ffi::Error::InvalidArgument("the received rows and gradients differ in pieces");
  }
  auto rows = Pieces<const int32_t>::FromArgs<ffi::S32>(received, 0, devices, slots, 1);
  if (rows.has_error()) return rows.error();
  auto grads = Pieces<const float>::FromArgs<ffi::F32>(received, devices, devices, slots, dim);
  if (grads.has_error()) return grads.error();
  if (grads->uniques() != rows->uniques()) {
    return ffi::Error::InvalidArgument("the received rows and gradients do not match");
  }
  const int64_t runs = rows->runs(slots);
  // Chunks cut the shard's rows; the work is the rows received.
  const int64_t chunks = ChunksFor(runs * rows->uniques());
  // The width a constant: a row's update and its gradients' sum stay in
  // vector registers (with the width known only at run time the merge above
  // took more than twice as long; docs/benchmarks.md).
  WithRowWidth(dim, [&](auto width) {
    constexpr int64_t D = decltype(width)::value;
    const RowUpdate<rule, D> update{dim,
                                    learning_rate.typed_data()[0],
                                    epsilon,
                                    table_starts.typed_data(),
                                    table_dims.typed_data(),
                                    static_cast<int64_t>(table_starts.element_count()),
                                    rows_per_partition,
                                    table,
                                    slot};
    ParallelFor(pool, chunks, [&](int64_t c) {
      auto [row_begin, row_end] = ChunkOf(c, shard_rows, chunks);
      MergeAndApply<rule, D>(*rows, *grads, runs, row_begin, row_end, update);
    });
  });
  return ffi::Error::Success();
}

ffi::Error UpdateSgd(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> learning_rate,
                     ffi::Buffer<ffi::S32> table_starts, ffi::Buffer<ffi::S32> table_dims,
                     ffi::Buffer<ffi::F32> table_in, ffi::RemainingArgs received,
                     ffi::ResultBuffer<ffi::F32> table, int64_t slots,
                     int64_t rows_per_partition, float epsilon) {
  CopyUnlessAliased(table_in, table);
  return Apply<Rule::kSgd>(pool, learning_rate, table_starts, table_dims, received,
                           table->typed_data(), table->dimensions()[0], table->dimensions()[1],
                           nullptr, slots, rows_per_partition, epsilon);
}

template <Rule rule>
ffi::Error UpdateWithSlot(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> learning_rate,
                          ffi::Buffer<ffi::S32> table_starts, ffi::Buffer<ffi::S32> table_dims,
                          ffi::Buffer<ffi::F32> table_in, ffi::Buffer<ffi::F32> slot_in,
                          ffi::RemainingArgs received, ffi::ResultBuffer<ffi::F32> table,
                          ffi::ResultBuffer<ffi::F32> slot, int64_t slots,
                          int64_t rows_per_partition, float epsilon) {
  CopyUnlessAliased(table_in, table);
  CopyUnlessAliased(slot_in, slot);
  return Apply<rule>(pool, learning_rate, table_starts, table_dims, received,
                     table->typed_data(), table->dimensions()[0], table->dimensions()[1],
                     slot->typed_data(), slots, rows_per_partition, epsilon);
}

// The DLRM interaction (see embedding/_interaction.py): the dot products of
// every pair of a sample's n vectors of d floats, P = n (n - 1) / 2 of them
// in np.triu_indices order, and their transpose.
//
// XLA runs them as a batch of tiny [n, d] x [d, n] products and takes the
// triangle after (about twice the time of this kernel, docs/benchmarks.md;
// a layout with the batch innermost was slower still). Here kLanes
// samples go side by side, one per vector lane: a block's vectors are
// transposed to [n, d, kLanes], so every multiply-add serves kLanes samples
// and no sum crosses lanes. A pair's sum runs over d in order, so results do
// not depend on the thread count.
constexpr int64_t kLanes = 16;
// Pairs summed at once in the forward pass: independent chains of additions.
constexpr int64_t kPairGroup = 8;

int64_t PairIndex(int64_t i, int64_t j, int64_t n) { return i * n - i * (i + 1) / 2 + (j - i - 1); }

// dst[t * dst_stride + s] = src[s * src_stride + t] for s, t < 8. With AVX
// in shuffles of 8 registers: the compiler left the loop element by
// element, and the transposes took longer than the products.
void Transpose8x8(const float* src, int64_t src_stride, float* dst, int64_t dst_stride) {
#ifdef __AVX__
  __m256 r[8], t[8];
  for (int k = 0; k < 8; ++k) r[k] = _mm256_loadu_ps(src + k * src_stride);
  for (int k = 0; k < 8; k += 2) {
    t[k] = _mm256_unpacklo_ps(r[k], r[k + 1]);
    t[k + 1] = _mm256_unpackhi_ps(r[k], r[k + 1]);
  }
  for (int k = 0; k < 8; k += 4) {
    r[k] = _mm256_shuffle_ps(t[k], t[k + 2], 0x44);
    r[k + 1] = _mm256_shuffle_ps(t[k], t[k + 2], 0xEE);
    r[k + 2] = _mm256_shuffle_ps(t[k + 1], t[k + 3], 0x44);
    r[k + 3] = _mm256_shuffle_ps(t[k + 1], t[k + 3], 0xEE);
  }
  for (int k = 0; k < 4; ++k) {
    _mm256_storeu_ps(dst + k * dst_stride, _mm256_permute2f128_ps(r[k], r[k + 4], 0x20));
    _mm256_storeu_ps(dst + (k + 4) * dst_stride, _mm256_permute2f128_ps(r[k], r[k + 4], 0x31));
  }
#else
  for (int64_t s = 0; s < 8; ++s) {
    for (int64_t t = 0; t < 8; ++t) dst[t * dst_stride + s] = src[s * src_stride + t];
  }
#endif
}

// Samples [b0, b0 + count) of `x` (rows of `width` floats) to `lanes`
// [width, kLanes], the missing lanes zero.
void ToLanes(const float* x, int64_t b0, int64_t count, int64_t width, float* lanes) {
  if (count < kLanes) std::fill(lanes, lanes + width * kLanes, 0.0f);
  int64_t f = 0;
  if (count == kLanes) {
    for (; f + 8 <= width; f += 8) {
      for (int64_t s = 0; s < kLanes; s += 8) {
        Transpose8x8(x + (b0 + s) * width + f, width, lanes + f * kLanes + s, kLanes);
      }
    }
  }
  for (int64_t s = 0; s < count; ++s) {
    const float* row = x + (b0 + s) * width;
    for (int64_t g = f; g < width; ++g) lanes[g * kLanes + s] = row[g];
  }
}

// The inverse of ToLanes for the `count` samples there are.
void FromLanes(const float* lanes, int64_t b0, int64_t count, int64_t width, float* x) {
  int64_t f = 0;
  if (count == kLanes) {
    for (; f + 8 <= width; f += 8) {
      for (int64_t s = 0; s < kLanes; s += 8) {
        Transpose8x8(lanes + f * kLanes + s, kLanes, x + (b0 + s) * width + f, width);
      }
    }
  }
  for (int64_t s = 0; s < count; ++s) {
    float* row = x + (b0 + s) * width;
    for (int64_t g = f; g < width; ++g) row[g] = lanes[g * kLanes + s];
  }
}

// dots[g] = sum over k of a[k] * b_g[k] for G pairs (lane-wise), a and b_g
// in [d, kLanes] (D floats, or `d` when D = 0).
template <int64_t G, int64_t D>
void DotGroup(const float* a, const float* const* b, int64_t d, float* dots) {
  float acc[G][kLanes] = {};
  for (int64_t k = 0; k < (D ? D : d); ++k) {
    const float* ak = a + k * kLanes;
    for (int64_t g = 0; g < G; ++g) {
      const float* bk = b[g] + k * kLanes;
      for (int64_t s = 0; s < kLanes; ++s) acc[g][s] += ak[s] * bk[s];
    }
  }
  for (int64_t g = 0; g < G; ++g) std::copy(acc[g], acc[g] + kLanes, dots + g * kLanes);
}

// The dots of one block (`lanes` [n, d, kLanes]) into `dots` [P, kLanes].
template <int64_t D>
void BlockDots(const float* lanes, int64_t n, int64_t d, float* dots) {
  for (int64_t i = 0; i + 1 < n; ++i) {
    const float* a = lanes + i * d * kLanes;
    float* row_dots = dots + PairIndex(i, i + 1, n) * kLanes;
    const float* b[kPairGroup];
    int64_t j = i + 1;
    for (; j + kPairGroup <= n; j += kPairGroup, row_dots += kPairGroup * kLanes) {
      for (int64_t g = 0; g < kPairGroup; ++g) b[g] = lanes + (j + g) * d * kLanes;
      DotGroup<kPairGroup, D>(a, b, d, row_dots);
    }
    for (; j < n; ++j, row_dots += kLanes) {
      b[0] = lanes + j * d * kLanes;
      DotGroup<1, D>(a, b, d, row_dots);
    }
  }
}

// The transpose of one block: out[i] = sum over j != i, ascending, of
// grads[pair(i, j)] * x[j], all in lanes. With D a constant, a vector's sum
// stays in registers.
template <int64_t D>
void BlockDotsTranspose(const float* lanes, const float* grads, int64_t n, int64_t d,
                        float* out) {
  const int64_t width = D ? D : d;
  for (int64_t i = 0; i < n; ++i) {
    float acc[D ? D : 1][kLanes];
    float* sum = D ? &acc[0][0] : out + i * width * kLanes;
    std::fill(sum, sum + width * kLanes, 0.0f);
    for (int64_t j = 0; j < n; ++j) {
      if (j == i) continue;
      const float* g = grads + PairIndex(std::min(i, j), std::max(i, j), n) * kLanes;
      const float* xj = lanes + j * width * kLanes;
      for (int64_t k = 0; k < width; ++k) {
        for (int64_t s = 0; s < kLanes; ++s) sum[k * kLanes + s] += g[s] * xj[k * kLanes + s];
      }
    }
    if (D) std::copy(sum, sum + width * kLanes, out + i * width * kLanes);
  }
}

// Checks that x is [B, n, d] and returns how many chunks its blocks of
// kLanes samples are cut into.
ffi::ErrorOr<int64_t> InteractionChunks(const ffi::Buffer<ffi::F32>& x) {
  if (x.dimensions().size() != 3) {
    return ffi::Unexpected(ffi::Error::InvalidArgument("the vectors must be [batch, n, d]"));
  }
  // At least 64 blocks (1024 samples) a chunk: each device's share of a
  // batch on a mesh of several CPU devices stays on one thread.
  const int64_t blocks = (x.dimensions()[0] + kLanes - 1) / kLanes;
  return std::max<int64_t>(1, std::min(kMaxChunks, blocks / 64));
}

ffi::Error PairwiseDots(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                        ffi::ResultBuffer<ffi::F32> out) {
  auto chunks = InteractionChunks(x);
  if (chunks.has_error()) return chunks.error();
  const int64_t batch = x.dimensions()[0], n = x.dimensions()[1], d = x.dimensions()[2];
  const int64_t pairs = n * (n - 1) / 2;
  if (out->dimensions().size() != 2 || out->dimensions()[0] != batch ||
      out->dimensions()[1] != pairs) {
    return ffi::Error::InvalidArgument("the dots must be [batch, n (n - 1) / 2]");
  }
  const int64_t blocks = (batch + kLanes - 1) / kLanes;
  ParallelFor(pool, *chunks, [&](int64_t c) {
    std::vector<float> lanes(n * d * kLanes), dots(std::max<int64_t>(pairs, 1) * kLanes);
    auto [first, last] = ChunkOf(c, blocks, *chunks);
    for (int64_t block = first; block < last; ++block) {
      const int64_t b0 = block * kLanes, count = std::min(kLanes, batch - b0);
      ToLanes(x.typed_data(), b0, count, n * d, lanes.data());
      WithRowWidth(d, [&](auto width) {
        BlockDots<decltype(width)::value>(lanes.data(), n, d, dots.data());
      });
      FromLanes(dots.data(), b0, count, pairs, out->typed_data());
    }
  });
  return ffi::Error::Success();
}

// grads_x[i] = sum over j != i, ascending, of grads[pair(i, j)] * x[j].
ffi::Error PairwiseDotsTranspose(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                                 ffi::Buffer<ffi::F32> grads,
                                 ffi::ResultBuffer<ffi::F32> grads_x) {
  auto chunks = InteractionChunks(x);
  if (chunks.has_error()) return chunks.error();
  const int64_t batch = x.dimensions()[0], n = x.dimensions()[1], d = x.dimensions()[2];
  const int64_t pairs = n * (n - 1) / 2;
  if (grads.dimensions().size() != 2 || grads.dimensions()[0] != batch ||
      grads.dimensions()[1] != pairs) {
    return ffi::Error::InvalidArgument("the dots' gradients must be [batch, n (n - 1) / 2]");
  }
  const int64_t blocks = (batch + kLanes - 1) / kLanes;
  ParallelFor(pool, *chunks, [&](int64_t c) {
    std::vector<float> lanes(n * d * kLanes), grad_lanes(std::max<int64_t>(pairs, 1) * kLanes);
    std::vector<float> out(n * d * kLanes);
    auto [first, last] = ChunkOf(c, blocks, *chunks);
    for (int64_t block = first; block < last; ++block) {
      const int64_t b0 = block * kLanes, count = std::min(kLanes, batch - b0);
      ToLanes(x.typed_data(), b0, count, n * d, lanes.data());
      ToLanes(grads.typed_data(), b0, count, pairs, grad_lanes.data());
      WithRowWidth(d, [&](auto width) {
        BlockDotsTranspose<decltype(width)::value>(lanes.data(), grad_lanes.data(), n, d,
                                                   out.data());
      });
      FromLanes(out.data(), b0, count, n * d, grads_x->typed_data());
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SfSegments, Segments,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("slots")
                                  .Attr<int64_t>("partitions")
                                  .Attr<int64_t>("minibatches")
                                  .Attr<int64_t>("width"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SfRoute, Route,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .RemainingRets()
                                  .Attr<int64_t>("slots")
                                  .Attr<int64_t>("minibatches")
                                  .Attr<int64_t>("width")
                                  .Attr<int64_t>("rows"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SfGatherRows, GatherRows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("slots"));

// Pool and its transpose start with entry index, samples and gains; then
// Pool takes the rows' pieces, its transpose the samples' gradients.
static auto PoolOperands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::F32>>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SfPool, Pool,
                              PoolOperands().RemainingArgs().Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SfPoolTranspose, PoolTranspose,
                              PoolOperands()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingRets());

// The operands every update starts with: learning rate, the stack's table
// starts and dims, and the table.
static auto UpdateBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::F32>>();
}

// Then the received rows' and gradients' pieces.
XLA_FFI_DEFINE_HANDLER_SYMBOL(SfUpdateSgd, UpdateSgd,
                              UpdateBinding()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("slots")
                                  .Attr<int64_t>("rows_per_partition")
                                  .Attr<float>("epsilon"));

// With a slot: one more operand (the slot, before the pieces) and one more result.
#define SF_UPDATE_WITH_SLOT_HANDLER(name, rule)                         \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, UpdateWithSlot<rule>,             \
                                UpdateBinding()                         \
                                    .Arg<ffi::Buffer<ffi::F32>>()       \
                                    .RemainingArgs()                    \
                                    .Ret<ffi::Buffer<ffi::F32>>()       \
                                    .Ret<ffi::Buffer<ffi::F32>>()       \
                                    .Attr<int64_t>("slots")             \
                                    .Attr<int64_t>("rows_per_partition") \
                                    .Attr<float>("epsilon"));

SF_UPDATE_WITH_SLOT_HANDLER(SfUpdateAdagrad, Rule::kAdagrad)
SF_UPDATE_WITH_SLOT_HANDLER(SfUpdateRowWiseAdagrad, Rule::kRowWiseAdagrad)

XLA_FFI_DEFINE_HANDLER_SYMBOL(SfPairwiseDots, PairwiseDots,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SfPairwiseDotsTranspose, PairwiseDotsTranspose,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
