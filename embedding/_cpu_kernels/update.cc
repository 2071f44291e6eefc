// The owner's update: the gradients it received, merged per row, applied
// by the optimizer's rule once per row, in place.

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

enum class Rule { kSgd, kAdagrad, kRowWiseAdagrad, kLaProp, kAdagradMomentum, kF2A, kRowWiseAdam };

// Per rule, in Rule's order: how many slot variables it keeps (each a row
// as wide as the table's per row, but row-wise Adagrad's one float per row
// and row-wise Adam's second)
// and how many scalars it reads from the hyperparameters operand (the
// learning rate, or all of the spec's `get_hyperparameters(step)` in its
// order; _cpu_kernels.py).
constexpr int64_t kSlotsOfRule[] = {0, 1, 1, 2, 2, 2, 2};
constexpr int64_t kHyperparametersOfRule[] = {1, 1, 1, 4, 6, 6, 6};
constexpr int64_t SlotsOf(Rule rule) { return kSlotsOfRule[static_cast<int>(rule)]; }
constexpr int64_t HyperparametersOf(Rule rule) {
  return kHyperparametersOfRule[static_cast<int>(rule)];
}
constexpr int64_t kMaxHyperparameters = 6;

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

// sign(w) as jnp.sign has it: 0 at 0.
float Sign(float w) { return static_cast<float>((w > 0.0f) - (w < 0.0f)); }

// LaProp's step of one row (LaPropOptimizerSpec), in place. `root` is
// sqrt(1 - b1^2), the same for every element.
void LaPropRow(float* w, float* mu, float* nu, const float* g, int64_t n, const float* h,
               float root) {
  const float learning_rate = h[0], b1 = h[1], decay = h[2], eps = h[3];
  for (int64_t d = 0; d < n; ++d) {
    nu[d] = decay * nu[d] + (1.0f - decay) * (g[d] * g[d] + eps);
    mu[d] = b1 * mu[d] + root * g[d] / std::sqrt(nu[d]);
    w[d] -= learning_rate * mu[d];
  }
}

// Adagrad with momentum's step of one row (AdagradMomentumOptimizerSpec),
// in place. Exponent 2, the usual one, takes a root instead of a power:
// std::pow per element made the update several times slower.
void AdagradMomentumRow(float* w, float* a, float* m, const float* g, int64_t n, const float* h) {
  const float learning_rate = h[0], momentum = h[1], beta2 = h[2], epsilon = h[3];
  const float exponent = h[4], power = -1.0f / exponent;
  const bool nesterov = h[5] != 0.0f;
  for (int64_t d = 0; d < n; ++d) {
    const float squared = g[d] * g[d];
    a[d] = beta2 == 1.0f ? a[d] + squared : beta2 * a[d] + (1.0f - beta2) * squared;
    const float root = exponent == 2.0f ? 1.0f / std::sqrt(a[d] + epsilon)
                                        : std::pow(a[d] + epsilon, power);
    const float scaled = root * g[d];
    m[d] = momentum * m[d] + scaled;
    w[d] -= learning_rate * (nesterov ? momentum * m[d] + scaled : m[d]);
  }
}

// F2A's boost min((t / n)^rho, cap) for a row's update count n, at global
// step t = max(step, 1). Counts are whole numbers, small but for the hottest
// rows: those below kCounts come from a table made once per call, bitwise
// the same as computing them (one std::pow per row took a third of the step).
class F2ABoosts {
 public:
  explicit F2ABoosts(const float* h)
      : step_(std::max(h[5], 1.0f)), rho_(h[1]), cap_(h[4]), table_(kCounts) {
    for (int64_t k = 1; k < kCounts; ++k) table_[k] = Compute(static_cast<float>(k));
  }

  float operator()(float count) const {
    if (count >= 1.0f && count < static_cast<float>(kCounts)) {
      const auto k = static_cast<int64_t>(count);
      if (static_cast<float>(k) == count) return table_[k];
    }
    return Compute(count);
  }

 private:
  static constexpr int64_t kCounts = 1024;

  float Compute(float count) const { return std::min(std::pow(step_ / count, rho_), cap_); }

  float step_;
  float rho_;
  float cap_;
  std::vector<float> table_;
};

// One element's F2A step with its boost.
inline void F2AElement(float& w, float& a, float g, float boost, const float* h) {
  const float learning_rate = h[0], l1 = h[2], l2 = h[3];
  a += g * g;
  w -= learning_rate * (boost * g / std::sqrt(a) + l1 * Sign(w) + l2 * w);
}

