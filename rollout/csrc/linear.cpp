// A memory-bound linear layer for decoding on the CPU: Y[m, n] = sum_k X[m, k] W[n, k] (+ b[n])
// for a handful of rows (M <= kMaxRows), fp32, W row-major [N, K] as nn.Linear stores it.
//
// Why: at batch 1 a decoding step of a small target is a chain of matrix-vector products whose
// cost is reading the weights once. torch's fp32 GEMM path reaches about 12 GB/s there on this
// project's 2-core CPU; one streaming pass per weight row reaches about 27 GB/s (the machine's
// sum-over-1-GiB bandwidth is about 30 GB/s). See rollout/native_linear.py.
//
// Each output row of W is read once, as one sequential stream, and multiplied into all M input
// rows at once (M accumulators of 16 lanes). The sum over k runs in the same order whatever M,
// the thread count or the row's place in the batch: results are deterministic and do not depend
// on how many rows share the call (batch invariance), and differ from torch's GEMM only by
// float32 rounding (the order of the sum).

#include <ATen/Parallel.h>
#include <cstdint>

namespace {

constexpr int64_t kMaxRows = 8;

#ifdef __AVX512F__
#include <immintrin.h>

template <int M>
inline void one_row(const float* w, const float* X, int64_t K, float* out, int64_t ldy) {
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512 u = _mm512_loadu_ps(w + k);
    for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(u, _mm512_loadu_ps(X + m * K + k), acc[m]);
  }
  if (k < K) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1u);
    const __m512 u = _mm512_maskz_loadu_ps(mask, w + k);
    for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(u, _mm512_maskz_loadu_ps(mask, X + m * K + k), acc[m]);
  }
  for (int m = 0; m < M; ++m) out[m * ldy] = _mm512_reduce_add_ps(acc[m]);
}
constexpr bool kVectorised = true;
#else
template <int M>
inline void one_row(const float* w, const float* X, int64_t K, float* out, int64_t ldy) {
  // Without AVX-512 (the Python side does not use the kernel then; kept so the file builds).
  for (int m = 0; m < M; ++m) {
    float s = 0.f;
    for (int64_t k = 0; k < K; ++k) s += w[k] * X[m * K + k];
    out[m * ldy] = s;
  }
}
constexpr bool kVectorised = false;
#endif

template <int M>
void run(const float* W, const float* b, const float* X, float* Y, int64_t N, int64_t K) {
  at::parallel_for(0, N, 256, [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; ++n) {
      one_row<M>(W + n * K, X, K, Y + n, N);
      if (b != nullptr)
        for (int m = 0; m < M; ++m) Y[m * N + n] += b[n];
    }
  });
}

}  // namespace

extern "C" {

int64_t hr_linear_max_rows() { return kMaxRows; }

// 1 when built with the AVX-512 path (the only one worth using), else 0.
int64_t hr_linear_vectorised() { return kVectorised ? 1 : 0; }

// Returns 0 on success, 1 when M is outside [1, kMaxRows] (nothing written).
int64_t hr_linear(const float* W, const float* b, const float* X, float* Y, int64_t N, int64_t K, int64_t M) {
  switch (M) {
    case 1: run<1>(W, b, X, Y, N, K); return 0;
    case 2: run<2>(W, b, X, Y, N, K); return 0;
    case 3: run<3>(W, b, X, Y, N, K); return 0;
    case 4: run<4>(W, b, X, Y, N, K); return 0;
    case 5: run<5>(W, b, X, Y, N, K); return 0;
    case 6: run<6>(W, b, X, Y, N, K); return 0;
    case 7: run<7>(W, b, X, Y, N, K); return 0;
    case 8: run<8>(W, b, X, Y, N, K); return 0;
    default: return 1;
  }
}

}  // extern "C"
