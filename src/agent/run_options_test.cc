#include "agent/run_options.h"

#include <cstdlib>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ballast::agent {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

absl::StatusOr<RunOptions> Parse(std::vector<std::string> args) { return ParseRunArgs(args); }

TEST(RunFlags, AcceptsUnderscoreAndDashSpellings) {
  auto dash = Parse({"--nproc-per-node", "2", "--max-restarts", "5", "--rdzv-endpoint", "h:1234", "--node-rank", "3",
                     "--master-addr", "m", "--master-port", "2000", "--log-dir", "/tmp/x", "--monitor-interval",
                     "0.5", "--local-addr", "10.0.0.1", "--rdzv-id", "job7", "--no-python", "prog"});
  auto under = Parse({"--nproc_per_node", "2", "--max_restarts", "5", "--rdzv_endpoint", "h:1234", "--node_rank", "3",
                      "--master_addr", "m", "--master_port", "2000", "--log_dir", "/tmp/x", "--monitor_interval",
                      "0.5", "--local_addr", "10.0.0.1", "--rdzv_id", "job7", "--no_python", "prog"});
  for (const auto* r : {&dash, &under}) {
    ASSERT_TRUE(r->ok()) << r->status();
    EXPECT_EQ((*r)->nproc_per_node, 2);
    EXPECT_EQ((*r)->max_restarts, 5);
    EXPECT_EQ((*r)->rdzv_endpoint, "h:1234");
    EXPECT_EQ((*r)->node_rank, 3);
    EXPECT_EQ((*r)->master_addr, "m");
    EXPECT_EQ((*r)->master_port, 2000);
    EXPECT_EQ((*r)->log_dir, "/tmp/x");
    EXPECT_DOUBLE_EQ((*r)->monitor_interval_s, 0.5);
    EXPECT_EQ((*r)->local_addr, "10.0.0.1");
    EXPECT_EQ((*r)->rdzv_id, "job7");
    EXPECT_TRUE((*r)->no_python);
    EXPECT_EQ((*r)->training_script, "prog");
  }
}

