// The per-rule part of the fused verifier: every place where the rules differ, one function per
// step, each a switch over the kernel ids. Each case is the C++ form of the same-named method of
// the rule's class in verifiers/rules.py (its ``kernel_id`` and ``kernel_args`` say which case
// and which arguments); verifiers/README.md has the math. chain.cpp and candidates.cpp call
// these and never look at the rule id themselves.
//
// Arguments (Params.arg, in the order of the rule's ``kernel_args``):
//   mars: theta | overshoot: lenience, min_p (0 without the gate) | typical: epsilon, delta |
//   min_p: p_base | cos: lam | lossless: none

#pragma once

#include <type_traits>

#include "common.h"

namespace {

enum RuleId : int64_t { kLossless = 0, kMars = 1, kOvershoot = 2, kTypical = 3, kMinP = 4, kCos = 5 };

// f(std::integral_constant<int64_t, R>{}) with R = rule as a compile-time id (-1 for an id not
// listed: the callee then reads the rule at run time), so that a loop in f over chain_prob_at
// folds its switch and vectorises.
template <class F>
auto with_rule_id(int64_t rule, F&& f) {
  switch (rule) {
    case kLossless: return f(std::integral_constant<int64_t, kLossless>{});
    case kMars: return f(std::integral_constant<int64_t, kMars>{});
    case kOvershoot: return f(std::integral_constant<int64_t, kOvershoot>{});
    case kTypical: return f(std::integral_constant<int64_t, kTypical>{});
    case kMinP: return f(std::integral_constant<int64_t, kMinP>{});
    case kCos: return f(std::integral_constant<int64_t, kCos>{});
    default: return f(std::integral_constant<int64_t, -1>{});
  }
}

struct RuleInfo {
  const char* name;  // the rule's registered name in verifiers/rules.py
  int64_t nargs;     // how many arguments it declares
};
constexpr RuleInfo kRules[] = {{"lossless", 0}, {"mars", 1},  {"overshoot", 2},
                               {"typical", 2},  {"min_p", 1}, {"cos", 1}};
constexpr int64_t kNumRules = sizeof(kRules) / sizeof(kRules[0]);

// What the row pass of a drafted target row computes besides max and normaliser.
inline bool wants_top2(const Params& prm) { return prm.rule == kMars; }      // v1, v2, z2
inline bool wants_entropy(const Params& prm) { return prm.rule == kTypical; }  // sum e (z - zmax)

// Whether the rule's chain statistics reduce whole vocabulary rows (rules.py ``full_row_stats``).
inline bool full_row_stats(const Params& prm) {
  return prm.rule == kOvershoot || prm.rule == kTypical || prm.rule == kMinP;
}

struct RuleState {     // the rule's values at one drafted position (``context``, ``chain_stats``)
  bool relax = false;  // MARS
  float thr = 0;       // min-p / typical / overshoot gate: the set A = {p >= thr}
  float q12 = 0;       // MARS: q(v1) + q(v2)
  float rejected = 0, tv = 0, feed = 0;  // full-row statistics (overshoot; typical, min_p)
};

// The rule's context at one target row (``context``): MARS's relax flag, or the threshold of
// the set A = {p >= thr} (min-p, typical, overshoot's gate; 0 otherwise).
static void rule_context(const Params& prm, const RowStats& st, bool& relax, float& thr) {
  relax = false;
  thr = 0;
  switch (prm.rule) {
    case kMars: {
      const double theta = prm.arg[0];
      relax = st.zmax > 0 && st.z2 / st.zmax > static_cast<float>(theta);
      break;
    }
    case kOvershoot: {
      const double min_p = prm.arg[1];
      thr = min_p > 0 ? static_cast<float>(min_p) * st.inv_sum : 0.0f;
      break;
    }
    case kMinP: {
      const double p_base = prm.arg[0];
      thr = static_cast<float>(p_base) * st.inv_sum;
      break;
    }
    case kTypical: {
      const double epsilon = prm.arg[0], delta = prm.arg[1];
      const float entropy = -std::log(st.inv_sum) - st.zsum_term * st.inv_sum;
      const float th = static_cast<float>(delta) * std::exp(-entropy);
      thr = th < static_cast<float>(epsilon) ? th : static_cast<float>(epsilon);
      break;
    }
    default:
      break;
  }
}

// The context at a drafted position, with the draft-side values it gathers (MARS's q12).
inline void chain_context(const Params& prm, const RowStats& ts, const RowView& dr, const RowStats& qs,
                          RuleState& rs) {
  rule_context(prm, ts, rs.relax, rs.thr);
  if (prm.rule == kMars) rs.q12 = prob(dr, qs, ts.v1) + prob(dr, qs, ts.v2);
}

// a(x) (``accept_prob``).
inline float chain_accept(const Params& prm, float p_x, float q_x, int64_t x, const RowStats& ts,
                          const RuleState& rs) {
  const float ratio = p_x / q_x;
  const float lossless = ratio > 1.0f ? 1.0f : ratio;  // min(ratio, 1), NaN kept (never accepted)
  switch (prm.rule) {
    case kMars:
      return rs.relax ? ((x == ts.v1 || x == ts.v2) ? 1.0f : 0.0f) : lossless;
    case kOvershoot: {
      const double lenience = prm.arg[0], min_p = prm.arg[1];
      if (min_p > 0 && p_x >= rs.thr) return 1.0f;
      const float a = p_x / (static_cast<float>(lenience) * q_x);
      return a > 1.0f ? 1.0f : a;
    }
    case kTypical:
    case kMinP:
      return p_x >= rs.thr ? 1.0f : 0.0f;
    case kCos: {
      const float lam = static_cast<float>(prm.arg[0]);
      const float a = lam * ratio + (1.0f - lam);
      return a > 1.0f ? 1.0f : a;
    }
    default:
      return lossless;
  }
}

// P == p at this position (``induces_target``).
inline bool chain_exact(const Params& prm, const RuleState& rs) {
  return prm.rule == kLossless || (prm.rule == kMars && !rs.relax) || (prm.rule == kCos && prm.arg[0] == 1.0);
}

// The full-row statistics at one drafted position (``chain_stats`` of the rules with
// ``full_row_stats``): overshoot's rejected mass and TV, the truncation rules' feed term, over
// p_at(i), q_at(i) (i < V): from the logits rows (``chain_row_stats``) or from p and q as arrays
// (a sampled tree node, sampled.h).
template <class PAt, class QAt>
inline void chain_row_stats_of(const Params& prm, int64_t V, PAt p_at, QAt q_at, RuleState& rs) {
  const float thr = rs.thr;
  double s1 = 0, s2 = 0;  // float64 sums (see row_stats)
  if (prm.rule == kOvershoot) {
    const double lenience = prm.arg[0], min_p = prm.arg[1];
    const float inv_l = static_cast<float>(1.0 / lenience);
    const bool gate = min_p > 0;
#pragma omp simd reduction(+ : s1, s2)
    for (int64_t i = 0; i < V; ++i) {
      const float p = p_at(i), q = q_at(i);
      const float over = q - p * inv_l;
      s1 += (over > 0 && !(gate && p >= thr)) ? over : 0.0f;
      s2 += p > q ? p - q : 0.0f;
    }
    rs.rejected = static_cast<float>(s1);
    rs.tv = static_cast<float>(s2);
  } else {  // typical, min_p: sum over p < thr of q / (1 - p)
#pragma omp simd reduction(+ : s1)
    for (int64_t i = 0; i < V; ++i) {
      const float p = p_at(i), q = q_at(i);
      const float denom = 1.0f - p > 1e-30f ? 1.0f - p : 1e-30f;
      s1 += p < thr ? q / denom : 0.0f;
    }
    rs.feed = static_cast<float>(s1);
  }
}

inline void chain_row_stats(const Params& prm, const RowView& tr, const RowView& dr, const RowStats& ts,
                            const RowStats& qs, RuleState& rs) {
  const float tm = ts.zmax, ti = ts.inv_sum, qm = qs.zmax, qi = qs.inv_sum;
  const float t = tr.temperature;
  // the rows' pointers in locals: read through the views inside the loops they kept gcc from
  // vectorising them (a scalar loop, ~13 ns a token: 24 ms of a batch-16 overshoot verification)
  const float* __restrict td = tr.data;
  const float* __restrict dd = dr.data;
  chain_row_stats_of(
      prm, tr.n, [=](int64_t i) { return exp_nonpos((t == 1.0f ? td[i] : td[i] / t) - tm) * ti; },
      [=](int64_t i) { return exp_nonpos((t == 1.0f ? dd[i] : dd[i] / t) - qm) * qi; }, rs);
}

// The weights a final token is sampled from: p (a bonus, MARS relaxed, or a residual with no
// mass), p without the rejected draft (truncation rules), else (p - q)+.
enum WeightKind { kP = 0, kPWithout = 1, kResidual = 2 };

// The residual after a rejection (``residual``).
inline WeightKind rejected_weights(const Params& prm, const RuleState& rs) {
  if (prm.rule == kMars && rs.relax) return kP;
  if (prm.rule == kTypical || prm.rule == kMinP) return kPWithout;
  return kResidual;
}

// P(y) at a non-exact position from the rule's closed form (``prob_at``). Branch-free selects,
// not std::fmin / fmax (library calls without -ffinite-math-only): loops over it vectorise.
inline double chain_prob_at(const Params& prm, double p_y, double q_y, int64_t y, const RuleState& rs,
                            const RowStats& ts) {
  switch (prm.rule) {
    case kMars: {
      const double in12 = (y == ts.v1 || y == ts.v2) ? q_y : 0.0;
      const double rest = 1.0 - rs.q12 > 0 ? 1.0 - rs.q12 : 0.0;
      return in12 + rest * p_y;
    }
    case kOvershoot: {
      const double lenience = prm.arg[0], min_p = prm.arg[1];
      const bool gate = min_p > 0 && p_y >= rs.thr;
      const double cap = p_y / lenience;
      const double g = gate || q_y < cap ? q_y : cap;
      const double r = rs.tv > 0 ? (p_y > q_y ? p_y - q_y : 0.0) / rs.tv : p_y;
      return g + static_cast<double>(rs.rejected) * r;
    }
    case kTypical:
    case kMinP: {
      const bool in_a = p_y >= rs.thr;
      const double t_y = in_a ? 0.0 : q_y / (1.0 - p_y > 1e-30 ? 1.0 - p_y : 1e-30);
      const double left = static_cast<double>(rs.feed) - t_y;
      return (in_a ? q_y : 0.0) + p_y * (left > 0 ? left : 0.0);
    }
    case kCos: {
      const double lam = prm.arg[0];
      return lam * p_y + (1.0 - lam) * q_y;
    }
    default:
      return p_y;
  }
}

// alpha_i of candidate c at a node (``node_alpha``): s_c is p(c) over the mass not yet rejected.
inline float node_alpha(const Params& prm, float s_c, float p_c, int64_t c, bool relax, float thr,
                        const RowStats& st) {
  switch (prm.rule) {
    case kMars:
      return relax ? ((c == st.v1 || c == st.v2) ? 1.0f : 0.0f) : s_c;
    case kOvershoot: {
      const double lenience = prm.arg[0], min_p = prm.arg[1];
      if (min_p > 0 && p_c >= thr) return 1.0f;
      const float a = s_c / static_cast<float>(lenience);
      return a > 1.0f ? 1.0f : a;
    }
    case kTypical:
    case kMinP:
      return p_c >= thr ? 1.0f : 0.0f;
    case kCos: {
      const double lam = prm.arg[0];
      return lam == 1.0 ? s_c : 1.0f - static_cast<float>(lam) * (1.0f - s_c);
    }
    default:
      return s_c;
  }
}

// Whether a node's fallback is p itself rather than p without the candidates (``node_fallback``).
inline bool node_fallback_is_p(const Params& prm, bool relax) { return prm.rule == kMars && relax; }

}  // namespace
