// The node step of the sampled-candidate kernels (sampled.cpp's hr_verify_sampled: one node per
// task; sampled_tree.cpp's hr_walk_sampled: a whole walk per task) and the row helpers they and
// hr_draw_sampled share: softmax, the float64 inverse CDF, per-thread scratch rows
// (verifiers/sampled.py is the contract; verifiers/README.md, "Sampled candidates", has the math).
//
// The node step (verify_node) tests the first candidate from the rows' statistics alone (max and
// normaliser of the target and draft rows, the rule's closed form P_R(c_1) = chain_prob_at; a
// vocabulary pass for the rules whose law needs row sums): most nodes accept it, and then no
// vocabulary-sized row is written. p, q and P_R are written out only when c_1 is rejected; the
// recursion then goes on from the state after that rejection. The same procedure, on the same
// uniforms, as the PyTorch code (which tests c_1 against the written rows: equal up to rounding).
//
// A row's sums accumulate in float64 on one thread.

#pragma once

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "common.h"
#include "rules.h"

namespace {

// softmax(row / t) into out (float), returning false for a NaN, +inf or all -inf row.
bool softmax_row(const float* row, int64_t n, float t, float* out) {
  float m = kNegInf;
  int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
  for (int64_t i = 0; i < n; ++i) {
    m = row[i] > m ? row[i] : m;
    nan |= row[i] != row[i];
  }
  if (nan || !std::isfinite(m)) return false;
  const float zmax = t == 1.0f ? m : m / t;
  if (!std::isfinite(zmax)) return false;
  double s = 0;
  if (t == 1.0f) {
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; ++i) {
      const float e = exp_nonpos(row[i] - zmax);
      out[i] = e;
      s += e;
    }
  } else {
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; ++i) {
      const float e = exp_nonpos(row[i] / t - zmax);
      out[i] = e;
      s += e;
    }
  }
  const float inv = static_cast<float>(1.0 / s);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] *= inv;
  return true;
}

// The first index whose cumulative weight (float64, in index order) exceeds u * total: block sums
// of kBlock weights first, then a scan inside the block. A zero weight is never picked. total > 0.
int64_t inverse_cdf(const float* w, int64_t n, double total, double u) {
  double goal = u * total;
  const double below = std::nextafter(total, 0.0);
  goal = goal < below ? goal : below;
  double cum = 0;
  int64_t start = 0;
  for (; start + kBlock < n; start += kBlock) {
    double b = 0;
#pragma omp simd reduction(+ : b)
    for (int64_t i = start; i < start + kBlock; ++i) b += w[i];
    if (cum + b > goal) break;
    cum += b;
  }
  int64_t last = -1;
  for (int64_t i = start; i < n; ++i) {
    if (w[i] <= 0) continue;
    cum += w[i];
    last = i;
    if (cum > goal) return i;
  }
  if (last >= 0) return last;
  for (int64_t i = start - 1; i >= 0; --i)  // rounding left no mass past the goal's block
    if (w[i] > 0) return i;
  return -1;
}

// Per-thread scratch rows (reused across calls: no zeroing of vocabulary-sized buffers; each file
// that includes this header has its own set).
float* scratch(int which, int64_t n) {
  thread_local std::vector<float> rows[5];
  if (static_cast<int64_t>(rows[which].size()) < n) rows[which].resize(n);
  return rows[which].data();
}

double* block_scratch(int64_t V) {  // per-thread block sums (ceil(V / kBlock))
  thread_local std::vector<double> sums;
  const int64_t n = (V + kBlock - 1) / kBlock;
  if (static_cast<int64_t>(sums.size()) < n) sums.resize(n);
  return sums.data();
}

// law[y] = P_R(y) over a row; returns the mass. R: the rule as a compile-time constant, so that
// the rule's switch folds and the loop vectorises (-1: prm's own rule).
template <int64_t R>
double law_row(const Params& prm, const RuleState& rs, const RowStats& ts, const float* __restrict p,
               const float* __restrict q, float* __restrict law, int64_t V) {
  Params fixed = prm;
  if (R >= 0) fixed.rule = R;
  double sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t y = 0; y < V; ++y) {
    const float w = static_cast<float>(chain_prob_at(fixed, p[y], q[y], y, rs, ts));
    law[y] = w;
    sum += w;
  }
  return sum;
}

