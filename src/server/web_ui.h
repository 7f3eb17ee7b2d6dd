// The web UI page (web/index.html), embedded into the binary at build time by cmake/embed.cmake
// into the gemma4_web_ui library.
#pragma once

#include <string_view>

namespace gemma4::server {

std::string_view web_ui_html();

}  // namespace gemma4::server
