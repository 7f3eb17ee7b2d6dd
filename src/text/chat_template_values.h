// Python/Jinja2 value semantics the Gemma 4 chat template relies on, applied to JSON values:
// how `{{ x }}` prints (Python str()), truthiness, `| trim` (str.strip()), `| upper`,
// `| dictsort` (case-insensitive, stable), `==`, and iteration. Internal to the renderer; exposed
// for its unit tests.
//
// A null `const Json*` stands for Jinja's Undefined (a missing key), which prints as "" and is
// falsy, unlike JSON null (Python None), which prints as "None".
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/status.h"

namespace gemma4::text::chat_values {

using Json = nlohmann::ordered_json;

// Jinja getitem on a JSON value: the member `key` of an object, else Undefined (nullptr).
const Json* member(const Json* value, std::string_view key);

bool py_truthy(const Json* value);
// Python str(): strings raw, None, True/False, ints, floats in repr form, lists/dicts as repr.
std::string py_str(const Json* value);
// Python repr() of a float: shortest round-trip digits, e.g. 2.5, 1.0, 1e-05, 1e+16.
std::string py_float_repr(double value);
// Python ==, including int == float and True == 1; Undefined compares like None (the template
// only compares values fetched with dict.get()).
bool py_equal(const Json* a, const Json* b);

// str.strip() with Python's Unicode whitespace set.
std::string_view py_strip(std::string_view text);
// str.upper() / str.lower() for ASCII, Latin-1, Latin Extended-A, Greek and Cyrillic letters
// (other characters unchanged).
std::string py_upper(std::string_view text);
std::string py_lower(std::string_view text);

// `mapping | dictsort`: (key, value) pairs sorted by lower-cased key, stable.
std::vector<std::pair<const std::string*, const Json*>> dictsort(const Json& object);

// `for x in value`: list items, a string's characters, an object's keys; errors for anything
// else (Python: "object is not iterable").
Expected<std::vector<Json>> py_iterate(const Json& value);

}  // namespace gemma4::text::chat_values
