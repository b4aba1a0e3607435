// Typed ids. A NodeId is an agent's node id (BALLAST_NODE_ID: the host, pod
// or Slurm node name people know the node by); a Round is one of a job's
// rounds (each change of the world is a new, larger one; 0: none yet). As
// their own types, a node id cannot be passed where a host name is wanted, nor
// a round where a step or a rank is: the compiler says so. They convert from
// and to the wire (proto strings and int64s) explicitly, at the RPC boundary.
//
// Both are values: cheap to copy, ordered, hashable, printable with fmt and
// streams (gtest messages).
#pragma once

#include <compare>
#include <cstddef>
#include <cstdint>
#include <ostream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fmt/format.h"

namespace ballast {

class NodeId {
 public:
  NodeId() = default;
  explicit NodeId(std::string id) : id_(std::move(id)) {}
  explicit NodeId(std::string_view id) : id_(id) {}
  explicit NodeId(const char* id) : id_(id) {}

  const std::string& str() const { return id_; }
  bool empty() const { return id_.empty(); }

  friend bool operator==(const NodeId&, const NodeId&) = default;
  friend std::strong_ordering operator<=>(const NodeId& a, const NodeId& b) { return a.id_ <=> b.id_; }
  template <typename H>
  friend H AbslHashValue(H h, const NodeId& id) {
    return H::combine(std::move(h), id.id_);
  }
  friend std::ostream& operator<<(std::ostream& os, const NodeId& id) { return os << id.id_; }

 private:
  std::string id_;
};

// "node-1"_node: a NodeId literal (tests, tables of known ids).
inline NodeId operator""_node(const char* id, size_t n) { return NodeId(std::string_view(id, n)); }

// "a, b, c": node ids for messages.
inline std::string JoinNodeIds(const std::vector<NodeId>& ids, std::string_view sep) {
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i > 0) out.append(sep);
    out.append(ids[i].str());
  }
  return out;
}

class Round {
 public:
  constexpr Round() = default;
  constexpr explicit Round(int64_t n) : n_(n) {}

  constexpr int64_t value() const { return n_; }
  // No round yet (before the first rendezvous completed).
  constexpr bool none() const { return n_ == 0; }
  constexpr Round Next() const { return Round(n_ + 1); }

  friend constexpr bool operator==(Round, Round) = default;
  friend constexpr std::strong_ordering operator<=>(Round a, Round b) { return a.n_ <=> b.n_; }
  friend std::ostream& operator<<(std::ostream& os, Round r) { return os << r.n_; }

 private:
  int64_t n_ = 0;
};

}  // namespace ballast

template <>
struct fmt::formatter<ballast::NodeId> : fmt::formatter<std::string_view> {
  template <typename FormatContext>
  auto format(const ballast::NodeId& id, FormatContext& ctx) {
    return fmt::formatter<std::string_view>::format(id.str(), ctx);
  }
};

template <>
struct fmt::formatter<ballast::Round> : fmt::formatter<int64_t> {
  template <typename FormatContext>
  auto format(ballast::Round r, FormatContext& ctx) {
    return fmt::formatter<int64_t>::format(r.value(), ctx);
  }
};
