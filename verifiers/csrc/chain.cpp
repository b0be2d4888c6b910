// Fused chain verification with sampled drafts on the CPU (the same procedure as
// verifiers/chain.py, whose docstring is the contract; VERIFICATION.md has the math).
//
// Why: over a vocabulary row the verification is a few passes of vector math, but in eager
// PyTorch it costs 100-200 separate ops, each with its own dispatch and temporaries. Here it is
// three phases with no temporaries of vocabulary size:
//   1. one pass per target / draft row (all rows in parallel): max (and MARS's top 2, NaN check),
//      then sum exp(z - max) (and, for typical, the entropy term);
//   2. per batch row, serially and cheaply: p(x_j), q(x_j), the rule's context and accept
//      probabilities, the accepted prefix;
//   3. in parallel over the rows that need them: the rule's row statistics at positions
//      j <= min(n_acc, K - 1), and block sums of the final token's sampling weights;
//   then per batch row the inverse-CDF search and the behaviour log-probs (closed form at y).
// A row's reduction always runs on one thread, so results do not depend on the thread count.
//
// Inputs are float32 logits (raw, divided by temperature here, or already processed with
// temperature 1); randomness comes in as the uniforms drawn by the caller.

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kBlock = 512;  // sampling blocks: block sums, then a scan inside one block
constexpr int kLanes = 16;       // lanes of the vectorised top-2 search
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

enum RuleId : int64_t { kLossless = 0, kMars = 1, kOvershoot = 2, kTypical = 3, kMinP = 4, kCos = 5 };

struct Params {  // mirrored by verifiers/native.py
  int64_t rule;
  double theta;     // mars
  double lenience;  // overshoot
  double min_p;     // overshoot gate, <= 0 when absent
  double epsilon, delta;  // typical
  double p_base;    // min_p
  double lam;       // cos
};

// e^x for x <= 0 (x = -inf gives 0; x < -87 flushes to 0; NaN gives 0, so callers check NaN
// separately). The file is compiled with -ffp-contract=off, so that every other expression
// rounds the same in vector and scalar code (p - q is exactly 0 where p == q); the fused
// multiply-adds here are explicit. Branch-free so that loops over it vectorise: Cody-Waite reduction
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
  float s = 0, h = 0;
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
  st.inv_sum = 1.0f / s;
  st.zsum_term = h;
  if (top2) top2_tokens(rv, raw_max, raw_second, st);
  return st;
}

// The rule's context at one target row (rules.py ``context``): MARS's relax flag, or the
// threshold of the set A = {p >= thr} (min-p, typical, overshoot's gate; 0 otherwise).
static void rule_context(const Params& prm, const RowStats& st, bool& relax, float& thr) {
  relax = false;
  thr = 0;
  switch (prm.rule) {
    case kMars:
      relax = st.zmax > 0 && st.z2 / st.zmax > static_cast<float>(prm.theta);
      break;
    case kOvershoot:
      thr = prm.min_p > 0 ? static_cast<float>(prm.min_p) * st.inv_sum : 0.0f;
      break;
    case kMinP:
      thr = static_cast<float>(prm.p_base) * st.inv_sum;
      break;
    case kTypical: {
      const float entropy = -std::log(st.inv_sum) - st.zsum_term * st.inv_sum;
      const float th = static_cast<float>(prm.delta) * std::exp(-entropy);
      thr = th < static_cast<float>(prm.epsilon) ? th : static_cast<float>(prm.epsilon);
      break;
    }
    default:
      break;
  }
}

inline float prob(const RowView& rv, const RowStats& st, int64_t v) {
  return exp_nonpos(rv.z(v) - st.zmax) * st.inv_sum;
}

