// RMS norm for decoding on the CPU: out[m, :] = w * (x[m, :] * rsqrt(mean(x[m, :]^2) + eps)), fp32
// (Llama's formula, in its order: x times the inverse root first, then times the weight).
//
// Why: torch's CPU rms_norm runs several ops per call, 14-28 us on a 576-wide row on this
// project's 2-core CPU, and a SmolLM2-135M step runs 61 of them (about 1.5 ms of a 24 ms step
// at batch 1). This loop takes ~1 us.
//
// The sum of squares runs in 16 lanes (lane j sums the elements j, j + 16, ...; the lanes are
// then added pairwise in a fixed tree), divided by the width, plus eps, then 1 / sqrt (both
// correctly rounded). Every row's result depends on that row alone (batch-invariant and
// deterministic whatever the thread count); it differs from torch's rms_norm by float32
// rounding of the sum.

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kLanes = 16;

// lanes added pairwise: (0 + 8), (1 + 9), ... then (0 + 4), ..., a fixed tree
inline float tree_sum(float* lanes) {
  for (int64_t width = kLanes / 2; width >= 1; width /= 2)
    for (int64_t j = 0; j < width; ++j) lanes[j] += lanes[j + width];
  return lanes[0];
}

void norm_row(const float* x, const float* w, float* out, int64_t n, float eps) {
  alignas(64) float lanes[kLanes];
  int64_t k = 0;
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  for (; k + kLanes <= n; k += kLanes) {
    const __m512 v = _mm512_loadu_ps(x + k);
    acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
  }
  _mm512_store_ps(lanes, acc);
#else
  for (int64_t j = 0; j < kLanes; ++j) lanes[j] = 0.f;
  for (; k + kLanes <= n; k += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) lanes[j] += x[k + j] * x[k + j];
#endif
  for (int64_t j = 0; k + j < n; ++j) lanes[j] += x[k + j] * x[k + j];  // the tail (n % 16 values)
  const float mean = tree_sum(lanes) / static_cast<float>(n);
  const float inv = 1.0f / std::sqrt(mean + eps);
  k = 0;
#ifdef __AVX512F__
  const __m512 s = _mm512_set1_ps(inv);
  for (; k + kLanes <= n; k += kLanes)
    _mm512_storeu_ps(out + k, _mm512_mul_ps(_mm512_loadu_ps(w + k), _mm512_mul_ps(_mm512_loadu_ps(x + k), s)));
#endif
  for (; k < n; ++k) out[k] = w[k] * (x[k] * inv);
}

}  // namespace

extern "C" {

// out [M, N] = the RMS norm of each row of x [M, N] (row-major, contiguous) with weight w [N].
void hr_rms_norm(const float* x, const float* w, float* out, int64_t M, int64_t N, float eps) {
  if (M * N < (1 << 16)) {  // a decoding step's few rows: one thread (a fork costs more)
    for (int64_t m = 0; m < M; ++m) norm_row(x + m * N, w, out + m * N, N, eps);
    return;
  }
  at::parallel_for(0, M, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t m = lo; m < hi; ++m) norm_row(x + m * N, w, out + m * N, N, eps);
  });
}

}  // extern "C"
