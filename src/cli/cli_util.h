// Helpers shared by the subcommands.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <limits>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/node_range.h"

namespace ballast::cli {

// Runs app.parse(args) (args without the program name). Returns -1 when the
// caller should go on, else the exit code (0 for --help, 2 for a usage error,
// with the message printed).
int ParseOrExit(CLI::App& app, const std::vector<std::string>& args);

// The token to use: `flag_value`, else $BALLAST_TOKEN, else "".
std::string TokenFromFlagOrEnv(const std::string& flag_value);

// Checks for numeric flags that say what to pass. A value out of range (or
// not a number) is a usage error such as "--nproc-per-node must be a
// positive count (got -1)": CLI11's own PositiveNumber/NonNegativeNumber
// print their bound as a 309-digit double. The message is "must be ..." and
// ParseOrExit puts the flag's name in front.
//
// An integer of type T in [lo, hi]; `what` completes "must be ...", e.g.
// "a port from 0 to 65535". For a value above hi the message adds the bound
// (", at most 2147483647") unless `what` names it.
template <typename T>
CLI::Validator IntegerIn(T lo, T hi, std::string what, std::string name, bool what_names_max = true) {
  return CLI::Validator(
      [lo, hi, what, what_names_max](std::string& input) -> std::string {
        T v{};
        if (absl::SimpleAtoi(input, &v) && v >= lo && v <= hi) return "";
        double d = 0;
        const bool too_big = absl::SimpleAtod(input, &d) && d > static_cast<double>(hi);
        return absl::StrCat("must be ", what, too_big && !what_names_max ? absl::StrCat(", at most ", hi) : "",
                            " (got ", input, ")");
      },
      "", std::move(name));
}
// An integer >= 1 (nodes, workers per node, a node unit).
template <typename T = int>
CLI::Validator PositiveCount() {
  return IntegerIn<T>(1, std::numeric_limits<T>::max(), "a positive count", "POSITIVE", false);
}
// An integer >= 0 (restarts, replacements, spares, a step interval).
template <typename T = int>
CLI::Validator Count() {
  return IntegerIn<T>(0, std::numeric_limits<T>::max(), "a count of 0 or more", "NONNEGATIVE", false);
}
// A TCP port, 0 meaning any free one.
CLI::Validator Port();
// A number of seconds >= 0 (positive: > 0).
CLI::Validator Seconds(bool positive = false);
// A fraction in (0, 1]; the message says it is `what`.
CLI::Validator Fraction(std::string what);

}  // namespace ballast::cli