// Sums of p over blocks of kBlock tokens (ceil(V / kBlock) entries), without the tokens in
// skip[0..nskip) (their p is subtracted from their block's sum).
static void p_block_sums(const RowView& rv, const RowStats& st, const int64_t* skip, int64_t nskip, double* sums) {
  const float zmax = st.zmax, inv = st.inv_sum, t = rv.temperature;
  const float* data = rv.data;  // locals: read through rv, the loads below are not vectorised contiguously
  const int64_t n = rv.n;
  for (int64_t start = 0, blk = 0; start < n; start += kBlock, ++blk) {
    const int64_t end = start + kBlock < n ? start + kBlock : n;
    double s = 0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = start; i < end; ++i) {
      const float z = t == 1.0f ? data[i] : data[i] / t;
      s += static_cast<double>(exp_nonpos(z - zmax) * inv);
    }
    for (int64_t k = 0; k < nskip; ++k)
      if (skip[k] >= start && skip[k] < end) s -= static_cast<double>(prob(rv, st, skip[k]));
    sums[blk] = s > 0 ? s : 0.0;
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

struct Position {  // what phase 2 works out at one drafted position of one row
  float p_x = 0, q_x = 0, a = 0;
  bool relax = false;  // MARS
  float thr = 0;       // min-p / typical / overshoot gate: the set A = {p >= thr}
  float q12 = 0;       // MARS: q(v1) + q(v2)
  float rejected = 0, tv = 0, feed = 0;  // row statistics (phase 3)
};

struct Kernel {
  const float* target;  // [B, K+1, V]
  const float* draft;   // [B, K, V]
  const int64_t* x;     // [B, K]
  const float* u_accept;  // [B, K]
  const float* u_final;   // [B]
  int64_t B, K, V;
  float temperature;
  Params prm;

  RowView trow(int64_t b, int64_t j) const { return {target + (b * (K + 1) + j) * V, V, temperature}; }
  RowView drow(int64_t b, int64_t j) const { return {draft + (b * K + j) * V, V, temperature}; }

  float accept(const Position& pos, int64_t x_j, const RowStats& ts) const {
    const float ratio = pos.p_x / pos.q_x;
    const float lossless = ratio > 1.0f ? 1.0f : ratio;  // min(ratio, 1), NaN kept (never accepted)
    switch (prm.rule) {
      case kMars:
        return pos.relax ? ((x_j == ts.v1 || x_j == ts.v2) ? 1.0f : 0.0f) : lossless;
      case kOvershoot: {
        if (prm.min_p > 0 && pos.p_x >= pos.thr) return 1.0f;
        const float a = pos.p_x / (static_cast<float>(prm.lenience) * pos.q_x);
        return a > 1.0f ? 1.0f : a;
      }
      case kTypical:
      case kMinP:
        return pos.p_x >= pos.thr ? 1.0f : 0.0f;
      case kCos: {
        const float lam = static_cast<float>(prm.lam);
        const float a = lam * ratio + (1.0f - lam);
        return a > 1.0f ? 1.0f : a;
      }
      default:
        return lossless;
    }
  }

  bool exact(const Position& pos) const {  // P == p at this position
    return prm.rule == kLossless || (prm.rule == kMars && !pos.relax) || (prm.rule == kCos && prm.lam == 1.0);
  }

  bool full_row_stats() const { return prm.rule == kOvershoot || prm.rule == kTypical || prm.rule == kMinP; }

  // Phase 3, statistics: overshoot's rejected mass and TV, the truncation rules' feed term.
  void stats(int64_t b, int64_t j, const RowStats& ts, const RowStats& qs, Position& pos) const {
    const RowView tr = trow(b, j), dr = drow(b, j);
    const float tm = ts.zmax, ti = ts.inv_sum, qm = qs.zmax, qi = qs.inv_sum, thr = pos.thr;
    const float t = temperature;
    float s1 = 0, s2 = 0;
    if (prm.rule == kOvershoot) {
      const float inv_l = static_cast<float>(1.0 / prm.lenience);
      const bool gate = prm.min_p > 0;
#pragma omp simd reduction(+ : s1, s2)
      for (int64_t i = 0; i < V; ++i) {
        const float zt = t == 1.0f ? tr.data[i] : tr.data[i] / t;
        const float zq = t == 1.0f ? dr.data[i] : dr.data[i] / t;
        const float p = exp_nonpos(zt - tm) * ti, q = exp_nonpos(zq - qm) * qi;
        const float over = q - p * inv_l;
        s1 += (over > 0 && !(gate && p >= thr)) ? over : 0.0f;
        s2 += p > q ? p - q : 0.0f;
      }
      pos.rejected = s1;
      pos.tv = s2;
    } else {  // typical, min_p: sum over p < thr of q / (1 - p)
#pragma omp simd reduction(+ : s1)
      for (int64_t i = 0; i < V; ++i) {
        const float zt = t == 1.0f ? tr.data[i] : tr.data[i] / t;
        const float zq = t == 1.0f ? dr.data[i] : dr.data[i] / t;
        const float p = exp_nonpos(zt - tm) * ti, q = exp_nonpos(zq - qm) * qi;
        const float denom = 1.0f - p > 1e-30f ? 1.0f - p : 1e-30f;
        s1 += p < thr ? q / denom : 0.0f;
      }
      pos.feed = s1;
    }
  }

  // The final token's sampling weights at position n of row b: p (bonus, MARS relaxed, or a
  // residual with no mass), p without x_n (truncation rules), else (p - q)+.
  enum WeightKind { kP = 0, kPWithout = 1, kResidual = 2 };

  // Sums of the weights over blocks of kBlock tokens (block_sums has ceil(V / kBlock) entries).
  void block_sums(int64_t b, int64_t n, int kind, const RowStats& ts, const RowStats* qs, double* sums) const {
    const RowView tr = trow(b, n);
    if (kind != kResidual) {
      p_block_sums(tr, ts, &x[b * K + n], kind == kPWithout ? 1 : 0, sums);
      return;
    }
    const float tm = ts.zmax, ti = ts.inv_sum, t = temperature, qm = qs->zmax, qi = qs->inv_sum;
    const float* dd = drow(b, n).data;
    for (int64_t start = 0, blk = 0; start < V; start += kBlock, ++blk) {
      const int64_t end = start + kBlock < V ? start + kBlock : V;
      double s = 0;
#pragma omp simd reduction(+ : s)
      for (int64_t i = start; i < end; ++i) {
        const float zt = t == 1.0f ? tr.data[i] : tr.data[i] / t;
        const float zq = t == 1.0f ? dd[i] : dd[i] / t;
        const float w = exp_nonpos(zt - tm) * ti - exp_nonpos(zq - qm) * qi;
        s += w > 0 ? static_cast<double>(w) : 0.0;
      }
      sums[blk] = s > 0 ? s : 0.0;
    }
  }

  float weight(int64_t b, int64_t n, int kind, const RowStats& ts, const RowStats* qs, int64_t i) const {
    const float p = prob(trow(b, n), ts, i);
    if (kind == kP) return p;
    if (kind == kPWithout) return i == x[b * K + n] ? 0.0f : p;
    const float w = p - prob(drow(b, n), *qs, i);
    return w > 0 ? w : 0.0f;
  }

  int64_t sample(int64_t b, int64_t n, int kind, const RowStats& ts, const RowStats* qs,
                 const double* sums, int64_t nblocks, double u, double& r_y) const {
    return sample_blocks(sums, nblocks, V, [&](int64_t i) { return weight(b, n, kind, ts, qs, i); }, u, r_y);
  }

  // P(y) at a non-exact position from the rule's closed form (prob_at in rules.py).
  double prob_at(double p_y, double q_y, int64_t y, const Position& pos, const RowStats& ts) const {
    switch (prm.rule) {
      case kMars: {
        const double in12 = (y == ts.v1 || y == ts.v2) ? q_y : 0.0;
        const double rest = 1.0 - pos.q12 > 0 ? 1.0 - pos.q12 : 0.0;
        return in12 + rest * p_y;
      }
      case kOvershoot: {
        const bool gate = prm.min_p > 0 && p_y >= pos.thr;
        const double g = gate ? q_y : std::fmin(q_y, p_y / prm.lenience);
        const double r = pos.tv > 0 ? std::fmax(p_y - q_y, 0.0) / pos.tv : p_y;
        return g + static_cast<double>(pos.rejected) * r;
      }
      case kTypical:
      case kMinP: {
        const bool in_a = p_y >= pos.thr;
        const double t_y = in_a ? 0.0 : q_y / std::fmax(1.0 - p_y, 1e-30);
        return (in_a ? q_y : 0.0) + p_y * std::fmax(static_cast<double>(pos.feed) - t_y, 0.0);
      }
      case kCos:
        return prm.lam * p_y + (1.0 - prm.lam) * q_y;
      default:
        return p_y;
    }
  }
};

}  // namespace

