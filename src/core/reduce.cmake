# Reduction kernels and sparse codec of the core; included by
# src/core/CMakeLists.txt:
#
#   include(${CMAKE_CURRENT_SOURCE_DIR}/reduce.cmake)
#   target_sources(<core lib> PRIVATE ${NETDAM_REDUCE_SOURCES})
#   target_link_libraries(<core lib> PUBLIC ${NETDAM_REDUCE_LIBS})
#
# The core library must be created in src/core (source file properties are
# directory-scoped) and must have src/ on its include path: reduce.cc includes
# itself as "core/reduce.cc" once per SIMD target (Highway foreach_target.h).

# Highway (Debian libhwy-dev 1.0.3 ships a CMake config: imported target hwy::hwy).
find_package(hwy 1.0 CONFIG QUIET)
if(NOT TARGET hwy::hwy)
  find_package(PkgConfig REQUIRED)
  pkg_check_modules(NETDAM_HWY REQUIRED IMPORTED_TARGET libhwy)
  add_library(hwy::hwy ALIAS PkgConfig::NETDAM_HWY)
endif()

set(NETDAM_REDUCE_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/reduce.cc
  ${CMAKE_CURRENT_LIST_DIR}/sparse.cc)
set(NETDAM_REDUCE_LIBS hwy::hwy)

# The reduction arithmetic is protocol: IEEE semantics, no FMA contraction,
# no fast-math (reduce.cc refuses to compile with -ffast-math).
set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/reduce.cc PROPERTIES
  COMPILE_OPTIONS "-ffp-contract=off;-fno-fast-math")