// law [V] = P_R over the node's p and q arrays (rs: the rule's context and row statistics at the
// node); returns its mass.
double law_of(const Params& prm, const RuleState& rs, const RowStats& ts, const float* __restrict p,
              const float* __restrict q, float* __restrict law, int64_t V) {
  return with_rule_id(prm.rule, [&](auto r) { return law_row<decltype(r)::value>(prm, rs, ts, p, q, law, V); });
}

// Recursive rejection at one node towards law [V] (mass law_mass), q in rest [V] (normalised;
// changed: the candidates are removed), s [V] scratch; candidates c[0..M) (-1 padded), uniforms
// u_acc[0..M) and u_fin; the candidates before index first were already rejected (not tested
// again: only the state moves past them). Returns the emitted token; accepted = the accepted
// candidate's index or -1.
int64_t recursive_rejection(const float* law, double law_mass, float* s, float* rest, int64_t V, const int64_t* c,
                            int64_t M, const float* u_acc, float u_fin, int64_t first, int64_t& accepted) {
#pragma omp simd
  for (int64_t j = 0; j < V; ++j) s[j] = law[j];
  double s_mass = law_mass, rest_mass = 0;
#pragma omp simd reduction(+ : rest_mass)
  for (int64_t j = 0; j < V; ++j) rest_mass += rest[j];
  accepted = -1;
  for (int64_t i = 0; i < M && c[i] >= 0; ++i) {
    const float inv_rest = static_cast<float>(1.0 / rest_mass);
    const float inv_s = static_cast<float>(1.0 / s_mass);
    const float q_c = rest[c[i]] * inv_rest;
    const float ratio = (s[c[i]] * inv_s) / q_c;
    if (i >= first && u_acc[i] < ratio) {
      accepted = i;
      break;
    }
    double mass = 0;
#pragma omp simd reduction(+ : mass)
    for (int64_t j = 0; j < V; ++j) {
      const float d = s[j] * inv_s - rest[j] * inv_rest;
      mass += d > 0 ? d : 0.0f;
    }
    if (mass > 0) {  // else s = q_i: the rejection had probability 0; s is kept
#pragma omp simd
      for (int64_t j = 0; j < V; ++j) {
        const float d = s[j] * inv_s - rest[j] * inv_rest;
        s[j] = d > 0 ? d : 0.0f;
      }
      s_mass = mass;
    }
    rest_mass -= rest[c[i]];
    rest[c[i]] = 0.0f;
    if (!(rest_mass > 0)) {  // float64 rounding: recount what is left of q
      rest_mass = 0;
      for (int64_t j = 0; j < V; ++j) rest_mass += rest[j];
    }
  }
  return accepted >= 0 ? c[accepted] : inverse_cdf(s, V, s_mass, u_fin);
}

// A node's draft row: logits over the draft vocabulary [Vd] and the target ids of its entries
// (ids [Vd] and inv [V], the draft index of a target id or -1; both nullptr: the identity, Vd = V).
struct DraftRow {
  RowView rv;
  const int64_t* ids;
  const int32_t* inv;
  int64_t index(int64_t y) const { return inv ? inv[y] : y; }
};

// Per-thread rows of vocabulary size a node step writes into (only when its first candidate is
// rejected, or for a leaf's bonus token).
struct NodeScratch {
  float *p, *s, *rest, *qd, *law;
  double* sums;  // block sums, ceil(V / kBlock)
};

