// A linear layer for decoding on the CPU: Y[m, n] = sum_k X[m, k] W[n, k] (+ b[n]), fp32, with
// W (nn.Linear's [N, K]) packed once into panels.
//
// Why: at small M a decoding step of a small target is bound by reading the weights once, and
// torch's fp32 GEMM reaches about 12 GB/s there on this project's 2-core CPU; streaming the
// packed panels reaches 25-30 GB/s at M = 1-8. At larger M (verify blocks of a batch, prefill)
// the work is FMAs, and the register tiles below keep ahead of torch's GEMM at every M measured
// (1-2048; see rollout/kernels/native_linear.py for the figures, scripts/research/profile_step.py to measure).
//
// The panels (fp32, compact bf16 or int8) are laid out as panels.h describes and packed by
// pack.cpp; this file is the kernel that streams them. Work units are kUnit adjacent
// panels (a trailing panel runs alone), each computed by one thread; the rows run in groups of
// kGroupU (kGroup1 alone): for k = 0..K-1, the 16 weights of row k of each panel are multiplied
// by x[m, k] (broadcast) into kUnit x rows accumulators of 16 lanes. A second group rereads the
// unit's panels from cache, and rows run in blocks of kRowBlock so X stays in cache too.
// k runs in blocks of 64 whose sums are added to the running sum (a shorter chain of roundings
// than one sum over all K). Every output's sum runs in this fixed order whatever M, the tiling,
// the thread count or the row's place in the batch: results are deterministic and
// batch-invariant, and differ from torch's GEMM only by float32 rounding.

#include <ATen/Parallel.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

#include "panels.h"

namespace {

constexpr int64_t kMaxRows = 1 << 16;
constexpr int64_t kRowBlock = 256;  // rows per pass over the weights
constexpr int kGroup1 = 16;  // rows per group with one panel
constexpr int kUnit = 2;  // panels per work unit
constexpr int kGroupU = 12;  // rows per group with a unit of panels
constexpr int64_t kBlock = 64;  // terms summed in order before joining the running sum (rounding error)
// Panel rows (64-byte lines) requested ahead of the one being read. A panel is one stream of K
// lines across several 4 KiB pages; on the Intel Xeon this was measured on, whose hardware
// prefetcher does not follow a stream into the next page, the explicit requests made a
// batch-1 forward of SmolLM2-135M 5-7% faster, a 4-token verify block 12-15% and batch 16 10-13%
// (the same bits: a prefetch changes no arithmetic).
constexpr int64_t kAhead = 32;
// Panel rows requested into L2 (not L1) further ahead. On a 2-core AMD EPYC (Zen 4 flags) the
// L1 requests alone left blocks of 5 or more rows 10-35% slower than 4 rows whenever the machine
// was busy (the extra FMAs per line leave fewer loads in flight); with these, 5-12 rows stream
// the weights about as fast as 1-4 do (all of SmolLM2-135M's weights, one process, interleaved
// with the old kernel: 5-9 rows 25-28 -> 19-20 ms when busy, 21-23 -> 20 ms when quiet; 12 rows
// 43 -> 24 ms; 1-4 rows and 48-128 rows unchanged). The same bits: a prefetch changes no arithmetic.
constexpr int64_t kAheadL2 = 128;

#ifdef __AVX512F__
#include <immintrin.h>

// 16 weights of a panel row as floats: fp32 panels as they are, compact panels widened (exact).
inline __m512 load16(const float* w) { return _mm512_loadu_ps(w); }
inline __m512 load16(const uint16_t* w) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
// Int8 panels: each integer as a float (exact) times its column's scale: the weight's own value.
inline __m512 load16(const int8_t* w, __m512 scale) {
  const __m512i wide = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(wide), scale);
}

