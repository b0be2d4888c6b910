// Sampled candidates on the CPU (verifiers/sampled.py is the contract; verifiers/README.md,
// "Sampled candidates", has the math), the same procedure on the same uniforms as the PyTorch
// code there:
//
// - hr_draw_sampled: m ids per row drawn from q = softmax(logits / T) without replacement, each
//   by inverse CDF over q with the earlier draws removed (one float64 uniform per draw);
// - hr_verify_sampled: recursive rejection at N nodes: s = P (p, or a lossy rule's chain law
//   P_R(p, q), rules.h's closed form); c_i is accepted with min(1, s(c_i) / q_i(c_i)), else
//   s = norm((s - q_i)+); the fallback y ~ s.
//
// The node step (verify_node) and the row helpers are in sampled.h, shared with the walk over a
// whole sampled tree (sampled_tree.cpp, hr_walk_sampled). One task per row; a row's sums
// accumulate in float64 on one thread.

#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

#include "sampled.h"

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
  return report_rows(status, bad_rows);
}

}  // extern "C"
