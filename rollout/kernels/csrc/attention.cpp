// Attention for decoding blocks on the CPU: a few query tokens per row against the row's KV cache.
//
// out[b, t, h, :] = sum_l p[l] v[b, g, l, :],  p = softmax over the allowed keys l of
// scale * (q[b, h, t, :] . k[b, g, l, :]),  g = h / (Hq / Hkv) (grouped kv heads),
// the allowed keys being those with mask[b, t, l] != 0.
//
// Why: torch's CPU attention (its flash kernel, with a mask) costs 20-30 us a call at batch 1,
// about 230 us at batch 16 and 480 us for a verify block of 4 tokens over 16 rows on this
// project's 2-core CPU: 7 ms of a 55 ms batch-16 step. This loop costs 2-3x less.
//
// One work item is a (row, kv head); each of its queries (the group's heads x the block's
// tokens) runs alone: the dots with every key (4 keys at a time, D in lanes of 16, then across
// the lanes), the maximum over the allowed keys, exp of the differences (a degree-6 polynomial
// after range reduction, relative error below 2e-7) summed in lanes of 16 keys, and the sum of
// p v over keys in two interleaved chains (even and odd keys). Disallowed keys get p = 0 (their
// finite values are read and multiplied by 0). Every sum runs in an order fixed by the key
// index alone: a row's output does not depend on the other rows, on how far the cache is padded
// (the batch's longest row) or on the thread count: batch-invariant and deterministic. It
// differs from torch's attention by float32 rounding. Non-finite inputs give what torch's
// (CPU, 2.13) gives: a query with a NaN score (a NaN in it or in any key it reads, allowed or
// not) or a +inf one among its allowed keys gets NaN outputs; a NaN or infinite value reaches
// the sum (times 0 for a disallowed key: NaN); a query whose allowed scores are all -inf, or with
// no allowed key, gets zeros.

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>

namespace {

// exp(x) for x <= 0: 2^n P(r), r = x - n ln2 (ln2 in two parts), |r| <= ln2 / 2; ~1e-38 below -87.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// One query against keys [0, L): scores into s, softmax over the allowed keys, o = sum p v.
template <int C>  // C = D / 16 chunks
inline void one_query(const float* qv, const float* kb, const float* vb, int64_t ks_l, const uint8_t* allowed,
                      int64_t L, float scale, float* s, float* o) {
  __m512 q[C];
  for (int c = 0; c < C; ++c) q[c] = _mm512_mul_ps(_mm512_loadu_ps(qv + 16 * c), _mm512_set1_ps(scale));
  float top = -INFINITY;
  int64_t l = 0;
  for (; l + 4 <= L; l += 4) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const float* k0 = kb + l * ks_l;
    for (int c = 0; c < C; ++c) {
      a0 = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(k0 + 16 * c), a0);
      a1 = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(k0 + ks_l + 16 * c), a1);
      a2 = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(k0 + 2 * ks_l + 16 * c), a2);
      a3 = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(k0 + 3 * ks_l + 16 * c), a3);
    }
    s[l] = _mm512_reduce_add_ps(a0);
    s[l + 1] = _mm512_reduce_add_ps(a1);
    s[l + 2] = _mm512_reduce_add_ps(a2);
    s[l + 3] = _mm512_reduce_add_ps(a3);
  }
  for (; l < L; ++l) {
    __m512 a0 = _mm512_setzero_ps();
    for (int c = 0; c < C; ++c) a0 = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(kb + l * ks_l + 16 * c), a0);
    s[l] = _mm512_reduce_add_ps(a0);
  }
  bool nan = false;
  for (l = 0; l < L; ++l) {
    nan |= std::isnan(s[l]);  // (a disallowed key's too, as torch's masked scores)
    if (allowed[l] && s[l] > top) top = s[l];
  }
  if (nan || top == INFINITY) {  // as torch: a NaN score, or inf - inf in the softmax
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_set1_ps(NAN));
    return;
  }
  if (top == -INFINITY) {
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_setzero_ps());
    return;
  }
  __m512 sum = _mm512_setzero_ps();
  const __m512 vtop = _mm512_set1_ps(top);
  for (int64_t l0 = 0; l0 < L; l0 += 16) {
    const int64_t n = L - l0 < 16 ? L - l0 : 16;
    const __mmask16 in = static_cast<__mmask16>(n == 16 ? 0xFFFF : (1u << n) - 1u);
    const __m128i bytes = _mm_maskz_loadu_epi8(in, allowed + l0);
    const __mmask16 ok = _mm_mask_cmpneq_epi8_mask(in, bytes, _mm_setzero_si128());
    const __m512 e = _mm512_maskz_mov_ps(ok, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(in, s + l0), vtop)));
    _mm512_mask_storeu_ps(s + l0, in, e);  // disallowed keys: 0
    sum = _mm512_add_ps(sum, e);
  }
  __m512 acc[C], acc2[C];
  for (int c = 0; c < C; ++c) acc[c] = acc2[c] = _mm512_setzero_ps();
  for (l = 0; l + 2 <= L; l += 2) {
    const __m512 p0 = _mm512_set1_ps(s[l]), p1 = _mm512_set1_ps(s[l + 1]);
    const float* v0 = vb + l * ks_l;
    for (int c = 0; c < C; ++c) {
      acc[c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v0 + 16 * c), acc[c]);
      acc2[c] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(v0 + ks_l + 16 * c), acc2[c]);
    }
  }
  if (l < L) {
    const __m512 p0 = _mm512_set1_ps(s[l]);
    for (int c = 0; c < C; ++c) acc[c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(vb + l * ks_l + 16 * c), acc[c]);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
  for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(_mm512_add_ps(acc[c], acc2[c]), inv));
}

}  // namespace