// After the one candidate of a node is rejected: y ~ norm((P_R - q)+), from the logits rows
// (p_at, q_at: a token's p and q) without writing a row: block sums of the weights, then a scan
// of one block (common.h's sample_blocks). R: the law as a compile-time rule id, so that
// chain_prob_at's switch folds and the loop vectorises (kLossless: P_R = p; -1: prm's own rule). residual = false
// samples P_R itself (where P_R = q: the rejection had probability 0).
template <int64_t R, class PAt, class QAt>
int64_t draw_after_rejection(const Params& prm, const RuleState& rs, const RowStats& ts, PAt p_at, QAt q_at,
                             int64_t V, bool residual, double u, double* sums) {
  Params fixed = prm;
  if (R >= 0) fixed.rule = R;
  const float keep_q = residual ? 1.0f : 0.0f;
  auto weight = [=, &rs, &ts](int64_t i) {
    const float p = p_at(i), q = q_at(i);
    const float law = R == kLossless ? p : static_cast<float>(chain_prob_at(fixed, p, q, i, rs, ts));
    const float w = law - keep_q * q;
    return w > 0 ? w : 0.0f;
  };
  weight_block_sums(V, weight, sums);
  double r_y = 0;
  return sample_blocks(sums, (V + kBlock - 1) / kBlock, V, weight, u, r_y);
}

// draw_after_rejection for the law at this node: p where the rule induces p (exact), else P_R.
template <class PAt, class QAt>
int64_t draw_after_rejection_of(const Params& prm, bool exact, const RuleState& rs, const RowStats& ts, PAt p_at,
                                QAt q_at, int64_t V, bool residual, double u, double* sums) {
  return with_rule_id(exact ? kLossless : prm.rule, [&](auto r) {
    return draw_after_rejection<decltype(r)::value>(prm, rs, ts, p_at, q_at, V, residual, u, sums);
  });
}

struct NodeResult {
  int64_t y = -1, accepted = -1;  // the emitted token, the accepted candidate's index (-1: none)
  float logp = 0, target_lp = 0;  // log P(y) (the law verified towards), log p(y)
  int status = 0;                 // 1 a bad target row, 2 a bad draft row, 4 a candidate with q = 0
};

// A node's p (in sc.p) and q (in sc.rest, over the target vocabulary) written out as rows.
void write_rows(const RowView& tr, const DraftRow& dr, const NodeScratch& sc) {
  const int64_t V = tr.n;
  softmax_row(tr.data, V, tr.temperature, sc.p);
  if (!dr.ids) {
    softmax_row(dr.rv.data, V, dr.rv.temperature, sc.rest);
  } else {
    softmax_row(dr.rv.data, dr.rv.n, dr.rv.temperature, sc.qd);
    std::fill(sc.rest, sc.rest + V, 0.0f);
    for (int64_t j = 0; j < dr.rv.n; ++j) sc.rest[dr.ids[j]] = sc.qd[j];
  }
}

// A leaf's node (no candidates): the bonus token y ~ p.
NodeResult bonus_token(const RowView& tr, float u_fin, const NodeScratch& sc) {
  NodeResult out;
  const int64_t V = tr.n;
  if (!softmax_row(tr.data, V, tr.temperature, sc.p)) {
    out.status = 1;
    return out;
  }
  double total = 0;
#pragma omp simd reduction(+ : total)
  for (int64_t j = 0; j < V; ++j) total += sc.p[j];
  out.y = inverse_cdf(sc.p, V, total, u_fin);
  out.logp = out.target_lp = std::log(sc.p[out.y]);
  return out;
}

// A chain's position (one candidate, q over the target vocabulary dr) after its candidate was
// rejected: y ~ norm((P_R - q)+) without writing rows (exact: P_R = p; ts, qs: the rows' statistics).
NodeResult chain_position(const Params& prm, bool exact, const RuleState& rs, const RowView& tr, const RowStats& ts,
                          const RowView& dr, const RowStats& qs, float u_fin, double* sums) {
  NodeResult out;
  const int64_t V = tr.n;
  const float *td = tr.data, *dd = dr.data;
  const float t = tr.temperature, tm = ts.zmax, ti = ts.inv_sum, qm = qs.zmax, qi = qs.inv_sum;
  auto p_at = [=](int64_t i) { return exp_nonpos((t == 1.0f ? td[i] : td[i] / t) - tm) * ti; };
  auto q_at_row = [=](int64_t i) { return exp_nonpos((t == 1.0f ? dd[i] : dd[i] / t) - qm) * qi; };
  out.y = draw_after_rejection_of(prm, exact, rs, ts, p_at, q_at_row, V, true, u_fin, sums);
  if (out.y < 0)  // P_R <= q everywhere: P_R = q, the rejection had probability 0 (kept: y ~ P_R)
    out.y = draw_after_rejection_of(prm, exact, rs, ts, p_at, q_at_row, V, false, u_fin, sums);
  const float p_y = p_at(out.y);
  out.target_lp = std::log(p_y);
  out.logp = exact ? out.target_lp
                   : static_cast<float>(std::log(chain_prob_at(prm, p_y, q_at_row(out.y), out.y, rs, ts)));
  return out;
}

