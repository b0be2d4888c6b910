// The packed panels of a linear layer's weight W (nn.Linear's [N, K]): the layout that the
// packers (pack.cpp) write and the kernel (linear.cpp) streams.
//
// Layout: panel p holds output columns [16p, 16p + 16) as K rows of 16 floats ([P][K][16],
// zero-padded past N), so one panel is one sequential stream.
//
// Compact panels: a weight whose every value is a bfloat16 (the low 16 bits of each float are
// zero: an EAGLE-3 head trained and stored in bf16, upcast on load) can be packed as the high
// halves only (hr_linear_pack16), half the bytes to stream. The kernel widens each value back
// to the same float (a shift, exact) before the same FMAs in the same order, so the outputs
// are the bits of the fp32 panels. The pack refuses (returns 1) a weight with any other value.
//
// Int8 panels: a weight whose row n is s[n] times integers in [-127, 127] (every value the float
// product fl(q s[n]): ``rollout.kernels.quantize`` makes the EAGLE-3 head so on request) can be packed as
// the integers, a quarter of the bytes, with the panel's 16 scales after its K rows (panel stride
// K x 16 + 64 bytes). The kernel widens each integer to a float and multiplies it by its column's
// scale, the product the weight holds, before the same FMAs: again the bits of the fp32 panels.
// The pack (hr_linear_pack8) checks every value against that product and refuses any other.

#pragma once

#include <cstdint>
#include <type_traits>

namespace {

constexpr int64_t kLanes = 16;

// Int8 panels: their 16 scales (floats) follow a panel's K rows of 16 bytes.
constexpr int64_t kScaleBytes = kLanes * sizeof(float);
template <typename W>
constexpr bool kInt8 = std::is_same_v<W, int8_t>;
// Elements of W from one panel's start to the next.
template <typename W>
inline int64_t panel_stride(int64_t K) {
  return K * kLanes + (kInt8<W> ? kScaleBytes : 0);
}
// The 16 scales of the panel at w (int8 panels only).
inline const float* panel_scales(const int8_t* w, int64_t K) {
  return reinterpret_cast<const float*>(w + K * kLanes);
}

}  // namespace