extern "C" {

// Returns 0, or 1 when a logit row is bad (bad_rows[B*(K+1) + B*K] flags which: target rows
// first, then draft rows), 2 when a draft token has q = 0 (bad_token = [b, j]), 3 when a final
// token's sampling weights have no mass (an internal error), or 4 when a draft token is
// outside [0, V).
int64_t hr_verify_chain(const float* target, const float* draft, const int64_t* x,
                        const float* u_accept, const float* u_final, int64_t B, int64_t K,
                        int64_t V, double temperature, const Params* prm,
                        int64_t* tokens, int64_t* num_emitted, float* behaviour, float* target_lp,
                        int8_t* kinds, bool* relaxed, uint8_t* bad_rows, int64_t* bad_token) {
  for (int64_t i = 0; i < B * K; ++i)
    if (x[i] < 0 || x[i] >= V) return 4;  // the caller names the token
  Kernel kn{target, draft, x, u_accept, u_final, B, K, V, static_cast<float>(temperature), *prm};
  const int64_t nt = B * (K + 1), nd = B * K;
  std::vector<RowStats> ts(nt), qs(nd);
  const bool mars = prm->rule == kMars, typical = prm->rule == kTypical;

  // phase 1: every target and draft row
  at::parallel_for(0, nt + nd, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      if (r < nt) {
        const int64_t b = r / (K + 1), j = r % (K + 1);
        ts[r] = row_stats(kn.trow(b, j), mars && j < K, typical && j < K);
      } else {
        const int64_t d = r - nt;
        qs[d] = row_stats(kn.drow(d / (K > 0 ? K : 1), d % (K > 0 ? K : 1)), false, false);
      }
    }
  });
  bool any_bad = false;
  for (int64_t r = 0; r < nt; ++r) any_bad |= (bad_rows[r] = ts[r].bad);
  for (int64_t d = 0; d < nd; ++d) any_bad |= (bad_rows[nt + d] = qs[d].bad);
  if (any_bad) return 1;

  // phase 2: per row, the drafted positions up to the first rejection
  std::vector<Position> pos(nd);
  std::vector<int64_t> n_acc(B);
  for (int64_t b = 0; b < B; ++b) {
    int64_t n = K;
    for (int64_t j = 0; j < K; ++j) {
      Position& ps = pos[b * K + j];
      const RowStats& t = ts[b * (K + 1) + j];
      const RowStats& q = qs[b * K + j];
      const int64_t xj = x[b * K + j];
      ps.p_x = prob(kn.trow(b, j), t, xj);
      ps.q_x = prob(kn.drow(b, j), q, xj);
      if (!(ps.q_x > 0)) {
        bad_token[0] = b;
        bad_token[1] = j;
        return 2;
      }
      if (n < K) continue;  // after the first rejection only q(x) > 0 is checked
      rule_context(*prm, t, ps.relax, ps.thr);
      if (prm->rule == kMars) ps.q12 = prob(kn.drow(b, j), q, t.v1) + prob(kn.drow(b, j), q, t.v2);
      ps.a = kn.accept(ps, xj, t);
      if (!(u_accept[b * K + j] < ps.a)) n = j;
    }
    n_acc[b] = n;
  }

  // phase 3: row statistics at positions j <= min(n_acc, K - 1) and the final rows' block sums
  struct Task { int64_t b, j; bool final_row; };
  std::vector<Task> tasks;
  if (kn.full_row_stats())
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j <= (n_acc[b] < K - 1 ? n_acc[b] : K - 1); ++j) tasks.push_back({b, j, false});
  const int64_t nblocks = (V + kBlock - 1) / kBlock;
  std::vector<double> sums(B * nblocks);
  std::vector<int> kind(B);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = n_acc[b];
    if (n == K || (mars && pos[b * K + n].relax)) kind[b] = Kernel::kP;
    else if (prm->rule == kTypical || prm->rule == kMinP) kind[b] = Kernel::kPWithout;
    else kind[b] = Kernel::kResidual;
    tasks.push_back({b, n, true});
  }
  auto final_q = [&](int64_t b) -> const RowStats* { return n_acc[b] < K ? &qs[b * K + n_acc[b]] : nullptr; };
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const Task& tk = tasks[i];
      if (tk.final_row)
        kn.block_sums(tk.b, tk.j, kind[tk.b], ts[tk.b * (K + 1) + tk.j], final_q(tk.b), &sums[tk.b * nblocks]);
      else
        kn.stats(tk.b, tk.j, ts[tk.b * (K + 1) + tk.j], qs[tk.b * K + tk.j], pos[tk.b * K + tk.j]);
    }
  });

  // the final tokens and every output
  std::vector<uint8_t> empty(B, 0);
  at::parallel_for(0, B, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      const int64_t n = n_acc[b];
      const RowStats& tf = ts[b * (K + 1) + n];
      double* bs = &sums[b * nblocks];
      double total = 0;
      for (int64_t k = 0; k < nblocks; ++k) total += bs[k];
      if (!(total > 0) && kind[b] == Kernel::kResidual) {  // p <= q everywhere: the residual is p
        kind[b] = Kernel::kP;
        kn.block_sums(b, n, Kernel::kP, tf, nullptr, bs);
      }
      double r_y = 0;
      const int64_t y = kn.sample(b, n, kind[b], tf, final_q(b), bs, nblocks, u_final[b], r_y);
      if (y < 0) {
        empty[b] = 1;
        continue;
      }
      int64_t* tok = tokens + b * (K + 1);
      float* blp = behaviour + b * (K + 1);
      float* tlp = target_lp + b * (K + 1);
      int8_t* kd = kinds + b * (K + 1);
      bool* rel = relaxed + b * (K + 1);
      for (int64_t j = 0; j < n; ++j) {
        const Position& ps = pos[b * K + j];
        const int64_t xj = x[b * K + j];
        tok[j] = xj;
        kd[j] = 0;
        tlp[j] = std::log(ps.p_x);
        if (kn.exact(ps)) {
          blp[j] = tlp[j];
          rel[j] = false;
        } else {
          const double P = kn.prob_at(ps.p_x, ps.q_x, xj, ps, ts[b * (K + 1) + j]);
          blp[j] = static_cast<float>(std::log(std::fmax(P, static_cast<double>(ps.q_x) * ps.a)));
          const float ratio = ps.p_x / ps.q_x;
          rel[j] = ps.a > (ratio > 1.0f ? 1.0f : ratio);
        }
      }
      const float p_y = prob(kn.trow(b, n), tf, y);
      tok[n] = y;
      kd[n] = n == K ? 2 : 1;
      tlp[n] = std::log(p_y);
      rel[n] = false;
      if (n == K || kn.exact(pos[b * K + n])) {
        blp[n] = tlp[n];
      } else {
        const Position& ps = pos[b * K + n];
        const float q_y = prob(kn.drow(b, n), qs[b * K + n], y);
        const double P = kn.prob_at(p_y, q_y, y, ps, ts[b * (K + 1) + n]);
        const double floor = static_cast<double>(ps.q_x) * (1.0 - static_cast<double>(ps.a)) * r_y;
        blp[n] = static_cast<float>(std::log(std::fmax(P, floor)));
      }
      for (int64_t j = n + 1; j <= K; ++j) {
        tok[j] = -1;
        kd[j] = -1;
        blp[j] = tlp[j] = 0;
        rel[j] = false;
      }
      num_emitted[b] = n + 1;
    }
  });
  for (int64_t b = 0; b < B; ++b)
    if (empty[b]) return 3;
  return 0;
}

}  // extern "C"

