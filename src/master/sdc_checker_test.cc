#include "master/sdc_checker.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ballast::master {
namespace {

using Kind = SdcChecker::Verdict::Kind;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(SdcChecker, AgreementMovesTheRollbackTargetOnlyOnceEveryRankReported) {
  SdcChecker c;
  EXPECT_EQ(c.Add(0, 100, 7, 1, 3).kind, Kind::kPending);
  EXPECT_EQ(c.Add(2, 100, 7, 1, 3).kind, Kind::kPending);
  SdcChecker::Verdict v = c.Add(1, 100, 7, 1, 3);
  EXPECT_EQ(v.kind, Kind::kAgree);
  EXPECT_EQ(c.last_agreed_step(), 100);
  EXPECT_EQ(c.Add(0, 100, 9, 1, 3).kind, Kind::kPending);  // late: already judged
}

TEST(SdcChecker, TheMinorityOfAGroupIsBlamedAndOtherGroupsDoNotCount) {
  SdcChecker c;
  c.Add(0, 100, 5, 1, 4);
  ASSERT_EQ(c.Add(1, 100, 5, 1, 4).kind, Kind::kPending);
  // HSDP: ranks 0,1 hold one shard, 2,3 another, 4 alone another.
  SdcChecker h;
  for (auto [r, val, g] : std::vector<std::tuple<int, uint64_t, uint64_t>>{
           {0, 11, 1}, {1, 11, 1}, {2, 22, 2}, {3, 22, 2}, {4, 33, 3}}) {
    EXPECT_EQ(h.Add(r, 50, val, g, 5).kind, r == 4 ? Kind::kAgree : Kind::kPending);
  }
  SdcChecker d;
  for (int r = 0; r < 3; ++r) d.Add(r, 200, 8, 1, 4);
  SdcChecker::Verdict v = d.Add(3, 200, 9, 1, 4);
  EXPECT_EQ(v.kind, Kind::kBlame);
  EXPECT_THAT(v.ranks, ElementsAre(3));
  EXPECT_EQ(v.last_agreed_step, 0);
  EXPECT_THAT(v.detail, HasSubstr("rank 3's parameter fingerprint 0000000000000009 differs from the 3 other"));
}

TEST(SdcChecker, TwoReplicasThatDisagreeRecomputeOnceThenFail) {
  SdcChecker c;
  c.Add(0, 10, 1, 1, 2);
  ASSERT_EQ(c.Add(1, 10, 1, 1, 2).kind, Kind::kAgree);
  c.Add(0, 20, 1, 1, 2);
  SdcChecker::Verdict v = c.Add(1, 20, 2, 1, 2);
  EXPECT_EQ(v.kind, Kind::kTie);
  EXPECT_EQ(v.last_agreed_step, 10);
  EXPECT_THAT(v.ranks, ElementsAre(0, 1));
  c.NewRound();
  c.Add(0, 20, 3, 1, 2);
  EXPECT_EQ(c.Add(1, 20, 4, 1, 2).kind, Kind::kTieAgain);
  // A recompute that agrees clears the suspicion.
  SdcChecker ok;
  ok.Add(0, 20, 1, 1, 2);
  ok.Add(1, 20, 2, 1, 2);
  ok.Add(0, 20, 5, 1, 2);
  EXPECT_EQ(ok.Add(1, 20, 5, 1, 2).kind, Kind::kAgree);
  ok.Add(0, 30, 1, 1, 2);
  EXPECT_EQ(ok.Add(1, 30, 2, 1, 2).kind, Kind::kTie);
}

}  // namespace
}  // namespace ballast::master
