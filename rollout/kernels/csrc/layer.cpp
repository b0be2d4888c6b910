// One Llama-style decoder layer of a decoding forward on the CPU, in one call from Python.
//
// Why: at batch 1 a forward of SmolLM2-135M spends about 15 ms of its ~40 ms outside the linear
// kernel on the Intel Xeon this was measured on (about 40 torch ops and the Python between them
// per layer: the rotary embedding, the cache write, the residual adds, the activation, and the
// calls into the kernels). This file runs a layer's whole sequence from C++, with the same
// arithmetic in the same order as ``rollout.kernels.fused_layers``' Python forwards (the same bits):
//
//   x = rms_norm(h, w_in)                     hr_rms_norm (csrc/norm.cpp)
//   qkv = x [Wq; Wk; Wv]^T                    hr_linear / hr_linear16 (csrc/linear.cpp), hr_linear_amx
//   q, k = rotate(q), rotate(k)               x * cos + swap_halves(x) * sin', sin' = sin with
//                                             its first half negated (two products, one sum)
//   cache[b, g, slot[b, t]] = k, v            the block's keys and values at each row's slots
//   a = attention(q, cache, mask)             hr_attend (csrc/attention.cpp)
//   h = h + a Wo^T
//   x = rms_norm(h, w_post)
//   g, u = x [Wg; Wu]^T
//   h = h + (silu(g) * u) Wd^T                silu: ATen's own kernel (at::silu_out on the same
//                                             strided view the Python forward hands it)
//
// With -ffp-contract=off (verifiers/cbuild.py) each product and sum rounds as torch's
// elementwise ops do, so the layer's output equals the Python forward's bit for bit (the tests
// compare them with torch.equal).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_softmax.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/silu.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

extern "C" {
int64_t hr_linear(const float* P, const float* b, const float* X, float* Y, int64_t N, int64_t K, int64_t M);
int64_t hr_linear16(const uint16_t* P, const float* b, const float* X, float* Y, int64_t N, int64_t K, int64_t M);
int64_t hr_linear8(const int8_t* P, const float* b, const float* X, float* Y, int64_t N, int64_t K, int64_t M);
int64_t hr_linear_amx(const uint16_t* P, const float* b, const float* X, float* Y, int64_t N, int64_t K, int64_t M);
int64_t hr_attend(const float* q, int64_t qs_b, int64_t qs_h, int64_t qs_t, const float* k, const float* v,
                  int64_t ks_b, int64_t ks_h, int64_t ks_l, const uint8_t* mask, int64_t ms_b, int64_t ms_t,
                  float* out, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t L, int64_t D, float scale);
void hr_rms_norm(const float* x, const float* w, float* out, int64_t M, int64_t N, float eps);
}