// ---------------------------------------------------------------------------------------------
// Verification over deterministic candidates (verifiers/candidates.py is the contract): node n
// examines c_1..c_m in order, accepting c_i with alpha_i = node_alpha(s(c_i), p(c_i)), where
// s(c_i) is p(c_i) over the mass not yet rejected; if none is accepted the token comes from the
// fallback (p without the candidates; p itself where MARS relaxes). One task per node.

namespace {

struct NodeKernel {
  const float* target;  // [N, V]
  const int64_t* cands;  // [N, M], -1 padded after the valid ones
  int64_t M, V;
  float temperature;
  Params prm;

  float alpha(float s_c, float p_c, int64_t c, bool relax, float thr, const RowStats& st) const {
    switch (prm.rule) {
      case kMars:
        return relax ? ((c == st.v1 || c == st.v2) ? 1.0f : 0.0f) : s_c;
      case kOvershoot: {
        if (prm.min_p > 0 && p_c >= thr) return 1.0f;
        const float a = s_c / static_cast<float>(prm.lenience);
        return a > 1.0f ? 1.0f : a;
      }
      case kTypical:
      case kMinP:
        return p_c >= thr ? 1.0f : 0.0f;
      case kCos:
        return prm.lam == 1.0 ? s_c : 1.0f - static_cast<float>(prm.lam) * (1.0f - s_c);
      default:
        return s_c;
    }
  }

