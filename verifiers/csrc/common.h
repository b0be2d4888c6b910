// The shared parts of the fused verifier (verifiers/README.md, "Kernel layout"): the Params a
// rule passes in, exp, one row's statistics (max, normaliser, top 2) and block sampling.
// Nothing here depends on the rule; rules.h holds what does.
//
// Every file of the kernel is compiled with -ffp-contract=off, so that an expression rounds the
// same in vector and scalar code (p - q is exactly 0 where p == q); the fused multiply-adds in
// exp_nonpos are explicit.

#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kBlock = 512;  // sampling blocks: block sums, then a scan inside one block
constexpr int kLanes = 16;       // lanes of the vectorised top-2 search
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kMaxArgs = 4;      // the most kernel arguments a rule may declare

// A rule as the kernel sees it, mirrored by verifiers/native.py: its kernel id (``kernel_id``
// in verifiers/rules.py) and its arguments (``kernel_args``, in that order; unused ones are 0).
struct Params {
  int64_t rule;
  double arg[kMaxArgs];
};

// e^x for x <= 0 (x = -inf gives 0; x < -87 flushes to 0; NaN gives 0, so callers check NaN
// separately). Branch-free so that loops over it vectorise: Cody-Waite reduction
// x = n ln2 + r, |r| <= ln2 / 2, and the degree-7 Taylor polynomial of e^r (truncation error
// below 1e-8 relative), scaled by 2^n through the exponent bits.
static inline float exp_nonpos(float x) {
  const float xc = x > -87.0f ? x : -87.0f;
  const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  float r = __builtin_fmaf(n, -0.693359375f, xc);
  r = __builtin_fmaf(n, 2.12194440e-4f, r);
  float poly = 1.0f / 5040.0f;
  poly = __builtin_fmaf(poly, r, 1.0f / 720.0f);
  poly = __builtin_fmaf(poly, r, 1.0f / 120.0f);
  poly = __builtin_fmaf(poly, r, 1.0f / 24.0f);
  poly = __builtin_fmaf(poly, r, 1.0f / 6.0f);
  poly = __builtin_fmaf(poly, r, 0.5f);
  poly = __builtin_fmaf(poly, r, 1.0f);
  poly = __builtin_fmaf(poly, r, 1.0f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  const float scale = __builtin_bit_cast(float, bits);
  return x >= -87.0f ? poly * scale : 0.0f;
}

struct RowView {  // one vocabulary row of logits and how to turn it into z = logits / T
  const float* data;
  int64_t n;
  float temperature;  // 1: z = logits
  inline float z(int64_t i) const { return temperature == 1.0f ? data[i] : data[i] / temperature; }
};

struct RowStats {
  float zmax = kNegInf;  // max z
  float inv_sum = 0;     // 1 / sum exp(z - zmax); p(v) = exp(z_v - zmax) * inv_sum
  float zsum_term = 0;   // typical: sum exp(z - zmax) (z - zmax)
  float z2 = kNegInf;    // MARS: second largest z
  int64_t v1 = 0, v2 = 0;
  bool bad = false;      // NaN, +inf, or all -inf
};

// First index i != skip with row[i] == value (raw logits), -1 if none.
static int64_t first_equal(const float* row, int64_t n, float value, int64_t skip) {
  constexpr int64_t kChunk = 64;
  for (int64_t start = 0; start < n; start += kChunk) {
    const int64_t end = start + kChunk < n ? start + kChunk : n;
    int hit = 0;
#pragma omp simd reduction(| : hit)
    for (int64_t i = start; i < end; ++i) hit |= (row[i] == value);
    if (hit)
      for (int64_t i = start; i < end; ++i)
        if (row[i] == value && i != skip) return i;
  }
  return -1;
}

// The max of the raw row, the NaN check and, with top2, the two largest values (with
// multiplicity) and their first indices (lowest index first on ties, like processing.top2).
static void row_max(const float* row, int64_t n, bool top2, RowStats& st, float& raw_max, float& raw_second) {
  int nan = 0;
  if (!top2) {
    float m = kNegInf;
#pragma omp simd reduction(max : m) reduction(| : nan)
    for (int64_t i = 0; i < n; ++i) {
      const float v = row[i];
      m = v > m ? v : m;
      nan |= (v != v);
    }
    raw_max = m;
    raw_second = kNegInf;
  } else {
    float a1[kLanes], a2[kLanes];
    for (int l = 0; l < kLanes; ++l) a1[l] = a2[l] = kNegInf;
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd reduction(| : nan)
      for (int l = 0; l < kLanes; ++l) {
        const float v = row[i + l];
        const float hi = v > a1[l] ? v : a1[l];
        const float lo = v > a1[l] ? a1[l] : v;
        a2[l] = lo > a2[l] ? lo : a2[l];
        a1[l] = hi;
        nan |= (v != v);
      }
    }
    float m1 = kNegInf, m2 = kNegInf;
    auto push = [&](float v) {
      if (v > m1) { m2 = m1; m1 = v; } else if (v > m2) { m2 = v; }
    };
    for (int l = 0; l < kLanes; ++l) { push(a1[l]); push(a2[l]); }
    for (; i < n; ++i) { nan |= (row[i] != row[i]); push(row[i]); }
    raw_max = m1;
    raw_second = m2;
  }
  st.bad = nan || !(std::isfinite(raw_max));
}

