// Reports the master's tests send, shared by the test files of master_test.
#pragma once

#include <cstdint>
#include <string>

#include "ballast/v1/master.pb.h"

namespace ballast::master::test_reports {

// A progress report of node `id` at `step` of `round` carrying rank `rank`'s
// parameter fingerprint `value` for that step (replica group 9).
inline v1::ProgressReport FingerprintReport(const std::string& id, int64_t round, int rank, int64_t step,
                                            uint64_t value) {
  v1::ProgressReport p;
  p.set_node_id(id);
  p.set_round(round);
  p.set_step(step);
  v1::Fingerprint* f = p.add_fingerprints();
  f->set_rank(rank);
  f->set_step(step);
  f->set_value(value);
  f->set_group(9);
  return p;
}

}  // namespace ballast::master::test_reports