  // Returns 0, 1 (bad logit row) or 3 (every candidate rejected and the fallback is empty).
  int node(int64_t n, float u_fin, const float* u_acc, int64_t& y, int64_t& index, float& blp, float& tlp,
           bool& rel, std::vector<double>& sums) const {
    const RowView rv{target + n * V, V, temperature};
    const int64_t* c = cands + n * M;
    const bool mars = prm.rule == kMars, typical = prm.rule == kTypical;
    RowStats st;
    float raw_max, raw_second;
    if (!row_top(rv, mars, st, raw_max, raw_second)) return 1;
    if (mars) top2_tokens(rv, raw_max, raw_second, st);
    const float zmax = st.zmax;
    int64_t m = 0;  // valid candidates
    while (m < M && c[m] >= 0) ++m;
    std::vector<int64_t> sorted(c, c + m);
    for (int64_t i = 1; i < m; ++i)
      for (int64_t j = i; j > 0 && sorted[j - 1] > sorted[j]; --j) std::swap(sorted[j - 1], sorted[j]);
    // sum exp(z - zmax) over the non-candidates, segment by segment (no cancellation later)
    float rest_e = 0, h = 0;
    const float t = temperature;
    int64_t lo = 0;
    for (int64_t k = 0; k <= m; ++k) {
      const int64_t hi = k < m ? sorted[k] : V;
      float s = 0, hh = 0;
#pragma omp simd reduction(+ : s, hh)
      for (int64_t i = lo; i < hi; ++i) {
        const float d = (t == 1.0f ? rv.data[i] : rv.data[i] / t) - zmax;
        const float e = exp_nonpos(d);
        s += e;
        hh += typical && e > 0 ? e * d : 0.0f;
      }
      rest_e += s;
      h += hh;
      lo = hi + 1;
    }
    std::vector<float> e_c(m);
    float cand_e = 0;
    for (int64_t i = 0; i < m; ++i) {
      const float d = rv.z(c[i]) - zmax;
      e_c[i] = exp_nonpos(d);
      cand_e += e_c[i];
      if (typical && e_c[i] > 0) h += e_c[i] * d;
    }
    st.inv_sum = 1.0f / (rest_e + cand_e);
    st.zsum_term = h;
    const float inv = st.inv_sum, rest = rest_e * inv;
    bool relax;
    float thr;
    rule_context(prm, st, relax, thr);
    // the walk: remaining mass when c_i is examined = non-candidates + c_i..c_m
    std::vector<float> p_c(m), s_c(m), al(m);
    for (int64_t i = 0; i < m; ++i) p_c[i] = e_c[i] * inv;
    float tail = 0;
    for (int64_t i = m - 1; i >= 0; --i) {
      tail += p_c[i];
      const float remaining = rest + tail;
      const float sc = remaining > 0 ? p_c[i] / remaining : 0.0f;
      s_c[i] = sc > 1.0f ? 1.0f : sc;
    }
    index = -1;
    double log_reach = 0;  // log prob of reaching the current candidate
    std::vector<double> lr(m + 1);
    for (int64_t i = 0; i < m; ++i) {
      al[i] = alpha(s_c[i], p_c[i], c[i], relax, thr, st);
      lr[i] = log_reach;
      if (index < 0 && u_acc[i] < al[i]) index = i;
      log_reach += std::log1p(-static_cast<double>(al[i]));
    }
    lr[m] = log_reach;
    const bool fb_is_p = mars && relax;
    const double fb_mass = fb_is_p ? 1.0 : static_cast<double>(rest);
    auto fb_weight = [&](int64_t i) -> float {
      const float p = prob(rv, st, i);
      if (fb_is_p) return p;
      for (int64_t k = 0; k < m; ++k)
        if (c[k] == i) return 0.0f;
      return p;
    };
    if (index >= 0) {
      y = c[index];
      rel = al[index] > s_c[index];
    } else {
      if (!(fb_mass > 0)) return 3;
      const int64_t nblocks = (V + kBlock - 1) / kBlock;
      sums.assign(nblocks, 0.0);
      p_block_sums(rv, st, c, fb_is_p ? 0 : m, sums.data());
      double r_y = 0;
      y = sample_blocks(sums.data(), nblocks, V, fb_weight, u_fin, r_y);
      if (y < 0) return 3;
      rel = false;
    }
    const float p_y = prob(rv, st, y);
    tlp = std::log(p_y);
    // log P(y) = log(reach_i alpha_i [y = c_i] + reach_{m+1} fallback(y) / |fallback|)
    double P = 0;
    for (int64_t i = 0; i < m; ++i)
      if (c[i] == y) P += std::exp(lr[i]) * al[i];
    if (fb_mass > 0) P += std::exp(lr[m]) * static_cast<double>(fb_weight(y)) / fb_mass;
    blp = static_cast<float>(std::log(P));
    return 0;
  }
};

}  // namespace

