// The pooling of the rows a slot's entries name into their samples' sums,
// and its transpose.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common.h"

namespace {

// Sums read and written at random this size and below stay in a core's
// cache (its L2, 1 MiB here, or more on most server cores).
constexpr int64_t kCachedSumsBytes = 512 << 10;

// A pooling's operands, as Pool checked them: S slots of C entries (each
// one's index into the rows, sample and gain), the rows' pieces (num_rows
// rows in all), and the sums it writes, float32[S, P, D]. Entries are sorted
// by row, not by sample: there are two ways to form the sums, and Pool
// chooses between them.
struct Pooling {
  const int32_t* entry_index;
  const int32_t* samples;
  const float* gains;
  const Pieces<const float>& pieces;
  float* pooled;
  int64_t slots;
  int64_t capacity;
  int64_t num_samples;
  int64_t dim;
  int64_t num_rows;

  // Adds each entry into its sample's sum in layout order: the rows are read
  // in the order they came, the sums at random places.
  void InLayoutOrder() const {
    Pieces<const float>::Reader rows_of(pieces);
    WithRowWidth(dim, [&](auto width) {
      constexpr int64_t D = decltype(width)::value;
      const int64_t w = D ? D : dim;
      std::fill(pooled, pooled + slots * num_samples * w, 0.0f);
      RowSum<D> scaled(dim);
      for (int64_t s = 0; s < slots; ++s) {
        const int64_t first = s * capacity;
        float* slot_sums = pooled + s * num_samples * w;
        for (int64_t e = first; e < first + capacity; ++e) {
          const int64_t i = entry_index[e];
          const int64_t sample = samples[e];
          if (i < 0 || i >= num_rows || sample < 0 || sample >= num_samples) continue;
          // Through registers: added in place, the compiler could not
          // rule out that the sum and the row overlap and added one float
          // at a time.
          float* sum = slot_sums + sample * w;
          scaled.Set(sum);
          scaled.Add(gains[e], rows_of.Row(i));
          scaled.Store(sum);
        }
      }
    });
  }

  // A counting sort by sample (stable, so layout order within a sample)
  // lists each sample's rows and gains first; every sum is then formed in
  // registers and written once, and chunks cut the samples.
  void BySample(ffi::ThreadPool& pool) const {
    // Entry indices ascend along a slot, so a Reader finds their rows; the
    // sums read them in sample order, from a list of row pointers. With one
    // run (one device, one slot) the list holds indices instead: 4 bytes each
    // instead of a pointer's 8, for the largest lists there are (pointers made
    // the step on 1 device 7% slower).
    Pieces<const float>::Reader rows_of(pieces);
    const bool one_run = pieces.runs(slots) == 1;
    std::vector<int32_t> starts(num_samples + 1);
    std::vector<int32_t> sorted_index(one_run ? capacity : 0);
    std::vector<const float*> sorted_rows(one_run ? 0 : capacity);
    const float* only_run = one_run ? pieces.Run(0) : nullptr;
    auto sorted_row = [&](int64_t k) {
      return one_run ? only_run + sorted_index[k] * dim : sorted_rows[k];
    };
    std::vector<float> sorted_gains(capacity);
    for (int64_t s = 0; s < slots; ++s) {
      const int32_t* index = entry_index + s * capacity;
      const int32_t* sample_of = samples + s * capacity;
      const float* gain_of = gains + s * capacity;
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
      float* out = pooled + s * num_samples * dim;
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
  }
};

// pooled float32[S, P, D]: per sample, the sum of gain * row over its
// entries, in layout order. Where the sums fit in a core's cache
// (kCachedSumsBytes, as for one device of 8 at the benchmark's shape:
// 256 KiB), adding the entries in layout order (Pooling::InLayoutOrder) is
// the fastest way (the pooling took half the time of the sort). Where they
// do not, it waited for them (twice as long as sorting the entries by sample
// first, Pooling::BySample; figures in docs/benchmarks.md, "Measured in the
// CPU kernels' design").
ffi::Error Pool(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> entry_index,
                ffi::Buffer<ffi::S32> samples, ffi::Buffer<ffi::F32> gains,
                ffi::RemainingArgs rows, ffi::ResultBuffer<ffi::F32> pooled) {
  const int64_t slots = pooled->dimensions()[0];
  const int64_t num_samples = pooled->dimensions()[1];
  const int64_t dim = pooled->dimensions()[2];
  auto pieces = Pieces<const float>::FromArgs<ffi::F32>(rows, 0, rows.size(), slots, dim);
  if (pieces.has_error()) return pieces.error();
  const Pooling pooling{entry_index.typed_data(),
                        samples.typed_data(),
                        gains.typed_data(),
                        *pieces,
                        pooled->typed_data(),
                        slots,
                        entry_index.element_count() / slots,
                        num_samples,
                        dim,
                        pieces->runs(slots) * pieces->uniques()};
  if (num_samples * dim * static_cast<int64_t>(sizeof(float)) <= kCachedSumsBytes) {
    pooling.InLayoutOrder();
  } else {
    pooling.BySample(pool);
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

}  // namespace