// One node: y ~ p at a leaf (m = 0); else recursive rejection over the candidates c[0..m) towards
// p (lossless) or the rule's chain law P_R(p, q).
NodeResult verify_node(const Params& prm, const RowView& tr, const DraftRow& dr, const int64_t* c, int64_t m,
                       const float* u_acc, float u_fin, const NodeScratch& sc) {
  if (m == 0) return bonus_token(tr, u_fin, sc);
  NodeResult out;
  const int64_t V = tr.n;
  const bool lossy = prm.rule != kLossless;
  const RowStats ts = row_stats(tr, lossy && wants_top2(prm), lossy && wants_entropy(prm));
  if (ts.bad) {
    out.status = 1;
    return out;
  }
  const RowStats qs = row_stats(dr.rv, false, false);
  if (qs.bad) {
    out.status = 2;
    return out;
  }
  auto q_at = [&](int64_t y) {
    const int64_t d = dr.index(y);
    return d >= 0 ? prob(dr.rv, qs, d) : 0.0f;
  };
  for (int64_t i = 0; i < m; ++i)
    if (!(q_at(c[i]) > 0)) out.status = 4;
  if (out.status) return out;
  RuleState rs;
  bool exact = true;  // the law is p here
  if (lossy) {
    rule_context(prm, ts, rs.relax, rs.thr);
    if (prm.rule == kMars) rs.q12 = q_at(ts.v1) + q_at(ts.v2);
    exact = chain_exact(prm, rs);
  }
  bool written = false;  // p and q (in rest, over the target vocabulary) written out
  if (!exact && full_row_stats(prm)) {
    if (!dr.ids) {  // q over the target vocabulary: the sums straight from the logits
      chain_row_stats(prm, tr, dr.rv, ts, qs, rs);
    } else {
      write_rows(tr, dr, sc);
      written = true;
      const float *p = sc.p, *q = sc.rest;
      chain_row_stats_of(prm, V, [=](int64_t i) { return p[i]; }, [=](int64_t i) { return q[i]; }, rs);
    }
  }
  // the first candidate, from the closed form
  const float p_c = prob(tr, ts, c[0]), q_c = q_at(c[0]);
  const double law_c = exact ? static_cast<double>(p_c) : chain_prob_at(prm, p_c, q_c, c[0], rs, ts);
  if (u_acc[0] < static_cast<float>(law_c / q_c)) {
    out.y = c[0];
    out.accepted = 0;
    out.target_lp = std::log(p_c);
    out.logp = exact ? out.target_lp : static_cast<float>(std::log(law_c));
    return out;
  }
  if (m == 1 && !dr.ids) return chain_position(prm, exact, rs, tr, ts, dr.rv, qs, u_fin, sc.sums);
  if (!written) write_rows(tr, dr, sc);
  double mass = 1.0;
  const float* to = exact ? sc.p : sc.law;
  if (!exact) mass = law_of(prm, rs, ts, sc.p, sc.rest, sc.law, V);
  out.y = recursive_rejection(to, mass, sc.s, sc.rest, V, c, m, u_acc, u_fin, 1, out.accepted);
  out.target_lp = std::log(sc.p[out.y]);
  out.logp = exact ? out.target_lp : static_cast<float>(std::log(to[out.y] / mass));
  return out;
}

// Each row's status (0 fine, else the refusal's code) into ``bad_rows``; returns the largest,
// the call's status (both kernels of sampled.cpp and sampled_tree.cpp end this way).
inline int64_t report_rows(const std::vector<uint8_t>& status, uint8_t* bad_rows) {
  int64_t worst = 0;
  for (size_t n = 0; n < status.size(); ++n) {
    bad_rows[n] = status[n];
    if (status[n] > worst) worst = status[n];
  }
  return worst;
}

}  // namespace
