// The master's KV records of flash-checkpoint replicas (agent/replica.h):
// written by the agents that send replicas, read by a replacement node's
// agent (to fetch its ranks' steps) and by the master's status view.
//
//   "ckpt-replica/<rank>/<k>"     = "<holder node id> <host:port> step=<S> world=<W>"
//   "ckpt-replica-ep/<node id>"   = "<host:port>" (an agent's replica data channel)
#pragma once

#include <cstdint>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"

namespace ballast {

// Where one replica of a rank's step lives (the KV value).
struct ReplicaRecord {
  std::string holder;  // node id of the holding agent
  std::string addr;    // host:port of its data channel
  uint64_t step = 0;
  int world = 0;
  std::string ToKvValue() const;
  static absl::StatusOr<ReplicaRecord> FromKvValue(const std::string& value);
};

inline constexpr absl::string_view kReplicaKeyPrefix = "ckpt-replica/";
std::string ReplicaKey(int rank, int k);
// (rank, k) of a ReplicaKey; false when `key` is not one.
bool ParseReplicaKey(absl::string_view key, int* rank, int* k);
std::string ReplicaEndpointKey(const std::string& node_id);

}  // namespace ballast
