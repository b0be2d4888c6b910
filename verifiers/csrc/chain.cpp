// Fused chain verification with sampled drafts on the CPU (the same procedure as
// verifiers/chain.py, whose docstring is the contract; verifiers/README.md has the math).
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
//
// The rule-specific steps come from rules.h, the shared row work from common.h.

#include <ATen/Parallel.h>

#include "rules.h"

namespace {

struct Position {  // what phase 2 (and phase 3's statistics) work out at one drafted position
  float p_x = 0, q_x = 0, a = 0;
  RuleState rule;
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

  // Phase 3, statistics at drafted position j of row b.
  void stats(int64_t b, int64_t j, const RowStats& ts, const RowStats& qs, Position& pos) const {
    chain_row_stats(prm, trow(b, j), drow(b, j), ts, qs, pos.rule);
  }

  // Sums of the weights over blocks of kBlock tokens (block_sums has ceil(V / kBlock) entries).
  void block_sums(int64_t b, int64_t n, int kind, const RowStats& ts, const RowStats* qs, double* sums) const {
    const RowView tr = trow(b, n);
    if (kind != kResidual) {
      p_block_sums(tr, ts, &x[b * K + n], kind == kPWithout ? 1 : 0, sums);
      return;
    }
    const float tm = ts.zmax, ti = ts.inv_sum, t = temperature, qm = qs->zmax, qi = qs->inv_sum;
    const float *td = tr.data, *dd = drow(b, n).data;
    weight_block_sums(V, [=](int64_t i) {
      const float zt = t == 1.0f ? td[i] : td[i] / t;
      const float zq = t == 1.0f ? dd[i] : dd[i] / t;
      const float w = exp_nonpos(zt - tm) * ti - exp_nonpos(zq - qm) * qi;
      return w > 0 ? w : 0.0f;
    }, sums);
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
  const bool top2 = wants_top2(*prm), entropy = wants_entropy(*prm);

  // phase 1: every target and draft row
  at::parallel_for(0, nt + nd, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      if (r < nt) {
        const int64_t b = r / (K + 1), j = r % (K + 1);
        ts[r] = row_stats(kn.trow(b, j), top2 && j < K, entropy && j < K);
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
      chain_context(*prm, t, kn.drow(b, j), q, ps.rule);
      ps.a = chain_accept(*prm, ps.p_x, ps.q_x, xj, t, ps.rule);
      if (!(u_accept[b * K + j] < ps.a)) n = j;
    }
    n_acc[b] = n;
  }

  // phase 3: row statistics at positions j <= min(n_acc, K - 1) and the final rows' block sums
  struct Task { int64_t b, j; bool final_row; };
  std::vector<Task> tasks;
  if (full_row_stats(*prm))
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j <= (n_acc[b] < K - 1 ? n_acc[b] : K - 1); ++j) tasks.push_back({b, j, false});
  const int64_t nblocks = (V + kBlock - 1) / kBlock;
  std::vector<double> sums(B * nblocks);
  std::vector<int> kind(B);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = n_acc[b];
    kind[b] = n == K ? kP : rejected_weights(*prm, pos[b * K + n].rule);
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
      if (!(total > 0) && kind[b] == kResidual) {  // p <= q everywhere: the residual is p
        kind[b] = kP;
        kn.block_sums(b, n, kP, tf, nullptr, bs);
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
        if (chain_exact(*prm, ps.rule)) {
          blp[j] = tlp[j];
          rel[j] = false;
        } else {
          const double P = chain_prob_at(*prm, ps.p_x, ps.q_x, xj, ps.rule, ts[b * (K + 1) + j]);
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
      if (n == K || chain_exact(*prm, pos[b * K + n].rule)) {
        blp[n] = tlp[n];
      } else {
        const Position& ps = pos[b * K + n];
        const float q_y = prob(kn.drow(b, n), qs[b * K + n], y);
        const double P = chain_prob_at(*prm, p_y, q_y, y, ps.rule, ts[b * (K + 1) + n]);
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
