// The job's master as `ballast launch`, `ballast slurm` and `ballast ray run` drive it
// (DrivenMaster): in their own process (InProcessMaster, the default), or in a
// child process with a journal (MasterProcess, --journal DIR) that is
// restarted from the journal when it dies, so a master crash is not the
// job's: agents reconnect to the restarted master on the same address and
// keep training, and the driver (node manager, scheduler backend, the
// agents' parent) never stops.
//
// A MasterProcess is `ballast master --journal DIR --no-supervise` with the
// job's settings on a fixed port. Where it runs is a MasterHost: a child
// process of the driver (LocalMasterHost, the default), or a Ray actor on the
// Ray head that Ray restarts there (`ballast ray run`, cmd_ray.cc). The
// driver learns what the in-process master would tell it by callback from
// the master's status (GetStatus, each loop turn): nodes that turned dead or
// left (lost) or excluded, with the reason; a new master_instance there is a
// restart, whether or not the host reported the death yet. A master that dies of a signal is restarted at most 5 times a
// minute; one that exits decided the job (its last status says how).
//
// Threading: one thread (the driver's loop) calls everything.
#pragma once

#include <algorithm>
#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ballast/v1/master.grpc.pb.h"
#include "ballast/v1/master.pb.h"
#include "common/chaos.h"
#include "common/net.h"
#include "common/subprocess.h"
#include "master/master_server.h"
#include "scheduler/node_manager.h"

namespace ballast::cli {

class DrivenMaster {
 public:
  virtual ~DrivenMaster() = default;
  virtual const std::string& job_id() const = 0;
  virtual std::string address() const = 0;  // what agents dial
  virtual const std::string& token() const = 0;
  // The outcome once the job finished, waiting up to timeout_s for it.
  virtual std::optional<master::JobResult> WaitForFinish(double timeout_s) = 0;
  virtual v1::JobStatus Status() = 0;
  // Stops the master, after up to linger_s for the agents to hear the end.
  virtual void Shutdown(double linger_s) = 0;
  // Once per loop turn: a master process that died is restarted, and the
  // nodes it lost or excluded since the last turn go to `nodes` (an
  // in-process master tells the node manager itself). Non-OK when the master
  // cannot go on: the job ends with that error.
  virtual absl::Status Poll(scheduler::NodeManager& nodes) { return absl::OkStatus(); }
  // Times a master process died and was restarted from its journal.
  virtual int master_restarts() const { return 0; }
  // The scheduler reports the node gone: the master loses it now
  // (MasterServer::NodeLost). Best effort: heartbeats find it anyway.
  virtual void NodeLost(const std::string& node_id, const std::string& reason) = 0;
};

// The master in this process (master_server.h).
class InProcessMaster : public DrivenMaster {
 public:
  explicit InProcessMaster(std::unique_ptr<master::MasterServer> server) : server_(std::move(server)) {}
  const std::string& job_id() const override { return server_->job_id(); }
  std::string address() const override { return server_->address(); }
  const std::string& token() const override { return server_->token(); }
  std::optional<master::JobResult> WaitForFinish(double timeout_s) override {
    return server_->WaitForFinish(timeout_s);
  }
  v1::JobStatus Status() override { return server_->Status(); }
  void Shutdown(double linger_s) override { server_->Shutdown(linger_s); }
  void NodeLost(const std::string& node_id, const std::string& reason) override {
    server_->NodeLost(node_id, reason);
  }
  master::MasterServer& server() { return *server_; }

