// The route of a slot's layout (its segments; each entry's place among the
// distinct rows and the rows to request from each device) and the owner's
// gather of the rows requested from it.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common.h"

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

}  // namespace