extern "C" {

// q: [B, Hq, T, D] with strides (qs_b, qs_h, qs_t, 1); k, v: [B, Hkv, >= L, D] with strides
// (ks_b, ks_h, ks_l, 1) (one cache layout); mask: bytes [B, T, L] with strides (ms_b, ms_t, 1);
// out: [B, T, Hq, D] contiguous. D is 16, 32, 64 or 128 and Hq a multiple of Hkv, else it returns 1
// (nothing written); 0 when done.
int64_t hr_attend(const float* q, int64_t qs_b, int64_t qs_h, int64_t qs_t, const float* k, const float* v,
                  int64_t ks_b, int64_t ks_h, int64_t ks_l, const uint8_t* mask, int64_t ms_b, int64_t ms_t,
                  float* out, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t L, int64_t D, float scale) {
  if ((D != 16 && D != 32 && D != 64 && D != 128) || Hkv <= 0 || Hq % Hkv != 0 || L <= 0 || T <= 0) return 1;
  const int64_t G = Hq / Hkv;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> s(L + 16);
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t b = item / Hkv, g = item % Hkv;
      const float* kb = k + b * ks_b + g * ks_h;
      const float* vb = v + b * ks_b + g * ks_h;
      for (int64_t t = 0; t < T; ++t)
        for (int64_t j = 0; j < G; ++j) {
          const int64_t h = g * G + j;
          const float* qv = q + b * qs_b + h * qs_h + t * qs_t;
          float* o = out + ((b * T + t) * Hq + h) * D;
          const uint8_t* allowed = mask + b * ms_b + t * ms_t;
          switch (D) {
            case 16: one_query<1>(qv, kb, vb, ks_l, allowed, L, scale, s.data(), o); break;
            case 32: one_query<2>(qv, kb, vb, ks_l, allowed, L, scale, s.data(), o); break;
            case 64: one_query<4>(qv, kb, vb, ks_l, allowed, L, scale, s.data(), o); break;
            default: one_query<8>(qv, kb, vb, ks_l, allowed, L, scale, s.data(), o); break;
          }
        }
    }
  });
  return 0;
}
int64_t hr_attend_vectorised() { return 1; }

}  // extern "C"

#else  // no AVX-512: refused (the caller runs torch's attention)

extern "C" {
int64_t hr_attend(const float*, int64_t, int64_t, int64_t, const float*, const float*, int64_t, int64_t, int64_t,
                  const uint8_t*, int64_t, int64_t, float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                  float) {
  return 1;
}
int64_t hr_attend_vectorised() { return 0; }
}

#endif
