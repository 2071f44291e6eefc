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
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kAlignment = 8;

int64_t RoundUp(int64_t x) { return (x + kAlignment - 1) / kAlignment * kAlignment; }

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

// For one minibatch: send_rows int32[S, G, U], the shard row of every
// distinct row slot s needs from device g (S * R where unused), and
// entry_index int32[S, C], each entry's flat index into [S, G, U] (-1 for
// entries outside the minibatch, padding, and ids past a partition).
ffi::Error Route(ffi::Buffer<ffi::S32> row_pointers, ffi::Buffer<ffi::S32> ids,
                 ffi::Buffer<ffi::S32> minibatch, ffi::ResultBuffer<ffi::S32> send_rows,
                 ffi::ResultBuffer<ffi::S32> entry_index, int64_t devices, int64_t slots,
                 int64_t minibatches, int64_t width, int64_t rows, int64_t uniques) {
  const int64_t partitions = devices * slots;
  const int64_t capacity = ids.element_count() / slots;
  const int64_t shard_rows = slots * rows;
  const int64_t k = minibatch.typed_data()[0];
  int32_t* send = send_rows->typed_data();
  int32_t* index = entry_index->typed_data();
  std::fill(send, send + slots * devices * uniques, static_cast<int32_t>(shard_rows));
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
      const int64_t run = (s * devices + dest) * uniques;
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
          send[run + count] = static_cast<int32_t>(row);
          ++count;
        }
        slot_index[i] = static_cast<int32_t>(run + count - 1);
      }
    }
  }
  return ffi::Error::Success();
}

// out[m] = table[rows[m]], zero where rows[m] is out of range.
ffi::Error GatherRows(ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::S32> rows,
                      ffi::ResultBuffer<ffi::F32> out) {
  const int64_t dim = table.dimensions()[1];
  const int64_t num_rows = table.dimensions()[0];
  const int64_t n = rows.element_count();
  const float* t = table.typed_data();
  float* o = out->typed_data();
  for (int64_t m = 0; m < n; ++m) {
    const int64_t r = rows.typed_data()[m];
    if (r >= 0 && r < num_rows) {
      std::memcpy(o + m * dim, t + r * dim, dim * sizeof(float));
    } else {
      std::memset(o + m * dim, 0, dim * sizeof(float));
    }
  }
  return ffi::Error::Success();
}

// pooled float32[S, P, D]: per sample, the sum of gain * row over its entries.
ffi::Error Pool(ffi::Buffer<ffi::S32> entry_index, ffi::Buffer<ffi::S32> samples,
                ffi::Buffer<ffi::F32> gains, ffi::Buffer<ffi::F32> rows,
                ffi::ResultBuffer<ffi::F32> pooled) {
  const int64_t slots = pooled->dimensions()[0];
  const int64_t num_samples = pooled->dimensions()[1];
  const int64_t dim = pooled->dimensions()[2];
  const int64_t capacity = entry_index.element_count() / slots;
  const int64_t num_rows = rows.dimensions()[0];
  float* out = pooled->typed_data();
  std::fill(out, out + slots * num_samples * dim, 0.0f);
  for (int64_t s = 0; s < slots; ++s) {
    for (int64_t i = 0; i < capacity; ++i) {
      const int64_t e = s * capacity + i;
      const int64_t u = entry_index.typed_data()[e];
      const int64_t sample = samples.typed_data()[e];
      if (u < 0 || u >= num_rows || sample < 0 || sample >= num_samples) continue;
      const float gain = gains.typed_data()[e];
      const float* row = rows.typed_data() + u * dim;
      float* target = out + (s * num_samples + sample) * dim;
      for (int64_t d = 0; d < dim; ++d) target[d] += gain * row[d];
    }
  }
  return ffi::Error::Success();
}

