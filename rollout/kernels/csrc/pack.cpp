// Packing a linear layer's weight W (nn.Linear's [N, K], row-major) into the panels of panels.h,
// once per weight: fp32 panels (hr_linear_pack), compact bf16 panels (hr_linear_pack16) and int8
// panels (hr_linear_pack8), which the kernel (linear.cpp) streams. Each panel is packed by one
// thread; the compact and int8 packs check every value and refuse a weight that has no such
// panels (see panels.h).

#include <ATen/Parallel.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "panels.h"

namespace {

#ifdef __AVX512F__
// One panel: rows [n0, n0 + 16) of W as K rows of 16 (16 x 16 blocks transposed in registers).
// ``cached``: the copy is read right away (keep it in cache: no streaming stores).
inline void pack_panel(const float* W, float* dst, int64_t N, int64_t K, int64_t n0, bool cached = false) {
  const bool full = n0 + kLanes <= N;
  // rows of 16 floats stay aligned
  const bool stream = !cached && reinterpret_cast<std::uintptr_t>(dst) % 64 == 0;
  int64_t k = 0;
  for (; full && k + kLanes <= K; k += kLanes) {
    __m512 r[16], t[16];
    for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_ps(W + (n0 + j) * K + k);
    for (int j = 0; j < 16; j += 2) {  // 2 x 2 blocks of single floats
      t[j] = _mm512_unpacklo_ps(r[j], r[j + 1]);
      t[j + 1] = _mm512_unpackhi_ps(r[j], r[j + 1]);
    }
    for (int j = 0; j < 16; j += 4) {  // 4 x 4 blocks
      for (int i = 0; i < 2; ++i) {
        r[j + i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[j + i]), _mm512_castps_pd(t[j + i + 2])));
        r[j + i + 2] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[j + i]), _mm512_castps_pd(t[j + i + 2])));
      }
    }
    for (int j = 0; j < 16; j += 8) {  // 8 x 8 blocks: 128-bit lanes
      for (int i = 0; i < 4; ++i) {
        t[j + i] = _mm512_shuffle_f32x4(r[j + i], r[j + i + 4], 0x88);
        t[j + i + 4] = _mm512_shuffle_f32x4(r[j + i], r[j + i + 4], 0xDD);
      }
    }
    for (int i = 0; i < 8; ++i) {  // 16 x 16
      r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
      r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    }
    // r[j] holds column k + kColumn[j] of the 16 rows (the 4 x 4 stage swaps the middle pair)
    static constexpr int kColumn[16] = {0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15};
    if (stream) {  // the copy is not read soon: skip reading its lines into the cache first
      for (int j = 0; j < 16; ++j) _mm512_stream_ps(dst + (k + kColumn[j]) * kLanes, r[j]);
    } else {
      for (int j = 0; j < 16; ++j) _mm512_storeu_ps(dst + (k + kColumn[j]) * kLanes, r[j]);
    }
  }
  for (; k < K; ++k)
    for (int64_t j = 0; j < kLanes; ++j) dst[k * kLanes + j] = n0 + j < N ? W[(n0 + j) * K + k] : 0.f;
}
// dst[i] = the high half of src[i], i < n (n a multiple of 16); false at the first float with low
// bits set (a value that is not a bfloat16).
inline bool narrow16(const float* src, uint16_t* dst, int64_t n) {
  const __m512i low = _mm512_set1_epi32(0xFFFF);
  for (int64_t i = 0; i < n; i += kLanes) {
    const __m512i v = _mm512_loadu_si512(src + i);
    if (_mm512_test_epi32_mask(v, low)) return false;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)));
  }
  return true;
}
inline void fence() { _mm_sfence(); }
#else
inline void pack_panel(const float* W, float* dst, int64_t N, int64_t K, int64_t n0, bool = false) {
  for (int64_t k = 0; k < K; ++k)
    for (int64_t j = 0; j < kLanes; ++j) dst[k * kLanes + j] = n0 + j < N ? W[(n0 + j) * K + k] : 0.f;
}
inline bool narrow16(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, src + i, sizeof bits);
    if (bits & 0xFFFFu) return false;
    dst[i] = static_cast<uint16_t>(bits >> 16);
  }
  return true;
}
inline void fence() {}
#endif

// One compact panel: the panel packed as floats into ``tmp`` (K x 16), then each float's high
// half. Returns false (the rest of the panel unwritten) at the first float with low bits set.
bool pack_panel16(const float* W, uint16_t* dst, float* tmp, int64_t N, int64_t K, int64_t n0) {
  pack_panel(W, tmp, N, K, n0, true);
  return narrow16(tmp, dst, K * kLanes);
}

