#include "common/chaos.h"

#include "gtest/gtest.h"

namespace ballast {
namespace {

TEST(ChaosSpec, EmptyTextIsEmptySpec) {
  auto s = ParseChaosSpec("  ");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(s->empty());
}

TEST(ChaosSpec, ParsesSeveralFaults) {
  auto s = ParseChaosSpec("check-fail:node=1; check-slow:node=3,factor=4.5");
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_EQ(s->faults.size(), 2u);
  EXPECT_EQ(s->faults[0].kind, "check-fail");
  EXPECT_EQ(s->faults[0].node, 1);
  ASSERT_NE(s->Find("check-slow", 3), nullptr);
  EXPECT_DOUBLE_EQ(s->Find("check-slow", 3)->Number("factor", 1), 4.5);
  EXPECT_EQ(s->Find("check-slow", 1), nullptr);
  EXPECT_EQ(s->Find("check-fail", 3), nullptr);
}

TEST(ChaosSpec, UnknownKindIsInvalidArgument) {
  auto s = ParseChaosSpec("disk-melt:node=1");
  ASSERT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("unknown fault kind \"disk-melt\""), std::string::npos);
  EXPECT_NE(s.status().message().find("check-fail"), std::string::npos);
}

TEST(ChaosSpec, UnknownKeyIsInvalidArgument) {
  auto s = ParseChaosSpec("check-fail:node=1,rate=2");
  ASSERT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("no key \"rate\""), std::string::npos);
}

TEST(ChaosSpec, MissingRequiredKeyIsInvalidArgument) {
  EXPECT_EQ(ParseChaosSpec("check-slow:node=1").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseChaosSpec("check-fail").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ChaosSpec, BadValuesAreInvalidArgument) {
  EXPECT_EQ(ParseChaosSpec("check-fail:node=x").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseChaosSpec("check-fail:node=-1").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseChaosSpec("check-slow:node=1,factor=0").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseChaosSpec("check-slow:node=1,factor=abc").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ChaosSpec, IncarnationPicksWhichAgentOfANodeIsHit) {
  auto s = ParseChaosSpec("kill-agent:node=1,after=2.5;check-fail:node=1,incarnation=2");
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_NE(s->Find("kill-agent", 1), nullptr);  // incarnation 1 by default
  EXPECT_DOUBLE_EQ(s->Find("kill-agent", 1)->Number("after", 0), 2.5);
  EXPECT_EQ(s->Find("check-fail", 1), nullptr);
  s->incarnation = 2;  // the first replacement of node 1
  EXPECT_EQ(s->Find("kill-agent", 1), nullptr);
  EXPECT_NE(s->Find("check-fail", 1), nullptr);
  EXPECT_EQ(ParseChaosSpec("check-fail:node=1,incarnation=0").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseChaosSpec("kill-agent:node=1").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ChaosSpec, TriggeredKindsNeedExactlyOneOfAfterOrAtStep) {
  auto s = ParseChaosSpec("kill-worker:rank=2,at_step=7;hang:rank=0,after=1.5,restart=1;kill-master:at_step=3");
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_EQ(s->All("kill-worker").size(), 1u);
  EXPECT_DOUBLE_EQ(s->All("kill-worker")[0]->Number("at_step", 0), 7);
  EXPECT_DOUBLE_EQ(s->All("hang")[0]->Number("restart", 0), 1);
  EXPECT_EQ(s->All("kill-master").size(), 1u);
  EXPECT_TRUE(s->All("nan").empty());
  for (const char* bad : {"kill-worker:rank=2", "kill-worker:rank=2,after=1,at_step=3", "hang:after=1",
                          "kill-master:", "kill-agent:node=0,at_step=-1"}) {
    auto r = ParseChaosSpec(bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  auto p = ParseChaosSpec("partition:node=1,at_step=5,for=8;disk-error:node=0,after=2,writes=5");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_DOUBLE_EQ(p->Find("partition", 1)->Number("for", 0), 8);
  EXPECT_DOUBLE_EQ(p->Find("disk-error", 0)->Number("writes", 0), 5);
  EXPECT_FALSE(ParseChaosSpec("partition:node=1,at_step=5").ok());  // for= is required
  auto r = ParseChaosSpec("kill-worker:rank=2");
  EXPECT_NE(r.status().message().find("after=SECONDS or at_step=STEP"), std::string::npos) << r.status();
  EXPECT_NE(ChaosKindsHelp().find("kill-worker:rank=N,after=F|at_step=N,[restart=N]"), std::string::npos)
      << ChaosKindsHelp();
}

TEST(ChaosSpec, FromEnvReadsSpecAndIncarnation) {
  setenv(kChaosEnv, "check-fail:node=0,incarnation=3", 1);
  setenv(kChaosIncarnationEnv, "3", 1);
  auto s = ChaosSpecFromEnv();
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->incarnation, 3);
  EXPECT_NE(s->Find("check-fail", 0), nullptr);
  setenv(kChaosIncarnationEnv, "first", 1);
  s = ChaosSpecFromEnv();
  ASSERT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find(kChaosIncarnationEnv), std::string::npos);
  unsetenv(kChaosEnv);
  unsetenv(kChaosIncarnationEnv);
}

}  // namespace
}  // namespace ballast