// The transpose of Pool: row_grads float32[num_rows, D], per distinct row
// the sum of gain * the sample's gradient over the row's entries.
ffi::Error PoolTranspose(ffi::Buffer<ffi::S32> entry_index, ffi::Buffer<ffi::S32> samples,
                         ffi::Buffer<ffi::F32> gains, ffi::Buffer<ffi::F32> grads,
                         ffi::ResultBuffer<ffi::F32> row_grads) {
  const int64_t slots = grads.dimensions()[0];
  const int64_t num_samples = grads.dimensions()[1];
  const int64_t dim = grads.dimensions()[2];
  const int64_t capacity = entry_index.element_count() / slots;
  const int64_t num_rows = row_grads->dimensions()[0];
  float* out = row_grads->typed_data();
  std::fill(out, out + num_rows * dim, 0.0f);
  for (int64_t s = 0; s < slots; ++s) {
    for (int64_t i = 0; i < capacity; ++i) {
      const int64_t e = s * capacity + i;
      const int64_t u = entry_index.typed_data()[e];
      const int64_t sample = samples.typed_data()[e];
      if (u < 0 || u >= num_rows || sample < 0 || sample >= num_samples) continue;
      const float gain = gains.typed_data()[e];
      const float* g = grads.typed_data() + (s * num_samples + sample) * dim;
      float* target = out + u * dim;
      for (int64_t d = 0; d < dim; ++d) target[d] += gain * g[d];
    }
  }
  return ffi::Error::Success();
}

enum class Rule { kSgd, kAdagrad, kRowWiseAdagrad };

// Merges the gradients the owner received (runs of U rows, one per source
// slot and device, each ascending and padded with out-of-range rows) and
// applies the optimizer once per distinct row, in place.
template <Rule rule>
void MergeAndApply(const int32_t* received, const float* grads, int64_t runs, int64_t uniques,
                   int64_t dim, int64_t shard_rows, float learning_rate, float epsilon,
                   const int32_t* table_starts, const int32_t* table_dims, int64_t tables,
                   int64_t rows_per_partition, float* table, float* slot) {
  // Heads of the runs still holding rows; runs are few (S * G), so the
  // smallest head is found by a scan.
  int64_t heads[4096];
  int64_t active = 0;
  int64_t run_of[4096];
  for (int64_t r = 0; r < runs; ++r) {
    if (uniques > 0 && received[r * uniques] >= 0 && received[r * uniques] < shard_rows) {
      heads[active] = r * uniques;
      run_of[active] = r;
      ++active;
    }
  }
  float sum[1024];
  while (active > 0) {
    int64_t row = shard_rows;
    for (int64_t a = 0; a < active; ++a) {
      const int64_t candidate = received[heads[a]];
      if (candidate < row) row = candidate;
    }
    std::fill(sum, sum + dim, 0.0f);
    for (int64_t a = 0; a < active;) {
      if (received[heads[a]] != row) {
        ++a;
        continue;
      }
      const float* g = grads + heads[a] * dim;
      for (int64_t d = 0; d < dim; ++d) sum[d] += g[d];
      const int64_t next = heads[a] + 1;
      const int64_t end = (run_of[a] + 1) * uniques;
      if (next < end && received[next] > row && received[next] < shard_rows) {
        heads[a] = next;
        ++a;
      } else {
        --active;
        heads[a] = heads[active];
        run_of[a] = run_of[active];
      }
    }
    float* w = table + row * dim;
    if constexpr (rule == Rule::kSgd) {
      for (int64_t d = 0; d < dim; ++d) w[d] -= learning_rate * sum[d];
    } else if constexpr (rule == Rule::kAdagrad) {
      float* a = slot + row * dim;
      for (int64_t d = 0; d < dim; ++d) {
        a[d] += sum[d] * sum[d];
        w[d] -= learning_rate * sum[d] / std::sqrt(a[d]);
      }
    } else {
      const int64_t local = row % rows_per_partition;
      int64_t t = 0;
      while (t + 1 < tables && local >= table_starts[t + 1]) ++t;
      float squares = 0.0f;
      for (int64_t d = 0; d < dim; ++d) squares += sum[d] * sum[d];
      slot[row] += squares / static_cast<float>(table_dims[t]);
      const float scale = learning_rate / (std::sqrt(slot[row]) + epsilon);
      for (int64_t d = 0; d < dim; ++d) w[d] -= scale * sum[d];
    }
  }
}

// The outputs alias the inputs (the variables are donated); copy only where
// XLA could not alias them.
void CopyUnlessAliased(ffi::Buffer<ffi::F32>& in, ffi::ResultBuffer<ffi::F32>& out) {
  if (out->typed_data() != in.typed_data()) {
    std::memcpy(out->typed_data(), in.typed_data(), in.size_bytes());
  }
}

