// Leader election on a coordination.k8s.io/v1 Lease, the way client-go's
// leaderelection does it: one holder at a time, renewed every retry_s; a
// candidate takes the Lease only when it is free (no holder, or released) or
// its holder has not renewed it for lease_duration_s as this process saw it
// (the candidate's own clock: clocks of different machines are never
// compared). Every write is conditional on the resourceVersion read, so two
// candidates never both win.
//
// Which candidate takes a silent holder's Lease is not defined, and not meant
// to be: each counts the silence from when it itself last saw the holder
// renew, and the first to look after lease_duration_s of it wins. A standby
// that waited for long has no head start over a replica that started
// meanwhile (the pod a Deployment creates for a deleted leader) when the old
// holder renewed once more after that replica began to look: a force-deleted
// pod's process runs until its kubelet sees the deletion. What is
// guaranteed: at most one holder at a time, and a new one within
// lease_duration_s (+ one look) of the last renewal while a candidate runs.
//
// A holder that cannot renew for renew_deadline_s (< lease_duration_s), or
// finds another holder, has lost the Lease: held() turns false at once and
// stays false, and the owner must stop acting (fencing: ballast's job master
// stops touching pods; the operator stops reconciling). Release() hands the
// Lease over at once (a master pod being deleted: its successor need not
// wait out the lease).
//
// The Lease carries the holder's annotations (the job master's endpoint, so
// agents find a master that moved: kube::LeaseAnnotation).
//
// Threading: Acquire blocks the caller; after it, a renewal thread runs until
// Release() or destruction. held() is thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "kube/kube_client.h"

namespace ballast::kube {

struct LeaseOptions {
  std::string ns;
  std::string name;
  std::string identity;          // this candidate (its pod name)
  double lease_duration_s = 15;  // a silent holder's Lease is taken after this
  double renew_deadline_s = 10;  // a holder that cannot renew this long steps down
  double retry_s = 2;            // renew / retry period
  std::map<std::string, std::string> annotations;
  Json owner_reference;          // null: none (else deleted with its owner)
  std::string what;              // for messages: "the master lease of ElasticJob ns/job"
};

class LeaderLease {
 public:
  LeaderLease(KubeClient* client, LeaseOptions options);
  ~LeaderLease();  // stops renewing (does not release)
  LeaderLease(const LeaderLease&) = delete;
  LeaderLease& operator=(const LeaderLease&) = delete;

  // Blocks until this candidate holds the Lease (OK), *stop becomes non-zero
  // (kCancelled) or timeout_s passes (kDeadlineExceeded; < 0: no limit).
  // on_wait is told, once, who holds it while we wait. Then renews it in the
  // background.
  absl::Status Acquire(const std::atomic<int>* stop, double timeout_s,
                       const std::function<void(const std::string& holder)>& on_wait = nullptr);
  // Whether this process holds the Lease now (false before Acquire and for
  // good once lost or released).
  bool held() const { return held_.load(); }
  // Why it was lost ("" while held).
  std::string lost_reason() const;
  // Stops renewing and frees the Lease for the next candidate at once.
  void Release();

  // One attempt (exposed for tests): true when this candidate holds it after.
  absl::StatusOr<bool> TryAcquireOrRenew();

 private:
  void RenewLoop();
  void Lose(const std::string& why);

  KubeClient* const client_;
  const LeaseOptions options_;
  std::atomic<bool> held_{false};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::string lost_reason_;
  // What this process last saw of the Lease, and when (its own clock).
  std::string observed_record_;
  std::chrono::steady_clock::time_point observed_at_{};
  std::chrono::steady_clock::time_point renewed_at_{};
  std::thread thread_;
};

// The annotation `key` of Lease ns/name when it has a holder, "" when it has
// none, is not there, or cannot be read.
absl::StatusOr<std::string> LeaseAnnotation(KubeClient* client, const std::string& ns, const std::string& name,
                                            const std::string& key);

// RFC 3339 with microseconds (a MicroTime), UTC.
std::string MicroTimeNow();

}  // namespace ballast::kube
