#include "common/replica_record.h"

#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace ballast {

std::string ReplicaRecord::ToKvValue() const {
  return absl::StrCat(holder, " ", addr, " step=", step, " world=", world);
}

absl::StatusOr<ReplicaRecord> ReplicaRecord::FromKvValue(const std::string& value) {
  std::vector<std::string> f = absl::StrSplit(value, ' ', absl::SkipEmpty());
  ReplicaRecord r;
  if (f.size() == 4 && absl::StartsWith(f[2], "step=") && absl::StartsWith(f[3], "world=") &&
      absl::SimpleAtoi(f[2].substr(5), &r.step) && absl::SimpleAtoi(f[3].substr(6), &r.world)) {
    r.holder = f[0];
    r.addr = f[1];
    return r;
  }
  return absl::InvalidArgumentError(absl::StrCat("malformed replica record '", value, "'"));
}

std::string ReplicaKey(int rank, int k) { return absl::StrCat(kReplicaKeyPrefix, rank, "/", k); }

bool ParseReplicaKey(absl::string_view key, int* rank, int* k) {
  if (!absl::ConsumePrefix(&key, kReplicaKeyPrefix)) return false;
  std::vector<absl::string_view> parts = absl::StrSplit(key, '/');
  return parts.size() == 2 && absl::SimpleAtoi(parts[0], rank) && absl::SimpleAtoi(parts[1], k) && *rank >= 0 &&
         *k >= 0;
}

std::string ReplicaEndpointKey(const std::string& node_id) { return absl::StrCat("ckpt-replica-ep/", node_id); }

}  // namespace ballast