// F2A's step of one row (F2AOptimizerSpec), in place. The update count is
// kept per element, but a row's elements share it unless set apart: then
// the row takes one boost, and its loop has no lookup to keep it from
// vector registers.
void F2ARow(float* w, float* a, float* count, const float* g, int64_t n, const float* h,
            const F2ABoosts& boosts) {
  bool shared = true;
  for (int64_t d = 0; d < n; ++d) {
    count[d] += 1.0f;
    shared &= count[d] == count[0];
  }
  if (shared) {
    const float boost = boosts(count[0]);
    for (int64_t d = 0; d < n; ++d) F2AElement(w[d], a[d], g[d], boost, h);
  } else {
    for (int64_t d = 0; d < n; ++d) F2AElement(w[d], a[d], g[d], boosts(count[d]), h);
  }
}

// The optimizer's update of one row from its summed gradient g (D floats,
// `dim` when D = 0), in place.
template <Rule rule, int64_t D>
struct RowUpdate {
  int64_t dim;
  float h[kMaxHyperparameters];
  float epsilon;
  const int32_t* table_starts;
  const int32_t* table_dims;
  int64_t tables;
  int64_t rows_per_partition;
  float* table;
  float* slot;
  float* second_slot;
  const F2ABoosts* boosts;
  // Row-wise Adam's bias corrections 1 - beta^t of its two moments, the
  // same for every row (two std::pow per row would cost more than the row).
  float corrections[2] = {1.0f, 1.0f};

  int64_t width() const { return D ? D : dim; }

  void Prefetch(int64_t row) const {
    PrefetchRow<1>(table + row * width(), width());
    if constexpr (rule == Rule::kAdagrad || SlotsOf(rule) == 2) {
      PrefetchRow<1>(slot + row * width(), width());
    }
    if constexpr (SlotsOf(rule) == 2 && rule != Rule::kRowWiseAdam) {
      PrefetchRow<1>(second_slot + row * width(), width());
    }
    if constexpr (rule == Rule::kRowWiseAdagrad) __builtin_prefetch(slot + row, 1, 1);
    if constexpr (rule == Rule::kRowWiseAdam) __builtin_prefetch(second_slot + row, 1, 1);
  }

  void Apply(int64_t row, const float* g) const {
    const int64_t n = width();
    float* w = table + row * n;
    const float learning_rate = h[0];
    if constexpr (rule == Rule::kSgd) {
      for (int64_t d = 0; d < n; ++d) w[d] -= learning_rate * g[d];
    } else if constexpr (rule == Rule::kAdagrad) {
      float* a = slot + row * n;
      for (int64_t d = 0; d < n; ++d) {
        a[d] += g[d] * g[d];
        w[d] -= learning_rate * g[d] / std::sqrt(a[d]);
      }
    } else if constexpr (rule == Rule::kRowWiseAdagrad) {
      ApplyRowWiseAdagrad(row, w, g);
    } else if constexpr (rule == Rule::kLaProp) {
      LaPropRow(w, slot + row * n, second_slot + row * n, g, n, h,
                std::sqrt(1.0f - h[1] * h[1]));
    } else if constexpr (rule == Rule::kAdagradMomentum) {
      AdagradMomentumRow(w, slot + row * n, second_slot + row * n, g, n, h);
    } else if constexpr (rule == Rule::kRowWiseAdam) {
      ApplyRowWiseAdam(row, w, g);
    } else {
      F2ARow(w, slot + row * n, second_slot + row * n, g, n, h, *boosts);
    }
  }

  // The embedding dim of the table that holds `row` (the stack pads every
  // table to its width).
  float TableDim(int64_t row) const {
    int64_t t = 0;
    if (tables > 1) {
      const int64_t local = row % rows_per_partition;
      while (t + 1 < tables && local >= table_starts[t + 1]) ++t;
    }
    return static_cast<float>(table_dims[t]);
  }

  void ApplyRowWiseAdagrad(int64_t row, float* w, const float* g) const {
    const int64_t n = width();
    const float accumulator = slot[row] + SumOfSquares(g, n) / TableDim(row);
    slot[row] = accumulator;
    const float scale = h[0] / (std::sqrt(accumulator) + epsilon);
    for (int64_t d = 0; d < n; ++d) w[d] -= scale * g[d];
  }

