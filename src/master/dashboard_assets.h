// The dashboard page (src/master/dashboard/index.html), compiled into the
// binary so the master serves it with no install tree and no network.
#pragma once

#include <string_view>

namespace ballast::master {

std::string_view DashboardHtml();

}  // namespace ballast::master
