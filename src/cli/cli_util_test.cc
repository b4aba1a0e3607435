#include "cli/cli_util.h"

#include "gtest/gtest.h"

namespace ballast::cli {
namespace {

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
