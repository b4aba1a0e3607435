# cmake -DIN=file -DOUT=file.cc -DNAMESPACE=ns -DFUNC=Name -P EmbedText.cmake
# Writes a .cc defining `std::string_view ns::Name()` that returns the file's
# bytes (a raw string literal in chunks, so no compiler's literal limit is hit).
file(READ "${IN}" content)
string(LENGTH "${content}" len)
set(body "")
set(pos 0)
while(pos LESS len)
  string(SUBSTRING "${content}" ${pos} 8000 chunk)
  string(APPEND body "R\"BALLAST_EMBED(${chunk})BALLAST_EMBED\"\n")
  math(EXPR pos "${pos} + 8000")
endwhile()
file(WRITE "${OUT}.tmp" "// Generated from ${IN} by cmake/EmbedText.cmake: do not edit.\n#include <string_view>\nnamespace ${NAMESPACE} {\nstd::string_view ${FUNC}() {\n  static constexpr char kText[] =\n${body};\n  return {kText, sizeof(kText) - 1};\n}\n}  // namespace ${NAMESPACE}\n")
file(RENAME "${OUT}.tmp" "${OUT}")