// One int8 panel: the panel packed as floats into ``tmp`` (K x 16), then each value's integer q
// with fl(q x scale) equal to the value (bit for bit), |q| <= 127, and the 16 scales after the
// rows (0 past N). Returns false (the panel unfinished) at the first value with no such integer.
bool pack_panel8(const float* W, const float* scales, int8_t* dst, float* tmp, int64_t N, int64_t K, int64_t n0) {
  pack_panel(W, tmp, N, K, n0, true);
  float s[kLanes];
  for (int64_t j = 0; j < kLanes; ++j) s[j] = n0 + j < N ? scales[n0 + j] : 0.f;
  for (int64_t k = 0; k < K; ++k)
    for (int64_t j = 0; j < kLanes; ++j) {
      const float v = tmp[k * kLanes + j];
      const float q = s[j] != 0.f ? std::nearbyint(v / s[j]) : 0.f;
      if (!(std::fabs(q) <= 127.f)) return false;  // (also NaN)
      const float back = static_cast<float>(static_cast<int>(q)) * s[j];
      uint32_t a, c;
      std::memcpy(&a, &v, sizeof a);
      std::memcpy(&c, &back, sizeof c);
      if (a != c) return false;
      dst[k * kLanes + j] = static_cast<int8_t>(q);
    }
  std::memcpy(dst + K * kLanes, s, sizeof s);
  return true;
}

}  // namespace

extern "C" {

// Floats the packed copy of a [N, K] weight takes.
int64_t hr_linear_packed_size(int64_t N, int64_t K) { return (N + kLanes - 1) / kLanes * kLanes * K; }

// Pack W [N, K] (row-major) into P (hr_linear_packed_size floats).
void hr_linear_pack(const float* W, float* P, int64_t N, int64_t K) {
  at::parallel_for(0, (N + kLanes - 1) / kLanes, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p) pack_panel(W, P + p * K * kLanes, N, K, p * kLanes);
    fence();  // streaming stores are visible to other threads after this
  });
}

// Pack W [N, K] into compact panels P (hr_linear_packed_size values of 16 bits) when every value
// of W is a bfloat16 (see panels.h). Returns 0, or 1 when some value is not (then P
// holds nothing usable; the first row is looked at before anything else, so a dense fp32 weight
// is refused at once). With P null only that first row is tested (0: it is all bfloat16s). An
// empty weight (N or K 0: no first row to look at) is refused.
int64_t hr_linear_pack16(const float* W, uint16_t* P, int64_t N, int64_t K) {
  if (N <= 0 || K <= 0) return 1;
  for (int64_t k = 0; k < K; ++k) {
    uint32_t bits;
    std::memcpy(&bits, W + k, sizeof bits);
    if (bits & 0xFFFFu) return 1;
  }
  if (P == nullptr) return 0;
  std::atomic<bool> ok{true};
  at::parallel_for(0, (N + kLanes - 1) / kLanes, 16, [&](int64_t lo, int64_t hi) {
    std::vector<float> tmp(K * kLanes);
    for (int64_t p = lo; p < hi && ok.load(std::memory_order_relaxed); ++p)
      if (!pack_panel16(W, P + p * K * kLanes, tmp.data(), N, K, p * kLanes)) ok = false;
  });
  return ok ? 0 : 1;
}

// Bytes the int8 packed copy of a [N, K] weight takes (hr_linear_pack8).
int64_t hr_linear_packed_size8(int64_t N, int64_t K) { return (N + kLanes - 1) / kLanes * panel_stride<int8_t>(K); }

// Pack W [N, K] into int8 panels P (hr_linear_packed_size8 bytes) when every value of row n is
// fl(q x S[n]) for an integer |q| <= 127 (see panels.h; S: N floats). Returns 0, or 1
// when some value is not (then P holds nothing usable).
int64_t hr_linear_pack8(const float* W, const float* S, int8_t* P, int64_t N, int64_t K) {
  std::atomic<bool> ok{true};
  at::parallel_for(0, (N + kLanes - 1) / kLanes, 16, [&](int64_t lo, int64_t hi) {
    std::vector<float> tmp(K * kLanes);
    for (int64_t p = lo; p < hi && ok.load(std::memory_order_relaxed); ++p)
      if (!pack_panel8(W, S, P + p * panel_stride<int8_t>(K), tmp.data(), N, K, p * kLanes)) ok = false;
  });
  return ok ? 0 : 1;
}

}  // extern "C"
