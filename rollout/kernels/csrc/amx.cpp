// A linear layer over bf16-valued weights on Intel AMX (the tile unit of Sapphire Rapids and later
// Xeons): Y[m, n] = sum_k X[m, k] W[n, k] (+ b[n]), fp32 inputs and outputs.
//
// Why: the fp32 FMA kernel (linear.cpp) is bound by its FMAs from about 12 rows on (a verify
// block of a batch, a batch of 16 and up, a prefill), and AMX multiplies bf16 tiles at about 16
// times the FMA rate. It serves the weights that are exactly bfloat16 values: the rollout copy
// rounded to bf16 (``backend_options: {weights: bfloat16}``) and an EAGLE-3 head stored in bf16.
//
// Exact products: each row of X is split into three bf16 parts by truncation, x = hi + mid + lo
// (hi = x's top 16 bits, mid = the top 16 bits of x - hi, lo = x - hi - mid: each difference is
// exact, and the three parts hold all 24 bits of x's significand), and a product of two bf16 values
// is exact in fp32. So every term w x is formed exactly, and the only roundings are the fp32 sums,
// as in any fp32 GEMM; the outputs are within float32 rounding of linear.cpp's, not its bits. The
// limit: the tile unit reads subnormal values as zero and flushes subnormal products, so the split
// is exact for |x| >= 2^-103 (x's last bit, which lo may hold, >= 2^-126; a power of two down to
// 2^-126), and a term below 2^-126 counts as zero (the pack refuses subnormal weights; activations
// of a real model are far above that). An infinite or NaN x gives hi = x (NaN made quiet) and
// mid = lo = 0: its row's outputs are inf or NaN as an fp32 sum's are.
//
// Order: for each block of 32 k, the tile unit adds the hi, then the mid, then the lo products of
// the block to the output's running fp32 sum (each TDPBF16PS adds the 32 terms of one part in
// pairs). That order is fixed whatever M, the tiling, the thread count or the row's place in the
// batch: results are deterministic and batch-invariant, as the FMA kernel's are.
//
// Layout (hr_linear_pack_amx): panel p holds output columns [16p, 16p + 16); within it, block kb
// holds k in [32 kb, 32 kb + 32) as the 16 x 32 bf16 tile the unit reads as its B operand:
// element [i][2j + e] = W[16p + j][32 kb + 2i + e] (pairs of k side by side, "VNNI" order). Needs
// N a multiple of 16 and K a multiple of 32; the pack refuses other shapes and any value that is
// not a bfloat16.
//
// The OS hands AMX's tile state to a process only on request (Linux: arch_prctl
// ARCH_REQ_XCOMP_PERM); hr_amx_enable asks once, and the kernel refuses to run before it is granted.

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HR_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define HR_AMX 0
#endif

namespace {

constexpr int64_t kAmxMaxRows = 1 << 16;
constexpr int64_t kAmxRowBlock = 256;  // rows per pass over the weights (see hr_linear_amx)
std::atomic<int> g_enabled{0};  // 1: tile state granted to this process

#if HR_AMX
constexpr int64_t kTile = 512;  // bf16 values in one 16 x 32 weight tile (1 KiB)
constexpr int64_t kAheadBlocks = 2;  // weight tiles of a panel requested into L1 ahead of the one being read
constexpr int64_t kAheadBlocksL2 = 8;  // and into L2

struct TileConfig {  // the LDTILECFG operand (palette 1)
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-3: C (rows x 16 fp32) of row groups 0 and 1 times panels 0 and 1; 4-5: B (the two
// panels' 16 x 32 weight tile); 6-7: A (rows x 32 bf16: one part of the rows of groups 0, 1).
void configure(int rows) {
  TileConfig c;
  std::memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = (t == 4 || t == 5) ? 16 : rows;
  }
  _tile_loadconfig(&c);
}

// The high 16 bits of each of 16 floats (held as 32-bit lanes) as 16 bf16 values.
inline __m256i high_halves(__m512i v) { return _mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)); }

