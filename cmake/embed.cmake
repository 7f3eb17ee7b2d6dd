# Turns INPUT (a text file) into OUTPUT, a C++ file defining gemma4::server::web_ui_html().
file(READ ${INPUT} content HEX)
string(LENGTH "${content}" hex_len)
math(EXPR size "${hex_len} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," bytes "${content}")
file(WRITE ${OUTPUT} "#include <string_view>\nnamespace gemma4::server {\nstatic const unsigned char kWebUi[] = {${bytes}0};\nstd::string_view web_ui_html() { return {reinterpret_cast<const char*>(kWebUi), ${size}}; }\n}  // namespace gemma4::server\n")
