// The job master's state kept outside its pod, so a master pod that replaces
// a lost one (deleted, evicted, its node gone) resumes the job: the same
// round, members, restart count and checkpoint commits, the worker pods
// training on. The state is the journal's (master/journal.h: a
// v1::MasterSnapshot), kept in the ConfigMap <job>-master-state (binaryData
// "snapshot"; data "holder" = the master pod that wrote it, "seq" = its
// journal sequence number), owned by the ElasticJob.
//
// Fencing: every write is conditional on the resourceVersion this master
// last read or wrote. A write refused because another master wrote since
// (its "holder" is not us) means a newer master acts for the job: Save
// returns kFailedPrecondition and this master must stop acting. (The job's
// Lease, kube/lease.h, is the primary fence; this one also catches a master
// that was cut off from the API server while its successor took over.)
//
// Thread safety: none (one thread mirrors).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "ballast/v1/journal.pb.h"
#include "kube/kube_client.h"
#include "scheduler/kubernetes/elastic_job.h"

namespace ballast::scheduler::kubernetes {

class MasterStateStore {
 public:
  MasterStateStore(kube::KubeClient* client, const ElasticJobSpec& job, std::string holder);

  std::string Name() const { return job_.name + "-master-state"; }
  // Takes the store over (a master holding the job's Lease, before it
  // serves): reads the state the job's last master stored (nullopt: none
  // yet) and writes it back as this master's, so the last master's later
  // writes are refused (it is fenced). Errors: the API server could not be
  // read or written, or the stored state does not parse.
  absl::StatusOr<std::optional<v1::MasterSnapshot>> Claim();
  // Stores the state. kFailedPrecondition when another master (named in the
  // message) stored it since this one last did: fenced.
  absl::Status Save(const v1::MasterSnapshot& state);
  // The holder of the last write seen ("" none).
  const std::string& last_holder() const { return last_holder_; }
  // The holder of the state Claim() read: the master this one took over from.
  const std::string& claimed_from() const { return claimed_from_; }
  size_t bytes_saved() const { return bytes_saved_; }

 private:
  absl::StatusOr<std::optional<v1::MasterSnapshot>> Load();
  absl::StatusOr<kube::Json> Write(const std::string& payload, uint64_t seq);
  kube::Json Build(const std::string& payload, uint64_t seq) const;

  kube::KubeClient* const client_;
  const ElasticJobSpec job_;
  const std::string holder_;
  std::string resource_version_;  // of the ConfigMap as last read or written; "" none seen
  std::string last_holder_;
  std::string claimed_from_;
  size_t bytes_saved_ = 0;
};

// Keeps the store current from a thread: the journal's state (state_after:
// MasterServer::JournalStateAfter) at once when the round changed (what
// agents act on; the owner passes each round it sees to NoteRound), else at
// most every interval_s. A refused write (fenced) stops it; fenced() says so.
class MasterStateMirror {
 public:
  MasterStateMirror(MasterStateStore* store,
                    std::function<std::optional<v1::MasterSnapshot>(uint64_t seq)> state_after,
                    double interval_s = 1.0);
  ~MasterStateMirror();  // Stop(false)
  void Start();
  // Stops the thread; with final_save, stores what changed since the last
  // write (a master that stops: its successor resumes from there).
  void Stop(bool final_save);
  // The job's current round (from the status the owner reads anyway).
  void NoteRound(int64_t round) { round_.store(round); }
  bool fenced() const { return fenced_.load(); }
  std::string fenced_why() const;

 private:
  void SaveIfChanged();

  MasterStateStore* const store_;
  const std::function<std::optional<v1::MasterSnapshot>(uint64_t)> state_after_;
  std::atomic<int64_t> round_{0};
  const double interval_s_;
  std::atomic<bool> fenced_{false};
  mutable std::mutex mu_;  // one save at a time; guards the fields below
  std::condition_variable cv_;
  bool stop_ = false;
  uint64_t saved_seq_ = 0;
  std::string fenced_why_;
  bool warned_ = false;
  std::thread thread_;
};

// A ConfigMap holds at most 1 MiB; the state of a job of ~10,000 nodes fits.
inline constexpr size_t kMaxMasterStateBytes = 1000 * 1000;

}  // namespace ballast::scheduler::kubernetes