// The A tile of part ``part`` (0 hi, 1 mid, 2 lo), row group g (rows 16 g .. 16 g + 15) and k
// block kb in S: 16 rows of 32 bf16 values, 1 KiB in a row (a tile load reads one stream; rows K
// values apart would map a 16-row tile onto few cache sets when K is a multiple of 1024 bytes).
inline int64_t a_tile(int64_t part, int64_t g, int64_t kb, int64_t groups, int64_t blocks) {
  return ((part * groups + g) * blocks + kb) * kTile;
}

// X [M, K] -> S: the three bf16 parts of every row as A tiles (a_tile). Past 16 rows the tiles
// are 16 rows high and rows M .. Mp - 1 are zero; up to 16 the tiles have M rows (nothing to pad).
void split(const float* X, uint16_t* S, int64_t M, int64_t Mp, int64_t K) {
  const int64_t groups = Mp / 16, blocks = K / 32;
  const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m512i exponent = _mm512_set1_epi32(0x7F800000), quiet_nan = _mm512_set1_epi32(0x7FC00000);
  for (int64_t m = 0; m < (M > 16 ? Mp : M); ++m)
    for (int64_t k = 0; k < K; k += 16) {
      const __m512 x = m < M ? _mm512_loadu_ps(X + m * K + k) : _mm512_setzero_ps();
      const __m512i bits = _mm512_castps_si512(x);
      const __mmask16 finite = _mm512_cmpneq_epi32_mask(_mm512_and_si512(bits, exponent), exponent);
      const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      const __m512i hi = _mm512_mask_mov_epi32(_mm512_and_si512(bits, top), nan, quiet_nan);
      const __m512 r = _mm512_maskz_sub_ps(finite, x, _mm512_castsi512_ps(hi));  // exact; 0 where not finite
      const __m512i mid = _mm512_and_si512(_mm512_castps_si512(r), top);
      const __m512i lo = _mm512_and_si512(_mm512_castps_si512(_mm512_sub_ps(r, _mm512_castsi512_ps(mid))), top);
      const int64_t at = (m % 16) * 32 + k % 32;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(S + a_tile(0, m / 16, k / 32, groups, blocks) + at),
                          high_halves(hi));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(S + a_tile(1, m / 16, k / 32, groups, blocks) + at),
                          high_halves(mid));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(S + a_tile(2, m / 16, k / 32, groups, blocks) + at),
                          high_halves(lo));
    }
}