template <Rule rule>
ffi::Error Apply(ffi::Buffer<ffi::S32>& received, ffi::Buffer<ffi::F32>& grads,
                 ffi::Buffer<ffi::F32>& learning_rate, ffi::Buffer<ffi::S32>& table_starts,
                 ffi::Buffer<ffi::S32>& table_dims, float* table, int64_t shard_rows, int64_t dim,
                 float* slot, int64_t runs, int64_t rows_per_partition, float epsilon) {
  if (runs < 1 || runs > 4096 || dim > 1024) {
    return ffi::Error::InvalidArgument("1 to 4096 sources and dim at most 1024 per stack");
  }
  const int64_t uniques = received.element_count() / runs;
  MergeAndApply<rule>(received.typed_data(), grads.typed_data(), runs, uniques, dim, shard_rows,
                      learning_rate.typed_data()[0], epsilon, table_starts.typed_data(),
                      table_dims.typed_data(), table_starts.element_count(), rows_per_partition,
                      table, slot);
  return ffi::Error::Success();
}

ffi::Error UpdateSgd(ffi::Buffer<ffi::S32> received, ffi::Buffer<ffi::F32> grads,
                     ffi::Buffer<ffi::F32> learning_rate, ffi::Buffer<ffi::S32> table_starts,
                     ffi::Buffer<ffi::S32> table_dims, ffi::Buffer<ffi::F32> table_in,
                     ffi::ResultBuffer<ffi::F32> table, int64_t runs, int64_t rows_per_partition,
                     float epsilon) {
  CopyUnlessAliased(table_in, table);
  return Apply<Rule::kSgd>(received, grads, learning_rate, table_starts, table_dims,
                           table->typed_data(), table->dimensions()[0], table->dimensions()[1],
                           nullptr, runs, rows_per_partition, epsilon);
}

template <Rule rule>
ffi::Error UpdateWithSlot(ffi::Buffer<ffi::S32> received, ffi::Buffer<ffi::F32> grads,
                          ffi::Buffer<ffi::F32> learning_rate, ffi::Buffer<ffi::S32> table_starts,
                          ffi::Buffer<ffi::S32> table_dims, ffi::Buffer<ffi::F32> table_in,
                          ffi::Buffer<ffi::F32> slot_in, ffi::ResultBuffer<ffi::F32> table,
                          ffi::ResultBuffer<ffi::F32> slot, int64_t runs,
                          int64_t rows_per_partition, float epsilon) {
  CopyUnlessAliased(table_in, table);
  CopyUnlessAliased(slot_in, slot);
  return Apply<rule>(received, grads, learning_rate, table_starts, table_dims,
                     table->typed_data(), table->dimensions()[0], table->dimensions()[1],
                     slot->typed_data(), runs, rows_per_partition, epsilon);
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
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("devices")
                                  .Attr<int64_t>("slots")
                                  .Attr<int64_t>("minibatches")
                                  .Attr<int64_t>("width")
                                  .Attr<int64_t>("rows")
                                  .Attr<int64_t>("uniques"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SfGatherRows, GatherRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SfPool, Pool,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SfPoolTranspose, PoolTranspose,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SfUpdateSgd, UpdateSgd,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("runs")
                                  .Attr<int64_t>("rows_per_partition")
                                  .Attr<float>("epsilon"));

#define SF_UPDATE_WITH_SLOT_HANDLER(name, rule)                              \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, UpdateWithSlot<rule>,                  \
                                ffi::Ffi::Bind()                             \
                                    .Arg<ffi::Buffer<ffi::S32>>()            \
                                    .Arg<ffi::Buffer<ffi::F32>>()            \
                                    .Arg<ffi::Buffer<ffi::F32>>()            \
                                    .Arg<ffi::Buffer<ffi::S32>>()            \
                                    .Arg<ffi::Buffer<ffi::S32>>()            \
                                    .Arg<ffi::Buffer<ffi::F32>>()            \
                                    .Arg<ffi::Buffer<ffi::F32>>()            \
                                    .Ret<ffi::Buffer<ffi::F32>>()            \
                                    .Ret<ffi::Buffer<ffi::F32>>()            \
                                    .Attr<int64_t>("runs")                   \
                                    .Attr<int64_t>("rows_per_partition")     \
                                    .Attr<float>("epsilon"));

SF_UPDATE_WITH_SLOT_HANDLER(SfUpdateAdagrad, Rule::kAdagrad)
SF_UPDATE_WITH_SLOT_HANDLER(SfUpdateRowWiseAdagrad, Rule::kRowWiseAdagrad)
