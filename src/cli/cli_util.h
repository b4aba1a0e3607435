// Helpers shared by the subcommands.
#pragma once

#include <CLI/CLI.hpp>

#include <string>

#include "common/node_range.h"

namespace ballast::cli {

// Runs app.parse(args) (args without the program name). Returns -1 when the
// caller should go on, else the exit code (0 for --help, 2 for a usage error,
// with the message printed).
int ParseOrExit(CLI::App& app, const std::vector<std::string>& args);

// The token to use: `flag_value`, else $BALLAST_TOKEN, else "".
std::string TokenFromFlagOrEnv(const std::string& flag_value);

}  // namespace ballast::cli