extern "C" {

// Returns 0, 1 when a logit row is bad (bad_rows[N] flags which), 3 when a node rejected
// every candidate and its fallback has no mass (an internal error), or 4 when the candidates
// are not distinct ids in [0, V) with -1 padding after them.
int64_t hr_verify_candidates(const float* target, const int64_t* cands, const float* u_accept,
                             const float* u_final, int64_t N, int64_t M, int64_t V, double temperature,
                             const Params* prm, int64_t* tokens, int64_t* index, float* behaviour,
                             float* target_lp, bool* relaxed, uint8_t* bad_rows) {
  for (int64_t n = 0; n < N; ++n) {  // ids in [-1, V), padding last, valid ones distinct
    const int64_t* c = cands + n * M;
    for (int64_t i = 0; i < M; ++i) {
      if (c[i] < -1 || c[i] >= V || (i > 0 && c[i] >= 0 && c[i - 1] < 0)) return 4;
      for (int64_t j = 0; j < i && c[i] >= 0; ++j)
        if (c[j] == c[i]) return 4;
    }
  }
  NodeKernel kn{target, cands, M, V, static_cast<float>(temperature), *prm};
  std::vector<int> status(N, 0);
  at::parallel_for(0, N, 1, [&](int64_t lo, int64_t hi) {
    std::vector<double> sums;
    for (int64_t n = lo; n < hi; ++n)
      status[n] = kn.node(n, u_final[n], u_accept + n * M, tokens[n], index[n], behaviour[n], target_lp[n],
                          relaxed[n], sums);
  });
  int64_t worst = 0;
  for (int64_t n = 0; n < N; ++n) {
    bad_rows[n] = status[n] == 1;
    if (status[n] == 1) worst = 1;
    else if (status[n] == 3 && worst == 0) worst = 3;
  }
  return worst;
}

}  // extern "C"