  // Row-wise Adam's step (RowWiseAdamOptimizerSpec): the first moment per
  // element in `slot`, the second per row in `second_slot`.
  void ApplyRowWiseAdam(int64_t row, float* w, const float* g) const {
    const int64_t n = width();
    const float learning_rate = h[0], beta_1 = h[1], beta_2 = h[2], eps = h[3], decay = h[4];
    const float velocity =
        beta_2 * second_slot[row] + (1.0f - beta_2) * (SumOfSquares(g, n) / TableDim(row));
    second_slot[row] = velocity;
    const float denominator = std::sqrt(velocity / corrections[1]) + eps;
    float* m = slot + row * n;
    for (int64_t d = 0; d < n; ++d) {
      m[d] = beta_1 * m[d] + (1.0f - beta_1) * g[d];
      w[d] -= learning_rate * (m[d] / corrections[0] / denominator + decay * w[d]);
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

// The shard's table and slots, written in place.
struct ShardState {
  float* table;
  int64_t rows;
  int64_t dim;
  float* slots[2];
};

template <Rule rule>
ffi::Error Apply(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& hyperparameters,
                 ffi::Buffer<ffi::S32>& table_starts, ffi::Buffer<ffi::S32>& table_dims,
                 const ffi::RemainingArgs& args, const ShardState& state, int64_t slots,
                 int64_t rows_per_partition, float epsilon) {
  if (static_cast<int64_t>(hyperparameters.element_count()) != HyperparametersOf(rule)) {
    return ffi::Error::InvalidArgument("the rule takes another number of hyperparameters");
  }
  // After the slots, the received rows' pieces, then their gradients'
  // pieces, one per device.
  const int64_t pieces = static_cast<int64_t>(args.size()) - SlotsOf(rule);
  const int64_t devices = pieces / 2;
  if (pieces < 2 || 2 * devices != pieces) {
    return ffi::Error::InvalidArgument("the received rows and gradients differ in pieces");
  }
  const int64_t dim = state.dim;
  auto rows = Pieces<const int32_t>::FromArgs<ffi::S32>(args, SlotsOf(rule), devices, slots, 1);
  if (rows.has_error()) return rows.error();
  auto grads = Pieces<const float>::FromArgs<ffi::F32>(args, SlotsOf(rule) + devices, devices,
                                                       slots, dim);
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
  std::unique_ptr<const F2ABoosts> boosts;
  if constexpr (rule == Rule::kF2A) {
    boosts = std::make_unique<const F2ABoosts>(hyperparameters.typed_data());
  }
  WithRowWidth(dim, [&](auto width) {
    constexpr int64_t D = decltype(width)::value;
    RowUpdate<rule, D> update{dim,
                              {},
                              epsilon,
                              table_starts.typed_data(),
                              table_dims.typed_data(),
                              static_cast<int64_t>(table_starts.element_count()),
                              rows_per_partition,
                              state.table,
                              state.slots[0],
                              state.slots[1],
                              boosts.get()};
    std::copy_n(hyperparameters.typed_data(), HyperparametersOf(rule), update.h);
    if constexpr (rule == Rule::kRowWiseAdam) {
      const float t = update.h[5];
      update.corrections[0] = 1.0f - std::pow(update.h[1], t);
      update.corrections[1] = 1.0f - std::pow(update.h[2], t);
    }
    ParallelFor(pool, chunks, [&](int64_t c) {
      auto [row_begin, row_end] = ChunkOf(c, state.rows, chunks);
      MergeAndApply<rule, D>(*rows, *grads, runs, row_begin, row_end, update);
    });
  });
  return ffi::Error::Success();
}

// The update of `rule`: the operands are the hyperparameters, the stack's
// table starts and dims, the table, then the rule's slots and the received
// pieces (`args`); the results the table and the slots (`slots_out`).
template <Rule rule>
ffi::Error Update(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> hyperparameters,
                  ffi::Buffer<ffi::S32> table_starts, ffi::Buffer<ffi::S32> table_dims,
                  ffi::Buffer<ffi::F32> table_in, ffi::RemainingArgs args,
                  ffi::ResultBuffer<ffi::F32> table, ffi::RemainingRets slots_out, int64_t slots,
                  int64_t rows_per_partition, float epsilon) {
  if (static_cast<int64_t>(slots_out.size()) != SlotsOf(rule)) {
    return ffi::Error::InvalidArgument("the optimizer's slots are not as many as its rule keeps");
  }
  CopyUnlessAliased(table_in, table);
  ShardState state{table->typed_data(), table->dimensions()[0], table->dimensions()[1], {}};
  for (int64_t i = 0; i < SlotsOf(rule); ++i) {
    auto slot_in = args.get<ffi::Buffer<ffi::F32>>(i);
    if (slot_in.has_error()) return slot_in.error();
    auto slot = slots_out.get<ffi::Buffer<ffi::F32>>(i);
    if (slot.has_error()) return slot.error();
    CopyUnlessAliased(*slot_in, *slot);
    state.slots[i] = (*slot)->typed_data();
  }
  return Apply<rule>(pool, hyperparameters, table_starts, table_dims, args, state, slots,
                     rows_per_partition, epsilon);
}

}  // namespace
