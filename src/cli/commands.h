// The `ballast` binary's subcommands, one file each. Each takes the arguments
// after its name and returns the process exit code (2 for usage errors).
#pragma once

#include <string>
#include <vector>

namespace ballast::cli {

using Args = std::vector<std::string>;

int RunCommand(const Args& args);     // ballast run: the agent (torchrun drop-in)
int MasterCommand(const Args& args);  // ballast master: a job master for hand-started agents
int LaunchCommand(const Args& args);  // ballast launch: master + N local agents
int SlurmCommand(const Args& args);   // ballast slurm: master + one agent step per node of a Slurm allocation
int StatusCommand(const Args& args);  // ballast status: print a job's state
int CkptCommand(const Args& args);    // ballast ckpt: ls/inspect/verify/export checkpoints
int RayCommand(const Args& args);      // ballast ray run: a job on a Ray cluster, one agent actor per Ray node
int OperatorCommand(const Args& args);  // ballast operator: the ElasticJob controller (Kubernetes)
int SimulateCommand(const Args& args);  // ballast simulate: goodput at scale under failures

// Exit code for bad command lines (as torchrun and most CLIs use).
inline constexpr int kUsageExit = 2;

}  // namespace ballast::cli