// The row max as z (st.zmax), with the raw top two values; false for a bad row (NaN, +inf,
// all -inf, or a finite logit that overflows once divided by T).
static bool row_top(const RowView& rv, bool top2, RowStats& st, float& raw_max, float& raw_second) {
  row_max(rv.data, rv.n, top2, st, raw_max, raw_second);
  if (st.bad) return false;
  const float zmax = rv.temperature == 1.0f ? raw_max : raw_max / rv.temperature;
  st.bad = !std::isfinite(zmax);
  if (st.bad) return false;
  st.zmax = zmax;
  return true;
}

// MARS's v1, v2 (first indices, lowest on ties) and z2 from row_top's raw top two values.
static void top2_tokens(const RowView& rv, float raw_max, float raw_second, RowStats& st) {
  st.v1 = first_equal(rv.data, rv.n, raw_max, -1);
  st.z2 = rv.temperature == 1.0f ? raw_second : raw_second / rv.temperature;
  st.v2 = first_equal(rv.data, rv.n, raw_second, st.v1);
  if (st.v2 < 0) st.v2 = st.v1;  // a one-token vocabulary
}

// Phase 1 for one row: max, normaliser (and the typical entropy term, MARS's top 2).
static RowStats row_stats(const RowView& rv, bool top2, bool entropy) {
  RowStats st;
  float raw_max, raw_second;
  if (!row_top(rv, top2, st, raw_max, raw_second)) return st;
  const float zmax = st.zmax;
  double s = 0, h = 0;  // float64 sums of float32 terms: a float32 lane of ~3000 terms lost up to 1e-4
  if (rv.temperature == 1.0f && !entropy) {
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < rv.n; ++i) s += exp_nonpos(rv.data[i] - zmax);
  } else {
    const float t = rv.temperature;
#pragma omp simd reduction(+ : s, h)
    for (int64_t i = 0; i < rv.n; ++i) {
      const float d = (t == 1.0f ? rv.data[i] : rv.data[i] / t) - zmax;
      const float e = exp_nonpos(d);
      s += e;
      h += e > 0 ? e * d : 0.0f;
    }
  }
  st.inv_sum = static_cast<float>(1.0 / s);
  st.zsum_term = static_cast<float>(h);
  if (top2) top2_tokens(rv, raw_max, raw_second, st);
  return st;
}

inline float prob(const RowView& rv, const RowStats& st, int64_t v) {
  return exp_nonpos(rv.z(v) - st.zmax) * st.inv_sum;
}

// sums[k] = the sum of weight(i) over block k (tokens [k kBlock, (k+1) kBlock) of V), in float64;
// ceil(V / kBlock) entries, as sample_blocks reads them. weight(i) >= 0.
template <class Weight>
void weight_block_sums(int64_t V, Weight weight, double* sums) {
  for (int64_t start = 0, blk = 0; start < V; start += kBlock, ++blk) {
    const int64_t end = start + kBlock < V ? start + kBlock : V;
    double s = 0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = start; i < end; ++i) s += static_cast<double>(weight(i));
    sums[blk] = s;
  }
}

// Sums of p over blocks of kBlock tokens (ceil(V / kBlock) entries), without the tokens in
// skip[0..nskip) (their p is subtracted from their block's sum).
static void p_block_sums(const RowView& rv, const RowStats& st, const int64_t* skip, int64_t nskip, double* sums) {
  const float zmax = st.zmax, inv = st.inv_sum, t = rv.temperature;
  const float* data = rv.data;  // locals: read through rv, the loads below are not vectorised contiguously
  weight_block_sums(rv.n, [=](int64_t i) { return exp_nonpos((t == 1.0f ? data[i] : data[i] / t) - zmax) * inv; },
                    sums);
  for (int64_t k = 0; k < nskip; ++k) {
    if (skip[k] < 0 || skip[k] >= rv.n) continue;
    double& s = sums[skip[k] / kBlock];
    s -= static_cast<double>(prob(rv, st, skip[k]));
    s = s > 0 ? s : 0.0;
  }
}

// Inverse CDF over weights given as block sums (sums[k] over tokens [k kBlock, (k+1) kBlock))
// and a per-token weight(i): the first token whose cumulative weight exceeds u * total (the
// goal kept below the total). Writes weight(y) / total to r_y.
template <class Weight>
int64_t sample_blocks(const double* sums, int64_t nblocks, int64_t V, Weight weight, double u, double& r_y) {
  double total = 0;
  for (int64_t k = 0; k < nblocks; ++k) total += sums[k];
  double goal = u * total;
  if (goal >= total) goal = std::nextafter(total, 0.0);
  double before = 0;
  int64_t blk = 0;
  for (; blk < nblocks - 1; ++blk) {
    if (before + sums[blk] > goal && sums[blk] > 0) break;
    before += sums[blk];
  }
  // rounding left no mass above the goal: the last positive weight of the last block with mass
  bool last = false;
  while (sums[blk] <= 0 && blk > 0) {
    --blk;
    last = true;
  }
  const int64_t start = blk * kBlock, end = start + kBlock < V ? start + kBlock : V;
  double cum = before;
  int64_t last_positive = -1;
  for (int64_t i = start; i < end; ++i) {
    const float w = weight(i);
    if (w <= 0) continue;
    last_positive = i;
    cum += w;
    if (cum > goal && !last) {
      r_y = static_cast<double>(w) / total;
      return i;
    }
  }
  if (last_positive < 0) return -1;  // no positive weight at all: the caller reports an internal error
  r_y = static_cast<double>(weight(last_positive)) / total;
  return last_positive;  // the block's own sum rounded above the scan's: its last positive weight
}

}  // namespace