// Rows [0, M) of X times panels p .. p + NP - 1: NP x M accumulators of 16 lanes. (always_inline:
// tile_one_region below compiles this body under its own options; the other tiles' machine code
// is the same as without the attribute.)
template <typename W, int M, int NP>
__attribute__((always_inline)) inline void tile(const W* P, const float* X, const float* b, float* Y, int64_t N,
                                                int64_t K, int64_t p) {
  __m512 acc[NP][M], part[NP][M];
  for (int j = 0; j < NP; ++j)
    for (int m = 0; m < M; ++m) acc[j][m] = _mm512_setzero_ps();
  const int64_t S = panel_stride<W>(K);
  const W* w = P + p * S;
  __m512 scale[NP];
  if constexpr (kInt8<W>)
    for (int j = 0; j < NP; ++j) scale[j] = _mm512_loadu_ps(panel_scales(w + j * S, K));
  // panel rows requested ahead: the same bytes ahead for int8 panels as for fp32 ones, once a line
  constexpr int64_t kRowsAhead = kInt8<W> ? 4 * kAhead : kAhead, kRowsAheadL2 = kInt8<W> ? 4 * kAheadL2 : kAheadL2;
  for (int64_t k0 = 0; k0 < K; k0 += kBlock) {  // blocks of kBlock terms, then the sum of blocks
    const int64_t k1 = k0 + kBlock < K ? k0 + kBlock : K;
    for (int j = 0; j < NP; ++j)
      for (int m = 0; m < M; ++m) part[j][m] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; ++k) {
      if (!kInt8<W> || (k & 3) == 0)
        for (int j = 0; j < NP; ++j) {  // (hints: past a panel's end they touch the next one, never fault)
          _mm_prefetch(reinterpret_cast<const char*>(w + j * S + (k + kRowsAhead) * kLanes), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(w + j * S + (k + kRowsAheadL2) * kLanes), _MM_HINT_T1);
        }
      __m512 v[NP];
      for (int j = 0; j < NP; ++j) {
        if constexpr (kInt8<W>) v[j] = load16(w + j * S + k * kLanes, scale[j]);
        else v[j] = load16(w + j * S + k * kLanes);
      }
      for (int m = 0; m < M; ++m) {
        const __m512 x = _mm512_set1_ps(X[m * K + k]);
        for (int j = 0; j < NP; ++j) part[j][m] = _mm512_fmadd_ps(x, v[j], part[j][m]);
      }
    }
    for (int j = 0; j < NP; ++j)
      for (int m = 0; m < M; ++m) acc[j][m] = _mm512_add_ps(acc[j][m], part[j][m]);
  }
  for (int j = 0; j < NP; ++j) {
    const int64_t n0 = (p + j) * kLanes;
    const __mmask16 mask = N - n0 >= kLanes ? static_cast<__mmask16>(0xFFFF)
                                            : static_cast<__mmask16>((1u << (N - n0)) - 1u);
    const __m512 bias = b != nullptr ? _mm512_maskz_loadu_ps(mask, b + n0) : _mm512_setzero_ps();
    for (int m = 0; m < M; ++m) {
      const __m512 out = b != nullptr ? _mm512_add_ps(acc[j][m], bias) : acc[j][m];
      _mm512_mask_storeu_ps(Y + m * N + n0, mask, out);
    }
  }
}
// The same tile compiled with one register-allocation region: with GCC 12's default regions the
// 7-row unit tile kept its two panel rows on the stack and reloaded them for every FMA (half
// speed: 7 rows cost more than 8). Only that tile uses it (with it, the others ran 1-2% slower).
template <typename W, int M, int NP>
__attribute__((optimize("ira-region=one"))) void tile_one_region(const W* P, const float* X, const float* b, float* Y,
                                                                 int64_t N, int64_t K, int64_t p) {
  tile<W, M, NP>(P, X, b, Y, N, K, p);
}
constexpr bool kVectorised = true;
#else
inline float widen(float w) { return w; }
inline float widen(uint16_t w) {
  const uint32_t bits = static_cast<uint32_t>(w) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
template <typename W, int M, int NP>
inline void tile(const W* P, const float* X, const float* b, float* Y, int64_t N, int64_t K, int64_t p) {
  // Without AVX-512 (the Python side does not use the kernel then; kept so the file builds).
  const int64_t S = panel_stride<W>(K);
  for (int64_t j = 0; j < NP * kLanes && p * kLanes + j < N; ++j)
    for (int m = 0; m < M; ++m) {
      const W* w = P + (p + j / kLanes) * S;
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) {
        float v;
        if constexpr (kInt8<W>) v = static_cast<float>(w[k * kLanes + j % kLanes]) * panel_scales(w, K)[j % kLanes];
        else v = widen(w[k * kLanes + j % kLanes]);
        s += X[m * K + k] * v;
      }
      Y[m * N + p * kLanes + j] = b != nullptr ? s + b[p * kLanes + j] : s;
    }
}
template <typename W, int M, int NP>  // (the register allocation of the vectorised tiles does not arise here)
inline void tile_one_region(const W* P, const float* X, const float* b, float* Y, int64_t N, int64_t K, int64_t p) {
  tile<W, M, NP>(P, X, b, Y, N, K, p);
}
constexpr bool kVectorised = false;
#endif

