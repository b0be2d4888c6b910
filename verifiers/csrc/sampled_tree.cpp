// hr_walk_sampled: the whole walk over a sampled tree on the CPU (rollout/engine/sampled_tree.py's
// walk_sampled is the contract; verifiers/sampled.py walks a chain verified towards the law as a
// tree), the same node step (sampled.h's verify_node) at each node. One task per row; a row's
// sums accumulate in float64 on one thread.

#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

#include "sampled.h"

extern "C" {

// The walk over a sampled tree for every row at once (rollout/engine/sampled_tree.py, walk_sampled):
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
  return report_rows(status, bad_rows);
}

}  // extern "C"
