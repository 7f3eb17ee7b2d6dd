#pragma once

namespace gemma4::cli {

// The commit the binary was built from: "<short hash>", "<short hash>-dirty" (tracked files had
// uncommitted changes) or "unknown" (built outside git). Generated at every build by
// cmake/build_commit.cmake, so it names the sources, not the directory the binary runs in.
const char* build_commit();

}  // namespace gemma4::cli
