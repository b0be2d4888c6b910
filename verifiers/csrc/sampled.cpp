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

// The law a node verifies towards, given its target row tr, p and q [V] (normalised): p itself
// (lossless; a rule that induces p here), else the rule's chain law P_R(y) = chain_prob_at
// (rules.h, ``induced``; its statistics over the p and q arrays) written into law, with its mass.
const float* node_law(const Params& prm, const RowView& tr, const float* __restrict p, const float* __restrict q,
                      float* __restrict law, double& mass) {
  mass = 1.0;
  if (prm.rule == kLossless) return p;
  const RowStats ts = row_stats(tr, wants_top2(prm), wants_entropy(prm));
  RuleState rs;
  rule_context(prm, ts, rs.relax, rs.thr);
  if (prm.rule == kMars) rs.q12 = q[ts.v1] + q[ts.v2];
  if (chain_exact(prm, rs)) return p;
  const int64_t V = tr.n;
  if (full_row_stats(prm)) chain_row_stats_of(prm, V, [=](int64_t i) { return p[i]; }, [=](int64_t i) { return q[i]; }, rs);
  switch (prm.rule) {
    case kMars: mass = law_row<kMars>(prm, rs, ts, p, q, law, V); break;
    case kOvershoot: mass = law_row<kOvershoot>(prm, rs, ts, p, q, law, V); break;
    case kTypical: mass = law_row<kTypical>(prm, rs, ts, p, q, law, V); break;
    case kMinP: mass = law_row<kMinP>(prm, rs, ts, p, q, law, V); break;
    case kCos: mass = law_row<kCos>(prm, rs, ts, p, q, law, V); break;
    default: mass = law_row<-1>(prm, rs, ts, p, q, law, V); break;
  }
  return law;
}

// Recursive rejection at one node towards law [V] (mass law_mass), q in rest [V] (normalised;
// changed: the candidates are removed), s [V] scratch; candidates c[0..M) (-1 padded), uniforms
// u_acc[0..M) and u_fin. Returns the emitted token; accepted = the accepted candidate's index or -1.
int64_t recursive_rejection(const float* law, double law_mass, float* s, float* rest, int64_t V, const int64_t* c,
                            int64_t M, const float* u_acc, float u_fin, int64_t& accepted) {
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
    if (u_acc[i] < ratio) {
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
    float *p = scratch(0, V), *s = scratch(1, V), *rest = scratch(2, V), *law = scratch(4, V);
    for (int64_t n = begin; n < end; ++n) {
      if (!softmax_row(target + n * V, V, t, p)) {
        status[n] = 1;
        continue;
      }
      if (!softmax_row(draft + n * V, V, t, rest)) {
        status[n] = 2;
        continue;
      }
      const int64_t* c = cands + n * M;
      for (int64_t i = 0; i < M && c[i] >= 0; ++i)
        if (!(rest[c[i]] > 0)) status[n] = 4;
      if (status[n]) continue;
      double mass = 1.0;
      const float* to = M > 0 && c[0] >= 0 ? node_law(*prm, RowView{target + n * V, V, t}, p, rest, law, mass) : p;
      int64_t accepted = -1;
      const int64_t y = recursive_rejection(to, mass, s, rest, V, c, M, u_acc + n * M, u_fin[n], accepted);
      tokens[n] = y;
      index[n] = accepted;
      target_lp[n] = std::log(p[y]);
      logp[n] = to == p ? target_lp[n] : static_cast<float>(std::log(to[y] / mass));
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
// truncated), draft [B, N+1, Vd] the draft logits each node's children were drawn from, draft_ids
// [Vd] their target ids, tokens [B, N+1] the nodes' target ids, children [N+1, K] (-1 padded),
// u_acc [B, W, K], u_fin [B, W] float32, prm the rule. At each node: a leaf emits a bonus token from
// p (u_fin); otherwise recursive rejection over its children towards p or the rule's chain law
// P_R(p, q); an accepted child moves the walk on. Outputs [B, W]: out_tokens (-1 padded), logp
// (log P(y); 0 padded), target_lp (log p(y); 0 padded), kinds (0 accepted, 1 recovered, 2 bonus, -1
// padded), path (the node whose row was used; 0 padded); emitted [B]. Returns 0, or 1 / 2 (a bad
// target / draft row: bad_rows[b] set), 4 (a child with q = 0).
int64_t hr_walk_sampled(const float* target, const float* draft, const int64_t* draft_ids, const int64_t* tokens,
                        const int64_t* children, const float* u_acc, const float* u_fin, int64_t B, int64_t N1,
                        int64_t V, int64_t Vd, int64_t K, int64_t W, double temperature, const Params* prm,
                        int64_t* out_tokens, float* logp, float* target_lp, int64_t* kinds, int64_t* path,
                        int64_t* emitted, uint8_t* bad_rows) {
  std::vector<uint8_t> status(B, 0);
  const float t = static_cast<float>(temperature);
  const bool lossy = prm->rule != kLossless;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    float *p = scratch(0, V), *s = scratch(1, V), *rest = scratch(2, V), *qd = scratch(3, Vd);
    float* law = lossy ? scratch(4, V) : nullptr;
    std::vector<int64_t> cands(K);
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t l = 0; l < W; ++l) {
        out_tokens[b * W + l] = -1, logp[b * W + l] = 0.0f, target_lp[b * W + l] = 0.0f, kinds[b * W + l] = -1;
        path[b * W + l] = 0;
      }
      int64_t node = 0, n = 0;
      for (int64_t level = 0; level < W; ++level) {
        if (!softmax_row(target + (b * N1 + node) * V, V, t, p)) {
          status[b] = 1;
          break;
        }
        const int64_t* kids = children + node * K;
        int64_t m = 0;
        while (m < K && kids[m] >= 0) cands[m] = tokens[b * N1 + kids[m]], ++m;
        int64_t y, accepted = -1;
        const float* to = p;
        double mass = 1.0;
        if (m == 0) {
          double total = 0;
#pragma omp simd reduction(+ : total)
          for (int64_t j = 0; j < V; ++j) total += p[j];
          y = inverse_cdf(p, V, total, u_fin[b * W + level]);
        } else {
          if (!softmax_row(draft + (b * N1 + node) * Vd, Vd, t, qd)) {
            status[b] = 2;
            break;
          }
          std::fill(rest, rest + V, 0.0f);
          for (int64_t j = 0; j < Vd; ++j) rest[draft_ids[j]] = qd[j];
          for (int64_t i = 0; i < m; ++i)
            if (!(rest[cands[i]] > 0)) status[b] = 4;
          if (status[b]) break;
          if (lossy) to = node_law(*prm, RowView{target + (b * N1 + node) * V, V, t}, p, rest, law, mass);
          y = recursive_rejection(to, mass, s, rest, V, cands.data(), m, u_acc + (b * W + level) * K,
                                  u_fin[b * W + level], accepted);
        }
        out_tokens[b * W + level] = y;
        target_lp[b * W + level] = std::log(p[y]);
        logp[b * W + level] = to == p ? target_lp[b * W + level] : static_cast<float>(std::log(to[y] / mass));
        kinds[b * W + level] = accepted >= 0 ? 0 : (m > 0 ? 1 : 2);
        path[b * W + level] = node;
        ++n;
        if (accepted < 0) break;
        node = kids[accepted];
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
