// The owner's update: the gradients it received, merged per row, applied
// by SGD, Adagrad or row-wise Adagrad once per row, in place.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "common.h"
#include "huge_pages.h"

namespace {

// The owner merges the gradients of several sources in windows of this
// many rows of its shard (4096: 256 KiB of sums at width 16; 1024 and 16384
// were slower).
constexpr int64_t kWindowRows = 4096;

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
        // Through registers, as the pooling adds (see Pooling::InLayoutOrder).
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

}  // namespace