namespace {

// A linear layer without bias from its packed panels: ``bit`` of ``compact`` set: bf16 panels
// (hr_linear_pack16); ``bit << 8`` set: int8 panels (hr_linear_pack8); ``bit << 16`` set: AMX
// tiles of bf16 values (hr_linear_pack_amx, csrc/amx.cpp); none: fp32 panels.
int64_t linear(const void* P, int64_t compact, int64_t bit, const float* X, float* Y, int64_t N, int64_t K,
               int64_t M) {
  if (compact & (bit << 16)) return hr_linear_amx(static_cast<const uint16_t*>(P), nullptr, X, Y, N, K, M);
  if (compact & (bit << 8)) return hr_linear8(static_cast<const int8_t*>(P), nullptr, X, Y, N, K, M);
  return compact & bit ? hr_linear16(static_cast<const uint16_t*>(P), nullptr, X, Y, N, K, M)
                       : hr_linear(static_cast<const float*>(P), nullptr, X, Y, N, K, M);
}

// Rows [lo, hi) in parallel when there are many (a prefill chunk), else on this thread.
template <typename F>
void rows(int64_t R, int64_t grain, const F& f) {
  if (R <= grain) {
    f(0, R);
    return;
  }
  at::parallel_for(0, R, grain, f);
}

// The layer after its input norm: x [R, K] (the normed input; may be scratch's first buffer
// when K == H), res [R, H] the residual input, h [R, H] the output (may be res). See
// hr_decoder_layer for the other arguments.
int64_t layer_body(const float* xin, int64_t K, const float* res, float* h, int64_t B, int64_t T, int64_t H,
                   const float* w_post, float eps, const void* p_qkv, const void* p_o, const void* p_gu,
                   const void* p_down, int64_t compact, int64_t Hq, int64_t Hkv, int64_t D, int64_t I,
                   const float* cos, const float* sin, float* kc, float* vc, int64_t ks_b, int64_t ks_h,
                   int64_t ks_l, const int64_t* slots, const uint8_t* mask, int64_t ms_b, int64_t ms_t, int64_t L,
                   float scale, float* scratch) {
  const int64_t R = B * T, nqk = (Hq + Hkv) * D, nqkv = nqk + Hkv * D, half = D / 2;
  float* x = scratch;            // [R, H]: the o and down outputs, the post-attention norm's output
  float* qkv = x + R * H;        // [R, nqkv]
  float* qk = qkv + R * nqkv;    // [R, nqk]: q and k rotated
  float* att = qk + R * nqk;     // [R, Hq D]
  float* gu = att + R * Hq * D;  // [R, 2I]
  float* act = gu + R * 2 * I;   // [R, I]: silu(g), then silu(g) * u
  int64_t status;

  if ((status = linear(p_qkv, compact, 1, xin, qkv, nqkv, K, R)) != 0) return status;
  rows(R, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const float* c = cos + r * D;
      const float* s = sin + r * D;
      for (int64_t j = 0; j < Hq + Hkv; ++j) {
        const float* src = qkv + r * nqkv + j * D;
        float* dst = qk + r * nqk + j * D;
        for (int64_t i = 0; i < half; ++i) dst[i] = src[i] * c[i] + src[i + half] * (-s[i]);
        for (int64_t i = half; i < D; ++i) dst[i] = src[i] * c[i] + src[i - half] * s[i];
      }
      const int64_t b = r / T, slot = slots[r];
      for (int64_t g = 0; g < Hkv; ++g) {
        std::memcpy(kc + b * ks_b + g * ks_h + slot * ks_l, qk + r * nqk + (Hq + g) * D, D * sizeof(float));
        std::memcpy(vc + b * ks_b + g * ks_h + slot * ks_l, qkv + r * nqkv + nqk + g * D, D * sizeof(float));
      }
    }
  });
  if ((status = hr_attend(qk, T * nqk, D, nqk, kc, vc, ks_b, ks_h, ks_l, mask, ms_b, ms_t, att, B, T, Hq, Hkv, L,
                          D, scale)) != 0)
    return status;
  if ((status = linear(p_o, compact, 2, att, x, H, Hq * D, R)) != 0) return status;
  rows(R, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo * H; i < hi * H; ++i) h[i] = res[i] + x[i];
  });

  hr_rms_norm(h, w_post, x, R, H, eps);
  if ((status = linear(p_gu, compact, 4, x, gu, 2 * I, H, R)) != 0) return status;
  {  // silu over the gate half ([R, I] with row stride 2I), as F.silu(gate_up[..., :I]) runs it
    const at::Tensor gate = at::from_blob(gu, {R, I}, {2 * I, 1}, at::TensorOptions().dtype(at::kFloat));
    at::Tensor out = at::from_blob(act, {R, I}, at::TensorOptions().dtype(at::kFloat));
    at::silu_out(out, gate);
  }
  rows(R, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r)
      for (int64_t i = 0; i < I; ++i) act[r * I + i] = act[r * I + i] * gu[r * 2 * I + I + i];
  });
  if ((status = linear(p_down, compact, 8, act, x, H, I, R)) != 0) return status;
  rows(R, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo * H; i < hi * H; ++i) h[i] = h[i] + x[i];
  });
  return 0;
}

}  // namespace

