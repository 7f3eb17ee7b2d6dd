# Writes OUTPUT, a C++ file defining gemma4::cli::build_commit(): the commit of SOURCE_DIR
# ("<short hash>", "<short hash>-dirty" when tracked files have uncommitted changes, "unknown"
# outside git). Runs at every build; rewrites OUTPUT only when the value changes, so an unchanged
# tree recompiles and relinks nothing.
find_package(Git QUIET)
set(commit "unknown")
if(GIT_FOUND)
  execute_process(COMMAND ${GIT_EXECUTABLE} -C ${SOURCE_DIR} rev-parse --short HEAD
                  OUTPUT_VARIABLE hash OUTPUT_STRIP_TRAILING_WHITESPACE
                  RESULT_VARIABLE hash_result ERROR_QUIET)
  if(hash_result EQUAL 0 AND hash)
    set(commit "${hash}")
    # Porcelain status of tracked files only: untracked files (build outputs, notes) are not in
    # the binary's sources, and unlike `diff-index` it is not fooled by stale file timestamps.
    # --no-optional-locks: no index refresh written back, so a concurrent git command never
    # meets our lock.
    execute_process(COMMAND ${GIT_EXECUTABLE} --no-optional-locks -C ${SOURCE_DIR} status
                            --porcelain --untracked-files=no
                    OUTPUT_VARIABLE changes RESULT_VARIABLE status_result ERROR_QUIET)
    if(NOT status_result EQUAL 0 OR changes)
      string(APPEND commit "-dirty")
    endif()
  endif()
endif()
string(CONCAT content "namespace gemma4::cli {\n"
       "const char* build_commit() { return \"${commit}\"; }\n"
       "}  // namespace gemma4::cli\n")
set(previous "")
if(EXISTS ${OUTPUT})
  file(READ ${OUTPUT} previous)
endif()
if(NOT previous STREQUAL content)
  file(WRITE ${OUTPUT} "${content}")
endif()