// Panels p (and p + 1 when two) times rows [m0, m0 + 32) (the second group when m0 + 16 < Mp).
template <bool kTwoPanels>
void unit(const uint16_t* P, const uint16_t* S, const float* b, float* Y, int64_t N, int64_t K, int64_t M,
          int64_t Mp, int64_t p, int64_t m0) {
  const int64_t blocks = K / 32;
  const uint16_t* w0 = P + p * blocks * kTile;
  const uint16_t* w1 = w0 + blocks * kTile;
  const bool two_groups = m0 + 16 < Mp;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kb = 0; kb < blocks; ++kb) {
    // (hints: past a panel's end they touch the next one or nothing, never fault)
    const char* ahead0 = reinterpret_cast<const char*>(w0 + (kb + kAheadBlocks) * kTile);
    const char* ahead1 = reinterpret_cast<const char*>(w1 + (kb + kAheadBlocks) * kTile);
    const char* far0 = reinterpret_cast<const char*>(w0 + (kb + kAheadBlocksL2) * kTile);
    const char* far1 = reinterpret_cast<const char*>(w1 + (kb + kAheadBlocksL2) * kTile);
    for (int line = 0; line < 1024; line += 64) {
      _mm_prefetch(ahead0 + line, _MM_HINT_T0);
      _mm_prefetch(far0 + line, _MM_HINT_T1);
      if constexpr (kTwoPanels) {
        _mm_prefetch(ahead1 + line, _MM_HINT_T0);
        _mm_prefetch(far1 + line, _MM_HINT_T1);
      }
    }
    _tile_loadd(4, w0 + kb * kTile, 64);
    if constexpr (kTwoPanels) _tile_loadd(5, w1 + kb * kTile, 64);
    for (int part = 0; part < 3; ++part) {  // hi, mid, lo: the fixed order of every output's sum
      _tile_loadd(6, S + a_tile(part, m0 / 16, kb, Mp / 16, blocks), 64);
      _tile_dpbf16ps(0, 6, 4);
      if constexpr (kTwoPanels) _tile_dpbf16ps(1, 6, 5);
      if (two_groups) {
        _tile_loadd(7, S + a_tile(part, m0 / 16 + 1, kb, Mp / 16, blocks), 64);
        _tile_dpbf16ps(2, 7, 4);
        if constexpr (kTwoPanels) _tile_dpbf16ps(3, 7, 5);
      }
    }
  }
  alignas(64) float c[4][16][16];
  _tile_stored(0, c[0], 64);
  if constexpr (kTwoPanels) _tile_stored(1, c[1], 64);
  if (two_groups) {
    _tile_stored(2, c[2], 64);
    if constexpr (kTwoPanels) _tile_stored(3, c[3], 64);
  }
  for (int g = 0; g < (two_groups ? 2 : 1); ++g) {
    const int64_t r0 = m0 + 16 * g, rows = M - r0 < 16 ? M - r0 : 16;
    for (int j = 0; j < (kTwoPanels ? 2 : 1); ++j) {
      const int64_t n0 = (p + j) * 16;
      const __m512 bias = b != nullptr ? _mm512_loadu_ps(b + n0) : _mm512_setzero_ps();
      for (int64_t r = 0; r < rows; ++r) {
        const __m512 out = _mm512_load_ps(c[2 * g + j][r]);
        _mm512_storeu_ps(Y + (r0 + r) * N + n0, b != nullptr ? _mm512_add_ps(out, bias) : out);
      }
    }
  }
}
#endif

}  // namespace

extern "C" {

// 1 when this build has the AMX kernel (an AMX-BF16 CPU at build time), else 0.
int64_t hr_amx_built() { return HR_AMX; }

// Ask the OS for AMX's tile state (once per process). Returns 1 when granted (the kernel may run),
// else 0 (no AMX build, or the OS refused: then only the other kernels run).
int64_t hr_amx_enable() {
#if HR_AMX
  if (g_enabled.load() == 0) {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    if (syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0) g_enabled.store(1);
  }
  return g_enabled.load();
#else
  return 0;
#endif
}

// Pack W [N, K] (row-major float32) into P (N x K values of 16 bits, the size of its bf16 panels)
// in the layout above. Returns 0, or 1 when N is not a multiple of 16, K not a multiple of 32, some
// value of W is not a bfloat16 or is a subnormal one, or this build has no AMX (P then holds
// nothing usable). With P null only the shape and W's first row are tested (0: they pass), as
// hr_linear_pack16 does: a dense fp32 weight is refused before a buffer is made for it.
int64_t hr_linear_pack_amx(const float* W, uint16_t* P, int64_t N, int64_t K) {
#if HR_AMX
  if (N < 16 || K < 32 || N % 16 != 0 || K % 32 != 0) return 1;
  const __m512i low = _mm512_set1_epi32(0xFFFF), exponent = _mm512_set1_epi32(0x7F800000);
  const __m512i mantissa = _mm512_set1_epi32(0x007F0000);
  // refused: a value of v that is not a bf16, or a subnormal one (the tile unit reads it as zero)
  const auto refused = [&](__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    return (_mm512_test_epi32_mask(bits, low) |
            (_mm512_testn_epi32_mask(bits, exponent) & _mm512_test_epi32_mask(bits, mantissa))) != 0;
  };
  if (P == nullptr) {
    for (int64_t k = 0; k < K; k += 16)
      if (refused(_mm512_loadu_ps(W + k))) return 1;
    return 0;
  }
  const int64_t blocks = K / 32;
  std::atomic<int> bad{0};
  at::parallel_for(0, N / 16, 16, [&](int64_t lo, int64_t hi) {
    // a row's 32 values of a block are 16 pairs (k = 2i, 2i + 1): as bf16 (exact for bf16
    // values) they are 16 32-bit words, word i going to row i of the tile, column j
    const __m512i rows16 = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(16));
    for (int64_t p = lo; p < hi; ++p)
      for (int64_t j = 0; j < 16; ++j) {
        const float* w = W + (16 * p + j) * K;
        for (int64_t kb = 0; kb < blocks; ++kb) {
          const __m512 a = _mm512_loadu_ps(w + 32 * kb), b = _mm512_loadu_ps(w + 32 * kb + 16);
          if (refused(a) || refused(b)) {
            bad.store(1, std::memory_order_relaxed);
            return;
          }
          _mm512_i32scatter_epi32(reinterpret_cast<int32_t*>(P) + (p * blocks + kb) * (kTile / 2) + j, rows16,
                                  reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a)), 4);
        }
        if (bad.load(std::memory_order_relaxed)) return;
      }
  });
  return bad.load();
