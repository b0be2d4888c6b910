// Sampled candidates on the CPU (verifiers/sampled.py is the contract; verifiers/README.md,
// "Sampled candidates", has the math), the same procedure on the same uniforms as the PyTorch
// code there:
//
// - hr_draw_sampled: m ids per row drawn from q = softmax(logits / T) without replacement, each
//   by inverse CDF over q with the earlier draws removed (one float64 uniform per draw);
// - hr_verify_sampled: recursive rejection at N nodes: s = P (p, or a lossy rule's chain law
//   P_R(p, q), rules.h's closed form); c_i is accepted with min(1, s(c_i) / q_i(c_i)), else
//   s = norm((s - q_i)+); the fallback y ~ s;
// - hr_walk_sampled: the whole walk over a sampled tree, one task per row (the same node step).
//
// The node step (verify_node) tests the first candidate from the rows' statistics alone (max and
// normaliser of the target and draft rows, the rule's closed form P_R(c_1) = chain_prob_at; a
// vocabulary pass for the rules whose law needs row sums): most nodes accept it, and then no
// vocabulary-sized row is written. p, q and P_R are written out only when c_1 is rejected; the
// recursion then goes on from the state after that rejection. The same procedure, on the same
// uniforms, as the PyTorch code (which tests c_1 against the written rows: equal up to rounding).
//
// One task per row; a row's sums accumulate in float64 on one thread.

#include <ATen/Parallel.h>

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

// Per-thread scratch rows (reused across calls: no zeroing of vocabulary-sized buffers).
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