TEST(RunFlags, AcceptsEqualsForm) {
  auto r = Parse({"--nnodes=1:4", "--nproc_per_node=3", "--rdzv-endpoint=[::1]:5", "--token=abc", "train.py"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->min_nodes, 1);
  EXPECT_EQ(r->max_nodes, 4);
  EXPECT_TRUE(r->nnodes_given);
  EXPECT_EQ(r->nproc_per_node, 3);
  EXPECT_EQ(r->rdzv_endpoint, "[::1]:5");
  EXPECT_EQ(r->token, "abc");
}

TEST(RunFlags, NnodesSingleValueSetsMinAndMax) {
  auto r = Parse({"--nnodes", "3", "--rdzv-endpoint", "h:1", "t.py"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->min_nodes, 3);
  EXPECT_EQ(r->max_nodes, 3);
}

TEST(RunFlags, DefaultsWhenOnlyScriptGiven) {
  auto r = Parse({"t.py"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->min_nodes, 1);
  EXPECT_EQ(r->max_nodes, 1);
  EXPECT_FALSE(r->nnodes_given);
  EXPECT_EQ(r->nproc_per_node, 1);
  EXPECT_FALSE(r->max_restarts.has_value());
  EXPECT_EQ(r->python, "python3");
  EXPECT_EQ(r->role, "default");
  EXPECT_EQ(r->node_rank, -1);
  EXPECT_TRUE(r->training_args.empty());
}

TEST(RunFlags, EverythingAfterTheScriptBelongsToIt) {
  auto r = Parse({"--standalone", "train.py", "--nproc-per-node", "8", "--help", "-m", "--lr=0.1", "x"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->nproc_per_node, 1);
  EXPECT_FALSE(r->module);
  EXPECT_EQ(r->training_script, "train.py");
  EXPECT_THAT(r->training_args, ElementsAre("--nproc-per-node", "8", "--help", "-m", "--lr=0.1", "x"));
}

TEST(RunFlags, DoubleDashEndsFlags) {
  auto r = Parse({"--", "-weird-name.py", "a"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->training_script, "-weird-name.py");
  EXPECT_THAT(r->training_args, ElementsAre("a"));
}

TEST(RunFlags, ModuleShortAndLong) {
  auto s = Parse({"-m", "pkg.train", "--epochs", "2"});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(s->module);
  EXPECT_EQ(s->training_script, "pkg.train");
  EXPECT_THAT(s->training_args, ElementsAre("--epochs", "2"));
  auto l = Parse({"--module", "pkg.train"});
  ASSERT_TRUE(l.ok());
  EXPECT_TRUE(l->module);
}

TEST(RunFlags, RedirectsAndTeeShortForms) {
  auto r = Parse({"-r", "3", "-t2", "t.py"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->redirects, "3");
  EXPECT_EQ(r->tee, "2");
  auto m = Parse({"--redirects", "0:1,1:2", "--tee=0:3", "t.py"});
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->redirects, "0:1,1:2");
  auto bad = Parse({"--redirects", "7", "t.py"});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(RunFlags, UnknownFlagIsInvalidArgumentNamingIt) {
  auto r = Parse({"--foo", "1", "t.py"});
  ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "unknown flag --foo for `ballast run`; see `ballast run --help`");
  auto eq = Parse({"--foo=1", "t.py"});
  EXPECT_EQ(eq.status().message(), "unknown flag --foo for `ballast run`; see `ballast run --help`");
  auto short_flag = Parse({"-x", "t.py"});
  EXPECT_EQ(short_flag.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(RunFlags, MissingScriptIsAnError) {
  auto r = Parse({"--nproc-per-node", "2"});
  ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("missing the training script"));
}

TEST(RunFlags, MissingValueIsAnError) {
  auto r = Parse({"--nproc-per-node"});
  ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("--nproc-per-node needs a value"));
}

TEST(RunFlags, HelpIsCancelled) {
  EXPECT_EQ(Parse({"--help"}).status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(Parse({"--nnodes", "1", "-h"}).status().code(), absl::StatusCode::kCancelled);
  EXPECT_THAT(RunUsage(), HasSubstr("--nproc-per-node"));
}

TEST(RunFlags, RejectsBadValues) {
  EXPECT_EQ(Parse({"--nproc-per-node", "0", "t.py"}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Parse({"--nproc-per-node", "two", "t.py"}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Parse({"--nnodes", "4:2", "t.py"}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Parse({"--nnodes", "0", "t.py"}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Parse({"--nnodes", "1:2:3", "t.py"}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Parse({"--max-restarts", "-1", "t.py"}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Parse({"--master-port", "70000", "t.py"}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Parse({"--monitor-interval", "0", "t.py"}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Parse({"--hang-timeout", "-1", "t.py"}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Parse({"--hang-timeout", "soon", "t.py"}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Parse({"--rdzv-endpoint", "nohostport", "t.py"}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Parse({"--standalone=1", "t.py"}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(RunFlags, StandaloneWithSeveralNodesIsAnError) {
  auto r = Parse({"--standalone", "--nnodes", "2", "t.py"});
  ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("--standalone"));
  EXPECT_TRUE(Parse({"--standalone", "--nnodes", "1", "t.py"}).ok());
}

TEST(RunFlags, ModuleAndNoPythonTogetherIsAnError) {
  EXPECT_EQ(Parse({"-m", "--no-python", "x"}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(RunFlags, NprocCpuUsesTheCpuCount) {
  auto r = Parse({"--nproc-per-node", "cpu", "t.py"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_GE(r->nproc_per_node, 1);
}

TEST(RunFlags, RdzvConfSetsTimeoutsAndToleratesUnknownKeys) {
  auto r = Parse({"--rdzv-conf", "last_call_timeout=2.5,join_timeout=60,read_timeout=5", "t.py"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_DOUBLE_EQ(r->last_call_s, 2.5);
  EXPECT_DOUBLE_EQ(r->join_timeout_s, 60);
  auto t = Parse({"--rdzv_conf=timeout=9", "t.py"});
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_DOUBLE_EQ(t->join_timeout_s, 9);
  EXPECT_EQ(Parse({"--rdzv-conf", "join_timeout=abc", "t.py"}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Parse({"--rdzv-conf", "novalue", "t.py"}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(RunFlags, RdzvBackendIsAcceptedAndIgnored) {
  auto r = Parse({"--rdzv-backend", "c10d", "--rdzv_backend=static", "--start-method", "spawn", "t.py"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->rdzv_backend, "static");
}

TEST(RunFlags, OursTokenPythonNodeUnitRole) {
  auto r = Parse({"--token", "t0k", "--python", "/usr/bin/python3", "--node-unit", "2", "--nnodes", "2:4", "--role",
                  "trainer", "--rdzv-endpoint", "h:9", "t.py"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->token, "t0k");
  EXPECT_EQ(r->python, "/usr/bin/python3");
  EXPECT_EQ(r->node_unit, 2);
  EXPECT_EQ(r->role, "trainer");
  EXPECT_EQ(Parse({"--node-unit", "0", "t.py"}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(RunFlags, TokenDefaultsToTheEnvironment) {
  setenv("BALLAST_TOKEN", "from-env", 1);
  auto r = Parse({"t.py"});
  auto flag = Parse({"--token", "from-flag", "t.py"});
  unsetenv("BALLAST_TOKEN");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->token, "from-env");
  ASSERT_TRUE(flag.ok());
  EXPECT_EQ(flag->token, "from-flag");
}

TEST(ParseRunArgs, HangTimeoutBothSpellingsDefaultOff) {
  auto off = Parse({"t.py"});
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_EQ(off->hang_timeout_s, 0);
  for (auto args : {std::vector<std::string>{"--hang-timeout", "30", "t.py"},
                    std::vector<std::string>{"--hang_timeout=30", "t.py"}}) {
    auto r = Parse(args);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_DOUBLE_EQ(r->hang_timeout_s, 30);
  }
}

TEST(ParseRunArgs, PrecheckFlags) {
  auto off = Parse({"t.py"});
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_FALSE(off->precheck);
  EXPECT_FALSE(off->exclude_stragglers);
  auto nc = Parse({"--network-check", "--exclude-stragglers", "t.py"});
  ASSERT_TRUE(nc.ok()) << nc.status();
  EXPECT_TRUE(nc->precheck);
  EXPECT_TRUE(nc->exclude_stragglers);
  auto p1 = Parse({"--precheck", "1", "t.py"});
  ASSERT_TRUE(p1.ok()) << p1.status();
  EXPECT_TRUE(p1->precheck);
  EXPECT_EQ(Parse({"--precheck", "7", "t.py"}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ParseRunArgs, TrainingHealthFlags) {
  auto none = Parse({"t.py"});
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->on_nan.empty());
  EXPECT_FALSE(none->max_rollbacks.has_value());
  EXPECT_FALSE(none->replica_check_every.has_value());
  auto all = Parse({"--on-nan", "fail", "--max-rollbacks", "0", "--loss-spike", "6", "--no-skip-data",
                    "--replica-check-every", "50", "t.py"});
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->on_nan, "fail");
  EXPECT_EQ(all->max_rollbacks, 0);
  EXPECT_EQ(all->loss_spike_z, 6);
  EXPECT_TRUE(all->no_skip_data);
  EXPECT_EQ(all->replica_check_every, 50);
  for (std::vector<std::string> bad : {std::vector<std::string>{"--on-nan", "retry", "t.py"},
                                       {"--max-rollbacks", "-1", "t.py"},
                                       {"--loss-spike", "0.5", "t.py"},
                                       {"--replica-check-every", "-1", "t.py"}}) {
    EXPECT_EQ(Parse(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad[0];
  }
}

}  // namespace
}  // namespace ballast::agent
