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

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef __AVX__
#include <immintrin.h>
#endif

#include "common.h"

namespace {

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

// kLanes floats, one sample per lane. The products below are written on
// this type: GCC 12 vectorized their scalar loops across the pairs, with
// gathers, which on AMD cores made the forward pass 4x slower than XLA's
// (docs/benchmarks.md). memcpy loads and stores, as the blocks' rows need
// not be aligned to a vector.
typedef float LaneVector __attribute__((vector_size(kLanes * sizeof(float))));

LaneVector LoadLanes(const float* p) {
  LaneVector v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// dots[g] = sum over k of a[k] * b_g[k] for G pairs (lane-wise), a and b_g
// in [d, kLanes] (D floats, or `d` when D = 0).
template <int64_t G, int64_t D>
void DotGroup(const float* a, const float* const* b, int64_t d, float* dots) {
  LaneVector acc[G] = {};
  for (int64_t k = 0; k < (D ? D : d); ++k) {
    const LaneVector ak = LoadLanes(a + k * kLanes);
    for (int64_t g = 0; g < G; ++g) acc[g] += ak * LoadLanes(b[g] + k * kLanes);
  }
  std::memcpy(dots, acc, sizeof acc);
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
