// hr_walk_block_tree: block verification of sampled trees on the CPU (verifiers/block_tree.py is
// the contract and the PyTorch backend: the walk_row there, on the same uniforms).
//
// Phase 1, every target and draft row in parallel: max, NaN check, normaliser (no row written).
// Phase 2, one task per batch row: the walk. Along a spine the block weights come from the rows'
// statistics alone (p and q at the drafted tokens); a residual mass r_j is one pass over row j,
// and only where the stop test reaches it (from the longest prefix down). At a stop node with a
// first child, p and q are written out once, R = (w_n p - q)+ built, and sampled.h's recursive
// rejection tries the other children towards it (q without the first child) and draws the final
// token from what is left; at a leaf the bonus token comes from p. A row's sums accumulate in
// float64 on one thread, so results do not depend on the thread count.

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "sampled.h"

extern "C" {

// target, draft [B, N1, V] float32 logits (draft row v: what node v's children were drawn from,
// over the target vocabulary, -inf outside the draft's; both already truncated and divided by the
// temperature where top-k / top-p apply), tokens [B, N1] target ids (node 0: the root), children
// [N1, K] in draw order (-1 padded; one shape for every row), depths [N1], u_block [B, W, W]
// float64, u_sibling [B, W, K] float32, u_final [B] float32. Outputs [B, W]: out_tokens (-1
// padded), logp (log p(y), 0 padded), kinds (0 accepted, 1 recovered, 2 bonus, -1 padded), path
// (the node each token was drawn from; 0 padded); emitted [B]. Returns 0, or 1 (a bad target row)
// / 2 (a bad draft row), bad_rows [B] flagging the rows, 4 (a child with q = 0 at its parent), 5
// (a token outside [0, V)), 6 (an internal error: a residual without mass where one was needed).
int64_t hr_walk_block_tree(const float* target, const float* draft, const int64_t* tokens, const int64_t* children,
                           const int64_t* depths, const double* u_block, const float* u_sibling, const float* u_final,
                           int64_t B, int64_t N1, int64_t V, int64_t K, int64_t W, double temperature,
                           int64_t* out_tokens, float* logp, int64_t* kinds, int64_t* path, int64_t* emitted,
                           uint8_t* bad_rows) {
  for (int64_t i = 0; i < B * N1; ++i)
    if (tokens[i] < 0 || tokens[i] >= V) return 5;
  const float t = static_cast<float>(temperature);
  auto trow = [&](int64_t b, int64_t v) { return RowView{target + (b * N1 + v) * V, V, t}; };
  auto drow = [&](int64_t b, int64_t v) { return RowView{draft + (b * N1 + v) * V, V, t}; };
  std::vector<uint8_t> inner(N1, 0);
  for (int64_t v = 0; v < N1; ++v) inner[v] = children[v * K] >= 0;

  // phase 1: the statistics of every target row and of the draft rows of nodes with children
  std::vector<RowStats> ts(B * N1), qs(B * N1);
  at::parallel_for(0, 2 * B * N1, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const int64_t i = r % (B * N1), b = i / N1, v = i % N1;
      if (r < B * N1)
        ts[i] = row_stats(trow(b, v), false, false);
      else if (inner[v])
        qs[i] = row_stats(drow(b, v), false, false);
    }
  });
  std::vector<uint8_t> status(B, 0);
  for (int64_t i = 0; i < B * N1; ++i) {
    if (ts[i].bad) status[i / N1] = 1;
    else if (inner[i % N1] && qs[i].bad && status[i / N1] == 0) status[i / N1] = 2;
  }
  bool any_bad = false;
  for (int64_t b = 0; b < B; ++b) any_bad |= status[b] != 0;
  if (any_bad) return report_rows(status, bad_rows);

  // phase 2: the walks
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    float* p = scratch(0, V);
    float* rest = scratch(1, V);
    float* law = scratch(2, V);
    float* s = scratch(3, V);
    double* sums = block_scratch(V);
    const NodeScratch sc{p, s, rest, nullptr, law, sums};
    std::vector<int64_t> spine, spares(K > 1 ? K - 1 : 1);
    std::vector<double> w(W + 1);
    std::vector<float> p_x(W + 1);
    for (int64_t b = begin; b < end; ++b) {
      int64_t* tok = out_tokens + b * W;
      float* lp = logp + b * W;
      int64_t* kd = kinds + b * W;
      int64_t* pa = path + b * W;
      for (int64_t l = 0; l < W; ++l) tok[l] = -1, lp[l] = 0.0f, kd[l] = -1, pa[l] = 0;
      int64_t node = 0, m = 0;  // the walk's start, tokens emitted
      auto accept = [&](int64_t v, float log_p) {  // an accepted node's token; the next comes from v
        tok[m] = tokens[b * N1 + v], lp[m] = log_p, kd[m] = 0;
        ++m;
        pa[m] = v;
      };
      for (;;) {
        spine.assign(1, node);
        while (children[spine.back() * K] >= 0) spine.push_back(children[spine.back() * K]);
        const int64_t k = static_cast<int64_t>(spine.size()) - 1;
        const double* ub = u_block + (b * W + depths[node]) * W;
        w[0] = 1.0;
        for (int64_t j = 0; j < k; ++j) {
          const int64_t v = spine[j], x = tokens[b * N1 + spine[j + 1]];
          p_x[j] = prob(trow(b, v), ts[b * N1 + v], x);
          const float q_x = prob(drow(b, v), qs[b * N1 + v], x);
          if (!(q_x > 0)) {
            status[b] = 4;
            break;
          }
          const double next = w[j] * (static_cast<double>(p_x[j]) / static_cast<double>(q_x));
          w[j + 1] = next < 1.0 ? next : 1.0;
        }
        if (status[b]) break;
        int64_t n = 0;  // the longest prefix whose test passes (h_0 = 1)
        if (ub[k] < w[k]) {
          n = k;
        } else {
          for (int64_t j = k - 1; j >= 1; --j) {
            const int64_t v = spine[j];
            const RowView tr = trow(b, v), dr = drow(b, v);
            const RowStats &st = ts[b * N1 + v], &sq = qs[b * N1 + v];
            const float wj = static_cast<float>(w[j]), tm = st.zmax, ti = st.inv_sum, qm = sq.zmax, qi = sq.inv_sum;
            double r = 0;
#pragma omp simd reduction(+ : r)
            for (int64_t i = 0; i < V; ++i) {
              const float d = wj * (exp_nonpos(tr.z(i) - tm) * ti) - exp_nonpos(dr.z(i) - qm) * qi;
              r += d > 0 ? d : 0.0f;
            }
            const double den = r + 1.0 - w[j];
            const double h = den > 0 ? r / den : 1.0;
            if (ub[j] < h) {
              n = j;
              break;
            }
          }
        }
        for (int64_t j = 1; j <= n; ++j) accept(spine[j], std::log(p_x[j - 1]));
        const int64_t stop = spine[n];
        if (n == k) {  // the bonus token at the spine's leaf
          const NodeResult r = bonus_token(trow(b, stop), u_final[b], sc);
          tok[m] = r.y, lp[m] = r.logp, kd[m] = 2;
          ++m;
          break;
        }
        // R = (w_n p - q)+ at the stop node, tried with its other children (q without the first)
        softmax_row(trow(b, stop).data, V, t, p);
        softmax_row(drow(b, stop).data, V, t, rest);
        const float wn = static_cast<float>(w[n]);
        double mass = 0;
#pragma omp simd reduction(+ : mass)
        for (int64_t i = 0; i < V; ++i) {
          const float d = wn * p[i] - rest[i];
          law[i] = d > 0 ? d : 0.0f;
          mass += law[i];
        }
        if (!(mass > 0)) {  // only rounding reaches it (w_n = 1, p = q): R is p
          mass = 0;
          for (int64_t i = 0; i < V; ++i) law[i] = p[i], mass += p[i];
        }
        rest[tokens[b * N1 + spine[n + 1]]] = 0.0f;
        const int64_t* kids = children + stop * K;
        int64_t nspare = 0;
        for (int64_t i = 1; i < K && kids[i] >= 0; ++i) spares[nspare++] = tokens[b * N1 + kids[i]];
        for (int64_t i = 0; i < nspare; ++i)
          if (!(rest[spares[i]] > 0)) status[b] = 4;
        if (status[b]) break;
        int64_t taken = -1;
        const int64_t y = recursive_rejection(law, mass, s, rest, V, spares.data(), nspare,
                                              u_sibling + (b * W + depths[stop]) * K, u_final[b], 0, taken);
        if (y < 0) {
          status[b] = 6;
          break;
        }
        if (taken >= 0) {
          accept(kids[taken + 1], std::log(p[y]));
          node = kids[taken + 1];
          continue;
        }
        tok[m] = y, lp[m] = std::log(p[y]), kd[m] = 1;
        ++m;
        break;
      }
      emitted[b] = m;
    }
  });
  return report_rows(status, bad_rows);
}

}  // extern "C"
