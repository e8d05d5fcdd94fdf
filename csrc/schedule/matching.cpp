#include "schedule/matching.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

namespace torch_stage::schedule {

namespace {

constexpr int kInf = std::numeric_limits<int>::max();

int words_for(int bits) {
  return (bits + 63) / 64;
}

bool test_bit(const std::vector<uint64_t>& bits, int i) {
  return (bits[i >> 6] >> (i & 63)) & 1U;
}

void set_bit(std::vector<uint64_t>& bits, int i) {
  bits[i >> 6] |= uint64_t{1} << (i & 63);
}

// Adjacency lists, walked by position.
struct ListAdjacency {
  const std::vector<std::vector<int>>& adj;
  int num_right;

  int num_left() const {
    return static_cast<int>(adj.size());
  }
  int next(int u, int& cursor, const std::vector<uint64_t>& exclude) const {
    const auto& list = adj[u];
    while (cursor < static_cast<int>(list.size())) {
      const int v = list[cursor++];
      if (!test_bit(exclude, v)) {
        return v;
      }
    }
    return -1;
  }
};

// Bit rows, walked by column, a word at a time.
struct BitAdjacency {
  const BitMatrix& adj;

  int num_left() const {
    return adj.rows();
  }
  int next(int u, int& cursor, const std::vector<uint64_t>& exclude) const {
    if (cursor >= adj.cols()) {
      return -1;
    }
    const int v = adj.next(u, cursor, exclude.data());
    cursor = v < 0 ? adj.cols() : v + 1;
    return v;
  }
};

template <typename Adjacency>
Matching run_hopcroft_karp(
    const Adjacency& graph,
    int num_right,
    const Matching& initial) {
  const int num_left = graph.num_left();
  const int words = std::max(1, words_for(num_right));
  Matching m;
  const bool usable = static_cast<int>(initial.left.size()) == num_left &&
      static_cast<int>(initial.right.size()) == num_right;
  if (usable) {
    m = initial;
  } else {
    // Greedy start: each left vertex takes its first free neighbour.
    m.left.assign(num_left, -1);
    m.right.assign(num_right, -1);
    std::vector<uint64_t> taken(words, 0);
    for (int u = 0; u < num_left; ++u) {
      int cursor = 0;
      const int v = graph.next(u, cursor, taken);
      if (v >= 0) {
        m.left[u] = v;
        m.right[v] = u;
        set_bit(taken, v);
      }
    }
  }

  std::vector<int> dist(num_left);
  std::vector<int> queue;
  std::vector<int> cursor(num_left);
  std::vector<uint64_t> mask(words);
  // Iterative DFS state: the left vertices on the current path and, for each,
  // the right vertex it is trying.
  std::vector<int> path_left;
  std::vector<int> path_right;
  while (true) {
    // BFS from every free left vertex, in layers, up to the first layer that
    // reaches a free right vertex.
    queue.clear();
    for (int u = 0; u < num_left; ++u) {
      if (m.left[u] < 0) {
        dist[u] = 0;
        queue.push_back(u);
      } else {
        dist[u] = kInf;
      }
    }
    std::fill(mask.begin(), mask.end(), 0);
    int limit = kInf;
    for (size_t head = 0; head < queue.size(); ++head) {
      const int u = queue[head];
      if (dist[u] + 1 > limit) {
        break;
      }
      int c = 0;
      for (int v = graph.next(u, c, mask); v >= 0; v = graph.next(u, c, mask)) {
        set_bit(mask, v);
        const int w = m.right[v];
        if (w < 0) {
          limit = std::min(limit, dist[u] + 1);
        } else if (dist[w] == kInf) {
          dist[w] = dist[u] + 1;
          queue.push_back(w);
        }
      }
    }
    if (limit == kInf) {
      break;
    }
    // DFS along the layers for vertex-disjoint shortest augmenting paths.
    // `mask` now marks right vertices that lead nowhere in this phase.
    std::fill(mask.begin(), mask.end(), 0);
    std::fill(cursor.begin(), cursor.end(), 0);
    for (int root = 0; root < num_left; ++root) {
      if (m.left[root] >= 0 || dist[root] != 0) {
        continue;
      }
      path_left.assign(1, root);
      path_right.clear();
      while (!path_left.empty()) {
        const int u = path_left.back();
        const int v = graph.next(u, cursor[u], mask);
        if (v < 0) {
          // u is a dead end; so is the right vertex that led here.
          dist[u] = kInf;
          path_left.pop_back();
          if (!path_right.empty()) {
            set_bit(mask, path_right.back());
            path_right.pop_back();
          }
          continue;
        }
        const int w = m.right[v];
        if (w < 0) {
          if (dist[u] + 1 != limit) {
            continue;
          }
          path_right.push_back(v);
          for (size_t k = 0; k < path_left.size(); ++k) {
            m.left[path_left[k]] = path_right[k];
            m.right[path_right[k]] = path_left[k];
          }
          break;
        }
        if (dist[w] == kInf) {
          set_bit(mask, v);
        } else if (dist[w] == dist[u] + 1) {
          path_right.push_back(v);
          path_left.push_back(w);
        }
      }
    }
  }
  return m;
}

} // namespace

BitMatrix::BitMatrix(int rows, int cols)
    : rows_(rows),
      cols_(cols),
      words_(words_for(cols)),
      bits_(static_cast<size_t>(rows) * words_for(cols), 0) {
  if (rows < 0 || cols < 0) {
    throw std::invalid_argument(
        "BitMatrix: rows and cols must be >= 0, got " + std::to_string(rows) +
        " x " + std::to_string(cols));
  }
}

int BitMatrix::next(int r, int c, const uint64_t* exclude) const {
  if (c >= cols_) {
    return -1;
  }
  const uint64_t* bits = row(r);
  int w = c >> 6;
  uint64_t word = bits[w] & (~uint64_t{0} << (c & 63));
  if (exclude != nullptr) {
    word &= ~exclude[w];
  }
  while (word == 0) {
    if (++w >= words_) {
      return -1;
    }
    word = bits[w];
    if (exclude != nullptr) {
      word &= ~exclude[w];
    }
  }
  const int found = (w << 6) + __builtin_ctzll(word);
  return found < cols_ ? found : -1;
}

void BitMatrix::or_row(int r, const BitMatrix& other, int other_row) {
  uint64_t* dst = row(r);
  const uint64_t* src = other.row(other_row);
  for (int w = 0; w < words_; ++w) {
    dst[w] |= src[w];
  }
}

BitMatrix reachability(const Dag& dag) {
  const int n = dag.size();
  BitMatrix reach(n, n);
  for (int u = n - 1; u >= 0; --u) {
    for (const int s : dag.successors(u)) {
      reach.set(u, s);
      reach.or_row(u, reach, s);
    }
  }
  return reach;
}

std::vector<std::vector<int>> transitive_reduction(
    const Dag& dag,
    const BitMatrix& reach) {
  const int n = dag.size();
  std::vector<std::vector<int>> kept(n);
  BitMatrix covered(1, n);
  for (int u = 0; u < n; ++u) {
    const auto& succs = dag.successors(u);
    if (succs.size() == 1) {
      kept[u] = succs;
      continue;
    }
    std::fill(covered.row(0), covered.row(0) + covered.words_per_row(), 0);
    // Ascending order is a topological order: a successor reachable through
    // another one comes after it, so it is already covered when seen.
    for (const int s : succs) {
      if (covered.test(0, s)) {
        continue;
      }
      kept[u].push_back(s);
      covered.set(0, s);
      covered.or_row(0, reach, s);
    }
  }
  return kept;
}

int Matching::size() const {
  return static_cast<int>(
      std::count_if(left.begin(), left.end(), [](int v) { return v >= 0; }));
}

Matching hopcroft_karp(
    int num_right,
    const std::vector<std::vector<int>>& adj,
    const Matching& initial) {
  for (size_t u = 0; u < adj.size(); ++u) {
    for (const int v : adj[u]) {
      if (v < 0 || v >= num_right) {
        throw std::invalid_argument(
            "hopcroft_karp: left vertex " + std::to_string(u) +
            " has right neighbour " + std::to_string(v) + ", outside 0.." +
            std::to_string(num_right - 1));
      }
    }
  }
  return run_hopcroft_karp(ListAdjacency{adj, num_right}, num_right, initial);
}

Matching hopcroft_karp(const BitMatrix& adj, const Matching& initial) {
  return run_hopcroft_karp(BitAdjacency{adj}, adj.cols(), initial);
}

} // namespace torch_stage::schedule
