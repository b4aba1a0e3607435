# Small helpers in the spirit of Abseil's CMake/AbseilHelpers.cmake.
#
# ballast_cc_library(NAME foo SRCS a.cc HDRS a.h DEPS ballast::common)
#   -> static library ballast_foo with alias ballast::foo
# ballast_cc_test(NAME foo_test SRCS foo_test.cc DEPS ballast::foo LABELS unit)
#   -> gtest executable registered with CTest under the given labels
# ballast_fuzz_target(NAME foo_fuzz SRCS foo_fuzz.cc DEPS ballast::foo)
#   -> a libFuzzer executable, only with -DBALLAST_FUZZ=ON (clang; `make fuzz`)
include(GoogleTest)

function(ballast_cc_library)
  cmake_parse_arguments(B "" "NAME" "SRCS;HDRS;DEPS" ${ARGN})
  add_library(ballast_${B_NAME} STATIC ${B_SRCS} ${B_HDRS})
  add_library(ballast::${B_NAME} ALIAS ballast_${B_NAME})
  target_include_directories(ballast_${B_NAME} PUBLIC ${PROJECT_SOURCE_DIR}/src ${PROJECT_BINARY_DIR}/gen)
  target_link_libraries(ballast_${B_NAME} PUBLIC ${B_DEPS})
  target_compile_options(ballast_${B_NAME} PRIVATE ${BALLAST_WARNINGS})
  set_target_properties(ballast_${B_NAME} PROPERTIES POSITION_INDEPENDENT_CODE ON)
endfunction()

function(ballast_cc_test)
  cmake_parse_arguments(B "" "NAME;TIMEOUT" "SRCS;DEPS;LABELS" ${ARGN})
  if(NOT BALLAST_TESTS)
    return()
  endif()
  add_executable(${B_NAME} ${B_SRCS})
  target_link_libraries(${B_NAME} PRIVATE ${B_DEPS} GTest::gmock GTest::gtest_main)
  target_compile_options(${B_NAME} PRIVATE ${BALLAST_WARNINGS})
  # Where tests find the binary and the sources (env BALLAST_BIN etc. override).
  # Baked in rather than set through ctest ENVIRONMENT, which gtest_discover_tests
  # would split at the list's semicolons.
  target_compile_definitions(${B_NAME} PRIVATE
    BALLAST_TEST_BIN="${PROJECT_BINARY_DIR}/bin/ballast"
    BALLAST_TEST_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
  if(NOT B_LABELS)
    set(B_LABELS unit)
  endif()
  if(NOT B_TIMEOUT)
    set(B_TIMEOUT 120)
  endif()
  set(serial FALSE)
  if("integration" IN_LIST B_LABELS)
    set(serial TRUE)  # each starts several real training processes
    # One label, not "integration;serial": gtest_discover_tests flattens a list
    # value into the properties. `ctest -L integration` and `-L serial` (what
    # `make test` runs first: scripts/make-test.sh) both match it.
    list(TRANSFORM B_LABELS REPLACE "^integration$" "integration-serial")
  endif()
  list(LENGTH B_LABELS n_labels)
  if(n_labels GREATER 1)
    message(FATAL_ERROR "ballast_cc_test(${B_NAME}): one label only (gtest_discover_tests flattens a list)")
  endif()
  gtest_discover_tests(${B_NAME}
    PROPERTIES LABELS "${B_LABELS}" TIMEOUT ${B_TIMEOUT} RUN_SERIAL ${serial}
    DISCOVERY_TIMEOUT 60)
endfunction()

function(ballast_fuzz_target)
  cmake_parse_arguments(B "" "NAME" "SRCS;DEPS" ${ARGN})
  if(NOT BALLAST_FUZZ)
    return()
  endif()
  add_executable(${B_NAME} ${B_SRCS})
  target_compile_options(${B_NAME} PRIVATE -fsanitize=fuzzer ${BALLAST_WARNINGS})
  target_link_options(${B_NAME} PRIVATE -fsanitize=fuzzer)
  target_link_libraries(${B_NAME} PRIVATE ${B_DEPS})
  set_property(GLOBAL APPEND PROPERTY BALLAST_FUZZ_TARGETS ${B_NAME})
endfunction()