// One node: y ~ p at a leaf (m = 0); else recursive rejection over the candidates c[0..m) towards
// p (lossless) or the rule's chain law P_R(p, q).
NodeResult verify_node(const Params& prm, const RowView& tr, const DraftRow& dr, const int64_t* c, int64_t m,
                       const float* u_acc, float u_fin, const NodeScratch& sc) {
  NodeResult out;
  const int64_t V = tr.n;
  if (m == 0) {  // a bonus token
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
  auto write_rows = [&] {
    softmax_row(tr.data, V, tr.temperature, sc.p);
    if (!dr.ids) {
      softmax_row(dr.rv.data, V, dr.rv.temperature, sc.rest);
    } else {
      softmax_row(dr.rv.data, dr.rv.n, dr.rv.temperature, sc.qd);
      std::fill(sc.rest, sc.rest + V, 0.0f);
      for (int64_t j = 0; j < dr.rv.n; ++j) sc.rest[dr.ids[j]] = sc.qd[j];
    }
    written = true;
  };
  if (!exact && full_row_stats(prm)) {
    if (!dr.ids) {  // q over the target vocabulary: the sums straight from the logits
      chain_row_stats(prm, tr, dr.rv, ts, qs, rs);
    } else {
      write_rows();
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
  if (m == 1 && !dr.ids) {  // a chain's position: y ~ norm((P_R - q)+) without writing rows
    const float *td = tr.data, *dd = dr.rv.data;
    const float t = tr.temperature, tm = ts.zmax, ti = ts.inv_sum, qm = qs.zmax, qi = qs.inv_sum;
    auto p_at = [=](int64_t i) { return exp_nonpos((t == 1.0f ? td[i] : td[i] / t) - tm) * ti; };
    auto q_at_row = [=](int64_t i) { return exp_nonpos((t == 1.0f ? dd[i] : dd[i] / t) - qm) * qi; };
    double* sums = sc.sums;
    out.y = draw_after_rejection_of(prm, exact, rs, ts, p_at, q_at_row, V, true, u_fin, sums);
    if (out.y < 0)  // P_R <= q everywhere: P_R = q, the rejection had probability 0 (kept: y ~ P_R)
      out.y = draw_after_rejection_of(prm, exact, rs, ts, p_at, q_at_row, V, false, u_fin, sums);
    const float p_y = p_at(out.y);
    out.target_lp = std::log(p_y);
    out.logp = exact ? out.target_lp
                     : static_cast<float>(std::log(chain_prob_at(prm, p_y, q_at_row(out.y), out.y, rs, ts)));
    return out;
  }
  if (!written) write_rows();
  double mass = 1.0;
  const float* to = exact ? sc.p : sc.law;
  if (!exact) mass = law_of(prm, rs, ts, sc.p, sc.rest, sc.law, V);
  out.y = recursive_rejection(to, mass, sc.s, sc.rest, V, c, m, u_acc, u_fin, 1, out.accepted);
  out.target_lp = std::log(sc.p[out.y]);
  out.logp = exact ? out.target_lp : static_cast<float>(std::log(to[out.y] / mass));
  return out;
}

}  // namespace

extern "C" {

// logits [R, V] float32, u [m, R] float64; out [R, m] int64 (-1 where q has no mass left).
// Returns 0, or 1 with bad_rows[r] = 1 for a NaN, +inf or all -inf row.
int64_t hr_draw_sampled(const float* logits, const double* u, int64_t R, int64_t V, int64_t m, double temperature,
                        int64_t* out, uint8_t* bad_rows) {
  std::vector<uint8_t> bad(R, 0);
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    float* q = scratch(0, V);
    for (int64_t r = begin; r < end; ++r) {
      if (!softmax_row(logits + r * V, V, static_cast<float>(temperature), q)) {
        bad[r] = 1;
        continue;
      }
      for (int64_t i = 0; i < m; ++i) {
        double total = 0;
#pragma omp simd reduction(+ : total)
        for (int64_t j = 0; j < V; ++j) total += q[j];
        const int64_t pick = total > 0 ? inverse_cdf(q, V, total, u[i * R + r]) : -1;
        out[r * m + i] = pick;
        if (pick >= 0) q[pick] = 0.0f;
      }
    }
  });
  int64_t status = 0;
  for (int64_t r = 0; r < R; ++r) {
    bad_rows[r] = bad[r];
    if (bad[r]) status = 1;
  }
  return status;
}

// target, draft [N, V] float32 logits (the target already truncated: -inf outside its support),
// cands [N, M] int64 in draw order (-1 padded after the valid ones), u_acc [N, M], u_fin [N]
// float32, prm the rule (a node with no candidates emits from p). Outputs tokens, index (-1: none
// accepted), logp = log P(y) (the law verified towards), target_lp = log p(y). Returns 0; 1 (a bad
// target row) or 2 (a bad draft row) with bad_rows[n] set; 4 when a candidate has q = 0.
int64_t hr_verify_sampled(const float* target, const float* draft, const int64_t* cands, const float* u_acc,
                          const float* u_fin, int64_t N, int64_t M, int64_t V, double temperature, const Params* prm,
                          int64_t* tokens, int64_t* index, float* logp, float* target_lp, uint8_t* bad_rows) {
  std::vector<uint8_t> status(N, 0);
  const float t = static_cast<float>(temperature);
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    const NodeScratch sc{scratch(0, V), scratch(1, V), scratch(2, V), nullptr, scratch(4, V), block_scratch(V)};
    for (int64_t n = begin; n < end; ++n) {
      const int64_t* c = cands + n * M;
      int64_t m = 0;
      while (m < M && c[m] >= 0) ++m;
      const DraftRow dr{RowView{draft + n * V, V, t}, nullptr, nullptr};
      if (m == 0 && row_stats(dr.rv, false, false).bad) {  // a bonus node's draft row is checked too
        status[n] = row_stats(RowView{target + n * V, V, t}, false, false).bad ? 1 : 2;
        continue;
      }
      const NodeResult r = verify_node(*prm, RowView{target + n * V, V, t}, dr, c, m, u_acc + n * M, u_fin[n], sc);
      status[n] = static_cast<uint8_t>(r.status);
      if (r.status) continue;
      tokens[n] = r.y;
      index[n] = r.accepted;
      target_lp[n] = r.target_lp;
      logp[n] = r.logp;
    }
  });
  int64_t worst = 0;
  for (int64_t n = 0; n < N; ++n) {
    bad_rows[n] = status[n];
    if (status[n] > worst) worst = status[n];
  }
  return worst;
}