 private:
  std::unique_ptr<master::MasterServer> server_;
};

// Where a MasterProcess's incarnations run. One thread calls everything.
class MasterHost {
 public:
  virtual ~MasterHost() = default;
  // Starts an incarnation: argv and env are `ballast master`'s without where
  // it listens (--host, --port, --advertise-host), which the host adds; the
  // endpoint it serves is the same for every incarnation. `restart`: after
  // Poll reported the last one dead of a signal (a host that restarts its
  // master itself, as Ray restarts an actor, waits for that incarnation).
  virtual absl::StatusOr<Endpoint> Start(const std::vector<std::string>& argv,
                                         const std::map<std::string, std::string>& env, bool restart) = 0;
  // How the incarnation ended, once it did (nullopt while it runs). An exit
  // code: it decided the job, or was stopped; a signal: it died.
  virtual std::optional<ExitStatus> Poll() = 0;
  // Stops it (SIGTERM, SIGKILL after grace_s) and waits for that.
  virtual void Stop(double grace_s) = 0;
  // Chaos kill-master: kills it as a crash would (its process, or its actor).
  virtual void Kill() = 0;
  // Where the incarnation runs, for messages: "pid 123", "pid 123 in a Ray actor on ray:...@10.0.0.2".
  virtual std::string Where() const = 0;
};

// The default host: `ballast master` as a child process of the driver, on
// bind_host and a port fixed at the first start (the options' or a free one).
class LocalMasterHost : public MasterHost {
 public:
  LocalMasterHost(std::string bind_host, std::string advertise_host, int port)
      : bind_host_(std::move(bind_host)), advertise_host_(std::move(advertise_host)), port_(port) {}
  absl::StatusOr<Endpoint> Start(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
                                 bool restart) override;
  std::optional<ExitStatus> Poll() override;
  void Stop(double grace_s) override;
  void Kill() override;
  std::string Where() const override;

 private:
  const std::string bind_host_;
  const std::string advertise_host_;
  int port_;
  std::unique_ptr<Subprocess> child_;
};

struct MasterProcessOptions {
  // The job's settings (callbacks unused: the driver polls). A port of 0 is
  // picked here: every incarnation serves the same one.
  master::MasterOptions master;
  std::string journal_dir;  // required
  bool http_port_given = false;  // else beside the gRPC port, as `ballast master` does
  const char* cmd = "launch";    // for messages
  double ready_timeout_s = 30;   // for the master to answer after a start
  // Chaos kill-master (common/chaos.h): SIGKILL to the master process `after`
  // seconds after it first started, or once every live node reached at_step.
  std::optional<ChaosFault> kill_master;
  // Where it runs (null: a LocalMasterHost on the master options' bind host and port).
  std::unique_ptr<MasterHost> host;
};

class MasterProcess : public DrivenMaster {
 public:
  // Starts the first incarnation and waits until it answers.
  static absl::StatusOr<std::unique_ptr<MasterProcess>> Start(MasterProcessOptions options);
  ~MasterProcess() override;  // Shutdown(0)

  const std::string& job_id() const override { return job_id_; }
  std::string address() const override { return address_; }
  const std::string& token() const override { return options_.master.token; }
  std::optional<master::JobResult> WaitForFinish(double timeout_s) override;
  v1::JobStatus Status() override;
  void NodeLost(const std::string& node_id, const std::string& reason) override;
  void Shutdown(double linger_s) override;
  absl::Status Poll(scheduler::NodeManager& nodes) override;

  // Incarnations started so far (1 + restarts).
  int incarnations() const { return incarnations_; }
  // The larger of the restarts this side saw and those the master's status
  // shows (a new master_instance): a host may report a death late (Ray), or
  // the job may end before it does.
  int master_restarts() const override {
    return std::max(incarnations_ - 1, static_cast<int>(instances_.size()) - 1);
  }

 private:
  explicit MasterProcess(MasterProcessOptions options);
  std::vector<std::string> Argv() const;
  absl::Status Spawn();
  // Keeps a status read from the master as the last one.
  void Keep(v1::JobStatus st);
  // Waits for the master to answer GetStatus (or to exit).
  absl::Status WaitReady();
  absl::StatusOr<v1::JobStatus> Fetch(double timeout_s);
  // A dead master is restarted (a signal), or its exit is taken as the end.
  absl::Status CheckChild();
  static std::optional<master::JobResult> ResultOf(const v1::JobStatus& st);
  // Sends the chaos kill-master when it is due (from last_).
  void InjectChaos();

  MasterProcessOptions options_;
  std::unique_ptr<MasterHost> host_;
  std::string job_id_;
  std::string address_;
  std::optional<ExitStatus> exited_;  // the last incarnation exited by itself
  int incarnations_ = 0;
  std::deque<std::chrono::steady_clock::time_point> restarts_;
  std::unique_ptr<v1::Master::Stub> stub_;
  std::optional<v1::JobStatus> last_;
  std::set<std::string> instances_;  // JobStatus.master_instance values seen
  std::map<std::string, std::string> reported_;  // node id -> the state it was reported in
  std::set<std::string> disconnected_;           // nodes told disconnected, not since reconnected
  bool shut_down_ = false;
  std::chrono::steady_clock::time_point first_started_{};
  bool chaos_fired_ = false;
};

}  // namespace ballast::cli