#else
  (void)W, (void)P, (void)N, (void)K;
  return 1;  // no AMX in this build: the tiles never run
#endif
}

// Y [M, N] = X [M, K] W^T (+ b) from the packed P. Returns 0; 1 when M is outside [1, 65536] or
// the shape is not packable; 2 when the tile state was not granted (hr_amx_enable) or this build
// has no AMX; 3 when the input parts could not be allocated. Rows run in blocks of kAmxRowBlock
// (the parts of a block stay in L2; a row's outputs do not depend on its block). Y is written
// only where it returns 0 (a failed allocation may leave earlier blocks written: the caller must
// not use Y then).
int64_t hr_linear_amx(const uint16_t* P, const float* b, const float* X, float* Y, int64_t N, int64_t K, int64_t M) {
#if HR_AMX
  if (g_enabled.load() == 0) return 2;
  if (M < 1 || M > kAmxMaxRows || N < 16 || K < 32 || N % 16 != 0 || K % 32 != 0) return 1;
  thread_local std::vector<uint16_t> parts;
  const int64_t panels = N / 16, units = (panels + 1) / 2;
  for (int64_t r0 = 0; r0 < M; r0 += kAmxRowBlock) {
    const int64_t Mb = std::min(kAmxRowBlock, M - r0), Mp = (Mb + 15) / 16 * 16;
    try {
      if (parts.size() < static_cast<size_t>(3 * Mp * K)) parts.resize(3 * Mp * K);
    } catch (const std::bad_alloc&) {
      return 3;
    }
    const uint16_t* S = parts.data();
    split(X + r0 * K, parts.data(), Mb, Mp, K);
    float* Yb = Y + r0 * N;
    const int rows = Mb < 16 ? static_cast<int>(Mb) : 16;
    at::parallel_for(0, units, 2, [&](int64_t lo, int64_t hi) {
      configure(rows);
      for (int64_t u = lo; u < hi; ++u) {
        const int64_t p = 2 * u;
        for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
          if (p + 1 < panels) unit<true>(P, S, b, Yb, N, K, Mb, Mp, p, m0);
          else unit<false>(P, S, b, Yb, N, K, Mb, Mp, p, m0);
        }
      }
      _tile_release();
    });
  }
  return 0;
#else
  (void)P, (void)b, (void)X, (void)Y, (void)N, (void)K, (void)M;
  return 2;
#endif
}

}  // extern "C"
