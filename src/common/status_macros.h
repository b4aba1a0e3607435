// Tiny Status helpers: Debian 12's Abseil has no RETURN_IF_ERROR / ASSIGN_OR_RETURN
// (Ray keeps the same in src/ray/common/status_or.h).
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define BALLAST_CONCAT_INNER_(a, b) a##b
#define BALLAST_CONCAT_(a, b) BALLAST_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define RETURN_IF_ERROR(expr)                       \
  do {                                              \
    ::absl::Status _ballast_st = (expr);            \
    if (!_ballast_st.ok()) return _ballast_st;      \
  } while (0)

// ASSIGN_OR_RETURN(auto x, StatusOrExpr()): assigns the value or returns the error.
#define ASSIGN_OR_RETURN(lhs, expr) \
  ASSIGN_OR_RETURN_IMPL_(BALLAST_CONCAT_(_ballast_sor_, __LINE__), lhs, expr)
#define ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                           \
  if (!tmp.ok()) return tmp.status();          \
  lhs = std::move(*tmp)