// The walk over a sampled tree for every row at once (rollout/sampled_tree.py, walk_sampled):
// target [B, N+1, V] float32 logits (row of node i = the target's prediction after node i; already
// truncated), draft [B, ND, Vd] the draft logits each node's children were drawn from (row i: node i;
// ND >= every node with children, N+1 for a tree, K for a chain whose last node is a leaf), draft_ids
// [Vd] their target ids, tokens [B, N+1] the nodes' target ids, children [N+1, K] (-1 padded),
// u_acc [B, W, K], u_fin [B, W] float32, prm the rule. At each node: a leaf emits a bonus token from
// p (u_fin); otherwise recursive rejection over its children towards p or the rule's chain law
// P_R(p, q); an accepted child moves the walk on. Outputs [B, W]: out_tokens (-1 padded), logp
// (log P(y); 0 padded), target_lp (log p(y); 0 padded), kinds (0 accepted, 1 recovered, 2 bonus, -1
// padded), path (the node whose row was used; 0 padded); emitted [B]. Returns 0, or 1 / 2 (a bad
// target / draft row: bad_rows[b] set), 4 (a child with q = 0), and before any walk 5 (a draft id
// outside [0, V): the inverse map would be written past its end) or 6 (ND > N+1, or a node from ND
// on has children: its draft row would be read past the end).
int64_t hr_walk_sampled(const float* target, const float* draft, const int64_t* draft_ids, const int64_t* tokens,
                        const int64_t* children, const float* u_acc, const float* u_fin, int64_t B, int64_t N1,
                        int64_t ND, int64_t V, int64_t Vd, int64_t K, int64_t W, double temperature, const Params* prm,
                        int64_t* out_tokens, float* logp, float* target_lp, int64_t* kinds, int64_t* path,
                        int64_t* emitted, uint8_t* bad_rows) {
  if (ND > N1) return 6;
  for (int64_t i = ND * K; i < N1 * K; ++i)
    if (children[i] >= 0) return 6;
  bool identity = Vd == V;  // draft ids 0..V-1 (a chain walked as a tree): q needs no scatter
  for (int64_t j = 0; j < Vd; ++j) {
    if (draft_ids[j] < 0 || draft_ids[j] >= V) return 5;
    identity = identity && draft_ids[j] == j;
  }
  std::vector<uint8_t> status(B, 0);
  const float t = static_cast<float>(temperature);
  std::vector<int32_t> inv(identity ? 0 : V, -1);
  for (int64_t j = 0; !identity && j < Vd; ++j) inv[draft_ids[j]] = static_cast<int32_t>(j);
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    const NodeScratch sc{scratch(0, V), scratch(1, V), scratch(2, V), identity ? nullptr : scratch(3, Vd),
                         scratch(4, V), block_scratch(V)};
    std::vector<int64_t> cands(K);
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t l = 0; l < W; ++l) {
        out_tokens[b * W + l] = -1, logp[b * W + l] = 0.0f, target_lp[b * W + l] = 0.0f, kinds[b * W + l] = -1;
        path[b * W + l] = 0;
      }
      int64_t node = 0, n = 0;
      for (int64_t level = 0; level < W; ++level) {
        const int64_t* kids = children + node * K;
        int64_t m = 0;
        while (m < K && kids[m] >= 0) cands[m] = tokens[b * N1 + kids[m]], ++m;
        const DraftRow dr{RowView{draft + (b * ND + (m > 0 ? node : 0)) * Vd, Vd, t}, identity ? nullptr : draft_ids,
                          identity ? nullptr : inv.data()};
        const NodeResult r = verify_node(*prm, RowView{target + (b * N1 + node) * V, V, t}, dr, cands.data(), m,
                                         u_acc + (b * W + level) * K, u_fin[b * W + level], sc);
        if (r.status) {
          status[b] = static_cast<uint8_t>(r.status);
          break;
        }
        out_tokens[b * W + level] = r.y;
        target_lp[b * W + level] = r.target_lp;
        logp[b * W + level] = r.logp;
        kinds[b * W + level] = r.accepted >= 0 ? 0 : (m > 0 ? 1 : 2);
        path[b * W + level] = node;
        ++n;
        if (r.accepted < 0) break;
        node = kids[r.accepted];
      }
      emitted[b] = n;
    }
  });
  int64_t worst = 0;
  for (int64_t b = 0; b < B; ++b) {
    bad_rows[b] = status[b];
    if (status[b] > worst) worst = status[b];
  }
  return worst;
}

}  // extern "C"
