# `cmake --install`: the public headers (include/netdam/ only), the static
# libraries behind them, the executables, a CMake package (netdamConfig.cmake,
# targets netdam::client, ...) and netdam.pc; docs/INSTALL.md.
#
# The private headers under src/ stay behind: every exported library has
# src/ as a PRIVATE include directory, and include/ as a BUILD_INTERFACE one,
# which the installed targets replace by the install's include directory
# (INCLUDES DESTINATION below). The public headers include only the standard
# library, so a consumer needs nothing else to compile; to link the static
# archives it needs fmt and Highway, found by netdamConfig.cmake
# (find_dependency) or named in netdam.pc (Requires).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# What include/netdam/ needs, in link order (each archive before those it
# uses): dataset.h, pool.h, group.h, client.h, local_memory.h and the
# vocabulary headers, then the internal layers under them.
set(netdam_exported
  dataset pool pool_core collectives client transport core common)
set(netdam_exported_targets)
foreach(name ${netdam_exported})
  set_target_properties(netdam_${name} PROPERTIES EXPORT_NAME ${name})
  # The same names inside the build tree, so in-tree and installed
  # consumers can be written alike.
  add_library(netdam::${name} ALIAS netdam_${name})
  list(APPEND netdam_exported_targets netdam_${name})
endforeach()

# netdam::netdam: all of the public API in one name, as netdam.pc gives it.
add_library(netdam_all INTERFACE)
set_target_properties(netdam_all PROPERTIES EXPORT_NAME netdam)
target_link_libraries(netdam_all INTERFACE ${netdam_exported_targets})
add_library(netdam::netdam ALIAS netdam_all)

install(TARGETS ${netdam_exported_targets} netdam_all
  EXPORT netdamTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})

# An explicit list: a header added to include/netdam/ is public only once
# it is named here.
install(FILES
  include/netdam/client.h
  include/netdam/dataset.h
  include/netdam/error.h
  include/netdam/group.h
  include/netdam/local_memory.h
  include/netdam/optimizer.h
  include/netdam/pool.h
  include/netdam/types.h
  ${PROJECT_BINARY_DIR}/include/netdam/version.h
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/netdam)
install(FILES LICENSE DESTINATION ${CMAKE_INSTALL_DOCDIR})

set(netdam_executables netdamd netdam netdam-mmu)
if(TARGET netdam-bench)
  list(APPEND netdam_executables netdam-bench)
endif()
install(TARGETS ${netdam_executables} RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})

set(netdam_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/netdam)
install(EXPORT netdamTargets NAMESPACE netdam:: DESTINATION ${netdam_cmake_dir})
configure_package_config_file(cmake/netdamConfig.cmake.in
  ${PROJECT_BINARY_DIR}/netdamConfig.cmake
  INSTALL_DESTINATION ${netdam_cmake_dir})
# 0.x: a minor version may change the API.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/netdamConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/netdamConfig.cmake ${PROJECT_BINARY_DIR}/netdamConfigVersion.cmake
  DESTINATION ${netdam_cmake_dir})

# netdam.pc finds the prefix from its own place (${pcfiledir}), so the
# package stays correct under `cmake --install --prefix` and DESTDIR.
set(netdam_pc_dir ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
if(IS_ABSOLUTE ${CMAKE_INSTALL_LIBDIR} OR IS_ABSOLUTE ${CMAKE_INSTALL_INCLUDEDIR})
  message(FATAL_ERROR "netdam.pc needs CMAKE_INSTALL_LIBDIR and CMAKE_INSTALL_INCLUDEDIR relative to the prefix")
endif()
file(RELATIVE_PATH netdam_pc_to_prefix /prefix/${netdam_pc_dir} /prefix)
string(REGEX REPLACE "/$" "" netdam_pc_to_prefix "${netdam_pc_to_prefix}")
list(TRANSFORM netdam_exported PREPEND "-lnetdam_" OUTPUT_VARIABLE netdam_pc_libs)
list(JOIN netdam_pc_libs " " netdam_pc_libs)
configure_file(cmake/netdam.pc.in ${PROJECT_BINARY_DIR}/netdam.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/netdam.pc DESTINATION ${netdam_pc_dir})
