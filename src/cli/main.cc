// The one `ballast` binary. Dispatches to a subcommand; configures logging once.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "cli/commands.h"
#include "common/tunables.h"
#include "common/logging.h"

namespace {

constexpr char kUsage[] =
    "usage: ballast <command> [options]\n"
    "\n"
    "Keeps distributed PyTorch training running through failures.\n"
    "\n"
    "commands:\n"
    "  run      run this node's workers (a drop-in for torchrun)\n"
    "  master   run a job master that agents on several hosts join\n"
    "  launch   run a whole job on this machine: a master and N agents (local backend)\n"
    "  slurm    run a job inside a Slurm allocation: one agent step per node, hot spares\n"
    "  ray      run a job on a Ray cluster (`ballast ray run`): one agent actor per Ray node\n"
    "  status   print the state of a running job\n"
    "  ckpt     list, inspect, verify and export flash checkpoints\n"
    "  operator run the Kubernetes ElasticJob operator (deploy/ installs it)\n"
    "  simulate predict goodput at 1,000-10,000 GPUs under failures (manual, DLRover-like, Ballast)\n"
    "\n"
    "`ballast <command> --help` describes each command's options.\n";

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fputs(kUsage, stderr);
    return ballast::cli::kUsageExit;
  }
  // Lock-order checking is for the tests (their own mains keep absl's
  // default): in the product it put a graph lookup on every lock, the master's
  // job lock included, and would abort a serving master instead of logging.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  std::string cmd = argv[1];
  ballast::cli::Args args(argv + 2, argv + argc);
  if (cmd == "-h" || cmd == "--help" || cmd == "help") {
    std::fputs(kUsage, stdout);
    return 0;
  }
  if (cmd == "--version") {
    std::puts("ballast " BALLAST_VERSION);
    return 0;
  }
  if (cmd == "run" || cmd == "master" || cmd == "launch" || cmd == "slurm" || cmd == "ray" || cmd == "status" || cmd == "operator") {
    ballast::SetupLogging(cmd == "run" ? "agent" : cmd);
  }
  // A mistyped BALLAST_* tunable is refused, not ignored.
  if (const std::vector<std::string> errors = ballast::Tunables::Validate(); !errors.empty()) {
    for (const std::string& e : errors) std::fprintf(stderr, "ballast: %s\n", e.c_str());
    return ballast::cli::kUsageExit;
  }
  if (cmd == "run") return ballast::cli::RunCommand(args);
  if (cmd == "master") return ballast::cli::MasterCommand(args);
  if (cmd == "launch") return ballast::cli::LaunchCommand(args);
  if (cmd == "slurm") return ballast::cli::SlurmCommand(args);
  if (cmd == "ray") return ballast::cli::RayCommand(args);
  if (cmd == "status") return ballast::cli::StatusCommand(args);
  if (cmd == "ckpt") return ballast::cli::CkptCommand(args);
  if (cmd == "operator") return ballast::cli::OperatorCommand(args);
  if (cmd == "simulate") return ballast::cli::SimulateCommand(args);
  std::fprintf(stderr, "ballast: unknown command '%s'\n\n%s", cmd.c_str(), kUsage);
  return ballast::cli::kUsageExit;
}