extern "C" {

// h [R, H] (R = B x T rows, row-major) is updated in place to the layer's output.
// panels: q/k/v side by side, o, gate/up side by side, down; bit i of ``compact`` set: panel i
// holds bf16 values (hr_linear_pack16); bit 8 + i: int8 values and scales (hr_linear_pack8); bit
// 16 + i: AMX tiles of bf16 values (hr_linear_pack_amx).
// cos, sin: [R, D] (the rotary tables of each row's position). kc, vc: this layer's key and value cache of the B rows, [B, Hkv, >= L, D] with
// strides (ks_b, ks_h, ks_l, 1); slots [R]: the slot each row's token is written to. mask:
// bytes [B, T, L] with strides (ms_b, ms_t, 1). scratch: at least
// hr_decoder_layer_scratch(R, H, Hq, Hkv, D, I) floats. Returns 0, or the status of the first
// kernel that refused (nothing after it ran: the caller must not use h then).
int64_t hr_decoder_layer(float* h, int64_t B, int64_t T, int64_t H, const float* w_in, const float* w_post,
                         float eps, const void* p_qkv, const void* p_o, const void* p_gu, const void* p_down,
                         int64_t compact, int64_t Hq, int64_t Hkv, int64_t D, int64_t I, const float* cos,
                         const float* sin, float* kc, float* vc, int64_t ks_b, int64_t ks_h, int64_t ks_l,
                         const int64_t* slots, const uint8_t* mask, int64_t ms_b, int64_t ms_t, int64_t L,
                         float scale, float* scratch) {
  hr_rms_norm(h, w_in, scratch, B * T, H, eps);
  return layer_body(scratch, H, h, h, B, T, H, w_post, eps, p_qkv, p_o, p_gu, p_down, compact, Hq, Hkv, D, I, cos,
                    sin, kc, vc, ks_b, ks_h, ks_l, slots, mask, ms_b, ms_t, L, scale, scratch);
}

// Floats of scratch hr_decoder_layer needs.
int64_t hr_decoder_layer_scratch(int64_t R, int64_t H, int64_t Hq, int64_t Hkv, int64_t D, int64_t I) {
  return R * (H + (Hq + 2 * Hkv) * D + (Hq + Hkv) * D + Hq * D + 3 * I);
}

// Every layer of a forward, each as hr_decoder_layer runs it, from one call: at batch 1 the Python
// loop around 30 layer calls (the tensor views of each layer's cache, 31 converted arguments a
// call) cost about 0.6 ms of a 15-20 ms SmolLM2-135M forward. Layer i takes its weights and cache
// from row i of ``layers`` [n, kStackArgs] (int64: w_in, w_post, p_qkv, p_o, p_gu, p_down,
// compact, kc, vc, keep), the sizes and scales the layers share from the other arguments. keep:
// -1, or j >= 0 to copy the layer's input h into kept + j R H first (the EAGLE-3 features). The
// same bits as the layer calls one by one. Returns 0, or the status of the first refusal.
int64_t hr_decoder_stack(float* h, int64_t B, int64_t T, int64_t H, int64_t n, const int64_t* layers, float eps,
                         int64_t Hq, int64_t Hkv, int64_t D, int64_t I, const float* cos, const float* sin,
                         int64_t ks_b, int64_t ks_h, int64_t ks_l, const int64_t* slots, const uint8_t* mask,
                         int64_t ms_b, int64_t ms_t, int64_t L, float scale, float* kept, float* scratch) {
  constexpr int64_t kStackArgs = 10;
  const int64_t R = B * T;
  auto ptr = [](int64_t v) { return reinterpret_cast<const void*>(v); };
  for (int64_t i = 0; i < n; ++i) {
    const int64_t* a = layers + i * kStackArgs;
    if (a[9] >= 0) std::memcpy(kept + a[9] * R * H, h, R * H * sizeof(float));
    const int64_t status = hr_decoder_layer(
        h, B, T, H, static_cast<const float*>(ptr(a[0])), static_cast<const float*>(ptr(a[1])), eps, ptr(a[2]),
        ptr(a[3]), ptr(a[4]), ptr(a[5]), a[6], Hq, Hkv, D, I, cos, sin, reinterpret_cast<float*>(a[7]),
        reinterpret_cast<float*>(a[8]), ks_b, ks_h, ks_l, slots, mask, ms_b, ms_t, L, scale, scratch);
    if (status != 0) return status;
  }
  return 0;
}

// One speculative step of the EAGLE-3 head's layer (rollout.eagle3_head.DraftLayer) and, when
// p_lm is given, its logits, with the arithmetic of the head's forward inside
// native_linear.routed (rollout.kernels.fused_layers' draft attention and MLP):
//
//   x = [rms_norm(emb, w_in), rms_norm(hid, w_hid)]      [R, 2H]
//   h = hid + attention(x) Wo^T                           q/k/v, rotation, cache write, hr_attend
//   h = h + mlp(rms_norm(h, w_post))                      as hr_decoder_layer
//   logits = (rms_norm(h, w_norm) Wlm^T) * logit_scale    (only when p_lm; bit 4 of compact: bf16, 12: int8, 20: AMX)
//
// emb, hid: [R, H] (the step's token embeddings and input hidden states); out: [R, H]; logits:
// [R, V]. The keys and values go to the draft cache at ``slots`` (scratch slots past every
// row's committed length: the caller's mask says which slots each query sees). scratch: at
// least hr_draft_layer_scratch(R, H, Hq, Hkv, D, I) floats.
int64_t hr_draft_layer(const float* emb, const float* hid, float* out, int64_t B, int64_t T, int64_t H,
                       const float* w_in, const float* w_hid, const float* w_post, float eps, const void* p_qkv,
                       const void* p_o, const void* p_gu, const void* p_down, int64_t compact, int64_t Hq,
                       int64_t Hkv, int64_t D, int64_t I, const float* cos, const float* sin, float* kc, float* vc,
                       int64_t ks_b, int64_t ks_h, int64_t ks_l, const int64_t* slots, const uint8_t* mask,
                       int64_t ms_b, int64_t ms_t, int64_t L, float scale, const float* w_norm, const void* p_lm,
                       int64_t V, float logit_scale, float* logits, float* scratch) {
  const int64_t R = B * T;
  float* xin = scratch + hr_decoder_layer_scratch(R, H, Hq, Hkv, D, I);  // [R, 2H]
  for (int64_t r = 0; r < R; ++r) {
    hr_rms_norm(emb + r * H, w_in, xin + r * 2 * H, 1, H, eps);
    hr_rms_norm(hid + r * H, w_hid, xin + r * 2 * H + H, 1, H, eps);
  }
  int64_t status = layer_body(xin, 2 * H, hid, out, B, T, H, w_post, eps, p_qkv, p_o, p_gu, p_down, compact, Hq,
                              Hkv, D, I, cos, sin, kc, vc, ks_b, ks_h, ks_l, slots, mask, ms_b, ms_t, L, scale,
                              scratch);
  if (status != 0 || p_lm == nullptr) return status;
  hr_rms_norm(out, w_norm, xin, R, H, eps);
  if ((status = linear(p_lm, compact, 16, xin, logits, V, H, R)) != 0) return status;
  if (logit_scale != 1.0f)
    for (int64_t i = 0; i < R * V; ++i) logits[i] = logits[i] * logit_scale;
  return 0;
}

// Floats of scratch hr_draft_layer needs.
int64_t hr_draft_layer_scratch(int64_t R, int64_t H, int64_t Hq, int64_t Hkv, int64_t D, int64_t I) {
  return hr_decoder_layer_scratch(R, H, Hq, Hkv, D, I) + R * 2 * H;
}

// The index torch.argmax gives over a float row: the first maximum, or the first NaN.
static int64_t first_argmax(const float* row, int64_t n) {
  int64_t pick = 0;
  float best = row[0];
  if (std::isnan(best)) return 0;
  for (int64_t i = 1; i < n; ++i) {
    if (std::isnan(row[i])) return i;
    if (row[i] > best) {
      best = row[i];
      pick = i;
    }
  }
  return pick;
}

// The id sample_draft's inversion picks from q [V] with the uniform u: the first whose float64
// running sum exceeds u times the total (kept below the total).
static int64_t inverse_cdf_pick(const float* q, int64_t V, double u) {
  double total = 0.0;
  for (int64_t i = 0; i < V; ++i) total += static_cast<double>(q[i]);
  const double target = std::fmin(u * total, std::nextafter(total, 0.0));
  double run = 0.0;
  for (int64_t i = 0; i < V; ++i) {
    run += static_cast<double>(q[i]);
    if (run > target) return i;
  }
  return V - 1;
}

// A chain of k sampled (or greedy) drafts after the root (rollout.engine.engine's _draft_chain with the steps of
// rollout.kernels.native_draft), from one call: at batch 1 the ~40 torch ops and the Python around each
// draft step (the mask, positions, embedding, the sampling) had cost about as much as the step's
// own C++ layer call. Step s (0-based) draws draft s from the logits ``logits[:, s]`` as
// rollout.engine.draft_sampling.sample_draft does (z = logits / T in float32, q = ATen's softmax of z, the
// first id whose float64 running sum of q exceeds u[s, b] times the row's total, the target kept
// below the total), then, unless s = k - 1, maps it to its target id (``draft_ids``), takes that id's
// row of ``emb_table`` [Vt, H] and runs hr_draft_layer on it and ``hidden`` [B, H] (written back
// with the step's output hidden) at cache slot slot0 + s with the mask row ``mask[b, :slot0 + s
// + 1]`` (bytes, row stride ms_b) and the rotary rows ``cos/sin[s]`` ([k - 1, B, D]); its
// logits go to ``logits[:, s + 1]``. The same bits as the Python loop (tests). logits: [B, k, V],
// ``logits[:, 0]`` the root's on entry; ids: [B, k] draft ids out; u: [k, B]. temperature <= 0:
// a greedy chain, each draft the argmax of its logits as torch.argmax picks it (the first
// maximum; the first NaN where there is one), ``u`` unread (may be null). scratch: at least
// hr_draft_chain_scratch(B, H, Hq, Hkv, D, I, V) floats. Returns 0, or the first refusal's status.
int64_t hr_draft_chain(const float* emb_table, const int64_t* draft_ids, float* hidden, float* logits, int64_t* ids,
                       const double* u, float temperature, int64_t B, int64_t k, int64_t H, const float* w_in,
                       const float* w_hid, const float* w_post, float eps, const void* p_qkv, const void* p_o,
                       const void* p_gu, const void* p_down, int64_t compact, int64_t Hq, int64_t Hkv, int64_t D,
                       int64_t I, const float* cos, const float* sin, float* kc, float* vc, int64_t ks_b,
                       int64_t ks_h, int64_t ks_l, const uint8_t* mask, int64_t ms_b, int64_t slot0, float scale,
                       const float* w_norm, const void* p_lm, int64_t V, float logit_scale, float* scratch) {
  float* z = scratch;          // [B, V]: the step's processed logits
  float* q = z + B * V;        // [B, V]: their softmax
  float* emb = q + B * V;      // [B, H]
  float* step = emb + B * H;   // [B, V]: the step's logits
  float* layer = step + B * V;
  std::vector<int64_t> slots(B);
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor zt = at::from_blob(z, {B, V}, f32), qt = at::from_blob(q, {B, V}, f32);
  const bool greedy = !(temperature > 0.0f);
  for (int64_t s = 0; s < k; ++s) {
    if (greedy) {
      for (int64_t b = 0; b < B; ++b) ids[b * k + s] = first_argmax(logits + (b * k + s) * V, V);
    } else {
      for (int64_t b = 0; b < B; ++b) {
        const float* row = logits + (b * k + s) * V;
        float* zr = z + b * V;
        if (temperature != 1.0f)
          for (int64_t i = 0; i < V; ++i) zr[i] = row[i] / temperature;
        else
          std::memcpy(zr, row, V * sizeof(float));
      }
      at::_softmax_out(qt, zt, 1, false);
      for (int64_t b = 0; b < B; ++b) ids[b * k + s] = inverse_cdf_pick(q + b * V, V, u[s * B + b]);
    }
    if (s == k - 1) break;
    for (int64_t b = 0; b < B; ++b) {
      std::memcpy(emb + b * H, emb_table + draft_ids[ids[b * k + s]] * H, H * sizeof(float));
      slots[b] = slot0 + s;
    }
    const int64_t status = hr_draft_layer(  // hidden in place (the layer's output may be its residual input)
        emb, hidden, hidden, B, 1, H, w_in, w_hid, w_post, eps, p_qkv, p_o, p_gu, p_down, compact, Hq, Hkv, D, I,
        cos + s * B * D, sin + s * B * D, kc, vc, ks_b, ks_h, ks_l, slots.data(), mask, ms_b, 0, slot0 + s + 1,
        scale, w_norm, p_lm, V, logit_scale, step, layer);
    if (status != 0) return status;
    for (int64_t b = 0; b < B; ++b) std::memcpy(logits + (b * k + s + 1) * V, step + b * V, V * sizeof(float));
  }
  return 0;
}

// Floats of scratch hr_draft_chain needs.
int64_t hr_draft_chain_scratch(int64_t B, int64_t H, int64_t Hq, int64_t Hkv, int64_t D, int64_t I, int64_t V) {
  return 3 * B * V + B * H + hr_draft_layer_scratch(B, H, Hq, Hkv, D, I);
}

}  // extern "C"
