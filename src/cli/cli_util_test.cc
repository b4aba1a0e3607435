#include "cli/cli_util.h"

#include "absl/strings/str_cat.h"
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

// The usage error ParseOrExit prints for `args` on an app with the flag
// --n of type T checked by `check` (empty when the parse succeeds).
template <typename T>
std::string UsageError(CLI::Validator check, const std::vector<std::string>& args, T* value = nullptr) {
  CLI::App app{"t", "t"};
  T v{};
  app.add_option("--n,--n_alias", value != nullptr ? *value : v)->check(check);
  testing::internal::CaptureStderr();
  const int rc = ParseOrExit(app, args);
  const std::string err = testing::internal::GetCapturedStderr();
  if (rc == -1) return "";
  EXPECT_EQ(rc, 2) << err;
  return err;
}

TEST(CountChecks, NegativeAndOutOfRangeCountsSayWhatToPass) {
  for (const char* bad : {"-1", "0", "abc", "1.5"}) {
    const std::string err = UsageError<int>(PositiveCount(), {"--n", bad});
    EXPECT_NE(err.find(absl::StrCat("ballast t: --n must be a positive count (got ", bad, ")")), std::string::npos)
        << err;
    EXPECT_LT(err.size(), 120u) << err;  // no 309-digit bound
  }
  std::string err = UsageError<int>(PositiveCount(), {"--n", "99999999999"});
  EXPECT_NE(err.find("--n must be a positive count, at most 2147483647 (got 99999999999)"), std::string::npos) << err;
  err = UsageError<int>(Count(), {"--n_alias", "-3"});
  EXPECT_NE(err.find("--n must be a count of 0 or more (got -3)"), std::string::npos) << err;
  err = UsageError<uint64_t>(Count<uint64_t>(), {"--n", "-1"});
  EXPECT_NE(err.find("--n must be a count of 0 or more (got -1)"), std::string::npos) << err;
  err = UsageError<int>(Port(), {"--n", "70000"});
  EXPECT_NE(err.find("--n must be a port from 0 to 65535 (0: any free port) (got 70000)"), std::string::npos) << err;
  err = UsageError<int>(IntegerIn(0, 8, "a count from 0 to 8", "0..8"), {"--n", "9"});
  EXPECT_NE(err.find("--n must be a count from 0 to 8 (got 9)"), std::string::npos) << err;
  err = UsageError<double>(Seconds(), {"--n", "-0.5"});
  EXPECT_NE(err.find("--n must be a number of seconds >= 0 (got -0.5)"), std::string::npos) << err;
  for (const char* bad : {"0", "inf", "nan"}) {
    err = UsageError<double>(Seconds(/*positive=*/true), {"--n", bad});
    EXPECT_NE(err.find(absl::StrCat("--n must be a number of seconds > 0 (got ", bad, ")")), std::string::npos)
        << err;
  }
}

TEST(CountChecks, ValidValuesParse) {
  int n = 0;
  EXPECT_EQ(UsageError<int>(PositiveCount(), {"--n", "3"}, &n), "");
  EXPECT_EQ(n, 3);
  EXPECT_EQ(UsageError<int>(Count(), {"--n", "0"}, &n), "");
  EXPECT_EQ(n, 0);
  EXPECT_EQ(UsageError<int>(Port(), {"--n", "65535"}, &n), "");
  EXPECT_EQ(n, 65535);
  uint64_t seed = 0;
  EXPECT_EQ(UsageError<uint64_t>(Count<uint64_t>(), {"--n", "18446744073709551615"}, &seed), "");
  EXPECT_EQ(seed, UINT64_MAX);
  double s = -1;
  EXPECT_EQ(UsageError<double>(Seconds(), {"--n", "0"}, &s), "");
  EXPECT_EQ(s, 0);
  EXPECT_EQ(UsageError<double>(Seconds(true), {"--n", "2.5"}, &s), "");
  EXPECT_EQ(s, 2.5);
}

}  // namespace
}  // namespace ballast::cli
