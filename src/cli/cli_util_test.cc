#include "cli/cli_util.h"

#include "gtest/gtest.h"

namespace ballast::cli {
namespace {

TEST(ParseNodeRange, SingleNumber) {
  auto r = ParseNodeRange("3", "--nodes");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->min, 3);
  EXPECT_EQ(r->max, 3);
}

TEST(ParseNodeRange, MinMax) {
  auto r = ParseNodeRange("1:4", "--nodes");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->min, 1);
  EXPECT_EQ(r->max, 4);
}

TEST(ParseNodeRange, RejectsInvertedAndGarbageNamingTheFlag) {
  for (const char* bad : {"4:1", "0", "x", "1:", ":2", "-1:2"}) {
    auto r = ParseNodeRange(bad, "--nnodes");
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(std::string(r.status().message()).find("--nnodes"), std::string::npos) << bad;
  }
}

TEST(ParseOrExit, UnknownFlagIsUsageError) {
  CLI::App app{"t", "t"};
  int x = 0;
  app.add_option("--x", x);
  EXPECT_EQ(ParseOrExit(app, {"--y", "1"}), 2);
}

TEST(ParseOrExit, ParsesValues) {
  CLI::App app{"t", "t"};
  int x = 0;
  app.add_option("--x,--x_alias", x);
  EXPECT_EQ(ParseOrExit(app, {"--x_alias", "5"}), -1);
  EXPECT_EQ(x, 5);
}

}  // namespace
}  // namespace ballast::cli