template <typename W>
using Tile = void (*)(const W*, const float*, const float*, float*, int64_t, int64_t, int64_t);

template <typename W, int M, int NP>  // the tile of M rows over NP panels
constexpr Tile<W> pick() {
  if constexpr (M == 7 && NP == kUnit) return &tile_one_region<W, M, NP>;
  else return &tile<W, M, NP>;
}
template <typename W, int NP, int... Ms>
constexpr std::array<Tile<W>, sizeof...(Ms) + 1> tiles(std::integer_sequence<int, Ms...>) {
  return {nullptr, pick<W, Ms + 1, NP>()...};
}
template <typename W>  // [rows] -> tile, for one panel and for a unit of panels
struct Tiles {
  static constexpr auto one = tiles<W, 1>(std::make_integer_sequence<int, kGroup1>{});
  static constexpr auto unit = tiles<W, kUnit>(std::make_integer_sequence<int, kGroupU>{});
};

// Work units are kUnit panels; each runs the rows in groups that fit the registers (a group
// rereads the unit's panels from cache, not memory). Panels past the last whole unit run alone.
template <typename W>
void run(const W* P, const float* b, const float* X, float* Y, int64_t N, int64_t K, int64_t M) {
  const int64_t panels = (N + kLanes - 1) / kLanes;
  const int64_t units = panels / kUnit;
  for (int64_t r0 = 0; r0 < M; r0 += kRowBlock) {  // row blocks whose X stays in cache
    const int64_t r1 = r0 + kRowBlock < M ? r0 + kRowBlock : M;
    at::parallel_for(0, units + panels % kUnit, 4, [&](int64_t lo, int64_t hi) {
      for (int64_t u = lo; u < hi; ++u) {
        const bool whole = u < units;
        const int64_t p = whole ? u * kUnit : units * kUnit + (u - units);
        const int64_t group = whole ? kGroupU : kGroup1;
        for (int64_t m0 = r0; m0 < r1; m0 += group) {
          const int64_t rows = r1 - m0 < group ? r1 - m0 : group;
          (whole ? Tiles<W>::unit[rows] : Tiles<W>::one[rows])(P, X + m0 * K, b, Y + m0 * N, N, K, p);
        }
      }
    });
  }
}

}  // namespace

extern "C" {

int64_t hr_linear_max_rows() { return kMaxRows; }

// 1 when built with the AVX-512 path (the only one worth using), else 0.
int64_t hr_linear_vectorised() { return kVectorised ? 1 : 0; }

// Y [M, N] = X [M, K] W^T (+ b) from the packed P. Returns 0, or 1 when M is outside
// [1, kMaxRows] (nothing written; kMaxRows only bounds the call).
int64_t hr_linear(const float* P, const float* b, const float* X, float* Y, int64_t N, int64_t K, int64_t M) {
  if (M < 1 || M > kMaxRows) return 1;
  run(P, b, X, Y, N, K, M);
  return 0;
}

// hr_linear over compact panels (hr_linear_pack16): the same bits as over the fp32 panels.
int64_t hr_linear16(const uint16_t* P, const float* b, const float* X, float* Y, int64_t N, int64_t K, int64_t M) {
  if (M < 1 || M > kMaxRows) return 1;
  run(P, b, X, Y, N, K, M);
  return 0;
}

// hr_linear over int8 panels (hr_linear_pack8): the same bits as over the fp32 panels.
int64_t hr_linear8(const int8_t* P, const float* b, const float* X, float* Y, int64_t N, int64_t K, int64_t M) {
  if (M < 1 || M > kMaxRows) return 1;
  run(P, b, X, Y, N, K, M);
  return 0;
}

}  // extern "C"
