// Graph algorithms behind the min_sync strategy: reachability bit matrices,
// transitive reduction and maximum bipartite matching (Hopcroft-Karp).
// Plain C++17, no torch. All functions are pure: they may run on several
// threads at once on different (or shared const) inputs.
#pragma once

#include <cstdint>
#include <vector>

#include "schedule/dag.h"

namespace torch_stage::schedule {

// A dense rows x cols bit matrix. Memory: rows * ceil(cols / 64) * 8 bytes
// (10,000 x 10,000 is 12.5 MB).
class BitMatrix {
 public:
  BitMatrix() = default;
  BitMatrix(int rows, int cols);

  int rows() const {
    return rows_;
  }
  int cols() const {
    return cols_;
  }
  int words_per_row() const {
    return words_;
  }
  bool test(int r, int c) const {
    return (bits_[index(r, c)] >> (c & 63)) & 1U;
  }
  void set(int r, int c) {
    bits_[index(r, c)] |= uint64_t{1} << (c & 63);
  }
  const uint64_t* row(int r) const {
    return bits_.data() + static_cast<size_t>(r) * words_;
  }
  uint64_t* row(int r) {
    return bits_.data() + static_cast<size_t>(r) * words_;
  }
  // The first column >= c set in row r and clear in `exclude` (a bit vector
  // of words_per_row() words, or nullptr); -1 if there is none.
  int next(int r, int c, const uint64_t* exclude) const;
  // Sets in row r every bit set in row `other` (same column count).
  void or_row(int r, const BitMatrix& other, int other_row);

 private:
  size_t index(int r, int c) const {
    return static_cast<size_t>(r) * words_ + (c >> 6);
  }

  int rows_ = 0;
  int cols_ = 0;
  int words_ = 0;
  std::vector<uint64_t> bits_;
};

// reach.test(u, v) iff v can be reached from u along one or more edges (of
// either kind). O(V * E / 64) time, V * V / 8 bytes.
BitMatrix reachability(const Dag& dag);

// The minimum equivalent graph: for each node, the successors that are not
// reachable through another successor (the edges no other path implies).
// Returned as successor lists, sorted.
std::vector<std::vector<int>> transitive_reduction(
    const Dag& dag,
    const BitMatrix& reach);

// A matching between left vertices 0..L-1 and right vertices 0..R-1:
// left[u] is u's partner or -1, right[v] likewise.
struct Matching {
  std::vector<int> left;
  std::vector<int> right;
  int size() const;
};

// Maximum bipartite matching by Hopcroft-Karp, O(E sqrt(V)). `adj[u]` lists
// u's right neighbours. Starts from `initial` when it is a matching of the
// right shape (otherwise from a greedy one).
Matching hopcroft_karp(
    int num_right,
    const std::vector<std::vector<int>>& adj,
    const Matching& initial = {});

// The same on a dense adjacency: row u of `adj` holds u's right neighbours
// (adj.cols() right vertices). Used on transitive closures, which can have
// O(V^2) edges: rows are scanned a word at a time and right vertices that can
// no longer lead anywhere in a phase are masked out.
Matching hopcroft_karp(const BitMatrix& adj, const Matching& initial = {});

} // namespace torch_stage::schedule
