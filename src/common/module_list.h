// Python module lists users give (--warm-modules, an ElasticJob's
// spec.warmModules): "a,b.c" -> {"a", "b.c"}, each checked to be a module name.
//
// And the list a job's workers imported, kept between runs (the warm
// interpreters' preload, see agent/warm_starter.h): one file per python and
// script under the user's cache directory, so the first interpreters of the
// next run, or of an agent started again on the same host, preload from the
// start what otherwise is learned only after the workers' first steps.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace ballast {

// Empty entries are skipped; anything that is not a dotted Python identifier
// is refused (kInvalidArgument naming it).
absl::StatusOr<std::vector<std::string>> ParseModuleList(const std::string& value);

// Whether `name` is a dotted Python identifier ("torch._dynamo").
bool IsModuleName(const std::string& name);

// Where Ballast caches what it learns about a machine's jobs: $BALLAST_CACHE,
// else $XDG_CACHE_HOME/ballast, else $HOME/.cache/ballast ("" when none is set).
std::string BallastCacheDir();

// The file that keeps the module list of the workers of `python` running
// `target` (the script's absolute path, or the module's name for -m):
// <cache_dir>/warm-modules/<hash of both>.txt. "" when cache_dir is "".
std::string ModuleListFile(const std::string& cache_dir, const std::string& python, const std::string& target);

// Reads a file ModuleListFile names. kNotFound when there is none; a file
// written for another python or target (a hash collision) is kNotFound too;
// lines that are not module names (dotted identifiers, '-' allowed as in
// _sysconfigdata__x86_64-linux-gnu) are skipped (it is a hint, edited or not).
absl::StatusOr<std::vector<std::string>> ReadModuleListFile(const std::string& path, const std::string& python,
                                                            const std::string& target);
// Writes it atomically (a temp file in the same directory, then rename), so
// agents of one host that write at once leave one whole list.
absl::Status WriteModuleListFile(const std::string& path, const std::string& python, const std::string& target,
                                 const std::vector<std::string>& modules);

}  // namespace ballast
